"""The chart rendered by Helm itself (helm-python-sdk bundles Helm v4's engine: no binary), linted,
checked against values.schema.json, and every manifest validated by kubernetes-validate against
two Kubernetes versions, with default and non-default values."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from loraserve.cli import build_parser

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
        "service": {"headless": True},
        "httpPort": 0,
        "enforceEager": True,
        "tpSize": 2,
        "fullyShardedLoras": True,
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
    _, docs = manifests
    parser = build_parser()
    for component in ("store", "executor"):
        args = container(docs, component)["args"]
        parsed = parser.parse_args(args)
        assert parsed.command == component


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
        assert "--tp-size=1" in executor["args"] and "--fully-sharded-loras" not in executor["args"]
        assert "--ep-size=1" in executor["args"]
    else:
        assert "http" not in pod_ports and "http" not in svc_ports
        assert "--http-port=0" in executor["args"] and "--enforce-eager" in executor["args"]
        assert "--tp-size=2" in executor["args"] and "--fully-sharded-loras" in executor["args"]


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
