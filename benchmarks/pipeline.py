"""Pipeline parallelism on 8 CPU devices: the trainer's step time with 2 pipeline stages
(GPipe and circular) against no pipelining, on the same devices, model and batch.

    .venv/bin/python benchmarks/pipeline.py [--rounds 3] [--steps 8] [--out benchmarks/results/pipeline.json]

Workload (fixed): a Llama block of width 256 (4 heads of 64, MLP 768), 8 layers, vocab 1024,
sequence 256, global batch 32 (per_device_batch_size=4 on 8 fake CPU devices), float32,
synthetic data, `scan_layers=true`. Settings: no pipelining (fsdp 8); 2 stages x fsdp 4 with
M = 8 microbatches (GPipe, bubble 1/9); 2 stages with 2 repeats (circular, bubble 1/17).

Every device of a stage computes in every iteration of the schedule, idle ones on filler, so
on CPU (where all 8 "devices" share the same cores) a pipelined step costs about
iterations / (M x R) = 1 / (1 - bubble) times the work of an unpipelined one, plus the
schedule's own overhead (the hand-over, the per-microbatch matmuls being smaller). The ratio
each setting reaches is printed next to that bubble factor. Rounds alternate the settings;
each reports the median step time after warm-up from the trainer's own report.
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

WORKLOAD = dict(base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4, head_dim=64, base_mlp_dim=768,
                base_num_decoder_layers=8, vocab_size=1024, max_target_length=256, per_device_batch_size=4,
                dataset_type="synthetic", scan_layers=True, enable_checkpointing=False, enable_tensorboard=False,
                report_warmup_steps=2, attention="dot_product")
SETTINGS = {
    "no pipeline (fsdp 8)": dict(ici_fsdp_parallelism=8),
    "2 stages, GPipe (M=8)": dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=4, num_pipeline_microbatches=8),
    "2 stages, circular R=2 (M=8)": dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=4,
                                         num_pipeline_microbatches=8, num_pipeline_repeats=2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=at_least(1), default=3)
    warmup = WORKLOAD["report_warmup_steps"]
    parser.add_argument("--steps", type=at_least(warmup + 1), default=8,
                        help=f"steps per run; the first {warmup} are warm-up, left out of the median")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pipeline.json"))
    args = parser.parse_args()
    results_file = checked_out(parser, args.out)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    logging.basicConfig(level=logging.WARNING)

    import jax

    from tessera.config import load_config
    from tessera.config.derived import plan_run
    from tessera.train import run

    seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    bubbles: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, mesh in SETTINGS.items():
                values = {**WORKLOAD, **mesh, "steps": args.steps, "base_output_directory": tmp,
                          "run_name": f"r{r}_{len(bubbles)}_{abs(hash(name))}"}
                cfg = load_config([str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in values.items())],
                                  env={})
                sizes = {"data": 1, "stage": cfg.mesh.ici_pipeline_parallelism, "fsdp": cfg.mesh.ici_fsdp_parallelism,
                         "sequence": 1, "tensor": 1, "expert": 1}
                layout = plan_run(cfg, sizes).pipeline
                bubbles[name] = layout.bubble if layout else 0.0
                report = run(cfg, jax.devices())
                seconds[name].append(report["step_seconds"])
                print(f"round {r + 1}/{args.rounds} {name}: {report['step_seconds']:.3f} s/step", flush=True)
    base = statistics.median(seconds["no pipeline (fsdp 8)"])
    rows = {name: {"step_seconds": statistics.median(v), "ratio_to_no_pipeline": statistics.median(v) / base,
                   "bubble": bubbles[name], "bubble_factor": 1 / (1 - bubbles[name]), "per_round_seconds": v}
            for name, v in seconds.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
              "jax": jax.__version__, "workload": WORKLOAD, "steps": args.steps, "rounds": args.rounds,
              "settings": SETTINGS, "results": rows}
    write_results(results_file, result)
    for name, row in rows.items():
        print(f"{name:30s} {row['step_seconds']:.3f} s/step  x{row['ratio_to_no_pipeline']:.2f} of no pipelining "
              f"(bubble {100 * row['bubble']:.1f}%: 1/(1-bubble) = {row['bubble_factor']:.2f})")
    print(f"wrote {results_file}")


if __name__ == "__main__":
    sys.exit(run_main(main))
