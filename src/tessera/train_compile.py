"""Ahead-of-time compile of the real train step for a TPU topology, on any host.

    .venv/bin/python -m tessera.train_compile configs/base.yml compile_topology=v5p-256 [key=value ...]

libtpu (installed from PyPI with requirements.txt) describes the chips of `compile_topology`
without the hardware being present; the trainer's own `setup` and `compile_step` then build
the mesh, shardings and step for those devices and XLA's TPU compiler compiles it. The
compiler's memory analysis, per device, is compared with the chip's HBM: the command exits 0
when the step fits, 3 when it does not (naming the knobs that would make it fit), 2 on a
config error and 130/143 when Ctrl-C/SIGTERM stops it (`tools.cli_signals.sigterm_raises`). `LIBTPU_INIT_ARGS` flags are read by that compiler, so a recipe run with
`EXECUTABLE=train_compile` also checks that libtpu accepts every flag it exports.

A JSON report goes to base_output_directory/run_name/compile_report.json (to the local
outputs/run_name/ when base_output_directory is a gs:// URL, as config.derived.run_dir says).
While XLA compiles (minutes for a large model) a line says every HEARTBEAT_SECONDS how long it
has been running.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from tessera.compile_report import CompileReport, memory_table, not_fits_message
from tessera.config import Config, ConfigError, load_config
from tessera.config.derived import run_dir
from tessera.config.checks import validate_for_build
from tessera.hardware import GIB, TpuSlice, tpu_slice
from tessera.hlo_text import COLLECTIVE_OP, collectives_in_loops, low_precision_dots, tpu_kernels, stage_transfers
from tessera.tools.cli import LOG_FORMAT, LOG_TIME, Heartbeat, UsageError, exit_if_help, help_text, resolve_config_file
from tessera.tools.cli_signals import sigterm_raises

log = logging.getLogger("tessera")

EXIT_DOES_NOT_FIT = 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # Ctrl-C, SIGTERM (128 + the signal's number)
HEARTBEAT_SECONDS = 30.0
_TEMPORARIES = r"HLO temporaries \(([\d.]+)([KMGT])\)"  # in the TPU compiler's out-of-memory message
HELP_KEYS = ("compile_topology", "compile_topology_num_slices", "compile_hbm_budget_fraction", "model_name",
             "per_device_batch_size", "max_target_length", "dtype", "remat_policy", "ici_tensor_parallelism",
             "dcn_fsdp_parallelism")


class CompileStopped(BaseException):
    """SIGTERM arrived while compiling (raised by `sigterm_raises`). Not an Exception: logging swallowed one
    raised while it wrote a line (as it swallows its own errors), and the compile went on."""


def topology_devices(topology: TpuSlice, num_slices: int) -> list:
    """Compile-only devices of `num_slices` slices of `topology` (multi-slice devices carry slice_index)."""
    # libtpu normally learns its topology from the TPU VM's metadata server; on another host
    # these settings describe a single worker, and several compile processes may run at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.name)
    from jax.experimental import topologies

    acc = topology.accelerator
    # v4 and v5p: one device per chip (megacore); TPU7x: one device per chiplet, libtpu's default
    kwargs = {"chip_config_name": "megacore"} if acc.cores_per_chip == 2 and acc.devices_per_chip == 1 else {}
    if num_slices > 1:
        kwargs["num_slices"] = num_slices
    term = signal.getsignal(signal.SIGTERM)
    try:
        desc = topologies.get_topology_desc(topology_name=topology.topology_name, platform="tpu", **kwargs)
    except RuntimeError as e:  # jax's error when libtpu is missing
        raise ConfigError(f"cannot describe TPU topology {topology.name}: {e}. "
                          "Install the dependencies with `bash setup.sh` (requirements.txt brings libtpu)") from None
    finally:  # libtpu, loading, takes SIGTERM for its crash handler (a stack dump); a handler of ours stays
        if callable(term) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, term)
    return list(desc.devices)


def unwritable_file(path: str) -> str:
    """Why a file could not be written at `path` (its missing folders made on the way), or "" when nothing
    in the way shows before writing: a folder at `path`, a file where a folder should be, a symbolic link to
    nothing (as a folder, or as the file when where it points cannot be made), no write permission.
    Nothing is created. Bucket URLs are not checked."""
    if "://" in path:
        return ""
    target = Path(os.path.abspath(path))
    if target.is_dir():
        return f"{target} is a folder"
    dangling = next((p for p in (target, *target.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is not None and (dangling != target or not Path(os.path.realpath(target)).parent.is_dir()):
        return f"{dangling} is a symbolic link to {os.readlink(dangling)}, which does not exist"  # else after compiling
    existing = next(p for p in target.parents if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if target.exists() and not os.access(target, os.W_OK) or not target.exists() and \
            not os.access(existing, os.W_OK | os.X_OK):
        return f"permission denied in {existing}"
    return ""


def check_compiled_file(path: str) -> None:
    """Before compiling: ConfigError when compiled_trainstep_file cannot be written (save_compiled's message)."""
    if "://" in path:  # Path() read gs://b/x as the local folder gs:/b and wrote there, reporting success
        raise ConfigError(f"compiled_trainstep_file={path} is a URL: the compiled step is written to a local file "
                          f"(as MaxText's); give a local path, e.g. compiled_trainstep_file={path.rsplit('/', 1)[-1]}, "
                          "and copy it where it should go (gcloud storage cp)")
    why = unwritable_file(path) if path else ""
    if why:
        raise ConfigError(f"compiled_trainstep_file={path} cannot be written: {why}; choose another path")


def check_report_file(path: Path) -> None:
    """Before compiling: ConfigError when compile_report.json cannot be written (a folder of that name); it was
    found after the compile, minutes on a large topology, and told to free some space."""
    why = unwritable_file(str(path))
    if why:
        raise ConfigError(f"the report {path} cannot be written: {why}; move it away, or choose another run_name")


def save_compiled(compiled, path: str) -> None:
    """The compiled step as MaxText's compiled_trainstep_file holds it: a pickle of
    jax.experimental.serialize_executable.serialize's (payload, in_tree, out_tree), which
    `deserialize_and_load` turns back into an executable on a host with that topology's devices."""
    import pickle

    from jax.experimental.serialize_executable import serialize

    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(pickle.dumps(serialize(compiled)))
    except OSError as e:
        raise ConfigError(f"compiled_trainstep_file={path} cannot be written: {e.strerror or e}; choose another "
                          "path or free some space there") from None
    log.info("compiled step saved to %s (%.1f MiB)", target, target.stat().st_size / 2**20)


def compile_slice(cfg: Config) -> TpuSlice:
    """The TPU slice compile_topology names; ConfigError when it is empty or names none."""
    if not cfg.compile.compile_topology:
        raise ConfigError("compile_topology is empty; name the TPU slice to compile for, e.g. compile_topology=v5p-256")
    return tpu_slice(cfg.compile.compile_topology)


def compile_for_topology(cfg: Config) -> CompileReport:
    """AOT-compile the train step of `cfg` for cfg.compile.compile_topology; nothing is allocated."""
    from tessera.mesh import sharding_report
    from tessera.step import compile_step, setup

    c = cfg.compile
    topology = compile_slice(cfg)
    devices = topology_devices(topology, c.compile_topology_num_slices)
    trainer = setup(cfg, devices)
    _, warnings = sharding_report(trainer.mesh, trainer.state_shardings["params"], trainer.model.param_shapes(),
                                  cfg.mesh.param_replication_warn_mib, logical_axes=trainer.model.logical_axes())
    for w in warnings:
        log.warning(w)
    hbm = topology.accelerator.hbm_bytes
    report = CompileReport(
        topology=topology.name, num_slices=c.compile_topology_num_slices, num_devices=len(devices),
        device_kind=devices[0].device_kind, mesh=dict(trainer.mesh.shape), global_batch=trainer.plan.global_batch,
        compile_seconds=0.0, argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0, code_bytes=0,
        peak_bytes=0, total_bytes=0, hbm_bytes=hbm, budget_bytes=int(hbm * c.compile_hbm_budget_fraction),
        attention_kernel=trainer.model.attention_kernel,
        quantization=cfg.model.quantization,
        pipeline={} if trainer.plan.pipeline is None else {
            **dataclasses.asdict(trainer.plan.pipeline), "bubble": round(trainer.plan.pipeline.bubble, 4)},
    )
    slices = f"{topology.name} x{c.compile_topology_num_slices}" if c.compile_topology_num_slices > 1 else topology.name
    log.info("lowering and compiling the train step for %s (%d devices); XLA's TPU compiler can take minutes",
             slices, len(devices))
    start = time.perf_counter()
    try:
        with Heartbeat(f"compiling for {slices}", HEARTBEAT_SECONDS, emit=log.info):
            compiled, seconds = compile_step(trainer, cfg.run.init_weights_seed)
        if c.compiled_trainstep_file:
            save_compiled(compiled, c.compiled_trainstep_file)
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory verdict is handled
        first_line, temp = _compiler_oom(e, "the train step")
        return _report_compiler_oom(report, trainer, first_line, temp, time.perf_counter() - start)
    mem = compiled.memory_analysis()
    _read_program(report, compiled.as_text())
    live = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    host = host_bytes(mem)
    # the TPU compiler's peak counts the buffers in host memory too (an offloaded optimizer state: llama2-7b on
    # v5p-8, 30.11 GiB = 17.56 on the device + 12.55 of moments on the host): HBM holds the rest
    peak = max(getattr(mem, "peak_memory_in_bytes", 0) - host, live)
    report = dataclasses.replace(
        report, compile_seconds=round(seconds, 2), argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes, code_bytes=mem.generated_code_size_in_bytes, peak_bytes=peak,
        total_bytes=peak + mem.generated_code_size_in_bytes, host_bytes=host,
        allocated_bytes=assigned_bytes(mem),
    )
    if cfg.data.eval_interval:
        report.eval_step = _compile_eval(trainer, report)
    return report


def assigned_bytes(mem) -> int:
    """XLA's buffer assignment in device memory plus the program (0 when the backend does not report it): the
    arguments and the temporaries as the program allocates them, what the TPU compiler holds against HBM when it
    refuses a program for memory."""
    assigned = getattr(mem, "total_allocation_bytes", 0) or 0
    return assigned + mem.generated_code_size_in_bytes if assigned else 0


def host_bytes(mem) -> int:
    """Bytes per device a compiled program keeps in host memory (its host arguments, temporaries and
    outputs not written in place): optimizer_memory_host_offload's moments, offloaded activations."""
    get = lambda name: getattr(mem, name, 0) or 0  # noqa: E731 - absent from some backends' analyses
    return max(0, get("host_argument_size_in_bytes") + get("host_temp_size_in_bytes")
               + get("host_output_size_in_bytes") - get("host_alias_size_in_bytes"))


def _read_program(report: CompileReport, hlo: str) -> None:
    """What the compiled program `hlo` holds, into `report`: its custom calls and TPU kernels, collectives,
    low-precision dots and, when pipelined, the stages' transfers."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    report.custom_calls = {t: targets.count(t) for t in sorted(set(targets))}
    report.tpu_kernels = tpu_kernels(hlo)
    ops = COLLECTIVE_OP.findall(hlo)
    report.collectives = {op: ops.count(op) for op in sorted(set(ops))}
    report.low_precision_dots = low_precision_dots(hlo)
    if report.pipeline:
        transfers, overlapped = stage_transfers(hlo)
        report.pipeline = {**report.pipeline, "stage_transfers": transfers, "overlapped_transfers": overlapped,
                           "collectives_in_loops": collectives_in_loops(hlo)}


def _compile_eval(trainer, report: CompileReport) -> dict:
    """The eval step (eval_interval > 0) compiled for the same devices: what it needs beside the
    train state (the train step's arguments) and the train step's program, both resident when an
    evaluation runs between two steps."""
    from tessera.evaluation import compile_eval_step

    log.info("compiling the eval step (eval batch of %d sequences)", trainer.plan.eval_batch)
    start, beside = time.perf_counter(), report.argument_bytes + report.code_bytes
    out = {"eval_batch": trainer.plan.eval_batch}
    try:
        with Heartbeat(f"compiling the eval step for {report.topology}", HEARTBEAT_SECONDS, emit=log.info):
            mem = compile_eval_step(trainer).memory_analysis()
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory verdict is handled
        first_line, temp = _compiler_oom(e, "the eval step")
        return {**out, "temp_bytes": temp, "output_bytes": 0, "code_bytes": 0, "compiler_error": first_line,
                "total_bytes": max(beside + temp, report.budget_bytes + 1),
                "compile_seconds": round(time.perf_counter() - start, 2)}
    new = mem.temp_size_in_bytes + mem.output_size_in_bytes + mem.generated_code_size_in_bytes
    return {**out, "temp_bytes": mem.temp_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "code_bytes": mem.generated_code_size_in_bytes, "total_bytes": beside + new, "compiler_error": "",
            "compile_seconds": round(time.perf_counter() - start, 2)}


def _compiler_oom(error: Exception, what: str) -> tuple[str, int]:
    """(the first line, the temporaries it names in bytes, 0 if none) of the TPU compiler's refusal
    to compile `what` for lack of HBM; any other error is raised again."""
    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message:
        raise error
    first_line = message.strip().splitlines()[0]
    log.warning("the TPU compiler ran out of HBM for %s: %s", what, first_line)
    return first_line, _bytes_in(_TEMPORARIES, message)


def _report_compiler_oom(report: CompileReport, trainer, first_line: str, temp: int, seconds: float) -> CompileReport:
    """The TPU compiler itself refuses a step that cannot fit; keep what its message tells."""
    from tessera.memory_fit import device_state_bytes

    state = device_state_bytes(trainer)
    total = state + temp if temp else max(state, report.budget_bytes + 1)
    return dataclasses.replace(report, compile_seconds=round(seconds, 2), argument_bytes=state, temp_bytes=temp,
                               peak_bytes=total, total_bytes=total, compiler_error=first_line)


def _bytes_in(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    if not match:
        return 0
    return int(float(match.group(1)) * 1024 ** ("KMGT".index(match.group(2)) + 1))


def compile_help() -> str:
    return help_text(
        ".venv/bin/python -m tessera.train_compile configs/base.yml compile_topology=v5p-256 [key=value ...]",
        "Compile the real train step for a TPU topology on this host (no TPU needed) and compare the\n"
        "compiler's memory per chip with its HBM. Exit 0: fits; 3: does not fit (the message lists the\n"
        "knobs); 2: config error; 130/143: stopped by Ctrl-C/SIGTERM (no report). The report goes to\n"
        "base_output_directory/run_name/compile_report.json (with a gs:// base_output_directory, to\n"
        "outputs/run_name/ under the working directory).",
        keys=HELP_KEYS, docs=("getting_started/AOT_compile.md",))


def main(argv: list[str]) -> int:
    exit_if_help(argv, compile_help)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt=LOG_TIME)
    logging.getLogger("jax").setLevel(logging.WARNING)
    from tessera.platforms import run_settings_restored
    from tessera.tools.cli import config_loads

    try:
        loads = config_loads(resolve_config_file(argv), check=compile_slice)
    except UsageError:  # a config file that is not there: said by _main
        loads = False
    if not loads:  # said before JAX is imported (run_settings_restored imports it: about a second)
        return _main(argv)
    with run_settings_restored():  # dump_hlo's and libtpu's settings end with the compile (a notebook goes on)
        return _main(argv)


def _main(argv: list[str]) -> int:
    try:
        cfg = load_config(resolve_config_file(argv))
        compile_slice(cfg)  # a mistyped slice is said before JAX starts (it took 5 s to get here)
        if not cfg.run.run_name:
            cfg.run.run_name = time.strftime("compile_%Y%m%d_%H%M%S")
        from tessera.xla_dump import apply_hlo_dump  # before the backends start: they read XLA_FLAGS then

        apply_hlo_dump(cfg)
        from tessera.platforms import check_platforms_start

        check_platforms_start()  # JAX_PLATFORMS=tpu (or cuda) on a host without one: one line, not a traceback
        validate_for_build(cfg.model)
        if cfg.run.jax_cache_dir:  # JAX writes programs compiled for a topology but cannot load them back
            log.info("jax_cache_dir is not used here: JAX cannot load a program compiled for a topology back")
        from tessera.checkpointing import check_writable  # the report's folder: checked before compiling

        check_writable(str(run_dir(cfg.run)), "base_output_directory", "the run folder")
        check_report_file(run_dir(cfg.run) / "compile_report.json")
        check_compiled_file(cfg.compile.compiled_trainstep_file)
        with sigterm_raises(CompileStopped):
            report = compile_for_topology(cfg)
    except (ConfigError, UsageError) as e:
        print(f"{'config ' if isinstance(e, ConfigError) else ''}error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, CompileStopped) as e:
        how, code = (("interrupted (Ctrl-C)", EXIT_INTERRUPTED) if isinstance(e, KeyboardInterrupt) else
                     ("stopped by SIGTERM", EXIT_TERMINATED))
        print(f"train_compile: {how} while compiling; no report was written (exit code {code})", file=sys.stderr)
        return code
    out = run_dir(cfg.run) / "compile_report.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.to_json(), indent=2))
    except OSError as e:  # e.g. the disk filled up while XLA compiled
        print(f"error: cannot write {out}: {e.strerror or e}; free some space there and compile again",
              file=sys.stderr)
        return 2
    log.info("compiled for %s x%d (%d devices, mesh %s, global batch %d) in %.1f s; memory per device:\n%s",
             report.topology, report.num_slices, report.num_devices, report.mesh, report.global_batch,
             report.compile_seconds, memory_table(report))
    log.info("report: %s", out)
    if not report.fits:
        print(not_fits_message(report, cfg), file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    log.info("fits: %.2f of %.2f GiB budget%s", report.total_bytes / GIB, report.budget_bytes / GIB,
             f" (an evaluation: {report.eval_step['total_bytes'] / GIB:.2f})" if report.eval_step else "")
    return 0


if __name__ == "__main__":
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    # the compile needs no local TPU: on a host without one, libtpu's probe for chips only printed errors
    use_cpu_on_hosts_without_accelerators()
    sys.exit(main(sys.argv[1:]))
