"""CPU training benchmark: a small Llama through the real trainer, next to the machine's matmul peak.

Workload (fixed, so results compare over time): emb 512, 8 layers, 8 heads of 64, mlp 1536,
vocab 32000, sequence 512, global batch 4, float32 weights, synthetic data, one CPU device.
The compute dtype is run both ways, float32 then bfloat16 (weights stay float32), unless
`dtype=` picks one.

    .venv/bin/python benchmarks/cpu_llama.py [--steps 12] [--out benchmarks/results/cpu_llama.json] [key=value ...]

Extra key=value arguments override trainer settings (e.g. remat_policy=full) but never the
workload's shapes. The JSON holds, per dtype, the trainer's medians and their ratio to the
FLOP/s of a large float32 matmul measured in the same process (the fraction of the practical
peak), and bf16's speed relative to f32, next to the same ratio for the matmul alone (the
backend's bfloat16 matmul against its float32 one: what bf16 compute can gain at most here), each
dtype's fraction of its own matmul's peak (`fraction_of_own_dtype_matmul_peak`: bfloat16's matmul
is two to five times as fast as float32's on a CPU with a bfloat16 dot product), how the trainer multiplied
bfloat16 operands (`cpu_bf16_matmul`: native or float32 copies, `tessera.cpu_matmul`), and
the host allocator the process ran with (`host_malloc`: mimalloc, as train.py uses on CPU, or
`system` with TESSERA_HOST_MALLOC=system, the baseline before it).
It says what it is doing as it goes: each phase, then the trainer's line per step (about two
minutes in all on 2 cores, both dtypes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_cli import at_least, checked_config, checked_out, key_values, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

WORKLOAD = dict(
    base_emb_dim=512, base_num_decoder_layers=8, base_num_query_heads=8, base_num_kv_heads=8, head_dim=64,
    base_mlp_dim=1536, vocab_size=32000, max_target_length=512, per_device_batch_size=4,
    weight_dtype="float32", dataset_type="synthetic",
)
# Settings that are ours to tune (measured: see the closing notes of the trainer-core issue).
TUNED = dict(remat_policy="none", scan_layers=False, attention="dot_product", enable_tensorboard=False,
             report_warmup_steps=2)


def median_seconds(fn, *args, repeats: int = 10) -> float:
    """Median wall time of `fn(*args)` (a jitted function, run once first to compile)."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_tflops(n: int = 2048, repeats: int = 10, dtype: str = "float32") -> float:
    """Median TFLOP/s of an n x n x n matmul in `dtype` (inputs and output) on the default device."""
    import jax

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    return 2 * n**3 / median_seconds(jax.jit(lambda x, y: x @ y), a, b, repeats=repeats) / 1e12


def phase(text: str) -> None:
    print(f"[cpu_llama {time.strftime('%H:%M:%S')}] {text}", flush=True)


def measured_peak(when: str, dtype: str = "float32") -> float:
    phase(f"matmul peak {when} training: 2048^3 {dtype}, 10 runs")
    peak = matmul_tflops(dtype=dtype)
    phase(f"matmul peak {when}: {peak:.3f} TFLOP/s ({dtype})")
    return peak


def check_settings(parser: argparse.ArgumentParser, settings: dict, dtypes: list[str], steps: int):
    """Refuse (usage error, exit 2) what would fail or mislead only after minutes of measuring: a key of
    the fixed workload, a compute dtype without a matmul peak here; returns the check of the trainer's
    config for one dtype (unknown keys, bad values, `steps` not above the warm-up)."""
    clash = set(settings) & set(WORKLOAD)
    if clash:
        parser.error(f"these keys define the fixed workload and cannot be overridden: {sorted(clash)}")
    if "steps" in settings:  # it overrode --steps in the runs, not in the warm-up check or the JSON's `steps`
        parser.error(f"steps={settings['steps']}: the number of steps is the option --steps (give --steps "
                     f"{settings['steps']})")
    ours = sorted(set(settings) & {"run_name", "base_output_directory"})
    if ours:
        parser.error(f"{ours[0]}={settings[ours[0]]}: each run trains in a temporary folder of its own; leave it out")
    other = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if other:
        parser.error(f"dtype={other[0]}: this benchmark measures float32 and bfloat16 compute (leave dtype out "
                     "for both)")

    def check(dtype: str) -> None:
        argv = [str(REPO / "configs" / "base.yml"), "run_name=bench_check", f"steps={steps}", f"dtype={dtype}",
                *(f"{k}={v}" for k, v in {**WORKLOAD, **settings}.items())]
        warmup = checked_config(parser, argv).run.report_warmup_steps
        if steps <= warmup:
            parser.error(f"--steps {steps} leaves no step after the {warmup} warm-up step(s) "
                         f"(report_warmup_steps); give --steps {warmup + 1} or more")

    return check


def _result(reports: dict[str, dict], settings: dict, steps: int, peaks: tuple[float, float],
            bf16_peak: float | None) -> dict:
    """The results file's record: each dtype's run (`reports`: the trainer's) against the measured matmul peaks
    (float32 before and after the runs; bfloat16's best, or None when no bfloat16 run)."""
    from tessera import cpu_matmul, host_malloc  # imported by main, after JAX_PLATFORMS is set

    peak = max(peaks)
    own_peak = {"float32": peak, "bfloat16": bf16_peak}
    runs = {dtype: {
        "step_seconds": r["step_seconds"],
        "tokens_per_sec": r["tokens_per_sec_per_device"],
        "train_tflops_per_sec": r["tflops_per_sec_per_device"],
        "compile_seconds": r["compile_seconds"],
        "fraction_of_matmul_peak": r["tflops_per_sec_per_device"] / peak,
        # against the matmul of the run's own compute dtype (bfloat16's is two to five times float32's on a CPU
        # with a bfloat16 dot product)
        "fraction_of_own_dtype_matmul_peak": r["tflops_per_sec_per_device"] / own_peak[dtype],
        "final_loss": r["final_loss"],
    } for dtype, r in reports.items()}
    result = {
        "benchmark": "cpu_llama",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "workload": WORKLOAD,
        "settings": settings,
        "steps": steps,
        "host_malloc": host_malloc.in_use(),
        "cpu_bf16_matmul": cpu_matmul.bf16_matmul(),  # how the trainer multiplies bfloat16 operands here
        "flops_per_step": next(iter(reports.values()))["flops_per_step"],
        "matmul_tflops_per_sec": peak,
        "matmul_tflops_per_sec_before_after": list(peaks),
        "runs": runs,
    }
    if bf16_peak is not None:
        result["bfloat16_matmul_tflops_per_sec"] = bf16_peak
        result["bfloat16_matmul_over_float32_matmul"] = bf16_peak / peak
    if len(runs) == 2:
        result["bfloat16_speed_over_float32"] = runs["float32"]["step_seconds"] / runs["bfloat16"]["step_seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=at_least(1), default=12)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_llama.json"))
    args, extra = parser.parse_known_args()
    settings = {**TUNED, **key_values(parser, extra)}
    dtypes = [settings.pop("dtype")] if "dtype" in settings else ["float32", "bfloat16"]
    checks = check_settings(parser, settings, dtypes, args.steps)
    results_file = checked_out(parser, args.out)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tessera import cpu_matmul, host_malloc

    host_malloc.reexec()  # as train.py does: mimalloc preloaded unless TESSERA_HOST_MALLOC=system
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname).1s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("tessera").setLevel(logging.INFO)  # the trainer's line per step

    from tessera.config import load_config
    from tessera.train import run

    for dtype in dtypes:  # a bad key or value stops here, before anything is measured
        checks(dtype)
    phase(f"host malloc: {host_malloc.describe()}")
    phase("bfloat16 matmuls: %s (%s)" % cpu_matmul.decision())
    peak_before = measured_peak("before")
    # the backend's own bfloat16 matmul against its float32 one: the most bf16 compute can gain here
    bf16_before = measured_peak("before", "bfloat16") if "bfloat16" in dtypes else None
    reports = {}
    for dtype in dtypes:
        phase(f"training {args.steps} steps in dtype={dtype} through the trainer (set-up and compilation first, "
              "then one line per step)")
        with tempfile.TemporaryDirectory() as out:
            argv = [str(REPO / "configs" / "base.yml"), f"run_name=bench_{dtype}", f"base_output_directory={out}",
                    f"steps={args.steps}", f"dtype={dtype}",
                    *(f"{k}={v}" for k, v in {**WORKLOAD, **settings}.items())]
            reports[dtype] = run(load_config(argv, env={}))
    peak_after = measured_peak("after")
    peak = max(peak_before, peak_after)
    bf16_peak = max(bf16_before, measured_peak("after", "bfloat16")) if bf16_before is not None else None
    result = _result(reports, settings, args.steps, (peak_before, peak_after), bf16_peak)
    for dtype, r in result["runs"].items():
        own = "" if dtype == "float32" else f", {r['fraction_of_own_dtype_matmul_peak']:.2f} of the {dtype} matmul's"
        phase(f"{dtype}: {r['step_seconds']:.2f} s/step, {r['fraction_of_matmul_peak']:.2f} of the (float32) "
              f"matmul peak{own}")
    if bf16_peak is not None:
        phase(f"bfloat16 matmul at {bf16_peak / peak:.2f} x the float32 matmul's speed")
    write_results(results_file, result)
    phase(f"wrote {results_file}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(run_main(main))
