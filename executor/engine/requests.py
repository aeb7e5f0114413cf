"""The engine's request API: what a request asks (GenerationRequest), what each step gives back
(GenerationOutput), and the checks a request passes before it is queued.

A text prompt above the executor's byte limit is refused before it is tokenized (a huge prompt
would hold a CPU core for seconds); token ids are checked against the vocabulary. Every refusal is
a StatusError of INVALID_ARGUMENT (FAILED_PRECONDITION for text sent to a model without a
tokenizer), and a deadline that passes is DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from loraserve.errors import StatusError, invalid, precondition

from ..config import ExecutorConfig
from .sampler import SamplingParams

FINISH_REASONS = ("length", "stop", "eos", "cancelled")


@dataclass
class GenerationRequest:
    """Exactly one of prompt (raw text), messages (chat) or prompt_token_ids."""

    request_id: str = ""
    adapter: str = ""  # "": the base model alone
    prompt: str | None = None
    messages: list[dict] | None = None  # [{"role": ..., "content": ...}]
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)  # max_tokens None: the default
    return_logprobs: bool = False
    deadline: float | None = None  # time.monotonic() seconds; None: no deadline


@dataclass
class GenerationOutput:
    """What one step produced for one request; the last one carries finish_reason."""

    request_id: str
    token_ids: list[int]
    text: str  # new text since the previous output
    logprobs: list[float]  # one per token id when return_logprobs, else empty
    finish_reason: str | None  # one of FINISH_REASONS, on the last output only
    prompt_tokens: int
    adapter_digest: str
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (engine/prefix_cache.py)
    prefix_cacheable: bool = False  # the prompt was looked up in the prefix cache (caching on, an adapter version known)


def resolve_sampling(p: SamplingParams, default_max_tokens: int) -> SamplingParams:
    """The request's sampling with max_tokens None replaced by the executor's default."""
    max_tokens = default_max_tokens if p.max_tokens is None else p.max_tokens
    return SamplingParams(p.temperature, p.top_k, p.top_p, max_tokens, tuple(p.stop), p.seed)


def check_prompt_size(req: GenerationRequest, cfg: ExecutorConfig, tokenizer) -> None:
    """Refuses what would cost too much to tokenize (or to copy), before any of it is done."""
    if req.prompt_token_ids is not None and len(req.prompt_token_ids) > cfg.max_model_len:
        raise invalid(f"token_ids: {len(req.prompt_token_ids)} tokens, above max_model_len {cfg.max_model_len}")
    texts = [req.prompt] if req.prompt is not None else [m["content"] for m in req.messages or ()]
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > cfg.prompt_byte_limit:
        what = "prompt" if req.prompt is not None else "chat messages"
        raise invalid(
            f"{what}: {size} bytes, above this executor's limit of {cfg.prompt_byte_limit} bytes "
            f"(max_prompt_bytes; max_model_len is {cfg.max_model_len} tokens)"
        )
    if (req.prompt or req.messages) and not getattr(tokenizer, "can_encode", True):
        raise precondition("this executor's model has no tokenizer: send token_ids, not text or chat")


def prompt_ids(req: GenerationRequest, tokenizer, vocab_size: int) -> list[int]:
    """The request's prompt as token ids (tokenizing text and chat: run it off the event loop)."""
    given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
    if sum(given) != 1:
        raise invalid("exactly one of prompt, chat messages or token_ids is required")
    if req.prompt is not None:
        if not req.prompt:
            raise invalid("prompt is empty")
        return tokenizer.encode(req.prompt)
    if req.messages is not None:
        if not req.messages:
            raise invalid("chat has no messages")
        try:
            return tokenizer.apply_chat_template(req.messages)
        except Exception as exc:  # no template in the model, or messages its template rejects
            raise invalid(f"chat: {exc}") from exc
    ids = list(req.prompt_token_ids)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"token_ids: {bad[0]} is outside the vocabulary of {vocab_size} tokens")
    return ids


async def within(awaitable, deadline: float | None, request_id: str):
    """awaitable's result, or DEADLINE_EXCEEDED once time.monotonic() passes deadline (None: no limit)."""
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {request_id}: deadline exceeded") from None
