"""A fleet of executors behind a router: which routing policy makes adapters cold-load least.

A discrete-event simulation (no GPU, no model: seconds per configuration) of N executors, each
with M GPU slots, a CPU cache of C adapters and continuous batching, behind a router that sees
the executors only through their /metrics as the Gateway API inference extension's endpoint
picker (EPP) does: one reading per executor every `--scrape-ms` (the picker's default
--refresh-metrics-interval is 50 ms), so every decision is made on readings up to that old.

Routing policies:
- random: any executor.
- least-queue: the EPP's queue scorer alone (waiting requests, min-max normalised; ties random).
- affinity-vllm: the EPP's queue + KV-cache + LoRA-affinity scorers (weights `EPP_WEIGHTS`, as
  deploy/helm ships them) with vLLM's LoRA signal: running_lora_adapters lists adapters with
  requests running, waiting_lora_adapters those of waiting requests.
- affinity: the same scorers fed by loraserve's signal: running_lora_adapters lists the adapters
  resident in GPU slots, waiting_lora_adapters those requests wait for that are not in a slot.
  LoRA-affinity tiers as the EPP scores them: active 1.0, room for one more (active + waiting <
  max_lora) 0.8, waiting 0.6, else 0.
- residency: queue + KV-cache + a residency score from loraserve_executor_adapter_residency and
  the LoRA-info gauge: ready in a slot 1.0, being loaded 0.9, in the CPU cache 0.7 (only adapters
  the residency gauge names: the first --label-limit seen per executor), a free slot 0.5, else 0.
  No EPP plugin reads the residency gauge today: this policy is what one would gain.

Costs (H100 rows of docs/BENCHMARKS.md; rank-16 adapters, Llama-3-8B shapes):
- decode step, base: "Engine: decode and prefill against the floors", decode B = 1 / 8 / 32 / 64
  base row (5.67 / 6.22 / 7.81 / 9.14 ms), interpolated in B;
- plus per distinct adapter in the batch: the same table, B = 32 with 32 adapters (9.42 ms) minus
  the base B = 32 step, over 32;
- prefill: the "prefill 1 x 4,096 / 16 x 256" row, 16 x 256 tokens in 98.0 ms, per prompt token,
  added to the step that admits the request (its first token comes at that step's end);
- CPU cache -> slot: "Cold loads", rank 16 (80 MiB) at 1.27x the floor (80 MiB at 54.7 GB/s);
  slot copies one at a time per executor;
- store -> CPU cache: "Cold loads", store -> slot, rank 16, 1.42 GB/s end to end, less the copy
  above; at most --max-concurrent-loads fetches at once per executor (the executor's default 4).

Slots: an adapter is loaded into a free slot or one whose adapter has no running or waiting
request (the least recently used); a request waits while its adapter loads. The CPU cache is
least-recently-used. Requests: Poisson arrivals, adapter by Zipf(--alpha) over --adapters names
(`zipf`), or that plus bursts of new adapters (`burst`: every --burst-every s, --burst-size names
never seen before take --burst-share of the requests for --burst-len s); prompt 64-256 and
output 64-128 tokens (uniform), as benchmarks/serve.py's many-adapter run.

Printed per policy: slot hit rate (requests whose adapter was ready in a slot of their executor
at arrival), cold loads/s (slot loads, the fleet's) and store fetches/s, TTFT p50 / p99 (arrival
at the router to the first token; one still waiting at the end counts with its wait so far),
output tokens/s; over requests arriving after --warmup-s.

    python benchmarks/fleet_sim.py --executors 4,16,64 --adapters 1000 --workload zipf
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import math
import random
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

MIB = 2**20
DECODE_BASE_S = ((1, 5.67e-3), (8, 6.22e-3), (32, 7.81e-3), (64, 9.14e-3))
ADAPTER_STEP_S = (9.42e-3 - 7.81e-3) / 32
PREFILL_TOKEN_S = 98.0e-3 / (16 * 256)
CPU_TO_SLOT_S = 1.27 * 80 * MIB / 54.7e9
STORE_TO_SLOT_S = 80 * MIB / 1.42e9
FETCH_S = STORE_TO_SLOT_S - CPU_TO_SLOT_S
# The scheduling profile's weights in deploy/helm/loraserve/templates/_epp.tpl (tests/deploy/test_helm.py checks).
EPP_WEIGHTS = {"queue-scorer": 1.0, "kv-cache-utilization-scorer": 1.0, "lora-affinity-scorer": 2.0}
POLICIES = ("random", "least-queue", "affinity-vllm", "affinity", "residency")


def decode_step_s(batch: int) -> float:
    """The base decode step at `batch` sequences: linear between the measured batch sizes."""
    points = DECODE_BASE_S
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in itertools.pairwise(points):
        if batch <= b1:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (batch - b1) / (b1 - b0)


@dataclass
class Config:
    executors: int = 4
    slots: int = 32
    cpu_adapters: int = 256
    max_num_seqs: int = 64
    kv_tokens: int = 65536  # KV cache capacity per executor, tokens (the KV-cache scorer's reading)
    max_concurrent_loads: int = 4
    adapters: int = 1000
    alpha: float = 1.0
    workload: str = "zipf"
    burst_every: float = 5.0
    burst_size: int = 50
    burst_share: float = 0.3
    burst_len: float = 2.0
    rate_per_executor: float = 25.0
    duration_s: float = 25.0
    warmup_s: float = 5.0
    scrape_s: float = 0.05
    label_limit: int = 32
    prompt_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (64, 128)
    seed: int = 0


@dataclass(eq=False)
class Request:
    adapter: str
    arrival: float
    prompt: int
    output: int
    measured: bool
    first_token: float | None = None


@dataclass(eq=False)
class Slot:
    ready: bool = False
    running: int = 0
    last_used: float = 0.0


@dataclass
class Reading:
    """What one scrape of an executor's /metrics tells the router."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    max_lora: int = 0
    resident: frozenset = frozenset()  # loraserve running_lora_adapters: ready in a slot
    waited_for: frozenset = frozenset()  # loraserve waiting_lora_adapters: asked for, not in a slot
    vllm_running: frozenset = frozenset()  # vLLM's: adapters with running requests
    vllm_waiting: frozenset = frozenset()  # vLLM's: adapters of waiting requests
    cpu_named: frozenset = frozenset()  # residency gauge: tier cpu, among the named adapters
    free_slots: int = 0


@dataclass
class Stats:
    hits: int = 0
    arrivals: int = 0
    slot_loads: int = 0
    store_fetches: int = 0
    tokens: int = 0
    ttft: list = field(default_factory=list)


class Executor:
    def __init__(self, sim: Sim, index: int):
        self.sim, self.index, self.cfg = sim, index, sim.cfg
        self.slots: dict[str, Slot] = {}
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.waiting: dict[str, deque[Request]] = {}  # adapter -> its waiting requests, in arrival order
        self.n_waiting = 0
        self.running: Counter[str] = Counter()  # adapter -> running requests
        self.n_running = 0
        self.finishes: list[tuple[int, int, Request]] = []  # (last step, tiebreak, request)
        self.step_no = 0
        self.stepping = False
        self.kv_used = 0
        self.fetching: set[str] = set()
        self.fetch_queue: deque[str] = deque()
        self.copy_free_at = 0.0
        self.named: set[str] = set()
        self.reading = Reading(max_lora=self.cfg.slots, free_slots=self.cfg.slots)

    # ---- requests and slots ----------------------------------------------------------------

    def arrive(self, now: float, req: Request) -> None:
        if len(self.named) < self.cfg.label_limit:
            self.named.add(req.adapter)
        slot = self.slots.get(req.adapter)
        if req.measured:
            self.sim.stats.arrivals += 1
            self.sim.stats.hits += slot is not None and slot.ready
        self.waiting.setdefault(req.adapter, deque()).append(req)
        self.n_waiting += 1
        self.kick(now)

    def kick(self, now: float) -> None:
        """Starts the loads waiting requests need (as slots allow), then a step if there is work."""
        for adapter in self.waiting:
            if adapter not in self.slots and not self._claim(now, adapter):
                break  # no slot can be freed now: the rest wait too
        if not self.stepping and (self.n_running or any(self.slots[a].ready for a in self.waiting if a in self.slots)):
            self._start_step(now)

    def _claim(self, now: float, adapter: str) -> bool:
        if len(self.slots) >= self.cfg.slots:
            idle = [(s.last_used, a) for a, s in self.slots.items() if s.ready and s.running == 0 and a not in self.waiting]
            if not idle:
                return False
            del self.slots[min(idle)[1]]
        self.slots[adapter] = Slot(last_used=now)
        if adapter in self.cpu:
            self.cpu.move_to_end(adapter)
            self._copy(now, adapter)
        elif adapter not in self.fetching:
            self.fetching.add(adapter)
            self.fetch_queue.append(adapter)
            self._fetch_next(now)
        return True

    def _fetch_next(self, now: float) -> None:
        in_flight = len(self.fetching) - len(self.fetch_queue)
        while self.fetch_queue and in_flight < self.cfg.max_concurrent_loads:
            adapter = self.fetch_queue.popleft()
            in_flight += 1
            if now >= self.cfg.warmup_s:
                self.sim.stats.store_fetches += 1
            self.sim.at(now + FETCH_S, self._fetched, adapter)

    def _fetched(self, now: float, adapter: str) -> None:
        self.fetching.discard(adapter)
        self.cpu[adapter] = None
        while len(self.cpu) > self.cfg.cpu_adapters:
            self.cpu.popitem(last=False)
        self._fetch_next(now)
        if adapter in self.slots:
            self._copy(now, adapter)

    def _copy(self, now: float, adapter: str) -> None:
        self.copy_free_at = max(now, self.copy_free_at) + CPU_TO_SLOT_S
        if now >= self.cfg.warmup_s:
            self.sim.stats.slot_loads += 1
        self.sim.at(self.copy_free_at, self._loaded, adapter)

    def _loaded(self, now: float, adapter: str) -> None:
        slot = self.slots.get(adapter)
        if slot is not None:
            slot.ready = True
            self.kick(now)

    # ---- steps -----------------------------------------------------------------------------

    def _start_step(self, now: float) -> None:
        admitted, prefill = [], 0
        for adapter in list(self.waiting):
            slot = self.slots.get(adapter)
            if slot is None or not slot.ready:
                continue
            queue = self.waiting[adapter]
            while queue and self.n_running < self.cfg.max_num_seqs:
                req = queue.popleft()
                self.n_waiting -= 1
                self.n_running += 1
                self.running[adapter] += 1
                slot.running += 1
                slot.last_used = now
                self.kv_used += req.prompt + req.output
                prefill += req.prompt
                admitted.append(req)
                heapq.heappush(self.finishes, (self.step_no + req.output, id(req), req))
            if not queue:
                del self.waiting[adapter]
        if not self.n_running:
            return
        distinct = sum(1 for n in self.running.values() if n)
        seconds = decode_step_s(self.n_running) + distinct * ADAPTER_STEP_S + prefill * PREFILL_TOKEN_S
        self.stepping = True
        self.sim.at(now + seconds, self._step_done, (admitted, self.n_running))

    def _step_done(self, now: float, payload) -> None:
        admitted, batch = payload
        self.stepping = False
        self.step_no += 1
        if now >= self.cfg.warmup_s:
            self.sim.stats.tokens += batch
        for req in admitted:
            req.first_token = now
            if req.measured:
                self.sim.stats.ttft.append(now - req.arrival)
        while self.finishes and self.finishes[0][0] <= self.step_no:
            _, _, req = heapq.heappop(self.finishes)
            self.n_running -= 1
            self.running[req.adapter] -= 1
            if not self.running[req.adapter]:
                del self.running[req.adapter]
            self.kv_used -= req.prompt + req.output
            slot = self.slots[req.adapter]
            slot.running -= 1
            slot.last_used = now
        self.kick(now)

    # ---- what /metrics shows ---------------------------------------------------------------

    def scrape(self, now: float, _=None) -> None:
        ready = frozenset(a for a, s in self.slots.items() if s.ready)
        self.reading = Reading(
            waiting=self.n_waiting,
            running=self.n_running,
            kv_usage=self.kv_used / self.cfg.kv_tokens,
            max_lora=self.cfg.slots,
            resident=ready,
            waited_for=frozenset(a for a in self.waiting if a not in ready),
            vllm_running=frozenset(self.running),
            vllm_waiting=frozenset(self.waiting),
            cpu_named=frozenset(a for a in self.named if a in self.cpu),
            free_slots=self.cfg.slots - len(self.slots),
        )
        self.sim.at(now + self.cfg.scrape_s, self.scrape)


def lora_affinity(r: Reading, adapter: str, active: frozenset, waiting: frozenset) -> float:
    """The EPP's LoRA-affinity tiers."""
    if adapter in active:
        return 1.0
    if len(active) + len(waiting) < r.max_lora:
        return 0.8
    if adapter in waiting:
        return 0.6
    return 0.0


def residency_score(r: Reading, adapter: str) -> float:
    if adapter in r.resident:
        return 1.0
    if adapter in r.waited_for:
        return 0.9
    if adapter in r.cpu_named:
        return 0.7
    return 0.5 if r.free_slots else 0.0


class Router:
    def __init__(self, policy: str, executors: list[Executor], rng: random.Random):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.executors, self.rng = policy, executors, rng

    def pick(self, adapter: str) -> Executor:
        if self.policy == "random":
            return self.rng.choice(self.executors)
        readings = [e.reading for e in self.executors]
        queues = [r.waiting for r in readings]
        lo, hi = min(queues), max(queues)
        queue = [1.0 if hi == lo else (hi - q) / (hi - lo) for q in queues]
        if self.policy == "least-queue":
            scores = queue
        else:
            w = EPP_WEIGHTS
            if self.policy == "affinity-vllm":
                affinity = [lora_affinity(r, adapter, r.vllm_running, r.vllm_waiting) for r in readings]
            elif self.policy == "affinity":
                affinity = [lora_affinity(r, adapter, r.resident, r.waited_for) for r in readings]
            else:
                affinity = [residency_score(r, adapter) for r in readings]
            scores = [
                w["queue-scorer"] * q + w["kv-cache-utilization-scorer"] * (1 - r.kv_usage) + w["lora-affinity-scorer"] * a
                for q, r, a in zip(queue, readings, affinity)
            ]
        best = max(scores)
        return self.rng.choice([e for e, s in zip(self.executors, scores) if s == best])


class Workload:
    def __init__(self, cfg: Config, rng: random.Random):
        self.cfg, self.rng = cfg, rng
        weights = [1 / (k + 1) ** cfg.alpha for k in range(cfg.adapters)]
        self.cumulative = list(itertools.accumulate(weights))

    def adapter(self, now: float) -> str:
        c = self.cfg
        if c.workload == "burst":
            burst, into = divmod(now, c.burst_every)
            if into < c.burst_len and self.rng.random() < c.burst_share:
                return f"new-{int(burst)}-{self.rng.randrange(c.burst_size)}"
        k = bisect.bisect_left(self.cumulative, self.rng.random() * self.cumulative[-1])
        return f"adapter-{k}"


class Sim:
    def __init__(self, cfg: Config, policy: str):
        if cfg.workload not in ("zipf", "burst"):
            raise ValueError(f"workload must be zipf or burst, got {cfg.workload!r}")
        if cfg.executors < 1 or cfg.slots < 1 or cfg.adapters < 1:
            raise ValueError("executors, slots and adapters must be at least 1")
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.events: list = []
        self.order = itertools.count()
        self.stats = Stats()
        self.executors = [Executor(self, i) for i in range(cfg.executors)]
        self.router = Router(policy, self.executors, random.Random(cfg.seed + 1))
        self.workload = Workload(cfg, random.Random(cfg.seed + 2))

    def at(self, when: float, fn, arg=None) -> None:
        heapq.heappush(self.events, (when, next(self.order), fn, arg))

    def _arrival(self, now: float, _=None) -> None:
        c = self.cfg
        req = Request(
            self.workload.adapter(now),
            now,
            self.rng.randint(*c.prompt_len),
            self.rng.randint(*c.output_len),
            measured=now >= c.warmup_s,
        )
        self.router.pick(req.adapter).arrive(now, req)
        self.at(now + self.rng.expovariate(c.rate_per_executor * c.executors), self._arrival)

    def run(self) -> dict:
        c = self.cfg
        for e in self.executors:
            self.at(self.rng.uniform(0, c.scrape_s), e.scrape)
        self.at(0.0, self._arrival)
        end = c.warmup_s + c.duration_s
        while self.events and self.events[0][0] < end:
            now, _, fn, arg = heapq.heappop(self.events)
            fn(now, arg)
        s = self.stats
        waited = [end - r.arrival for e in self.executors for q in e.waiting.values() for r in q if r.measured]
        ttft = sorted(s.ttft + waited)  # a request still without its first token counts with its wait so far
        return {
            "hit_rate": s.hits / s.arrivals if s.arrivals else 0.0,
            "loads_per_s": s.slot_loads / c.duration_s,
            "fetches_per_s": s.store_fetches / c.duration_s,
            "ttft_p50": _quantile(ttft, 0.50),
            "ttft_p99": _quantile(ttft, 0.99),
            "tok_per_s": s.tokens / c.duration_s,
            "arrivals": s.arrivals,
            "first_tokens": len(ttft),
        }


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def simulate(cfg: Config, policy: str) -> dict:
    return Sim(cfg, policy).run()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--executors", default="4,16,64", help="N, comma-separated: one table block per N")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    d = Config()
    p.add_argument("--slots", type=int, default=d.slots, help="GPU slots per executor (--max-loras)")
    p.add_argument("--cpu-adapters", type=int, default=d.cpu_adapters, help="adapters the CPU cache holds")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-concurrent-loads", type=int, default=d.max_concurrent_loads)
    p.add_argument("--adapters", type=int, default=d.adapters)
    p.add_argument("--alpha", type=float, default=d.alpha, help="Zipf exponent")
    p.add_argument("--workload", choices=("zipf", "burst"), default=d.workload)
    p.add_argument("--burst-every", type=float, default=d.burst_every)
    p.add_argument("--burst-size", type=int, default=d.burst_size)
    p.add_argument("--burst-share", type=float, default=d.burst_share)
    p.add_argument("--burst-len", type=float, default=d.burst_len)
    p.add_argument("--rate-per-executor", type=float, default=d.rate_per_executor, help="requests/s per executor")
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="simulated seconds measured")
    p.add_argument("--warmup-s", type=float, default=d.warmup_s, help="simulated seconds before measuring")
    p.add_argument("--scrape-ms", type=float, default=d.scrape_s * 1000)
    p.add_argument("--label-limit", type=int, default=d.label_limit, help="adapters the residency gauge names")
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    policies = a.policies.split(",")
    for policy in policies:
        if policy not in POLICIES:
            p.error(f"--policies: unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    print(
        f"{a.adapters} adapters, {a.workload} (alpha {a.alpha}), {a.slots} slots and a {a.cpu_adapters}-adapter CPU cache "
        f"per executor, {a.rate_per_executor:g} req/s per executor, scrape every {a.scrape_ms:g} ms, "
        f"{a.duration_s:g} s measured after {a.warmup_s:g} s"
    )
    print("| N | policy | slot hit rate | cold loads/s | store fetches/s | TTFT p50 ms | TTFT p99 ms | tok/s | sim s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in a.executors.split(",")):
        for policy in policies:
            cfg = Config(
                executors=n,
                slots=a.slots,
                cpu_adapters=a.cpu_adapters,
                max_num_seqs=a.max_num_seqs,
                max_concurrent_loads=a.max_concurrent_loads,
                adapters=a.adapters,
                alpha=a.alpha,
                workload=a.workload,
                burst_every=a.burst_every,
                burst_size=a.burst_size,
                burst_share=a.burst_share,
                burst_len=a.burst_len,
                rate_per_executor=a.rate_per_executor,
                duration_s=a.duration_s,
                warmup_s=a.warmup_s,
                scrape_s=a.scrape_ms / 1000,
                label_limit=a.label_limit,
                seed=a.seed,
            )
            t0 = time.perf_counter()
            r = simulate(cfg, policy)
            print(
                f"| {n} | {policy} | {r['hit_rate']:.3f} | {r['loads_per_s']:.1f} | {r['fetches_per_s']:.1f} "
                f"| {r['ttft_p50'] * 1e3:.1f} | {r['ttft_p99'] * 1e3:.1f} | {r['tok_per_s']:,.0f} | {time.perf_counter() - t0:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
