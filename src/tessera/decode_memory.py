"""decode.py's memory check before anything is loaded: the parameters, the KV cache and the prompts'
prefill against what the devices have left (exit code 7 with what to change). See tessera.decode."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from tessera.generation import batch_rows, batch_ways, cache_shape, kv_cache_bytes, prefill_program, prompt_width

if TYPE_CHECKING:
    from tessera.models import ModelDef

log = logging.getLogger("tessera")


def check_memory(model: ModelDef, abstract, mesh, decoding: dict | None, weight_dtype: str):
    """`load_model`'s checks (OutOfMemory); returns the compiled prefill (None without `decoding`)."""
    import jax

    from tessera.memory_fit import bytes_per_device, check_fits, format_bytes, local_devices, read_buffers

    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    need, what = bytes_per_device(model.param_shapes(), shardings), "the parameters"
    parts, cache = f"{weight_dtype}, over a mesh of {mesh.size} device(s)", 0
    if decoding:
        prompts, tokens = cache_shape(decoding["prompts"], decoding["max_new_tokens"],
                                      width=prompt_width(decoding["prompts"], model.attention_kernel))
        rows = batch_rows(prompts, batch_ways(mesh))
        cache, whole = kv_cache_bytes(model, rows, tokens, mesh), kv_cache_bytes(model, rows, tokens)
        need, what = need + cache, "the parameters and the KV cache"
        layout = f" in {rows} rows" if rows > prompts else ""
        if mesh.size > 1:
            ways = round(whole / cache)
            layout += f", split {ways} ways" if ways > 1 else ", whole on each device"
        parts = (f"parameters {format_bytes(need - cache)} ({parts}), KV cache {format_bytes(cache)} per device for "
                 f"{prompts} prompt(s) of up to {tokens} tokens{layout}")
    kv_quant = model.cfg.kv_quant_dtype if model.cfg.quantize_kvcache else ""
    advice = functools.partial(memory_advice, cache=10 * cache >= need, kv_quant=kv_quant,
                               float32_weights=weight_dtype == "float32" and 10 * (need - cache) >= need)
    check_fits(local_devices(mesh), need, what, parts, advice, host_buffers=read_buffers(model.param_shapes()))
    program = None
    if decoding:
        with jax.set_mesh(mesh):
            program = prefill_program(model, abstract, **decoding)
        analysis = program.memory_analysis()
        temporaries = analysis.temp_size_in_bytes if analysis is not None else 0
        prefill_advice = functools.partial(advice, prefill=10 * temporaries >= need + temporaries)
        check_fits(local_devices(mesh), need + temporaries, f"{what} with the prompts' prefill",
                   f"{parts}, prefill temporaries {format_bytes(temporaries)}", prefill_advice,
                   host_buffers=read_buffers(model.param_shapes()))
        log.info("memory: %s, prefill temporaries %s", parts, format_bytes(temporaries))
    return program


def memory_advice(shared: bool, cache: bool = False, kv_quant: str = "", float32_weights: bool = False,
                   prefill: bool = False) -> str:
    """What makes decoding fit; `cache`: the KV cache is a tenth of the need or more; `kv_quant`: the
    type it is quantized to already ("": not quantized); `float32_weights`: float32 parameters are a
    tenth of the need or more; `prefill`: the prefill's temporaries are. XLA:CPU (`shared`) stores int4
    in a byte per value, as int8: int4 is not offered there."""
    smaller = {"": " or set quantize_kvcache=true", "int8": "" if shared else " or set kv_quant_dtype=int4"}
    smaller = smaller.get(kv_quant, "")
    ways = [f"decode fewer prompts at once, lower --max_new_tokens{smaller}"] if cache else []
    if prefill:  # a MoE over an expert axis: every shard makes room for all the prompts' token copies (moe.py)
        ways.append("decode fewer or shorter prompts at once (the prefill's temporaries grow with the prompts' "
                    "tokens; over an expert axis each expert shard holds room for every token's copies)")
    if float32_weights:  # Decode.md: float32 weights decode as bfloat16 (it was not offered)
        ways.append("set weight_dtype=bfloat16 (float32 parameters are read as bfloat16, half the memory)")
    if not shared:  # CPU devices share the host's memory: more of them do not help
        ways.append("shard the parameters over more devices (ici_fsdp_parallelism or ici_tensor_parallelism)")
    ways.append("free memory" if not shared else "free memory, or decode on a host with more")
    return "; ".join(ways)
