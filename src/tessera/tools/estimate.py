"""Size a model and a sharding before compiling anything.

    .venv/bin/python -m tessera.tools.estimate llama3.1-70b per_device_batch_size=2 --hardware v5p-256
    .venv/bin/python -m tessera.tools.estimate my_model.yml ici_tensor_parallelism=4 --hardware v6e-256
    .venv/bin/python -m tessera.tools.estimate 1b global_parameter_scale=128 --hardware h100-64 --mfu 0.4
    .venv/bin/python -m tessera.tools.estimate base_emb_dim=4096 base_num_decoder_layers=32 --hardware v5e-256

With only key=value arguments the model starts from `model_name` among them, else `default`.
Sequences are `max_target_length` tokens long, as in training; the first line of the report
says which length was used and where it came from (the base.yml default is 128, far shorter
than a large model's runs: pass max_target_length=... for real numbers).

Prints total and active parameters, training FLOPs per token (the trainer's own formula),
memory per device for parameters, gradients, optimizer state and activations (per remat policy),
and the roofline checks of the public TPU sizing guide for each parallel axis in use: an axis is worth its
communication when the arithmetic intensity (FLOPs per byte moved) it leaves is above the
hardware's, peak FLOP/s divided by the ICI bandwidth the collective can use:

    FSDP      tokens per device (per micro-batch) x tensor x expert / sparsity     (sparsity = experts / experts
              per token)
    expert    4 x F / expert (on a dense model, which it splits as fsdp: the FSDP figure, without x expert)
    tensor    F / tensor       (F: mlp_dim, or a MoE model's expert width, base_moe_mlp_dim when set)
    sequence  the FSDP figure (weights are split over the sequence axis too) combined with a layer's
              FLOPs per token over the key/value and query bytes it moves (`sequence_intensity`)

An axis split across slices (GPU nodes) is also checked against the data-center network's
intensity (peak / hardware.DCN_BYTES_PER_S), data parallelism included, as tessera.tools.plan scores it.

Memory per device comes from tessera.tools.memory_model, whose docstring says how it
compares with the compiler's figures; `EXECUTABLE=train_compile` gives the exact figure for a
TPU topology.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

from tessera.config import Config, ConfigError, build_config, load_config
from tessera.config.checks import check_trainable_dtypes
from tessera.config.derived import plan_run
from tessera.config.layers import LAYERS_PER_BLOCK, mlp_widths
from tessera.config.loader import read_yaml
from tessera.config.maxtext import ALIASES, translate
from tessera.config.schema import all_fields
from tessera.gpu_tuning import gpu_memory_fraction
from tessera.hardware import GIB, GPUS, TPUS, Accelerator, tpu_slice
from tessera.metrics import training_flops_per_step
from tessera.tools.cli import config_epilog, parse_with_keys
from tessera.tools.memory_model import DTYPE_BYTES, Memory, count_params, estimate_memory, unmodelled_notes
from tessera.tools.rooflines import roofline_lines

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
OPTIMIZER_STATE = {"adamw": "AdamW state (2 moments)", "muon": "Muon momentum + AdamW's", "sgd": "SGD state (none)"}


@dataclasses.dataclass(frozen=True)
class Hardware:
    accelerator: Accelerator
    name: str
    num_devices: int
    num_slices: int
    links: int  # ICI links (one way each) a ring collective uses; 1 for a GPU's NVLink port

    @property
    def intensity(self) -> float:
        """FLOPs per byte of collective traffic at which compute and communication take equal time."""
        return self.accelerator.peak_flops / (self.links * self.accelerator.link_bytes_per_s)


def parse_hardware(text: str, num_slices: int = 1, ici_links: int = 0, slices_flag: str = "--num_slices") -> Hardware:
    """"v6e-256" (a TPU slice type) or "h100-8" (that many GPUs). `slices_flag`: the option that asks for several
    slices, named when a slice type is too large for one."""
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", text.strip().lower())
    if match and match.group(1) in GPUS:
        if int(match.group(2)) < 1:
            raise ConfigError(f"--hardware={text!r} has no GPUs; give the count after the name, e.g. "
                              f"{match.group(1)}-8")
        count = int(match.group(2)) * num_slices
        return Hardware(GPUS[match.group(1)], text, count, num_slices, ici_links or 1)
    try:
        s = tpu_slice(text, key="--hardware")
    except ConfigError as e:
        if match and match.group(1) in (*TPUS, "v5litepod"):  # a TPU generation with a size it does not have
            raise ConfigError(str(e).replace("(compile_topology_num_slices)", f"({slices_flag} <n>)")) from None
        gpus = ", ".join(f"{g}-<count>" for g in GPUS)
        raise ConfigError(f"--hardware={text!r} is neither a TPU slice type (v5p-256, v5e-256, v6e-256, v4-128, "
                          f"tpu7x-16) nor {gpus}") from None
    # s.name: the type as reports print it, however it was typed (" V6E-256" went into a plan's recipe as typed)
    links = ici_links or (4 if s.has_wraparound else 2)
    return Hardware(s.accelerator, s.name, s.devices * num_slices, num_slices, links)


def mesh_sizes(cfg: Config, hw: Hardware) -> dict[str, int]:
    """Size of each mesh axis (ICI x DCN), as the trainer would build it on this hardware."""
    from tessera.mesh import mesh_shape

    ici, dcn = mesh_shape(cfg.mesh, hw.num_devices, hw.num_slices)
    return {axis: ici[axis] * dcn[axis] for axis in ici}


def memory_budget(cfg: Config, hw: Hardware) -> tuple[float, str]:
    """(the share of a device's HBM a run may use, the setting it comes from). TPUs:
    compile_hbm_budget_fraction. GPUs: the share JAX's client takes at start-up and never goes
    past (`gpu_tuning.gpu_memory_fraction`: xla_python_client_mem_fraction, else JAX's 0.75);
    sized against 0.95, a run was said to fit in more memory than JAX would have."""
    if hw.accelerator.torus_dims:
        return cfg.compile.compile_hbm_budget_fraction, "compile_hbm_budget_fraction"
    return gpu_memory_fraction(cfg.gpu, os.environ)


def fused_attention(cfg: Config, hw: Hardware, mesh: dict[str, int] | None = None) -> bool:
    """Whether the trainer would run a fused attention kernel, which keeps no score matrix: its own
    choice (`select_attention`) for this hardware's platform, the sequence length and `mesh`, so
    the estimate and the run cannot disagree (splash on TPUs; cuDNN on GPUs, 16-bit, not for
    soft-capped scores, nor packed documents, nor head sizes above 128 on an A100)."""
    from tessera.config.derived import packs_documents
    from tessera.models.attention_choice import select_attention

    acc = hw.accelerator
    platform = "gpu" if acc.torus_dims == 0 else "tpu"
    return select_attention(cfg.model, platform, cfg.data.max_target_length, mesh, acc.device_kind,
                            acc.compute_capability, packs_documents(cfg.data)).kernel != "dot_product"


def load_model_config(model: str | None, overrides: list[str]) -> Config:
    """A model name from configs/models, or a path to a model YAML file, plus key=value overrides.
    With no model, the `model_name=` among the overrides, else the default model. A model named
    both ways, differently, is a ConfigError (the later one used to win silently)."""
    base = CONFIGS / "base.yml"
    names = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "model_name"]
    overrides = [o for o in overrides if o.partition("=")[0].strip() != "model_name"]
    if model is not None:
        same = {model, Path(model).stem} if model.endswith((".yml", ".yaml")) else {model}
        other = next((n for n in names if n not in same), None)
        if other is not None:
            raise ConfigError(f"the model is named twice: {model} and model_name={other}; give it once (a model "
                              "name or YAML file as the first argument, or model_name=...)")
    elif len(set(names)) > 1:
        raise ConfigError(f"the model is named twice: {' and '.join(f'model_name={n}' for n in names)}; give it once")
    model = model or (names[0] if names else "default")
    is_path = "/" in model  # a model name has no folder
    if not model.endswith((".yml", ".yaml")) and not is_path:
        return load_config([str(base), f"model_name={model}", *overrides], env={})
    path = Path(model)
    if not model.endswith((".yml", ".yaml")):
        near = next((f"; did you mean {p}?" for p in (Path(model + ".yml"), Path(model + ".yaml")) if p.is_file()), "")
        raise ConfigError(f"{model} is a path, but a model file is YAML with a .yml or .yaml name, and a model name "
                          f"(configs/models/<name>.yml) has no folder{near}")
    if path.is_dir():  # "does not exist" sent the user looking for a folder that is there
        raise ConfigError(f"model file {path} is a folder; give a model's YAML file, e.g. configs/models/llama2-7b.yml")
    if not path.is_file():
        raise ConfigError(f"model file {path} does not exist")
    layers = [(str(base), read_yaml(base, "config file")), (str(path), read_yaml(path, "model file")),
              ("the command line", {})]  # the loader's YAML errors
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"argument {item!r} is not of the form key=value")
        layers[-1][1][name] = value
    errors: list[str] = []  # unknown keys, named with the file (or command line) that has them
    flat = {k: v for source, values in layers for k, v in translate(values, source, all_fields(), errors).items()
            if k not in ALIASES}  # renamed already; an alias translate keeps to check the model with is the trainer's
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else f"{len(errors)} problems:\n  " + "\n  ".join(errors))
    named = layers[1][1].get("model_name")
    if named is not None and str(named) != path.stem:  # the trainer refuses such a model file too
        raise ConfigError(f"{path} sets model_name={named!r}, which a model file (a whole model, like configs/models/"
                          f"*.yml) cannot; remove that line, or name that model and give your keys as overrides: "
                          f"{named} key=value ...")
    flat["model_name"] = path.stem
    return build_config(flat)


def sequence_note(cfg: Config, overrides: list[str]) -> str:
    """Which sequence length the estimate uses and where it comes from."""
    length = cfg.data.max_target_length
    names = {o.partition("=")[0].strip() for o in overrides}
    if names & {"max_target_length", *(a for a, (key, _) in ALIASES.items() if key == "max_target_length")}:
        return f"sequence length {length} tokens (max_target_length from the command line)"
    if length != all_fields()["max_target_length"][1].default:
        return f"sequence length {length} tokens (max_target_length of the model config)"
    return (f"sequence length {length} tokens: the max_target_length default of configs/base.yml, not this model's "
            "context; pass max_target_length=<your run's> (e.g. 8192) for the numbers of your run")


def report(cfg: Config, hw: Hardware, mfu: float, sequence: str = "") -> str:
    """The whole estimate as text; `sequence` (see sequence_note) comes first."""
    m, counts = cfg.model, count_params(cfg.model)
    mesh = mesh_sizes(cfg, hw)
    plan = plan_run(cfg, mesh)  # the trainer's own batch, accumulation and pipeline checks: refused as it refuses
    unsplit, example = check_mesh_divides(cfg, mesh)
    fused = fused_attention(cfg, hw, mesh)
    mem = with_copies(cfg, estimate_memory(cfg, counts, mesh, fused), unsplit)
    tokens = cfg.data.max_target_length
    flops_token = training_flops_per_step(m, 1, tokens) / tokens
    hbm = hw.accelerator.hbm_bytes
    lines = [
        sequence or f"sequence length {tokens} tokens (max_target_length)",
        f"model {m.model_name}: {m.num_decoder_layers} layers, emb {m.emb_dim}, {mlp_widths(m)}, heads "
        f"{m.num_query_heads}/{m.num_kv_heads} x {m.head_dim}, vocab {m.vocab_size}"
        + (f", {m.num_experts} experts (top {m.num_experts_per_tok})" if m.num_experts > 1 else ""),
        f"parameters: total {counts.total:.3e}, active {counts.active:.3e}",
        f"training FLOPs per token: {flops_token:.3e} (forward + backward, sequence {tokens})",
        f"hardware: {hw.name} x{hw.num_slices} = {hw.num_devices} x {hw.accelerator.device_kind}, "
        f"{hbm / GIB:.1f} GiB HBM, {hw.accelerator.peak_flops / 1e12:.0f} TFLOP/s bf16",
        f"mesh: {', '.join(f'{k}={v}' for k, v in mesh.items() if v > 1) or 'one device'}; "
        f"global batch {plan.global_batch} sequences"
        + (f" in {plan.micro_batches} accumulation steps" if plan.micro_batches > 1 else ""),
        "",
        "memory per device (GiB):",
        f"  parameters ({m.weight_dtype})      {mem.params / GIB:8.2f}",
        f"  gradients                  {mem.grads / GIB:8.2f}"
        + ("   (and their sum over the accumulation steps)" if cfg.optim.gradient_accumulation_steps > 1 else ""),
        f"  {OPTIMIZER_STATE[cfg.optim.opt_type]:<27}{mem.optimizer / GIB:8.2f}"
        + ("   (optimizer_memory_host_offload: the part in HBM while the update streams it; the rest in host memory)"
           if cfg.optim.optimizer_memory_host_offload else ""),
        (f"  a stage gathered once      {mem.gathered / GIB:8.2f}   (pipeline_fsdp_ag_once; and the logits' "
         "matrix with its gradient)" if mesh["stage"] > 1 and mesh["fsdp"] > 1 and cfg.mesh.pipeline_fsdp_ag_once else
         f"  FSDP-gathered weights      {mem.gathered / GIB:8.2f}   (2 layers in flight and the logits' matrix, "
         "with their gradients)"),
        "  activations by remat_policy" + ("" if fused else " (reference attention: scores kept in memory)"),
    ]
    for policy, value in mem.activations.items():
        mark = "  <- remat_policy" if policy == m.remat_policy else ""
        lines.append(f"    {policy:<24} {value / GIB:8.2f}   total {mem.total(policy) / GIB:8.2f}{mark}")
    fraction, source = memory_budget(cfg, hw)
    fits = mem.total(m.remat_policy) <= hbm * fraction
    lines += [
        f"  -> {'fits' if fits else 'does NOT fit'} in {fraction:g} x {hbm / GIB:.1f} GiB ({source}) with "
        f"remat_policy={m.remat_policy}",
        *(f"  note: {note}" for note in unmodelled_notes(cfg)),
        *([f"  note: {unsplit * DTYPE_BYTES[m.weight_dtype] / GIB:.2f} GiB of the parameters (and their gradients "
           f"and optimizer state) are copied whole over a mesh axis that does not divide them, e.g. {example}"]
          if unsplit else []),
        *eval_note(cfg, hbm),
        "",
        f"roofline (hardware intensity {hw.intensity:,.0f} FLOPs/byte with {hw.links} link(s) per collective):",
    ]
    lines += roofline_lines(cfg, mesh, hw)
    layout = plan.pipeline
    if layout is not None:
        lines += ["", f"pipeline: {layout.describe(LAYERS_PER_BLOCK.get(m.decoder_block, 1))}"]
    if mfu:
        lines += ["", mfu_line(mfu, layout, hw, flops_token)]
    return "\n".join(lines)


def mfu_line(mfu: float, layout, hw: Hardware, flops_token: float) -> str:
    """Tokens/s and TFLOP/s per device at `mfu` (outside the pipeline bubble when `layout` pipelines)."""
    busy = 1.0 - (layout.bubble if layout is not None else 0.0)
    rate = mfu * busy * hw.accelerator.peak_flops / flops_token
    bubble = f" ({mfu:.1%} outside the pipeline bubble x {busy:.3f} busy = {mfu * busy:.1%})" if layout else ""
    return (f"at {f'{mfu * busy:.1%}' if layout else f'{mfu:.0%}'} MFU{bubble}: {rate:,.0f} tokens/s per device, "
            f"{rate * hw.num_devices:,.0f} tokens/s in all, {mfu * busy * hw.accelerator.peak_flops / 1e12:.0f} "
            "TFLOP/s per device")


def eval_note(cfg: Config, hbm: float) -> list[str]:
    """With eval_interval, a line on the eval step, which the memory above leaves out: its float32 logits
    (eval batch per device x length x vocab / num_vocab_tiling), what mostly sizes it. train_compile
    compiles it (an eval batch of 64 sequences of 1024 tokens per v5e chip, vocab 131,072: 32 GiB of
    logits, 33.13 GiB in all)."""
    d, m = cfg.data, cfg.model
    if not d.eval_interval:
        return []
    seqs = d.eval_per_device_batch_size or d.per_device_batch_size
    logits = seqs * d.max_target_length * m.vocab_size * 4 / m.num_vocab_tiling
    warn = ": more than the HBM; lower eval_per_device_batch_size or raise num_vocab_tiling" if logits > hbm else ""
    return [f"  note: the eval step (eval_interval={d.eval_interval}, {seqs:g} sequence{'s' if seqs != 1 else ''} per device in one forward "
            f"pass) is not in these figures; its float32 logits alone take {logits / GIB:.2f} GiB per device{warn} "
            "(EXECUTABLE=train_compile compiles it)"]


def with_copies(cfg: Config, mem: Memory, unsplit: float) -> Memory:
    """`mem` with `unsplit` more parameter elements per device (check_mesh_divides: the weights a mesh axis does
    not divide, copied whole over it), their gradients and optimizer state."""
    w = DTYPE_BYTES[cfg.model.weight_dtype] * unsplit
    if not w:
        return mem
    grow = 1 + w / mem.params
    return dataclasses.replace(mem, params=mem.params + w, grads=mem.grads * grow, optimizer=mem.optimizer * grow)


def param_layout(cfg: Config) -> tuple:
    """The model's parameters as (logical axis names, abstract shapes): nothing allocated, the same for every
    mesh (tessera.tools.plan builds it once per search for check_mesh_divides)."""
    from tessera.models import build_model

    model = build_model(cfg.model)
    return model.logical_axes(), model.param_shapes()


def check_mesh_divides(cfg: Config, mesh: dict[str, int], layout: tuple | None = None) -> tuple[float, str]:
    """The trainer's ConfigError for a mesh axis that does not divide a dimension it must split (query heads,
    MLP width: `tessera.mesh.check_divides`), on the model's parameter shapes (abstract: nothing allocated).
    Returns (parameter elements per device beyond a split over every axis their rules name, the first such
    parameter and why): the trainer copies a weight whole over an axis that does not divide its dimension
    (llama2-70b on 192 chips: the width 8192 over fsdp 192), which the memory model does not see. `layout`:
    param_layout(cfg), when the caller has it already."""
    import math

    import jax

    from tessera.mesh import LOGICAL_RULES, replication_cause, check_divides, logical_spec

    axes, shapes = layout or param_layout(cfg)
    extra, first = [0.0], []

    def visit(path, names, shape):
        check_divides(names, shape.shape, mesh)
        spec = logical_spec(names, shape.shape, mesh)
        ways = math.prod(mesh[a] for axes in spec if axes for a in ((axes,) if isinstance(axes, str) else axes))
        ideal = math.prod(mesh[a] for a in {a for n in names if n for a in LOGICAL_RULES[n]})
        size = math.prod(shape.shape)
        if ways < ideal:
            extra[0] += size / ways - size / ideal
            if not first:
                first.append(f"{jax.tree_util.keystr(path, simple=True, separator='/')} "
                             f"({replication_cause(names, shape.shape, mesh)})")

    jax.tree_util.tree_map_with_path(visit, axes, shapes, is_leaf=lambda x: isinstance(x, tuple))
    return extra[0], first[0] if first else ""


def check_options(args: argparse.Namespace) -> None:
    """ConfigError for option values no hardware has: fewer than one slice or link, an MFU outside (0, 1]."""
    if args.num_slices < 1:
        raise ConfigError(f"--num_slices={args.num_slices}: give at least 1 (the slices joined over DCN)")
    if args.ici_links is not None and args.ici_links < 1:
        raise ConfigError(f"--ici_links={args.ici_links}: give at least 1 (the ICI links a collective uses), "
                          "or leave it out for the slice's own")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu={args.mfu:g}: give a fraction above 0 and at most 1, e.g. --mfu 0.4 for 40%")


def check_topology_keys(cfg: Config, hardware: str, num_slices: int, tool: str = "the estimate",
                        slices_flag: str = "--num_slices") -> None:
    """ConfigError for the config keys that name the hardware, which `tool` takes from --hardware and
    `slices_flag` only: compile_topology, compile_topology_num_slices, num_slices (accepted when they agree)."""
    topology, slices = cfg.compile.compile_topology, cfg.compile.compile_topology_num_slices

    def canonical(name: str) -> str:
        return name.strip().lower().replace("v5litepod-", "v5e-")

    if topology and canonical(topology) != canonical(hardware):
        raise ConfigError(f"compile_topology={topology} is not read by {tool}, which sizes for --hardware "
                          f"{hardware}; pass --hardware {topology} instead")
    for key, value, default in (("compile_topology_num_slices", slices, 1), ("num_slices", cfg.mesh.num_slices, -1)):
        if value not in (default, num_slices):
            raise ConfigError(f"{key}={value} is not read by {tool}, which sizes for {slices_flag} "
                              f"{num_slices}; pass {slices_flag} {value} instead")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog=".venv/bin/python -m tessera.tools.estimate", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config_epilog(("model_name", "per_device_batch_size", "max_target_length", "remat_policy", "dtype",
                              "ici_tensor_parallelism", "ici_expert_parallelism", "global_parameter_scale"),
                             ("getting_started/AOT_compile.md#estimating-first",)))
    p.add_argument("model", nargs="?", help="model name (configs/models/<name>.yml) or path to a model YAML file "
                   "(default: model_name=... among the overrides, else the default model)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (mesh, batch, remat_policy, ...)")
    p.add_argument("--hardware", required=True, help="TPU slice type (v6e-256, v5p-128, ...) or <gpu>-<count> (h100-8)")
    p.add_argument("--num_slices", "--slices", type=int, default=1, help="slices joined over DCN (default 1; "
                   "--slices, as tessera.tools.plan names it, is the same option)")
    p.add_argument("--ici_links", type=int, default=None, help="links per collective, at least 1 (default: 4 on "
                   "slices with wraparound, else 2; 1 on GPUs)")
    p.add_argument("--mfu", type=float, default=None, help="also print the throughput at this MFU, above 0 and at "
                   "most 1 (e.g. 0.4)")
    args = parse_with_keys(p, argv)  # key=value may come before or after the options
    model, overrides = args.model, args.overrides
    if model is not None and "=" in model:  # only key=value arguments: no model named
        model, overrides = None, [model, *overrides]
    try:
        check_options(args)
        cfg = load_model_config(model, overrides)
        check_topology_keys(cfg, args.hardware, args.num_slices)
        hw = parse_hardware(args.hardware, args.num_slices, args.ici_links or 0)
        check_trainable_dtypes(cfg.model, "tpu" if hw.accelerator.torus_dims else "gpu")
        print(report(cfg, hw, args.mfu or 0.0, sequence_note(cfg, overrides)))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from tessera.tools.cli import run_printing

    sys.exit(run_printing(main, sys.argv[1:]))
