"""benchmarks/fleet_sim.py in small: the routing policies' order holds (adapter-aware routing loads
fewer adapters than random), the costs come from the measured table, bad input is refused."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fleet_sim

# 8 executors x 8 slots = 64 slots for 100 Zipf adapters: random routing spreads every adapter over
# every executor, adapter-aware routing gives each executor its share.
TINY = fleet_sim.Config(executors=8, slots=8, cpu_adapters=32, adapters=100, rate_per_executor=10, duration_s=6, warmup_s=3)


@pytest.fixture(scope="module")
def results():
    return {policy: fleet_sim.simulate(TINY, policy) for policy in fleet_sim.POLICIES}


def test_adapter_aware_routing_loads_fewer_adapters_than_random(results):
    random_, affinity, residency = results["random"], results["affinity"], results["residency"]
    assert random_["arrivals"] > 400 and random_["first_tokens"] >= 0.95 * random_["arrivals"]
    for aware in (affinity, residency):
        assert aware["loads_per_s"] < 0.5 * random_["loads_per_s"], (aware, random_)
        assert aware["hit_rate"] > random_["hit_rate"] + 0.3
        assert aware["ttft_p99"] < random_["ttft_p99"]
    # the resident list (loraserve's signal) beats vLLM's running list for the same scorers
    assert affinity["loads_per_s"] < results["affinity-vllm"]["loads_per_s"]
    # the same requests are served whatever the routing: throughput within a few percent
    for r in results.values():
        assert r["tok_per_s"] == pytest.approx(random_["tok_per_s"], rel=0.05)
        assert 0 < r["ttft_p50"] <= r["ttft_p99"]


def test_the_costs_are_the_benchmark_tables_rows():
    assert fleet_sim.decode_step_s(1) == pytest.approx(5.67e-3) and fleet_sim.decode_step_s(64) == pytest.approx(9.14e-3)
    assert fleet_sim.decode_step_s(20) == pytest.approx((6.22e-3 + 7.81e-3) / 2)
    assert fleet_sim.CPU_TO_SLOT_S == pytest.approx(1.27 * 80 * 2**20 / 54.7e9)
    assert fleet_sim.STORE_TO_SLOT_S == pytest.approx(0.059, rel=0.01)


def test_the_lora_affinity_tiers_are_the_pickers():
    r = fleet_sim.Reading(max_lora=3)
    assert fleet_sim.lora_affinity(r, "a", frozenset({"a", "b", "c"}), frozenset()) == 1.0
    assert fleet_sim.lora_affinity(r, "x", frozenset({"a"}), frozenset({"b"})) == 0.8  # room for one more
    assert fleet_sim.lora_affinity(r, "x", frozenset({"a", "b"}), frozenset({"x"})) == 0.6  # waiting, no room
    assert fleet_sim.lora_affinity(r, "x", frozenset({"a", "b", "c"}), frozenset()) == 0.0


def test_bad_input_is_refused(capsys):
    with pytest.raises(ValueError, match="policy must be one of random, least-queue, .* got 'nearest'"):
        fleet_sim.simulate(TINY, "nearest")
    with pytest.raises(ValueError, match="workload must be zipf or burst, got 'flat'"):
        fleet_sim.simulate(fleet_sim.Config(workload="flat"), "random")
    with pytest.raises(SystemExit):
        fleet_sim.main(["--policies", "random,nearest"])
    assert "unknown policy 'nearest'" in capsys.readouterr().err


def test_the_burst_workload_asks_for_new_adapters():
    cfg = fleet_sim.Config(executors=2, slots=4, adapters=50, workload="burst", duration_s=3, warmup_s=0, burst_every=1)
    sim = fleet_sim.Sim(cfg, "affinity")
    names = {sim.workload.adapter(t / 100) for t in range(300)}
    assert any(n.startswith("new-") for n in names) and any(n.startswith("adapter-") for n in names)
    assert sim.run()["loads_per_s"] > 0
