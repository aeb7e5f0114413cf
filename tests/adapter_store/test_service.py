"""The adapter store through real gRPC on loopback: register from disk, S3 (moto's HTTP server)
and a local HF cache; fetch shards; every validation failure returns its status and message
and leaves nothing behind; Redis down; a corrupted cache file is rebuilt."""

from __future__ import annotations

import json
import logging
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import boto3
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from loraserve.adapter_store import pack, validate
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import serve
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import StoreClient
from loraserve.errors import StatusError
from loraserve.v1 import common_pb2 as pb

H, V = 64, 128


class StoreThread:
    """A real store server on a free loopback port, on the test's event loop thread."""

    def __init__(self, cfg: StoreConfig, loop_thread):
        self.lt = loop_thread
        self.server, port = loop_thread.run(serve(cfg), 30)
        self.address = f"127.0.0.1:{port}"
        self.cfg = cfg
        self.stopped = False

    def client(self, token: str | None = None) -> StoreClient:
        return StoreClient(self.address, token=token, timeout_s=60)

    def stop(self):
        if not self.stopped:
            self.stopped = True
            self.lt.run(self.server.stop(0), 10)


@pytest.fixture
def make_store(tmp_path, tiny_llama_dir, loop_thread):
    started = []
    adapters_root = tmp_path / "adapters"
    adapters_root.mkdir()

    def start(**overrides) -> StoreThread:
        sources = overrides.pop("sources", SourceConfig(local_roots=(adapters_root.resolve(),)))
        cfg = StoreConfig(
            listen="127.0.0.1:0",
            data_dir=tmp_path / "store",
            base_model="tiny-llama",
            base_model_path=tiny_llama_dir,
            sources=sources,
            limits=validate.Limits(max_rank=32, max_adapter_bytes=4 << 20),
        )
        cfg = replace(cfg, **overrides)
        store = StoreThread(cfg, loop_thread)
        started.append(store)
        return store

    start.adapters_root = adapters_root
    yield start
    for s in started:
        s.stop()


def place(adapter_dir: Path, root: Path, name: str) -> Path:
    """Copies a PEFT adapter into the store's allowed local root."""
    target = root / name
    shutil.copytree(adapter_dir, target)
    return target


def qkv_layout(tp: int, base_model: str = "tiny-llama", max_rank: int = 32) -> pb.Layout:
    lay = pb.Layout(tp_size=tp, dtype="float32", max_rank=max_rank, base_model=base_model)
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        lay.modules.add(
            name=f"{p}.qkv_proj",
            kind=pb.QKV,
            input_size=H,
            output_sizes=[64, 32, 32],
            head_size=16,
            peft_modules=[f"{p}.{x}_proj" for x in "qkv"],
        )
        lay.modules.add(name=f"{p}.o_proj", kind=pb.ROW, input_size=64, output_sizes=[H], peft_modules=[f"{p}.o_proj"])
    return lay


def same_shard(blob1: bytes, blob2: bytes) -> bool:
    """Equal tensors (safetensors writes its metadata map in no fixed order, so bytes may differ)."""
    t1, t2 = st_load(blob1), st_load(blob2)
    return t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)


def assert_nothing_kept(store: StoreThread):
    data = store.cfg.data_dir
    assert store.client().list() == []
    assert list((data / "adapters").iterdir()) == []
    assert list((data / "staging").iterdir()) == []
    assert list(p for p in (data / "cache").rglob("*.shard")) == []


# -- the happy paths ----------------------------------------------------------------------
def test_register_list_fetch_delete_from_local_disk(make_store, peft_adapter):
    store = make_store()
    client = store.client()
    src = place(peft_adapter(r=8, target_modules=("q_proj", "v_proj", "o_proj")), make_store.adapters_root, "a1")
    m = client.register("a1", str(src))
    assert m.rank == 8 and len(m.digest) == 64 and m.uri == f"file://{src.resolve()}"
    assert "model.layers.0.self_attn.q_proj" in m.target_modules and m.num_parameters > 0
    assert client.get("a1").digest == m.digest

    layout = qkv_layout(2)
    blobs = []
    for tp_rank in range(2):
        header, blob = client.fetch_shard("a1", layout, tp_rank=tp_rank)
        assert header.cache_tier == "packed" and header.total_bytes == len(blob)
        blobs.append(st_load(blob))
    # Rank 1 holds the second half of q's B rows and kv head 1.
    expected = pack.shard(
        pack.pack_full(pack.load_adapter(src, None, validate.Limits()), layout), layout, pb.ShardRank(tp_rank=1)
    )
    for name, t in expected.items():
        assert torch.equal(blobs[1][name], t), name
    header, _ = client.fetch_shard("a1", layout, tp_rank=1)
    assert header.cache_tier == "disk"

    assert client.delete("a1")
    with pytest.raises(StatusError) as e:
        client.get("a1")
    assert e.value.code.name == "NOT_FOUND" and "'a1' is not registered" in e.value.message
    assert list((store.cfg.data_dir / "cache").rglob("*.shard")) == []


@pytest.mark.parametrize(
    "which, targets",
    [
        ("alone", ["model.embed_tokens"]),
        ("alone_with_lm_head", ["lm_head", "model.embed_tokens"]),
        ("beside_lora", ["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]),
    ],
)
def test_a_manifest_lists_the_modules_whose_trainable_tokens_it_holds(make_store, tiny_llama_model, tmp_path, which, targets):
    from .test_trainable_tokens import make, make_alone

    if which == "beside_lora":
        directory, kind = make(tiny_llama_model, tmp_path / which), "lora+tokens"
    else:
        extra = {"target_modules": ["embed_tokens", "lm_head"]} if which == "alone_with_lm_head" else {}
        directory, kind = make_alone(tiny_llama_model, tmp_path / which, **extra), "tokens"
    store = make_store()
    client = store.client()
    m = client.register("t", str(place(directory, make_store.adapters_root, "t")))
    assert (m.kind, list(m.target_modules)) == (kind, targets)
    assert list(client.get("t").target_modules) == targets
    assert [list(x.target_modules) for x in client.list()] == [targets]


def test_list_pages_through_all_adapters(make_store, peft_adapter):
    store = make_store()
    client = store.client()
    src = place(peft_adapter(r=4), make_store.adapters_root, "x")
    for name in ("c", "a", "b"):
        client.register(name, f"file://{src}")
    assert [m.name for m in client.list(page_size=2)] == ["a", "b", "c"]
    with pytest.raises(StatusError) as e:
        client.list(page_size=5000)
    assert e.value.code.name == "INVALID_ARGUMENT" and "page_size" in e.value.message


def test_register_from_s3_through_moto_http_server(make_store, peft_adapter, s3_server):
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket="adapters")
    src = peft_adapter(r=16, target_modules=("q_proj", "k_proj", "v_proj"), use_rslora=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(src / f), "adapters", f"team/rs16/{f}")
    store = make_store(
        sources=SourceConfig(local_roots=(make_store.adapters_root,), s3_endpoint_url=s3_server, s3_region="us-east-1")
    )
    m = store.client().register("rs16", "s3://adapters/team/rs16")
    assert m.rank == 16 and m.use_rslora and m.revision  # the weights' ETag
    header, blob = store.client().fetch_shard("rs16", qkv_layout(2), tp_rank=0)
    assert header.manifest.digest == m.digest and len(blob) == header.total_bytes
    with pytest.raises(StatusError) as e:
        store.client().register("missing", "s3://adapters/team/nothing-here")
    assert e.value.code.name == "NOT_FOUND" and "adapters" in e.value.message


def test_register_from_local_hf_cache_offline(make_store, peft_adapter, tmp_path):
    src = peft_adapter(r=4, target_modules=("q_proj",))
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-cache" / "models--acme--tiny-lora"
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(src / f, snap / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    store = make_store(
        sources=SourceConfig(local_roots=(make_store.adapters_root,), hf_cache_dir=tmp_path / "hf-cache", hf_offline=True)
    )
    m = store.client().register("hf1", "hf://acme/tiny-lora")
    assert m.revision == sha and m.rank == 4
    with pytest.raises(StatusError) as e:
        store.client().register("hf2", "hf://acme/not-cached")
    assert e.value.code.name == "NOT_FOUND"


# -- hostile and broken adapters: status, message, nothing kept ------------------------------
def _edit_config(d: Path, **changes):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _rewrite_header(d: Path, edit):
    path = d / "adapter_model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _set_tensor(d: Path, edit):
    tensors = st_load((d / "adapter_model.safetensors").read_bytes())
    edit(tensors)
    save_file(tensors, d / "adapter_model.safetensors")


def _first(tensors, part="lora_A"):
    return next(k for k in sorted(tensors) if part in k)


CASES = {
    "not_lora": (lambda d: _edit_config(d, peft_type="PREFIX_TUNING"), "INVALID_ARGUMENT", "only 'LORA'"),
    "dora_without_magnitudes": (
        lambda d: _edit_config(d, use_dora=True),
        "INVALID_ARGUMENT",
        "DoRA adapter (use_dora: true): module 'model.layers.0.self_attn.",
    ),
    "trainable_tokens": (
        lambda d: _edit_config(d, trainable_token_indices={"embed_tokens": [3, 4]}),
        "INVALID_ARGUMENT",
        "trainable_token_indices is set but the weights hold no trainable_tokens_delta",
    ),
    "modules_to_save": (lambda d: _edit_config(d, modules_to_save=["score"]), "INVALID_ARGUMENT", "modules_to_save"),
    "bias": (lambda d: _edit_config(d, bias="all"), "INVALID_ARGUMENT", "bias 'all'"),
    "bad_r": (lambda d: _edit_config(d, r=0), "INVALID_ARGUMENT", "r must be a positive integer"),
    "bad_alpha": (lambda d: _edit_config(d, lora_alpha="x"), "INVALID_ARGUMENT", "lora_alpha"),
    "other_base": (
        lambda d: _edit_config(d, base_model_name_or_path="meta-llama/Llama-3-8B"),
        "FAILED_PRECONDITION",
        "made for base model 'meta-llama/Llama-3-8B'",
    ),
    "rank_too_big": (lambda d: _edit_config(d, rank_pattern={"q_proj": 64}), "FAILED_PRECONDITION", "maximum rank 32"),
    "r_too_big_before_the_weights_are_read": (  # the weights are garbage: r alone refuses it first
        lambda d: (
            _edit_config(d, r=64),
            (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!"),
        ),
        "FAILED_PRECONDITION",
        "adapter rank 64 is above this store's maximum rank 32",
    ),
    "config_not_json": (lambda d: (d / "adapter_config.json").write_text("{nope"), "INVALID_ARGUMENT", "not valid JSON"),
    "no_weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "NOT_FOUND", "adapter_model.safetensors"),
    "no_config": (
        lambda d: (d / "adapter_config.json").unlink(),
        "INVALID_ARGUMENT",
        "has adapter_model.safetensors but no adapter_config.json: not a valid PEFT adapter without it",
    ),
    "fp64_beyond_fp32": (
        lambda d: _set_tensor(d, lambda t: t.update({k: v.double() * (1e300 if k == _first(t) else 1) for k, v in t.items()})),
        "INVALID_ARGUMENT",
        "holds float64 values beyond float32's range",
    ),
    "pickled": (lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"), "INVALID_ARGUMENT", "pickled"),
    "header_garbage": (
        lambda d: (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!"),
        "INVALID_ARGUMENT",
        "header is not valid JSON",
    ),
    "header_too_long": (
        lambda d: (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}"),
        "INVALID_ARGUMENT",
        "header length",
    ),
    "offsets_outside": (
        lambda d: _rewrite_header(d, lambda h: h[_first(h)].update(data_offsets=[0, 1 << 30])),
        "INVALID_ARGUMENT",
        "outside the file",
    ),
    "bad_dtype": (lambda d: _rewrite_header(d, lambda h: h[_first(h)].update(dtype="I64")), "INVALID_ARGUMENT", "dtype 'I64'"),
    "unknown_module": (
        lambda d: _set_tensor(
            d,
            lambda t: t.update(
                {
                    "base_model.model.model.layers.0.mlp.foo.lora_A.weight": torch.zeros(8, H),
                    "base_model.model.model.layers.0.mlp.foo.lora_B.weight": torch.zeros(H, 8),
                }
            ),
        ),
        "INVALID_ARGUMENT",
        "does not exist in base model",
    ),
    "stray_tensor": (
        lambda d: _set_tensor(d, lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.bias": torch.zeros(H)})),
        "INVALID_ARGUMENT",
        "not a LoRA A/B weight",
    ),
    "rank_mismatch": (
        lambda d: _set_tensor(d, lambda t: t.update({_first(t): torch.zeros(5, H)})),
        "INVALID_ARGUMENT",
        "disagree with r=8",
    ),
    "base_dims_mismatch": (
        lambda d: _set_tensor(d, lambda t: t.update({_first(t): torch.zeros(8, 96)})),
        "INVALID_ARGUMENT",
        "base model 'tiny-llama' has 64 -> ",
    ),
    "missing_b": (
        lambda d: _set_tensor(d, lambda t: t.pop(_first(t, "lora_B"))),
        "INVALID_ARGUMENT",
        "exactly one lora_A and one lora_B",
    ),
    "nan": (lambda d: _set_tensor(d, lambda t: t[_first(t)].__setitem__((0, 0), float("nan"))), "INVALID_ARGUMENT", "NaN or Inf"),
}


def test_float64_adapter_is_cast_to_float32_and_says_so(make_store, peft_adapter):
    store = make_store()
    src = place(peft_adapter(r=8, target_modules=("q_proj", "v_proj")), make_store.adapters_root, "fp32")
    fp64 = place(src, make_store.adapters_root, "fp64")
    _set_tensor(fp64, lambda t: t.update({k: v.double() for k, v in t.items()}))
    client = store.client()
    assert client.register("fp32", str(src)).weights_cast == ""
    manifest = client.register("fp64", str(fp64))
    assert manifest.weights_cast == "float64 -> float32" and client.get("fp64").weights_cast == "float64 -> float32"
    _, blob32 = client.fetch_shard("fp32", qkv_layout(1))
    _, blob64 = client.fetch_shard("fp64", qkv_layout(1))
    assert same_shard(blob32, blob64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_adapter_is_refused_with_status_and_nothing_kept(make_store, peft_adapter, case):
    store = make_store()
    corrupt, code, fragment = CASES[case]
    src = place(peft_adapter(r=8, target_modules=("q_proj", "v_proj")), make_store.adapters_root, case)
    corrupt(src)
    with pytest.raises(StatusError) as e:
        store.client().register("bad", str(src))
    assert e.value.code.name == code, e.value.message
    assert fragment in e.value.message
    assert_nothing_kept(store)


def test_oversized_weights_are_refused_before_download(make_store, peft_adapter):
    store = make_store(
        limits=validate.Limits(max_rank=32, max_adapter_bytes=5000),
        sources=SourceConfig(local_roots=(make_store.adapters_root,), max_file_bytes=5000),
    )
    src = place(peft_adapter(r=8), make_store.adapters_root, "big")
    with pytest.raises(StatusError) as e:
        store.client().register("big", str(src))
    assert e.value.code.name == "INVALID_ARGUMENT" and "adapter_model.safetensors" in e.value.message
    assert_nothing_kept(store)


def _gemma3_adapter_and_text_base(tmp_path: Path, rank_pattern) -> tuple[Path, Path, str]:
    """(a PEFT adapter on q_proj / v_proj of a tiny Gemma3ForConditionalGeneration, its language model's
    and its SigLIP vision tower's both, r 4 but for rank_pattern (a function of the vision tower's first
    q_proj); a text-only Gemma 3 base (Gemma3ForCausalLM) of the same language model; that q_proj)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    text = dict(vocab_size=260, hidden_size=48, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=256, bos_token_id=256, eos_token_id=257)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    mm = tf.Gemma3ForConditionalGeneration(
        tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=259)
    )
    tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**text)).save_pretrained(tmp_path / "gemma3-text")
    vq = next(n for n, _ in mm.named_modules() if "vision_tower" in n and n.endswith("layers.0.self_attn.q_proj"))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern=rank_pattern(vq))
    get_peft_model(mm, config).save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", tmp_path / "gemma3-text", vq


def test_vision_tower_modules_on_a_text_only_gemma3_are_refused_as_missing_before_their_rank(make_store, tmp_path):
    """An adapter made on a multimodal Gemma 3 whose rank_pattern puts a vision-tower module above the
    store's maximum rank: on a text-only Gemma 3 base, which has no vision tower, RegisterAdapter names
    the module the base lacks (INVALID_ARGUMENT), not the rank; a language-model module's rank above it
    is still FAILED_PRECONDITION."""
    adapter, base, vq = _gemma3_adapter_and_text_base(tmp_path, lambda vq: {vq: 16})
    tensors = st_load((adapter / "adapter_model.safetensors").read_bytes())
    assert tensors[f"base_model.model.{vq}.lora_A.weight"].shape[0] == 16
    vision = sorted({n[len("base_model.model.") :].rsplit(".lora_", 1)[0] for n in tensors if "vision_tower" in n})
    store = make_store(base_model="gemma3-text", base_model_path=base, limits=validate.Limits(max_rank=8))
    with pytest.raises(StatusError) as e:
        store.client().register("mm", str(place(adapter, make_store.adapters_root, "mm")))
    assert e.value.code.name == "INVALID_ARGUMENT", e.value.message
    assert e.value.message == f"module {vision[0]!r} does not exist in base model 'gemma3-text'"
    lm = place(adapter, make_store.adapters_root, "lm-rank")
    _edit_config(lm, rank_pattern={"model.language_model.layers.0.self_attn.q_proj": 16})
    with pytest.raises(StatusError) as e:
        store.client().register("lm-rank", str(lm))
    assert e.value.code.name == "FAILED_PRECONDITION", e.value.message
    assert e.value.message == "adapter rank 16 is above this store's maximum rank 8"
    assert_nothing_kept(store)


@pytest.mark.parametrize(
    "name,uri,code,fragment",
    [
        ("../etc", "x", "INVALID_ARGUMENT", "adapter name '../etc' is invalid"),
        ("ok", "", "INVALID_ARGUMENT", "uri is required"),
        ("ok", "ftp://host/adapter", "INVALID_ARGUMENT", "unsupported adapter URI scheme 'ftp'"),
        ("ok", "/etc", "PERMISSION_DENIED", "outside the store's allowed local roots"),
        ("ok", "file://{root}/not-here", "NOT_FOUND", "not-here"),
    ],
)
def test_bad_register_requests(make_store, name, uri, code, fragment):
    store = make_store()
    with pytest.raises(StatusError) as e:
        store.client().register(name, uri.format(root=make_store.adapters_root))
    assert e.value.code.name == code and fragment in e.value.message, e.value.message
    assert_nothing_kept(store)


def test_path_escaping_the_root_is_refused(make_store, peft_adapter, tmp_path):
    store = make_store()
    outside = tmp_path / "outside"
    outside.mkdir()
    place(peft_adapter(r=4), outside, "real")
    link = make_store.adapters_root / "link"
    link.symlink_to(outside)  # inside the root by name, outside by resolution
    root = make_store.adapters_root
    for uri in (f"{root}/../outside/real", f"file://{link}/real"):
        with pytest.raises(StatusError) as e:
            store.client().register("esc", uri)
        assert e.value.code.name == "PERMISSION_DENIED" and "outside the store's allowed local roots" in e.value.message
    assert_nothing_kept(store)


def test_fetch_errors(make_store, peft_adapter):
    store = make_store()
    client = store.client()
    src = place(peft_adapter(r=8, target_modules=("q_proj",)), make_store.adapters_root, "a")
    m = client.register("a", str(src))
    cases = [
        (("nope", qkv_layout(1)), {}, "NOT_FOUND", "'nope' is not registered"),
        (("a", qkv_layout(1, base_model="other-model")), {}, "FAILED_PRECONDITION", "executor serves base model 'other-model'"),
        (("a", qkv_layout(1, max_rank=4)), {}, "FAILED_PRECONDITION", "above the executor's max_rank 4"),
        (("a", qkv_layout(3)), {}, "INVALID_ARGUMENT", "4 attention heads do not split over tp_size 3"),
        (("a", qkv_layout(2)), {"tp_rank": 2}, "INVALID_ARGUMENT", "outside tp_size 2"),
        (("a", qkv_layout(1)), {"digest": "f" * 64}, "FAILED_PRECONDITION", f"now has digest {m.digest[:12]}"),
        (("a", pb.Layout(tp_size=1, dtype="int8", max_rank=8)), {}, "INVALID_ARGUMENT", "layout.dtype 'int8'"),
    ]
    for args, kwargs, code, fragment in cases:
        with pytest.raises(StatusError) as e:
            client.fetch_shard(*args, **kwargs)
        assert e.value.code.name == code and fragment in e.value.message, (code, e.value.message)
    assert list((store.cfg.data_dir / "cache").rglob("*.shard")) == []


def test_admin_token_guards_mutating_rpcs(make_store, peft_adapter):
    store = make_store(admin_token="s3cret")
    src = place(peft_adapter(r=4), make_store.adapters_root, "t")
    with pytest.raises(StatusError) as e:
        store.client().register("t", str(src))
    assert e.value.code.name == "UNAUTHENTICATED" and "admin token" in e.value.message
    with pytest.raises(StatusError) as e:
        store.client(token="wrong").register("t", str(src))
    assert e.value.code.name == "PERMISSION_DENIED" and "not valid" in e.value.message
    assert_nothing_kept(store)
    store.client(token="s3cret").register("t", str(src))
    assert store.client().get("t").name == "t"  # reads need no token
    with pytest.raises(StatusError) as e:
        store.client().delete("t")
    assert e.value.code.name == "UNAUTHENTICATED"
    assert store.client().get("t").name == "t"


# -- cache tiers -------------------------------------------------------------------------------
def test_redis_down_serves_from_disk_and_logs_it(make_store, peft_adapter, closed_port, caplog):
    caplog.set_level(logging.WARNING)
    store = make_store(redis_url=f"redis://127.0.0.1:{closed_port}/0")
    src = place(peft_adapter(r=4), make_store.adapters_root, "r")
    store.client().register("r", str(src))
    header, blob = store.client().fetch_shard("r", qkv_layout(1))
    header2, blob2 = store.client().fetch_shard("r", qkv_layout(1))
    assert header2.cache_tier == "disk" and blob2 == blob
    assert any("unavailable" in r.getMessage() and "disk" in r.getMessage() for r in caplog.records)


def test_redis_tier_serves_first_when_up(make_store, peft_adapter, redis_url):
    store = make_store(redis_url=redis_url.url, redis_prefix=redis_url.prefix)
    src = place(peft_adapter(r=4), make_store.adapters_root, "rr")
    store.client().register("rr", str(src))
    _, blob = store.client().fetch_shard("rr", qkv_layout(1))
    header, blob2 = store.client().fetch_shard("rr", qkv_layout(1))
    assert header.cache_tier == "redis" and blob2 == blob


def test_corrupted_disk_cache_file_is_detected_and_rebuilt(make_store, peft_adapter, caplog):
    store = make_store()
    src = place(peft_adapter(r=4), make_store.adapters_root, "c")
    store.client().register("c", str(src))
    _, blob = store.client().fetch_shard("c", qkv_layout(1))
    (shard_file,) = (store.cfg.data_dir / "cache").rglob("*.shard")
    data = bytearray(shard_file.read_bytes())
    data[-10] ^= 0xFF
    shard_file.write_bytes(bytes(data))
    header, blob2 = store.client().fetch_shard("c", qkv_layout(1))
    assert header.cache_tier == "packed" and same_shard(blob2, blob)
    assert any("xxh3-128" in r.getMessage() for r in caplog.records)
    assert store.client().fetch_shard("c", qkv_layout(1))[0].cache_tier == "disk"


def test_registry_survives_restart(make_store, peft_adapter):
    store = make_store()
    src = place(peft_adapter(r=4), make_store.adapters_root, "p")
    m = store.client().register("p", str(src))
    store.client().fetch_shard("p", qkv_layout(1))
    store.stop()
    again = make_store()
    assert again.client().get("p").digest == m.digest
    assert again.client().fetch_shard("p", qkv_layout(1))[0].cache_tier == "disk"


def test_reregistering_new_weights_gives_a_new_digest_and_drops_the_old(make_store, peft_adapter):
    store = make_store()
    client = store.client()
    v1 = place(peft_adapter(r=4, seed=1), make_store.adapters_root, "v1")
    v2 = place(peft_adapter(r=4, seed=2), make_store.adapters_root, "v2")
    old = client.register("same", str(v1))
    client.fetch_shard("same", qkv_layout(1))
    new = client.register("same", str(v2))
    assert new.digest != old.digest and client.get("same").digest == new.digest
    with pytest.raises(StatusError) as e:  # an executor still asking for the old version
        client.fetch_shard("same", qkv_layout(1), digest=old.digest)
    assert e.value.code.name == "FAILED_PRECONDITION"
    assert not (store.cfg.data_dir / "adapters" / old.digest).exists()
    assert not list((store.cfg.data_dir / "cache").glob(f"{old.digest}/**/*.shard"))
    header, _ = client.fetch_shard("same", qkv_layout(1), digest=new.digest)
    assert header.manifest.digest == new.digest


def test_prefetch_packs_every_rank_ahead_and_reports_failures(make_store, peft_adapter):
    from loraserve.v1 import adapter_store_pb2 as spb

    store = make_store()
    client = store.client()
    client.register("pf", str(place(peft_adapter(r=4), make_store.adapters_root, "pf")))
    results = client.prefetch(
        [spb.PrefetchItem(name="pf", layout=qkv_layout(2)), spb.PrefetchItem(name="ghost", layout=qkv_layout(2))]
    )
    ok = [r for r in results if r.name == "pf"]
    assert [(r.rank.tp_rank, r.ok, r.cache_tier) for r in ok] == [(0, True, "packed"), (1, True, "packed")]
    assert all(r.bytes > 0 for r in ok)
    ghost = [r for r in results if r.name == "ghost"]
    assert len(ghost) == 2 and not any(r.ok for r in ghost) and all("NOT_FOUND" in r.error for r in ghost)
    assert all(client.fetch_shard("pf", qkv_layout(2), tp_rank=t)[0].cache_tier == "disk" for t in range(2))
    again = client.prefetch([spb.PrefetchItem(name="pf", layout=qkv_layout(2))])
    assert [(r.cache_tier, r.bytes) for r in again] == [("disk", r.bytes) for r in ok]  # found, not packed again


def test_health_service_reports_serving(make_store):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    store = make_store()
    with grpc.insecure_channel(store.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "loraserve.v1.AdapterStore"):
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
                == health_pb2.HealthCheckResponse.SERVING
            )
