"""Production operations, against real servers on loopback (a store and a CPU executor on a tiny
chat model, real PEFT adapters):

- Prometheus metrics of both services, scraped over HTTP after real gRPC requests, equal what
  was sent (requests by adapter and code, tokens, slot hits / misses / evictions, load tiers,
  registrations and rejections, fetch bytes, cache hits) and the LoRA-affinity gauge;
- gRPC server reflection lists each service; health is NOT_SERVING while the model loads;
- TLS and mutual TLS on both services and the executor's store client; plaintext and
  certificate-less clients are refused.
"""

from __future__ import annotations

import datetime
import json
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.service import serve as serve_store
from loraserve.adapter_store.sources import SourceConfig
from loraserve.client import ExecutorClient, StoreClient
from loraserve.errors import StatusError
from loraserve.executor.config import ExecutorConfig
from loraserve.executor.service import build_executor, open_server, serve, shutdown
from loraserve.tls import ClientTls, ServerTls
from loraserve.v1 import executor_pb2 as epb

BASE = "tiny-chat"
STORE_SERVICE, EXECUTOR_SERVICE = "loraserve.v1.AdapterStore", "loraserve.v1.Executor"


def store_config(tmp: Path, adapters: Path, base_dir: Path, **kw) -> StoreConfig:
    return StoreConfig(
        listen="127.0.0.1:0",
        data_dir=tmp,
        base_model=BASE,
        base_model_path=base_dir,
        sources=SourceConfig(local_roots=(adapters,)),
        **kw,
    )


def executor_config(base_dir: Path, store_address: str, **kw) -> ExecutorConfig:
    return ExecutorConfig(
        model=str(base_dir),
        base_model=BASE,
        dtype="float32",
        max_loras=2,
        max_rank=16,
        num_blocks=256,
        block_size=8,
        max_model_len=512,
        store_address=store_address,
        slot_wait_timeout_s=10.0,
        adapter_refresh_s=0,
        **kw,
    )


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics page."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def lora_info(samples, name: str = "loraserve_lora_requests_info") -> tuple[list[str], list[str], str, float]:
    """(running_lora_adapters, waiting_lora_adapters, max_lora, value) of the one LoRA-info sample of a scrape."""
    found = [(dict(labels), v) for (n, labels), v in samples.items() if n == name]
    assert len(found) == 1, found
    return lora_lists(*found[0])


def lora_lists(labels: dict, value: float) -> tuple[list[str], list[str], str, float]:
    assert set(labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}, labels
    split = lambda text: text.split(",") if text else []  # noqa: E731
    return split(labels["running_lora_adapters"]), split(labels["waiting_lora_adapters"]), labels["max_lora"], value


def token_request(adapter: str, max_tokens: int, first: int = 10, length: int = 6) -> epb.GenerateRequest:
    return epb.GenerateRequest(
        adapter=adapter,
        token_ids=epb.TokenIds(ids=list(range(first, first + length))),
        sampling=epb.SamplingParams(max_tokens=max_tokens),
    )


# ---- metrics, reflection, health ----------------------------------------------------------


@pytest.fixture(scope="module")
def served(module_loop_thread, tiny_chat_llama, chat_adapters, tmp_path_factory):
    lt = module_loop_thread
    _, base_dir = tiny_chat_llama
    scfg = store_config(tmp_path_factory.mktemp("ops-store"), chat_adapters, base_dir, metrics_listen="127.0.0.1:0")
    store_server, store_port = lt.run(serve_store(scfg))
    store = StoreClient(f"127.0.0.1:{store_port}", timeout_s=60)
    cfg = executor_config(base_dir, f"127.0.0.1:{store_port}", metrics_listen="127.0.0.1:0", metrics_max_adapters=2)
    parts = build_executor(cfg)
    opened = lt.run(open_server(cfg, "127.0.0.1:0"))
    executor = ExecutorClient(f"127.0.0.1:{opened[0].port}", timeout_s=60)
    loading = health(executor.channel, EXECUTOR_SERVICE)
    with pytest.raises(StatusError) as refused:
        executor.generate("hi")
    server, _ = lt.run(serve(parts, "127.0.0.1:0", opened))
    yield dict(
        store=store,
        executor=executor,
        parts=parts,
        store_server=store_server,
        server=server,
        loading=(loading, refused.value),
        adapters=chat_adapters,
    )
    lt.run(shutdown(server, parts))
    lt.run(store_server.stop(0))


def health(channel, service: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_health_is_not_serving_while_the_model_loads_then_serving(served):
    status, refused = served["loading"]
    assert status == "NOT_SERVING"
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert refused.message == "the executor is loading its model; try again shortly"
    assert health(served["executor"].channel, EXECUTOR_SERVICE) == "SERVING"
    assert health(served["executor"].channel, "") == "SERVING"


def test_reflection_lists_each_services_own_and_standard_services(served):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    standard = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    for client, service in ((served["store"], STORE_SERVICE), (served["executor"], EXECUTOR_SERVICE)):
        db = ProtoReflectionDescriptorDatabase(client.channel)
        assert set(db.get_services()) == {service} | standard
        methods = {m.name for m in db.FindFileContainingSymbol(service).service[0].method}
        assert "FetchShard" in methods if service == STORE_SERVICE else "GenerateStream" in methods


def test_metrics_count_what_was_sent(served):
    store, executor, parts = served["store"], served["executor"], served["parts"]
    adapters = Path(parts.config.model).parent  # not an allowed root: refused
    for name in ("qv8", "mlp4", "o2"):
        store.register(name, str(served["adapters"] / name))
    with pytest.raises(StatusError) as bad_name:
        store.register("bad name", str(served["adapters"] / "qv8"))
    assert (
        bad_name.value.code == grpc.StatusCode.INVALID_ARGUMENT and "adapter name 'bad name' is invalid" in bad_name.value.message
    )
    with pytest.raises(StatusError) as outside:
        store.register("outside", str(adapters))
    assert (
        outside.value.code == grpc.StatusCode.PERMISSION_DENIED
        and "is outside the store's allowed local roots" in outside.value.message
    )

    sent = []  # (adapter, response) in order: qv8 misses then hits; o2 evicts mlp4, the colder (2 slots)
    # qv8's second request finds the 2 full blocks of its 18-token prompt in the prefix cache
    for adapter, n, length in (("", 3, 6), ("qv8", 4, 18), ("qv8", 5, 18), ("mlp4", 2, 6), ("o2", 6, 6)):
        sent.append((adapter, executor._call(executor.stub.Generate, token_request(adapter, n, length=length))))
    assert [r.cached_tokens for _, r in sent] == [0, 0, 16, 0, 0]
    with pytest.raises(StatusError) as missing:
        executor._call(executor.stub.Generate, token_request("missing", 3))
    assert missing.value.code == grpc.StatusCode.NOT_FOUND and missing.value.message == "adapter 'missing' is not registered"

    ex = scrape(parts.metrics_server.port)
    label = {"": "_base", "qv8": "qv8", "mlp4": "mlp4", "o2": "_other"}  # 2 adapter labels: qv8, mlp4
    for lab in set(label.values()):
        mine = [r for a, r in sent if label[a] == lab]
        assert value(ex, "loraserve_executor_requests_total", adapter=lab, code="OK") == len(mine), lab
        assert value(ex, "loraserve_executor_generation_tokens_total", adapter=lab) == sum(len(r.token_ids) for r in mine)
        assert value(ex, "loraserve_executor_prompt_tokens_total", adapter=lab) == sum(r.prompt_tokens for r in mine)
        assert value(ex, "loraserve_executor_prefix_cache_queries_total", adapter=lab) == sum(r.prompt_tokens for r in mine)
        assert value(ex, "loraserve_executor_prefix_cache_hits_total", adapter=lab) == sum(r.cached_tokens for r in mine)
        assert value(ex, "loraserve_executor_time_to_first_token_seconds_count", adapter=lab) == len(mine)
        failed = lab == "_other"  # "missing" counts there too: every request ends, whatever its outcome
        assert value(ex, "loraserve_executor_request_duration_seconds_count", adapter=lab) == len(mine) + failed
    assert value(ex, "loraserve_executor_requests_total", adapter="_other", code="NOT_FOUND") == 1
    assert value(ex, "loraserve_executor_slot_hits_total") == 1  # the second qv8
    assert value(ex, "loraserve_executor_slot_misses_total") == 4  # qv8, mlp4, o2, missing
    assert value(ex, "loraserve_executor_slot_evictions_total") == 1  # mlp4 (asked for once; qv8 twice) for o2
    assert value(ex, "loraserve_executor_adapter_load_seconds_count", tier="store") == 3
    for phase in ("fetch", "slot_wait", "copy"):  # each load's time, split
        assert value(ex, "loraserve_executor_adapter_load_phase_seconds_count", phase=phase) == 3
    assert value(ex, "loraserve_executor_adapter_load_phase_seconds_sum", phase="fetch") > 0
    assert value(ex, "loraserve_executor_lora_slots_total") == 2 and value(ex, "loraserve_executor_lora_slots_used") == 2
    assert value(ex, "loraserve_executor_kv_cache_blocks_total") == 256
    assert value(ex, "loraserve_executor_prefix_cache_blocks") == parts.engine.allocator.num_cached > 0
    assert value(ex, "loraserve_executor_prefix_cache_evictions_total") == 0
    held = {s.name: s.bytes for s in executor.list() if s.in_cpu_cache}
    assert set(held) == {"qv8", "mlp4", "o2"}
    assert value(ex, "loraserve_executor_cpu_cache_bytes") == sum(held.values())
    # idle now: the affinity gauge lists the adapters resident in the 2 slots (qv8, o2), none running
    assert value(ex, "loraserve_lora_requests_info", running_lora_adapters="o2,qv8", waiting_lora_adapters="", max_lora="2") > 0
    assert value(ex, "loraserve_executor_running_sequences") == 0
    # steps by kind (on CPU every step is eager: the prompts' "mixed" ones and "decode" ones, no graphs)
    totals = parts.engine.step_totals
    assert totals["mixed"].steps >= 3 and totals["decode"].steps >= 1 and totals["decode-graph"].steps == 0
    for kind, t in totals.items():
        assert value(ex, "loraserve_executor_steps_total", kind=kind) == t.steps
        assert value(ex, "loraserve_executor_step_seconds_total", kind=kind) == pytest.approx(t.seconds)
        assert value(ex, "loraserve_executor_step_launch_seconds_total", kind=kind) == pytest.approx(t.launch_seconds)
        assert value(ex, "loraserve_executor_step_sequences_total", kind=kind) == t.sequences
    # on the CPU a step's work is done when its launch returns: the launch is (nearly) all of it
    assert 0 < totals["mixed"].launch_seconds <= totals["mixed"].seconds

    st = scrape(served["store_server"].metrics_port)
    assert value(st, "loraserve_store_registrations_total") == 3
    assert value(st, "loraserve_store_registration_rejections_total", reason="INVALID_ARGUMENT") == 1
    assert value(st, "loraserve_store_registration_rejections_total", reason="PERMISSION_DENIED") == 1
    assert value(st, "loraserve_store_cache_misses_total") == 3 and value(st, "loraserve_store_pack_seconds_count") == 3
    shard_bytes = value(st, "loraserve_store_fetch_bytes_total", tier="packed")
    assert shard_bytes > 0 and value(st, "loraserve_store_fetch_seconds_count", tier="packed") == 3
    assert value(st, "loraserve_store_cache_bytes", tier="disk") == shard_bytes  # every packed shard was kept

    # mlp4 again: its shard comes from the executor's CPU cache into a slot (no store fetch).
    executor._call(executor.stub.Generate, token_request("mlp4", 2))
    ex = scrape(parts.metrics_server.port)
    assert value(ex, "loraserve_executor_adapter_load_seconds_count", tier="cpu") == 1


def test_lora_affinity_gauge_names_the_adapter_of_a_running_request(served):
    executor, parts = served["executor"], served["parts"]
    served["store"].register("all4", str(served["adapters"] / "all4"))
    stream = executor.stub.GenerateStream(token_request("all4", 400, first=40), timeout=60)
    seen = []
    try:
        next(stream)  # its first token: the sequence is in the running batch now
        for _ in range(5):
            seen.append(scrape(parts.metrics_server.port))
    finally:
        stream.cancel()
    running = [s for s in seen if value(s, "loraserve_executor_running_sequences") == 1 and "all4" in lora_info(s)[0]]
    assert running, "no scrape saw all4 running"
    assert lora_info(running[0])[2] == "2"
    assert value(running[0], "loraserve_executor_running_sequences") == 1
    assert value(running[0], "loraserve_executor_kv_cache_blocks_used") >= 1


def test_lora_affinity_gauge_names_the_adapter_a_request_waits_for(served):
    """Two slots held by running streams: a request for a third adapter waits for a slot, and the
    gauge lists it as waiting (and the two others as running)."""
    executor, parts, store = served["executor"], served["parts"], served["store"]
    for name in ("qv8", "o2", "mlp4"):
        store.register(name, str(served["adapters"] / name))
    streams = [
        executor.stub.GenerateStream(token_request(name, 400, first=50 + i), timeout=60) for i, name in enumerate(("qv8", "o2"))
    ]
    try:
        for s in streams:
            next(s)  # both slots are held by running sequences now
        third = executor.stub.GenerateStream(token_request("mlp4", 4, first=70), timeout=60)
        seen = []
        for _ in range(20):
            seen.append(scrape(parts.metrics_server.port))
            if any(
                value(
                    s, "loraserve_lora_requests_info", running_lora_adapters="o2,qv8", waiting_lora_adapters="mlp4", max_lora="2"
                )
                > 0
                for s in seen
            ):
                break
    finally:
        for s in streams:
            s.cancel()
    assert any(
        value(s, "loraserve_lora_requests_info", running_lora_adapters="o2,qv8", waiting_lora_adapters="mlp4", max_lora="2") > 0
        for s in seen
    ), "no scrape saw mlp4 waiting beside qv8 and o2 running"
    assert [r.finish_reason for r in third][-1] == epb.LENGTH  # it ran once a slot was free


# ---- the model-server protocol the endpoint picker reads (ENGINE_CONFIG), on the HTTP port ---


@pytest.fixture(scope="module", params=["none", "vllm"])
def routed(request, module_loop_thread, tiny_chat_llama, chat_adapters, tmp_path_factory):
    """A store and an executor (2 slots, the HTTP front on) with --metrics-compat none / vllm."""
    lt = module_loop_thread
    _, base_dir = tiny_chat_llama
    store_server, store_port = lt.run(serve_store(store_config(tmp_path_factory.mktemp("routed"), chat_adapters, base_dir)))
    store = StoreClient(f"127.0.0.1:{store_port}", timeout_s=60)
    for name in ("qv8", "o2", "mlp4", "all4"):
        store.register(name, str(chat_adapters / name))
    cfg = executor_config(base_dir, f"127.0.0.1:{store_port}", http_listen="127.0.0.1:0", metrics_compat=request.param)
    parts = build_executor(cfg)
    server, port = lt.run(serve(parts, "127.0.0.1:0"))
    yield dict(executor=ExecutorClient(f"127.0.0.1:{port}", timeout_s=60), parts=parts, compat=request.param)
    lt.run(shutdown(server, parts))
    lt.run(store_server.stop(0))


def scrape_families(port: int) -> dict:
    """{family name: family} of one /metrics page, by prometheus_client's text parser."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def one_sample(families: dict, spec: str):
    """The sample the endpoint picker would take for `spec` (a name without label matchers, as
    ENGINE_CONFIG's are): for a LoRA-info gauge the newest (highest value); others must have one."""
    family = families[spec]
    samples = family.samples
    assert samples, spec
    if "lora_requests_info" in spec:
        return max(samples, key=lambda s: s.value)
    assert len(samples) == 1, (spec, samples)
    return samples[0]


def test_the_engine_configs_fields_on_the_http_port_while_requests_wait_for_slots(routed):
    """Two adapters hold both slots with running streams, two more are asked for (more adapters than
    slots): every field ENGINE_CONFIG names (and, with compat vllm, VLLM_ENGINE_CONFIG) is on the HTTP
    port's /metrics with the documented labels: running = resident, waiting = asked for and not in a
    slot, max_lora = slots, the LoRA-info value the reading's time; residency by tier with ranks."""
    import time

    from loraserve.metrics import ENGINE_CONFIG, VLLM_ENGINE_CONFIG

    executor, parts = routed["executor"], routed["parts"]
    port = parts.http.port
    configs = [ENGINE_CONFIG] + ([VLLM_ENGINE_CONFIG] if routed["compat"] == "vllm" else [])
    streams = [
        executor.stub.GenerateStream(token_request(name, 400, first=50 + i), timeout=60) for i, name in enumerate(("qv8", "o2"))
    ]
    waiting = []
    try:
        for s in streams:
            next(s)  # both slots are held by running sequences now
        waiting = [
            executor.stub.GenerateStream(token_request(name, 4, first=80 + i), timeout=60)
            for i, name in enumerate(("mlp4", "all4"))
        ]
        seen = None
        for _ in range(40):
            families = scrape_families(port)
            running, asked, _, _ = lora_info_of(one_sample(families, ENGINE_CONFIG["loraSpec"]))
            if running == ["o2", "qv8"] and asked == ["all4", "mlp4"]:
                seen = families
                break
        assert seen is not None, "no scrape saw qv8 and o2 resident while mlp4 and all4 waited"
        later = scrape_families(port)
    finally:
        for s in streams:
            s.cancel()
    for cfg in configs:
        queued = one_sample(seen, cfg["queuedRequestsSpec"])
        assert queued.value >= 2, cfg["name"]  # mlp4's and all4's requests (queued at arrival)
        assert one_sample(seen, cfg["runningRequestsSpec"]).value == 2
        assert 0 < one_sample(seen, cfg["kvUsageSpec"]).value <= 1
        info = one_sample(seen, cfg["loraSpec"])
        assert lora_info_of(info)[:3] == (["o2", "qv8"], ["all4", "mlp4"], "2")
        assert abs(info.value - time.time()) < 60  # the reading's Unix time ...
        assert one_sample(later, cfg["loraSpec"]).value > info.value  # ... so the newest reading wins
        cache = one_sample(seen, cfg["cacheInfoSpec"])
        assert cache.value == 1 and (cache.labels["block_size"], cache.labels["num_gpu_blocks"]) == ("8", "256")
    assert any(n.startswith("vllm:") for n in seen) == (routed["compat"] == "vllm")
    if routed["compat"] == "vllm":
        assert one_sample(seen, "vllm:num_requests_running").labels == {"model_name": BASE}
    tiers = {s.labels["adapter"]: s.labels for s in seen["loraserve_executor_adapter_residency"].samples}
    assert {n: t["tier"] for n, t in tiers.items() if t["tier"] == "gpu"} == {"qv8": "gpu", "o2": "gpu"}
    assert (tiers["qv8"]["rank"], tiers["o2"]["rank"], tiers["qv8"]["pinned"]) == ("8", "2", "false")
    assert tiers["mlp4"]["tier"] in ("cpu", "store") and tiers["all4"]["tier"] in ("cpu", "store")
    assert one_sample(seen, "loraserve_executor_lora_slots_used").value == 2
    assert one_sample(seen, "loraserve_executor_lora_slots_total").value == 2
    for w in waiting:
        assert [r.finish_reason for r in w][-1] == epb.LENGTH  # each ran once a slot was free
    # idle: no request runs, and the gauge still lists the two adapters resident in the slots
    idle = scrape_families(port)
    running, asked, max_lora, _ = lora_info_of(one_sample(idle, ENGINE_CONFIG["loraSpec"]))
    assert one_sample(idle, ENGINE_CONFIG["runningRequestsSpec"]).value == 0
    assert len(running) == 2 and set(running) <= {"qv8", "o2", "mlp4", "all4"} and asked == [] and max_lora == "2"
    # residency is read anew at each scrape: an adapter that left its slot since is no longer labelled gpu
    now = [(s.labels["adapter"], s.labels["tier"]) for s in idle["loraserve_executor_adapter_residency"].samples]
    assert len({name for name, _ in now}) == len(now)  # one series an adapter
    assert sorted(name for name, tier in now if tier == "gpu") == sorted(running)


def lora_info_of(sample) -> tuple[list[str], list[str], str, float]:
    return lora_lists(sample.labels, sample.value)


def test_an_unknown_metrics_compat_is_refused():
    from loraserve.cli import build_parser
    from loraserve.metrics import ExecutorMetrics

    with pytest.raises(ValueError, match="metrics compat must be one of none, vllm, got 'sglang'"):
        ExecutorMetrics(compat="sglang")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["executor", "--metrics-compat", "sglang"])


# ---- TLS and mutual TLS -------------------------------------------------------------------


def make_certs(directory: Path) -> dict[str, Path]:
    """A CA; a server certificate for 127.0.0.1 / localhost; a client certificate from the CA;
    and a client certificate from another CA (a stranger). PEM files in `directory`."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    files: dict[str, Path] = {}

    def write(name: str, cert, key) -> None:
        files[f"{name}_cert"] = directory / f"{name}.pem"
        files[f"{name}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{name}_key"] = directory / f"{name}-key.pem"
        files[f"{name}_key"].write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )

    def issue(cn: str, issuer=None, issuer_key=None, ca: bool = False, server: bool = False):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer.subject if issuer else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        if not ca:
            usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return builder.sign(issuer_key or key, hashes.SHA256()), key

    ca, ca_key = issue("loraserve-test-ca", ca=True)
    write("ca", ca, ca_key)
    write("server", *issue("loraserve-server", ca, ca_key, server=True))
    write("client", *issue("loraserve-client", ca, ca_key))
    other, other_key = issue("stranger-ca", ca=True)
    write("stranger", *issue("stranger", other, other_key))
    return files


@pytest.fixture(scope="module")
def tls_served(module_loop_thread, tiny_chat_llama, chat_adapters, tmp_path_factory):
    """A store serving TLS, an executor serving mutual TLS that reaches the store over TLS."""
    lt = module_loop_thread
    _, base_dir = tiny_chat_llama
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    scfg = store_config(
        tmp_path_factory.mktemp("tls-store"), chat_adapters, base_dir, tls=ServerTls(certs["server_cert"], certs["server_key"])
    )
    store_server, store_port = lt.run(serve_store(scfg))
    cfg = executor_config(
        base_dir,
        f"127.0.0.1:{store_port}",
        store_tls=ClientTls(certs["ca_cert"]),
        tls=ServerTls(certs["server_cert"], certs["server_key"], certs["ca_cert"]),
    )
    parts = build_executor(cfg)
    server, port = lt.run(serve(parts, "127.0.0.1:0"))
    yield dict(certs=certs, store=f"127.0.0.1:{store_port}", executor=f"127.0.0.1:{port}", adapters=chat_adapters)
    lt.run(shutdown(server, parts))
    lt.run(store_server.stop(0))


def test_tls_store_and_mtls_executor_serve_clients_with_the_right_certificates(tls_served):
    c = tls_served["certs"]
    store = StoreClient(tls_served["store"], timeout_s=30, tls=ClientTls(c["ca_cert"]))
    store.register("qv8", str(tls_served["adapters"] / "qv8"))
    executor = ExecutorClient(
        tls_served["executor"], timeout_s=30, tls=ClientTls(c["ca_cert"], c["client_cert"], c["client_key"])
    )
    reply = executor._call(executor.stub.Generate, token_request("qv8", 3))  # the executor fetched it over TLS
    assert len(reply.token_ids) == 3 and reply.adapter_digest == store.get("qv8").digest


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "stranger's certificate", "plaintext store"])
def test_tls_refuses_clients_without_the_right_credentials(tls_served, who):
    c = tls_served["certs"]
    tls = {
        "plaintext": None,
        "no client certificate": ClientTls(c["ca_cert"]),
        "stranger's certificate": ClientTls(c["ca_cert"], c["stranger_cert"], c["stranger_key"]),
        "plaintext store": None,
    }[who]
    if who == "plaintext store":
        client = StoreClient(tls_served["store"], timeout_s=10, tls=tls)
        call = lambda: client.list()  # noqa: E731
    else:
        client = ExecutorClient(tls_served["executor"], timeout_s=10, tls=tls)
        call = client.info
    with pytest.raises(StatusError) as refused:
        call()
    # The TLS handshake fails (the server's log says why), so the channel never connects.
    address = tls_served["store" if who == "plaintext store" else "executor"]
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert refused.value.message.startswith(f"failed to connect to all addresses; last error: UNAVAILABLE: ipv4:{address}: "), (
        refused.value.message
    )


# ---- the Grafana dashboard ------------------------------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "loraserve-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",), "info": ("_info",)}


def exported_names(port: int) -> set[str]:
    """Every sample name a /metrics page defines (from its TYPE lines, so labelled series not yet
    observed count too)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name + suffix for f in text_string_to_metric_families(text) for suffix in SUFFIXES.get(f.type, ("",))}


def test_every_dashboard_query_names_metrics_the_services_export(served):
    exported = exported_names(served["parts"].metrics_server.port) | exported_names(served["store_server"].metrics_port)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"\bloraserve_[a-z_]+\b", e)}
    assert not used - exported, f"the dashboard queries metrics nobody exports: {sorted(used - exported)}"
    # Every panel the issue asks for is there.
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for what in (
        "requests / s",
        "tokens / s",
        "time to first token",
        "sequences",
        "kv cache",
        "slot hit rate",
        "adapter load latency",
        "store cache hits",
    ):
        assert what in titles, what


def test_prefix_cache_queries_count_only_prompts_looked_up_in_the_cache():
    """A request whose prompt was never looked up (caching off, or an adapter version without a
    content digest) adds to neither prefix-cache counter; one looked up adds its prompt tokens to
    the queries and its cached tokens to the hits."""
    import asyncio

    from prometheus_client import generate_latest

    from loraserve.executor.engine.requests import GenerationOutput
    from loraserve.metrics import ExecutorMetrics

    m = ExecutorMetrics()

    async def run(adapter: str, cacheable: bool) -> None:
        async def outputs():
            yield GenerationOutput(
                "r", [5], "x", [], "length", 40, "", cached_tokens=32 if cacheable else 0, prefix_cacheable=cacheable
            )

        async for _ in m.track(outputs(), adapter):
            pass

    asyncio.run(run("looked-up", True))
    asyncio.run(run("never-looked-up", False))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(m.registry).decode())
        for s in family.samples
    }
    assert value(samples, "loraserve_executor_prefix_cache_queries_total", adapter="looked-up") == 40
    assert value(samples, "loraserve_executor_prefix_cache_hits_total", adapter="looked-up") == 32
    assert ("loraserve_executor_prefix_cache_queries_total", (("adapter", "never-looked-up"),)) not in samples
    assert value(samples, "loraserve_executor_prompt_tokens_total", adapter="never-looked-up") == 40
