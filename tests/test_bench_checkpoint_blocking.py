"""benchmarks/checkpoint_blocking.py's `write_seconds` is the time until the checkpoint is on disk,
not until the steps trained after the save have ended too."""

import importlib
import sys
import time

import pytest

import tessera.step
from conftest import REPO, TINY


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    module = importlib.import_module("checkpoint_blocking")
    monkeypatch.setattr(module, "WORKLOAD", {k: v for k, v in TINY.items() if k not in ("steps", "log_period")})
    original = tessera.step.compile_step

    def slow_steps(trainer, seed):  # each step takes 0.6 s more: the steps after the save are long
        step_fn, seconds = original(trainer, seed)

        def slow(state, batch):
            time.sleep(0.6)
            return step_fn(state, batch)
        return slow, seconds

    monkeypatch.setattr(tessera.step, "compile_step", slow_steps)
    yield module
    sys.modules.pop("checkpoint_blocking", None)


@pytest.mark.parametrize("async_save", [False, True])
def test_write_seconds_leave_out_the_steps_after_the_save(bench, tmp_path, async_save):
    row = bench.measure(async_save, False, str(tmp_path / "ckpt"))
    assert row["median_step_seconds"] >= 0.6 and row["step_after_save_seconds"] >= 0.6, row
    if not async_save:  # on disk when the call returns; before, the three steps after it were counted too
        assert row["write_seconds"] == row["save_call_seconds"], row
    else:  # a few KiB are written long before the three 0.6 s steps end
        assert row["save_call_seconds"] <= row["write_seconds"] < row["save_call_seconds"] + 1.2, row
