"""Cluster validation suite: run a training job described by a JSON file and check its speed.

    .venv/bin/python -m tessera.tools.validate <file.json> [--nodes host1,host2] [--dry-run]
                                      [--model NAME] [--gpu NAME] [--out DIR] [--timeout SECONDS]

The file format is the one of the JAX training validation files for GPU clusters: `config`
(job, container, NCCL/RCCL and XLA settings, `container_config.env_dict`), and
`model_params.{single_node|multi_node}.<model>.<gpu>` holding train keys, `xla_flags` and
`result_dict` (targets for `tflops_per_sec_per_gpu` and `tokens_per_sec_per_gpu`). Keys that
start with `_` are comments; `{user-id}` becomes the current user; any `<changeme>` left
stops the suite before anything runs. Every key either has a use (a train key, an environment
variable, a mapped meaning) or is listed as ignored, with the reason.

Every node runs train.py with the interpreter that runs this suite (sys.executable): over ssh,
the same path in the same repository folder, so every host needs the repository at the same
path, set up the same way (`bash setup.sh`). While training runs, node 0's progress shows as
a bar on a terminal, else as a line every PROGRESS_SECONDS (`validate_commands` builds the
nodes' commands, `validate_nodes` starts and follows them). See getting_started/Validation.md.

Exit codes: 0 every check passed, 1 a check failed or the training failed, 2 the file is
unusable (placeholders left, bad structure) or the output folder cannot be written, 141 the reader
of stdout went away (`| head`; the nodes are stopped first), 124 the
nodes ran longer than --timeout (they were stopped: SIGTERM, then SIGKILL), 130 Ctrl-C
and 143 SIGTERM (passed on to every node, which saves a checkpoint and stops; their logs say
where; the suite returns once they have exited, its validation.json/.xml saying the run was stopped),
129 SIGHUP (the terminal or ssh session closed; passed on as SIGTERM; under `nohup` it is ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

from tessera.config.schema import all_fields
from tessera.tools.cli import UsageError, resolve_path
from tessera.tools.cli_signals import sigterm_raises
from tessera.tools.validate_file import (METRICS, Plan, build_plan, check_train_keys, gpu_tuning, quantization_line,
                                         tuning_line)
from tessera.tools.validate_json import ValidationInputError, load, select
from tessera.tools.validate_commands import (REPO, container_engine, environment_here, node_commands,
                                             node_setting_lines, with_local_xla_flags)
from tessera.tools.validate_nodes import KILL_AFTER_SECONDS, NodesStopped, NodesTimedOut, run_nodes

EXIT_TIMEOUT = 124  # --timeout stopped the nodes (as GNU timeout's)

# --------------------------------------------------------------------------- checking


def check(plan: Plan, report: dict | None, codes: list[int]) -> list[dict]:
    """One row per check: training exit codes, no skipped step, then each target in result_dict."""
    rows = [{"check": "training finished", "target": "exit code 0 on every node", "measured": str(codes),
             "passed": all(c == 0 for c in codes) and report is not None}]
    skipped = None if report is None else report.get("steps_skipped")
    # on_nonfinite_loss=skip_step: a run whose updates were dropped (non-finite loss or gradient) passed on its speed
    rows.append({"check": "no step skipped", "target": "0 steps skipped",
                 "measured": skipped, "passed": skipped == 0})
    for metric, target in plan.targets.items():
        value = None if report is None else report.get(METRICS[metric])
        rows.append({"check": metric, "target": target, "measured": value,
                     "passed": value is not None and value >= target})
    return rows


def write_results(rows: list[dict], plan: Plan, out_dir: Path, seconds: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "validation.json").write_text(json.dumps(
        {"name": plan.name, "passed": all(r["passed"] for r in rows), "checks": rows, "gpu_tuning": plan.tuning,
         "ignored_keys": plan.ignored}, indent=2) + "\n")
    failures = sum(not r["passed"] for r in rows)
    cases, quote = [], {'"': "&quot;"}  # every value in an attribute: a model or gpu name may hold a quote
    for r in rows:
        message = escape(f"measured {r['measured']}, target {r['target']}", quote)
        body = "" if r["passed"] else f'<failure message="{message}"/>'
        cases.append(f'  <testcase classname="{escape(plan.name, quote)}" name="{escape(r["check"], quote)}">{body}'
                     '</testcase>')
    properties = [f'    <property name="{escape(k, quote)}" value="{escape(v, quote)}"/>'
                  for k, v in plan.tuning.items()]
    (out_dir / "validation.xml").write_text(
        f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name="tessera.validate" tests="{len(rows)}" '
        f'failures="{failures}" time="{seconds:.1f}">\n  <properties>\n' + "\n".join(properties)
        + "\n  </properties>\n" + "\n".join(cases) + "\n</testsuite>\n")


def save_results(rows: list[dict], plan: Plan, out_dir: Path, seconds: float) -> bool:
    """write_results, or (a full disk) a line saying why not, with no half-written file left: an empty
    validation.json and a traceback were all that was left, as if the run had not finished."""
    try:
        write_results(rows, plan, out_dir, seconds)
        return True
    except OSError as e:
        for name in ("validation.json", "validation.xml"):
            try:
                (out_dir / name).unlink(missing_ok=True)
            except OSError:
                pass
        print(f"error: cannot write validation.json/.xml in {out_dir}: {e.strerror or e}; free some space there "
              "or choose another --out", file=sys.stderr)
        return False


def _last_line(log_file: Path) -> str:
    try:
        with log_file.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError as e:
        return f"(cannot be read: {e.strerror or e})"
    return lines[-1].strip() if lines else "(empty)"


def print_table(rows: list[dict]) -> None:
    print(f"{'check':<26} {'target':>28} {'measured':>16}  result")
    for r in rows:
        measured = f"{r['measured']:.3f}" if isinstance(r["measured"], float) else str(r["measured"])
        print(f"{r['check']:<26} {str(r['target']):>28} {measured:>16}  {'PASS' if r['passed'] else 'FAIL'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m tessera.tools.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="the validation JSON file (relative to the working directory)")
    parser.add_argument("--nodes", default="", help="comma-separated hosts reached over ssh; the first is rank 0")
    parser.add_argument("--dry-run", action="store_true", help="print every node's command and environment")
    parser.add_argument("--model", help="which model_params.<mode>.<model> to run (needed when there are several)")
    parser.add_argument("--gpu", help="which model_params.<mode>.<model>.<gpu> to run (needed when there are several)")
    parser.add_argument("--out", help="where validation.json/.xml and node logs go (default: the run's folder)")
    parser.add_argument("--timeout", type=_seconds, default=0.0, metavar="SECONDS",
                        help=f"stop the nodes (SIGTERM, then SIGKILL {KILL_AFTER_SECONDS:g} s later) when they have "
                             f"run this long, and fail with exit code {EXIT_TIMEOUT} (default 0: no limit)")
    return parser.parse_args(argv)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; give one of at least 0, e.g. "
                                         "--timeout 3600 (0: no limit)")
    return seconds


class _Terminated(BaseException):  # like KeyboardInterrupt: no `except Exception` on the way swallows it
    """SIGTERM while no node runs (raised by `sigterm_raises`; run_nodes passes it on to the nodes instead)."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # Ctrl-C or SIGTERM before the nodes start (loading the config, asking docker) was a traceback
        with sigterm_raises(_Terminated):
            return _run(args)
    except (KeyboardInterrupt, _Terminated) as e:
        signum = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        print(f"stopped by {signum.name} (no node was running)", file=sys.stderr)
        return 128 + signum


def _plan_run(args: argparse.Namespace):
    """The hosts, the plan and the run's name from the command line and the validation file; raises
    ValidationInputError or UsageError."""
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]  # "h1, h2": the space is not the host's
    if any(len(n.split()) > 1 for n in nodes):
        raise UsageError(f"--nodes {args.nodes!r}: a host name has no spaces; separate the hosts with commas, "
                         "e.g. --nodes h1,h2")
    if args.nodes.strip() and not nodes or any(n.startswith("-") for n in nodes):  # ssh would read an option
        raise UsageError(f"--nodes {args.nodes!r} names no host; give host names (or user@host) separated by "
                         "commas, e.g. --nodes h1,h2, or leave --nodes out to run here")
    path = resolve_path(args.file, "validation file")
    if args.out and "://" in args.out:  # it became the local folder ./gs:/bucket/..., and the results went there
        raise UsageError(f"--out {args.out}: the suite writes validation.json/.xml and the node logs as local files; "
                         "give a local folder (and copy it to the bucket afterwards)")
    out = resolve_path(args.out, "--out folder", must_exist=False) if args.out else None
    blocker = _in_the_way(out) if out else ""
    if blocker:  # found only when the nodes' log folder was made ("Not a directory"), and never by --dry-run
        raise UsageError(f"--out {args.out}: the results cannot go there: {blocker}; choose another --out")
    data = load(path)
    name, entry = select(data, len(nodes) > 1, args.model, args.gpu)
    plan = build_plan(data, name, entry)
    base = plan.overrides.get("base_output_directory", "")
    if "base_output_directory" in plan.overrides and "://" not in base:  # relative to the working directory, as
        # --out; over ssh the nodes start in the repository, where a relative folder would be another one; `~` is
        # a home, as for train.py, not a folder named ~ here; a bucket (gs://b/logs) is kept: it became /here/gs:/b
        plan.overrides["base_output_directory"] = str(Path(base).expanduser().absolute())
    # the pid: two suites started in the same second (a CI matrix) shared one run folder; one trainer was
    # refused and its suite reported the other's measurements
    run_name = f"validate_{Path(path).stem}_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}"
    check_train_keys(plan, run_name, plan.env if nodes else {**environment_here(), **plan.env})
    return nodes, out, plan, run_name


def _announce(plan: Plan, nodes: list[str]) -> str | None:
    """Prints the keys left out, the node settings replaced, the container engine used and the GPU tuning the run
    uses; returns the engine (None: the nodes run directly)."""
    for key, why in sorted(plan.ignored.items()):
        print(f"ignored {key}: {why}")
    for line in node_setting_lines(plan, nodes):
        print(line)
    engine = container_engine() if plan.container.get("container_image") else None  # no image: none is asked
    if plan.container.get("container_image") and not engine:
        print(f"no container engine answers here: running directly, not in {plan.container['container_image']}")
    if not nodes and not engine:  # the nodes run with this environment under the file's: the tuning line said
        # "xla_python_client_mem_fraction=default (0.75)" where XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 here was used
        plan.tuning = gpu_tuning(plan.overrides, {**os.environ, **with_local_xla_flags(plan.env)})
    print(tuning_line(plan))
    if quantization_line(plan):
        print(quantization_line(plan))
    return engine


def _in_the_way(folder: str) -> str:
    """What keeps local folder `folder` from being made ("<p> is a file, not a folder", a dangling link), or ""."""
    from tessera.checkpointing.storage import in_the_way

    return in_the_way(Path(folder))


def _run(args: argparse.Namespace) -> int:
    try:
        nodes, out, plan, run_name = _plan_run(args)
    except (ValidationInputError, UsageError) as e:
        print(f"{'validation file ' if isinstance(e, ValidationInputError) else ''}error: {e}", file=sys.stderr)
        return 2
    engine = _announce(plan, nodes)
    commands = node_commands(plan, nodes, run_name, engine)
    if args.dry_run:
        for rank, (host, cmd, env) in enumerate(commands):
            print(f"\n# node {rank} ({host})")
            print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())))
            print(shlex.join(cmd))
        return 0
    base = plan.overrides.get("base_output_directory", str(REPO / "outputs"))
    if "://" in base:  # a bucket holds the checkpoints only: report.json is in outputs/ of the trainer's working
        # directory (the repository over ssh and in a container, else this one)
        run_dir = (REPO if nodes or engine else Path.cwd()) / "outputs" / run_name
    else:
        run_dir = Path(base) / run_name
    out_dir = Path(out) if out else run_dir
    start, timed_out = time.time(), None
    try:
        for stale in ("validation.json", "validation.xml"):  # an earlier run's results in --out must not stand
            (out_dir / stale).unlink(missing_ok=True)
        codes = run_nodes(commands, out_dir / "logs",
                          plan.overrides.get("steps", str(all_fields()["steps"][1].default)), args.timeout)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): the nodes were stopped; exit code 141
        raise
    except OSError as e:  # e.g. config.log_dir under a file: found when the log folder is made, before any node starts
        fix = "choose another --out" if out else "set config.log_dir in the file, or give --out"
        why = _in_the_way(str(out_dir / "logs")) or e.strerror or e
        print(f"error: cannot write node logs under {out_dir}: {why}; {fix}", file=sys.stderr)
        return 2
    except NodesStopped as stopped:  # SIGTERM, Ctrl-C or SIGHUP: the nodes were given it and have exited
        rows = check(plan, None, [])  # validation.json/.xml say the run did not finish, for CI dashboards
        rows[0]["measured"] = f"stopped by {stopped}"
        save_results(rows, plan, out_dir, time.time() - start)
        try:
            print(f"stopped by {stopped}: every node has exited; node logs in {out_dir / 'logs'}", file=sys.stderr)
        except OSError:  # SIGHUP: the terminal is gone
            pass
        return 128 + stopped.signum
    except NodesTimedOut as e:  # the nodes were stopped: whatever they measured is not the whole run's
        timed_out, codes = e, e.codes
    return _report(plan, nodes, codes, timed_out, run_dir, out_dir, time.time() - start)


def _report(plan, nodes, codes, timed_out, run_dir: Path, out_dir: Path, seconds: float) -> int:
    """Checks node 0's report.json against the plan, saves and prints the results; the exit code."""
    report_path = run_dir / "report.json"
    try:
        report = json.loads(report_path.read_text()) if report_path.exists() and not timed_out else None
    except (OSError, ValueError) as e:  # e.g. cut short by a full disk: no measurement, the run fails
        print(f"{report_path} cannot be read ({e}): no measurements", file=sys.stderr)
        report = None
    rows = check(plan, report, codes)
    if timed_out:
        rows[0].update(measured=f"{timed_out}, exit codes {codes}", passed=False)
    saved = save_results(rows, plan, out_dir, seconds)
    print(tuning_line(plan))
    print_table(rows)
    if report is None and codes and all(c == 0 for c in codes) and not timed_out:
        if nodes:
            fix = (f"node 0 writes it on {nodes[0]}, where node 0 ran; run the suite on the first host of --nodes, or "
                   "set config.log_dir to a folder all hosts share")
        else:  # "run the suite on the first host of --nodes" for a run without --nodes
            fix = (f"the line 'run <name> -> <folder>' of {out_dir / 'logs' / 'node0.log'} says where node 0 wrote its "
                   "run" + ("; a container must mount config.log_dir at the same path (volume_dict)"
                            if plan.container.get("container_image") else ""))
        print(f"every node exited with code 0 but there is no {report_path} here: {fix}", file=sys.stderr)
    for rank, code in enumerate(codes):
        if code != 0:  # the trainer's last words say why (a config error, a crash, a signal)
            log_file = out_dir / "logs" / f"node{rank}.log"
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            print(f"node {rank} {how}; the end of {log_file}: {_last_line(log_file)}")
    passed = all(r["passed"] for r in rows)
    where = f"results in {out_dir / 'validation.json'} and validation.xml" if saved else "no results written"
    print(f"{'PASS' if passed else 'FAIL'}: {plan.name}{f' ({timed_out})' if timed_out else ''}; {where}")
    return 2 if not saved else EXIT_TIMEOUT if timed_out else 0 if passed else 1


if __name__ == "__main__":
    from tessera.tools.cli import run_printing

    sys.exit(run_printing(main, sys.argv[1:]))  # `--dry-run | head`: exit code 141, not a BrokenPipeError traceback
