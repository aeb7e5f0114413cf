"""Sampling: greedy/seeded/truncated selection, request validation, stop strings."""

from __future__ import annotations

import grpc
import pytest
import torch

from loraserve.errors import StatusError
from loraserve.executor.engine.sampler import (
    SamplingParams,
    find_stop,
    make_generator,
    sample,
    validate_request,
)

VOCAB = 50


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _run(logits, temperature=0.0, top_k=0, top_p=1.0, seeds=None):
    rows = logits.shape[0]
    seeds = seeds if seeds is not None else [None] * rows
    return sample(
        logits,
        torch.full((rows,), temperature),
        torch.full((rows,), top_k, dtype=torch.long),
        torch.full((rows,), top_p),
        [make_generator(s, logits.device) for s in seeds],
    )


def test_greedy_is_argmax_with_model_logprobs():
    logits = _logits()
    ids, logprobs = _run(logits)
    assert torch.equal(ids, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = _logits(rows=3)
    a, _ = _run(logits, temperature=1.0, seeds=[7, 8, 9])
    b, _ = _run(logits, temperature=1.0, seeds=[7, 8, 9])
    assert torch.equal(a, b)
    # Row 0 alone, with the same seed, draws the same token as inside the batch.
    alone, _ = _run(logits[:1], temperature=1.0, seeds=[7])
    assert alone.item() == a[0].item()
    # Different seeds over many rows do not all agree (the draw really is random).
    many = logits[:1].expand(64, VOCAB).contiguous()
    draws, _ = _run(many, temperature=2.0, seeds=list(range(64)))
    assert len(set(draws.tolist())) > 1


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _logits(rows=8)
    greedy = logits.argmax(-1)
    ids_k, _ = _run(logits, temperature=1.5, top_k=1, seeds=list(range(8)))
    ids_p, _ = _run(logits, temperature=1.5, top_p=1e-6, seeds=list(range(8)))
    assert torch.equal(ids_k, greedy)
    assert torch.equal(ids_p, greedy)


def test_top_k_only_draws_from_the_k_best():
    logits = _logits(rows=1).expand(200, VOCAB).contiguous()
    ids, _ = _run(logits, temperature=5.0, top_k=3, seeds=list(range(200)))
    best3 = set(logits[0].topk(3).indices.tolist())
    assert set(ids.tolist()) <= best3
    assert len(set(ids.tolist())) > 1


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = _logits(rows=4)
    ids, _ = sample(
        logits,
        torch.tensor([0.0, 1.0, 0.0, 1.0]),
        torch.zeros(4, dtype=torch.long),
        torch.ones(4),
        [None, make_generator(1, logits.device), None, make_generator(2, logits.device)],
    )
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()


def _validate(params: SamplingParams, prompt_len: int = 5):
    if params.max_tokens is None:
        params.max_tokens = 10
    validate_request(params, prompt_len, vocab_size=VOCAB, max_model_len=100, max_stop_strings=4, max_stop_string_chars=10)


@pytest.mark.parametrize(
    "params, prompt_len, message",
    [
        (SamplingParams(temperature=-0.5), 5, "temperature must be a finite number >= 0, got -0.5"),
        (SamplingParams(temperature=float("nan")), 5, "temperature must be a finite number >= 0, got nan"),
        (SamplingParams(top_p=1.5), 5, "top_p must be in [0, 1], got 1.5"),
        (SamplingParams(top_p=-0.1), 5, "top_p must be in [0, 1], got -0.1"),
        (SamplingParams(top_k=VOCAB + 1), 5, f"top_k must be in [0, vocab size {VOCAB}], got {VOCAB + 1}"),
        (SamplingParams(max_tokens=0), 5, "max_tokens must be in [1, max_model_len 100], got 0"),
        (SamplingParams(max_tokens=101), 5, "max_tokens must be in [1, max_model_len 100], got 101"),
        (SamplingParams(stop=("a", "b", "c", "d", "e")), 5, "stop has 5 strings, at most 4 are allowed"),
        (SamplingParams(stop=("x" * 11,)), 5, "stop string of 11 characters exceeds the limit of 10"),
        (SamplingParams(stop=("",)), 5, "stop strings must not be empty"),
        (SamplingParams(), 0, "prompt is empty"),
        (SamplingParams(), 100, "prompt of 100 tokens exceeds max_model_len 100"),
    ],
)
def test_bad_request_is_invalid_argument_naming_the_parameter(params, prompt_len, message):
    with pytest.raises(StatusError) as info:
        _validate(params, prompt_len)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(message)


def test_good_request_passes_validation():
    _validate(SamplingParams(temperature=0.7, top_k=VOCAB, top_p=1.0, max_tokens=100, stop=("a",) * 4, seed=3), 99)


def test_find_stop_cuts_at_the_first_stop_string():
    assert find_stop("hello world", ["wor", "lo"], 0) == (3, 3)
    assert find_stop("hello", [], 0) == (None, 5)


def test_find_stop_holds_back_a_possible_stop_prefix():
    # "ab" might become "abc": only "xx" is safe to emit.
    assert find_stop("xxab", ["abc"], 0) == (None, 2)
    # Incrementally, a stop string spanning two deltas is found.
    text, safe = "xxab", 2
    text += "cd"
    assert find_stop(text, ["abc"], safe) == (2, 2)
