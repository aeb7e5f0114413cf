"""Prometheus metrics of both services, defined in one place.

Names follow Prometheus conventions: `loraserve_<service>_<what>_<unit>`, counters end in
`_total`, durations are in seconds and sizes in bytes. Each service has its own registry
(two services in one process, as `loraserve up` runs them, never clash) served on its own
`/metrics` port (`serve_metrics`).

Nothing here runs on the executor's step loop:
- request metrics are counted by `ExecutorMetrics.track`, which wraps `Engine.generate` in the
  request's own task (the front's coroutine), one observation per output;
- slot hits / misses / evictions and adapter load times come from the slot manager, on the
  event loop, when an adapter is acquired or loaded (`SlotObserver`);
- queue depth, KV blocks, slot occupancy, CPU cache bytes, adapter residency and the LoRA
  affinity gauge are read from the engine's and slot manager's snapshots when Prometheus scrapes
  (`_ExecutorState.collect`), never pushed.

The model-server protocol (what the Gateway API inference extension's endpoint picker reads for
queue, running, KV use, LoRA affinity and cache shape) is `ENGINE_CONFIG`: the engine config of
an executor pod labelled `ENGINE_TYPE_LABEL: loraserve` (deploy/helm ships it). With
`compat="vllm"` the same readings are also served under vLLM's names (`VLLM_ENGINE_CONFIG`).

The adapter label is bounded: the first `max_adapter_labels` adapters seen keep their names,
later ones count as OTHER; the base model (no adapter) is BASE. Adapter names start with a
letter or digit, so neither can clash with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraserve.errors import StatusError
from loraserve.serving import ListenError

log = logging.getLogger(__name__)

BASE = "_base"
OTHER = "_other"
DEFAULT_MAX_ADAPTER_LABELS = 32
LORA_INFO = "loraserve_lora_requests_info"  # vLLM's lora_requests_info labels; lists the RESIDENT adapters
ENGINE_TYPE = "loraserve"
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"  # the pod label the endpoint picker picks an engine config by
# The endpoint picker's core-metrics-extractor engineConfigs entry for loraserve (spec strings: PromQL selectors).
ENGINE_CONFIG = {
    "name": ENGINE_TYPE,
    "queuedRequestsSpec": "loraserve_executor_waiting_sequences",
    "runningRequestsSpec": "loraserve_executor_running_sequences",
    "kvUsageSpec": "loraserve_executor_kv_cache_usage_ratio",
    "loraSpec": LORA_INFO,
    "cacheInfoSpec": "loraserve_executor_cache_config_info",
}
# vLLM's names of the same readings (the picker's built-in "vllm" engine config), served with compat="vllm".
VLLM_ENGINE_CONFIG = {
    "name": "vllm",
    "queuedRequestsSpec": "vllm:num_requests_waiting",
    "runningRequestsSpec": "vllm:num_requests_running",
    "kvUsageSpec": "vllm:kv_cache_usage_perc",
    "loraSpec": "vllm:lora_requests_info",
    "cacheInfoSpec": "vllm:cache_config_info",
}
METRICS_COMPAT = ("none", "vllm")
TIERS = ("gpu", "cpu", "store")  # where an adapter is: a GPU slot, the CPU cache only, or neither (being fetched)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class AdapterLabels:
    """Adapter name -> label value, with at most `limit` distinct names (then OTHER)."""

    def __init__(self, limit: int = DEFAULT_MAX_ADAPTER_LABELS):
        self.limit = limit
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> str:
        if not name:
            return BASE
        with self._lock:
            if name in self._named:
                return name
            if len(self._named) < self.limit:
                self._named.add(name)
                return name
        return OTHER


class ExecutorMetrics:
    """The executor's metrics; `attach(engine, slots)` adds the ones read at scrape time."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        max_adapter_labels: int = DEFAULT_MAX_ADAPTER_LABELS,
        compat: str = "none",
    ):
        if compat not in METRICS_COMPAT:
            raise ValueError(f"metrics compat must be one of {', '.join(METRICS_COMPAT)}, got {compat!r}")
        self.compat = compat
        self.registry = registry or CollectorRegistry()
        self.adapters = AdapterLabels(max_adapter_labels)
        r = self.registry
        self.requests = Counter(
            "loraserve_executor_requests", "Finished requests by adapter and gRPC status code", ["adapter", "code"], registry=r
        )
        self.ttft = Histogram(
            "loraserve_executor_time_to_first_token_seconds",
            "From the request's arrival to its first output token",
            ["adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "loraserve_executor_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            ["adapter"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "loraserve_executor_request_duration_seconds",
            "From the request's arrival to its end, whatever the outcome",
            ["adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "loraserve_executor_prompt_tokens", "Prompt tokens of requests that produced output", ["adapter"], registry=r
        )
        self.generation_tokens = Counter("loraserve_executor_generation_tokens", "Output tokens sent", ["adapter"], registry=r)
        self.prefix_cache_queries = Counter(
            "loraserve_executor_prefix_cache_queries",
            "Prompt tokens of admitted requests looked up in the prefix cache (caching on), by adapter",
            ["adapter"],
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "loraserve_executor_prefix_cache_hits",
            "Prompt tokens whose KV came from the prefix cache, by adapter",
            ["adapter"],
            registry=r,
        )
        self.slot_hits = Counter("loraserve_executor_slot_hits", "Requests whose adapter was already in a GPU slot", registry=r)
        self.slot_misses = Counter(
            "loraserve_executor_slot_misses", "Requests whose adapter had to be loaded into a slot", registry=r
        )
        self.slot_evictions = Counter(
            "loraserve_executor_slot_evictions", "Adapters taken out of a slot (the coldest idle one) for another", registry=r
        )
        self.adapter_load = Histogram(
            "loraserve_executor_adapter_load_seconds",
            "Time to bring an adapter into a GPU slot, by the tier it came from (cpu, store)",
            ["tier"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.adapter_load_phase = Histogram(
            "loraserve_executor_adapter_load_phase_seconds",
            "Where a slot load's time goes: fetch (into the CPU cache, with its wait for a load seat), "
            "slot_wait (for a slot to free), copy (into the slot)",
            ["phase"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )

    def attach(self, engine, slots, max_loras: int, model_name: str = "") -> None:
        self.registry.register(_ExecutorState(engine, slots, max_loras, self.adapters, self.compat, model_name))

    def dtypes(self, weight_dtype: str, kv_cache_dtype: str, lora_dtype: str) -> None:
        """loraserve_executor_dtype_info{weight_dtype, kv_cache_dtype, lora_dtype} = 1: what the base
        model's linear layers, the KV cache and the dense layers' LoRA slots hold (e.g. float8_e4m3fn,
        bfloat16)."""
        info = Gauge(
            "loraserve_executor_dtype_info",
            "The dtypes of the base model's linear-layer weights, of the KV cache and of the LoRA slots (value 1)",
            ["weight_dtype", "kv_cache_dtype", "lora_dtype"],
            registry=self.registry,
        )
        info.labels(weight_dtype, kv_cache_dtype, lora_dtype).set(1)

    async def track(self, outputs: AsyncIterator, adapter: str) -> AsyncIterator:
        """Yields `outputs` (Engine.generate's) and counts the request when it ends, however it ends."""
        label = self.adapters(adapter)
        start = time.monotonic()
        first = last = None
        tokens = prompt_tokens = cached_tokens = 0
        cacheable = False
        code = "OK"
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    last = time.monotonic()
                    if first is None and out.token_ids:
                        first = last
                    tokens += len(out.token_ids)
                    prompt_tokens, cached_tokens, cacheable = out.prompt_tokens, out.cached_tokens, out.prefix_cacheable
                    yield out
        except StatusError as exc:
            code = exc.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED.name
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL.name
            raise
        finally:
            self.requests.labels(label, code).inc()
            self.e2e.labels(label).observe(time.monotonic() - start)
            if first is not None:
                self.ttft.labels(label).observe(first - start)
                if tokens > 1:
                    self.tpot.labels(label).observe((last - first) / (tokens - 1))
            if prompt_tokens:
                self.prompt_tokens.labels(label).inc(prompt_tokens)
                if cacheable:  # looked up in the prefix cache: caching on, the adapter's version known
                    self.prefix_cache_queries.labels(label).inc(prompt_tokens)
                    self.prefix_cache_hits.labels(label).inc(cached_tokens)
            if tokens:
                self.generation_tokens.labels(label).inc(tokens)

    # The slot manager's observer (executor/slots.py): called on the event loop.
    def slot_hit(self) -> None:
        self.slot_hits.inc()

    def slot_miss(self) -> None:
        self.slot_misses.inc()

    def slot_eviction(self, name: str) -> None:
        self.slot_evictions.inc()

    def adapter_loaded(self, tier: str, seconds: float) -> None:
        self.adapter_load.labels(tier).observe(seconds)

    def load_phases(self, fetch_s: float, slot_wait_s: float, copy_s: float) -> None:
        for phase, seconds in (("fetch", fetch_s), ("slot_wait", slot_wait_s), ("copy", copy_s)):
            self.adapter_load_phase.labels(phase).observe(seconds)


class _ExecutorState:
    """Gauges read from the engine and slot manager at scrape time (a Prometheus custom collector).

    It runs on the metrics server's thread (or the HTTP front's /metrics) and only reads the
    engine's and slot manager's snapshots (`Engine.load`, `SlotManager.residency`)."""

    def __init__(self, engine, slots, max_loras: int, adapters: AdapterLabels, compat: str = "none", model_name: str = ""):
        self.engine, self.slots, self.max_loras = engine, slots, max_loras
        self.adapters, self.compat, self.model_name = adapters, compat, model_name

    def describe(self):
        return []  # collected at scrape time only: nothing to check at registration

    def collect(self):
        e = self.engine
        load = e.load()
        residency = self.slots.residency()
        in_slots = [r for r in residency if r.tier == "gpu"]
        cpu_adapters, cpu_bytes = self.slots.cpu_cache_state()
        usage = load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
        yield _gauge("loraserve_executor_running_sequences", "Sequences in the running batch", load.running)
        yield _gauge(
            "loraserve_executor_waiting_sequences",
            "Sequences waiting for their first step (for their adapter, for KV blocks) or preempted",
            load.waiting,
        )
        yield _gauge("loraserve_executor_kv_cache_blocks_used", "KV cache blocks held by sequences", load.kv_blocks_used)
        yield _gauge("loraserve_executor_kv_cache_blocks_total", "KV cache blocks", load.kv_blocks_total)
        yield _gauge("loraserve_executor_kv_cache_usage_ratio", "Used / total KV cache blocks (0..1)", usage)
        yield _gauge(
            "loraserve_executor_prefix_cache_blocks",
            "KV cache blocks filed in the prefix cache, held by sequences or kept for reuse",
            e.allocator.num_cached,
        )
        yield CounterMetricFamily(
            "loraserve_executor_prefix_cache_evictions",
            "Prefix-cached KV blocks nobody held, taken for other sequences (their prefixes computed again if asked)",
            value=e.allocator.evictions,
        )
        yield _info(
            ENGINE_CONFIG["cacheInfoSpec"],
            "The KV cache's shape (value 1): tokens per block, blocks",
            block_size=str(load.block_size),
            num_gpu_blocks=str(load.kv_blocks_total),
        )
        yield _gauge("loraserve_executor_lora_slots_used", "GPU slots holding an adapter ready to run", len(in_slots))
        yield _gauge("loraserve_executor_lora_slots_total", "GPU slots (max_loras)", self.max_loras)
        yield _gauge(
            "loraserve_executor_lora_slots_pinned", "GPU slots holding a pinned adapter", sum(r.pinned for r in in_slots)
        )
        yield _gauge("loraserve_executor_cpu_cache_bytes", "Bytes of packed adapter shards in host memory", cpu_bytes)
        yield _gauge("loraserve_executor_cpu_cache_adapters", "Adapters in the host memory cache", cpu_adapters)
        yield self._residency(residency)
        resident, waiting = lora_lists(residency)
        now = time.time()
        yield self._lora_info(LORA_INFO, resident, waiting, now)
        if self.compat == "vllm":
            yield from self._vllm(load, usage, resident, waiting, now)
        yield from self._steps(dict(e.step_totals))
        yield self._slow_steps(e.slow_steps)
        yield from self._builds(e.kernel_builds)
        yield self._gc_pauses(getattr(e, "gc_pauses", None))

    def _residency(self, residency) -> GaugeMetricFamily:
        """Adapters by where they are, pinned or not, and rank: 1 per named adapter (the adapter
        label's limit: beyond it they add up under _other)."""
        g = GaugeMetricFamily(
            "loraserve_executor_adapter_residency",
            "Adapters this executor knows, by tier (gpu: ready in a slot, cpu: host cache only, store: being fetched), "
            "pinned and rank (0: not fetched yet, or trainable tokens alone)",
            labels=["adapter", "tier", "pinned", "rank"],
        )
        counts: dict[tuple, int] = {}
        for r in residency:
            key = (self.adapters(r.name), r.tier, str(r.pinned).lower(), str(r.rank))
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            g.add_metric(list(key), n)
        return g

    def _lora_info(self, name: str, resident: list[str], waiting: list[str], now: float) -> GaugeMetricFamily:
        """vLLM's `lora_requests_info` shape: one sample, its value the time of this reading (the
        newest series wins), labels: the adapters ready in GPU slots (running_lora_adapters: resident,
        with requests or not), those requests wait for (waiting_lora_adapters), max_lora (the slots)."""
        g = GaugeMetricFamily(
            name,
            "Adapters resident in GPU slots and adapters requests wait for, comma-separated; value: the reading's Unix time",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        g.add_metric([",".join(resident), ",".join(waiting), str(self.max_loras)], now)
        return g

    def _vllm(self, load, usage: float, resident: list[str], waiting: list[str], now: float):
        """The same readings under vLLM's names (`VLLM_ENGINE_CONFIG`), for pickers and dashboards that know only vLLM."""
        model = {"model_name": self.model_name}
        yield _gauge(VLLM_ENGINE_CONFIG["queuedRequestsSpec"], "Requests waiting to be processed", load.waiting, **model)
        yield _gauge(VLLM_ENGINE_CONFIG["runningRequestsSpec"], "Requests in model execution batches", load.running, **model)
        yield _gauge(VLLM_ENGINE_CONFIG["kvUsageSpec"], "KV-cache usage. 1 means 100 percent usage", usage, **model)
        yield self._lora_info(VLLM_ENGINE_CONFIG["loraSpec"], resident, waiting, now)
        yield _info(
            VLLM_ENGINE_CONFIG["cacheInfoSpec"],
            "Information of the KV cache config (value 1)",
            block_size=str(load.block_size),
            num_gpu_blocks=str(load.kv_blocks_total),
        )

    @staticmethod
    def _steps(totals: dict):
        """Forward steps by kind (executor/engine/step_stats.py: STEP_KINDS, StepTotals): decode-graph and mixed-graph (replayed
        CUDA graphs; mixed: a prefill chunk in it), decode and mixed (eager). Their share says how often admissions take
        the eager path; launch seconds near step seconds say the host, not the GPU, sets the pace."""
        out = [
            CounterMetricFamily("loraserve_executor_steps", "Forward steps collected, by kind", labels=["kind"]),
            CounterMetricFamily(
                "loraserve_executor_step_seconds",
                "Seconds from launch to sampled tokens, by step kind (a step launched ahead overlaps the one before: the sum can pass wall time)",
                labels=["kind"],
            ),
            CounterMetricFamily(
                "loraserve_executor_step_launch_seconds",
                "Host seconds spent queuing the steps' work (Python launches, graph staging), by step kind",
                labels=["kind"],
            ),
            CounterMetricFamily("loraserve_executor_step_sequences", "Sequences in the steps, by step kind", labels=["kind"]),
        ]
        for kind, t in sorted(totals.items()):
            for family, value in zip(out, (t.steps, t.seconds, t.launch_seconds, t.sequences)):
                family.add_metric([kind], value)
        return out

    @staticmethod
    def _slow_steps(slow) -> CounterMetricFamily:
        """Steps far slower than their kind's recent median (executor/diagnostics/slow_steps.py), each logged."""
        from loraserve.executor.diagnostics.slow_steps import RULE

        family = CounterMetricFamily("loraserve_executor_slow_steps", f"Forward steps {RULE}, by kind", labels=["kind"])
        for kind, count in sorted(slow.counts.items()):
            family.add_metric([kind], count)
        return family

    @staticmethod
    def _builds(builds):
        """Triton kernels built after start-up (executor/diagnostics/builds.py): each held its step.
        None (an engine without Triton: CPU): 0, so dashboards find the series everywhere."""
        count, seconds = (builds.count, builds.seconds) if builds is not None else (0, 0.0)
        return [
            CounterMetricFamily(
                "loraserve_executor_kernel_builds",
                "Triton kernels built (or loaded from its disk cache) while serving: each held its step",
                value=count,
            ),
            CounterMetricFamily("loraserve_executor_kernel_build_seconds", "Seconds of those builds", value=seconds),
        ]

    @staticmethod
    def _gc_pauses(pauses) -> CounterMetricFamily:
        """The garbage collector's time (executor/diagnostics/gc_pauses.py): the event loop waits it out."""
        family = CounterMetricFamily(
            "loraserve_executor_gc_pause_seconds",
            "Seconds Python's garbage collector ran (the event loop waited), by generation",
            labels=["generation"],
        )
        for generation, seconds in enumerate(pauses.seconds_by_generation if pauses is not None else (0.0,) * 3):
            family.add_metric([str(generation)], seconds)
        return family


def lora_lists(residency) -> tuple[list[str], list[str]]:
    """(resident, waiting), sorted: adapters ready in GPU slots, and adapters requests wait for that are not."""
    resident = sorted(r.name for r in residency if r.tier == "gpu")
    waiting = sorted(r.name for r in residency if r.waited_for)
    return resident, waiting


def _gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), value)
    return g


def _info(name: str, doc: str, **labels: str) -> GaugeMetricFamily:
    """An info-style gauge: value 1, the facts in its labels."""
    return _gauge(name, doc, 1, **labels)


class StoreMetrics:
    """The adapter store's metrics; `attach(cache)` adds the cache tiers' sizes, read at scrape."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.registrations = Counter("loraserve_store_registrations", "Adapters registered", registry=r)
        self.rejections = Counter(
            "loraserve_store_registration_rejections",
            "Registrations refused, by reason (the gRPC status code)",
            ["reason"],
            registry=r,
        )
        self.pack = Histogram(
            "loraserve_store_pack_seconds", "Packing one adapter for a layout (all asked ranks)", buckets=LOAD_BUCKETS, registry=r
        )
        self.fetch_bytes = Counter(
            "loraserve_store_fetch_bytes", "Shard bytes streamed to executors, by the tier they came from", ["tier"], registry=r
        )
        self.fetch = Histogram(
            "loraserve_store_fetch_seconds",
            "FetchShard from request to last chunk (a wait for its turn under --max-streams included), by tier",
            ["tier"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.cache_hits = Counter("loraserve_store_cache_hits", "Shard lookups answered by a cache tier", ["tier"], registry=r)
        self.cache_misses = Counter("loraserve_store_cache_misses", "Shard lookups no tier had (then packed)", registry=r)
        self.streams = Gauge("loraserve_store_streams", "FetchShard streams being served", registry=r)
        self.streams_waiting = Gauge(
            "loraserve_store_streams_waiting", "FetchShard streams waiting for their turn (--max-streams)", registry=r
        )
        self.streams_busy = Counter(
            "loraserve_store_streams_busy",
            "FetchShard streams refused RESOURCE_EXHAUSTED after waiting --max-stream-wait-s for a turn",
            registry=r,
        )

    def attach(self, cache) -> None:
        self.registry.register(_StoreCache(cache))


class _StoreCache:
    def __init__(self, cache):
        self.cache = cache

    def describe(self):
        return []

    def collect(self):
        g = GaugeMetricFamily("loraserve_store_cache_bytes", "Bytes of packed shards kept, by cache tier", labels=["tier"])
        for tier, size in self.cache.total_bytes().items():  # a tier that is down has no size now
            if size is not None:
                g.add_metric([tier], size)
        yield g


class MetricsServer:
    """A `/metrics` HTTP endpoint for one registry, on its own thread (prometheus_client's)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, listen: str) -> MetricsServer | None:
    """Serves `registry` on host:port; None when listen is "" (metrics off). A port that cannot be
    bound (e.g. taken since the command checked it) fails with ListenError naming the address."""
    if not listen:
        return None
    host, _, port = listen.rpartition(":")
    try:
        server = MetricsServer(registry, host.strip("[]") or "0.0.0.0", int(port))
    except OSError as e:
        raise ListenError(f"could not listen on {listen} for /metrics: {e.strerror or e}") from None
    log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", server.port)
    return server
