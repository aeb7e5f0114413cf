"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/models (and /metrics).

Translation only, as executor/service.py is for gRPC: a request becomes a GenerationRequest,
Engine.generate runs it, its outputs become OpenAI's JSON or server-sent events. `model` is an
adapter's name, or the base model's name for no adapter. Errors are the engine's StatusError,
sent with the HTTP status of HTTP_STATUS in OpenAI's error shape. Served by uvicorn on the
executor's event loop, beside the gRPC server (started by service.serve when config.http_listen is set).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import accumulate

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from loraserve.errors import StatusError, invalid, not_found

from .engine.requests import GenerationOutput, GenerationRequest
from .engine.sampler import SamplingParams

log = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type): the one table from StatusError to HTTP.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),  # e.g. rank above the slots'
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),  # every slot pinned, or busy past the wait
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),  # the store is down (cold adapter)
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
FINISH = {"length": "length", "stop": "stop", "eos": "stop", "cancelled": "abort"}  # engine -> OpenAI


# ---- request bodies: OpenAI's fields (null: the default); unknown fields are ignored ------------


class _Sampling(BaseModel):
    model: str
    max_tokens: int | None = None  # None: the executor's default_max_tokens
    temperature: float | None = None  # None: 1, OpenAI's default (gRPC's is 0: greedy)
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's: sent in the body's extra fields (extra_body), as vLLM takes it
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the usage
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    prompt_logprobs: int | None = None  # vLLM's extra field: refused (no outputs at prompt positions)

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        if self.n not in (None, 1):
            raise invalid(f"n must be 1 (one choice per request), got {self.n}")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise invalid("presence_penalty, frequency_penalty and logit_bias are not supported")
        if self.prompt_logprobs is not None:
            raise invalid(
                "prompt_logprobs is not supported: the executor computes no outputs at prompt positions "
                "(a prefix found in the prefix cache is not computed at all)"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        top_k = 0 if self.top_k in (None, -1) else self.top_k  # -1: off, as in vLLM
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        return SamplingParams(temperature, top_k, top_p, max_tokens, stop, self.seed)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # 0: the sampled tokens' logprobs (no top alternatives)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict] | None = None  # a string, or parts of type "text"


class ChatBody(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # wins over max_tokens, as in OpenAI's API
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None


def completion_request(body: CompletionBody, request_id: str, adapter: str) -> GenerationRequest:
    if body.best_of not in (None, 1) or body.echo or body.suffix:
        raise invalid("best_of, echo and suffix are not supported")
    if body.logprobs not in (None, 0):
        raise invalid(f"logprobs must be 0 (the sampled tokens only; no top alternatives), got {body.logprobs}")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid(f"prompt: one prompt per request, got a list of {len(prompt)}")
        prompt = prompt[0]
    return GenerationRequest(
        request_id=request_id,
        adapter=adapter,
        sampling=body.sampling(body.max_tokens),
        return_logprobs=body.logprobs is not None,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
    )


def chat_request(body: ChatBody, request_id: str, adapter: str) -> GenerationRequest:
    if body.tools or (body.response_format or {}).get("type", "text") != "text":
        raise invalid("tools and response_format other than text are not supported")
    if body.top_logprobs:
        raise invalid(f"top_logprobs must be 0 (the sampled tokens only), got {body.top_logprobs}")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return GenerationRequest(
        request_id=request_id,
        adapter=adapter,
        sampling=body.sampling(max_tokens),
        return_logprobs=body.logprobs,
        messages=[{"role": m.role, "content": _text(m)} for m in body.messages],
    )


def _text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    if any(part.get("type") != "text" for part in m.content):
        raise invalid(f"messages: a {m.role} message has a part that is not text (only text is served)")
    return "".join(part.get("text", "") for part in m.content)


# ---- responses -------------------------------------------------------------------------------


def error_body(exc: StatusError) -> tuple[int, dict]:
    status, kind = HTTP_STATUS.get(exc.code, (500, "server_error"))
    return status, {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code.name.lower()}}


def error_response(exc: StatusError) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status)


class _Result:
    """What a request produced, gathered output by output."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs = [], [], []
        self.finish_reason, self.prompt_tokens, self.cached_tokens = None, 0, 0

    def add(self, out: GenerationOutput) -> None:
        self.text.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = out.cached_tokens
        if out.finish_reason is not None:
            self.finish_reason = FINISH[out.finish_reason]

    def usage(self) -> dict:
        n = len(self.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Front:
    """The routes' logic over one executor's parts (engine, slots, store client, config)."""

    def __init__(self, parts):
        self.parts, self.engine, self.cfg = parts, parts.engine, parts.config
        self.base_model = self.cfg.base_model or self.cfg.model  # as GetServerInfo names it

    def adapter_of(self, model: str) -> str:
        return "" if model == self.base_model else model

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.engine.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def completion_logprobs(self, ids: list[int], logprobs: list[float], offset: int = 0) -> dict:
        tokens = self.token_strings(ids)
        offsets = list(accumulate((len(t) for t in tokens), initial=offset))[:-1]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}

    def chat_logprobs(self, ids: list[int], logprobs: list[float]) -> dict:
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(self.token_strings(ids), logprobs)
            ]
        }

    def choice(
        self,
        chat: bool,
        text: str,
        ids: list[int],
        logprobs: list[float] | None,
        finish: str | None,
        delta: bool = False,
        first: bool = False,
        offset: int = 0,
    ) -> dict:
        """One choice: of a response, or (delta) of a stream's event. logprobs None: not asked for."""
        c = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            message = {"role": "assistant", "content": text} if first or not delta else {"content": text}
            c["delta" if delta else "message"] = message
        else:
            c["text"] = text
        if logprobs is not None:
            c["logprobs"] = self.chat_logprobs(ids, logprobs) if chat else self.completion_logprobs(ids, logprobs, offset)
        return c

    async def run(self, req: GenerationRequest, chat: bool, stream: bool, include_usage: bool, model: str, request: Request):
        """The response of one request; errors before its first output get their HTTP status."""
        outputs = self.parts.generate(req)
        try:
            first = await outputs.__anext__()
        except BaseException:
            await outputs.aclose()
            raise
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + req.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        headers = {"x-request-id": req.request_id}
        if stream:
            events = self.events(first, outputs, head, chat, include_usage, req.return_logprobs)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        result = _Result()
        result.add(first)
        if first.finish_reason is None:
            await _unless_disconnected(self._collect(outputs, result), request)
        choice = self.choice(
            chat, "".join(result.text), result.token_ids, result.logprobs if req.return_logprobs else None, result.finish_reason
        )
        return JSONResponse({**head, "choices": [choice], "usage": result.usage()}, headers=headers)

    @staticmethod
    async def _collect(outputs: AsyncIterator[GenerationOutput], result: _Result) -> None:
        async for out in outputs:
            result.add(out)

    async def events(self, first, outputs, head: dict, chat: bool, include_usage: bool, with_logprobs: bool):
        """Server-sent events: one chunk per output, then the usage (if asked) and [DONE]."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        result, out, offset = _Result(), first, 0
        try:
            while True:
                result.add(out)
                choice = self.choice(
                    chat,
                    out.text,
                    out.token_ids,
                    out.logprobs if with_logprobs else None,
                    result.finish_reason,
                    delta=True,
                    first=out is first,
                    offset=offset,
                )
                offset += len(out.text)
                yield _sse({**head, "choices": [choice]})
                if out.finish_reason is not None:
                    break
                out = await outputs.__anext__()
            if include_usage:
                yield _sse({**head, "choices": [], "usage": result.usage()})
            yield "data: [DONE]\n\n"
        except StatusError as exc:  # after the status line went out: the error is the last event
            yield _sse(error_body(exc)[1])
        finally:
            await outputs.aclose()

    async def models(self) -> list[dict]:
        """The base model, then every adapter of the store (or, with the store down, those held here)."""
        held = {s.name: s for s in self.parts.slots.states()}
        cards = [
            {
                "id": self.base_model,
                "object": "model",
                "created": 0,
                "owned_by": "loraserve",
                "root": self.base_model,
                "parent": None,
                "loaded": True,
                "pinned": False,
                "cpu_cached": False,
            }
        ]
        try:
            manifests = {m.name: m for m in await self.parts.store.list_adapters()}
        except StatusError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE:
                raise
            log.warning("GET /v1/models lists only the adapters this executor holds: %s", exc.message)
            manifests = {name: None for name in held}
        for name, m in sorted(manifests.items()):
            s = held.get(name)
            cards.append({
                "id": name, "object": "model", "created": m.created_unix_ms // 1000 if m else 0, "owned_by": "loraserve",
                "root": m.uri if m else name, "parent": self.base_model, "loaded": s is not None and s.slot >= 0,
                "pinned": bool(s and s.pinned), "cpu_cached": bool(s and s.in_cpu_cache),
            })  # fmt: skip
        return cards


async def _unless_disconnected(work, request: Request) -> None:
    """Runs `work`; cancels it (freeing its slot and KV blocks) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
    if not task.cancelled():
        task.result()  # raises the request's error
    else:
        raise StatusError(grpc.StatusCode.CANCELLED, f"request {request.headers.get('x-request-id', '')}: client went away")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id", "")[:128] or uuid.uuid4().hex


def build_app(parts) -> FastAPI:
    app = FastAPI(title="loraserve (OpenAI-compatible)", docs_url=None, redoc_url=None)
    front = Front(parts)

    @app.exception_handler(StatusError)
    async def _status_error(request, exc: StatusError):
        log.info("%s %s -> %s: %s", request.method, request.url.path, exc.code.name, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, exc: RequestValidationError):
        e = exc.errors()[0]
        where = ".".join(str(x) for x in e["loc"] if x != "body")
        return error_response(invalid(f"{where}: {e['msg']}" if where else e["msg"]))

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):  # unknown route, wrong method
        message = f"{request.method} {request.url.path}: {exc.detail}"
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        req = completion_request(body, _request_id(request), front.adapter_of(body.model))
        return await front.run(req, False, body.stream, body.include_usage, body.model, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        req = chat_request(body, _request_id(request), front.adapter_of(body.model))
        return await front.run(req, True, body.stream, body.include_usage, body.model, request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": await front.models()})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        for card in await front.models():
            if card["id"] == model:
                return JSONResponse(card)
        raise not_found(f"model {model!r} is neither the base model nor an adapter of the store")

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    if parts.metrics is not None:

        @app.get("/metrics")
        async def metrics() -> Response:
            """The executor's Prometheus metrics on the HTTP port too: the endpoint picker of the
            Gateway API inference extension scrapes the port it routes to."""
            body = await asyncio.to_thread(generate_latest, parts.metrics.registry)
            return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the executor's process owns its signals (Ctrl-C stops gRPC too)
        yield


@dataclass
class HttpFront:
    server: _Server
    task: asyncio.Task
    port: int

    async def stop(self) -> None:
        """Stops accepting, lets running requests finish (up to 5 s), then closes."""
        self.server.should_exit = True
        await self.task


async def serve_http(parts, listen: str) -> HttpFront:
    """Starts the HTTP front on the running event loop (the gRPC server's), at host:port."""
    host, port = listen.rsplit(":", 1)
    host = host.strip("[]")
    sock = socket.create_server((host, int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    config = uvicorn.Config(build_app(parts), log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="http-front")
    while not server.started:
        if task.done():
            task.result()  # raises why it did not start
        await asyncio.sleep(0.01)
    front = HttpFront(server, task, sock.getsockname()[1])
    log.info(
        "OpenAI-compatible HTTP front on %s:%d (model: an adapter's name, or %r)",
        host,
        front.port,
        parts.config.base_model or parts.config.model,
    )
    return front
