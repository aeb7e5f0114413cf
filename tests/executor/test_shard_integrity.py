"""A shard stream that arrives damaged never reaches a slot. A real store on loopback whose
FetchShard stream is altered on its way out (cut short, a byte flipped, a wrong or missing
checksum trailer, no header) feeds a real executor, the Python client and the CLI: each says
DATA_LOSS with its reason, nothing is cached or put in a slot, and once the store streams
honestly again the adapter serves exactly what transformers + PEFT compute."""

from __future__ import annotations

import copy
import hashlib
import subprocess
import sys
import warnings
from pathlib import Path

import grpc
import pytest
import torch
import xxhash
from peft import PeftModel

from loraserve.adapter_store import validate
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import SERVICE_NAME, AdapterStoreService
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import ExecutorClient, StoreClient
from loraserve.errors import StatusError
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.service import build_executor, shutdown
from loraserve.executor.service import serve as serve_executor
from loraserve.serving import start_server
from loraserve.v1 import adapter_store_pb2 as spb
from loraserve.v1 import adapter_store_pb2_grpc as spb_grpc
from loraserve.v1 import executor_pb2 as epb

from .conftest import BYTE_BOS

ADAPTER = "qv8"


def _flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[-5] ^= 0x01  # in the last tensor's data: the blob still parses, only the checksum knows
    return bytes(b)


def _sha256_trailer(data_chunks) -> spb.ShardChunk:
    """The trailer of an older store, or of a copy cached before xxh3-128 was kept: sha256 only."""
    return spb.ShardChunk(trailer=spb.ShardTrailer(sha256=hashlib.sha256(b"".join(c.data for c in data_chunks)).hexdigest()))


# mode -> (how the honest stream [header, data..., trailer] is altered, the DATA_LOSS message).
# The honest trailer carries xxh3_128 only (test_the_honest_trailer_is_xxh3_and_a_sha256_one_still_loads).
TAMPER = {
    "truncated": (
        lambda h, d, t: [h, *d[:-1], spb.ShardChunk(data=d[-1].data[:-100]), t],
        "shard stream ended after {short} bytes, header said {total}",
    ),
    "flipped_byte": (
        lambda h, d, t: [h, *d[:-1], spb.ShardChunk(data=_flip(d[-1].data)), t],
        "shard checksum mismatch: the stream was corrupted",
    ),
    "wrong_trailer": (
        lambda h, d, t: [h, *d, spb.ShardChunk(trailer=spb.ShardTrailer(sha256=hashlib.sha256(b"other").hexdigest()))],
        "shard checksum mismatch: the stream was corrupted",
    ),
    "wrong_xxh3_trailer": (
        lambda h, d, t: [h, *d, spb.ShardChunk(trailer=spb.ShardTrailer(xxh3_128=xxhash.xxh3_128_hexdigest(b"other")))],
        "shard checksum mismatch: the stream was corrupted",
    ),
    "flipped_byte_sha256_trailer": (
        lambda h, d, t: [h, *d[:-1], spb.ShardChunk(data=_flip(d[-1].data)), _sha256_trailer(d)],
        "shard checksum mismatch: the stream was corrupted",
    ),
    "no_trailer": (lambda h, d, t: [h, *d], "shard stream ended without its checksum trailer"),
    "no_header": (lambda h, d, t: [*d, t], "shard stream sent data before its header"),
}


# Streams that are not damaged, only in another form: they must load.
HONEST = {"sha256_trailer": lambda h, d, t: [h, *d, _sha256_trailer(d)]}


class TamperingStore(AdapterStoreService):
    """The real store, except that FetchShard streams are altered as `mode` says (None: honest)."""

    mode: str | None = None

    async def FetchShard(self, request, context):
        # The real FetchShard yields data chunks already framed (bytes): back to messages here.
        chunks = [spb.ShardChunk.FromString(c) if isinstance(c, bytes) else c async for c in super().FetchShard(request, context)]
        if self.mode is not None:
            alter = HONEST[self.mode] if self.mode in HONEST else TAMPER[self.mode][0]
            chunks = alter(chunks[0], chunks[1:-1], chunks[-1])
        for c in chunks:
            yield c


class Setup:
    def __init__(self, lt, base_dir: Path, adapters: Path, data: Path):
        self.lt = lt
        scfg = StoreConfig(
            listen="127.0.0.1:0",
            data_dir=data,
            base_model="tiny",
            base_model_path=base_dir,
            sources=SourceConfig(local_roots=(adapters,)),
            limits=validate.Limits(max_rank=16),
        )
        services = []

        def add(server):
            services.append(TamperingStore(scfg))
            spb_grpc.add_AdapterStoreServicer_to_server(services[0], server)

        self.store_server = lt.run(start_server(scfg.listen, add, (SERVICE_NAME,)))
        self.store = services[0]
        self.store_address = f"127.0.0.1:{self.store_server.port}"
        StoreClient(self.store_address).register(ADAPTER, str(adapters / ADAPTER))
        cfg = ExecutorConfig(
            model=str(base_dir),
            base_model="tiny",
            dtype="float32",
            max_loras=2,
            max_rank=16,
            num_blocks=64,
            block_size=4,
            max_model_len=128,
            store_address=self.store_address,
            adapter_refresh_s=0,
        )
        self.parts = build_executor(cfg)
        self.server, port = lt.run(serve_executor(self.parts, "127.0.0.1:0"))
        self.executor = ExecutorClient(f"127.0.0.1:{port}", timeout_s=60)

    def close(self):
        self.lt.run(shutdown(self.server, self.parts))
        self.lt.run(self.store_server.server.stop(0))


@pytest.fixture(scope="module")
def setup(module_loop_thread, tiny_chat_llama, chat_adapters, tmp_path_factory):
    s = Setup(module_loop_thread, tiny_chat_llama[1], chat_adapters, tmp_path_factory.mktemp("store"))
    yield s
    s.close()


@pytest.fixture
def honest_after(setup):
    yield setup
    setup.store.mode = None


def expected_message(mode: str, shard_bytes: int) -> str:
    return TAMPER[mode][1].format(short=shard_bytes - 100, total=shard_bytes)


def shard_bytes(setup) -> int:
    return len(StoreClient(setup.store_address).fetch_shard(ADAPTER, setup.parts.store.layout)[1])


@pytest.mark.parametrize("mode", sorted(TAMPER))
def test_python_client_refuses_a_damaged_stream_with_data_loss(honest_after, mode):
    setup = honest_after
    total = shard_bytes(setup)
    setup.store.mode = mode
    with pytest.raises(StatusError) as e:
        StoreClient(setup.store_address).fetch_shard(ADAPTER, setup.parts.store.layout)
    assert e.value.code == grpc.StatusCode.DATA_LOSS and e.value.message == expected_message(mode, total)


def test_executor_never_puts_a_damaged_shard_in_a_slot(honest_after, tiny_chat_llama, chat_adapters):
    setup = honest_after
    total = shard_bytes(setup)
    prompt = [BYTE_BOS, 72, 105, 33, 10]
    request = epb.GenerateRequest(
        adapter=ADAPTER, token_ids=epb.TokenIds(ids=prompt), sampling=epb.SamplingParams(max_tokens=6), return_logprobs=True
    )
    for mode in sorted(TAMPER):
        setup.store.mode = mode
        for call in (lambda: setup.executor.load(ADAPTER), lambda: setup.executor._call(setup.executor.stub.Generate, request)):
            with pytest.raises(StatusError) as e:
                call()
            assert e.value.code == grpc.StatusCode.DATA_LOSS, (mode, e.value)
            assert e.value.message == expected_message(mode, total), mode
        assert [s.name for s in setup.executor.list()] == [], mode  # not in a slot, not in the CPU cache
    setup.store.mode = None
    resp = setup.executor._call(setup.executor.stub.Generate, request)
    with warnings.catch_warnings():  # transformers' deprecation notes about its own internals
        warnings.simplefilter("ignore", FutureWarning)
        reference = PeftModel.from_pretrained(copy.deepcopy(tiny_chat_llama[0]), chat_adapters / ADAPTER).eval()
    out = list(resp.token_ids)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :].double()
    logprobs = torch.log_softmax(logits, -1)
    assert logprobs.argmax(-1).tolist() == out
    torch.testing.assert_close(
        torch.tensor(list(resp.logprobs), dtype=torch.float64), logprobs[torch.arange(len(out)), out], atol=2e-4, rtol=0
    )


def test_cli_fetch_of_a_damaged_stream_fails_and_writes_nothing(honest_after, tiny_chat_llama, tmp_path):
    setup = honest_after
    setup.store.mode = "flipped_byte"
    loraserve = str(Path(sys.executable).parent / "loraserve")
    out = tmp_path / "shards"
    args = [
        loraserve,
        "--log-level",
        "WARNING",
        "adapters",
        "--store",
        setup.store_address,
        "fetch",
        ADAPTER,
        "--model",
        str(tiny_chat_llama[1]),
        "--dtype",
        "float32",
        "--max-rank",
        "16",
        "--out",
        str(out),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "error: DATA_LOSS: shard checksum mismatch: the stream was corrupted" in proc.stderr
    assert "checksum ok" not in proc.stdout and list(out.iterdir()) == []  # (test_cli.py fetches honest shards)


def test_a_cold_load_reaches_the_slot_copy_as_views_of_the_one_buffer_the_stream_wrote(honest_after):
    """One host copy per cold load: the stream's bytes land once in a buffer (a block of the host
    arena here, of the pinned one on CUDA) and the slot copy reads views of it, with no safetensors
    parse copy and no second copy into pinned memory."""
    from loraserve.executor.slots import SlotManager

    setup, seen = honest_after, []

    async def load():
        mgr = SlotManager(
            setup.parts.store.fetch_shard,
            lambda slot, tensors: seen.append(tensors),
            lambda slot: None,
            max_loras=1,
            device=torch.device("cpu"),
        )
        mgr.release(await mgr.acquire(ADAPTER))
        return mgr.state(ADAPTER).bytes

    nbytes = setup.lt.run(load())
    (tensors,) = seen
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    start = min(t.data_ptr() for t in tensors.values())
    end = max(t.data_ptr() + t.nbytes for t in tensors.values())
    arena = setup.parts.store.arena  # a CPU executor's default host arena
    assert len(tensors) > 1 and len(storages) == 1 and end - start <= nbytes  # one storage, within the shard's bytes
    assert arena is not None and arena.holds(next(iter(tensors.values())))
    (block,) = [
        (arena.base.data_ptr() + o, size)
        for o, size in arena._live.items()
        if arena.base.data_ptr() + o <= start < arena.base.data_ptr() + o + size
    ]
    assert end <= block[0] + block[1]  # every view inside the one block the stream wrote


def test_the_honest_trailer_is_xxh3_and_a_sha256_one_still_loads(honest_after, tiny_chat_llama, tmp_path):
    """The store's trailer carries xxh3_128 alone; a sha256-only trailer (an older store, or a copy it
    cached before xxh3-128 was kept) is still checked and accepted by every client."""
    setup = honest_after
    with grpc.insecure_channel(setup.store_address) as channel:
        req = spb.FetchShardRequest(name=ADAPTER, layout=setup.parts.store.layout, xxh3=True)
        chunks = list(spb_grpc.AdapterStoreStub(channel).FetchShard(req, timeout=60))
    good = b"".join(c.data for c in chunks[1:-1])
    assert chunks[-1].trailer == spb.ShardTrailer(xxh3_128=xxhash.xxh3_128_hexdigest(good))

    setup.store.mode = "sha256_trailer"
    assert StoreClient(setup.store_address).fetch_shard(ADAPTER, setup.parts.store.layout)[1] == good
    _, _, tensors, nbytes = setup.lt.run(setup.parts.store.fetch_shard(ADAPTER))  # the executor's client
    assert nbytes == len(good) and tensors
    loraserve = str(Path(sys.executable).parent / "loraserve")
    out = tmp_path / "shards"
    args = [
        loraserve,
        "--log-level",
        "WARNING",
        "adapters",
        "--store",
        setup.store_address,
        "fetch",
        ADAPTER,
        "--model",
        str(tiny_chat_llama[1]),
        "--dtype",
        "float32",
        "--max-rank",
        "16",
        "--out",
        str(out),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "checksum ok" in proc.stdout, proc.stderr


def _arena_client(setup, nbytes: int):
    """The executor's store client landing shards in an arena (CPU memory here: the bookkeeping is
    what CUDA's page-locked arena does)."""
    from loraserve.executor.pinned_arena import PinnedArena
    from loraserve.executor.store_client import StoreClient as ExecutorStoreClient

    arena = PinnedArena(nbytes, pin_memory=False)
    return ExecutorStoreClient(setup.store_address, setup.parts.store.layout, timeout_s=30, arena=arena), arena


def test_a_shard_lands_in_the_pinned_arena_and_its_block_comes_back_when_dropped(honest_after):
    import gc

    setup = honest_after
    client, arena = _arena_client(setup, 64 << 20)
    _, _, plain, nbytes = setup.lt.run(setup.parts.store.fetch_shard(ADAPTER))
    _, _, tensors, _ = setup.lt.run(client.fetch_shard(ADAPTER))
    assert tensors.keys() == plain.keys() and all(torch.equal(tensors[k], plain[k]) for k in plain)
    assert all(arena.holds(t) for t in tensors.values()) and arena.live_blocks() == 1
    assert arena.free_bytes() == arena.nbytes - -(-nbytes // 4096) * 4096
    del tensors
    gc.collect()
    assert arena.live_blocks() == 0 and arena.free_bytes() == arena.nbytes
    setup.lt.run(client.close())


@pytest.mark.parametrize("mode", ["truncated", "flipped_byte", "no_trailer"])
def test_a_damaged_stream_gives_its_arena_block_back(honest_after, mode):
    """DATA_LOSS after the header: the client asks again once (verify), and neither try keeps a block."""
    setup = honest_after
    total = shard_bytes(setup)
    client, arena = _arena_client(setup, 64 << 20)
    setup.store.mode = mode
    with pytest.raises(StatusError) as e:
        setup.lt.run(client.fetch_shard(ADAPTER))
    assert e.value.code == grpc.StatusCode.DATA_LOSS and e.value.message == expected_message(mode, total)
    assert arena.live_blocks() == 0 and arena.free_bytes() == arena.nbytes
    setup.lt.run(client.close())


def test_a_full_arena_lands_the_shard_in_a_fresh_buffer_and_says_why(honest_after, caplog):
    setup = honest_after
    client, arena = _arena_client(setup, 4096)  # smaller than the shard
    with caplog.at_level("WARNING", logger="loraserve.executor.store_client"):
        _, _, tensors, nbytes = setup.lt.run(client.fetch_shard(ADAPTER))
    assert tensors and not any(arena.holds(t) for t in tensors.values()) and arena.misses == 1
    assert (
        f"host arena has no room for adapter {ADAPTER} ({nbytes} bytes; 4096 of 4096 bytes free, largest block "
        "4096): it lands in a fresh host buffer (fetches in flight have the arena's room"
    ) in caplog.text
    setup.lt.run(client.close())
