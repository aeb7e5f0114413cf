"""Triton builds while serving (executor/diagnostics/builds.py): counted and logged once armed, Triton's
hooks chained, exported to /metrics. Triton is not needed: its hooks are called as Triton calls them."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from loraserve.executor.diagnostics import builds
from loraserve.metrics import _ExecutorState


def fn_info(name: str):
    return types.SimpleNamespace(name=name)


def build(watch: builds.KernelBuilds, name: str, key=("sig", "opts")) -> None:
    info = {"constants": {"BLOCK_M": 64, "ONE_TILE": False}}
    watch.started(
        key=key, fn=fn_info(name), repr=f"{name}[num_warps=4]", compile=info, is_manual_warmup=False, already_compiled=False
    )
    watch.finished(
        key=key, fn=fn_info(name), repr=f"{name}[num_warps=4]", compile=info, is_manual_warmup=False, already_compiled=False
    )


def test_builds_count_only_once_armed_and_each_is_logged(caplog):
    watch = builds.KernelBuilds()
    build(watch, "_shrink_kernel")  # the warm-up's builds: expected, not counted
    assert (watch.count, watch.seconds) == (0, 0.0)
    watch.armed = True
    with caplog.at_level(logging.WARNING, logger="loraserve.executor.diagnostics.builds"):
        build(watch, "_expand_kernel", key=("other", "opts"))
    assert watch.count == 1 and watch.seconds > 0
    assert watch.recent == ["_expand_kernel: _expand_kernel[num_warps=4]"]  # the warm-up's build is not in it
    assert "Triton kernel _expand_kernel built while serving in" in caplog.text
    assert "_expand_kernel[num_warps=4]" in caplog.text
    assert "compile-time values {'BLOCK_M': 64, 'ONE_TILE': False}" in caplog.text
    watch.finished(key=("never", "started"), fn=fn_info("_x"), repr="_x")  # no start seen: nothing counted
    assert watch.count == 1


def test_watch_builds_chains_the_hooks_set_before_it(monkeypatch):
    calls, skip = [], {"_skipped_kernel"}

    def theirs_before(**kwargs):
        calls.append(("before", kwargs["fn"].name))
        return kwargs["fn"].name in skip or None  # a true answer makes Triton skip the build

    def theirs_after(**kwargs):
        calls.append(("after", kwargs["fn"].name))

    runtime = types.SimpleNamespace(jit_cache_hook=theirs_before, jit_post_compile_hook=theirs_after)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(builds, "_hooked", False)
    watch = builds.KernelBuilds()
    monkeypatch.setattr(builds, "_BUILDS", watch)
    assert builds.watch_builds() is watch
    assert builds.watch_builds() is watch  # once per process: the hooks are not wrapped twice
    watch.armed = True

    def kwargs(name):
        return dict(key=("k",), fn=fn_info(name), repr=name, compile={}, is_manual_warmup=False, already_compiled=False)

    # as Triton does: the cache hook, then (unless it answered true) the build and the post-compile hook
    assert runtime.jit_cache_hook(**kwargs("_prefill_kernel")) is None
    assert runtime.jit_post_compile_hook(**kwargs("_prefill_kernel")) is None
    assert runtime.jit_cache_hook(**kwargs("_skipped_kernel")) is True  # theirs skips it: nothing starts
    assert calls == [("before", "_prefill_kernel"), ("after", "_prefill_kernel"), ("before", "_skipped_kernel")]
    assert watch.count == 1 and not watch._started


def test_the_log_names_triton_s_positional_constants():
    watch = builds.KernelBuilds()
    watch.armed = True
    fn = types.SimpleNamespace(name="_shrink_kernel", jit_function=types.SimpleNamespace(arg_names=["x_ptr", "a_ptr", "RANK"]))
    constants = {(2,): 64, (7, 0): 1}
    assert builds._named(constants, fn) == {"RANK": 64, "(7, 0)": 1}
    assert builds._named(constants, fn_info("_no_jit_function")) is constants


def test_a_fault_in_the_counter_does_not_fail_the_build(monkeypatch, caplog):
    monkeypatch.setattr(builds, "_hooked", False)
    runtime = types.SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(builds, "_BUILDS", builds.KernelBuilds())
    builds.watch_builds()
    with caplog.at_level(logging.ERROR, logger="loraserve.executor.diagnostics.builds"):
        assert runtime.jit_cache_hook(key=("k",), fn=None) is None  # fn.name fails inside the counter
    assert "kernel build counter failed" in caplog.text


def test_watch_builds_without_triton_is_a_no_op(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.setattr(builds, "_hooked", False)
    assert isinstance(builds.watch_builds(), builds.KernelBuilds)
    assert builds._hooked is False


def test_builds_are_exported_as_counters():
    watch = builds.KernelBuilds()
    watch.armed = True
    build(watch, "_shrink_kernel")
    build(watch, "_shrink_kernel", key=("t17",))
    families = {f.name: f for f in _ExecutorState._builds(watch)}
    assert families["loraserve_executor_kernel_builds"].samples[0].value == 2
    assert families["loraserve_executor_kernel_build_seconds"].samples[0].value == pytest.approx(watch.seconds)
    cpu = {f.name: f.samples[0].value for f in _ExecutorState._builds(None)}  # no Triton: zeros, still exported
    assert cpu == {"loraserve_executor_kernel_builds": 0, "loraserve_executor_kernel_build_seconds": 0.0}
