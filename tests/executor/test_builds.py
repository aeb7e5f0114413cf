"""Triton builds while serving (executor/engine/builds.py): counted and logged once armed, Triton's
hooks chained, exported to /metrics. Triton is not needed: its hooks are called as Triton calls them."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from loraserve.executor.engine import builds
from loraserve.metrics import _ExecutorState


def fn_info(name: str):
    return types.SimpleNamespace(name=name)


def build(watch: builds.KernelBuilds, name: str, key=("sig", "opts")) -> None:
    info = {"constants": {"BLOCK_M": 64, "ONE_TILE": False}}
    watch.started(key=key, fn=fn_info(name), repr=f"{name}[num_warps=4]", compile=info, is_manual_warmup=False,
                  already_compiled=False)
    watch.finished(key=key, fn=fn_info(name), repr=f"{name}[num_warps=4]", compile=info, is_manual_warmup=False,
                   already_compiled=False)


def test_builds_count_only_once_armed_and_each_is_logged(caplog):
    watch = builds.KernelBuilds()
    build(watch, "_shrink_kernel")  # the warm-up's builds: expected, not counted
    assert (watch.count, watch.seconds) == (0, 0.0)
    watch.armed = True
    with caplog.at_level(logging.WARNING, logger="loraserve.executor.engine.builds"):
        build(watch, "_expand_kernel", key=("other", "opts"))
    assert watch.count == 1 and watch.seconds > 0
    assert "Triton kernel _expand_kernel built while serving in" in caplog.text
    assert "_expand_kernel[num_warps=4]" in caplog.text
    assert "compile-time values {'BLOCK_M': 64, 'ONE_TILE': False}" in caplog.text
    watch.finished(key=("never", "started"), fn=fn_info("_x"), repr="_x")  # no start seen: nothing counted
    assert watch.count == 1


def test_watch_builds_chains_the_hooks_set_before_it(monkeypatch):
    calls = []

    def theirs_before(**kwargs):
        calls.append(("before", kwargs["fn"].name))
        return True  # theirs may skip a build: that answer must reach Triton

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
    kwargs = dict(key=("k",), fn=fn_info("_prefill_kernel"), repr="_prefill_kernel", compile={},
                  is_manual_warmup=False, already_compiled=False)
    assert runtime.jit_cache_hook(**kwargs) is True
    assert runtime.jit_post_compile_hook(**kwargs) is None
    assert calls == [("before", "_prefill_kernel"), ("after", "_prefill_kernel")]
    assert watch.count == 1


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
