"""The matmul-bound ceiling of benchmarks/cpu_llama.py's workload: what fraction of the matmul
peak a training step could reach if it did nothing but its own matmuls, each at the speed that
shape runs at alone.

    .venv/bin/python benchmarks/cpu_llama_ceiling.py [--out benchmarks/results/cpu_llama_ceiling.json] [key=value ...]

It compiles the trainer's step for the fixed workload (same keys as cpu_llama.py, e.g.
remat_policy=full scan_layers=true; dtype=float32 by default), reads every dot the compiled
program executes from its HLO (how many times each runs: loops count their trip count, so a
recomputed forward counts twice), times each distinct dot alone (same operand shapes, dimension
numbers and dtype; XLA chooses its layouts), and reports:

- `matmul_seconds`: the sum of count x alone-time over the step's dots;
- `ceiling_fraction`: model FLOPs (what the trainer's MFU counts) / matmul_seconds / peak, with
  the peak measured as cpu_llama.py does (a 2048^3 float32 matmul, before and after);
- per dot shape: its count, GFLOP and its own fraction of that peak;
- `xla_flops_per_step`: XLA's own FLOP count of the compiled step (which counts a loop's body
  once), next to the dots' sum counted the same way: the matmuls are nearly all of it, so a dot
  the parse missed would show as a gap.

A step cannot beat its ceiling unless its matmuls run faster inside it than alone; the gap
between the ceiling and cpu_llama.py's measured fraction is everything that is not a matmul.
About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import cpu_llama  # noqa: E402  (the workload, its settings and the peak measurement)
from bench_cli import at_least, checked_config, checked_out, key_values, run_main, write_results  # noqa: E402

_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = \w+\[[\d,]*\]\S* dot\(%([\w.-]+), %([\w.-]+)\)(.*)$")


def _dims(attrs: str, name: str) -> tuple[int, ...]:
    m = re.search(name + r"=\{([\d,]*)\}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def step_dots(hlo: str, trips: bool = True) -> Counter:
    """{(dtype, lhs shape, rhs shape, lhs contracting, rhs contracting, lhs batch, rhs batch): times
    executed per step} for every dot of a compiled (XLA:CPU) HLO text; `trips=False` counts a loop
    body once, as XLA's cost analysis does."""
    from tessera.hlo_text import hlo_computations

    bodies = hlo_computations(hlo)
    entry = next(m.group(1) for m in re.finditer(r"^ENTRY %([\w.-]+) \(", hlo, re.M))
    # how many times each computation runs per step: callers' counts, times a while loop's trip count
    calls: dict[str, list[tuple[str, int]]] = {}
    for name, body in bodies.items():
        for line in body:
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            for kind, callee in re.findall(r"(calls|body|condition|to_apply|branch_computations)=\{?%([\w.-]+)", line):
                n = int(trip.group(1)) if trip and kind == "body" and trips else 1
                calls.setdefault(callee, []).append((name, n))
            for callee in re.findall(r"branch_computations=\{([^}]*)\}", line):
                for c in re.findall(r"%([\w.-]+)", callee):
                    calls.setdefault(c, []).append((name, 1))
    runs: dict[str, int] = {entry: 1}

    def count(name: str) -> int:
        if name not in runs:
            runs[name] = 0
            runs[name] = sum(count(caller) * n for caller, n in calls.get(name, []))
        return runs[name]

    dots: Counter = Counter()
    for name, body in bodies.items():
        shapes = {}
        for line in body:
            d = _DEF.match(line)
            if d:
                shapes[d.group(1)] = (d.group(2), tuple(int(x) for x in d.group(3).split(",") if x))
            m = _DOT.match(line)
            if m and count(name):
                (dtype, lhs), (_, rhs) = shapes[m.group(1)], shapes[m.group(2)]
                attrs = m.group(3)
                key = (dtype, lhs, rhs, _dims(attrs, "lhs_contracting_dims"), _dims(attrs, "rhs_contracting_dims"),
                       _dims(attrs, "lhs_batch_dims"), _dims(attrs, "rhs_batch_dims"))
                dots[key] += count(name)
    return dots


def dot_flops(key) -> int:
    _, lhs, rhs, lc, rc, lb, rb = key
    contracted = math.prod(lhs[i] for i in lc)
    batch = math.prod(lhs[i] for i in lb)
    free_l = math.prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
    free_r = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
    return 2 * batch * free_l * free_r * contracted


def time_alone(key, repeats: int) -> float:
    """Median seconds of this dot alone, jitted, on random operands."""
    import jax

    dtype, lhs, rhs, lc, rc, lb, rb = key
    jdtype = {"f32": "float32", "bf16": "bfloat16"}[dtype]
    a = jax.random.normal(jax.random.key(0), lhs, jdtype)
    b = jax.random.normal(jax.random.key(1), rhs, jdtype)
    return cpu_llama.median_seconds(jax.jit(lambda x, y: jax.lax.dot_general(x, y, ((lc, rc), (lb, rb)))), a, b,
                                    repeats=repeats)


def _settings(parser: argparse.ArgumentParser, extra: list[str]) -> dict:
    """cpu_llama's tuned settings with the command line's `key=value`s (dtype float32 unless given); the fixed
    workload's keys and other dtypes are refused."""
    settings = {**cpu_llama.TUNED, "dtype": "float32", **key_values(parser, extra)}
    clash = set(settings) & set(cpu_llama.WORKLOAD)
    if clash:
        parser.error(f"these keys define the fixed workload and cannot be overridden: {sorted(clash)}")
    if settings["dtype"] not in ("float32", "bfloat16"):
        parser.error(f"dtype={settings['dtype']}: this benchmark times float32 or bfloat16 dots")
    return settings


def _timed_dots(dots: dict, repeats: int) -> list[dict]:
    """A row per distinct dot of the step (the costliest in all first), each timed alone."""
    rows = []
    for key, n in sorted(dots.items(), key=lambda kv: -dot_flops(kv[0]) * kv[1]):
        seconds = time_alone(key, repeats)
        rows.append({"dtype": key[0], "lhs": key[1], "rhs": key[2], "contracting": [key[3], key[4]],
                     "batch": [key[5], key[6]], "count": n, "gflop_each": dot_flops(key) / 1e9,
                     "seconds_each": seconds, "tflops_per_sec": dot_flops(key) / seconds / 1e12})
    return rows


def _print_rows(rows: list[dict], peak: float) -> None:
    """Each row's fraction of the matmul `peak` (kept in the row too), a line per row."""
    for r in rows:
        r["fraction_of_peak"] = r["tflops_per_sec"] / peak
        print(f"  {r['count']:3d} x {r['dtype']}{list(r['lhs'])} . {list(r['rhs'])}: {r['gflop_each']:7.2f} GFLOP, "
              f"{r['fraction_of_peak']:.2f} of peak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_llama_ceiling.json"))
    parser.add_argument("--repeats", type=at_least(1), default=10)
    args, extra = parser.parse_known_args()
    settings = _settings(parser, extra)
    results_file = checked_out(parser, args.out)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tessera import host_malloc

    host_malloc.reexec()  # the allocator cpu_llama.py and train.py run with
    import jax

    from tessera.metrics import training_flops_per_step
    from tessera.step import compile_step, setup

    argv = [str(REPO / "configs" / "base.yml"), "run_name=ceiling", "base_output_directory=/tmp/unused",
            *(f"{k}={v}" for k, v in {**cpu_llama.WORKLOAD, **settings}.items())]
    cfg = checked_config(parser, argv)  # a bad key or value stops here, before anything is measured
    peak_before = cpu_llama.measured_peak("before")
    cpu_llama.phase("compiling the step and reading its dots")
    trainer = setup(cfg, jax.devices()[:1])
    compiled, _ = compile_step(trainer, 0)
    dots = step_dots(compiled.as_text())
    model_flops = training_flops_per_step(cfg.model, trainer.plan.global_batch, trainer.plan.max_target_length)
    cpu_llama.phase(f"{sum(dots.values())} dots a step, {len(dots)} distinct; timing each alone")
    rows = _timed_dots(dots, args.repeats)
    peak = max(peak_before, cpu_llama.measured_peak("after"))
    matmul_seconds = sum(r["count"] * r["seconds_each"] for r in rows)
    executed = sum(r["count"] * r["gflop_each"] for r in rows) * 1e9
    analysis = compiled.cost_analysis()
    xla_flops = float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])
    once = sum(dot_flops(key) * n for key, n in step_dots(compiled.as_text(), trips=False).items())
    _print_rows(rows, peak)
    result = {
        "benchmark": "cpu_llama_ceiling",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{os.cpu_count()} cores",
        "workload": cpu_llama.WORKLOAD,
        "settings": settings,
        "matmul_tflops_per_sec": peak,
        "model_flops_per_step": model_flops,
        "executed_matmul_flops_per_step": executed,
        "xla_flops_per_step": xla_flops,
        "matmul_flops_loop_bodies_once": once,
        "matmul_seconds": matmul_seconds,
        "ceiling_fraction": model_flops / matmul_seconds / peak / 1e12,
        "dots": rows,
    }
    if not 0.9 * xla_flops <= once <= xla_flops:
        cpu_llama.phase(f"warning: the dots read from the program add up to {once / 1e9:.1f} GFLOP (loop bodies "
                        f"once), XLA counts {xla_flops / 1e9:.1f}: the ceiling below is not to be trusted")
    cpu_llama.phase(f"model {model_flops / 1e9:.1f} GFLOP, executed matmuls {executed / 1e9:.1f} GFLOP (loop bodies "
                    f"once: {once / 1e9:.1f}, XLA's count {xla_flops / 1e9:.1f}), "
                    f"{matmul_seconds:.2f} s of matmuls alone: ceiling {result['ceiling_fraction']:.2f} of the "
                    f"{peak:.3f} TFLOP/s peak")
    write_results(results_file, result)
    cpu_llama.phase(f"wrote {results_file}")


if __name__ == "__main__":
    sys.exit(run_main(main))
