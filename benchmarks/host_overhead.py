"""Host overhead per training step: the loop that reads each step's metrics before dispatching
the next (METRICS_LAG=0, the old loop) against the one that reads them one step late
(METRICS_LAG=1, the default), on a model so small that the device work is negligible.

    .venv/bin/python benchmarks/host_overhead.py [--rounds 3] [--steps 200] [--out benchmarks/results/host_overhead.json]

Workload (fixed): one Llama block of width 64 (4 heads of 16, MLP 128), vocab 256, sequence
32, batch 1, float32, synthetic data, one CPU device, no checkpoints or TensorBoard: the step's
own compute is a few hundred microseconds, so the time per step is mostly the host's. Each round
runs the real trainer (`tessera.train.run`) once per mode, alternating, and takes the median
step time after warm-up from its report; the result is each mode's median over rounds and the
ratio lag-1 / lag-0 (below 1: the one-step-late loop is faster). On CPU the "device" is the
same cores as the host, so this measures the loop's bookkeeping and the blocking fetch, not
the overlap an accelerator gains.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_cli import at_least, checked_out, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

WORKLOAD = dict(base_emb_dim=64, base_mlp_dim=128, base_num_decoder_layers=1, base_num_query_heads=4,
                base_num_kv_heads=4, head_dim=16, vocab_size=256, max_target_length=32, per_device_batch_size=1,
                dataset_type="synthetic", enable_checkpointing=False, enable_tensorboard=False, report_warmup_steps=10,
                log_period=1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=at_least(1), default=3)
    warmup = WORKLOAD["report_warmup_steps"]
    parser.add_argument("--steps", type=at_least(warmup + 1), default=200,
                        help=f"steps per run; the first {warmup} are warm-up, left out of the median")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "host_overhead.json"))
    args = parser.parse_args()
    results_file = checked_out(parser, args.out)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.basicConfig(level=logging.WARNING)

    import jax

    import tessera.train
    import tessera.train_loop
    from tessera.config import load_config

    seconds: dict[int, list[float]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for lag in (0, 1):
                tessera.train_loop.METRICS_LAG = lag  # the loop's lag (tessera.step_stats)
                values = {**WORKLOAD, "steps": args.steps, "base_output_directory": tmp, "run_name": f"r{r}_lag{lag}"}
                cfg = load_config([str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in values.items())],
                                  env={})
                report = tessera.train.run(cfg, jax.devices()[:1])
                seconds[lag].append(report["step_seconds"])
                print(f"round {r + 1}/{args.rounds} METRICS_LAG={lag}: {1e3 * report['step_seconds']:.2f} ms/step",
                      flush=True)
    median = {lag: statistics.median(v) for lag, v in seconds.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "jax": jax.__version__, "steps": args.steps, "rounds": args.rounds, "workload": WORKLOAD,
        "ms_per_step_sync": 1e3 * median[0], "ms_per_step_one_step_late": 1e3 * median[1],
        "ratio_late_over_sync": median[1] / median[0], "per_round_seconds": seconds,
    }
    write_results(results_file, result)
    print(f"median ms/step: sync {result['ms_per_step_sync']:.2f}, one step late "
          f"{result['ms_per_step_one_step_late']:.2f}; ratio {result['ratio_late_over_sync']:.3f} -> {results_file}")


if __name__ == "__main__":
    sys.exit(run_main(main))
