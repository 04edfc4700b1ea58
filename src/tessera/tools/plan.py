"""From a model and a slice to the mesh, remat policy and batch that should train it fastest.

    .venv/bin/python -m tessera.tools.plan llama3.1-8b max_target_length=2048 --hardware v6e-256
    .venv/bin/python -m tessera.tools.plan my_model.yml weight_dtype=bfloat16 --hardware v6e-256 --slices 16 \
        --tokens-per-device 2048
    .venv/bin/python -m tessera.tools.plan llama3.1-70b max_target_length=4096 --hardware h100-64
    .venv/bin/python -m tessera.tools.plan llama3.1-8b max_target_length=2048 --hardware v6e-256 --top 2 --compile

Enumerates meshes (data, fsdp, sequence, tensor, expert and pipeline ways inside a slice; data,
fsdp and pipeline ways across slices), remat policies and per-device batches, scores each with the
estimator (tessera.tools.estimate) and prints the best `--top` of them, ranked, with one or two
sentences on the winner. `--compile` then AOT-compiles those on the real TPU topology, one at a
time, moves each one's batch to the largest the compiler fits, and writes a recipe script and a
JSON report (TPU only).

Enumeration keeps only sizes that split the model evenly: tensor ways divide the query heads,
the kv heads, mlp_dim (when a layer has it) and the expert width; expert ways divide
num_experts; fsdp x sequence x expert ways divide emb_dim; pipeline stages satisfy the
trainer's own pipeline layout (`derived.pipeline_layout`), and the global batch splits over data x fsdp x expert
(`derived.global_batch`). Tensor, expert and sequence ways stay inside a slice (their
collectives run at every layer). Sequence ways are tried on TPUs where splash attention serves
the split load-balanced (`sequence_ways`): they let a long sequence spread over devices without
tensor parallelism's per-layer all-reduces, and a global batch of fewer sequences than the
batch axes' devices. Pipelines are tried as GPipe and as circular with one layer per group.

Memory per chip is the estimator's (`estimate_memory`).

How each candidate is scored (each axis' roofline against its link, and the MFU estimate
that ranks them) is tessera.tools.plan_model's docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from tessera.config import Config, ConfigError
from tessera.config.checks import check_trainable_dtypes, validate_for_build
from tessera.config.derived import global_batch, pipeline_layout
from tessera.config.maxtext import ALIASES
from tessera.config.schema import all_fields
from tessera.tools.cli import config_epilog, parse_with_keys
from tessera.tools.estimate import (Hardware, check_mesh_divides, check_topology_keys, fused_attention,
                                   load_model_config, memory_budget, mesh_sizes, parse_hardware, sequence_note,
                                   with_copies)
from tessera.tools.memory_model import ParamCounts, count_params, estimate_memory
from tessera.tools.plan_meshes import DCN_AXES, ICI_AXES, KEY, Mesh, gpu_split, meshes
from tessera.tools.plan_model import REMAT_POLICIES, Axis, ModelTerms, estimate_mfu, score_axes

MAX_GLOBAL_TOKENS = 2**24  # 16.8M tokens per step: the largest global batch tried without --tokens-per-device
# the keys the plan chooses (mesh_config, run_args): given on the command line they are replaced, and said so
_CHOSEN = {"per_device_batch_size", "remat_policy", "num_pipeline_repeats", "num_layers_per_pipeline_stage",
           "ici_fsdp_transpose_parallelism", "dcn_fsdp_transpose_parallelism",
           *(f"{kind}_{KEY[a]}_parallelism" for kind in ("ici", "dcn") for a in ICI_AXES)}
# with their other spellings (tensor_parallelism, ici_context_parallelism, ...): kept, they reached train_compile
# beside the plan's own key, which the loader refused as a disagreement, and every candidate failed to compile
CHOSEN_KEYS = frozenset({*_CHOSEN, *(alias for alias, (key, _) in ALIASES.items() if key in _CHOSEN)})


# --------------------------------------------------------------------------- candidates


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    repeats: int  # pipeline repeats (1: GPipe)
    remat: str
    per_device_batch: float  # sequences per device (per_device_batch_size)
    tokens_per_device: int
    memory: float  # bytes per chip
    budget: float  # bytes per chip the step may use
    axes: tuple[Axis, ...]
    bubble: float
    mfu: float
    compiled: bool = False  # memory is the compiler's, not the estimate

    @property
    def fits(self) -> bool:
        return self.memory <= self.budget

    @property
    def binding(self) -> Axis | None:
        return min(self.axes, key=lambda a: a.ratio) if self.axes else None

    def rank_key(self) -> tuple:
        return (self.fits, *self.roofline_key())

    def roofline_key(self) -> tuple:
        """Estimated MFU to half a point (the model is not finer than that: closer estimates tie), then fewer
        pipeline stages, headroom above the roofline, more tokens per device, less memory."""
        headroom = min(self.binding.ratio, 1e6) if self.binding else 1e6
        return (round(self.mfu * 200), -self.mesh.sizes["stage"], round(headroom, 3), self.tokens_per_device,
                -self.memory)

    def tokens_needed(self) -> int:
        """Tokens per device at which the binding axis reaches its roofline, when it is fsdp or data (their
        intensity grows with the batch); 0 otherwise."""
        b = self.binding
        return math.ceil(self.tokens_per_device / b.ratio) if b and b.axis in ("fsdp", "data") else 0


def mesh_config(cfg: Config, mesh: Mesh, repeats: int, per_device_batch: float) -> Config:
    """`cfg` with this mesh and batch (the sections are copied, `cfg` is left as it was)."""
    sizes = {**{f"ici_{KEY[a]}_parallelism": mesh.ici.get(a, 1) for a in ICI_AXES},
             **{f"dcn_{KEY[a]}_parallelism": mesh.dcn.get(a, 1) for a in ICI_AXES}}
    if mesh.gpu:
        sizes = {**{k: 1 for k in sizes}, **{f"ici_{KEY[a]}_parallelism": mesh.sizes[a] for a in ICI_AXES}}
    return dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, ici_fsdp_transpose_parallelism=1, dcn_fsdp_transpose_parallelism=1,
                                      num_pipeline_repeats=repeats, num_layers_per_pipeline_stage=-1, **sizes),
        data=dataclasses.replace(cfg.data, per_device_batch_size=per_device_batch))


# --------------------------------------------------------------------------- search


def token_options(cfg: Config, hw: Hardware, tokens_per_device: int) -> list[int]:
    """Tokens per device to try, ascending: the one asked for, else powers of two times the sequence
    length from 1/128 of a sequence up to MAX_GLOBAL_TOKENS over all devices. With num_vocab_tiling, only
    those whose forward pass (a micro-batch with gradient_accumulation_steps) the tiles divide, as the
    trainer requires."""
    steps, tiles = cfg.optim.gradient_accumulation_steps, cfg.model.num_vocab_tiling
    unit = steps * tiles if tiles > 1 else 1
    if tokens_per_device:
        if tokens_per_device % unit:
            raise ConfigError(f"--tokens-per-device {tokens_per_device} / gradient_accumulation_steps={steps} is not "
                              f"a whole number of tokens that num_vocab_tiling={tiles} divides, as the trainer "
                              f"requires; give a multiple of {unit}")
        return [tokens_per_device]
    length = cfg.data.max_target_length
    most = max(MAX_GLOBAL_TOKENS // hw.num_devices, length)
    sizes = (length * 2**i for i in range(-7, 8))
    return [int(t) for t in sizes if 1 <= t <= most and t == int(t) and int(t) % unit == 0]


def pipeline_repeats(cfg: Config, stages: int) -> list[int]:
    """GPipe (1 repeat) and circular with one block per group."""
    return [1] if stages == 1 else sorted({1, max(1, cfg.model.num_decoder_layers // stages)})


def layout_or_none(cfg: Config, mesh: Mesh):
    """(pipeline layout or None) when this batch and mesh are valid for the trainer, else raises ConfigError.
    With gradient accumulation the pipeline cuts each micro-batch (global batch / steps), as the trainer does."""
    steps = cfg.optim.gradient_accumulation_steps
    rows = global_batch(cfg.data.per_device_batch_size, steps, mesh.sizes) // steps
    return pipeline_layout(cfg, mesh.sizes, rows)


def mesh_candidates(cfg: Config, counts: ParamCounts, hw: Hardware, mesh: Mesh, tokens: list[int],
                    repeats_tried: list[int] | None = None, terms: ModelTerms | None = None) -> list[Candidate]:
    """Per remat policy and pipeline schedule (`pipeline_repeats` unless given): the largest batch that fits (else
    the smallest tried). `terms`: ModelTerms.of(cfg), when the caller has it already."""
    terms = terms or ModelTerms.of(cfg)
    if cfg.optim.optimizer_memory_host_offload and mesh.sizes["stage"] > 1:
        return []  # the trainer refuses the moments' offload on a pipeline mesh
    fused, executed = fused_attention(cfg, hw, mesh.sizes), terms.executed
    try:  # a weight whose dimension the mesh does not divide is copied whole (a vocabulary of 32001 over tensor 4)
        unsplit = check_mesh_divides(cfg, mesh.sizes, terms.params)[0] if terms.params else 0.0
    except ConfigError:  # the trainer refuses this mesh
        return []
    budget = hw.accelerator.hbm_bytes * memory_budget(cfg, hw)[0]
    found: dict[tuple[int, str], Candidate] = {}
    for repeats in repeats_tried or pipeline_repeats(cfg, mesh.sizes["stage"]):
        for t in tokens:
            c = mesh_config(cfg, mesh, repeats, t / cfg.data.max_target_length)
            try:
                layout = layout_or_none(c, mesh)
            except ConfigError:
                continue
            mem, axes = with_copies(c, estimate_memory(c, counts, mesh.sizes, fused), unsplit), score_axes(c, mesh, hw)
            bubble = layout.bubble if layout else 0.0
            for policy in REMAT_POLICIES:
                cand = Candidate(mesh, repeats, policy, c.data.per_device_batch_size, t, mem.total(policy), budget,
                                 axes, bubble, estimate_mfu(axes, bubble, terms.recomputed[policy], executed))
                if cand.fits or (repeats, policy) not in found:
                    found[(repeats, policy)] = cand
    return list(found.values())


def config_mesh(cfg: Config, hw: Hardware) -> Mesh:
    """The mesh `cfg` asks for on `hw` (-1 entries filled in as tessera.mesh fills them: dcn_data_parallelism=-1,
    the default, is the slice count, which was counted inside the slice)."""
    from tessera.mesh import mesh_shape

    if hw.accelerator.torus_dims == 0:
        return gpu_split(mesh_sizes(cfg, hw))
    ici, dcn = mesh_shape(cfg.mesh, hw.num_devices, hw.num_slices)
    return Mesh({a: ici[a] for a in ICI_AXES}, {a: dcn[a] for a in ICI_AXES if a in DCN_AXES or dcn[a] > 1})


def own_candidates(cfg: Config, hw: Hardware) -> dict[str, Candidate]:
    """The plan's score of the mesh, batch and pipeline schedule `cfg` already has (a recipe's, say), per remat
    policy the plan tries (and `cfg`'s own policy, scored as full when the plan does not model it)."""
    mesh = config_mesh(cfg, hw)
    tokens = round(cfg.data.per_device_batch_size * cfg.data.max_target_length)
    repeats = max(cfg.mesh.num_pipeline_repeats, 1) if mesh.sizes["stage"] > 1 else 1
    found = {c.remat: c for c in mesh_candidates(cfg, count_params(cfg.model), hw, mesh, [tokens], [repeats])}
    if found:
        found.setdefault(cfg.model.remat_policy, found["full"])
    return found


def search(cfg: Config, hw: Hardware, tokens_per_device: int = 0) -> list[Candidate]:
    """Every mesh's candidates (per remat policy and pipeline schedule), best first (fitting ones before the
    others, which come smallest first)."""
    m, counts, terms = cfg.model, count_params(cfg.model), ModelTerms.of(cfg)
    tokens = token_options(cfg, hw, tokens_per_device)
    found = []
    for mesh in meshes(cfg, hw):
        sizes = mesh.sizes
        if m.emb_dim % (sizes["fsdp"] * sizes["sequence"] * sizes["expert"]):
            continue  # the embedding dimension would not split: those weights would be copied, not sharded
        found += mesh_candidates(cfg, counts, hw, mesh, tokens, terms=terms)
    fitting = sorted((c for c in found if c.fits), key=Candidate.rank_key, reverse=True)
    return fitting + sorted((c for c in found if not c.fits), key=lambda c: c.memory)


def plan(cfg: Config, hw: Hardware, tokens_per_device: int = 0) -> list[Candidate]:
    """The best candidate of each mesh and pipeline schedule, best first; when none fits, smallest first."""
    return best_per_mesh(search(cfg, hw, tokens_per_device))


def best_per_mesh(ranked: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in ranked:
        key = (c.mesh.describe(), c.repeats)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def run_args(c: Candidate, cfg: Config) -> list[str]:
    """The overrides a recipe gives train_compile / train.py for this candidate."""
    stages = c.mesh.sizes["stage"]
    pipe = [f"num_pipeline_repeats={c.repeats}"] if stages > 1 else []
    return [*c.mesh.keys(), *pipe, f"per_device_batch_size={c.per_device_batch:g}",
            f"max_target_length={cfg.data.max_target_length}", f"remat_policy={c.remat}"]


# --------------------------------------------------------------------------- command line


def chosen_overrides(overrides: list[str]) -> list[str]:
    """The key=value overrides the plan replaces with its own choice (CHOSEN_KEYS)."""
    return [o for o in overrides if o.partition("=")[0].strip() in CHOSEN_KEYS]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=".venv/bin/python -m tessera.tools.plan", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config_epilog(("model_name", "max_target_length", "dtype", "weight_dtype", "attention",
                              "compile_hbm_budget_fraction"), ("getting_started/Plan.md",)))
    p.add_argument("model", nargs="?", help="model name (configs/models/<name>.yml) or path to a model YAML file "
                   "(default: model_name=... among the overrides, else the default model)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (max_target_length, weight_dtype, ...); "
                   "mesh, batch and remat keys are what the plan chooses")
    p.add_argument("--hardware", required=True, help="TPU slice type (v6e-256, v5p-128, ...) or <gpu>-<count> (h100-8)")
    p.add_argument("--slices", "--num_slices", type=int, default=1, help="TPU slices joined over DCN (GPUs: that "
                   "many times the count; default 1; --num_slices, as tessera.tools.estimate names it, is the same "
                   "option)")
    p.add_argument("--tokens-per-device", type=int, default=0, help="fix the batch at this many tokens per device "
                   "(default: the largest that fits, up to 128 sequences per device and 16.8M tokens per step)")
    p.add_argument("--top", type=int, default=5, help="rows of the ranked table, and candidates --compile tries")
    p.add_argument("--compile", action="store_true", help="AOT-compile the top candidates for the TPU topology, "
                   "fit the batch to the compiler's memory, write a recipe and a JSON report")
    p.add_argument("--output", default="", help="with --compile: the recipe to write (default configs/tpu/<gen>/"
                   "plan_<model>.sh); the JSON report goes next to it")
    args = parse_with_keys(p, argv)
    if args.model is not None and "=" in args.model:  # only key=value arguments: no model named
        args.model, args.overrides = None, [args.model, *args.overrides]
    return args


def main(argv: list[str]) -> int:
    from tessera.tools.plan_report import explain, no_fit_message, report_header, table

    args = parse_args(argv)
    try:
        for flag, value, least in (("--slices", args.slices, 1), ("--top", args.top, 1),
                                   ("--tokens-per-device", args.tokens_per_device, 0)):
            if value < least:
                raise ConfigError(f"{flag} {value}: give at least {least}"
                                  + (" (0: the largest batch that fits)" if least == 0 else ""))
        cfg = load_model_config(args.model, args.overrides)
        check_topology_keys(cfg, args.hardware, args.slices, "the plan", "--slices")
        hw = parse_hardware(args.hardware, args.slices, slices_flag="--slices")
        check_trainable_dtypes(cfg.model, "tpu" if hw.accelerator.torus_dims else "gpu")
        if args.output and not args.compile:
            raise ConfigError(f"--output {args.output} names the recipe --compile writes; add --compile, or leave "
                              "--output out to print the plan only")
        if args.compile and not hw.accelerator.torus_dims:
            raise ConfigError("--compile confirms plans with libtpu's TPU compiler only; GPU plans stay estimates "
                              "(leave --compile out)")
        most = all_fields()["compile_topology_num_slices"][1].metadata["maximum"]
        if args.compile and args.slices > most:  # every compile was refused, then "the compiler fits none"
            raise ConfigError(f"--slices {args.slices} with --compile: train_compile compiles for at most {most} "
                              "slices (libtpu aborts at 512); leave --compile out to plan without compiling")
        if args.compile:  # the recipe's folder, before minutes of compiling
            from tessera.tools.plan_compile import check_output

            # a model the trainer cannot build (experts on a dense block family) is sized, not compiled: every
            # compile failed, then "the compiler fits none of the top candidates"
            validate_for_build(cfg.model)
            check_output(cfg, hw, args.output)
        print(report_header(cfg, hw, sequence_note(cfg, args.overrides)), flush=True)
        from tessera.tools.plan_compile import model_overrides

        replaced = chosen_overrides(model_overrides(args.model, args.overrides))  # a model file's keys too
        if replaced:
            print(f"replaced by the plan's own choice (the mesh, the batch and remat_policy are what it chooses): "
                  f"{' '.join(replaced)}", flush=True)
        ranked = search(cfg, hw, args.tokens_per_device)
        if not ranked:
            steps = cfg.optim.gradient_accumulation_steps
            raise ConfigError(f"no mesh of {hw.num_devices} devices splits this model evenly with a whole global batch"
                              + (f" that gradient_accumulation_steps={steps} divides" if steps > 1 else "")
                              + "; change --tokens-per-device or the device count"
                              + (" (or leave gradient_accumulation_steps out)" if steps > 1 else ""))
        shown = best_per_mesh(ranked)
        if not ranked[0].fits:
            print("\nnothing fits; the smallest candidates (! = over the memory budget):\n" + table(shown[:args.top]))
            raise ConfigError(no_fit_message(cfg, hw, ranked, args.tokens_per_device))
        ranked = shown
        print("\n" + table(ranked[:args.top]))
        print("\n" + explain(ranked[0], ranked[1] if len(ranked) > 1 else None))
        if args.compile:
            from tessera.tools.plan_compile import compile_top

            return compile_top(cfg, hw, ranked[:args.top], args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from tessera.tools.cli import run_printing

    sys.exit(run_printing(main, sys.argv[1:]))
