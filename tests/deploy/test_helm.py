"""The chart rendered by Helm itself (helm-python-sdk bundles Helm v4's engine: no binary), linted,
checked against values.schema.json, and every manifest validated by kubernetes-validate against
two Kubernetes versions, with default and non-default values."""

from __future__ import annotations

import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from loraserve.cli import build_parser
from loraserve.defaults import DEFAULT_BASE_MODEL

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "loraserve"
KUBE_VERSIONS = ("1.27.0", "1.33.0")  # the chart needs >= 1.24 (gRPC probes)
CRDS = {"monitoring.coreos.com/v1"}  # the Prometheus Operator's: no schema in kubernetes-validate

NON_DEFAULT = {
    "tls": {"enabled": True, "existingSecret": "loraserve-tls", "mutual": True},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}, "executorPort": 9400},
    "redis": {"enabled": False, "url": "redis://redis.example:6379/1"},
    "executor": {
        "replicaCount": 4,
        "gpu": {"count": 0},
        "dtype": "bfloat16",
        "quantization": "fp8",
        "kvCacheDtype": "fp8",
        "loraDtype": "fp8",
        "service": {"headless": True},
        "httpPort": 0,
        "enforceEager": True,
        "prefixCaching": False,
        "tpSize": 2,
        "fullyShardedLoras": False,  # with tpSize 2 and enableDora: refused (test_dora_with_fully_sharded_loras_...)
        "enableDora": True,
        "enableTrainableTokens": True,
        "maxLoras": 16,
    },
    "model": {
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "path": "/models/llama",
        "volume": {"persistentVolumeClaim": {"claimName": "models"}},
    },
    "auth": {"storeAdminToken": "s", "executorAdminToken": "e"},
    "s3": {"existingSecret": "aws", "endpointUrl": "http://minio:9000"},
    "store": {"persistence": {"enabled": False}},
}


def render(values: dict) -> list[dict]:
    out = helm.Chart.load(CHART).render(values, name="lora", namespace="ml", is_install=True)
    docs = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module", params=["default", "non-default"])
def manifests(request):
    return request.param, render({} if request.param == "default" else NON_DEFAULT)


def test_lint_finds_no_error_or_warning():
    for values in ({}, NON_DEFAULT):
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_manifest_validates_against_kubernetes(manifests, version):
    _, docs = manifests
    for doc in docs:
        if doc["apiVersion"] in CRDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)


def kinds(docs) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def container(docs, component: str) -> dict:
    dep = next(d for d in kinds(docs)["Deployment"] if d["metadata"]["name"] == f"lora-loraserve-{component}")
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_rendered_args_parse_with_the_real_cli(manifests):
    which, docs = manifests
    parser = build_parser()
    for component in ("store", "executor"):
        args = container(docs, component)["args"]
        parsed = parser.parse_args(args)
        assert parsed.command == component
    assert parsed.kv_cache_dtype == ("auto" if which == "default" else "fp8")
    assert parsed.max_loras == (0 if which == "default" else 16)


def test_the_chart_sizes_the_gpu_slots_from_memory_as_the_executor_does(monkeypatch):
    """By default the chart passes --max-loras 0, the executor's own default: as many slots as the
    GPU memory left after the model and KV cache holds (docs/OPERATIONS.md)."""
    monkeypatch.delenv("LORASERVE_MAX_LORAS", raising=False)
    cli_default = build_parser().parse_args(["executor"]).max_loras
    assert cli_default == 0
    assert f"--max-loras={cli_default}" in container(render({}), "executor")["args"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["executor"]["maxLoras"] == cli_default
    readme = (CHART.parents[1] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `executor.maxLoras`"))
    assert row.split(" | ")[1] == f"{cli_default}, {values['executor']['maxLoraRank']}"  # the values table's defaults


def test_metrics_ports_tls_pdb_and_service_monitor(manifests):
    which, docs = manifests
    k = kinds(docs)
    store, executor = container(docs, "store"), container(docs, "executor")
    ports = {c["name"]: {p["name"]: p["containerPort"] for p in c["ports"]} for c in (store, executor)}
    assert ports["store"]["metrics"] == 9091
    assert ports["executor"]["metrics"] == (9090 if which == "default" else 9400)
    assert f"--executor-metrics-port={ports['executor']['metrics']}" in executor["args"]
    for svc in k["Service"]:
        if svc["metadata"]["name"].endswith(("-store", "-executor")):
            assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}
    pdbs = {p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: p for p in k["PodDisruptionBudget"]}
    assert set(pdbs) == {"executor", "store"} and all(p["spec"]["maxUnavailable"] == 1 for p in pdbs.values())
    if which == "default":
        assert "ServiceMonitor" not in k and not any(a.startswith("--tls") or "tls" in a for a in store["args"])
        assert "grpc" in executor["readinessProbe"]
        return
    monitors = {m["metadata"]["name"]: m for m in k["ServiceMonitor"]}
    assert set(monitors) == {"lora-loraserve-store", "lora-loraserve-executor"}
    for m in monitors.values():
        assert m["metadata"]["labels"]["release"] == "prometheus" and m["spec"]["endpoints"][0]["port"] == "metrics"
    assert {"--tls-cert=/etc/loraserve/tls/tls.crt", "--tls-client-ca=/etc/loraserve/tls/ca.crt"} <= set(store["args"])
    assert {
        "--executor-tls-client-ca=/etc/loraserve/tls/ca.crt",
        "--store-tls-ca=/etc/loraserve/tls/ca.crt",
        "--store-tls-cert=/etc/loraserve/tls/tls.crt",
    } <= set(executor["args"])
    assert "tcpSocket" in executor["readinessProbe"]  # the kubelet's gRPC probe speaks no TLS


def test_metrics_disabled_turns_them_off_in_both_services():
    """metrics.enabled false: the flags say 0 (the CLI's default is on), and no metrics port is declared."""
    docs = render({"metrics": {"enabled": False}})
    store, executor = container(docs, "store"), container(docs, "executor")
    assert "--metrics-port=0" in store["args"] and "--executor-metrics-port=0" in executor["args"]
    for c in (store, executor):
        assert "metrics" not in {p["name"] for p in c["ports"]}


def deployment(docs, component: str) -> dict:
    return next(d for d in kinds(docs)["Deployment"] if d["metadata"]["name"] == f"lora-loraserve-{component}")


def test_store_replicas_share_the_redis_registry(manifests):
    """With a Redis (the chart's own or an external one): 2 stores, --registry redis, scratch data dirs."""
    which, docs = manifests
    store = deployment(docs, "store")
    assert store["spec"]["replicas"] == 2 and store["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "--registry=redis" in container(docs, "store")["args"]
    data = next(v for v in store["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert data == {"name": "data", "emptyDir": {}}
    claims = {c["metadata"]["name"] for c in kinds(docs).get("PersistentVolumeClaim", [])}
    if which == "default":  # the chart's Redis holds the registry: it persists (AOF on a PVC)
        assert claims == {"lora-loraserve-redis"}
        args = container(docs, "redis")["args"]
        assert args[args.index("--appendonly") + 1] == "yes"
    else:
        assert claims == set()


def test_without_redis_one_store_keeps_the_file_registry():
    docs = render({"redis": {"enabled": False}, "store": {"replicaCount": 1}})
    k = kinds(docs)
    store = deployment(docs, "store")
    assert store["spec"]["replicas"] == 1 and store["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(a.startswith(("--registry", "--redis")) for a in container(docs, "store")["args"])
    assert [c["metadata"]["name"] for c in k["PersistentVolumeClaim"]] == ["lora-loraserve-store"]
    assert [p["metadata"]["name"] for p in k["PodDisruptionBudget"]] == ["lora-loraserve-executor"]
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
    with pytest.raises(
        helm.HelmRenderError, match=r"store.replicaCount > 1 needs a Redis \(redis.enabled, redis.url or redis.existingSecret\)"
    ):
        render({"redis": {"enabled": False}})


def test_schema_refuses_wrong_values():
    with pytest.raises(helm.HelmValuesError, match="at '/executor/port': got string, want integer"):
        render({"executor": {"port": "fifty"}})
    with pytest.raises(helm.HelmValuesError, match="additional properties 'replicas' not allowed"):
        render({"executor": {"replicas": 3}})
    with pytest.raises(helm.HelmValuesError, match="at '/store/replicaCount': minimum: got 0, want 1"):
        render({"store": {"replicaCount": 0}})
    with pytest.raises(helm.HelmRenderError, match="tls.enabled needs tls.existingSecret"):
        render({"tls": {"enabled": True}})
    with pytest.raises(helm.HelmValuesError, match="at '/executor/maxLoras': minimum: got -1, want 0"):
        render({"executor": {"maxLoras": -1}})
    with pytest.raises(helm.HelmValuesError, match="at '/executor/epSize': minimum: got 0, want 1"):
        render({"executor": {"epSize": 0}})
    with pytest.raises(helm.HelmRenderError, match=r"executor.epSize > 1 needs executor.tpSize 1"):
        render({"executor": {"epSize": 2, "tpSize": 2}})
    ep = container(render({"executor": {"epSize": 2, "gpu": {"count": 2}}}), "executor")["args"]
    assert "--ep-size=2" in ep and "--tp-size=1" in ep
    # One GPU per rank: fewer GPUs than ranks would crash-loop the pod on its second rank.
    with pytest.raises(helm.HelmRenderError, match=r"executor.gpu.count 1 is fewer than the executor's 2 ranks"):
        render({"executor": {"epSize": 2}})
    with pytest.raises(helm.HelmRenderError, match=r"executor.gpu.count 2 is fewer than the executor's 4 ranks"):
        render({"executor": {"tpSize": 4, "gpu": {"count": 2}}})
    assert "--tp-size=2" in container(render({"executor": {"tpSize": 2, "gpu": {"count": 0}}}), "executor")["args"]  # CPU ranks


def test_executor_http_port_and_eager_flag(manifests):
    """The OpenAI-compatible HTTP port is on the pod and the Service by default; 0 removes it."""
    which, docs = manifests
    executor = container(docs, "executor")
    service = next(s for s in kinds(docs)["Service"] if s["metadata"]["name"].endswith("-executor"))
    pod_ports = {p["name"]: p["containerPort"] for p in executor["ports"]}
    svc_ports = {p["name"] for p in service["spec"]["ports"]}
    if which == "default":
        assert pod_ports["http"] == 8000 and "http" in svc_ports
        assert "--http-port=8000" in executor["args"] and "--enforce-eager" not in executor["args"]
        assert "--no-prefix-caching" not in executor["args"]
        assert "--tp-size=1" in executor["args"] and "--fully-sharded-loras" not in executor["args"]
        assert "--ep-size=1" in executor["args"] and "--enable-dora" not in executor["args"]
        assert "--enable-trainable-tokens" not in executor["args"]
    else:
        assert "http" not in pod_ports and "http" not in svc_ports
        assert "--http-port=0" in executor["args"] and "--enforce-eager" in executor["args"]
        assert "--no-prefix-caching" in executor["args"]
        assert "--tp-size=2" in executor["args"] and "--fully-sharded-loras" not in executor["args"]
        assert "--enable-dora" in executor["args"] and "--enable-trainable-tokens" in executor["args"]


def test_executor_kernel_cache_is_an_emptydir_named_by_triton_cache_dir(manifests):
    """The warm-up's Triton builds land on an emptyDir (TRITON_CACHE_DIR), kept across container
    restarts in the pod; "" leaves the image's default and mounts nothing."""
    _, docs = manifests
    executor = container(docs, "executor")
    env = {e["name"]: e.get("value") for e in executor["env"]}
    assert env["TRITON_CACHE_DIR"] == "/var/cache/loraserve/triton"
    mount = next(m for m in executor["volumeMounts"] if m["name"] == "kernel-cache")
    assert mount["mountPath"] == "/var/cache/loraserve/triton"
    pod = next(d for d in kinds(docs)["Deployment"] if d["metadata"]["name"].endswith("-executor"))["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "kernel-cache") == {"name": "kernel-cache", "emptyDir": {}}
    off = container(render({"executor": {"kernelCacheDir": ""}}), "executor")
    assert "TRITON_CACHE_DIR" not in {e["name"] for e in off["env"]}
    assert "kernel-cache" not in {m["name"] for m in off.get("volumeMounts", [])}
    with pytest.raises(helm.HelmValuesError, match="at '/executor/kernelCacheDir': 'relative/path' does not match"):
        render({"executor": {"kernelCacheDir": "relative/path"}})


# ---- adapter-aware routing: the InferencePool and the endpoint picker's configuration -------

POOL = {"inferencePool": {"enabled": True}, "metrics": {"compat": "vllm"}}
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")  # the CRD's matchLabels value pattern
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_inference_pool_v1(pool: dict) -> None:
    """The fields of inference.networking.k8s.io/v1 InferencePool (the Gateway API inference
    extension's CRD, api/v1/inferencepool_types.go) one by one: no unknown field, required ones
    present, enums, ranges and patterns as its OpenAPI schema has them."""
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert set(pool) <= {"apiVersion", "kind", "metadata", "spec"}
    assert DNS_LABEL.match(pool["metadata"]["name"]) and len(pool["metadata"]["name"]) <= 63
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert {"selector", "targetPorts"} <= set(spec)
    assert set(spec["selector"]) == {"matchLabels"}
    labels = spec["selector"]["matchLabels"]
    assert 1 <= len(labels) <= 64 and all(isinstance(v, str) and LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values())
    ports = spec["targetPorts"]
    assert 1 <= len(ports) <= 8 and len({p["number"] for p in ports}) == len(ports)
    for p in ports:
        assert set(p) == {"number"} and isinstance(p["number"], int) and 1 <= p["number"] <= 65535
    assert spec.get("appProtocol", "http") in ("http", "kubernetes.io/h2c")
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"}
    assert 1 <= len(ref["name"]) <= 253
    if ref.get("kind", "Service") == "Service":
        assert set(ref["port"]) == {"number"} and 1 <= ref["port"]["number"] <= 65535
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def pod_labels(docs, component: str) -> dict:
    return deployment(docs, component)["spec"]["template"]["metadata"]["labels"]


def test_inference_pool_selects_the_executors_http_port_through_the_endpoint_picker():
    from loraserve.metrics import ENGINE_TYPE, ENGINE_TYPE_LABEL

    docs = render(POOL)
    k = kinds(docs)
    [pool] = k["InferencePool"]
    check_inference_pool_v1(pool)
    labels = pool["spec"]["selector"]["matchLabels"]
    assert labels.items() <= pod_labels(docs, "executor").items() and labels[ENGINE_TYPE_LABEL] == ENGINE_TYPE
    assert not labels.items() <= pod_labels(docs, "store").items()
    http = next(p["containerPort"] for p in container(docs, "executor")["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    assert pool["metadata"]["name"] == "lora-loraserve"
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "lora-router-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert "--metrics-compat=vllm" in container(docs, "executor")["args"]
    for version in KUBE_VERSIONS:  # the ConfigMap and the rest; the InferencePool (a CRD) is checked above
        for doc in docs:
            if doc["apiVersion"] not in CRDS | {"inference.networking.k8s.io/v1"}:
                kubernetes_validate.validate(doc, version, strict=True)
    report = helm.lint(CHART, POOL, strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    named = render(
        {"inferencePool": {"enabled": True, "name": "adapters", "endpointPicker": {"service": "epp", "failureMode": "FailOpen"}}}
    )
    [pool] = kinds(named)["InferencePool"]
    check_inference_pool_v1(pool)
    assert pool["metadata"]["name"] == "adapters" and pool["spec"]["endpointPickerRef"]["name"] == "epp"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_the_endpoint_picker_config_reads_loraserves_engine_config():
    """The EndpointPickerConfig the chart ships: the engine config is loraserve/metrics.py's
    ENGINE_CONFIG (which tests/test_operations.py scrapes from a live executor), the pods' label
    picks it, the scorer weights are those fleet_sim simulates; the llm-d router chart's values
    carry the same file and point its EPP at this pool."""
    import sys

    from loraserve.metrics import ENGINE_CONFIG, ENGINE_TYPE_LABEL

    sys.path.insert(0, str(CHART.parents[2] / "benchmarks"))
    import fleet_sim

    docs = render(POOL)
    [cm] = [c for c in kinds(docs)["ConfigMap"] if c["metadata"]["name"] == "lora-loraserve-epp"]
    cfg = yaml.safe_load(cm["data"]["loraserve-plugins.yaml"])
    assert cfg["apiVersion"] == "llm-d.ai/v1alpha1" and cfg["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in cfg["plugins"]}
    extractor = plugins["core-metrics-extractor"]["parameters"]
    assert extractor["engineLabelKey"] == ENGINE_TYPE_LABEL and extractor["engineConfigs"] == [ENGINE_CONFIG]
    assert plugins["metrics-data-source"]["parameters"] == {"scheme": "http", "path": "/metrics"}
    [profile] = cfg["schedulingProfiles"]
    assert {p["pluginRef"]: p["weight"] for p in profile["plugins"]} == fleet_sim.EPP_WEIGHTS
    refs = [p["pluginRef"] for p in profile["plugins"]]
    for source in cfg["dataLayer"]["sources"]:
        refs += [source["pluginRef"]] + [e["pluginRef"] for e in source["extractors"]]
    assert set(refs) <= set(plugins)  # every reference names a declared plugin
    router = yaml.safe_load(cm["data"]["llm-d-router-values.yaml"])
    ext = router["inferenceExtension"]
    assert yaml.safe_load(ext["pluginsCustomConfig"][ext["pluginsConfigFile"]]) == cfg
    [pool] = kinds(docs)["InferencePool"]
    assert ext["flags"]["pool-name"] == pool["metadata"]["name"]
    assert router["inferencePool"]["modelServers"]["matchLabels"] == pool["spec"]["selector"]["matchLabels"]
    assert router["inferencePool"]["targetPorts"] == pool["spec"]["targetPorts"]
    assert ext["extProcPort"] == pool["spec"]["endpointPickerRef"]["port"]["number"]


def test_without_the_pool_the_executors_still_carry_the_engine_type_label(manifests):
    which, docs = manifests
    k = kinds(docs)
    assert "InferencePool" not in k and not any(c["metadata"]["name"].endswith("-epp") for c in k.get("ConfigMap", []))
    assert pod_labels(docs, "executor")["llm-d.ai/engine-type"] == "loraserve"
    assert "--metrics-compat=none" in container(docs, "executor")["args"]


def test_the_pool_needs_the_http_port_and_known_values():
    with pytest.raises(helm.HelmRenderError, match="inferencePool.enabled needs executor.httpPort"):
        render({"inferencePool": {"enabled": True}, "executor": {"httpPort": 0}})
    with pytest.raises(helm.HelmValuesError, match="at '/inferencePool/endpointPicker/failureMode'"):
        render({"inferencePool": {"enabled": True, "endpointPicker": {"failureMode": "Sometimes"}}})
    with pytest.raises(helm.HelmValuesError, match="at '/metrics/compat'"):
        render({"metrics": {"compat": "sglang"}})
    with pytest.raises(helm.HelmValuesError, match="at '/inferencePool/name'"):
        render({"inferencePool": {"enabled": True, "name": "Not_A_Name"}})


def test_kv_events_publish_on_a_pod_port_under_the_indexers_topic():
    """Off by default; enabled, the executor binds the PUB (and replay) port, named on the pod,
    with the llm-d indexer's topic kv@<pod ip>@<model> (POD_IP from the downward API)."""
    off = container(render({}), "executor")
    assert not [a for a in off["args"] if a.startswith("--kv-events")] and "kv-events" not in {p["name"] for p in off["ports"]}
    docs = render({"executor": {"kvEvents": {"enabled": True, "replayPort": 5558}}})
    executor = container(docs, "executor")
    assert "--kv-events-endpoint=tcp://*:5557" in executor["args"]
    assert f"--kv-events-topic=kv@$(POD_IP)@{DEFAULT_BASE_MODEL}" in executor["args"]  # the embedded model's name
    assert "--kv-events-replay-endpoint=tcp://*:5558" in executor["args"]
    assert {p["name"]: p["containerPort"] for p in executor["ports"]}.items() >= {"kv-events": 5557, "kv-replay": 5558}.items()
    pod_ip = next(e for e in executor["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert build_parser().parse_args(executor["args"]).kv_events_endpoint == "tcp://*:5557"
    for version in KUBE_VERSIONS:
        for doc in docs:
            if doc["apiVersion"] not in CRDS:
                kubernetes_validate.validate(doc, version, strict=True)
    named = {
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "path": "/models/llama",
        "volume": {"persistentVolumeClaim": {"claimName": "m"}},
    }
    args = container(render({"model": named, "executor": {"kvEvents": {"enabled": True}}}), "executor")["args"]
    assert "--kv-events-topic=kv@$(POD_IP)@meta-llama/Llama-3.1-8B-Instruct" in args
    assert not [a for a in args if a.startswith("--kv-events-replay")]
    topic = container(render({"executor": {"kvEvents": {"enabled": True, "topic": "kv@x@y"}}}), "executor")["args"]
    assert "--kv-events-topic=kv@x@y" in topic
    with pytest.raises(helm.HelmRenderError, match=r"executor.kvEvents.enabled needs executor.prefixCaching"):
        render({"executor": {"kvEvents": {"enabled": True}, "prefixCaching": False}})
    with pytest.raises(helm.HelmValuesError, match="additional properties 'endpoint' not allowed"):
        render({"executor": {"kvEvents": {"endpoint": "tcp://*:5557"}}})


def test_dora_with_fully_sharded_loras_under_tp_fails_the_render():
    """The executor refuses --enable-dora with --fully-sharded-loras under --tp-size > 1 (a DoRA norm
    needs each rank's whole LoRA rank): the chart fails at install time instead of crash-looping."""
    with pytest.raises(
        helm.HelmRenderError,
        match=r"executor.enableDora is not served with executor.fullyShardedLoras under executor.tpSize > 1",
    ):
        render({"executor": {"tpSize": 2, "gpu": {"count": 2}, "fullyShardedLoras": True, "enableDora": True}})
    for executor in (
        {"tpSize": 2, "gpu": {"count": 2}, "fullyShardedLoras": True},
        {"tpSize": 2, "gpu": {"count": 2}, "enableDora": True},
        {"tpSize": 1, "fullyShardedLoras": True, "enableDora": True},
    ):
        args = container(render({"executor": executor}), "executor")["args"]
        parsed = build_parser().parse_args(args)
        assert (parsed.tp_size, parsed.fully_sharded_loras, parsed.enable_dora) == (
            executor["tpSize"],
            executor.get("fullyShardedLoras", False),
            executor.get("enableDora", False),
        )


def test_a_kv_events_replay_port_equal_to_the_pub_port_fails_the_render():
    with pytest.raises(helm.HelmRenderError, match=r"executor.kvEvents.replayPort 5557 is executor.kvEvents.port"):
        render({"executor": {"kvEvents": {"enabled": True, "replayPort": 5557}}})
    with pytest.raises(helm.HelmRenderError, match=r"executor.kvEvents.replayPort 6000 is executor.kvEvents.port"):
        render({"executor": {"kvEvents": {"enabled": True, "port": 6000, "replayPort": 6000}}})
    args = container(render({"executor": {"kvEvents": {"enabled": True, "port": 6000, "replayPort": 5557}}}), "executor")["args"]
    assert "--kv-events-endpoint=tcp://*:6000" in args and "--kv-events-replay-endpoint=tcp://*:5557" in args
