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
- queue depth, KV blocks, slot occupancy, CPU cache bytes and the LoRA affinity gauge are read
  from the engine's state when Prometheus scrapes (`_ExecutorState.collect`), never pushed.

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
# The Gateway API inference extension's endpoint picker reads this gauge for LoRA affinity
# (vLLM's `vllm:lora_requests_info`, same labels); point its --lora-info-metric here.
LORA_INFO = "loraserve_lora_requests_info"

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

    def __init__(self, registry: CollectorRegistry | None = None, max_adapter_labels: int = DEFAULT_MAX_ADAPTER_LABELS):
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

    def attach(self, engine, slots, max_loras: int) -> None:
        self.registry.register(_ExecutorState(engine, slots, max_loras))

    def dtypes(self, weight_dtype: str, kv_cache_dtype: str) -> None:
        """loraserve_executor_dtype_info{weight_dtype, kv_cache_dtype} = 1: what the base model's linear
        layers and the KV cache hold (e.g. float8_e4m3fn, bfloat16)."""
        info = Gauge(
            "loraserve_executor_dtype_info",
            "The dtypes of the base model's linear-layer weights and of the KV cache (value 1)",
            ["weight_dtype", "kv_cache_dtype"],
            registry=self.registry,
        )
        info.labels(weight_dtype, kv_cache_dtype).set(1)

    async def track(self, outputs: AsyncIterator, adapter: str) -> AsyncIterator:
        """Yields `outputs` (Engine.generate's) and counts the request when it ends, however it ends."""
        label = self.adapters(adapter)
        start = time.monotonic()
        first = last = None
        tokens = prompt_tokens = 0
        code = "OK"
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    last = time.monotonic()
                    if first is None and out.token_ids:
                        first = last
                    tokens += len(out.token_ids)
                    prompt_tokens = out.prompt_tokens
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

    It runs on the metrics server's thread and only reads: lengths of the scheduler's queues
    and snapshots (list(...)) of dicts the event loop owns, which CPython copies atomically."""

    def __init__(self, engine, slots, max_loras: int):
        self.engine, self.slots, self.max_loras = engine, slots, max_loras

    def describe(self):
        return []  # collected at scrape time only: nothing to check at registration

    def collect(self):
        e, s = self.engine, self.slots
        running, waiting = list(e.scheduler.running), list(e.scheduler.waiting)
        total = e.allocator.num_blocks
        used = total - e.allocator.num_free
        adapters = list(s._adapters.values())
        in_slots = [a for a in adapters if a.slot >= 0]
        cpu_adapters, cpu_bytes = s.cpu_cache_state()
        yield _gauge("loraserve_executor_running_sequences", "Sequences in the running batch", len(running))
        yield _gauge(
            "loraserve_executor_waiting_sequences", "Sequences waiting for their first step (or preempted)", len(waiting)
        )
        yield _gauge("loraserve_executor_kv_cache_blocks_used", "KV cache blocks held by sequences", used)
        yield _gauge("loraserve_executor_kv_cache_blocks_total", "KV cache blocks", total)
        yield _gauge(
            "loraserve_executor_kv_cache_usage_ratio", "Used / total KV cache blocks (0..1)", used / total if total else 0.0
        )
        yield _gauge("loraserve_executor_lora_slots_used", "GPU slots holding an adapter", len(in_slots))
        yield _gauge("loraserve_executor_lora_slots_total", "GPU slots (max_loras)", self.max_loras)
        yield _gauge(
            "loraserve_executor_lora_slots_pinned", "GPU slots holding a pinned adapter", sum(a.pinned for a in in_slots)
        )
        yield _gauge("loraserve_executor_cpu_cache_bytes", "Bytes of packed adapter shards in host memory", cpu_bytes)
        yield _gauge("loraserve_executor_cpu_cache_adapters", "Adapters in the host memory cache", cpu_adapters)
        yield self._lora_info(running, waiting, adapters)
        yield from self._steps(dict(e.step_totals))
        yield self._slow_steps(e.slow_steps)
        yield from self._builds(e.kernel_builds)
        yield self._gc_pauses(getattr(e, "gc_pauses", None))

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

    def _lora_info(self, running, waiting, adapters) -> GaugeMetricFamily:
        """vLLM's `lora_requests_info` shape: one sample whose labels list the adapters of running
        and of waiting requests, and max_lora; its value is the time of this reading."""
        runs = dict(self.engine._runs)  # seq_id -> the request's engine state

        def names(seqs) -> set[str]:
            out = set()
            for seq in seqs:
                run = runs.get(seq.seq_id)
                if run is not None and run.lease is not None:
                    out.add(run.lease.name)
            return out

        run_names = names(running)
        # Requests whose adapter is still being fetched or copied wait for it too.
        wait_names = names(waiting) | {a.name for a in adapters if a.loading and a.holds} - run_names
        g = GaugeMetricFamily(
            LORA_INFO,
            "Adapters of running and waiting requests (for LoRA-affinity routing)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        g.add_metric([",".join(sorted(run_names)), ",".join(sorted(wait_names)), str(self.max_loras)], time.time())
        return g


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


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
