"""Sampling: request validation, next-token selection from logits, and stop-string detection.

(Incremental detokenization lives with the tokenizer: model/tokenizer.py.)

Pure functions of their inputs. Every row of a batch has its own temperature, top-k, top-p
and (optionally) its own seeded torch.Generator, so a seeded request draws the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraserve import kernels
from loraserve.errors import invalid


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 0 or 1: off
    max_tokens: int | None = None  # None: the executor's default (the engine resolves it)
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_request(
    params: SamplingParams,
    prompt_len: int,
    *,
    vocab_size: int,
    max_model_len: int,
    max_stop_strings: int,
    max_stop_string_chars: int,
) -> None:
    """Raises INVALID_ARGUMENT naming the first parameter at fault. max_tokens must be resolved."""
    t = params.temperature
    if math.isnan(t) or math.isinf(t) or t < 0:
        raise invalid(f"temperature must be a finite number >= 0, got {t}")
    if math.isnan(params.top_p) or not 0.0 <= params.top_p <= 1.0:
        raise invalid(f"top_p must be in [0, 1], got {params.top_p}")
    if not 0 <= params.top_k <= vocab_size:
        raise invalid(f"top_k must be in [0, vocab size {vocab_size}], got {params.top_k}")
    if not 1 <= params.max_tokens <= max_model_len:
        raise invalid(f"max_tokens must be in [1, max_model_len {max_model_len}], got {params.max_tokens}")
    if params.seed is not None and not 0 <= params.seed < 2**64:
        raise invalid(f"seed must be in [0, 2**64), got {params.seed}")
    if len(params.stop) > max_stop_strings:
        raise invalid(f"stop has {len(params.stop)} strings, at most {max_stop_strings} are allowed")
    for s in params.stop:
        if not s:
            raise invalid("stop strings must not be empty")
        if len(s) > max_stop_string_chars:
            raise invalid(f"stop string of {len(s)} characters exceeds the limit of {max_stop_string_chars}")
    if prompt_len == 0:
        raise invalid("prompt is empty")
    if prompt_len >= max_model_len:
        # At least one output token must fit in the sequence.
        raise invalid(
            f"prompt of {prompt_len} tokens exceeds max_model_len {max_model_len} "
            f"(prompt + output must fit, so at most {max_model_len - 1} prompt tokens)"
        )


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> the argmax of each row [B] int64 and its logprob [B] float32
    (one fused kernel on CUDA: kernels.greedy)."""
    return kernels.greedy(logits)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    any_sample: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Picks one token per row.

    logits:      [B, V] float32
    temperature: [B] float32, 0 = greedy (argmax)
    top_k:       [B] int64, 0 = off
    top_p:       [B] float32, <= 0 or >= 1 = off
    generators:  B entries, a seeded generator on logits' device or None (the global RNG)
    any_sample:  whether some temperature is > 0, when the caller knows it on the host (saves a
                 device->host sync); None: read it from `temperature`
    Returns token ids [B] int64 and their logprobs [B] float32 under the model's own
    distribution (log_softmax of the raw logits, before temperature and truncation).
    """
    logprobs_all = torch.log_softmax(logits, dim=-1)
    token_ids = logits.argmax(dim=-1)
    do_sample = temperature > 0
    if any_sample is None:
        any_sample = bool(do_sample.any())
    if any_sample:
        sampled = _sample_rows(logits, temperature, top_k, top_p, generators)
        token_ids = torch.where(do_sample, sampled, token_ids)
    logprobs = logprobs_all.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return token_ids, logprobs


def _sample_rows(logits, temperature, top_k, top_p, generators) -> torch.Tensor:
    num_rows, vocab = logits.shape
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp.unsqueeze(1)
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    # top-k: drop everything past the k-th best.
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    # top-p: keep the smallest prefix whose mass reaches p (the best token always stays).
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.where((top_p > 0) & (top_p < 1), top_p, torch.ones_like(top_p)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (rank > 0), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p; each row's noise
    # comes from its own generator, so seeded rows do not depend on their batch.
    noise = torch.empty_like(probs)
    seeded = [row for row, gen in enumerate(generators) if gen is not None]
    if len(seeded) < num_rows:
        noise.exponential_()  # one draw for every unseeded row; seeded rows are overwritten below
    for row in seeded:
        noise[row].exponential_(generator=generators[row])
    choice = (probs / noise).argmax(dim=-1, keepdim=True)  # index into the sorted order
    return sorted_idx.gather(1, choice).squeeze(1)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def find_stop(text: str, stops: Sequence[str], search_from: int) -> tuple[int | None, int]:
    """Looks for stop strings in text, incrementally.

    search_from: how much of text was already searched (the length returned as safe last time).
    Returns (index where the first stop string begins, or None;
             length of the text prefix that can be emitted: it cannot be the start of a stop string).
    """
    if not stops:
        return None, len(text)
    longest = max(len(s) for s in stops)
    start = max(0, search_from - longest + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    if hits:
        return min(hits), min(hits)
    # Hold back a tail that could still grow into a stop string.
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return None, len(text) - held
