"""The services as processes, the way an operator meets them: a second server on a busy port,
SIGTERM while clients register or stream, kill -9 during a registration, and `up`'s one admin
token guarding both services."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from loraserve.client import ExecutorClient, StoreClient
from loraserve.errors import StatusError
from loraserve.v1 import executor_pb2 as epb

LORASERVE = str(Path(sys.executable).parent / "loraserve")


class Proc:
    """A `loraserve` process whose output is collected by a thread (so it never blocks on a pipe)."""

    def __init__(self, *args, env=None):
        self.p = subprocess.Popen(
            [LORASERVE, "--log-level", "INFO", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def wait(self, timeout: float) -> int:
        """The exit code, once the process has ended and its last line has been read."""
        code = self.p.wait(timeout)
        self._reader.join(10)
        assert not self._reader.is_alive(), f"its output did not end with the process:\n{self.output}"
        return code

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while text not in self.output:
            assert self.p.poll() is None, f"exited {self.p.returncode} before printing {text!r}:\n{self.output}"
            assert time.time() < deadline, f"no {text!r} within {timeout}s:\n{self.output}"
            time.sleep(0.05)

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def retry(call, timeout: float = 10):
    """call() once the channel has reconnected: blocking channels share one connection per address,
    which may still be backing off from the process that was there before."""
    deadline = time.time() + timeout
    while True:
        try:
            return call()
        except StatusError as e:
            if e.code.name != "UNAVAILABLE" or time.time() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture
def procs():
    started: list[Proc] = []

    def start(*args, env=None) -> Proc:
        started.append(Proc(*args, env=env))
        return started[-1]

    yield start
    for p in started:
        p.stop()


def store_args(port: int, data: Path, base: Path, root: Path, *extra) -> list[str]:
    return [
        "store",
        "--listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(data),
        "--base-model",
        "tiny",
        "--base-model-path",
        str(base),
        "--allow-local-root",
        str(root),
        "--metrics-port",
        "0",
        *extra,
    ]


def test_a_second_store_or_executor_on_a_busy_port_refuses_to_start(procs, tmp_path, tiny_chat_llama, chat_adapters, free_port):
    base = tiny_chat_llama[1]
    port = free_port()
    first = procs(*store_args(port, tmp_path / "a", base, chat_adapters))
    first.wait_for("adapter store serving on")
    second = procs(*store_args(port, tmp_path / "b", base, chat_adapters))
    assert second.wait(30) == 1, second.output
    assert f"error: could not listen on 127.0.0.1:{port}: address in use" in second.output
    executor = procs(
        "executor",
        "--model",
        str(base),
        "--executor-listen",
        f"127.0.0.1:{port}",
        "--executor-metrics-port",
        "0",
        "--cache-dir",
        "",
    )
    assert executor.wait(60) == 1, executor.output
    assert f"error: could not listen on 127.0.0.1:{port}: address in use" in executor.output
    store = StoreClient(f"127.0.0.1:{port}", timeout_s=30)
    for i in range(6):  # every registration lands in the one store that listens
        store.register(f"a{i}", str(chat_adapters / "qv8"))
    assert [m.name for m in store.list()] == [f"a{i}" for i in range(6)]
    assert not (tmp_path / "b" / "registry").exists() or not list((tmp_path / "b" / "registry").iterdir())


def test_a_busy_metrics_port_is_refused_at_start_naming_the_flag(procs, tmp_path, tiny_chat_llama, chat_adapters, free_port):
    """A /metrics port given and taken (another service on the host): the command exits 1 at once,
    naming the address and the flag, before loading anything."""
    base = tiny_chat_llama[1]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        store = procs(*store_args(free_port(), tmp_path / "data", base, chat_adapters, "--metrics-port", str(taken)))
        assert store.wait(30) == 1, store.output
        assert (
            f"error: could not listen on 127.0.0.1:{taken}: address in use (/metrics, --metrics-port: give another port, "
            "or 0 for none)"
        ) in store.output
        port = free_port()
        args = ("--executor-listen", f"127.0.0.1:{port}", "--executor-metrics-port", str(taken), "--cache-dir", "")
        executor = procs("executor", "--model", str(base), *args)
        assert executor.wait(60) == 1, executor.output
        assert (
            f"error: could not listen on 127.0.0.1:{taken}: address in use (/metrics, --executor-metrics-port: give "
            "another port, or 0 for none)"
        ) in executor.output
        assert "executor ready" not in executor.output


def test_store_drains_on_sigterm_and_an_acknowledged_registration_is_kept(
    procs, tmp_path, tiny_chat_llama, chat_adapters, free_port
):
    base, port = tiny_chat_llama[1], free_port()
    store = procs(*store_args(port, tmp_path / "data", base, chat_adapters))
    store.wait_for("adapter store serving on")
    ok, failed, errors = [], [], []
    started = threading.Event()

    def client(i: int):
        c = StoreClient(f"127.0.0.1:{port}", timeout_s=30)
        for k in range(1000):
            name = f"c{i}-{k}"
            try:
                c.register(name, str(chat_adapters / ["qv8", "mlp4", "o2", "all4"][k % 4]))
                ok.append(name)
                started.set()
            except StatusError as e:
                failed.append(name)
                errors.append(e)
                return

    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client, i) for i in range(16)]
        assert started.wait(30)
        time.sleep(1.0)
        store.p.send_signal(signal.SIGTERM)
        for f in futures:
            f.result(60)
    assert store.wait(30) == 0, store.output
    assert "SIGTERM: draining" in store.output
    assert len(ok) > 0 and len(failed) == 16
    for e in errors:  # refused while draining (gRPC says CANCELLED for a call racing its stop), or the port is closed
        assert e.code.name in ("UNAVAILABLE", "CANCELLED"), [str(x) for x in errors]
    restarted = procs(*store_args(port, tmp_path / "data", base, chat_adapters))
    restarted.wait_for("adapter store serving on")
    kept = {m.name for m in retry(lambda: StoreClient(f"127.0.0.1:{port}", timeout_s=30).list(page_size=1000))}
    assert kept == set(ok), (sorted(kept - set(ok)), sorted(set(ok) - kept))


def test_staging_left_by_kill_9_during_registration_is_removed_at_start(
    procs, tmp_path, tiny_chat_llama, chat_adapters, free_port
):
    # An "S3 endpoint" that accepts connections and never answers: the registration waits in
    # its download, with its staging folder made, when the store is killed.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(16)
    endpoint = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    base, port, data = tiny_chat_llama[1], free_port(), tmp_path / "data"
    args = store_args(port, data, base, chat_adapters, "--s3-endpoint-url", endpoint, "--s3-region", "us-east-1")
    store = procs(*args, env=env)
    store.wait_for("adapter store serving on")
    client = StoreClient(f"127.0.0.1:{port}", timeout_s=60)
    threads = [
        threading.Thread(target=lambda: pytest.raises(StatusError, client.register, f"s{i}", f"s3://bucket/a{i}"), daemon=True)
        for i in range(3)
    ]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while len(list((data / "staging").iterdir())) < 3:
        assert time.time() < deadline, store.output
        time.sleep(0.05)
    store.p.kill()
    store.wait(10)
    left = list((data / "staging").iterdir())
    assert len(left) == 3 and all(p.name.startswith("tmp") for p in left)
    blackhole.close()
    again = procs(*args, env=env)
    again.wait_for("adapter store serving on")
    assert list((data / "staging").iterdir()) == []
    assert "staging: removed 3 folder(s) left by an earlier run" in again.output


def test_calls_still_running_at_the_end_of_the_executors_drain_grace_end_unavailable_saying_why(
    procs, tiny_chat_llama, free_port
):
    """SIGTERM with --drain-grace-s 1: a stream and a unary Generate still running when the grace
    ends (each waits for its cold adapter from a "store" that takes every call and answers none)
    end UNAVAILABLE naming the executor's shutdown, the grace and what to do, not with gRPC's bare
    "Cancelling all calls"; the process then exits 0."""
    released = threading.Event()

    def hang(request, context):
        released.wait(120)
        context.abort(grpc.StatusCode.UNAVAILABLE, "the silent store is closing")

    def hang_stream(request, context):
        yield hang(request, context)

    class Silent(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method.endswith("/FetchShard"):
                return grpc.unary_stream_rpc_method_handler(hang_stream)
            return grpc.unary_unary_rpc_method_handler(hang)

    silent_store = grpc.server(cf.ThreadPoolExecutor(8), handlers=[Silent()])
    store_port = silent_store.add_insecure_port("127.0.0.1:0")
    silent_store.start()
    port = free_port()
    executor = procs(
        "executor",
        "--model",
        str(tiny_chat_llama[1]),
        "--executor-listen",
        f"127.0.0.1:{port}",
        "--store",
        f"127.0.0.1:{store_port}",
        "--store-timeout-s",
        "120",
        "--drain-grace-s",
        "1",
        "--http-port",
        "0",
        "--executor-metrics-port",
        "0",
        "--cache-dir",
        "",
        "--max-lora-rank",
        "8",
    )
    executor.wait_for("executor serving gRPC on port")
    client = ExecutorClient(f"127.0.0.1:{port}", timeout_s=60)
    errors: dict[str, StatusError] = {}

    def call(kind: str, adapter: str):
        try:
            if kind == "stream":
                list(client.generate_stream("hello", adapter=adapter, max_tokens=8))
            else:
                client.generate("hello", adapter=adapter, max_tokens=8)
        except StatusError as e:
            errors[kind] = e

    threads = [threading.Thread(target=call, args=args) for args in (("stream", "qv8"), ("call", "o2"))]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while {s.name for s in client.list() if s.loading} != {"qv8", "o2"}:  # both in flight, waiting on the store
        assert time.time() < deadline, executor.output
        time.sleep(0.05)
    executor.p.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert executor.wait(30) == 0, executor.output
    released.set()
    silent_store.stop(0)
    for kind in ("stream", "call"):
        assert (errors[kind].code.name, errors[kind].message) == (
            "UNAVAILABLE",
            f"the executor is shutting down: this {kind} was cut at the end of its 1 s drain grace; retry on another replica",
        ), executor.output


@pytest.fixture(scope="module")
def up_process(tiny_chat_llama, chat_adapters, tmp_path_factory, free_port):
    """`loraserve up --admin-token T` on the tiny chat model, with two demo adapters: (process, the
    executor's address, {"store": its /metrics port, "executor": its /metrics port})."""
    demo = tmp_path_factory.mktemp("demo")
    for name in ("qv8", "o2"):
        shutil.copytree(chat_adapters / name, demo / name)
    base = tiny_chat_llama[1]
    sport, eport, hport = free_port(), free_port(), free_port()
    metrics = {"store": free_port(), "executor": free_port()}
    p = Proc(
        "up",
        "--model",
        str(base),
        "--base-model",
        "tiny",
        "--base-model-path",
        str(base),
        "--demo-adapters",
        str(demo),
        "--admin-token",
        "T",
        "--listen",
        f"127.0.0.1:{sport}",
        "--executor-listen",
        f"127.0.0.1:{eport}",
        "--http-port",
        str(hport),
        "--metrics-port",
        str(metrics["store"]),
        "--executor-metrics-port",
        str(metrics["executor"]),
        "--data-dir",
        str(tmp_path_factory.mktemp("up-data")),
        "--cache-dir",
        "",
        "--max-lora-rank",
        "8",
        "--metrics-compat",
        "vllm",
    )
    try:
        p.wait_for("loraserve is up", 120)
        yield p, f"127.0.0.1:{eport}", {**metrics, "http": hport}
    finally:
        p.stop()


@pytest.mark.parametrize("rpc", ["load", "load --pin", "pin", "unpin", "evict"])
def test_up_admin_token_guards_the_executors_admin_rpcs(up_process, rpc):
    _, address, _ = up_process
    name, *flags = rpc.split()
    call = {
        "load": lambda c: c.load("qv8", pin=bool(flags)),
        "pin": lambda c: c.pin("qv8"),
        "unpin": lambda c: c.unpin("qv8"),
        "evict": lambda c: c.evict("o2"),
    }[name]
    with pytest.raises(StatusError) as e:
        call(ExecutorClient(address, timeout_s=30))
    assert e.value.code.name == "UNAUTHENTICATED"
    assert e.value.message == "this RPC needs an admin token: send 'authorization: Bearer <token>'"
    with pytest.raises(StatusError) as e:
        call(ExecutorClient(address, token="wrong", timeout_s=30))
    assert e.value.code.name == "PERMISSION_DENIED" and e.value.message == "the admin token is not valid"
    if name == "evict":
        ExecutorClient(address, token="T", timeout_s=30).load("o2")
    call(ExecutorClient(address, token="T", timeout_s=30))


def test_up_serves_both_services_metrics_on_the_given_ports(up_process):
    """/metrics is on by default in every serving command: `up` serves the store's and the
    executor's Prometheus metrics on --metrics-port and --executor-metrics-port, and says where."""
    proc, address, metrics = up_process
    ExecutorClient(address, timeout_s=30).generate("hi", max_tokens=2)
    scraped = {}
    for who, port in metrics.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            scraped[who] = reply.read().decode().splitlines()
    assert "loraserve_store_registrations_total 2.0" in scraped["store"]  # the two demo adapters
    assert any(line.startswith('loraserve_executor_requests_total{adapter="_base",code="OK"}') for line in scraped["executor"])
    # --metrics-compat vllm: vLLM's names too; the HTTP port serves the executor's metrics (the endpoint picker scrapes there)
    assert any(line.startswith('vllm:num_requests_running{model_name="tiny"}') for line in scraped["executor"])
    assert any(line.startswith("loraserve_lora_requests_info{") for line in scraped["http"])
    assert any(line.startswith("vllm:lora_requests_info{") for line in scraped["http"])
    assert (
        f"Prometheus metrics: store http://127.0.0.1:{metrics['store']}/metrics, "
        f"executor http://127.0.0.1:{metrics['executor']}/metrics"
    ) in proc.output


def test_up_drains_on_sigterm_a_running_stream_finishes(up_process):
    """Last in this module: it stops the `up` process."""
    proc, address, _ = up_process
    client = ExecutorClient(address, timeout_s=60)
    stream = client.generate_stream("hello", adapter="qv8", max_tokens=300)
    parts = [next(stream)]
    proc.p.send_signal(signal.SIGTERM)
    parts += list(stream)  # the stream in flight runs to its end
    assert parts[-1].finish_reason in (epb.LENGTH, epb.EOS), parts[-1]  # ended, not cancelled
    with pytest.raises(StatusError) as e:  # nothing new is accepted meanwhile
        client.generate("hi", max_tokens=2)
    assert e.value.code.name == "UNAVAILABLE"
    assert proc.wait(30) == 0, proc.output
    assert "SIGTERM: draining" in proc.output
