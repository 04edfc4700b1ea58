"""What one AOT compile found (`train_compile`): the `CompileReport` written to
compile_report.json, its memory table as printed, and, when the step does not fit, the message
naming the knobs that shrink the part that dominates."""

from __future__ import annotations

import dataclasses

from tessera.config import Config
from tessera.hardware import GIB
from tessera.tools.memory_model import logits_bytes


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
    host_bytes: int = 0  # kept in the host's memory, beside the HBM above (offloaded optimizer state, activations)
    # XLA's own buffer assignment in HBM (arguments and temporaries as the program allocates them) + the program, 0
    # when the compiler does not say. The TPU compiler's memory analysis reports more temporaries than it assigns
    # (llama2-7b on v5p-8: 13.19 GiB against 11.23); total_bytes keeps the analysis' sum, the one MaxText prints
    allocated_bytes: int = 0
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
    if r.host_bytes:
        rows.insert(5, ("in host memory (not in the total above)", r.host_bytes))
    if r.allocated_bytes:
        rows.insert(5, ("XLA's buffer assignment + program", r.allocated_bytes))
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
    if cfg.optim.opt_type == "adamw" and not cfg.optim.optimizer_memory_host_offload:
        state.append("optimizer_memory_host_offload=true: AdamW's moments in host memory between steps, streamed "
                     "through HBM a layer at a time (needs scan_layers=true and no pipeline stages)")
    temp_first = r.temp_bytes >= r.argument_bytes
    first, second = (activations, state) if temp_first else (state, activations)
    over = (r.total_bytes - r.budget_bytes) / GIB
    compiler = f"The TPU compiler stopped with: {r.compiler_error}\n" if r.compiler_error else ""
    return compiler + (
        f"does not fit: the train step needs {r.total_bytes / GIB:.2f} GiB per device on {r.topology}, "
        f"{over:.2f} GiB over the budget of {r.budget_bytes / GIB:.2f} GiB "
        f"({cfg.compile.compile_hbm_budget_fraction:g} of {r.hbm_bytes / GIB:.1f} GiB HBM). "
        f"The larger part is {'activations/workspace' if temp_first else 'the train state'}; turn one of:\n  - "
        + "\n  - ".join(first + second) + _assigned_within_budget(r)
    )


def _assigned_within_budget(r: CompileReport) -> str:
    """A line for a step whose total is over the budget while XLA's own buffer assignment is within it."""
    if not r.allocated_bytes or r.allocated_bytes > r.budget_bytes:
        return ""
    return (f"\n(XLA's own buffer assignment for this step is {r.allocated_bytes / GIB:.2f} GiB per device, within "
            f"the budget: the total above sums the compiler's memory analysis, whose temporaries are "
            f"{(r.total_bytes - r.allocated_bytes) / GIB:.2f} GiB larger than what it assigns. Before relying on "
            "the smaller figure, run a step on the slice.)")


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
