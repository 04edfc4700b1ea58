"""Text generation from a checkpoint, with a KV cache.

    .venv/bin/python -m tessera.decode configs/base.yml load_parameters_path=outputs/demo/checkpoints/100 \\
        tokenizer_path=<tokenizer> [model keys ...] --prompt "Once upon a time" --max_new_tokens 32

`key=value` arguments build the config as for training (the model keys must be those the
checkpoint was trained with); `--flags` choose what to generate (see `parse_args`). Prompts
of different lengths are decoded together, left-padded: one call writes the prompts into the
KV cache (prefill), then each call adds one token per row. Sampling is greedy at
--temperature 0 (the default), else from softmax(logits / temperature) over the --top_k most
likely tokens (0: all) and the fewest of them whose probabilities add up to --top_p (1: all). A
row stops at the tokenizer's end-of-sequence token and the eos_token_id of a generation_config.json
beside it (or at any --eos_id instead, a repeatable flag).

Several processes (a TPU slice's hosts, a Slurm job, or NNODES / NODE_RANK / JAX_COORDINATOR_IP
as for train.py) decode together: each loads its part of the parameters, all sample the same
tokens, and process 0 prints them.

Exit codes: 0 done; 2 bad config, flags or checkpoint (one line on stderr, nothing generated; also
logits that are NaN or inf, NonFiniteLogits);
4 a multi-process job could not start (as train.py's);
7 the parameters, the KV cache and the prompts' prefill do not fit in the memory the devices have left
(checked before loading); 130 interrupted by Ctrl-C and 143 stopped by SIGTERM (one line, no traceback;
decoding writes no files, so nothing is left half-written); 141 the reader of stdout went away (`| head`),
1 stdout could not be written (a full disk; one line), as for the other commands that print.
See getting_started/Decode.md. JAX is imported only once decoding starts, so that --help is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import time
from typing import TYPE_CHECKING


from tessera.compile_cache import check_cache_folder, use_compilation_cache
from tessera.config import Config, ConfigError, load_config
from tessera.generation import (  # noqa: F401 - the library half, re-exported: `from tessera.decode import generate`
    NonFiniteLogits, batch_rows, batch_ways, cache_abstract, cache_shape, empty_cache, generate, kv_cache_bytes,
    prefill_program, prompt_width, sample,
)
from tessera.decode_args import check_parameters_named, encode_prompts, parse_args, stop_tokens
from tessera.decode_memory import check_memory
from tessera.platforms import run_settings_restored
from tessera.tools.cli import UsageError, command_logging, resolve_config_file
from tessera.tools.cli_signals import sigterm_raises

if TYPE_CHECKING:
    from tessera.models import ModelDef

log = logging.getLogger("tessera")

EXIT_OK, EXIT_USER_ERROR, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 2, 130, 143


def load_model(cfg: Config, mesh, decoding: dict | None = None):
    """(model, parameters from load_parameters_path sharded over `mesh`, the compiled prefill or
    None). Checked first: that the devices multiply in `quantization` (as training checks it); given
    `decoding` (`generate`'s prompts, max_new_tokens, temperature and top_k, top_p): that the
    parameters fit with the KV cache decoding them on `mesh` will hold (`cache_shape`: the prompts
    as `batch_rows` rows); then that the prefill fits with them too (`prefill_program`, compiled
    from shapes; its temporaries hold a chunk of each prompt's attention scores and the prompts'
    activations)."""
    import jax

    from tessera.checkpointing.quantized import check_new_folder, save_quantized, source_config
    from tessera.mesh import named_shardings
    from tessera.models import build_model
    from tessera.models.quantization import check_platform as check_quantization

    path = cfg.checkpoint.load_parameters_path
    device = mesh.devices.flat[0]  # the devices run the projections in `quantization` too, as in training
    check_quantization(cfg.model.quantization, device.device_kind, device.platform,
                       str(getattr(device, "compute_capability", "")), tied_logits=cfg.model.logits_via_embedding)
    if cfg.checkpoint.save_quantized_params_path:  # before the load: a folder that cannot be made is found at once
        check_new_folder(cfg.checkpoint.save_quantized_params_path, "save_quantized_params_path")
    model_cfg = _prefill_tiles(decoding_model(cfg.model), mesh, decoding)
    model = build_model(model_cfg, _prefill_kernel(dataclasses.replace(cfg, model=model_cfg), mesh, decoding))
    shardings = named_shardings(mesh, model.logical_axes(), model.param_shapes())
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            model.param_shapes(), shardings)
    program = check_memory(model, abstract, mesh, decoding, cfg.model.weight_dtype)
    with _quantization_explained(path, cfg.checkpoint.checkpoint_is_quantized, cfg.model.quantization):
        params = _load(cfg, model, abstract, shardings)
    if cfg.checkpoint.save_quantized_params_path:
        save_quantized(params, model.logical_axes(), cfg.model.quantization,
                       cfg.checkpoint.save_quantized_params_path, cfg.checkpoint.checkpoint_checksums,
                       config=source_config(cfg))
    return model, params, program


def decoding_model(m):
    """The model section decoding builds from `m`: dropless routing with a receive buffer that has room
    for every token copy (ragged_buffer_factor=-1). A bounded buffer, training's memory saving, dropped
    the copies past its end while decoding without a word (decoding reports no dropped share): other
    tokens than the model gives (decoding_keys_without_effect names the key)."""
    return dataclasses.replace(m, ragged_buffer_factor=-1.0) if m.ragged_buffer_factor > 0 else m


def _load(cfg: Config, model: ModelDef, abstract, shardings):
    """`load_model`'s parameters from load_parameters_path: a quantized checkpoint dequantized
    (checkpoint_is_quantized), else read as they are; either with a warning for changed model keys."""
    import jax

    from tessera.checkpointing import load_parameters, mismatch_explained, warn_model_changes
    from tessera.models.quantization import dequantize_params, quantized_abstract

    path = cfg.checkpoint.load_parameters_path
    model_keys = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)}
    if cfg.checkpoint.checkpoint_is_quantized:
        stored = load_parameters(path, quantized_abstract(abstract, cfg.model.quantization, model.logical_axes()),
                                 verify=cfg.checkpoint.checkpoint_checksums)
        params = jax.jit(lambda t: dequantize_params(t, abstract, model.logical_axes()),
                         out_shardings=shardings)(stored)
        log.info("loaded quantized parameters (%s) from %s, dequantized to %s", cfg.model.quantization, path,
                 cfg.model.weight_dtype)
        warn_model_changes(path, model_keys)  # the config it keeps is its source's (save_quantized)
    else:
        with mismatch_explained(path, model_keys):
            params = load_parameters(path, abstract, verify=cfg.checkpoint.checkpoint_checksums)
        log.info("loaded parameters from %s", path)
        warn_model_changes(path, model_keys)
    return params


@contextlib.contextmanager
def _quantization_explained(path: str, is_quantized: bool, mode: str = ""):
    """Around a load from `path`: a CheckpointMismatch gets a last line when checkpoint_is_quantized
    or the quantization `mode` explains it (a quantized checkpoint read as float weights listed every
    matrix as missing and unexpected, without a word on the key that reads it; one written as int8 and
    read with quantization=fp8 listed every matrix's dtype and said to use the model settings)."""
    import jax
    import jax.numpy as jnp

    from tessera.checkpointing import CheckpointMismatch
    from tessera.checkpointing.loading import saved_tree
    from tessera.models.quantization import MODES, storage_type

    try:
        yield
    except CheckpointMismatch as e:
        _, tree = saved_tree(path, verify=False)
        stored = {str(leaf.dtype) for keys, leaf in jax.tree_util.tree_leaves_with_path(tree.get("params", {}))
                  if getattr(keys[-1], "key", None) == "qvalue"}
        if stored and not is_quantized:
            modes = " or ".join(m for m in MODES if m and jnp.dtype(storage_type(m)).name in stored)
            hint = (f"load_parameters_path={path} holds quantized parameters ({', '.join(sorted(stored))}, written by "
                    f"save_quantized_params_path): read them with checkpoint_is_quantized=true "
                    f"quantization={modes or 'the mode they were written with'}")
        elif is_quantized and not stored:
            hint = (f"load_parameters_path={path} holds parameters that are not quantized: leave out "
                    "checkpoint_is_quantized=true")
        elif is_quantized and stored != {jnp.dtype(storage_type(mode)).name}:
            modes = " or ".join(m for m in MODES if m and jnp.dtype(storage_type(m)).name in stored)
            hint = (f"load_parameters_path={path} holds parameters quantized to {', '.join(sorted(stored))}, not to "
                    f"{jnp.dtype(storage_type(mode)).name} (quantization={mode}): read them with "
                    f"quantization={modes or 'the mode they were written with'}")
        else:
            raise
        raise CheckpointMismatch(f"{e}\n{hint}") from None


def _prefill_tiles(m, mesh, decoding: dict | None):
    """The model section `m` with splash attention tiles for the prompts' prefill on a TPU: sa_block_*
    keys (tuned for training's max_target_length) that do not fit the prompts' padded width are left
    to splash's own pick (0), said in one line. They were a config error about a "sequence length"
    that no key sets (sa_block_q=384 for 1,536 tokens, prompts of 400 tokens padded to 512)."""
    from tessera.models.splash import BLOCK_KEYS, block_sizes, unsupported

    if not decoding or mesh.devices.flat[0].platform != "tpu" or not any(getattr(m, k) for k in BLOCK_KEYS):
        return m
    width, shape = prompt_width(decoding["prompts"], "splash"), dict(mesh.shape)
    if unsupported(m, width, shape):
        return m  # the reference runs the prefill (`_prefill_kernel` says why)
    try:
        block_sizes(m, width, shape.get("sequence", 1))
        return m
    except ConfigError as e:
        log.info("prefill attention: the prompts are padded to %d tokens, which the tiles do not fit (%s); the "
                 "prefill's splash attention picks its own", width, e)
        return dataclasses.replace(m, **dict.fromkeys(BLOCK_KEYS, 0))


def _prefill_kernel(cfg: Config, mesh, decoding: dict | None) -> str:
    """The attention kernel of the prompts' prefill (`select_attention`, as training picks it, for
    the prompts' padded width: splash attention on TPU); each new token attends over the cache
    with the reference math whatever this is."""
    from tessera.models.attention_choice import select_attention

    device = mesh.devices.flat[0]
    platform = device.platform
    width = prompt_width(decoding["prompts"], "splash" if platform == "tpu" else "") if decoding else 0
    choice = select_attention(cfg.model, platform, width, dict(mesh.shape), device.device_kind,
                              str(getattr(device, "compute_capability", "")))
    if choice.kernel.startswith("splash") or choice.kernel == "dot_product":
        chunked = choice.kernel.startswith("splash") and cfg.model.chunk_attn_window_size and \
            cfg.model.decoder_block == "llama4"  # (splash counts chunks by index; the prompts are left-padded)
        log.info("prefill attention: %s%s", choice.reason, "; Llama 4's chunked layers: the reference math, its "
                 "queries in chunks" if chunked else "")
        return choice.kernel
    # cuDNN (a GPU's pick for training): the prefill runs the reference math (Attention.attend_prompt), and the log
    # said "cuDNN fused attention on gpu"
    log.info("prefill attention: the reference math, its queries in chunks (training's choice, %s, is not used for "
             "the prefill: the prompts are left-padded, and JAX's cuDNN call has no segment ids to mask the padding)",
             choice.reason)
    return "dot_product"


def decode(cfg: Config, flags: argparse.Namespace, out=None) -> list[list[int]]:
    """Generate for the flags' prompts and print the results (to `out`, default stdout); returns
    the new tokens per prompt."""
    import jax

    from tessera.config.unread_keys import decoding_keys_without_effect
    from tessera.cpu_miscompile import check_cpu_mesh
    from tessera.mesh import create_mesh

    check_parameters_named(cfg)
    tokenizer, prompts = encode_prompts(cfg, flags)
    for stop in flags.eos_id or []:  # a second --eos_id replaced the first without a word: now both stop a row
        if stop >= cfg.model.vocab_size:
            raise ConfigError(f"--eos_id {stop} is outside the model's vocabulary [0, vocab_size="
                              f"{cfg.model.vocab_size}): no row would ever stop at it")
    eos_ids = stop_tokens(cfg, flags, tokenizer)
    unused = [f"--{name} {value}" for name, value, default in (("top_k", flags.top_k, 0), ("top_p", flags.top_p, 1.0),
                                                               ("seed", flags.seed, 0)) if value != default]
    if flags.temperature == 0 and unused:  # they were ignored without a word
        log.warning("%s: no effect at --temperature 0, which decodes greedily; give a --temperature above 0 "
                    "(e.g. 1) to sample", ", ".join(unused))
    for line in decoding_keys_without_effect(cfg):  # each was accepted without a word
        log.warning("%s", line)
    mesh = create_mesh(cfg.mesh)
    check_cpu_mesh(mesh)  # a mesh XLA:CPU computes wrong results on: other tokens than one device's, silently
    decoding = dict(prompts=prompts, max_new_tokens=flags.max_new_tokens, temperature=flags.temperature,
                    top_k=flags.top_k, top_p=flags.top_p)
    model, params, program = load_model(cfg, mesh, decoding)
    rows = batch_rows(len(prompts), batch_ways(mesh))
    if rows > len(prompts):
        log.info("decoding %d prompt(s) in %d rows: the mesh splits the batch and the KV cache %d ways over its "
                 "data, fsdp and expert axes", len(prompts), rows, batch_ways(mesh))
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        outputs = generate(model, params, prompts, flags.max_new_tokens, flags.temperature, flags.top_k,
                           flags.seed, eos_ids or None, prefill=program, top_p=flags.top_p)
    seconds = time.perf_counter() - start
    count = sum(len(o) for o in outputs)
    log.info("generated %d tokens for %d prompt(s) in %.2f s (compilation included)", count, len(prompts), seconds)
    if jax.process_index() != 0:  # every process of a multi-process job has the same outputs: one prints them
        return outputs
    past = sum(t >= tokenizer.vocab_size for new in outputs for t in new) if tokenizer else 0
    if past:  # vocab_size may pad the tokenizer's vocabulary (check_tokenizer); the tokenizers fail on them
        log.warning("%d generated token(s) have ids past the tokenizer's %d tokens (vocab_size=%d pads it): left "
                    "out of the text; a model that generates them has not learned the data's vocabulary yet",
                    past, tokenizer.vocab_size, cfg.model.vocab_size)
    for i, (prompt, new) in enumerate(zip(prompts, outputs)):
        if tokenizer is None:
            print(" ".join(map(str, new)), file=out or sys.stdout)
        else:  # prompt and continuation decoded together, so that the spacing between them is right
            stop = 1 if new and new[-1] in eos_ids else 0  # the token the row stopped at; an --eos_id such as "="
            text = tokenizer.decode([t for t in prompt + new[:len(new) - stop]  # was also cut out of the prompt
                                     if t not in (tokenizer.bos_id, tokenizer.eos_id) and t < tokenizer.vocab_size])
            print(("\n" if i else "") + text, file=out or sys.stdout)
    return outputs


def _results_only_on_stdout():
    """A stream to the original stdout, with file descriptor 1 sent to stderr from now on: in a
    multi-process job on CPU the collectives library prints its connection lines on stdout, which
    must hold the generated text alone."""
    import os

    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return results


class _Terminated(BaseException):  # like KeyboardInterrupt: no `except Exception` on the way swallows it
    """SIGTERM: decoding stops with one line (nothing to save)."""


def main(argv: list[str]) -> int:
    flags, config_args = parse_args(argv)  # --help ends here, before JAX is imported
    with sigterm_raises(_Terminated):
        return _main(flags, config_args)


def _main(flags: argparse.Namespace, config_args: list[str]) -> int:
    try:  # a signal while JAX is still being imported is one line too
        # the GPU keys' settings and the log set-up end with the decoding (a notebook decodes on)
        with command_logging(), run_settings_restored():
            return _decode_main(flags, config_args)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated:
        print(f"stopped by SIGTERM (exit code {EXIT_TERMINATED})", file=sys.stderr)
        return EXIT_TERMINATED


def _decode_main(flags: argparse.Namespace, config_args: list[str]) -> int:
    from tessera.checkpointing import CheckpointError
    from tessera.distributed import EXIT_DISTRIBUTED, DistributedError, initialize
    from tessera.memory_fit import EXIT_OUT_OF_MEMORY, OutOfMemory
    from tessera.platforms import check_platforms_start

    try:
        cfg = load_config(resolve_config_file(config_args))
        # the GPU keys before any device use, as in train.py (a GPU recipe's run has xla_python_client_mem_fraction=0.9
        # in its config.yml, which decoding ignored)
        from tessera.gpu_tuning import apply_gpu_tuning

        apply_gpu_tuning(cfg.gpu)
        use_compilation_cache(cfg.run.jax_cache_dir)
        job = initialize()  # a multi-process job (the same environment variables as train.py's): join it
        check_platforms_start()  # JAX_PLATFORMS=cuda without the CUDA plugin: one line, not a traceback
        check_cache_folder(cfg.run.jax_cache_dir)  # joined now; before the first compile
        decode(cfg, flags, _results_only_on_stdout() if job.num_processes > 1 else None)
    except DistributedError as e:
        print(f"distributed start-up error: {e}", file=sys.stderr)
        return EXIT_DISTRIBUTED
    except (UsageError, NonFiniteLogits) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (ConfigError, CheckpointError) as e:
        print(f"{'config' if isinstance(e, ConfigError) else 'checkpoint'} error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OutOfMemory as e:
        print(f"memory error: {e} (exit code {EXIT_OUT_OF_MEMORY})", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    return EXIT_OK


if __name__ == "__main__":
    from tessera.platforms import use_cpu_on_hosts_without_accelerators
    from tessera.tools.cli import run_printing

    use_cpu_on_hosts_without_accelerators()
    sys.exit(run_printing(main, sys.argv[1:]))
