"""AOT-compile every TPU recipe for its own topology and record whether it fits in HBM.

    .venv/bin/python benchmarks/aot_recipes.py                 # all of configs/tpu/*/*.sh
    .venv/bin/python benchmarks/aot_recipes.py v5p/128b v6e    # only recipes whose path contains these

Each recipe runs as a user would run it, `bash <recipe> EXECUTABLE=train_compile`, so its
LIBTPU_INIT_ARGS reach libtpu's compiler (an unknown flag fails the recipe) and the config it
builds is the one it would train with. One JSON row per recipe goes to
benchmarks/results/aot_recipes.json (rows of recipes not run this time are kept). Exits 1 when
any recipe of this run fails to compile or does not fit.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_cli import chosen_recipes, read_results, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "aot_recipes.json"
GIB = 2**30


def compile_recipe(recipe: Path, out_dir: Path) -> dict:
    name = str(recipe.relative_to(REPO / "configs" / "tpu")).removesuffix(".sh")
    run_name = name.replace("/", "_")
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(recipe), "EXECUTABLE=train_compile", f"RUN_NAME={run_name}", f"OUTPUT_PATH={out_dir}"],
        capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    wall = time.perf_counter() - start
    report_file = out_dir / run_name / "compile_report.json"
    row = {"recipe": f"configs/tpu/{name}.sh", "exit_code": proc.returncode, "wall_seconds": round(wall, 1)}
    if not report_file.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {**row, "fits": False, "error": "\n".join(tail)}
    r = json.loads(report_file.read_text())
    return {
        **row, "topology": r["topology"], "num_slices": r["num_slices"], "num_devices": r["num_devices"],
        "mesh": {k: v for k, v in r["mesh"].items() if v > 1}, "global_batch": r["global_batch"],
        "compile_seconds": r["compile_seconds"], "bytes_per_device": r["total_bytes"],
        "state_bytes": r["argument_bytes"], "temp_bytes": r["temp_bytes"], "hbm_bytes": r["hbm_bytes"],
        "assigned_bytes": r.get("allocated_bytes", 0),  # XLA's buffer assignment + program (compile_report.py)
        "budget_bytes": r["budget_bytes"], "gib_per_device": round(r["total_bytes"] / GIB, 2),
        "hbm_gib": round(r["hbm_bytes"] / GIB, 2), "fits": r["fits"],
        "attention_kernel": r.get("attention_kernel", ""), "custom_calls": r.get("custom_calls", {}),
        "tpu_kernels": r.get("tpu_kernels", {}),
        "collectives": r.get("collectives", {}), "pipeline": r.get("pipeline", {}),
    }


def main(argv: list[str]) -> int:
    recipes = chosen_recipes(__doc__, argv)
    read_results(RESULTS, {})  # a file that is not JSON stops the run now, not after the first compile
    rows = []  # this run's: the exit code is theirs, not that of rows kept from earlier runs
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in recipes:
            row = compile_recipe(recipe, Path(tmp))
            rows.append(row)
            _record(row)  # after each recipe: a long run keeps what it has done
            verdict = "fits" if row["fits"] else "DOES NOT FIT" if "error" not in row else "FAILED"
            print(f"{row['recipe']:<40} {verdict:<13} {row.get('gib_per_device', '-'):>7} / "
                  f"{row.get('hbm_gib', '-')} GiB  compile {row.get('compile_seconds', '-')} s", flush=True)
    print(f"wrote {RESULTS}")
    return 0 if all(r["fits"] for r in rows) else 1


def _record(row: dict) -> dict:
    """Merge one row into the results file under a lock (several runs may fill it at once)."""
    import fcntl

    import jax

    with open(Path(tempfile.gettempdir()) / "tessera_aot_recipes.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = read_results(RESULTS, {"rows": []})["rows"]
        rows = {r["recipe"]: r for r in old}
        rows[row["recipe"]] = {**row, "date": time.strftime("%Y-%m-%d")}
        current = {str(p.relative_to(REPO)) for p in (REPO / "configs" / "tpu").glob("*/*.sh")}
        result = {
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs (no TPU)",
            "jax": jax.__version__, "libtpu": _version("libtpu"),
            "rows": [rows[k] for k in sorted(rows) if k in current],  # drop rows of deleted recipes
        }
        write_results(RESULTS, result)
    return result


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:], unfinished=f"the recipes compiled before it are in {RESULTS}"))
