"""Every TPU recipe next to the plan's choice for the same model, sequence and batch (no compile).

    .venv/bin/python benchmarks/plan_recipes.py            # writes benchmarks/results/plan_recipes.json
    .venv/bin/python benchmarks/plan_recipes.py v6e v5p/deepseek   # only recipes whose path contains these

For each configs/tpu/*/*.sh the recipe's own training command (its dry run) gives the config.
The recipe's mesh and remat policy are scored as `tessera.tools.plan` scores a candidate
(memory from the estimator, each axis' roofline, the estimated MFU); then the plan searches
every mesh and remat policy at the recipe's tokens per device (a recipe's batch is a training
choice, so it is held fixed). A row says whether the plan's first choice is the recipe's mesh,
and if not, both scores. Estimates only: benchmarks/aot_recipes.py gives the compiler's memory;
each row holds that figure too (`compiled_gib`, from benchmarks/results/aot_recipes.json, and the
date of its compile) and the estimate's error against it, and the run ends with a summary of
those errors: how far the estimator's memory is from the compiler's over every recipe.
A run limited to some recipes replaces their rows and keeps the others' (each row has the date
of the run that made it); the summary covers every row in the file.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench_cli import chosen_recipes, read_results, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
RESULTS = REPO / "benchmarks" / "results" / "plan_recipes.json"
COMPILED = REPO / "benchmarks" / "results" / "aot_recipes.json"
MESH_KEYS = ("parallelism", "per_device_batch_size", "remat_policy", "num_pipeline_repeats", "compile_topology")


def recipe_args(recipe: Path) -> list[str]:
    """The key=value arguments of the recipe's train.py command (its dry run)."""
    out = subprocess.run(["bash", str(recipe), "DRY_RUN=1", "RUN_NAME=plan", "PLATFORM=gke"], capture_output=True,
                         text=True, cwd="/", timeout=60, check=True).stdout
    for line in out.splitlines():
        words = shlex.split(line) if line.strip() and not line.startswith("#") else []
        if len(words) > 2 and words[1] == "train.py":
            return [w for w in words[3:] if "=" in w]
    raise RuntimeError(f"{recipe}: no train.py command in its dry run")


def recipe_config(recipe: Path):
    """(config, hardware) of a recipe: its train.py arguments on its slice(s)."""
    import re

    from tessera.config import load_config
    from tessera.tools.estimate import parse_hardware

    text = recipe.read_text()
    topology = re.search(r"^run_recipe (\S+)", text, re.M).group(1)
    found = re.search(r"^NUM_SLICES=\$\{NUM_SLICES:-(\d+)\}", text, re.M)
    hw = parse_hardware(topology, int(found.group(1)) if found else 1)
    return load_config([str(REPO / "configs" / "base.yml"), *recipe_args(recipe)], env={}), hw


def compare(recipe: Path) -> dict:
    from tessera.tools import plan
    from tessera.tools.plan_report import describe

    cfg, hw = recipe_config(recipe)
    tokens = round(cfg.data.per_device_batch_size * cfg.data.max_target_length)
    own = plan.own_candidates(cfg, hw)
    fitting = [c for c in own.values() if c.fits]
    own_best = max(fitting, key=plan.Candidate.roofline_key) if fitting else None
    best = plan.plan(cfg, hw, tokens)[0]
    mesh = plan.config_mesh(cfg, hw)
    row = {"recipe": str(recipe.relative_to(REPO)), "hardware": hw.name, "slices": hw.num_slices,
           "tokens_per_device": tokens, "recipe_mesh": mesh.describe(), "recipe_remat": cfg.model.remat_policy,
           "plan_mesh": describe(best), "plan_remat": best.remat, "same_mesh": best.mesh.sizes == mesh.sizes,
           "recipe_mesh_best_remat": own_best.remat if own_best else None}
    for name, c in (("recipe", own.get(cfg.model.remat_policy)), ("plan", best), ("recipe_mesh_best", own_best)):
        if c is not None:
            b = c.binding
            row[f"{name}_gib"] = round(c.memory / 2**30, 2)
            row[f"{name}_fits"] = c.fits
            row[f"{name}_mfu"] = round(c.mfu, 4)
            row[f"{name}_binding"] = f"{b.axis} {b.ratio:.2f}x" if b else "none"
    return row


def add_compiled(row: dict, compiled: dict) -> None:
    """The compiler's GiB per chip for the row's recipe (aot_recipes.json) and the estimate's error."""
    found = compiled.get(row["recipe"])
    if found and found.get("gib_per_device") and row.get("recipe_gib"):
        row["compiled_gib"], row["compiled_date"] = found["gib_per_device"], found.get("date")
        row["estimate_error"] = round(row["recipe_gib"] / found["gib_per_device"] - 1, 4)


def error_summary(rows: list[dict]) -> dict:
    """How far the estimated memory is from the compiled one, over the rows that have both."""
    errors = sorted((r["estimate_error"], r["recipe"]) for r in rows if "estimate_error" in r)
    if not errors:
        return {}
    sizes = [abs(e) for e, _ in errors]
    return {"recipes": len(errors), "lowest": errors[0][0], "lowest_recipe": errors[0][1],
            "highest": errors[-1][0], "highest_recipe": errors[-1][1],
            "within_10_percent": sum(x <= 0.10 for x in sizes), "within_15_percent": sum(x <= 0.15 for x in sizes),
            "mean_absolute": round(sum(sizes) / len(sizes), 4)}


def merged_rows(new: list[dict]) -> list[dict]:
    """The results file's rows with this run's in place of theirs; rows of deleted recipes are dropped."""
    old = read_results(RESULTS, {"rows": []})
    rows = {r["recipe"]: {**r, "date": r.get("date", old.get("date"))} for r in old["rows"]}
    rows.update((r["recipe"], r) for r in new)
    current = {str(p.relative_to(REPO)) for p in (REPO / "configs" / "tpu").glob("*/*.sh")}
    return [rows[k] for k in sorted(rows) if k in current]


def main(argv: list[str]) -> int:
    import logging
    import os

    recipes = chosen_recipes(__doc__, argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.basicConfig(level=logging.WARNING)
    compiled = {r["recipe"]: r for r in read_results(COMPILED, {"rows": []})["rows"]}
    read_results(RESULTS, {})  # a file that is not JSON stops the run now, not after it
    rows = []  # this run's; merged into the file's at the end
    for recipe in recipes:
        start = time.perf_counter()
        row = compare(recipe)
        add_compiled(row, compiled)
        rows.append({**row, "date": time.strftime("%Y-%m-%d")})
        print(f"{row['recipe']:<36} recipe {row['recipe_mesh']:<34} {row.get('recipe_gib', '-'):>7} GiB "
              f"{100 * row.get('recipe_mfu', 0):5.1f}% | plan {row['plan_mesh']:<34} {row['plan_remat']:<20} "
              f"{row['plan_gib']:>7} GiB {100 * row['plan_mfu']:5.1f}%  ({time.perf_counter() - start:.1f} s)",
              flush=True)
    rows = merged_rows(rows)
    summary = error_summary(rows)
    if summary:
        print(f"estimated memory against the compiler's ({summary['recipes']} recipes): from "
              f"{100 * summary['lowest']:+.1f}% ({summary['lowest_recipe']}) to {100 * summary['highest']:+.1f}% "
              f"({summary['highest_recipe']}); {summary['within_10_percent']} within 10%, "
              f"{summary['within_15_percent']} within 15%; mean |error| {100 * summary['mean_absolute']:.1f}%")
    write_results(RESULTS, {"date": time.strftime("%Y-%m-%d"), "estimate_vs_compiled": summary, "rows": rows})
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
