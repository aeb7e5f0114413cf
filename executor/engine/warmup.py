"""Kernel warm-up at start: eager steps over a ladder of token counts, before the first request.

Why: Triton compiles a kernel the first time it meets a new set of compile-time values, and the
LoRA kernels' values follow the step's token count (the block sizes and split-K that the tuning
tables pick for it, kernels/tuning.py; whether a launch fits in one wave). Steps replay CUDA
graphs captured at start (whose captures build their kernels), but whatever runs eagerly (every
step without graphs; decode batches past the largest graph; float32 and MoE prefill) meets
whatever token count the arrivals make, and a compile takes ~0.1-1 s and holds the whole step
(and every stream in it). Warming up moves that to start, where it is logged and timed, and
Triton's disk cache makes it short on the next start.

`warm_up_engine` runs the steps below through the engine's eager forward, then the sampler's greedy
kernel (kernels.greedy) on each step's logits, and the lm_head at every sampled-row count of
`token_ladder(max_num_seqs)`.

The steps: one sequence's prefill first (its KV is then written, so later steps' decode row reads
only what was written), then, for every token count T of `token_ladder`, one step of T tokens:
that sequence's decode row plus a T - 1 token prefill chunk cut into sequences of at most
max_model_len. Every other token uses LoRA slot 0 (all zeros at start), and the steps run every
LoRA module's kernels over whole slots as a captured graph does (`StepInputs.every_slot`: slot 0
targets no module yet, so a normal step would skip them all), on every rank alike. Then slot 0 is
zeroed through the slot-load kernel (kernels/triton_copy.py) at each word width it may move
(slot_load.warm_slot_scatter), which builds it before the first adapter load; the attention kernels are
not specialised on what varies with a step's sequences (table width, their count), so the ladder's
steps cover every step's variant. What the steps leave in the KV cache is what any freed block
holds: never read (a sequence reads only the positions it wrote).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from loraserve.kernels.tuning import tuned_token_counts

from ..config import ExecutorConfig
from ..lora import lora_modules
from ..slot_load import warm_slot_scatter
from .kv_cache import KVCache
from .sampler import greedy
from .step import StepInputs, forward_step

log = logging.getLogger(__name__)

FIRST_LEN = 32  # tokens of the sequence whose decode row every ladder step carries


def token_ladder(max_tokens: int, tuned: tuple[int, ...] = ()) -> list[int]:
    """Token counts to warm: 1, 2, 3, 4, 6, 8, 12, 16, ... (two per octave) up to max_tokens, each
    tuned count of the tables (`tuned`) in range, and max_tokens itself."""
    counts, p = {max_tokens}, 1
    while p <= max_tokens:
        counts.add(p)
        if p * 3 // 2 <= max_tokens and p > 1:
            counts.add(p * 3 // 2)
        p *= 2
    counts.update(t for t in tuned if 1 <= t <= max_tokens)
    return sorted(counts)


def warm_up_steps(
    max_tokens: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    max_loras: int,
    vocab_size: int,
    tuned: tuple[int, ...] = (),
    packed_rank: int = 0,
) -> list[StepInputs]:
    """The warm-up's steps (see the module docstring); token counts that do not fit the KV cache
    (num_blocks) or max_model_len are left out. packed_rank: the slot rank, for slots whose B is
    packed (slot_layout.packs_b_on): their expand reads each slot at the rank the step gives it, here
    the whole slot (slot 0 holds zeros)."""
    slot = 0 if max_loras else -1
    ranks = [packed_rank] * max_loras if packed_rank and max_loras else None
    first_len = min(FIRST_LEN, max_model_len - 1)
    first_blocks = list(range(-(-(first_len + 1) // block_size)))  # room for the decode row's token
    free = num_blocks - len(first_blocks)
    steps = [_step([(first_len, 0, first_blocks)], [0] * first_len, slot, ranks)]
    for t in token_ladder(max_tokens, tuned):
        seqs, next_block, left = [(1, first_len, first_blocks)], len(first_blocks), t - 1
        while left > 0:
            n = min(left, max_model_len)
            blocks = list(range(next_block, next_block + -(-n // block_size)))
            next_block += len(blocks)
            seqs.append((n, 0, blocks))
            left -= n
        if next_block - len(first_blocks) > free:
            continue
        steps.append(_step(seqs, [(7 * i) % vocab_size for i in range(t)], slot, ranks))
    return steps


def _step(
    seqs: list[tuple[int, int, list[int]]], input_ids: list[int], slot: int, slot_ranks: list[int] | None = None
) -> StepInputs:
    """seqs: (query_len, context_len: tokens already cached before it, block table) of each sequence."""
    query_lens = [q for q, _, _ in seqs]
    sample_rows = [sum(query_lens[: i + 1]) - 1 for i in range(len(seqs))]
    token_slots = [slot if i % 2 == 0 else -1 for i in range(len(input_ids))]
    return StepInputs(
        input_ids=input_ids,
        query_lens=query_lens,
        context_lens=[c for _, c, _ in seqs],
        block_tables=[b for _, _, b in seqs],
        token_slots=token_slots,
        sample_rows=sample_rows,
        sample_slots=[token_slots[r] for r in sample_rows],
        every_slot=True,
        slot_ranks=slot_ranks,
    )


def warm_up(run_step: Callable[[StepInputs], object], steps: list[StepInputs], device: torch.device) -> float:
    """Runs the steps (`run_step`: the engine's eager forward, on every rank); the seconds it took."""
    t0 = time.perf_counter()
    for i, step in enumerate(steps):
        run_step(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if time.perf_counter() - t0 > 10 and i % 4 == 0:
            log.info(
                "warming up kernels: step %d of %d (%d tokens), %.0fs",
                i + 1,
                len(steps),
                len(step.input_ids),
                time.perf_counter() - t0,
            )
    seconds = time.perf_counter() - t0
    log.info(
        "warmed up the kernels: %d eager steps of 1-%d tokens in %.1fs", len(steps), max(len(s.input_ids) for s in steps), seconds
    )
    return seconds


def warm_up_engine(model, kv: KVCache, config: ExecutorConfig, max_loras: int, device: torch.device, ranks=None) -> float | None:
    """Builds an engine's eager-step Triton kernels before its first request (see the module
    docstring): on CUDA, on every rank (`ranks`: executor/ranks.py's TPRanks, or None); the seconds
    it took, None off CUDA."""
    if device.type != "cuda":
        return None
    spec = getattr(model, "lora_spec", None)
    steps = warm_up_steps(
        config.max_num_batched_tokens,
        config.max_model_len,
        kv.block_size,
        kv.num_blocks,
        max_loras,
        model.cfg.vocab_size,
        tuned_token_counts(device),
        packed_rank=spec.max_rank if spec is not None else 0,
    )  # B packed on CUDA

    def run(step: StepInputs) -> None:
        if ranks is not None:
            ranks.step(step)
        with torch.cuda.device(device):
            logits = forward_step(model, kv, step, max_loras, device)
            if logits is not None:
                greedy(logits)  # the sampler's fused greedy kernel (kernels.greedy) too

    seconds = warm_up(run, steps, device)
    if ranks is None:  # (under TP, compute_logits gathers across ranks: their steps warm it)
        # the lm_head (a skinny GEMM at up to 64 rows, kernels/triton_linear.py) at every
        # sampled-row count an eager step may bring: the ladder's steps sample 1-2 rows (the
        # greedy kernel above is built once for any row count)
        rows = token_ladder(config.max_num_seqs)
        hidden = torch.zeros(rows[-1], model.cfg.hidden_size, dtype=model.dtype, device=device)
        with torch.cuda.device(device):
            for n in rows:
                model.compute_logits(hidden[:n], None)
            torch.cuda.synchronize(device)
    modules = lora_modules(model).values()
    if max_loras and modules:  # the slot-load kernel too, each word width (slot 0 holds nothing yet:
        # zeroing it changes nothing)
        with torch.cuda.device(device):
            warm_slot_scatter(modules, 0)
            torch.cuda.synchronize(device)
    return seconds
