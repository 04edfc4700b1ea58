"""What `tessera.tools.plan` prints: the ranked table, the explanation of the winner, and the
message when nothing fits (how far over the budget, and what would fit)."""

from __future__ import annotations

import dataclasses
import math

from tessera.config import Config
from tessera.config.layers import mlp_widths
from tessera.hardware import GIB, GPUS_PER_NODE
from tessera.tools.estimate import Hardware, fused_attention, memory_budget
from tessera.tools.memory_model import count_params, estimate_memory, unmodelled_notes
from tessera.tools.plan import Candidate, mesh_config
from tessera.tools.plan_model import executed_ratio


def describe(c: Candidate) -> str:
    pipe = f", {c.repeats} repeats" if c.repeats > 1 else ""
    return f"{c.mesh.describe()}{pipe}"


def binding_text(c: Candidate) -> str:
    b = c.binding
    if b is None:
        return "none (one device)"
    return f"{b.axis} {b.intensity:,.0f} / {b.hardware:,.0f} ({b.link})"


def table(cands: list[Candidate]) -> str:
    head = f"{'#':>2}  {'mesh':<52} {'remat':<20} {'batch/dev':>9} {'tokens/dev':>10} {'GiB/chip':>9}  " \
           f"{'binding axis: intensity / hardware':<38} {'MFU est':>7}"
    rows = [head]
    for i, c in enumerate(cands, 1):
        gib = f"{c.memory / GIB:.2f}" + ("" if c.fits else "!") + ("*" if c.compiled else "")
        rows.append(f"{i:>2}  {describe(c):<52} {c.remat:<20} {c.per_device_batch:>9g} {c.tokens_per_device:>10,} "
                    f"{gib:>9}  {binding_text(c):<38} {c.mfu:>6.1%}")
    return "\n".join(rows)


def explain(winner: Candidate, runner_up: Candidate | None) -> str:
    """One or two sentences: why the winner ranks first."""
    b = winner.binding
    if b is None:
        why = "it needs no communication"
    elif b.ratio >= 1:
        why = (f"every axis leaves more FLOPs per byte than its link needs (the closest: {b.axis}, "
               f"{b.intensity:,.0f} against {b.hardware:,.0f} on {b.link}, {b.ratio:.1f}x)")
    else:
        needed = winner.tokens_needed()
        why = (f"its binding axis, {b.axis}, is the least communication-bound on offer ({b.intensity:,.0f} "
               f"against {b.hardware:,.0f} FLOPs/byte on {b.link}, {b.ratio:.2f}x"
               + (f"; compute-bound from {needed:,} tokens per device)" if needed else ")"))
    bubble = f", a {winner.bubble:.1%} pipeline bubble" if winner.bubble else ""
    first = (f"{describe(winner)} with remat_policy={winner.remat} at {winner.tokens_per_device:,} tokens per device "
             f"ranks first: {why}{bubble}, and it needs {winner.memory / GIB:.1f} of {winner.budget / GIB:.1f} GiB "
             f"per chip.")
    ways = winner.mesh.sizes["sequence"]
    if ways > 1:
        length = round(winner.tokens_per_device / winner.per_device_batch)
        first += (f" Each sequence is split {ways} ways (a chip holds {length // ways:,} of its tokens): splash "
                  "attention gathers the keys and values of the other shares, load-balanced.")
    if runner_up is None:
        return first
    return first + f" Next: {describe(runner_up)} ({runner_up.remat}), {_lost(winner, runner_up)}."


def _lost(w: Candidate, r: Candidate) -> str:
    if not r.fits:
        return f"which needs {r.memory / GIB:.1f} GiB per chip"
    if round(r.mfu, 4) < round(w.mfu, 4):
        rb = r.binding
        reason = f"binding axis {rb.axis} at {rb.ratio:.2f}x" if rb and rb.ratio < 1 else \
            f"remat {r.remat}" if r.remat != w.remat else f"bubble {r.bubble:.1%}" if r.bubble else "its remat"
        return f"estimated {r.mfu:.1%} MFU ({reason})"
    if r.binding and w.binding and round(r.binding.ratio, 3) < round(w.binding.ratio, 3):
        return f"same estimate but less headroom ({r.binding.axis} at {r.binding.ratio:.2f}x)"
    if r.tokens_per_device < w.tokens_per_device:
        return f"same estimate at a smaller batch ({r.tokens_per_device:,} tokens per device)"
    return f"same estimate with more memory ({r.memory / GIB:.1f} GiB)"


def no_fit_message(cfg: Config, hw: Hardware, ranked: list[Candidate], tokens_per_device: int) -> str:
    """By how much the smallest candidate misses the budget and what would make it fit."""
    small = ranked[0]  # the smallest of all, when none fits
    fraction, source = memory_budget(cfg, hw)
    ideal = max(ranked, key=Candidate.roofline_key)
    c = mesh_config(cfg, small.mesh, small.repeats, small.per_device_batch)
    mem = estimate_memory(c, count_params(c.model), small.mesh.sizes, fused_attention(c, hw, small.mesh.sizes))
    state = mem.params + mem.grads + mem.optimizer  # split over the chips; the gathered layers are not
    acts = small.memory - state - mem.gathered
    # counted with the state, the gathered layers made llama3.1-405b on v5e-16 ask for 32x the chips, which did not fit
    room = small.budget - acts - mem.gathered
    more = 2 ** math.ceil(math.log2(max(2.0, state / max(room, small.budget * 0.05))))
    hints = [f"more chips: the {state / GIB:.1f} GiB of parameters, gradients and optimizer state shrink with the "
             f"chips they are split over (not the {mem.gathered / GIB:.1f} GiB of gathered layers); about {more}x the "
             f"chips (--slices {more * hw.num_slices})"]
    if c.model.weight_dtype == "float32":
        saved = (mem.params + mem.grads + mem.optimizer) / 2
        hints.append(f"weight_dtype=bfloat16: halves parameters, gradients and optimizer state "
                     f"({saved / GIB:.1f} GiB less)")
    hints.append(f"offload: the {acts / GIB:.1f} GiB of activations to host memory (remat_policy=custom "
                 "decoder_layer_input=offload)")
    o = c.optim
    if o.opt_type == "adamw" and c.model.scan_layers and small.mesh.sizes["stage"] == 1 and not (
            o.optimizer_memory_host_offload):
        offloaded = dataclasses.replace(c, optim=dataclasses.replace(o, optimizer_memory_host_offload=True))
        saved = mem.optimizer - estimate_memory(offloaded, count_params(c.model), small.mesh.sizes,
                                                fused_attention(c, hw, small.mesh.sizes)).optimizer
        hints.append(f"optimizer_memory_host_offload=true: AdamW's moments in host memory, streamed through HBM a "
                     f"layer at a time in the update ({saved / GIB:.1f} GiB less per chip)")
    m = c.model
    dropless = m.sparse_matmul or m.megablox
    if m.num_experts > 1 and dropless and m.ragged_buffer_factor <= 0 and small.mesh.sizes["expert"] > 2:
        bounded = dataclasses.replace(c, model=dataclasses.replace(m, ragged_buffer_factor=2.0))
        saved = mem.total(small.remat) - estimate_memory(bounded, count_params(m), small.mesh.sizes,
                                                            fused_attention(c, hw, small.mesh.sizes)).total(small.remat)
        hints.append(f"ragged_buffer_factor=2: each device's buffer for the token copies it receives over the "
                     f"{small.mesh.sizes['expert']}-way expert axis holds twice its own copies instead of every "
                     f"sender's ({saved / GIB:.1f} GiB less; copies past it are dropped and counted)")
    if tokens_per_device:
        hints.append(f"fewer tokens per device than {tokens_per_device:,}")
    hints.append(f"with the memory, the rooflines' choice: {describe(ideal)}, remat {ideal.remat} "
                 f"({ideal.mfu:.1%} MFU estimated, binding {binding_text(ideal)}, "
                 f"{ideal.memory / GIB:.1f} GiB per chip)")
    return (f"{c.model.model_name} does not fit on {hw.name} x{hw.num_slices} at any mesh tried: the smallest "
            f"needs {small.memory / GIB:.1f} GiB per chip ({describe(small)}, remat {small.remat}, "
            f"{small.tokens_per_device:,} tokens per device), {(small.memory - small.budget) / GIB:.1f} GiB over the "
            f"budget of {small.budget / GIB:.1f} GiB ({fraction:g} of {hw.accelerator.hbm_bytes / GIB:.1f} GiB HBM, "
            f"{source}). What would fit:\n  - " + "\n  - ".join(hints))


def report_header(cfg: Config, hw: Hardware, sequence: str) -> str:
    m, counts = cfg.model, count_params(cfg.model)
    links = "ICI links per axis from the slice shape; DCN between slices" if hw.accelerator.torus_dims \
        else f"NVLink inside nodes of {GPUS_PER_NODE}, the network between them (compile confirmation is TPU-only)"
    return "\n".join([
        sequence,
        f"model {m.model_name}: {counts.total:.3e} parameters ({counts.active:.3e} active), {m.num_decoder_layers} "
        f"layers, emb {m.emb_dim}, {mlp_widths(m)}, heads {m.num_query_heads}/{m.num_kv_heads}"
        + (f", {m.num_experts} experts (top {m.num_experts_per_tok})" if m.num_experts > 1 else ""),
        f"hardware: {hw.name} x{hw.num_slices} = {hw.num_devices} x {hw.accelerator.device_kind}, "
        f"{hw.accelerator.hbm_bytes / GIB:.1f} GiB HBM; {links}",
        *routing_note(cfg),
        *(f"memory: {note}" for note in unmodelled_notes(cfg)),
        *([f"memory: the eval step (eval_interval={cfg.data.eval_interval}) is not in these estimates; --compile "
           "compiles it too, and a candidate fits only when its evaluation does"] if cfg.data.eval_interval else []),
    ])


def routing_note(cfg: Config) -> list[str]:
    """A line when capacity routing makes the step compute more than MFU counts (every estimate is divided)."""
    executed = executed_ratio(cfg)
    if executed < 1.005:
        return []
    limit = "no capacity limit: every expert takes every token's slot" if cfg.model.capacity_factor <= 0 else \
        f"capacity_factor={cfg.model.capacity_factor:g}"
    return [f"routing: capacity routing ({limit}) computes {executed:.2f}x the FLOPs MFU counts (padded expert slots, "
            "one-hot dispatch and combine); the estimates below are divided by that. sparse_matmul=true routes "
            "dropless and computes only the chosen experts"]
