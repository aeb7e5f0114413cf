"""The async engine end to end on CPU: a tiny random Llama (transformers, saved, loaded by our
loader), a real paged KV cache, scheduler, sampler and slot manager; transformers is the oracle."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc
import pytest
import torch

from loraserve.errors import StatusError, not_found
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.diagnostics import gil_handoff, slow_steps
from loraserve.executor.engine import engine as engine_mod
from loraserve.executor.engine.batch import step_kind
from loraserve.executor.engine.engine import Engine
from loraserve.executor.engine.graphs import DecodeGraphs
from loraserve.executor.engine.kv_cache import KVCache
from loraserve.executor.engine.requests import GenerationRequest
from loraserve.executor.engine.sampler import SamplingParams, make_generator, sample
from loraserve.executor.lora import lora_modules
from loraserve.executor.model.loader import load_model
from loraserve.executor.model.tokenizer import Tokenizer
from loraserve.executor.slot_layout import LoraSpec
from loraserve.executor.slot_load import load_shard_into_slot
from loraserve.executor.slots import SlotManager

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?'-:;()"


def _char_tokenizer(vocab_size: int, eos: set[int] = frozenset()) -> Tokenizer:
    """A real fast tokenizer, one token per character, covering every id the model can produce."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf, set(eos))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(ref_model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = ref_model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    ids = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1)
    return ids, logprobs.gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()


class Store:
    """Adapter shards in memory, shaped for the model's slot buffers (fetch_shard's contract)."""

    def __init__(self, model, names: list[str], rank: int = 4):
        self.shards = {}
        for i, name in enumerate(names):
            g = torch.Generator().manual_seed(100 + i)
            tensors = {}
            for mod_name, mod in lora_modules(model).items():
                if mod.lora_a is None or mod_name.endswith("embed_tokens"):
                    continue
                _, slices, _, in_features = mod.lora_a.shape
                tensors[f"{mod_name}.lora_a"] = torch.randn(slices, rank, in_features, generator=g) * 0.2
                tensors[f"{mod_name}.lora_b"] = torch.randn(mod.lora_b.shape[1], rank, generator=g) * 0.2
            self.shards[name] = tensors

    async def fetch(self, name):
        if name not in self.shards:
            raise not_found(f"adapter {name!r} is not registered")
        tensors = self.shards[name]
        return f"sha256:{name}", 4, tensors, sum(t.numel() * 4 for t in tensors.values())


def _engine(model, *, eos=frozenset(), store=None, **overrides) -> Engine:
    cfg = ExecutorConfig(
        **{
            "max_loras": 2, "max_rank": 8, "num_blocks": 64, "block_size": 4, "max_num_seqs": 8,
            "max_num_batched_tokens": 32, "max_model_len": 96, **overrides,
        }
    )  # fmt: skip
    mc = model.cfg
    kv = KVCache(mc.num_layers, cfg.num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim, model.dtype, cfg.torch_device)
    store = store or Store(model, [])
    slots = SlotManager(
        store.fetch,
        lambda slot, tensors: load_shard_into_slot(model, slot, tensors),
        lambda slot: load_shard_into_slot(model, slot, {}),
        max_loras=cfg.max_loras,
        max_cpu_adapters=cfg.max_cpu_adapters,
        device=cfg.torch_device,
        slot_wait_timeout_s=cfg.slot_wait_timeout_s,
        max_concurrent_loads=cfg.max_concurrent_loads,
    )
    return Engine(model, _char_tokenizer(mc.vocab_size, eos), kv, slots, cfg)


@pytest.fixture(scope="module")
def tiny(hf_model):
    """(transformers model, our model loaded from its save_pretrained dir with 2 LoRA slots)."""
    ref_model, path = hf_model("llama")
    return ref_model, load_model(path, lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32))


@pytest.fixture(params=["eager", "graph-steps"])
async def make_engine(tiny, request):
    """Engines that run every step eagerly, or decode steps through the graphs' static buffers
    (on CPU uncaptured, the same step a CUDA graph replays): then the engine launches each
    decode step before the previous one's tokens reach the host (placeholders fed on the device)."""
    engines = []

    def make(**kwargs) -> Engine:
        engine = _engine(tiny[1], **kwargs)
        if request.param == "graph-steps":
            cfg = engine.config
            engine.graphs = DecodeGraphs(
                engine.model, engine.kv_cache, cfg.max_num_seqs, cfg.max_model_len, engine.max_loras, cfg.torch_device
            )
            engine.scheduler.admit_ratio = cfg.admit_ratio  # as an engine with captured graphs sets it
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


async def _collect(engine: Engine, req: GenerationRequest):
    outs = [o async for o in engine.generate(req)]
    ids = [t for o in outs for t in o.token_ids]
    return ids, "".join(o.text for o in outs), outs


def _greedy(prompt, max_tokens, **kwargs) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens), **kwargs)


def _idle(engine: Engine) -> bool:
    return (
        engine.allocator.num_free == engine.kv_cache.num_blocks
        and not engine.scheduler.has_work()
        and engine._runs == {}
        and all(s.in_use == 0 for s in engine.slots.states())
    )


async def _freed_within_steps(engine: Engine, steps_before: int, until) -> None:
    """The engine goes idle within a few steps of `steps_before` (the step in flight and those planned
    ahead): a request left running to its max_tokens would take dozens more."""
    await until(lambda: _idle(engine))
    _assert_idle(engine)
    more = len(engine.step_times) - steps_before
    assert more <= engine.steps_ahead + 2, f"{more} steps ran after the request ended"


def _assert_idle(engine: Engine):
    assert engine.allocator.num_free == engine.kv_cache.num_blocks
    assert not engine.scheduler.has_work() and engine._runs == {}
    assert all(s.in_use == 0 for s in engine.slots.states())


async def test_concurrent_greedy_requests_match_transformers_generate(tiny, make_engine):
    ref_model, _ = tiny
    engine = make_engine()  # 32-token budget: the 40-token prompt is prefilled in two chunks
    prompts = [_prompt(n, seed) for seed, n in enumerate([3, 17, 40, 9, 25])]
    results = await asyncio.gather(*(_collect(engine, _greedy(p, 12, return_logprobs=True)) for p in prompts))
    for prompt, (ids, text, outs) in zip(prompts, results):
        ref_ids, ref_logprobs = _hf_greedy(ref_model, prompt, 12)
        assert ids == ref_ids
        torch.testing.assert_close(
            torch.tensor([lp for o in outs for lp in o.logprobs]), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4
        )
        assert text == engine.tokenizer.decode(ids)
        assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
        assert outs[-1].prompt_tokens == len(prompt)
    _assert_idle(engine)
    assert (engine.steps_ahead > 0) == (engine.graphs is not None)


async def test_every_collected_step_goes_through_the_slow_step_watch(tiny, make_engine, caplog):
    """Engine._collect hands each step to engine.slow_steps (executor/diagnostics/slow_steps.py): with a
    floor of 0 s and a factor of 0, every step past the warm-up count is slow and logged."""
    engine = make_engine()
    engine.slow_steps.reset_longest()
    watch = engine.slow_steps
    with caplog.at_level(logging.WARNING, logger="loraserve.executor.diagnostics.slow_steps"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(slow_steps, "MIN_SECONDS", 0.0)
            mp.setattr(slow_steps, "FACTOR", 0.0)
            mp.setattr(slow_steps, "WARMUP_STEPS", 1)
            await _collect(engine, _greedy(_prompt(5, 1), 6))
    steps = len(engine.step_times)
    assert steps >= 6 and watch.longest is not None
    assert sum(len(q) for q in watch._recent.values()) == steps  # every step, once
    flagged = sum(watch.counts.values())
    assert flagged >= 1 and caplog.text.count(" step: ") == flagged  # the watch's own lines, one per slow step
    assert "Triton" not in caplog.text  # CPU: builds are not watched
    assert caplog.text.count("Python's garbage collector: ") == flagged  # the collector's time since the previous step


async def test_the_engine_freezes_start_up_objects_and_puts_them_back_when_the_last_one_stops(tiny):
    """Once serving, start-up's objects are out of the garbage collector's walks (gc_pauses.py): a
    cycle made before start survives a collection while an engine runs, and is freed once the last
    running engine has stopped. A second engine neither re-freezes nor thaws the first one's."""
    import gc
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(b)
    first, second = _engine(tiny[1]), _engine(tiny[1])
    before = first.gc_pauses.count
    first.start()
    try:
        assert gc.get_freeze_count() > 1000 and first.gc_pauses.count > before  # its collection timed
        del a, b
        gc.collect()
        assert alive() is not None, "frozen: the collector must not walk start-up's cycle"
        second.start()
        await second.stop()  # the first still runs: still frozen
        assert gc.get_freeze_count() > 1000
    finally:
        await first.stop()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


async def test_a_serving_engine_shortens_the_switch_interval_and_the_last_to_stop_puts_it_back(tiny):
    """While an engine serves, a helper thread waits at most gil_handoff.SWITCH_INTERVAL_US for the
    GIL: the first engine sets it, a second one leaves it, the last to stop puts back the interval
    it found (here one the process had set itself)."""
    import sys

    found = sys.getswitchinterval()
    sys.setswitchinterval(0.003)
    first, second = _engine(tiny[1]), _engine(tiny[1])
    try:
        first.start()
        try:
            assert sys.getswitchinterval() == pytest.approx(gil_handoff.SWITCH_INTERVAL_US / 1e6)
            second.start()
            await second.stop()
            assert sys.getswitchinterval() == pytest.approx(gil_handoff.SWITCH_INTERVAL_US / 1e6)  # the first still serves
        finally:
            await first.stop()
        assert sys.getswitchinterval() == pytest.approx(0.003)
    finally:
        sys.setswitchinterval(found)


async def test_admission_pacing_holds_a_late_request_back_only_with_graphs_and_keeps_outputs(tiny, make_engine):
    ref_model, _ = tiny
    engine = make_engine(admit_ratio=0.5, max_admit_delay_steps=3)
    prompts = [_prompt(n, seed) for seed, n in enumerate([5, 7, 6, 8, 4])]
    first = [asyncio.ensure_future(_collect(engine, _greedy(p, 24))) for p in prompts[:4]]
    while not (len(engine.scheduler.running) == 4 and all(s.num_uncomputed <= 1 for s in engine.scheduler.running)):
        await asyncio.sleep(0.001)  # all four decode now
    late = await _collect(engine, _greedy(prompts[4], 6))  # 1 ready < 0.5 x 4 running: held back (graphs)
    results = await asyncio.gather(*first) + [late]
    for prompt, (ids, _, _), n in zip(prompts, results, [24] * 4 + [6]):
        assert ids == _hf_greedy(ref_model, prompt, n)[0]
    held = engine.scheduler.deferred_steps
    assert (1 <= held <= 3) if engine.graphs is not None else held == 0, (held, engine.scheduler.steps)
    _assert_idle(engine)


async def test_the_engine_paces_admissions_only_when_it_has_graphs(tiny, monkeypatch):
    engine = _engine(tiny[1], admit_ratio=0.5)  # on CPU: no graphs captured, every step eager
    assert engine.graphs is None and engine.scheduler.admit_ratio == 0.0

    def graphs(model, kv_cache, config, max_loras, device, ranks=None):
        return DecodeGraphs(model, kv_cache, 4, config.max_model_len, max_loras, device)  # as if captured: largest 4

    monkeypatch.setattr(engine_mod, "capture_decode_graphs", graphs)
    engine = _engine(tiny[1], admit_ratio=0.5)
    assert engine.scheduler.admit_ratio == 0.5 and engine.scheduler.pace_max_running == engine.graphs.max_batch == 4


async def test_short_kv_cache_preempts_and_recomputes_without_changing_outputs(tiny, make_engine, caplog):
    ref_model, _ = tiny
    # 4 sequences of 10 + 14 tokens need 24 blocks of 4; there are 16: some get preempted.
    engine = make_engine(num_blocks=16, max_model_len=64)
    prompts = [_prompt(10, 10 + i) for i in range(4)]
    results = await asyncio.gather(*(_collect(engine, _greedy(p, 14)) for p in prompts))
    for prompt, (ids, _, _) in zip(prompts, results):
        assert ids == _hf_greedy(ref_model, prompt, 14)[0]
    assert any("preempted seq" in r.getMessage() for r in caplog.records)
    _assert_idle(engine)


async def test_consumer_stopping_early_frees_blocks_and_lease(tiny, make_engine, until):
    engine = make_engine(store=Store(tiny[1], ["a1"]))
    stream = engine.generate(_greedy(_prompt(30, 0), 50, adapter="a1"))
    first = await stream.__anext__()
    await stream.__anext__()
    assert first.adapter_digest == "sha256:a1"
    assert engine.allocator.num_free < engine.kv_cache.num_blocks
    assert engine.slots.state("a1").in_use == 1
    steps = len(engine.step_times)
    await stream.aclose()
    await _freed_within_steps(engine, steps, until)  # a step in flight finishes, then the deferred lease is released


async def test_cancelled_task_frees_blocks_and_lease(tiny, make_engine, until):
    engine = make_engine(store=Store(tiny[1], ["a1"]))
    got = asyncio.Event()

    async def consume():
        async for _ in engine.generate(_greedy(_prompt(30, 1), 80, adapter="a1")):
            got.set()

    task = asyncio.create_task(consume())
    await got.wait()
    steps = len(engine.step_times)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _freed_within_steps(engine, steps, until)
    # The engine goes on serving.
    ids, _, _ = await _collect(engine, _greedy(_prompt(5, 2), 3))
    assert len(ids) == 3


async def test_eos_ends_the_request_without_text(tiny, make_engine, until):
    ref_model, _ = tiny
    prompt = _prompt(8, 3)
    ref = _hf_greedy(ref_model, prompt, 12)[0]
    k = next(i for i in range(2, 12) if ref[i] not in ref[:i])  # first fresh token after two
    engine = make_engine(eos={ref[k]})
    ids, text, outs = await _collect(engine, _greedy(prompt, 12))
    assert ids == ref[: k + 1] and outs[-1].finish_reason == "eos"
    assert text == engine.tokenizer.decode(ref[:k])
    await until(lambda: _idle(engine))  # the step planned past the eos ends; its row is dropped
    _assert_idle(engine)
    assert (engine.steps_ahead > 0) == (engine.graphs is not None)


async def test_stop_string_is_cut_from_the_output(tiny, make_engine, until):
    ref_model, _ = tiny
    engine = make_engine()
    # A prompt whose greedy text has a two-character piece that first appears after a few chars.
    for seed in range(20):
        prompt = _prompt(6, 100 + seed)
        full = engine.tokenizer.decode(_hf_greedy(ref_model, prompt, 16)[0])
        cut = next((i for i in range(3, len(full) - 2) if full[i : i + 2] not in full[: i + 1]), None)
        if cut is not None:
            break
    stop = full[cut : cut + 2]
    req = GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=16, stop=("zzzz", stop)))
    ids, text, outs = await _collect(engine, req)
    assert text == full[:cut] and outs[-1].finish_reason == "stop"
    assert engine.tokenizer.decode(ids).startswith(full[:cut] + stop)
    await until(lambda: _idle(engine))
    _assert_idle(engine)
    assert (engine.steps_ahead > 0) == (engine.graphs is not None)


async def test_max_tokens_default_and_max_model_len(tiny, make_engine):
    engine = make_engine(default_max_tokens=4, max_model_len=20)
    ids, _, outs = await _collect(engine, GenerationRequest(prompt="hello"))
    assert len(ids) == 4 and outs[-1].finish_reason == "length"
    # 17 prompt tokens in a 20-token sequence leave room for 3, whatever max_tokens says.
    ids, _, outs = await _collect(engine, _greedy(_prompt(17, 4), 10))
    assert len(ids) == 3 and outs[-1].finish_reason == "length"


async def test_seeded_sampling_is_reproducible_across_batches(make_engine, monkeypatch):
    """... with each sampling step's temperature / top-k / top-p staged through the engine's
    SamplingInputs (on CUDA read by a kernel from pinned memory, not copied), the greedy rows of a
    batch with them: temperature 0, top_k 0, top_p 1."""
    engine = make_engine()
    staged, stage = [], engine.runner.sampling_inputs.stage
    monkeypatch.setattr(engine.runner.sampling_inputs, "stage", lambda *rows: staged.append(rows) or stage(*rows))
    req = dict(prompt_token_ids=_prompt(7, 5), sampling=SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=42))
    alone, _, _ = await _collect(engine, GenerationRequest(**req))
    assert len(staged) == 10 and all(list(rows) == [[1.0], [0], [0.9]] for rows in staged)
    crowd = await asyncio.gather(
        _collect(engine, GenerationRequest(**req)),
        *(_collect(engine, _greedy(_prompt(20, s), 6)) for s in range(3)),
    )
    assert crowd[0][0] == alone
    assert any(sorted(rows[0]) == [0.0, 0.0, 0.0, 1.0] and sorted(rows[2]) == [0.9, 1.0, 1.0, 1.0] for rows in staged)


def _sampler_draws(ref_model, prompt: list[int], p: SamplingParams, n_tokens: int) -> list[int]:
    """What the sampler itself draws for one seeded request: one generator, one row per step, on
    transformers' logits of the sequence so far."""
    gen, ids = make_generator(p.seed, torch.device("cpu")), []
    for _ in range(n_tokens):
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt + ids])).logits[0, -1:].float()
        token, _ = sample(logits, torch.tensor([p.temperature]), torch.tensor([p.top_k]), torch.tensor([p.top_p]), [gen])
        ids.append(int(token))
    return ids


async def _seeded_runs(engine: Engine, prompt: list[int], n_tokens: int, seeds, **sampling) -> list[list[int]]:
    """One request per seed, all at once (the engine batches them); the tokens of each."""
    reqs = [
        GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=n_tokens, seed=s, **sampling))
        for s in seeds
    ]
    return [ids for ids, _, _ in await asyncio.gather(*(_collect(engine, r) for r in reqs))]


# Statistics below use fixed seeds, so they are deterministic; the false-failure rates given are
# those of the same checks over random seeds (the code under test being right).
async def test_temperature_samples_through_the_engine_as_the_sampler_draws(tiny, make_engine):
    ref_model, _ = tiny
    engine = make_engine()
    prompt = _prompt(7, 5)
    # 1. The first token over 200 seeds: each the very token the sampler draws for that seed on the
    #    model's logits (a forced-greedy or unseeded engine fails this at once) ...
    seeds = range(200)
    firsts = [ids[0] for ids in await _seeded_runs(engine, prompt, 1, seeds, temperature=1.0)]
    assert firsts == [_sampler_draws(ref_model, prompt, SamplingParams(temperature=1.0, seed=s), 1)[0] for s in seeds]
    # ... and the draws follow softmax(logits), not argmax: the argmax's count is Binomial(200, p_max)
    # (p_max is 0.04 here; within 5 sigma: false failure < 1e-6), and 200 draws over this flat
    # distribution hit about 115 +- 7 distinct tokens (at least 80: false failure < 1e-6).
    with torch.no_grad():
        probs = torch.softmax(ref_model(torch.tensor([prompt])).logits[0, -1].double(), -1)
    p_max, top = probs.max().item(), int(probs.argmax())
    n_top, sigma = firsts.count(top), (200 * p_max * (1 - p_max)) ** 0.5
    assert abs(n_top - 200 * p_max) < 5 * sigma, (n_top, p_max)
    assert len(set(firsts)) >= 80, sorted(set(firsts))
    # 2. Longer seeded outputs, sampled step after step from each request's own generator, while
    #    their neighbours in the batch are other seeded requests.
    runs = await _seeded_runs(engine, prompt, 6, range(12), temperature=0.8)
    assert runs == [_sampler_draws(ref_model, prompt, SamplingParams(temperature=0.8, seed=s), 6) for s in range(12)]
    assert len({tuple(r) for r in runs}) > 6
    _assert_idle(engine)


def _kept_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k / top-p leave (computed here, not by the sampler): the k best, and the
    smallest best-first prefix whose probability at this temperature reaches top_p."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    keep = order[:top_k] if top_k else order
    if top_p < 1:
        kept_probs = probs[keep] / probs[keep].sum()
        n = int((kept_probs.cumsum(0) < top_p).sum()) + 1
        keep = keep[:n]
    return set(keep.tolist())


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.2), (12, 0.3)])
async def test_top_k_and_top_p_cut_through_the_engine(tiny, make_engine, top_k, top_p):
    ref_model, _ = tiny
    engine = make_engine()
    prompt, temperature, seeds = _prompt(9, 8), 1.5, range(64)
    with torch.no_grad():
        logits = ref_model(torch.tensor([prompt])).logits[0, -1]
    kept = _kept_tokens(logits, temperature, top_k, top_p)
    firsts = [ids[0] for ids in await _seeded_runs(engine, prompt, 1, seeds, temperature=temperature, top_k=top_k, top_p=top_p)]
    assert set(firsts) <= kept, (sorted(set(firsts) - kept), len(kept))
    # The cut keeps 3, 21 and 4 tokens here, each with probability >= 0.038 after it: 64 draws all
    # of one token (a greedy engine) would happen by chance with probability < 1e-29.
    assert 1 < len(kept) < 40 and len(set(firsts)) > 1
    expected = [
        _sampler_draws(ref_model, prompt, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=s), 1)[0]
        for s in seeds
    ]
    assert firsts == expected


async def test_adapter_output_does_not_depend_on_its_batch(tiny, make_engine):
    engine = make_engine(store=Store(tiny[1], ["a1", "a2"]))
    prompts = [_prompt(9, 20), _prompt(14, 21)]
    cases = [(p, a) for p in prompts for a in ("", "a1", "a2")]
    alone = [(await _collect(engine, _greedy(p, 8, adapter=a)))[0] for p, a in cases]
    together = await asyncio.gather(*(_collect(engine, _greedy(p, 8, adapter=a)) for p, a in cases))
    assert [r[0] for r in together] == alone
    # The adapters change the output (they are not no-ops).
    assert alone[0] != alone[1] and alone[0] != alone[2]
    _assert_idle(engine)


async def test_steps_read_each_slot_to_its_adapters_rank(tiny, make_engine, monkeypatch):
    """Every step's LoraMeta (eager, and the graphs' static buffer) carries each slot's adapter
    rank (SlotManager.slot_ranks, from the loaded shard), so the CUDA kernels read a rank-4
    adapter's rank-4 bytes out of the rank-8 slots."""
    from loraserve.executor.engine import graphs as graphs_mod
    from loraserve.executor.engine import step as step_mod

    seen = []
    for mod in (step_mod, graphs_mod):
        real = mod.make_lora_meta

        def spy(token_slots, max_loras, host_slots=None, slot_ranks=None, block_m=None, real=real):
            meta = real(token_slots, max_loras, host_slots, slot_ranks, block_m)
            seen.append((token_slots.tolist(), None if slot_ranks is None else slot_ranks.tolist()))
            return meta

        monkeypatch.setattr(mod, "make_lora_meta", spy)
    engine = make_engine(store=Store(tiny[1], ["a1", "a2"], rank=4))
    await asyncio.gather(*(_collect(engine, _greedy(_prompt(6, 30 + i), 5, adapter=a)) for i, a in enumerate(("a1", "a2"))))
    used = [(slots, ranks) for slots, ranks in seen if max(slots) >= 0]
    assert used, "no step used an adapter"
    assert engine.slots.slot_ranks == [4, 4]  # rank 4 shards in both slots (max_rank 8)
    for slots, ranks in used:
        assert ranks is not None and all(ranks[s] == 4 for s in slots if s >= 0), (slots, ranks)


async def test_request_with_missing_adapter_fails_alone(tiny, make_engine):
    ref_model, _ = tiny
    engine = make_engine()
    prompt = _prompt(6, 7)
    good = asyncio.create_task(_collect(engine, _greedy(prompt, 8)))
    with pytest.raises(StatusError) as info:
        await _collect(engine, _greedy(prompt, 8, adapter="missing"))
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert info.value.message == "adapter 'missing' is not registered"
    assert (await good)[0] == _hf_greedy(ref_model, prompt, 8)[0]
    _assert_idle(engine)


@pytest.mark.parametrize(
    "req, message",
    [
        (GenerationRequest(prompt_token_ids=[5], sampling=SamplingParams(temperature=-1)), "temperature"),
        (GenerationRequest(prompt_token_ids=[5], sampling=SamplingParams(top_k=100_000)), "top_k"),
        (GenerationRequest(prompt_token_ids=[], sampling=SamplingParams()), "prompt is empty"),
        (GenerationRequest(prompt="", sampling=SamplingParams()), "prompt is empty"),
        (GenerationRequest(prompt_token_ids=[5] * 96), "prompt of 96 tokens exceeds max_model_len 96"),
        (GenerationRequest(prompt_token_ids=[5, 999]), "token_ids: 999 is outside the vocabulary of 256 tokens"),
        (GenerationRequest(), "exactly one of prompt, chat messages or token_ids is required"),
        (GenerationRequest(messages=[{"role": "user", "content": "hi"}]), "chat: "),
    ],
)
async def test_bad_requests_are_invalid_argument(make_engine, req, message):
    engine = make_engine()
    with pytest.raises(StatusError) as info:
        await _collect(engine, req)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.message
    _assert_idle(engine)


async def test_deadline_exceeded_frees_the_sequence(make_engine, until):
    engine = make_engine()
    req = _greedy(_prompt(10, 8), 90, request_id="r1", deadline=time.monotonic() + 0.05)
    with pytest.raises(StatusError) as info:
        await _collect(engine, req)
    steps = len(engine.step_times)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.value.message == "request r1: deadline exceeded"
    await _freed_within_steps(engine, steps, until)


async def test_stop_cancels_live_requests(make_engine):
    engine = make_engine()
    stream = engine.generate(_greedy(_prompt(10, 9), 90))
    await stream.__anext__()
    await engine.stop()
    rest = [o async for o in stream]
    assert rest[-1].finish_reason == "cancelled"
    _assert_idle(engine)


async def test_a_crashed_step_loop_fails_its_requests_and_gives_their_slots_back(tiny, make_engine, monkeypatch, until):
    """The loop dies (a bug in planning, here injected): every live request gets INTERNAL, and the
    leases held back for steps in flight go back, so the adapter can be evicted."""
    engine = make_engine(store=Store(tiny[1], ["a1"]))
    stream = engine.generate(_greedy(_prompt(12, 5), 60, adapter="a1"))
    await stream.__anext__()

    def broken(*args, **kwargs):
        raise RuntimeError("planning bug")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    with pytest.raises(StatusError) as err:
        async for _ in stream:
            pass
    assert err.value.code == grpc.StatusCode.INTERNAL and "engine stopped: RuntimeError: planning bug" in err.value.message
    await until(lambda: engine.slots.state("a1").in_use == 0 and engine._deferred_releases == [])


class GatedStore(Store):
    """Store whose fetches of `cold` wait for `gate` (a slow store, a cold cache)."""

    def __init__(self, model, names, cold: str | tuple[str, ...]):
        super().__init__(model, names)
        self.cold, self.gate = {cold} if isinstance(cold, str) else set(cold), asyncio.Event()
        self.fetching: list[str] = []  # fetches started, in order

    async def fetch(self, name):
        self.fetching.append(name)
        if name in self.cold:
            await self.gate.wait()
        return await super().fetch(name)


async def _first_token_time(engine: Engine, req: GenerationRequest, times: dict, key: str):
    async for out in engine.generate(req):
        times.setdefault(key, time.monotonic())
    times[key + " done"] = time.monotonic()


async def test_a_cold_adapters_request_is_admitted_in_arrival_order_once_its_adapter_lands(tiny, make_engine, until):
    """One running seat: the cold adapter's request arrived before `later`; its adapter lands while
    another request runs, and it runs next, before `later` (queued at arrival, admitted on landing)."""
    store = GatedStore(tiny[1], ["cold"], cold="cold")
    engine = make_engine(store=store, max_num_seqs=1)
    times: dict[str, float] = {}
    first = asyncio.create_task(_first_token_time(engine, _greedy(_prompt(5, 1), 80), times, "first"))
    await until(lambda: "first" in times)  # running
    cold = asyncio.create_task(_first_token_time(engine, _greedy(_prompt(5, 2), 4, adapter="cold"), times, "cold"))
    await asyncio.sleep(0.01)  # `cold` arrives first (its fetch waits at the gate) ...
    later = asyncio.create_task(_first_token_time(engine, _greedy(_prompt(5, 3), 4), times, "later"))
    await until(lambda: len(engine._runs) == 3)  # ... then `later` is queued (`cold` is, since it arrived)
    store.gate.set()
    await until(lambda: engine.slots.state("cold").slot >= 0)  # the cold adapter lands
    assert "first done" not in times  # ... while `first` still runs (80 tokens)
    await asyncio.wait_for(asyncio.gather(first, cold, later), 30)
    assert times["first done"] <= times["cold"] < times["later"]
    _assert_idle(engine)


async def test_a_cold_adapter_does_not_hold_up_other_requests(tiny, make_engine):
    store = GatedStore(tiny[1], ["cold", "hot"], cold="cold")
    engine = make_engine(store=store)
    cold = asyncio.create_task(_collect(engine, _greedy(_prompt(5, 2), 4, adapter="cold")))
    await asyncio.sleep(0.01)
    for adapter in ("", "hot"):  # served while the cold adapter's fetch is still waiting
        ids, _, _ = await asyncio.wait_for(_collect(engine, _greedy(_prompt(5, 3), 4, adapter=adapter)), 30)
        assert len(ids) == 4
    assert not cold.done() and len(engine.scheduler.waiting) == 1  # queued, not admitted
    store.gate.set()
    assert len((await asyncio.wait_for(cold, 30))[0]) == 4
    _assert_idle(engine)


async def test_a_resident_adapters_request_runs_within_steps_while_cold_loads_hold_every_load_seat(tiny, make_engine, until):
    """One load seat, held by a stalled store fetch, a second cold load queued for it: a request for
    an adapter in a slot arrives behind both and gets its first token within a few steps (the step
    in flight, one launched ahead, its own, and one launched ahead of it before its token is
    delivered; on a busy CPU its arrival (tokenized in a worker thread) can miss one more planning:
    up to 6, where waiting for the cold loads would never end before the gate opens); one for an
    adapter in the CPU cache is served too, both while the cold loads wait."""
    store = GatedStore(tiny[1], ["cold-1", "cold-2", "hot", "warm"], cold=("cold-1", "cold-2"))
    engine = make_engine(store=store, max_concurrent_loads=1)
    await engine.slots.load("hot")  # in a slot
    await engine.slots.load("warm", into_slot=False)  # in the CPU cache only
    times: dict[str, float] = {}
    running = asyncio.create_task(_first_token_time(engine, _greedy(_prompt(5, 1), 80), times, "running"))
    await until(lambda: "running" in times)  # steps go on from here
    cold = [asyncio.create_task(_collect(engine, _greedy(_prompt(5, 2), 4, adapter=n))) for n in ("cold-1", "cold-2")]
    await until(lambda: store.fetching[-1:] == ["cold-1"] and len(engine.scheduler.waiting) == 2)
    sent = time.perf_counter()
    ids, _, _ = await asyncio.wait_for(_collect(engine, _greedy(_prompt(5, 3), 1, adapter="hot")), 30)
    steps = [t for t in engine.step_times if t.end > sent]
    assert len(ids) == 1 and 1 <= len(steps) <= 6, len(steps)
    ids, _, _ = await asyncio.wait_for(_collect(engine, _greedy(_prompt(5, 3), 1, adapter="warm")), 30)
    assert len(ids) == 1  # its copy into a slot takes no seat (steps go on meanwhile: not counted)
    assert "running done" not in times and not any(t.done() for t in cold)
    assert store.fetching[-1] == "cold-1"  # cold-2 still waits for the seat
    store.gate.set()
    assert [len((await asyncio.wait_for(t, 30))[0]) for t in cold] == [4, 4]
    await asyncio.wait_for(running, 30)
    _assert_idle(engine)


def test_step_kind_picks_a_graph_only_where_one_takes_the_step():
    """batch.step_kind: decode batches up to the largest decode graph replay it; steps with a
    prefill chunk replay a mixed graph when one fits their tokens and sequences and no token is a
    placeholder of the previous step; everything else runs eagerly (and without graphs, all)."""
    from types import SimpleNamespace

    class Fits:
        def fits(self, tokens, seqs):
            return tokens <= 96 and seqs <= 4

    def batch(query_lens, sources=None, long_rope=None):
        n = sum(query_lens)
        return SimpleNamespace(
            is_decode=all(q == 1 for q in query_lens), query_lens=query_lens, input_ids=[0] * n, sources=sources or [-1] * n,
            long_rope=long_rope,
        )  # fmt: skip

    graphed = (SimpleNamespace(max_batch=4), Fits())
    kind = lambda graphs, b: step_kind(b, *graphs)  # noqa: E731
    assert kind(graphed, batch([1, 1, 1])) == "decode-graph"
    assert kind(graphed, batch([1] * 5)) == "decode"  # past the largest decode graph
    assert kind(graphed, batch([1, 7, 30])) == "mixed-graph"
    assert kind(graphed, batch([1, 95, 1])) == "mixed"  # 97 tokens: past the largest bucket
    assert kind(graphed, batch([1, 2, 3, 4, 5])) == "mixed"  # more sequences than the graphs hold
    assert kind(graphed, batch([1, 7], [2, -1, -1, -1, -1, -1, -1, -1])) == "mixed"  # a placeholder id
    assert kind(graphed, batch([1, 1], long_rope=[False, True])) == "decode"  # a 1-token LongRoPE prompt chunk
    assert kind(graphed, batch([1, 7], long_rope=[False, True])) == "mixed-graph"
    eager = (None, None)
    assert kind(eager, batch([1, 1])) == "decode" and kind(eager, batch([1, 7])) == "mixed"


# ---- prefix caching (engine/prefix_cache.py) ----------------------------------------------------

SYSTEM = _prompt(13, 90)  # a shared prefix: 3 full blocks of 4, and a token more


def _no_block_held(engine: Engine) -> bool:
    alloc = engine.allocator
    return alloc.num_held == 0 and all(alloc.refs(b) == 0 for b in range(alloc.num_blocks))


async def test_prefix_caching_keeps_greedy_outputs_of_the_base_model_and_adapters_alone_and_mixed(tiny, make_engine):
    ref_model, model = tiny
    store = Store(model, ["a1", "a2"])
    cold = make_engine(store=store, prefix_caching=False)
    prompts = [SYSTEM + _prompt(n, 30 + n) for n in (1, 3, 7)] + [SYSTEM[:12]]  # the last: exactly 3 blocks
    cases = [(p, a) for p in prompts for a in ("", "a1", "a2")]
    want = [(await _collect(cold, _greedy(p, 6, adapter=a)))[0] for p, a in cases]
    assert [w for w, (p, a) in zip(want, cases) if not a] == [_hf_greedy(ref_model, p, 6)[0] for p in prompts]
    assert cold.allocator.num_cached == 0 and cold._cache_seed("", "") is None
    await cold.stop()  # the engines share the model's slot buffers: one at a time

    engine = make_engine(store=store)
    alone = [(await _collect(engine, _greedy(p, 6, adapter=a))) for p, a in cases]
    assert [ids for ids, _, _ in alone] == want
    cached = [outs[-1].cached_tokens for _, _, outs in alone]
    # The same prompt under another adapter (or the base model) shares nothing; the shared system
    # prefix is found under the same adapter; the block-aligned prompt computes its last block.
    assert cached == [0, 0, 0] + [12, 12, 12] * 2 + [8, 8, 8]
    together = await asyncio.gather(*(_collect(engine, _greedy(p, 6, adapter=a)) for p, a in cases))
    assert [ids for ids, _, _ in together] == want
    assert [outs[-1].cached_tokens for _, _, outs in together] == [(len(p) - 1) // 4 * 4 for p, _ in cases]
    assert all(o.cached_tokens == outs[-1].cached_tokens for _, _, outs in together for o in outs)
    _assert_idle(engine)
    assert _no_block_held(engine) and engine.allocator.num_cached > 0
    assert engine._cache_seed("a1", "") is None  # a version without a content digest is never cached


async def test_a_prompt_cached_but_its_last_token_runs_as_a_decode_row_with_the_outputs_of_caching_off(tiny, make_engine):
    """A prompt whose full blocks are cached and one token is left computes that token alone at
    its last position: its first step is decode-shaped (batch.step_kind: one query token a
    sequence), a step a decode graph replays where the engine has graphs. Its tokens and logprobs
    (greedy, base model and adapter, and seeded sampling), alone and beside other requests, are
    those of caching off."""
    _, model = tiny
    store = Store(model, ["a1"])

    def req(prompt, adapter="", sampling=None):
        sampling = sampling or SamplingParams(max_tokens=5)
        return GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=sampling, return_logprobs=True)

    cases = [(SYSTEM, ""), (SYSTEM, "a1"), (SYSTEM, "", SamplingParams(temperature=1.0, max_tokens=5, seed=7))]
    others = [(_prompt(9, 41), ""), (_prompt(6, 42), "a1"), (SYSTEM + _prompt(5, 44), "a1")]
    results = {}
    for caching in (False, True):
        engine = make_engine(store=store, prefix_caching=caching)
        for adapter in ("", "a1"):  # files SYSTEM's 3 full blocks under both chains (caching on)
            await _collect(engine, req(SYSTEM + _prompt(2, 43), adapter))
        alone = []
        for case in cases:
            before = len(engine.step_times)
            alone.append(await _collect(engine, req(*case)))
            first = engine.step_times[before]
            if caching:  # 12 of 13 prompt tokens cached: one token at position 12, as a decode row
                assert (first.num_seqs, first.num_tokens) == (1, 1)
                assert first.kind == ("decode-graph" if engine.graphs is not None else "decode")
            else:
                assert (first.num_tokens, first.kind) == (13, "mixed")
        together = await asyncio.gather(*(_collect(engine, req(*c)) for c in cases + others))
        results[caching] = alone + together
        assert [outs[-1].cached_tokens for _, _, outs in alone] == [12 if caching else 0] * 3
        assert [outs[-1].cached_tokens for _, _, outs in together] == ([12, 12, 12, 0, 0, 12] if caching else [0] * 6)
        _assert_idle(engine)
        await engine.stop()  # the engines share the model's slot buffers: one at a time
    for (ids, _, outs), (want_ids, _, want_outs) in zip(results[True], results[False]):
        assert ids == want_ids
        assert [lp for o in outs for lp in o.logprobs] == pytest.approx([lp for o in want_outs for lp in o.logprobs], abs=1e-5)


async def test_admission_pacing_admits_a_request_cached_but_for_its_last_token_at_once(tiny, make_engine):
    """Pacing holds a request that needs a prefill (test_admission_pacing_holds_a_late_request_back...);
    one whose prompt is cached but for its last token joins the decoding batch as a decode row at once."""
    ref_model, _ = tiny
    engine = make_engine(admit_ratio=0.5, max_admit_delay_steps=16)
    await _collect(engine, _greedy(SYSTEM, 1))  # files SYSTEM's 3 full blocks
    prompts = [_prompt(n, seed) for seed, n in enumerate([5, 7, 6, 8])]
    first = [asyncio.ensure_future(_collect(engine, _greedy(p, 24))) for p in prompts]
    while not (len(engine.scheduler.running) == 4 and all(s.num_uncomputed <= 1 for s in engine.scheduler.running)):
        await asyncio.sleep(0.001)  # all four decode now
    late = SYSTEM[:12] + _prompt(1, 45)
    ids, _, outs = await _collect(engine, _greedy(late, 6))  # 1 ready < 0.5 x 4 running, but a decode row
    assert ids == _hf_greedy(ref_model, late, 6)[0] and outs[-1].cached_tokens == 12
    assert engine.scheduler.deferred_steps == 0
    for prompt, (ids, _, _) in zip(prompts, await asyncio.gather(*first)):
        assert ids == _hf_greedy(ref_model, prompt, 24)[0]
    _assert_idle(engine)


async def test_prefix_caching_under_eviction_and_preemption_keeps_outputs(tiny, make_engine, caplog):
    ref_model, model = tiny
    # 16 blocks of 4: six 10 + 8 token sequences at once preempt; 12 prefixes cannot all stay cached.
    engine = make_engine(num_blocks=16, max_model_len=64)
    prompts = [_prompt(8, 50 + i % 6) + _prompt(2, 60 + i) for i in range(12)]  # pairs share an 8-token prefix
    want = [_hf_greedy(ref_model, p, 8)[0] for p in prompts]
    for _ in range(2):
        results = await asyncio.gather(*(_collect(engine, _greedy(p, 8)) for p in prompts))
        assert [ids for ids, _, _ in results] == want
    assert any("preempted seq" in r.getMessage() for r in caplog.records)
    assert any(outs[-1].cached_tokens for _, _, outs in results)
    assert engine.allocator.evictions > 0
    _assert_idle(engine)
    assert _no_block_held(engine)


async def test_a_thousand_short_requests_cancelled_preempted_or_not_leave_no_block_held(tiny, make_engine, caplog, until):
    engine = make_engine(store=Store(tiny[1], ["a1"]), num_blocks=12, max_model_len=40)
    rng = random.Random(1)
    prefixes = [_prompt(8, 70 + i) for i in range(4)]
    gate = asyncio.Semaphore(16)
    hits = cancelled = 0

    async def one(i: int) -> None:
        nonlocal hits, cancelled
        prompt = rng.choice(prefixes) + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 6))]
        req = _greedy(prompt, rng.randrange(1, 5), adapter=rng.choice(["", "a1"]))
        how = rng.choice(["whole", "whole", "after-first", "at-once"])
        async with gate:
            if how == "at-once":  # cancelled before (or just after) its admission
                task = asyncio.ensure_future(_collect(engine, req))
                await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                cancelled += 1
                return
            stream = engine.generate(req)
            async for out in stream:
                if how == "after-first":
                    cancelled += 1
                    break
            hits += bool(out.cached_tokens)  # the request's count, on each of its outputs
            await stream.aclose()

    await asyncio.gather(*(one(i) for i in range(1000)))
    await until(lambda: _idle(engine))
    assert hits > 100 and cancelled > 100
    assert any("preempted seq" in r.getMessage() for r in caplog.records)
    assert _no_block_held(engine) and engine.allocator.num_free == 12


async def test_dynamic_rope_never_shares_blocks_written_with_a_grown_base(hf_model):
    """Dynamic (NTK) RoPE grows its base in a step whose longest sequence passes max_position_embeddings
    (16 here): a longer prompt takes no cached prefix (computed whole, its prefix would take the grown
    base), and blocks written with a grown base are never filed; prompts within the length still share.
    Caching off is the reference (transformers' dynamic RoPE keeps the base of its longest call so far)."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}
    _, path = hf_model("llama", rope_parameters=rope, max_position_embeddings=16)
    model = load_model(path)
    cases = []
    for seed, short_first in ((3, True), (6, False)):
        prefix = _prompt(12, seed)
        short, long = (prefix + _prompt(1, seed + 1), 3), (prefix + _prompt(8, seed + 2), 4)  # 13 + 3 tokens; 20 tokens
        cases += [short, long] if short_first else [long, short]
    cases.append(cases[0])  # within the length: the plain-base blocks are shared
    results = {}
    for caching in (False, True):
        engine = _engine(model, max_model_len=32, prefix_caching=caching)
        engine.start()
        try:
            results[caching] = [await _collect(engine, _greedy(p, n, return_logprobs=True)) for p, n in cases]
            _assert_idle(engine)
        finally:
            await engine.stop()
    for (ids, _, outs), (want_ids, _, want_outs) in zip(results[True], results[False]):
        assert ids == want_ids
        assert [lp for o in outs for lp in o.logprobs] == pytest.approx([lp for o in want_outs for lp in o.logprobs], abs=1e-5)
    assert [outs[-1].cached_tokens for _, _, outs in results[True]] == [0, 0, 0, 0, 12]
