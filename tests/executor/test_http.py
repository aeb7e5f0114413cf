"""The OpenAI-compatible HTTP front, through the official `openai` client, against one live executor
(CPU, tiny model) beside its gRPC server, with a real store on loopback and real PEFT adapters:
greedy outputs equal gRPC's for the same requests; every error has its status and OpenAI's shape."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import logging
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model

from loraserve.adapter_store import validate
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import serve as serve_store
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import ExecutorClient, StoreClient, make_request
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.service import build_executor, shutdown
from loraserve.executor.service import serve as serve_executor
from loraserve.v1 import executor_pb2 as epb

from .conftest import BYTE_BOS

BASE = "tiny"  # the base model's name: `model` for no adapter
TOKEN = "admin-secret"  # guards gRPC admin calls; the HTTP front needs none
ADAPTERS = {  # name: (r, alpha, targets); "cold" is first used by the store-down test
    "qv8": (8, 16, ("q_proj", "v_proj")),
    "all4": (4, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "mlp16": (16, 16, ("gate_proj", "up_proj", "down_proj")),
    "cold": (8, 32, ("k_proj", "down_proj")),
}


class Served:
    """A store and an executor (gRPC + HTTP) on loopback, served from one event loop thread."""

    def __init__(self, lt, base_dir, adapters_dir, data_dir):
        self.lt = lt
        self.scfg = StoreConfig(
            listen="127.0.0.1:0",
            data_dir=data_dir,
            base_model=BASE,
            base_model_path=base_dir,
            sources=SourceConfig(local_roots=(adapters_dir,)),
            limits=validate.Limits(max_rank=16),
        )
        self.start_store()
        store = StoreClient(self.store_address, timeout_s=60)
        for name in ADAPTERS:
            store.register(name, str(adapters_dir / name))
        cfg = ExecutorConfig(
            model=str(base_dir),
            base_model=BASE,
            dtype="float32",
            max_loras=2,
            max_rank=16,
            num_blocks=256,
            block_size=4,
            max_model_len=512,
            store_address=self.store_address,
            slot_wait_timeout_s=10.0,
            admin_token=TOKEN,
            http_listen="127.0.0.1:0",
        )
        self.parts = build_executor(cfg)
        self.server, port = lt.run(serve_executor(self.parts, "127.0.0.1:0"))
        self.grpc = ExecutorClient(f"127.0.0.1:{port}", token=TOKEN, timeout_s=120)
        self.url = f"http://127.0.0.1:{self.parts.http.port}/v1"
        self.openai = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def start_store(self, port: int = 0):
        self.scfg.listen = f"127.0.0.1:{port}"
        self.store_server, p = self.lt.run(serve_store(self.scfg))
        self.store_address = f"127.0.0.1:{p}"

    def stop_store(self):
        self.lt.run(self.store_server.stop(0))

    def in_use(self, name: str) -> int:
        return next((s.in_use for s in self.grpc.list() if s.name == name), 0)

    def close(self):
        self.lt.run(shutdown(self.server, self.parts))
        self.stop_store()


@pytest.fixture(scope="module")
def served(module_loop_thread, byte_model, tmp_path_factory):
    model, base_dir = byte_model("llama")
    root = tmp_path_factory.mktemp("http-adapters")
    for seed, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
        peft.save_pretrained(root / name)
    s = Served(module_loop_thread, base_dir, root, tmp_path_factory.mktemp("http-store"))
    yield s
    s.close()


def prompt_ids(i: int) -> list[int]:
    g = torch.Generator().manual_seed(200 + i)
    return [BYTE_BOS] + torch.randint(0, 256, (3 + 2 * i,), generator=g).tolist()


def grpc_generate(served, adapter: str, req: epb.GenerateRequest) -> epb.GenerateResponse:
    req.adapter, req.return_logprobs = adapter, True
    return served.grpc._call(served.grpc.stub.Generate, req)


GRPC_FINISH = {epb.LENGTH: "length", epb.STOP: "stop", epb.EOS: "stop"}


def http_complete(served, model: str, stream: bool, chat: bool, prompt, **kw) -> tuple[str, list[float], str, dict]:
    """(text, logprobs, finish_reason, usage) of one HTTP request, streamed or not."""
    if chat:
        call = served.openai.chat.completions.create
        kw.update(messages=[{"role": "user", "content": prompt}], logprobs=True)
    else:
        call = served.openai.completions.create
        kw.update(prompt=prompt, logprobs=0)
    if not stream:
        r = call(model=model, **kw)
        choice = r.choices[0]
        if chat:
            return choice.message.content, [c.logprob for c in choice.logprobs.content], choice.finish_reason, r.usage.to_dict()
        return choice.text, choice.logprobs.token_logprobs, choice.finish_reason, r.usage.to_dict()
    text, logprobs, finish, usage = [], [], None, None
    for chunk in call(model=model, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.to_dict()
        for choice in chunk.choices:
            text.append(choice.delta.content if chat else choice.text)
            logprobs += [c.logprob for c in choice.logprobs.content] if chat else choice.logprobs.token_logprobs
            finish = choice.finish_reason or finish
    return "".join(text), logprobs, finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_output_equals_grpc_for_several_adapters_concurrently(served, stream):
    """Completions (token ids and text) and chat, mixed adapters and the base model, all at once."""
    jobs = [(name, "completion", prompt_ids(i)) for i, name in enumerate(["qv8", "all4", "", "mlp16", "qv8"])]
    jobs += [("all4", "completion", "Hello there"), ("qv8", "chat", "hi there"), ("", "chat", "hi"), ("mlp16", "chat", "yo")]

    def over_grpc(job):
        name, kind, prompt = job
        if isinstance(prompt, list):
            req = epb.GenerateRequest(token_ids=epb.TokenIds(ids=prompt), sampling=epb.SamplingParams(max_tokens=8))
        else:
            req = make_request(prompt, chat=kind == "chat", max_tokens=8)
        return grpc_generate(served, name, req)

    def over_http(job):
        name, kind, prompt = job
        return http_complete(served, name or BASE, stream, kind == "chat", prompt, max_tokens=8, temperature=0)

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        want = list(pool.map(over_grpc, jobs))
        got = list(pool.map(over_http, jobs))
    for job, w, (text, logprobs, finish, usage) in zip(jobs, want, got):
        assert text == w.text and len(w.token_ids) > 0, job
        assert logprobs == pytest.approx(list(w.logprobs), abs=1e-4), job
        assert finish == GRPC_FINISH[w.finish_reason], job
        n = len(w.token_ids)
        # the prompt's full blocks before its last token were cached by the gRPC request before it
        cached = (w.prompt_tokens - 1) // served.parts.config.block_size * served.parts.config.block_size
        assert w.cached_tokens in (0, cached), job  # the "stream" run's gRPC requests come after the "whole" run's
        assert usage == {
            "prompt_tokens": w.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": w.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }, job


def test_stop_seed_top_k_and_request_id(served):
    ids = prompt_ids(1)
    greedy = grpc_generate(
        served, "qv8", epb.GenerateRequest(token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(max_tokens=12))
    )
    stop = greedy.text[3:5]
    assert stop, greedy.text
    want = grpc_generate(
        served,
        "qv8",
        epb.GenerateRequest(token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(max_tokens=12, stop=[stop])),
    )
    r = served.openai.completions.create(model="qv8", prompt=ids, max_tokens=12, temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "stop") and stop not in r.choices[0].text
    # top_k=1 through the extra body is greedy whatever the temperature.
    r = served.openai.completions.create(model="qv8", prompt=ids, max_tokens=12, temperature=1.5, extra_body={"top_k": 1})
    assert r.choices[0].text == greedy.text
    # A seed gives the same draw over HTTP and over gRPC.
    seeded = dict(max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    want = grpc_generate(
        served, "all4", epb.GenerateRequest(token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(**seeded))
    )
    for _ in range(2):
        assert served.openai.completions.create(model="all4", prompt=ids, **seeded).choices[0].text == want.text
    # The request id: the client's X-Request-Id, echoed in the header and the response id.
    raw = served.openai.chat.completions.with_raw_response.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"X-Request-Id": "req-42"}
    )
    assert raw.headers["x-request-id"] == "req-42" and raw.parse().id == "chatcmpl-req-42"
    r = served.openai.completions.create(model=BASE, prompt="a", max_tokens=1)
    assert r.id.startswith("cmpl-") and len(r.id) > 10 and r.object == "text_completion"


def test_default_temperature_is_one_over_http_and_greedy_over_grpc(served):
    ids = prompt_ids(2)
    params = dict(max_tokens=10, seed=11)
    greedy = grpc_generate(
        served,
        "all4",
        epb.GenerateRequest(token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(max_tokens=10, temperature=0)),
    )
    sampled = grpc_generate(
        served,
        "all4",
        epb.GenerateRequest(token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(temperature=1.0, **params)),
    )
    assert sampled.text != greedy.text, (
        "the seeded draw at temperature 1 must differ from greedy for this test to tell them apart"
    )
    # OpenAI's default (no temperature sent) is 1: the same seeded draw as gRPC at temperature 1.
    assert served.openai.completions.create(model="all4", prompt=ids, **params).choices[0].text == sampled.text
    # gRPC's default (no temperature set) is greedy, seed or not.
    unset = grpc_generate(
        served, "all4", epb.GenerateRequest(token_ids=epb.TokenIds(ids=ids), sampling=epb.SamplingParams(**params))
    )
    assert unset.text == greedy.text


def test_models_lists_the_base_model_and_the_stores_adapters_marking_loaded(served):
    served.grpc.load("qv8")
    cards = {m.id: m for m in served.openai.models.list()}
    assert list(cards)[0] == BASE and set(cards) == {BASE, *ADAPTERS}
    assert cards[BASE].loaded and cards[BASE].parent is None
    assert cards["qv8"].loaded and cards["qv8"].parent == BASE and cards["qv8"].created > 0
    assert not cards["cold"].loaded and not cards["cold"].cpu_cached
    assert served.openai.models.retrieve("all4").id == "all4"
    with pytest.raises(openai.NotFoundError) as e:
        served.openai.models.retrieve("no-such-adapter")
    assert e.value.body["code"] == "not_found" and "no-such-adapter" in e.value.body["message"]


def raw_http(served, method: str, path: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON body) of one plain HTTP request: what a client other than `openai` sends."""
    req = urllib.request.Request(served.url + path, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


BAD_COMPLETIONS = [
    (dict(n=2), "n must be 1"),
    (dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs is not supported: the executor computes no outputs at prompt"),
    (dict(temperature=-1), "temperature must be a finite number >= 0"),
    (dict(temperature="hot"), "temperature: Input should be a valid number"),
    (dict(top_p=1.5), "top_p must be in [0, 1]"),
    (dict(extra_body={"top_k": 100000}), "top_k must be in"),
    (dict(max_tokens=0), "max_tokens must be in [1"),
    (dict(seed=-1), "seed must be in"),
    (dict(logprobs=3), "logprobs must be 0"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(echo=True), "echo"),
    (dict(prompt=["a", "b"]), "one prompt per request"),
    (dict(prompt=[5, 99999]), "outside the vocabulary"),
    (dict(prompt=""), "prompt is empty"),
    (dict(stop=[""]), "stop strings must not be empty"),
]


@pytest.mark.parametrize("kwargs,fragment", BAD_COMPLETIONS, ids=[f[1][:24] for f in BAD_COMPLETIONS])
def test_bad_completion_requests_are_400(served, kwargs, fragment):
    kwargs = {"prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        served.openai.completions.create(model="qv8", **kwargs)
    err = _error(e.value)
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["code"] == "invalid_argument"
    assert fragment in err["message"]


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "not text"),
        (dict(messages=[]), "chat has no messages"),
        (dict(extra_body={"prompt_logprobs": 0}), "prompt_logprobs is not supported"),
        (dict(top_logprobs=2, logprobs=True), "top_logprobs must be 0"),
        (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (dict(max_completion_tokens=100000), "max_tokens must be in"),
        (dict(stream=True, temperature=-0.5), "temperature"),  # before the first event: a status, not an event
    ],
)
def test_bad_chat_requests_are_400(served, kwargs, fragment):
    kwargs = {"messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        served.openai.chat.completions.create(model="all4", **kwargs)
    assert fragment in _error(e.value)["message"]


def test_malformed_json_and_unknown_routes_get_openai_errors(served):
    status, body = raw_http(served, "POST", "/completions", b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_argument"
    status, body = raw_http(served, "POST", "/completions", json.dumps({"prompt": "hi"}).encode())  # no model
    assert status == 400 and body["error"]["message"] == "model: Field required"
    status, body = raw_http(served, "GET", "/embeddings")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("kind", ["completion", "chat", "stream"])
def test_unknown_model_is_404(served, kind):
    with pytest.raises(openai.NotFoundError) as e:
        if kind == "completion":
            served.openai.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
        else:
            list(
                served.openai.chat.completions.create(
                    model="no-such-adapter", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=kind == "stream"
                )
            )
    err = _error(e.value)
    assert e.value.status_code == 404 and err["code"] == "not_found"
    assert err["message"] == "adapter 'no-such-adapter' is not registered"  # the same message as gRPC's NOT_FOUND


def test_every_slot_pinned_is_429_then_serves_again(served):
    served.grpc.load("qv8", pin=True)
    served.grpc.load("all4", pin=True)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            served.openai.completions.create(model="mlp16", prompt="hi", max_tokens=2)
        err = _error(e.value)
        assert e.value.status_code == 429 and err["code"] == "resource_exhausted" and "pinned" in err["message"]
        assert served.openai.completions.create(model="qv8", prompt="hi", max_tokens=2).choices[0].finish_reason
    finally:
        served.grpc.unpin("qv8")
        served.grpc.unpin("all4")
    assert served.openai.completions.create(model="mlp16", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_a_client_going_away_cancels_its_request_and_frees_the_slot(served, caplog):
    caplog.set_level(logging.INFO, logger="loraserve.executor.engine.engine")
    long = dict(model="mlp16", prompt=prompt_ids(0), max_tokens=480, temperature=0)
    stream = served.openai.completions.create(stream=True, extra_headers={"X-Request-Id": "gone-stream"}, **long)
    next(iter(stream))
    assert served.in_use("mlp16") == 1
    stream.close()
    req = urllib.request.Request(
        f"{served.url}/completions",
        data=json.dumps(long).encode(),
        headers={"content-type": "application/json", "x-request-id": "gone-whole"},
    )
    with pytest.raises(TimeoutError):  # not streamed: the client gives up waiting and hangs up
        urllib.request.urlopen(req, timeout=0.3)
    deadline = time.time() + 20
    while served.in_use("mlp16") or "gone-whole: finished" not in caplog.text:
        assert time.time() < deadline, served.grpc.list()
        time.sleep(0.05)
    assert "request gone-stream: finished (cancelled)" in caplog.text
    assert "request gone-whole: finished (cancelled)" in caplog.text


def test_store_down_cold_adapter_is_503_and_models_lists_held_ones(served):
    """Last in this module: it stops the store (and starts it again on the same port)."""
    hot = served.openai.completions.create(model="qv8", prompt="hi", max_tokens=3, temperature=0).choices[0].text
    port = int(served.store_address.rsplit(":", 1)[1])
    served.stop_store()
    try:
        assert served.openai.completions.create(model="qv8", prompt="hi", max_tokens=3, temperature=0).choices[0].text == hot
        with pytest.raises(openai.InternalServerError) as e:
            served.openai.completions.create(model="cold", prompt="hi", max_tokens=2)
        err = _error(e.value)
        assert e.value.status_code == 503 and err["code"] == "unavailable" and "store" in err["message"]
        ids = [m.id for m in served.openai.models.list()]
        assert ids[0] == BASE and "qv8" in ids and "cold" not in ids
    finally:
        served.start_store(port)
