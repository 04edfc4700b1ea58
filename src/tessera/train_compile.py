"""Ahead-of-time compile of the real train step for a TPU topology, on any host.

    .venv/bin/python -m tessera.train_compile configs/base.yml compile_topology=v5p-256 [key=value ...]

libtpu (installed from PyPI with requirements.txt) describes the chips of `compile_topology`
without the hardware being present; the trainer's own `setup` and `compile_step` then build
the mesh, shardings and step for those devices and XLA's TPU compiler compiles it. The
compiler's memory analysis, per device, is compared with the chip's HBM: the command exits 0
when the step fits, 3 when it does not (naming the knobs that would make it fit), 2 on a
config error and 130/143 when Ctrl-C/SIGTERM stops it (`tools.cli.sigterm_raises`). `LIBTPU_INIT_ARGS` flags are read by that compiler, so a recipe run with
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

from tessera.config import Config, ConfigError, load_config
from tessera.config.derived import run_dir
from tessera.config.checks import validate_for_build
from tessera.hardware import GIB, TpuSlice, tpu_slice
from tessera.hlo_text import COLLECTIVE_OP, collectives_in_loops, low_precision_dots, tpu_kernels, stage_transfers
from tessera.tools.cli import Heartbeat, UsageError, exit_if_help, help_text, resolve_config_file, sigterm_raises
from tessera.tools.memory_model import logits_bytes

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


@dataclasses.dataclass
class CompileReport:
    """What one AOT compile found, per device (bytes) unless the name says otherwise."""

    topology: str
    num_slices: int
    num_devices: int
    device_kind: str
    mesh: dict
    global_batch: int
    compile_seconds: float
    argument_bytes: int  # train state and batch (inputs of the step)
    output_bytes: int
    alias_bytes: int  # outputs written in place of donated inputs
    temp_bytes: int  # activations and workspace
    code_bytes: int  # the compiled program
    peak_bytes: int  # the compiler's peak of live buffers
    total_bytes: int  # peak + program: what must fit in HBM
    hbm_bytes: int
    budget_bytes: int  # hbm_bytes * compile_hbm_budget_fraction
    compiler_error: str = ""  # the compiler's own out-of-memory message, when it refused to compile
    attention_kernel: str = ""  # the attention kernel compiled into the step (select_attention's choice)
    custom_calls: dict = dataclasses.field(default_factory=dict)  # custom-call target -> count in the program
    tpu_kernels: dict = dataclasses.field(default_factory=dict)  # TPU kernel (gmm, splash_..., ragged-dot-...) -> count
    collectives: dict = dataclasses.field(default_factory=dict)  # collective op (all-reduce, ...) -> count
    pipeline: dict = dataclasses.field(default_factory=dict)  # stages, repeats, microbatches, bubble (if pipelined)
    quantization: str = ""  # quantized training mode ('' off)
    low_precision_dots: dict = dataclasses.field(default_factory=dict)  # operand type (s8, f8e4m3fn, ...) -> dots
    # with eval_interval: the eval step's eval_batch, temp_bytes, output_bytes, code_bytes, total_bytes (beside
    # the train state and the train step's program), compile_seconds, compiler_error
    eval_step: dict = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes and self.eval_fits

    @property
    def eval_fits(self) -> bool:
        return not self.eval_step or self.eval_step["total_bytes"] <= self.budget_bytes

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "fits": self.fits}


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
    in the way shows before writing: a folder at `path`, a file where a folder should be, no write permission.
    Nothing is created. Bucket URLs are not checked."""
    if "://" in path:
        return ""
    target = Path(os.path.abspath(path))
    if target.is_dir():
        return f"{target} is a folder"
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


def compile_for_topology(cfg: Config) -> CompileReport:
    """AOT-compile the train step of `cfg` for cfg.compile.compile_topology; nothing is allocated."""
    from tessera.mesh import sharding_report
    from tessera.step import compile_step, setup

    c = cfg.compile
    if not c.compile_topology:
        raise ConfigError("compile_topology is empty; name the TPU slice to compile for, e.g. compile_topology=v5p-256")
    topology = tpu_slice(c.compile_topology)
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
    log.info("lowering and compiling the train step for %s (%d devices); XLA's TPU compiler can take minutes",
             topology.name, len(devices))
    start = time.perf_counter()
    try:
        with Heartbeat(f"compiling for {topology.name}", HEARTBEAT_SECONDS, emit=log.info):
            compiled, seconds = compile_step(trainer, cfg.run.init_weights_seed)
        if c.compiled_trainstep_file:
            save_compiled(compiled, c.compiled_trainstep_file)
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory verdict is handled
        first_line, temp = _compiler_oom(e, "the train step")
        return _report_compiler_oom(report, trainer, first_line, temp, time.perf_counter() - start)
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
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
    live = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    peak = max(getattr(mem, "peak_memory_in_bytes", 0), live)
    report = dataclasses.replace(
        report, compile_seconds=round(seconds, 2), argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes, code_bytes=mem.generated_code_size_in_bytes, peak_bytes=peak,
        total_bytes=peak + mem.generated_code_size_in_bytes,
    )
    if cfg.data.eval_interval:
        report.eval_step = _compile_eval(trainer, report)
    return report


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
    from tessera.memory_fit import state_bytes

    state = sum(state_bytes(trainer).values())
    total = state + temp if temp else max(state, report.budget_bytes + 1)
    return dataclasses.replace(report, compile_seconds=round(seconds, 2), argument_bytes=state, temp_bytes=temp,
                               peak_bytes=total, total_bytes=total, compiler_error=first_line)


def _bytes_in(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    if not match:
        return 0
    return int(float(match.group(1)) * 1024 ** ("KMGT".index(match.group(2)) + 1))


def memory_table(r: CompileReport) -> str:
    rows = [
        ("train state + batch (arguments)", r.argument_bytes),
        ("activations + workspace (temporaries)", r.temp_bytes),
        ("outputs not written in place", r.output_bytes - r.alias_bytes),
        ("compiled program", r.code_bytes),
        ("total needed (peak live + program)", r.total_bytes),
        (f"HBM of one {r.device_kind} device", r.hbm_bytes),
        ("budget (compile_hbm_budget_fraction)", r.budget_bytes),
    ]
    if r.eval_step:
        rows.append((f"evaluation total (eval batch {r.eval_step['eval_batch']})", r.eval_step["total_bytes"]))
    kernels = ", ".join(f"{t} x{n}" for t, n in r.custom_calls.items()) or "none"
    kernels += "" if not r.tpu_kernels else f" (kernels: {', '.join(f'{k} x{n}' for k, n in r.tpu_kernels.items())})"
    collectives = ", ".join(f"{op} x{n}" for op, n in r.collectives.items()) or "none"
    if r.compiler_error:  # no program came out of the compiler: "none" would claim it had no kernels
        kernels = collectives = "unknown (the compiler stopped before the program was complete)"
    return ("\n".join(f"  {name:<40} {b / GIB:9.2f} GiB" for name, b in rows)
            + f"\n  attention kernel: {r.attention_kernel or 'unknown'}; custom calls in the program: {kernels}"
            + f"\n  collectives in the program: {collectives}"
            + ("" if not r.quantization else
               f"\n  quantization={r.quantization}: low-precision dots in the program: "
               + (", ".join(f"{t} x{n}" for t, n in r.low_precision_dots.items()) or "none"))
            + ("" if not r.pipeline else
               f"\n  pipeline: {r.pipeline['stages']} stages x {r.pipeline['repeats']} repeat(s), "
               f"{r.pipeline['microbatches']} microbatches, bubble {100 * r.pipeline['bubble']:.1f}%"
               + ("" if "stage_transfers" not in r.pipeline else
                  f"; hand-overs between stages overlapping a matmul: {r.pipeline['overlapped_transfers']} of "
                  f"{r.pipeline['stage_transfers']}; collectives inside loops (each runs every iteration): "
                  + (", ".join(f"{op} x{n}" for op, n in r.pipeline["collectives_in_loops"].items()) or "none"))))


def not_fits_message(r: CompileReport, cfg: Config) -> str:
    """Why the step does not fit and which knobs shrink the part that dominates."""
    if r.total_bytes <= r.budget_bytes:  # the train step fits, the eval step does not
        return _eval_not_fits_message(r, cfg)
    m, d, mesh = cfg.model, cfg.data, cfg.mesh
    activations = [
        f"per_device_batch_size (now {d.per_device_batch_size:g}) lower",
        f"gradient_accumulation_steps (now {cfg.optim.gradient_accumulation_steps}) higher, same global batch",
        f"remat_policy (now {m.remat_policy}) to full" if m.remat_policy != "full" else "remat_policy=full (already)",
        f"max_target_length (now {d.max_target_length}) shorter",
    ]
    tokens = d.per_device_batch_size * d.max_target_length / cfg.optim.gradient_accumulation_steps
    logits = logits_bytes(m, tokens)  # a forward pass's, on one device
    if m.num_vocab_tiling == 1 and logits >= 0.05 * r.total_bytes:
        activations.insert(1, f"num_vocab_tiling (now 1) higher: the logits of {tokens:,.0f} tokens x {m.vocab_size:,} "
                              f"take about {logits / GIB:.2f} GiB per device, and tiles compute them a chunk at a time")
    state = [
        f"more chips: a bigger compile_topology (now {r.topology}) or compile_topology_num_slices "
        f"(now {r.num_slices}) with dcn_fsdp_parallelism",
        f"ici_tensor_parallelism (now {mesh.ici_tensor_parallelism}) higher, with ici_fsdp_parallelism=-1",
        f"weight_dtype (now {m.weight_dtype}) bfloat16, halving parameters and optimizer state"
        if m.weight_dtype != "bfloat16" else "weight_dtype=bfloat16 (already)",
    ]
    temp_first = r.temp_bytes >= r.argument_bytes
    first, second = (activations, state) if temp_first else (state, activations)
    over = (r.total_bytes - r.budget_bytes) / GIB
    compiler = f"The TPU compiler stopped with: {r.compiler_error}\n" if r.compiler_error else ""
    return compiler + (
        f"does not fit: the train step needs {r.total_bytes / GIB:.2f} GiB per device on {r.topology}, "
        f"{over:.2f} GiB over the budget of {r.budget_bytes / GIB:.2f} GiB "
        f"({cfg.compile.compile_hbm_budget_fraction:g} of {r.hbm_bytes / GIB:.1f} GiB HBM). "
        f"The larger part is {'activations/workspace' if temp_first else 'the train state'}; turn one of:\n  - "
        + "\n  - ".join(first + second)
    )


def _eval_not_fits_message(r: CompileReport, cfg: Config) -> str:
    """The train step fits, the eval step does not: its knobs."""
    e, d = r.eval_step, cfg.data
    compiler = f"The TPU compiler stopped with: {e['compiler_error']}\n" if e["compiler_error"] else ""
    size = f"now {d.eval_per_device_batch_size:g}" if d.eval_per_device_batch_size else \
        f"now per_device_batch_size, {d.per_device_batch_size:g}"
    knobs = [f"eval_per_device_batch_size ({size}) lower"]
    if cfg.model.num_vocab_tiling == 1:
        knobs.append("num_vocab_tiling higher (the logits in pieces)")
    knobs.append("eval_interval=0 (no evaluation during training)")
    return compiler + (
        f"does not fit: the train step fits ({r.total_bytes / GIB:.2f} GiB per device), but an evaluation needs "
        f"{e['total_bytes'] / GIB:.2f} GiB per device on {r.topology} (the train state and both programs included), "
        f"{(e['total_bytes'] - r.budget_bytes) / GIB:.2f} GiB over the budget of {r.budget_bytes / GIB:.2f} GiB "
        f"(an eval batch of {e['eval_batch']} sequences in one forward pass). Turn one of:\n  - "
        + "\n  - ".join(knobs))


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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        cfg = load_config(resolve_config_file(argv))
        if not cfg.run.run_name:
            cfg.run.run_name = time.strftime("compile_%Y%m%d_%H%M%S")
        from tessera.xla_dump import apply_hlo_dump  # before the backends start: they read XLA_FLAGS then

        apply_hlo_dump(cfg)
        validate_for_build(cfg.model)
        if cfg.run.jax_cache_dir:  # JAX writes programs compiled for a topology but cannot load them back
            log.info("jax_cache_dir is not used here: JAX cannot load a program compiled for a topology back")
        from tessera.checkpointing import check_writable  # the report's folder: checked before compiling

        check_writable(str(run_dir(cfg.run)), "base_output_directory", "the run folder")
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
