"""The executor end to end: real store and executor gRPC servers on loopback, real PEFT adapters,
every row of mixed batches checked against transformers + PEFT; slot rules and error statuses."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import copy
import logging
import re
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from loraserve.adapter_store import validate
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import serve as serve_store
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import ExecutorClient, StoreClient
from loraserve.errors import StatusError
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.engine.sampler import make_generator, sample
from loraserve.executor.service import build_executor, shutdown
from loraserve.executor.service import serve as serve_executor
from loraserve.v1 import executor_pb2 as epb

from .conftest import check_against_reference, check_bf16_rows, generate, prompt_ids, save_lora_adapters

ADAPTERS = {  # name: (r, alpha, targets, rslora)
    "qv8": (8, 16, ("q_proj", "v_proj"), False),
    "all4": (4, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "mlp16": (16, 16, ("gate_proj", "up_proj", "down_proj"), True),
    "o2": (2, 4, ("o_proj",), False),
    "kd8": (8, 32, ("k_proj", "down_proj"), False),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def base(byte_model, family):
    return byte_model(family)


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    configs = {
        name: LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora)
        for name, (r, alpha, targets, rslora) in ADAPTERS.items()
    }
    return save_lora_adapters(base[0], tmp_path_factory.mktemp("adapters"), configs, b_std=0.2)


class Cluster:
    """A store and an executor on loopback, served from one event loop thread."""

    def __init__(self, lt, base_dir: Path, adapters: Path, data: Path, device: str = "cpu", **executor_overrides):
        self.lt, self.adapters, self.data = lt, adapters, data
        self.scfg = StoreConfig(
            listen="127.0.0.1:0",
            data_dir=data,
            base_model="tiny",
            base_model_path=base_dir,
            sources=SourceConfig(local_roots=(adapters,)),
            limits=validate.Limits(max_rank=16),
        )
        self.start_store()
        store = self.store_client()
        for name in ADAPTERS:
            store.register(name, str(adapters / name))
        cfg = ExecutorConfig(
            model=str(base_dir),
            base_model="tiny",
            device=device,
            dtype="float32",
            max_loras=2,
            max_rank=16,
            max_cpu_adapters=8,
            num_blocks=256,
            block_size=4,
            max_model_len=512,
            cpu_cache_bytes=256 << 20,
            store_address=self.store_address,
            slot_wait_timeout_s=10.0,
        )
        for k, v in executor_overrides.items():
            setattr(cfg, k, v)
        self.parts = build_executor(cfg)
        self.server, port = lt.run(serve_executor(self.parts, "127.0.0.1:0"))
        self.address = f"127.0.0.1:{port}"

    def start_store(self, port: int = 0):
        self.scfg.listen = f"127.0.0.1:{port}"
        self.store_server, p = self.lt.run(serve_store(self.scfg))
        self.store_address = f"127.0.0.1:{p}"

    def stop_store(self):
        self.lt.run(self.store_server.stop(0))

    def store_client(self) -> StoreClient:
        return StoreClient(self.store_address, timeout_s=60)

    def client(self, token=None) -> ExecutorClient:
        return ExecutorClient(self.address, token=token, timeout_s=120)

    def close(self):
        self.lt.run(shutdown(self.server, self.parts))
        self.stop_store()


@pytest.fixture
def cluster(loop_thread, base, adapter_dirs, tmp_path, device):
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", device)
    yield c
    c.close()


@pytest.fixture(scope="module")
def references(base, adapter_dirs):
    """name -> the transformers + PEFT model that is the oracle ("" -> the base model)."""
    model, _ = base
    refs = {"": model}
    for name in ADAPTERS:
        refs[name] = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / name).eval()
    return refs


def test_mixed_batches_match_transformers_peft(family, cluster, references, caplog):
    client = cluster.client()
    # Two adapters + base rows at once fill both slots; run twice so other pairs get slots too.
    for group in (["qv8", "all4", "", "qv8"], ["mlp16", "", "o2", "mlp16"]):
        slots = {name: client.load(name).slot for name in set(group) - {""}} | {"": -1}  # in slots before the burst
        jobs = [(name, prompt_ids(i)) for i, name in enumerate(group)]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="loraserve.executor.engine.engine"):
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                resps = list(pool.map(lambda j: generate(client, *j), jobs))
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(references[name], ids, resp)
            if name:
                assert resp.adapter_digest == cluster.store_client().get(name).digest
        # They shared forward passes: some step ran the base model and both adapters together.
        steps = [
            set(map(int, re.findall(r"-?\d+", m.group(1))))
            for r in caplog.records
            if (m := re.search(r"^step: .* slots \[([^]]*)\]", r.getMessage()))
        ]
        assert steps and any(step >= set(slots.values()) for step in steps), (slots, steps)


def test_sampling_over_grpc_draws_what_the_sampler_draws_on_the_adapters_logits(cluster, references, device):
    """temperature / top_k / top_p / seed reach the engine: each seeded request's tokens are the
    sampler's own draws on transformers + PEFT's logits, and top-k keeps only the k best."""
    client, name, ids, k = cluster.client(), "qv8", prompt_ids(2), 5
    reqs = [
        epb.GenerateRequest(
            adapter=name,
            token_ids=epb.TokenIds(ids=ids),
            sampling=epb.SamplingParams(max_tokens=3, temperature=1.2, top_k=k, top_p=0.95, seed=seed),
        )
        for seed in range(16)
    ]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = [list(r.token_ids) for r in pool.map(lambda r: client._call(client.stub.Generate, r), reqs)]
    for seed, out in enumerate(outs):
        dev = torch.device(device)  # the executor draws from a generator on its own device
        gen, drawn = make_generator(seed, dev), []
        for _ in range(3):
            with torch.no_grad():
                logits = references[name](torch.tensor([ids + drawn])).logits[0, -1:].float().to(dev)
            if not drawn:
                assert out[0] in logits[0].topk(k).indices.tolist()
            token, _ = sample(
                logits, torch.tensor([1.2], device=dev), torch.tensor([k], device=dev), torch.tensor([0.95], device=dev), [gen]
            )
            drawn.append(int(token))
        assert out == drawn, seed
    assert len({o[0] for o in outs}) > 1  # 16 draws from 5 tokens all alike: a greedy executor


def test_five_adapters_over_two_slots_in_turn_and_concurrently(cluster, references):
    client = cluster.client()
    names = list(ADAPTERS)
    for i, name in enumerate(names):  # in turn: every load evicts the coldest (each asked once: the least recently used)
        check_against_reference(references[name], prompt_ids(i), generate(client, name, prompt_ids(i)))
    jobs = [(names[i % 5], prompt_ids(i)) for i in range(10)]
    with cf.ThreadPoolExecutor(10) as pool:  # concurrently: requests wait for slots, none corrupts another
        resps = list(pool.map(lambda j: generate(client, *j, 6), jobs))
    for (name, ids), resp in zip(jobs, resps):
        check_against_reference(references[name], ids, resp)
    assert sum(s.slot >= 0 for s in client.list()) <= 2


def test_pinned_adapter_is_never_evicted_and_all_pinned_is_resource_exhausted(cluster, references):
    client = cluster.client()
    assert client.load("qv8", pin=True).pinned
    for name in ("all4", "mlp16", "o2"):  # the one free slot cycles; qv8 stays
        generate(client, name, prompt_ids(0), 2)
        qv8 = next(s for s in client.list() if s.name == "qv8")
        assert qv8.slot >= 0 and qv8.pinned
    client.pin("kd8")
    with pytest.raises(StatusError) as e:
        generate(client, "o2", prompt_ids(1), 2)
    assert e.value.code.name == "RESOURCE_EXHAUSTED" and "pinned" in e.value.message
    with pytest.raises(StatusError) as e:
        client.evict("qv8")
    assert e.value.code.name == "FAILED_PRECONDITION" and "unpin" in e.value.message
    client.unpin("kd8")
    check_against_reference(references["o2"], prompt_ids(1), generate(client, "o2", prompt_ids(1)))
    check_against_reference(references["qv8"], prompt_ids(2), generate(client, "qv8", prompt_ids(2)))


def test_evicting_an_adapter_in_use_is_failed_precondition(cluster):
    client = cluster.client()
    req = epb.GenerateRequest(
        adapter="all4", token_ids=epb.TokenIds(ids=prompt_ids(0)), sampling=epb.SamplingParams(max_tokens=400)
    )
    stream = client.stub.GenerateStream(req, timeout=120)
    next(stream)  # the request is running and holds its slot
    with pytest.raises(StatusError) as e:
        client.evict("all4")
    assert e.value.code.name == "FAILED_PRECONDITION" and "in use" in e.value.message
    stream.cancel()
    for _ in range(100):  # the cancelled request gives its slot back
        state = next(s for s in client.list() if s.name == "all4")
        if state.in_use == 0:
            break
        time.sleep(0.05)
    assert client.evict("all4").slot == -1


@pytest.mark.parametrize(
    "sampling,fragment",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=100000), "top_k"),
        (dict(max_tokens=100000), "max_tokens"),
    ],
)
def test_bad_sampling_parameters_are_invalid_argument(cluster, sampling, fragment):
    req = epb.GenerateRequest(token_ids=epb.TokenIds(ids=prompt_ids(0)), sampling=epb.SamplingParams(**sampling))
    with pytest.raises(StatusError) as e:
        cluster.client()._call(cluster.client().stub.Generate, req)
    assert e.value.code.name == "INVALID_ARGUMENT" and fragment in e.value.message


def test_request_errors_fail_alone(cluster, references):
    client = cluster.client()
    with pytest.raises(StatusError) as e:
        generate(client, "no-such-adapter", prompt_ids(0))
    assert e.value.code.name == "NOT_FOUND" and "no-such-adapter" in e.value.message
    with pytest.raises(StatusError) as e:
        client._call(client.stub.Generate, epb.GenerateRequest(adapter="qv8"))
    assert e.value.code.name == "INVALID_ARGUMENT" and "prompt, chat or token_ids" in e.value.message
    with pytest.raises(StatusError) as e:
        client.pin("no-such-adapter")
    assert e.value.code.name == "NOT_FOUND"
    check_against_reference(references["qv8"], prompt_ids(3), generate(client, "qv8", prompt_ids(3)))


def test_text_prompts_chat_and_stream(cluster):
    client = cluster.client()
    whole = client.generate("hi there", adapter="qv8", chat=True, max_tokens=6)
    parts = list(client.generate_stream("hi there", adapter="qv8", chat=True, max_tokens=6))
    assert "".join(p.text for p in parts) == whole.text
    assert parts[-1].finish_reason in (epb.LENGTH, epb.EOS) and whole.prompt_tokens > 2
    info = client.info()
    assert info.max_loras == 2 and info.max_rank == 16 and info.device


def test_store_down_hot_adapters_serve_cold_fail_unavailable_then_recover(cluster, references):
    client = cluster.client()
    check_against_reference(references["qv8"], prompt_ids(0), generate(client, "qv8", prompt_ids(0)))
    port = int(cluster.store_address.rsplit(":", 1)[1])
    cluster.stop_store()
    check_against_reference(references["qv8"], prompt_ids(1), generate(client, "qv8", prompt_ids(1)))  # hot
    assert client.load("qv8").slot >= 0  # LoadAdapter cannot check the version: it keeps what it holds
    with pytest.raises(StatusError) as e:
        generate(client, "mlp16", prompt_ids(2))  # cold
    assert e.value.code.name == "UNAVAILABLE" and "store" in e.value.message
    cluster.start_store(port)
    deadline = time.time() + 30
    while True:  # the channel reconnects with backoff
        try:
            resp = generate(client, "mlp16", prompt_ids(2))
            break
        except StatusError as exc:
            assert exc.code.name == "UNAVAILABLE" and time.time() < deadline
            time.sleep(0.5)
    check_against_reference(references["mlp16"], prompt_ids(2), resp)


def test_admin_rpcs_need_the_token_when_configured(loop_thread, base, adapter_dirs, tmp_path):
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", admin_token="tok")
    try:
        with pytest.raises(StatusError) as e:
            c.client().load("qv8")
        assert e.value.code.name == "UNAUTHENTICATED"
        with pytest.raises(StatusError) as e:
            c.client(token="bad").evict("qv8")
        assert e.value.code.name == "PERMISSION_DENIED"
        assert c.client(token="tok").load("qv8").slot >= 0
        assert [s.name for s in c.client().list()] == ["qv8"]  # reads stay open
    finally:
        c.close()


def test_load_adapter_brings_the_new_version_of_a_re_registered_adapter(loop_thread, base, adapter_dirs, tmp_path, references):
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", adapter_refresh_s=0)  # no refresh loop
    try:
        client, store = c.client(), c.store_client()
        old = generate(client, "qv8", prompt_ids(0))
        check_against_reference(references["qv8"], prompt_ids(0), old)
        new = store.register("qv8", str(adapter_dirs / "mlp16"))  # other weights under the same name
        assert new.digest != old.adapter_digest
        assert client.load("qv8").digest == new.digest  # LoadAdapter asks the store for the version
        resp = generate(client, "qv8", prompt_ids(1))
        assert resp.adapter_digest == new.digest
        check_against_reference(references["mlp16"], prompt_ids(1), resp)
    finally:
        c.close()


def test_a_pinned_adapter_whose_new_version_fails_to_load_reports_the_version_it_serves(
    loop_thread, base, adapter_dirs, tmp_path, references, caplog
):
    """The store's new version of a pinned adapter cannot be loaded here (DoRA, no --enable-dora):
    the old version keeps its slot and serves, and LoadAdapter / ListAdapters report that version
    (its digest, rank and bytes), not the one that failed."""
    dora = adapter_dirs / "qv8-dora"
    if not dora.exists():
        peft = get_peft_model(copy.deepcopy(base[0]), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))
        peft.save_pretrained(dora)
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", adapter_refresh_s=0)  # no refresh loop
    try:
        client, store = c.client(), c.store_client()
        pinned = client.pin("qv8")
        assert (pinned.rank, pinned.pinned, pinned.slot >= 0, pinned.bytes > 0) == (8, True, True, True)
        assert store.register("qv8", str(dora)).kind == "dora"
        with caplog.at_level(logging.WARNING, logger="loraserve.executor.slots"):
            client.load("qv8")  # asks the store: the pinned slot's reload starts and fails
            deadline = time.time() + 20
            while "loading its new version failed" not in caplog.text:
                assert time.time() < deadline, caplog.text
                time.sleep(0.05)
        want = (pinned.name, pinned.digest, 8, pinned.slot, True, False, pinned.bytes, False)
        for state in (client.load("qv8"), *client.list()):
            assert (
                state.name,
                state.digest,
                state.rank,
                state.slot,
                state.pinned,
                state.in_cpu_cache,
                state.bytes,
                state.loading,
            ) == want
        resp = generate(client, "qv8", prompt_ids(0))
        assert resp.adapter_digest == pinned.digest
        check_against_reference(references["qv8"], prompt_ids(0), resp)
    finally:
        c.close()


def test_an_adapter_evicted_before_its_prefetch_begins_leaves_no_host_copy(loop_thread, base, adapter_dirs, tmp_path, caplog):
    """A request announces its adapter (want: the prefetch is spawned) and an evict lands before the
    prefetch task has run (an adapter in no slot is evicted without yielding to the loop): no fetch is
    started (not even one the fetch limit's seat check then cancels), and neither the host arena nor the
    CPU cache holds bytes for it; a later request loads it."""
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store")
    try:
        slots, arena = c.parts.slots, c.parts.arena
        assert arena is not None and arena.live_blocks() == 0

        async def evict_between_want_and_prefetch():
            unwant = slots.want("qv8")
            state = await slots.evict("qv8")
            unwant()
            while slots.cpu._tasks:  # the prefetch task, and any fetch it would start
                await asyncio.wait(set(slots.cpu._tasks))
            return state

        with caplog.at_level(logging.INFO, logger="loraserve.executor.cpu_cache"):
            state = loop_thread.run(evict_between_want_and_prefetch())
        assert not [r for r in caplog.records if "fetching adapter qv8" in r.getMessage()]  # not started at all
        assert (state.slot, state.in_cpu_cache, state.loading) == (-1, False, False)
        assert (arena.live_blocks(), slots.cpu_cache_state(), list(c.client().list())) == (0, (0, 0), [])
        generate(c.client(), "qv8", prompt_ids(0))
        assert arena.live_blocks() == 1 and slots.cpu_cache_state()[0] == 1  # where a fetched shard lands
    finally:
        c.close()


def test_refresh_loop_follows_re_registration_and_deletion_in_the_store(loop_thread, base, adapter_dirs, tmp_path, references):
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", adapter_refresh_s=0.2)
    try:
        client, store = c.client(), c.store_client()
        check_against_reference(references["o2"], prompt_ids(0), generate(client, "o2", prompt_ids(0)))

        def wait_until_dropped():  # an idle superseded version leaves the executor
            deadline = time.time() + 20
            while "o2" in [s.name for s in client.list()]:
                assert time.time() < deadline, client.list()
                time.sleep(0.1)

        new = store.register("o2", str(adapter_dirs / "all4"))
        wait_until_dropped()
        resp = generate(client, "o2", prompt_ids(1))
        assert resp.adapter_digest == new.digest
        check_against_reference(references["all4"], prompt_ids(1), resp)
        store.delete("o2")
        wait_until_dropped()
        with pytest.raises(StatusError) as e:
            generate(client, "o2", prompt_ids(2))
        assert e.value.code.name == "NOT_FOUND" and e.value.message == "adapter 'o2' is not registered"
    finally:
        c.close()


def test_prefix_cache_reuses_a_prompts_kv_per_adapter_version_only(loop_thread, base, adapter_dirs, tmp_path, references, device):
    """A repeated prompt reuses its prefix's KV under the same adapter version only: other adapters
    and the base model on the same prompt start cold, so does a re-registered version, and every
    output matches transformers + PEFT."""
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", device, adapter_refresh_s=0)
    try:
        client, store = c.client(), c.store_client()
        assert client.info().prefix_caching
        ids = prompt_ids(6)  # 16 tokens: 3 full blocks of 4 before the last one
        first = {name: generate(client, name, ids) for name in ("", "qv8", "all4")}
        assert [r.cached_tokens for r in first.values()] == [0, 0, 0]
        for name, resp in first.items():
            again = generate(client, name, ids)
            assert again.cached_tokens == 12 and list(again.token_ids) == list(resp.token_ids)
            check_against_reference(references[name], ids, again)
        new = store.register("qv8", str(adapter_dirs / "mlp16"))  # other weights under the same name
        assert client.load("qv8").digest == new.digest
        cold = generate(client, "qv8", ids)
        assert cold.cached_tokens == 0 and cold.adapter_digest == new.digest
        check_against_reference(references["mlp16"], ids, cold)
        warm = generate(client, "qv8", ids)
        assert warm.cached_tokens == 12 and list(warm.token_ids) == list(cold.token_ids)
    finally:
        c.close()


def test_without_prefix_caching_every_prompt_is_prefilled_whole(loop_thread, base, adapter_dirs, tmp_path, references):
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", prefix_caching=False)
    try:
        client = c.client()
        assert not client.info().prefix_caching
        ids = prompt_ids(6)
        for _ in range(2):
            resp = generate(client, "qv8", ids)
            assert resp.cached_tokens == 0
            check_against_reference(references["qv8"], ids, resp)
        assert c.parts.engine.allocator.num_cached == 0
    finally:
        c.close()


@pytest.mark.gpu
def test_bf16_on_cuda_applies_each_rows_adapter(loop_thread, base, adapter_dirs, tmp_path, references):
    """bf16 on the GPU runs the Triton kernels: each row's tokens must be scored like its own
    adapter's reference (float32 PEFT), and clearly unlike the base model's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA + Triton: no CUDA device here (run benchmarks/gpu.sh OUT test on a CUDA host)")
    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", "cuda", dtype="bfloat16")
    try:
        client = c.client()
        jobs = [(name, prompt_ids(i)) for i, name in enumerate(["qv8", "all4", "", "mlp16", "qv8", ""])]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            resps = list(pool.map(lambda j: generate(client, *j, 12), jobs))
        check_bf16_rows(references, jobs, resps)
        # the engine's warm-up built every kernel these steps ran (slot loads, prefill attention over
        # any number of sequences, LoRA at any token count): none was built while they waited
        engine = c.parts.engine
        assert engine.kernel_builds.count == 0, engine.kernel_builds.recent
        # and the prompts' steps replayed the mixed-step graphs (a failed capture would run them eagerly)
        assert engine.mixed_graphs is not None and engine.step_totals["mixed-graph"].steps > 0
        # Again: each prompt's full blocks short of its last token come from the prefix cache, the rest
        # is prefilled over that cached context, and every row is still scored as its own adapter's.
        mixed = engine.step_totals["mixed-graph"].steps
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            again = list(pool.map(lambda j: generate(client, *j, 12), jobs))
        assert [r.cached_tokens for r in again] == [(len(ids) - 1) // 4 * 4 for _, ids in jobs]
        check_bf16_rows(references, jobs, again)
        assert engine.step_totals["mixed-graph"].steps > mixed
    finally:
        c.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slot_reloads_on_cuda_serve_each_rows_adapter(loop_thread, base, adapter_dirs, tmp_path, references, dtype):
    """Five adapters of ranks 2-16 through two rank-16 slots on the GPU, so slots are reloaded at
    other ranks (16 over 4, 8 over 16, ...) by the Triton scatter and read in the step's graphs: every
    row is scored like its own adapter's PEFT reference (float32 exactly, bf16 within its tolerance).
    On CUDA the dense layers' B slots hold [N, r8] rows, read by the packed expand."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA + Triton: no CUDA device here (run benchmarks/gpu.sh OUT test on a CUDA host)")
    from loraserve.executor.lora import LinearWithLoRA

    c = Cluster(loop_thread, base[1], adapter_dirs, tmp_path / "store", "cuda", dtype=dtype)
    try:
        engine = c.parts.engine
        dense = [m.packed_b for m in engine.model.modules() if isinstance(m, LinearWithLoRA) and m.lora_a is not None]
        assert dense and all(dense)
        client = c.client()
        rounds = [["mlp16", "all4", ""], ["qv8", "o2", "kd8"], ["all4", "mlp16", "qv8", ""]]
        for i, names in enumerate(rounds):
            jobs = [(name, prompt_ids(4 * i + j)) for j, name in enumerate(names)]
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                resps = list(pool.map(lambda j: generate(client, *j, 12), jobs))
            if dtype == "float32":
                for (name, ids), resp in zip(jobs, resps):
                    check_against_reference(references[name], ids, resp)
            else:
                check_bf16_rows(references, jobs, resps)
        assert engine.kernel_builds.count == 0, engine.kernel_builds.recent  # the warm-up built each expand
        assert engine.step_totals["decode-graph"].steps + engine.step_totals["mixed-graph"].steps > 0
    finally:
        c.close()


def test_embedding_and_lm_head_adapters_when_enabled(loop_thread, base, adapter_dirs, tmp_path, device):
    """An adapter on embed_tokens + lm_head + q_proj: refused by a default executor's layout,
    served exactly (vs PEFT) when lora_embeddings is on."""
    model, base_dir = base
    torch.manual_seed(7)
    peft = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"])
    )
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n or "lora_embedding_B" in n:
                p.normal_(0, 0.2)
    peft.save_pretrained(adapter_dirs / "emb4")
    ref = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / "emb4").eval()
    plain = Cluster(loop_thread, base_dir, adapter_dirs, tmp_path / "s1", device)
    try:
        plain.store_client().register("emb4", str(adapter_dirs / "emb4"))
        with pytest.raises(StatusError) as e:
            generate(plain.client(), "emb4", prompt_ids(0))
        assert e.value.code.name == "FAILED_PRECONDITION" and "does not serve" in e.value.message
    finally:
        plain.close()
    c = Cluster(loop_thread, base_dir, adapter_dirs, tmp_path / "s2", device, lora_embeddings=True)
    try:
        c.store_client().register("emb4", str(adapter_dirs / "emb4"))
        jobs = [("emb4", prompt_ids(0)), ("qv8", prompt_ids(1)), ("", prompt_ids(2))]
        with cf.ThreadPoolExecutor(3) as pool:
            resps = list(pool.map(lambda j: generate(c.client(), *j), jobs))
        check_against_reference(ref, *jobs[0][1:], resps[0])
        for (name, ids), resp in zip(jobs[1:], resps[1:]):
            check_against_reference(
                PeftModel.from_pretrained(copy.deepcopy(model), adapter_dirs / name).eval() if name else model, ids, resp
            )
    finally:
        c.close()


def test_a_stream_closed_between_messages_ends_its_request_at_once(cluster, caplog):
    """GenerateStream closed while it waits at a message (the client gone between two: gRPC
    closes the servicer's stream) ends its engine request as the close returns, not when the
    garbage collector finds the engine's generator: its sequence and blocks are let go then."""
    from loraserve.executor.service import ExecutorService

    class Context:  # what GenerateStream asks of grpc.aio's context
        def time_remaining(self):
            return None

        def cancelled(self):
            return False

    req = epb.GenerateRequest(
        adapter="all4",
        request_id="closed-early",
        token_ids=epb.TokenIds(ids=prompt_ids(0)),
        sampling=epb.SamplingParams(max_tokens=400),
    )

    async def run():
        stream = ExecutorService(cluster.parts).GenerateStream(req, Context())
        assert (await stream.__anext__()).token_ids
        running = len(cluster.parts.engine._runs)
        await stream.aclose()
        ended = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request closed-early: finished")]
        return running, len(cluster.parts.engine._runs), ended

    with caplog.at_level(logging.INFO, logger="loraserve.executor.engine.engine"):
        running, after, ended = cluster.lt.run(run(), 60)
    assert (running, after) == (1, 0)
    assert len(ended) == 1 and ended[0].startswith("request closed-early: finished (cancelled)")
