"""`tessera.tools.plan --compile`: confirm the plan's best candidates with the TPU compiler.

For each candidate, one at a time: `tessera.train_compile` in a subprocess with the generation's
`configs/tpu/<gen>/flags.inc` (as the recipes run it), its heartbeat lines passed on; the
compiler's memory replaces the estimate and the batch moves to the largest predicted to fit,
which is compiled too (a --tokens-per-device plan keeps its batch). A candidate the compiler
does not fit at any batch falls back to the same mesh with the next remat policy that keeps less (one
that fails otherwise is dropped). The best confirmed candidate becomes a recipe script shaped like
configs/tpu/*/*.sh and a JSON report. TPU only (libtpu compiles for a topology on any host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tessera.config import Config, ConfigError
from tessera.hardware import GIB
from tessera.train_compile import EXIT_DOES_NOT_FIT
from tessera.tools.estimate import CONFIGS, Hardware
from tessera.tools.memory_model import count_params
from tessera.tools.plan import CHOSEN_KEYS, REMAT_POLICIES, Candidate, mesh_candidates, run_args, token_options
from tessera.tools.plan_report import binding_text, describe, table


def model_overrides(model: str | None, overrides: list[str]) -> list[str]:
    """The model as train_compile's key=value arguments: model_name=..., or a model file's keys."""
    if model is None:
        return list(overrides)
    if not model.endswith((".yml", ".yaml")):
        return [f"model_name={model}", *overrides]
    import yaml

    keys = yaml.safe_load(Path(model).read_text()) or {}
    return [f"{k}={override_text(v)}" for k, v in keys.items() if k != "model_name"] + list(overrides)


def override_text(value) -> str:
    """A YAML value as the loader reads it back from key=value: true/false, a list as ["a","b"], null as empty
    (Python's str gave True and ['a', 'b'], which a recipe's shell split in two)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return "" if value is None else str(value)


def libtpu_flags(generation: str) -> str:
    """LIBTPU_INIT_ARGS of configs/tpu/<generation>/flags.inc, as the recipes export them."""
    inc = CONFIGS / "tpu" / generation / "flags.inc"
    if not inc.is_file():
        return ""
    out = subprocess.run(["bash", "-c", f'source "{inc}" && echo "$LIBTPU_INIT_ARGS"'], capture_output=True, text=True)
    return " ".join(out.stdout.split())


def aot_compile(base: list[str], c: Candidate, cfg: Config, hw: Hardware, out_dir: Path, label: str) -> dict:
    """One train_compile subprocess (its progress lines passed on); its compile report, {} if it failed."""
    # one run folder per compile: a fallback policy's compile that fails must not find the report of the one before
    name = f"plan_{abs(hash((label, c.per_device_batch, c.remat, c.repeats, c.mesh.describe()))) % 10**8}"
    cmd = [sys.executable, "-m", "tessera.train_compile", str(CONFIGS / "base.yml"), *base, *run_args(c, cfg),
           f"compile_topology={hw.name}", f"compile_topology_num_slices={hw.num_slices}", f"run_name={name}",
           f"base_output_directory={out_dir}"]
    # the caller's LIBTPU_INIT_ARGS after the recipe's, as run_recipe.sh puts them (they replaced them here)
    flags = " ".join((libtpu_flags(hw.accelerator.name) + " " + os.environ.get("LIBTPU_INIT_ARGS", "")).split())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "LIBTPU_INIT_ARGS": flags,
           "PYTHONPATH": os.pathsep.join(p for p in (str(CONFIGS.parent / "src"), os.environ.get("PYTHONPATH")) if p)}
    print(f"compiling {label}: {describe(c)}, {c.remat}, per_device_batch_size={c.per_device_batch:g}", flush=True)
    start, tail = time.monotonic(), []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        try:
            for line in proc.stdout:
                tail = (tail + [line.rstrip()])[-5:]
                if "elapsed" in line or "error" in line.lower():
                    print("  " + line.rstrip(), flush=True)
        except BaseException:  # Ctrl-C or SIGTERM: the compiler must not go on alone for minutes
            proc.kill()
            raise
    report = out_dir / name / "compile_report.json"
    if proc.returncode not in (0, EXIT_DOES_NOT_FIT) or not report.is_file():
        print("  failed:\n    " + "\n    ".join(tail), flush=True)
        return {}
    r = json.loads(report.read_text())
    evaluation = r.get("eval_step") or {}  # with eval_interval: `fits` is the eval step's verdict too
    evaluation = f", an evaluation {evaluation['total_bytes'] / GIB:.2f}" if evaluation else ""
    print(f"  {r['total_bytes'] / GIB:.2f} GiB per chip{evaluation} ({'fits' if r['fits'] else 'does NOT fit'} in "
          f"{r['budget_bytes'] / GIB:.1f}), {time.monotonic() - start:.0f} s", flush=True)
    return r


def heavier_policies(c: Candidate) -> list[str]:
    """The remat policies that keep less than c's, nearest first (the fallback when c does not fit)."""
    return list(REMAT_POLICIES[:REMAT_POLICIES.index(c.remat)])[::-1]


def confirm(base, c: Candidate, cfg: Config, hw: Hardware, out_dir: Path, label: str,
            move_batch: bool) -> Candidate | None:
    """c confirmed by the compiler (its batch moved when `move_batch`); when the compiler says it does not fit,
    the same mesh and batch with the next remat policy that keeps less, until one fits. A compile that failed
    otherwise (a crash, a refused config) ends the candidate: a heavier policy would not mend it."""
    for policy in [c.remat, *heavier_policies(c)]:
        if policy != c.remat:
            same = [x for x in mesh_candidates(cfg, count_params(cfg.model), hw, c.mesh, [c.tokens_per_device],
                                               [c.repeats]) if x.remat == policy]
            if not same:
                continue
            print(f"  trying remat_policy={policy} on the same mesh", flush=True)
            c = dataclasses.replace(same[0], budget=c.budget)
        try:
            done = fit_batch(base, c, cfg, hw, out_dir, label, move_batch)
        except CompileFailed:
            print("  not trying heavier remat policies: this compile failed for a reason other than memory (above)",
                  flush=True)
            return None
        if done:
            return done
    return None


class CompileFailed(Exception):
    """train_compile failed for a reason other than memory (`fit_batch`'s first compile of a candidate)."""


def fit_batch(base, c: Candidate, cfg: Config, hw: Hardware, out_dir: Path, label: str,
              move_batch: bool = True) -> Candidate | None:
    """c with the compiler's memory, its batch moved to the largest that fits (unless `move_batch` is false: a
    --tokens-per-device plan keeps its batch): the compiler's temporaries are scaled with the batch to predict
    it, then that batch is compiled (and one step down if it does not fit). CompileFailed when the compile of c
    itself failed for another reason than memory."""
    r = aot_compile(base, c, cfg, hw, out_dir, label)
    if not r:
        raise CompileFailed
    if not move_batch:
        return dataclasses.replace(c, memory=r["total_bytes"], compiled=True) if r["fits"] else None
    budget = r["budget_bytes"]
    options = token_options(cfg, hw, 0)
    fixed = r["total_bytes"] - r["temp_bytes"]
    fits = [t for t in options if fixed + r["temp_bytes"] * t / c.tokens_per_device <= budget
            and eval_bytes(r, cfg, t / c.tokens_per_device) <= budget]
    if not r["fits"]:  # only down from a batch that does not fit: up again, it went round in circles
        fits = [t for t in fits if t < c.tokens_per_device]
    target = max(fits, default=options[0])
    if target != c.tokens_per_device:
        moved = rescore(cfg, hw, c, target)
        r2 = aot_compile(base, moved, cfg, hw, out_dir, label + " (batch moved)") if moved else {}
        if r2 and r2["fits"]:
            return dataclasses.replace(moved, memory=r2["total_bytes"], compiled=True)
        if not r["fits"] and options.index(target) > 0:
            smaller = rescore(cfg, hw, c, options[options.index(target) - 1])
            return fit_batch(base, smaller, cfg, hw, out_dir, label) if smaller else None
    return dataclasses.replace(c, memory=r["total_bytes"], compiled=True) if r["fits"] else None


def eval_bytes(r: dict, cfg: Config, scale: float) -> float:
    """The eval step's total in compile report `r` (0 without one) at `scale` times the train batch: its own
    temporaries and outputs grow with it unless eval_per_device_batch_size fixes the eval batch."""
    e = r.get("eval_step") or {}
    if not e:
        return 0.0
    grows = 0 if cfg.data.eval_per_device_batch_size else e["temp_bytes"] + e["output_bytes"]
    return e["total_bytes"] + grows * (scale - 1)


def rescore(cfg: Config, hw: Hardware, c: Candidate, tokens: int) -> Candidate | None:
    """The candidate's mesh and remat at another batch (None when that batch does not split over the mesh)."""
    found = mesh_candidates(cfg, count_params(cfg.model), hw, c.mesh, [tokens])
    same = [x for x in found if x.repeats == c.repeats and x.remat == c.remat]
    return dataclasses.replace(same[0], budget=c.budget) if same else None


def _sourced(recipe: Path, target: Path) -> str:
    """How `recipe` names `target` to source it: relative to the recipe's own folder when both are in
    this repository (a moved or fresh clone keeps working), else by its absolute path."""
    repo = CONFIGS.parent
    recipe = recipe.absolute()
    if recipe.is_relative_to(repo):
        return f'"$(dirname "${{BASH_SOURCE[0]}}")/{os.path.relpath(target, recipe.parent)}"'
    return f'"{target}"'


def write_recipe(path: Path, c: Candidate, cfg: Config, hw: Hardware, base: list[str]) -> None:
    gen = hw.accelerator.name
    flags = CONFIGS / "tpu" / gen / "flags.inc"
    chosen = [*run_args(c, cfg), f"dtype={cfg.model.dtype}"]
    base = [b for b in base if b.partition("=")[0] not in {k.partition("=")[0] for k in chosen}]
    # a short run, unless the plan's command line set its length (after it, steps=100 replaced the user's steps=)
    given = {b.partition("=")[0] for b in base}
    short_run = [k for k in ("steps=100", "log_period=10") if k.partition("=")[0] not in given]
    lines = [
        "#!/usr/bin/env bash",
        f"# Recipe written by tessera.tools.plan: {cfg.model.model_name} on {hw.name} x{hw.num_slices}.",
        f"# Mesh {describe(c)}, remat {c.remat}, {c.tokens_per_device:,} tokens per device; "
        f"the TPU compiler's memory: {c.memory / GIB:.2f} GiB per chip; estimated MFU {c.mfu:.1%}.",
        f"#   bash {path.relative_to(CONFIGS.parent) if path.is_relative_to(CONFIGS.parent) else path} "
        "RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke",
        "# Settings (KEY=VALUE) are described in configs/run_recipe.sh.",
        '[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash',
        "set -e",
        # before run_recipe.sh, which sets NUM_SLICES=1 when it is unset: after it, this line changed nothing
        f"NUM_SLICES=${{NUM_SLICES:-{hw.num_slices}}}  # the recipe's slice count (EXECUTABLE=train_compile compiles "
        "for it)" if hw.num_slices > 1 else None,
        f'source {_sourced(path, CONFIGS / "run_recipe.sh")} "$@"',
        "",
        f'source {_sourced(path, flags)}   # LIBTPU_INIT_ARGS of every {gen} recipe' if flags.is_file() else
        # tpu7x has no recipes yet: sourcing the missing file stopped the recipe at its first line (set -e)
        f"# no configs/tpu/{gen}/flags.inc: libtpu's default flags (the plan compiled with them)",
        "",
        f"run_recipe {hw.name} \\",
        "  " + shlex.join(base) + " \\",
        "  " + shlex.join(chosen) + (" \\" if short_run else ""),
        "  " + " ".join(short_run) if short_run else None,
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(line for line in lines if line is not None) + "\n")
    path.chmod(0o755)


def recipe_path(cfg: Config, hw: Hardware, output: str) -> Path:
    """The recipe --compile writes: --output, else configs/tpu/<gen>/plan_<model>.sh."""
    name = re.sub(r"[^a-z0-9_.]+", "_", cfg.model.model_name.lower())
    return Path(output) if output else CONFIGS / "tpu" / hw.accelerator.name / f"plan_{name}.sh"


def check_output(cfg: Config, hw: Hardware, output: str) -> None:
    """Before any compile: ConfigError when the recipe or its JSON report could not be written."""
    from tessera.config.paths import too_long_name
    from tessera.train_compile import unwritable_file

    if "://" in output or output[:5].lower() == "file:":  # Path() made gs://b/x.sh the local file ./gs:/b/x.sh
        raise ConfigError(f"--output={output} is a URL: the recipe and its JSON report are written to local files; "
                          f"give a local path, e.g. --output {output.rstrip('/').rsplit('/', 1)[-1] or 'plan.sh'}, "
                          "and copy them where they should go")
    if too_long_name(os.path.abspath(output)):  # Path.exists raised OSError "File name too long"
        raise ConfigError(f"--output={too_long_name(os.path.abspath(output))}; use a shorter name")
    recipe = recipe_path(cfg, hw, output)
    if recipe.suffix == ".json":  # the report goes to <recipe>.json: it would replace the recipe
        raise ConfigError(f"--output={recipe} names the recipe, a bash script, and its JSON report goes beside "
                          f"it as {recipe.with_suffix('.json').name}; give the recipe a .sh name")
    for path in (recipe, recipe.with_suffix(".json")):  # a shipped recipe or the user's file is never replaced
        if path.exists() or path.is_symlink():
            raise ConfigError(f"{path} already exists and --compile would replace it; move it away or choose "
                              "another --output")
    why = unwritable_file(str(recipe)) or unwritable_file(str(recipe.with_suffix(".json")))
    if why:
        raise ConfigError(f"--output={recipe} cannot be written: {why}; choose another --output")


class CompileStopped(Exception):
    """SIGTERM arrived while --compile compiled (raised by `sigterm_raises`)."""


def compile_top(cfg: Config, hw: Hardware, cands: list[Candidate], args) -> int:
    """--compile: one AOT compile at a time of each candidate, then the recipe and the JSON report
    (TPU hardware only: `plan.main` refuses --compile for GPUs before the search). Ctrl-C or SIGTERM
    while compiling stops the compiler and returns 130 or 143, with one line and nothing written."""
    from tessera.tools.cli_signals import sigterm_raises

    # the keys the plan chooses are its candidates' (a user's ici_tensor_parallelism=4 would change the compiled mesh)
    base = [o for o in model_overrides(args.model, args.overrides) if o.partition("=")[0].strip() not in CHOSEN_KEYS]
    confirmed = []
    try:
        with sigterm_raises(CompileStopped), tempfile.TemporaryDirectory() as tmp:
            for i, c in enumerate(cands, 1):
                done = confirm(base, c, cfg, hw, Path(tmp), f"{i}/{len(cands)}",
                               move_batch=not args.tokens_per_device)
                if done:
                    confirmed.append(done)
    except (KeyboardInterrupt, CompileStopped) as e:
        how, code = ("interrupted (Ctrl-C)", 130) if isinstance(e, KeyboardInterrupt) else ("stopped by SIGTERM", 143)
        print(f"plan: {how} while compiling; the compiler was stopped and no recipe was written", file=sys.stderr)
        return code
    if not confirmed:
        raise ConfigError("the compiler fits none of the top candidates; see the messages above")
    confirmed.sort(key=Candidate.rank_key, reverse=True)
    print("\nconfirmed by the TPU compiler (* = compiler's memory):\n" + table(confirmed))
    recipe = recipe_path(cfg, hw, args.output)
    report = recipe.with_suffix(".json")
    try:  # checked before compiling, but the folder can go, or the disk fill, in the minutes since
        write_recipe(recipe.resolve(), confirmed[0], cfg, hw, base)
        write_report(report, confirmed, hw, base)
    except OSError as e:
        for path in (recipe, report):  # neither existed (check_output): no half of the pair is left behind
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {e.filename or recipe}: {e.strerror or e}; the confirmed candidates are in "
                          "the table above: free some space or choose another --output, and plan again") from None
    print(f"wrote {recipe} and {report}")
    return 0


def write_report(report: Path, confirmed: list[Candidate], hw: Hardware, base: list[str]) -> None:
    report.write_text(json.dumps({"model": base, "hardware": hw.name, "slices": hw.num_slices, "candidates": [
        {"mesh": x.mesh.keys(), "repeats": x.repeats, "remat": x.remat, "per_device_batch_size": x.per_device_batch,
         "tokens_per_device": x.tokens_per_device, "gib_per_chip": round(x.memory / GIB, 2),
         "binding": binding_text(x), "mfu_estimate": round(x.mfu, 4)} for x in confirmed]}, indent=2) + "\n")
