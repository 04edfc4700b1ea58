"""skip_step_on_spikes: a step whose loss or gradient norm is more than skip_step_scaling_factor standard
deviations above the mean of the last skip_step_interval steps' drops its update; the window is part of the
train state (saved, resumed, turned on or off at a resume)."""

import json

import jax
import numpy as np
import pytest

from conftest import REPO, tiny_config
from tessera.config import load_config
from tessera.train import run

# a window of 8 steps and half a standard deviation: the tiny model's noisy steps spike often
SPIKY = dict(skip_step_on_spikes=True, skip_step_interval=8, skip_step_scaling_factor=0.5, learning_rate=0.03,
             per_device_batch_size=2)


def _records(folder):
    return [json.loads(line) for line in (folder / "test" / "metrics.jsonl").read_text().splitlines()]


def _decisions_by_hand(records, interval, scaling):
    """Each step's skip, from the logged losses and gradient norms: a spike when either is above the mean +
    scaling x the standard deviation (n - 1) of the window's values, once it holds max(2, interval // 2); every
    finite step's values join the window, skipped or not."""
    losses, norms, skips = [], [], []
    for r in records:
        spike = False
        if len(losses) >= max(2, interval // 2):
            spike = any(value > np.mean(w[-interval:]) + scaling * np.std(w[-interval:], ddof=1)
                        for value, w in ((r["loss"], losses), (r["grad_norm"], norms)))
        skips.append(spike)
        losses.append(r["loss"])
        norms.append(r["grad_norm"])
    return skips


@pytest.fixture(scope="module")
def spiky(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spiky")
    report = run(tiny_config(folder, steps=30, **SPIKY), jax.devices()[:1])
    return report, _records(folder)


def test_the_steps_skipped_are_those_the_rule_picks_and_their_updates_are_dropped(spiky, caplog):
    """The device's decisions equal the rule applied on the host to the logged values; a skipped step leaves the
    schedule's count where it was (the next step trains at its rate), and the report counts the skips."""
    report, records = spiky
    skipped = [bool(r.get("spike")) for r in records]
    assert skipped == _decisions_by_hand(records, 8, 0.5)
    assert 3 <= sum(skipped) <= 20 and not any(skipped[:4])  # none before the window holds 4 values
    assert all(r.get("skipped") for r in records if r.get("spike"))
    for now, after in zip(records, records[1:]):
        if now.get("spike"):
            assert after["learning_rate"] == now["learning_rate"]
    assert report["steps_skipped"] == report["steps_skipped_spikes"] == sum(skipped)


def test_a_spike_is_named_with_the_threshold_it_crossed(tmp_path, caplog):
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=30, **SPIKY), jax.devices()[:1])
    first = next(r for r in _records(tmp_path) if r.get("spike"))
    line = next(m for m in caplog.messages if m.startswith(f"step {first['step']}: "))
    assert ("above" in line and line.endswith("(the mean + 0.5 standard deviations of the last 8 steps' values): "
                                              "update skipped (skip_step_on_spikes)"))
    assert "steps trained were skipped (a loss or gradient norm spike, skip_step_on_spikes" in caplog.text


def test_a_resumed_run_keeps_its_window_and_skips_the_same_steps(spiky, tmp_path):
    """A stop just before the uninterrupted run's first skip, then a resume to 30 (the schedule 30 steps long in
    both): the window is saved with the train state, so the losses, gradient norms and skips are the uninterrupted
    run's (bitwise on CPU). A resume with a new window could not skip that step (4 values come first)."""
    want = spiky[1]
    first = next(i for i, r in enumerate(want) if r.get("spike"))
    run(tiny_config(tmp_path, steps=first, learning_rate_schedule_steps=30, **SPIKY), jax.devices()[:1])
    run(tiny_config(tmp_path, steps=30, learning_rate_schedule_steps=30, **SPIKY), jax.devices()[:1])
    got = _records(tmp_path)
    assert [(r["loss"], r["grad_norm"], bool(r.get("spike"))) for r in got] == \
           [(r["loss"], r["grad_norm"], bool(r.get("spike"))) for r in want]


@pytest.mark.parametrize("before, after, said", [
    ({}, SPIKY, "saved without the spike check's window, restored with skip_step_on_spikes' window of 8 steps: it "
                "starts empty"),
    (SPIKY, {"learning_rate": 0.03, "per_device_batch_size": 2},
     "saved with skip_step_on_spikes' window of recent losses, restored without the check"),
    (SPIKY, {**SPIKY, "skip_step_interval": 4}, "saved with a window of 8 steps, restored with skip_step_on_spikes' "
                                                "window of 4 steps: it starts empty"),
], ids=["turned on", "turned off", "another interval"])
def test_the_check_may_be_turned_on_or_off_or_resized_at_a_resume(tmp_path, caplog, before, after, said):
    """A run that spikes may turn the check on at a resume (and off again, or change its window): the optimizer
    state resumes as saved and the window starts empty, so no step is skipped before it fills to half."""
    keys = {"learning_rate": 0.03, "per_device_batch_size": 2, **before}
    run(tiny_config(tmp_path, steps=6, **keys), jax.devices()[:1])
    with caplog.at_level("INFO"):
        run(tiny_config(tmp_path, steps=12, **after), jax.devices()[:1])
    assert said in caplog.text and "resuming from step 6" in caplog.text
    records = _records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    half = max(2, after.get("skip_step_interval", 0) // 2)
    assert not any(r.get("spike") for r in records[6:6 + half])


def test_the_window_keys_without_the_check_are_named_as_unread():
    from tessera.config.unread_keys import keys_without_effect

    cfg = load_config([str(REPO / "configs" / "base.yml"), "skip_step_interval=64"], env={})
    assert keys_without_effect(cfg, {"fsdp": 1}) == [
        "skip_step_interval=64: no effect without skip_step_on_spikes=true"]
