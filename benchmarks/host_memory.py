"""Peak resident host memory of CPU training runs: a fresh start, a resume, and checkpoint saves.

Workload (fixed): Llama block, emb 1024, 8 layers, 8 heads of 64, mlp 4096, vocab 32000,
float32 weights with AdamW state (183M parameters: a 2.05 GiB train state), batch 1 x 128
tokens, synthetic data, one CPU device. Each case is a real `train.py` run in a process of its
own, started the way a user starts it (mimalloc preloaded unless TESSERA_HOST_MALLOC=system);
its peak resident memory comes from the kernel (`wait4`'s ru_maxrss):

    fresh               3 steps from a fresh init, no checkpoints (the baseline)
    resume              3 steps from load_full_state_path (a checkpoint of step 1), no checkpoints
    saves_async         5 steps from a fresh init, a save every 2 steps (async_checkpointing=true)
    saves_sync          the same with async_checkpointing=false

The cases run in turn, twice (`--rounds`). A fresh start's peak varies from run to run by up
to 1.4 GiB here (how mimalloc's per-thread heaps happen to reuse the init's and the first steps'
memory), so the JSON holds every run's peak in GiB, each case's median, and the medians' ratio
to `fresh`, next to the train state's size.

    .venv/bin/python benchmarks/host_memory.py [--out benchmarks/results/host_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_cli import at_least, checked_out, run_main, write_results

REPO = Path(__file__).resolve().parent.parent

WORKLOAD = dict(base_emb_dim=1024, base_num_decoder_layers=8, base_num_query_heads=8, base_num_kv_heads=8,
                head_dim=64, base_mlp_dim=4096, vocab_size=32000, max_target_length=128, per_device_batch_size=1,
                dataset_type="synthetic", enable_tensorboard=False)
STATE_GIB = 182_993_920 * 12 / 2**30  # parameters x (weight + two AdamW moments) in float32; checked below

CASES = {
    "fresh": dict(steps=3, enable_checkpointing=False),
    "resume": dict(steps=3, enable_checkpointing=False, load_full_state_path="{source}"),
    "saves_async": dict(steps=5, checkpoint_period=2, async_checkpointing=True),
    "saves_sync": dict(steps=5, checkpoint_period=2, async_checkpointing=False),
}


def train(folder: Path, run_name: str, settings: dict) -> tuple[float, str]:
    """(peak resident GiB, stderr) of one train.py run with `settings` over the workload."""
    keys = {**WORKLOAD, **settings, "run_name": run_name, "base_output_directory": str(folder)}
    command = [sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml"),
               *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FLAGS")}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=folder)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # Ctrl-C or SIGTERM (run_main): the run must not go on training alone
            proc.kill()
            proc.wait()
            raise
        err.seek(0)
        log = err.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{run_name} failed:\n{log[-3000:]}")
    return usage.ru_maxrss / 2**20, log  # KiB on Linux


def phase(text: str) -> None:
    print(f"[host_memory {time.strftime('%H:%M:%S')}] {text}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "host_memory.json"))
    parser.add_argument("--rounds", type=at_least(1), default=2)
    args = parser.parse_args()
    results_file = checked_out(parser, args.out)
    if platform.system() != "Linux":
        raise SystemExit("this benchmark reads peak memory the Linux way (wait4); run it on Linux")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        phase("a checkpoint of step 1 to resume from")
        _, log = train(folder, "source", dict(steps=1))
        count = int(log.split(" parameters, global batch")[0].rsplit(" ", 1)[-1].replace(",", ""))
        assert count * 12 / 2**30 == STATE_GIB, f"the workload changed: {count:,} parameters"
        source = folder / "source" / "checkpoints" / "1"
        peaks = {name: [] for name in CASES}
        for round_ in range(args.rounds):
            for name, settings in CASES.items():
                settings = {k: str(v).format(source=source) if isinstance(v, str) else v for k, v in settings.items()}
                peak, _ = train(folder, f"{name}_{round_}", settings)
                peaks[name].append(peak)
                phase(f"{name}: peak {peak:.2f} GiB resident")

    from tessera import host_malloc

    result = {
        "benchmark": "host_memory", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "workload": WORKLOAD,
        "host_malloc": os.environ.get(host_malloc.CHOICE_VAR, "mimalloc"),
        "train_state_gib": round(STATE_GIB, 3),
        "peak_resident_gib": {k: [round(p, 3) for p in v] for k, v in peaks.items()},
        "median_peak_resident_gib": {k: round(statistics.median(v), 3) for k, v in peaks.items()},
        "median_ratio_to_fresh": {k: round(statistics.median(v) / statistics.median(peaks["fresh"]), 3)
                                  for k, v in peaks.items()},
    }
    write_results(results_file, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(run_main(main))
