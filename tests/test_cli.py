"""The `loraserve` command as a user runs it: a store process, adapters registered from disk and
S3 with the CLI, tp=2 shards fetched; and `loraserve up` on the embedded default."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from safetensors import safe_open

LORASERVE = str(Path(sys.executable).parent / "loraserve")
REPO = Path(__file__).resolve().parent.parent


def cli(*args, check=True, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([LORASERVE, "--log-level", "WARNING", *args], capture_output=True, text=True, timeout=300, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"loraserve {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


# -- every flag reads its environment variable, and --help names it ---------------------------
def _leaf_commands(parser, path=(), parents=()):
    """(command words, the parsers along them) of every runnable command."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, (*parents, parser)
        return
    for name, sub in subs[0].choices.items():
        yield from _leaf_commands(sub, (*path, name), (*parents, parser))


def _sample_value(action) -> tuple[str, object]:
    """A value for the flag's variable and what the flag must parse it to."""
    import argparse

    convert = action.type or str
    if action.const is True:
        return "true", True
    if isinstance(action, argparse._AppendAction):
        return f"a{os.pathsep}b", [convert("a"), convert("b")]
    if action.choices:
        choice = list(action.choices)[-1]
        return str(choice), choice
    text = {int: "7", float: "2.5"}.get(convert, "/some/where")
    return text, convert(text)


def test_every_flag_reads_its_environment_variable_and_help_names_it(monkeypatch):
    import argparse

    from loraserve.cli import build_parser, env_var

    for name in [n for n in os.environ if n.startswith("LORASERVE_")]:
        monkeypatch.delenv(name)
    commands = list(_leaf_commands(build_parser()))
    assert {" ".join(path) for path, _ in commands} >= {"up", "store", "executor", "adapters fetch", "generate", "load"}
    checked = 0
    for path, parsers in commands:
        flags = [a for p in parsers for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        values = {env_var(a): _sample_value(a) for a in flags}
        for name, (text, _) in values.items():
            monkeypatch.setenv(name, text)
        parser = build_parser()  # reads the environment
        fresh = dict(_leaf_commands(parser))[path]
        args = parser.parse_args([*path, *["x"] * sum(not a.option_strings for a in fresh[-1]._actions)])
        helps = " ".join("".join(p.format_help() for p in fresh).split())
        for a in flags:
            assert getattr(args, a.dest) == values[env_var(a)][1], (path, a.option_strings, env_var(a))
            assert f"[env {env_var(a)}]" in helps, (path, a.option_strings)
            checked += 1
        for name in values:
            monkeypatch.delenv(name)
    assert checked > 100
    # The two --token flags read the admin tokens' variables, and a flag given on the command line wins.
    monkeypatch.setenv("LORASERVE_ADMIN_TOKEN", "store-secret")
    monkeypatch.setenv("LORASERVE_EXECUTOR_ADMIN_TOKEN", "executor-secret")
    monkeypatch.setenv("LORASERVE_TP_SIZE", "3")
    assert build_parser().parse_args(["adapters", "list"]).token == "store-secret"
    assert build_parser().parse_args(["loaded"]).token == "executor-secret"
    assert build_parser().parse_args(["adapters", "fetch", "a", "--tp-size", "2"]).tp_size == 2
    monkeypatch.setenv("LORASERVE_TP_SIZE", "two")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["adapters", "fetch", "a"])
    assert build_parser().parse_args(["adapters", "list"]).token == "store-secret"  # other commands unaffected


def test_prefix_caching_is_on_unless_no_prefix_caching_is_given(monkeypatch):
    from loraserve.cli import build_parser
    from loraserve.executor.cli import executor_config

    monkeypatch.delenv("LORASERVE_NO_PREFIX_CACHING", raising=False)
    parser = build_parser()
    for command in ("executor", "up"):
        assert executor_config(parser.parse_args([command, "--device", "cpu"])).prefix_caching
        assert not executor_config(parser.parse_args([command, "--device", "cpu", "--no-prefix-caching"])).prefix_caching


def test_kv_cache_dtype_is_auto_unless_fp8_is_given(monkeypatch):
    """--kv-cache-dtype fp8 (or LORASERVE_KV_CACHE_DTYPE) for `executor` and `up`: the cache's dtype."""
    import torch

    from loraserve.cli import build_parser
    from loraserve.executor.cli import executor_config

    monkeypatch.delenv("LORASERVE_KV_CACHE_DTYPE", raising=False)
    for command in ("executor", "up"):
        auto = executor_config(build_parser().parse_args([command, "--device", "cpu"]))
        assert (auto.kv_cache_dtype, auto.torch_kv_dtype) == ("auto", torch.float32)
        fp8 = executor_config(build_parser().parse_args([command, "--device", "cpu", "--kv-cache-dtype", "fp8"]))
        assert (fp8.kv_cache_dtype, fp8.torch_kv_dtype) == ("fp8", torch.float8_e4m3fn)
    monkeypatch.setenv("LORASERVE_KV_CACHE_DTYPE", "fp8")
    assert executor_config(build_parser().parse_args(["executor", "--device", "cpu"])).kv_cache_dtype == "fp8"


def test_dora_is_off_unless_enable_dora_is_given(monkeypatch):
    """--enable-dora (or LORASERVE_ENABLE_DORA) turns DoRA serving on: the config's enable_dora and
    the slots' LoraSpec.dora."""
    from loraserve.cli import build_parser
    from loraserve.executor.build import lora_spec
    from loraserve.executor.cli import executor_config

    monkeypatch.delenv("LORASERVE_ENABLE_DORA", raising=False)
    for command in ("executor", "up"):
        off = executor_config(build_parser().parse_args([command, "--device", "cpu"]))
        assert not off.enable_dora and not lora_spec(off).dora
        on = executor_config(build_parser().parse_args([command, "--device", "cpu", "--enable-dora"]))
        assert on.enable_dora and lora_spec(on).dora
    monkeypatch.setenv("LORASERVE_ENABLE_DORA", "true")
    assert executor_config(build_parser().parse_args(["executor", "--device", "cpu"])).enable_dora


def test_lora_slots_are_in_dtype_unless_lora_dtype_fp8_is_given(monkeypatch, capsys):
    """--lora-dtype fp8 (or LORASERVE_LORA_DTYPE) puts the dense layers' slots in FP8: the config's
    lora_dtype and the slots' LoraSpec.fp8; another value is refused by the parser, naming the choices."""
    from loraserve.cli import build_parser
    from loraserve.executor.build import lora_spec
    from loraserve.executor.cli import executor_config

    monkeypatch.delenv("LORASERVE_LORA_DTYPE", raising=False)
    for command in ("executor", "up"):
        off = executor_config(build_parser().parse_args([command, "--device", "cpu"]))
        assert off.lora_dtype == "auto" and not lora_spec(off).fp8
        on = executor_config(build_parser().parse_args([command, "--device", "cpu", "--lora-dtype", "fp8"]))
        assert on.lora_dtype == "fp8" and lora_spec(on).fp8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["executor", "--lora-dtype", "int8"])
    assert "argument --lora-dtype: invalid choice: 'int8'" in capsys.readouterr().err
    monkeypatch.setenv("LORASERVE_LORA_DTYPE", "fp8")
    assert executor_config(build_parser().parse_args(["executor", "--device", "cpu"])).lora_dtype == "fp8"


def test_trainable_tokens_are_off_unless_enable_trainable_tokens_is_given(monkeypatch):
    """--enable-trainable-tokens (or LORASERVE_ENABLE_TRAINABLE_TOKENS) turns trainable-token serving
    on: the config's enable_trainable_tokens and the slots' LoraSpec.trainable_tokens."""
    from loraserve.cli import build_parser
    from loraserve.executor.build import lora_spec
    from loraserve.executor.cli import executor_config

    monkeypatch.delenv("LORASERVE_ENABLE_TRAINABLE_TOKENS", raising=False)
    for command in ("executor", "up"):
        off = executor_config(build_parser().parse_args([command, "--device", "cpu"]))
        assert not off.enable_trainable_tokens and not lora_spec(off).trainable_tokens
        on = executor_config(build_parser().parse_args([command, "--device", "cpu", "--enable-trainable-tokens"]))
        assert on.enable_trainable_tokens and lora_spec(on).trainable_tokens and not lora_spec(on).dora
    monkeypatch.setenv("LORASERVE_ENABLE_TRAINABLE_TOKENS", "true")
    assert executor_config(build_parser().parse_args(["executor", "--device", "cpu"])).enable_trainable_tokens


def test_metrics_are_on_by_default_at_the_charts_ports_in_every_serving_command(monkeypatch):
    """One default for store, executor and up: /metrics on, at the Helm chart's ports (store 9091,
    executor 9090), on the service's host; 0 turns it off."""
    import yaml

    from loraserve.cli import build_parser, metrics_listen

    for name in ("LORASERVE_METRICS_PORT", "LORASERVE_EXECUTOR_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    chart = yaml.safe_load((REPO / "deploy" / "helm" / "loraserve" / "values.yaml").read_text())["metrics"]
    assert (chart["storePort"], chart["executorPort"]) == (9091, 9090)
    parser = build_parser()
    store, executor, up = (parser.parse_args([command]) for command in ("store", "executor", "up"))
    assert store.metrics_port == up.metrics_port == chart["storePort"]
    assert executor.executor_metrics_port == up.executor_metrics_port == chart["executorPort"]
    assert metrics_listen(up.listen, up.metrics_port) == "127.0.0.1:9091"
    assert metrics_listen(up.executor_listen, up.executor_metrics_port) == "127.0.0.1:9090"
    off = parser.parse_args(["up", "--metrics-port", "0", "--executor-metrics-port", "0"])
    assert metrics_listen(off.listen, off.metrics_port) == metrics_listen(off.executor_listen, off.executor_metrics_port) == ""


def test_a_busy_default_metrics_port_turns_metrics_off_a_busy_given_one_fails(caplog):
    """A second service on one host finds the default /metrics port taken: it starts without
    /metrics and says so; a port given by flag or variable that is taken fails the start."""
    import socket

    from loraserve.cli import DefaultPort, check_metrics_listen, metrics_listen
    from loraserve.serving import ListenError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        with caplog.at_level("WARNING", logger="loraserve.cli"):
            assert metrics_listen("127.0.0.1:50061", DefaultPort(taken)) == ""
        assert f"/metrics off: could not listen on 127.0.0.1:{taken}: address in use" in caplog.text
        given = metrics_listen("127.0.0.1:50061", taken)
        assert given == f"127.0.0.1:{taken}"
        with pytest.raises(ListenError, match=r"address in use \(/metrics, --metrics-port: give another port, or 0 for none\)"):
            check_metrics_listen(given, "--metrics-port")


def test_a_negative_max_streams_is_refused_with_its_value(tmp_path):
    bad = cli("store", "--max-streams", "-1", "--data-dir", str(tmp_path / "store"), check=False)
    assert bad.returncode == 1 and "error: --max-streams must be 0 (no cap) or more, got -1" in bad.stderr
    assert not (tmp_path / "store").exists()  # refused before anything was made


@pytest.fixture
def store_process(tmp_path, tiny_llama_dir, s3_server, free_port):
    root = tmp_path / "adapters"
    root.mkdir()
    port = free_port()
    proc = subprocess.Popen(
        [
            LORASERVE,
            "store",
            "--listen",
            f"127.0.0.1:{port}",
            "--data-dir",
            str(tmp_path / "data"),
            "--base-model",
            "tiny",
            "--base-model-path",
            str(tiny_llama_dir),
            "--allow-local-root",
            str(root),
            "--s3-endpoint-url",
            s3_server,
            "--s3-region",
            "us-east-1",
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    address = f"127.0.0.1:{port}"
    for _ in range(200):
        if cli("adapters", "--store", address, "list", check=False).returncode == 0:
            break
        time.sleep(0.1)
    yield address, root
    proc.terminate()
    proc.wait(10)


def test_register_from_disk_and_s3_then_fetch_tp2_shards(
    store_process, peft_adapter, s3_server, tiny_llama_dir, tiny_llama_model, tmp_path
):
    from .adapter_store.test_trainable_tokens import make as make_with_tokens

    address, root = store_process
    src = peft_adapter(r=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    shutil.copytree(src, root / "mine")
    out = cli("adapters", "--store", address, "register", "from-disk", str(root / "mine")).stdout
    assert '"digest"' in out and '"rank": 8' in out

    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket="cli-bucket")
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(src / f), "cli-bucket", f"loras/mine/{f}")
    cli("adapters", "--store", address, "register", "from-s3", "s3://cli-bucket/loras/mine")
    make_with_tokens(tiny_llama_model, root / "tokens")
    cli("adapters", "--store", address, "register", "with-tokens", str(root / "tokens"))
    lines = [line for line in cli("adapters", "--store", address, "list").stdout.splitlines() if line.strip()]
    assert {line.split()[0]: line.split()[1] for line in lines} == {
        "from-disk": "lora",
        "from-s3": "lora",
        "with-tokens": "lora+tokens",
    }
    # name, kind, "rank", rank, size, "MiB", digest, uri: each word but the right-aligned numbers starts
    # where it does on the other lines
    starts = [[m.start() for m in re.finditer(r"\S+", line)] for line in lines]
    assert len({(s[1], s[2], s[5], s[6], s[7]) for s in starts}) == 1, lines

    out = cli(
        "adapters",
        "--store",
        address,
        "fetch",
        "from-s3",
        "--model",
        str(tiny_llama_dir),
        "--tp-size",
        "2",
        "--dtype",
        "float32",
        "--out",
        str(tmp_path / "shards"),
    ).stdout
    assert out.count("checksum ok") == 2
    shapes = []
    for rank in range(2):
        with safe_open(tmp_path / "shards" / f"from-s3.tp{rank}-of-2.safetensors", "pt") as f:
            assert f.metadata()["tp_rank"] == str(rank)
            shapes.append(f.get_tensor("model.layers.0.mlp.gate_up_proj.lora_b").shape)
    assert shapes == [(2 * 64, 8), (2 * 64, 8)]  # gate and up (128 each) cut in half on each rank

    cli("adapters", "--store", address, "delete", "from-disk")
    bad = cli("adapters", "--store", address, "register", "x", "ftp://nowhere/adapter", check=False)
    assert bad.returncode == 1 and "error: INVALID_ARGUMENT: unsupported adapter URI scheme 'ftp'" in bad.stderr
    missing = cli("adapters", "--store", address, "show", "from-disk", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def _readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def test_up_prints_one_mixed_batch_and_the_readme_examples_run_against_it(tmp_path, free_port):
    """`loraserve up` as `make up` starts it (from the repository root, default allowed roots),
    then the README's store examples as written: only the addresses (to free ports, through
    LORASERVE_STORE / LORASERVE_EXECUTOR; /metrics too) and the placeholder adapter path differ."""
    demo = REPO / "deploy" / "demo-adapters"
    names = sorted(p.name for p in demo.iterdir() if (p / "adapter_config.json").is_file()) if demo.is_dir() else []
    if not names:
        pytest.skip("deploy/demo-adapters holds no adapters yet")
    store, executor, http_port = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", free_port()
    store_metrics, executor_metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [
            LORASERVE,
            "--log-level",
            "WARNING",
            "up",
            "--data-dir",
            str(tmp_path / "data"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--listen",
            store,
            "--executor-listen",
            executor,
            "--http-port",
            str(http_port),
            "--metrics-port",
            str(store_metrics),
            "--executor-metrics-port",
            str(executor_metrics),
            "--max-num-seqs",
            "32",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "-d '{" in line:  # the last line of the banner: the curl example
                break
        out = "".join(lines)
        assert f"over {len(names) + 1} adapters" in out, out
        for name in names:
            assert f"registered demo adapter {name}" in out and f"[{name}" in out
        assert "[base model" in out and "loraserve is up" in out
        assert f"curl -s http://127.0.0.1:{http_port}/v1/chat/completions" in out and f'"model": "{names[0]}"' in out

        # README "From Python": registers ./deploy/demo-adapters/pirate (a path under the current directory).
        (python_example,) = [b for b in _readme_blocks("python") if "StoreClient(" in b]
        python_example = python_example.replace("127.0.0.1:50061", store).replace("127.0.0.1:50051", executor)
        run = subprocess.run([sys.executable, "-c", python_example], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip(), run.stderr

        # README "Adapters in the store": the commands on local folders, in order.
        (block,) = [b for b in _readme_blocks("bash") if "loraserve adapters register my-lora ./" in b]
        commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith("loraserve adapters")]
        commands = [
            c.replace("./path/to/peft-adapter", "./deploy/demo-adapters/french").replace("shards/", str(tmp_path / "shards"))
            for c in commands
            if "s3://" not in c and "hf://" not in c
        ]
        assert [c.split()[2] for c in commands] == ["register", "list", "show", "delete", "prefetch", "fetch"]
        commands.append(commands.pop(3))  # delete last, so that prefetch and fetch find my-lora
        env = {**os.environ, "LORASERVE_STORE": store, "LORASERVE_EXECUTOR": executor}
        for command in commands:
            run = subprocess.run(
                [LORASERVE, *shlex.split(command)[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
            )
            assert run.returncode == 0, (command, run.stderr)
        assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [f"my-lora.tp{r}-of-3.safetensors" for r in range(3)]
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_negative_max_stream_wait_is_refused_with_its_value(tmp_path):
    bad = cli("store", "--max-stream-wait-s", "-0.5", "--data-dir", str(tmp_path / "store"), check=False)
    assert bad.returncode == 1 and "error: --max-stream-wait-s must be 0 or more seconds, got -0.5" in bad.stderr
    assert not (tmp_path / "store").exists()


def test_dora_with_fully_sharded_loras_under_tp_is_refused_at_start(free_port, tmp_path):
    """DoRA's norm needs each rank's whole LoRA rank, which --fully-sharded-loras cuts under
    --tp-size > 1: the config refuses the three together (each pair alone is accepted), and the
    executor command exits 1 naming them."""
    from loraserve.executor.config import ExecutorConfig

    message = "--enable-dora is not served with --fully-sharded-loras under --tp-size > 1"
    with pytest.raises(ValueError, match=message):
        ExecutorConfig(tp_size=2, fully_sharded_loras=True, enable_dora=True)
    ExecutorConfig(tp_size=2, fully_sharded_loras=True)
    ExecutorConfig(tp_size=2, enable_dora=True)
    ExecutorConfig(tp_size=1, fully_sharded_loras=True, enable_dora=True)  # one rank holds the whole rank dim
    # a model path that is not there: an executor that got past the flags would fail on it instead
    args = ("--device", "cpu", "--model", str(tmp_path / "no-model"), "--executor-listen", f"127.0.0.1:{free_port()}")
    bad = cli(
        "executor", *args, "--executor-metrics-port", "0", "--tp-size", "2", "--fully-sharded-loras", "--enable-dora", check=False
    )
    assert bad.returncode == 1 and f"error: {message}" in bad.stderr, bad.stderr


@pytest.mark.parametrize("embeddings", [False, True])
def test_prefetch_flags_describe_the_layout_the_executor_of_the_same_flags_declares(tiny_llama_dir, embeddings):
    """`adapters prefetch|fetch` pack for the layout an executor started with the same --model,
    --base-model, --tp-size, --max-rank (its --max-lora-rank), --dtype and --lora-embeddings declares:
    the same packing hash, so the shards it warms are the ones that executor fetches."""
    from loraserve.adapter_store.pack import packing_hash
    from loraserve.cli import _layout, build_parser
    from loraserve.executor.build import lora_spec
    from loraserve.executor.layout import declare_layout, model_config

    flags = ["--model", str(tiny_llama_dir), "--base-model", "tiny-llama", "--tp-size", "2", "--dtype", "bfloat16"]
    flags += ["--lora-embeddings"] if embeddings else []
    parser = build_parser()
    cfg = executor_config_of(parser, ["executor", *flags, "--max-lora-rank", "32"])
    declared = declare_layout(model_config(tiny_llama_dir), lora_spec(cfg), cfg.base_model, cfg.tp_size, cfg.ep_size)
    described = _layout(parser.parse_args(["adapters", "prefetch", "my-lora", *flags, "--max-rank", "32"]))
    assert described.base_model == "tiny-llama" and described.max_rank == 32
    assert ("model.embed_tokens" in {m.name for m in described.modules}) is embeddings
    assert packing_hash(described) == packing_hash(declared)


def executor_config_of(parser, argv: list[str]):
    from loraserve.executor.cli import executor_config

    return executor_config(parser.parse_args(argv))
