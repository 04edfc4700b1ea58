"""Text generation from a checkpoint, with a KV cache.

    python3 -m tessera.decode configs/base.yml load_parameters_path=outputs/demo/checkpoints/100 \\
        tokenizer_path=<tokenizer> [model keys ...] --prompt "Once upon a time" --max_new_tokens 32

`key=value` arguments build the config as for training (the model keys must be those the
checkpoint was trained with); `--flags` choose what to generate (see `parse_args`). Prompts
of different lengths are decoded together, left-padded: one call writes the prompts into the
KV cache (prefill), then each call adds one token per row. Sampling is greedy at
--temperature 0 (the default), else from softmax(logits / temperature) over the --top_k most
likely tokens (0: all). A row stops at the tokenizer's end-of-sequence token (or --eos_id).

Exit codes: 0 done; 2 bad config, flags or checkpoint (one line on stderr, nothing generated);
7 the parameters and the KV cache do not fit in the memory the devices have left (checked before loading); 130 interrupted by Ctrl-C and 143 stopped by SIGTERM (one line, no traceback; decoding writes no
files, so nothing is left half-written).
See getting_started/Decode.md. JAX is imported only once decoding starts, so that --help is instant.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import re
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from tessera.config import Config, ConfigError, load_config
from tessera.tools.cli import UsageError, config_epilog, resolve_config_file, sigterm_raises

if TYPE_CHECKING:
    from tessera.data.tokenizers import Tokenizer
    from tessera.models import ModelDef

log = logging.getLogger("tessera")

EXIT_OK, EXIT_USER_ERROR, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 2, 130, 143


# ---- sampling and the decoding loop

def sample(logits_bv, key, temperature: float, top_k: int):
    """Next token ids [B] from logits [B, V]: the argmax when temperature == 0, else a draw from
    softmax(logits / temperature) restricted to the top_k largest logits (top_k=0: all)."""
    import jax
    import jax.numpy as jnp

    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv / temperature
    if top_k:
        kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv < kth_b1, -jnp.inf, logits_bv)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


def left_padded(prompts: list[list[int]]):
    """(tokens, positions, segment ids), each int32 [B, P]: prompts right-aligned, padding with
    segment id 0; positions count each prompt's tokens from 0."""
    width = max(len(p) for p in prompts)
    tokens, positions, segments = (np.zeros((len(prompts), width), np.int32) for _ in range(3))
    for row, prompt in enumerate(prompts):
        start = width - len(prompt)
        tokens[row, start:], positions[row, start:], segments[row, start:] = prompt, np.arange(len(prompt)), 1
    return tokens, positions, segments


def _decode_step(params, tokens_bt, positions_bt, segment_ids_bt, cache, key, *, model: ModelDef, temperature: float,
                 top_k: int):
    """(next tokens [B], their logits [B, V], cache) after the tokens [B, T] (the prompt, then one token)."""
    logits_btv, cache = model.apply(params, tokens_bt, positions_bt, segment_ids_bt, kv_cache=cache)
    return sample(logits_btv[:, -1], key, temperature, top_k), logits_btv[:, -1], cache


@functools.cache
def _jitted_decode_step():
    import jax

    return jax.jit(_decode_step, static_argnames=("model", "temperature", "top_k"), donate_argnames="cache")


def cache_shape(prompts: list[list[int]], max_new_tokens: int, ways: int = 1) -> tuple[int, int]:
    """(rows, tokens) of the KV cache `generate` creates on a mesh whose batch axes split rows
    `ways` ways (`batch_ways`): the prompts are left-padded to the longest, and their number is
    rounded up to a multiple of `ways` (`batch_rows`)."""
    return batch_rows(len(prompts), ways), max(map(len, prompts)) + max_new_tokens


def batch_rows(prompts: int, ways: int) -> int:
    """The rows `generate` decodes `prompts` prompts in: a multiple of the mesh's `ways`, the
    rows past the prompts only filling the batch (see `generate`)."""
    return -(-prompts // ways) * ways


def batch_ways(mesh) -> int:
    """How many ways `mesh` (concrete or abstract) splits a batch's rows: data x fsdp x expert."""
    from tessera.mesh import LOGICAL_RULES

    return math.prod(dict(mesh.shape).get(axis, 1) for axis in LOGICAL_RULES["batch"])


def empty_cache(model: ModelDef, rows: int, tokens: int):
    """The empty KV cache for decoding `rows` prompts of up to `tokens` tokens, created split over
    the current mesh (`KVCache.shard_tree`): no device ever holds more than its part."""
    import jax

    from tessera.models.kv_cache import KVCache

    return jax.jit(lambda: KVCache.shard_tree(model.init_cache(rows, tokens)))()


def generate(model: ModelDef, params, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, eos_id: int | None = None, return_logits: bool = False):
    """The tokens generated for each prompt (prompt not included), ending at eos_id when a row
    produces it. With `return_logits`, also each row's logits [n, V] (float32 numpy), the i-th
    row being the distribution the i-th new token was drawn from.

    Under a mesh (`jax.set_mesh`) the batch of prompts is split over its batch axes (`batch_ways`),
    and so is the KV cache. A number of prompts those do not divide is made up with one-token rows
    whose output is dropped: each device then decodes and caches its share of rows instead of a
    copy of all of them."""
    import jax

    from tessera.models import BLOCKS

    if not prompts or any(len(p) == 0 for p in prompts) or max_new_tokens < 1:
        raise ValueError("give at least one prompt, each of at least one token, and max_new_tokens >= 1")
    lengths = np.array([len(p) for p in prompts], np.int32)
    table = model.cfg.trainable_position_size if BLOCKS[model.cfg.decoder_block].absolute_positions else 0
    if table and lengths.max() + max_new_tokens > table:
        raise ValueError(f"{lengths.max()} prompt tokens + {max_new_tokens} new tokens exceed the "
                         f"trainable_position_size={table} positions this model has embeddings for")

    step = functools.partial(_jitted_decode_step(), model=model, temperature=temperature, top_k=top_k)
    rows, length = cache_shape(prompts, max_new_tokens, batch_ways(jax.sharding.get_abstract_mesh()))
    filler = rows - len(prompts)
    tokens_bt, positions_bt, segment_ids_bt = left_padded(prompts + [[0]] * filler)
    lengths = np.concatenate([lengths, np.ones(filler, np.int32)])
    cache = empty_cache(model, rows, length)
    key = jax.random.key(seed)
    new_tokens, new_logits = [], []
    done = np.arange(rows) >= len(prompts)  # the filler rows count as done from the start
    for i in range(max_new_tokens):
        token_b, logits_bv, cache = step(params, tokens_bt, positions_bt, segment_ids_bt, cache,
                                         jax.random.fold_in(key, i))
        token_b = np.asarray(token_b)
        new_tokens.append(np.where(done, -1, token_b))  # -1: the row had already stopped
        if return_logits:
            new_logits.append(np.asarray(logits_bv))
        if eos_id is not None:
            done |= token_b == eos_id
            if done.all():
                break
        tokens_bt, positions_bt = token_b[:, None], (lengths + i)[:, None]
        segment_ids_bt = np.ones_like(tokens_bt)
    out = [[int(t) for t in row if t >= 0] for row in np.stack(new_tokens, axis=1)[:len(prompts)]]
    if not return_logits:
        return out
    return out, [np.stack(new_logits, axis=1)[row, :len(toks)] for row, toks in enumerate(out)]


# ---- command line

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(decoding flags, config arguments): `--flag value` pairs are ours, the rest (the config
    file and key=value overrides) go to `load_config`."""
    parser = argparse.ArgumentParser(
        prog="python3 -m tessera.decode", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s configs/base.yml load_parameters_path=PATH [tokenizer_path=PATH] [key=value ...] "
              "(--prompt TEXT | --tokens 1,2,3) [--max_new_tokens N] [--temperature T] [--top_k K] [--seed S]\n"
              "       python3 decode.py ... (the same)",
        description="Generate text from a checkpoint. key=value arguments build the config as for training: "
                    "give the model keys the checkpoint was trained with.",
        epilog=config_epilog(("load_parameters_path", "tokenizer_path", "model_name", "max_target_length",
                              "add_bos", "ici_tensor_parallelism"), ("getting_started/Decode.md",)))
    parser.add_argument("--prompt", action="append", default=[], help="text to continue (repeat for a batch)")
    parser.add_argument("--tokens", action="append", default=[], type=_token_ids,
                        help="token ids to continue, comma-separated (repeat for a batch); no tokenizer needed")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    parser.add_argument("--eos_id", type=int, default=None, help="stop a row at this token (default: the "
                        "tokenizer's end-of-sequence token; none with --tokens)")
    flags, rest = parser.parse_known_args(_joined_token_lists(argv))
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        parser.error(f"unknown flag {unknown[0]}; config keys are given as key=value")
    if flags.max_new_tokens < 1 or flags.temperature < 0 or flags.top_k < 0:
        parser.error("--max_new_tokens must be >= 1, --temperature >= 0 and --top_k >= 0")
    return flags, rest


def _joined_token_lists(argv: list[str]) -> list[str]:
    """`--tokens -1,2` as `--tokens=-1,2`: argparse takes a value starting with '-' for a flag (and says
    "expected one argument"); joined, the ids reach the check that names what is wrong with them."""
    out = []
    for arg in argv:
        if out and out[-1] == "--tokens" and re.fullmatch(r"-[\d,\s-]*", arg):
            out[-1] = f"--tokens={arg}"
        else:
            out.append(arg)
    return out


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None


def encode_prompts(cfg: Config, flags: argparse.Namespace) -> tuple[Tokenizer | None, list[list[int]]]:
    """The tokenizer (None with --tokens) and the prompts as token ids, checked against the config."""
    from tessera.data.tokenizers import check_tokenizer, load_tokenizer

    if bool(flags.prompt) == bool(flags.tokens):
        raise ConfigError("give the prompts as --prompt TEXT (with tokenizer_path=...) or as --tokens 1,2,3, "
                          "not both and not neither")
    tokenizer = None
    prompts = flags.tokens
    if flags.prompt:
        tokenizer = load_tokenizer(cfg.data.tokenizer_path, cfg.data.tokenizer_type)
        check_tokenizer(tokenizer, cfg.data.tokenizer_path, cfg.model.vocab_size, cfg.data.add_bos, False)
        bos = [tokenizer.bos_id] if cfg.data.add_bos else []
        prompts = [bos + ids for ids in tokenizer.encode_batch(flags.prompt)]
    vocab, limit = cfg.model.vocab_size, cfg.data.max_target_length
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ConfigError(f"prompt {i + 1} is empty; give at least one token")
        if not all(0 <= t < vocab for t in prompt):
            raise ConfigError(f"prompt {i + 1} has token ids outside [0, vocab_size={vocab}): {prompt}")
        if len(prompt) + flags.max_new_tokens > limit:
            raise ConfigError(f"prompt {i + 1} has {len(prompt)} tokens + --max_new_tokens {flags.max_new_tokens} = "
                              f"{len(prompt) + flags.max_new_tokens}, more than max_target_length={limit} (the "
                              "sequence length the model was trained for); shorten the prompt, lower "
                              f"--max_new_tokens or set max_target_length={len(prompt) + flags.max_new_tokens}")
    return tokenizer, prompts


def load_model(cfg: Config, mesh, kv_cache: tuple[int, int] | None = None) -> tuple[ModelDef, dict]:
    """The model and its parameters from load_parameters_path, sharded over `mesh`. Checked first:
    that the parameters fit, with the KV cache that decoding `kv_cache` = (prompts, tokens) on
    `mesh` will hold (`cache_shape`: the prompts as `batch_rows` rows)."""
    import jax

    from tessera.checkpointing import load_parameters
    from tessera.memory_fit import bytes_per_device, check_fits, format_bytes, local_devices, read_buffers
    from tessera.mesh import named_shardings
    from tessera.models import build_model
    from tessera.models.quantization import dequantize_params, quantized_abstract

    path = cfg.checkpoint.load_parameters_path
    model = build_model(cfg.model, "dot_product")  # the cached path always runs the reference attention
    shardings = named_shardings(mesh, model.logical_axes(), model.param_shapes())
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            model.param_shapes(), shardings)
    need, what = bytes_per_device(model.param_shapes(), shardings), "the parameters"
    parts, cache = f"{cfg.model.weight_dtype}, over a mesh of {mesh.size} device(s)", 0
    if kv_cache:
        (prompts, tokens), rows = kv_cache, batch_rows(kv_cache[0], batch_ways(mesh))
        cache, whole = kv_cache_bytes(model, rows, tokens, mesh), kv_cache_bytes(model, rows, tokens)
        need, what = need + cache, "the parameters and the KV cache"
        layout = f" in {rows} rows" if rows > prompts else ""
        if mesh.size > 1:
            ways = round(whole / cache)
            layout += f", split {ways} ways" if ways > 1 else ", whole on each device"
        parts = (f"parameters {format_bytes(need - cache)} ({parts}), KV cache {format_bytes(cache)} per device for "
                 f"{prompts} prompt(s) of up to {tokens} tokens{layout}")
    check_fits(local_devices(mesh), need, what, parts, functools.partial(_memory_advice, cache=10 * cache >= need),
               host_buffers=read_buffers(model.param_shapes()))
    if cfg.checkpoint.checkpoint_is_quantized:
        stored = load_parameters(path, quantized_abstract(abstract, cfg.model.quantization),
                                 verify=cfg.checkpoint.checkpoint_checksums)
        params = jax.jit(lambda t: dequantize_params(t, abstract), out_shardings=shardings)(stored)
        log.info("loaded quantized parameters (%s) from %s, dequantized to %s", cfg.model.quantization, path,
                 cfg.model.weight_dtype)
    else:
        params = load_parameters(path, abstract, verify=cfg.checkpoint.checkpoint_checksums)
        log.info("loaded parameters from %s", path)
    if cfg.checkpoint.save_quantized_params_path:
        save_quantized(params, cfg.model.quantization, cfg.checkpoint.save_quantized_params_path,
                       cfg.checkpoint.checkpoint_checksums)
    return model, params


def kv_cache_bytes(model: ModelDef, rows: int, tokens: int, mesh=None) -> int:
    """Bytes of the KV cache `generate` creates for `rows` prompts of up to `tokens` tokens (prompt
    and new ones): all of it, or with `mesh`, what one device of it holds (`empty_cache`)."""
    import jax
    from jax.sharding import NamedSharding

    from tessera.memory_fit import bytes_per_device
    from tessera.mesh import logical_spec
    from tessera.models.kv_cache import KVCache

    shapes = jax.eval_shape(lambda: model.init_cache(rows, tokens))
    leaves, names = jax.tree.leaves(shapes), KVCache.tree_logical_axes(shapes)
    if mesh is None:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    return bytes_per_device(leaves, [NamedSharding(mesh, logical_spec(n, leaf.shape, dict(mesh.shape)))
                                     for leaf, n in zip(leaves, names)])


def _memory_advice(shared: bool, cache: bool = False) -> str:
    """What makes decoding fit; `cache`: the KV cache is a tenth of the need or more."""
    ways = ["decode fewer prompts at once, lower --max_new_tokens or set quantize_kvcache=true"] if cache else []
    if not shared:  # CPU devices share the host's memory: more of them do not help
        ways.append("shard the parameters over more devices (ici_fsdp_parallelism or ici_tensor_parallelism)")
    ways.append("free memory" if not shared else "free memory, or decode on a host with more")
    return "; ".join(ways)


def save_quantized(params, mode: str, path: str, checksums: bool = True) -> None:
    """Write `params` quantized (`tessera.models.quantization.quantize_params`) as an Orbax
    checkpoint holding {"params": ...}: what load_parameters_path with checkpoint_is_quantized=true reads;
    with `checksums`, its files' checksums too (`checkpoint_checksums`), which every load verifies."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    from tessera.checkpointing import record_checksums
    from tessera.models.quantization import quantize_params

    target = epath.Path(path)
    if target.exists():
        raise ConfigError(f"save_quantized_params_path={path} exists already; choose a new folder (nothing was "
                          "written)")
    tree = {"params": jax.jit(lambda p: quantize_params(p, mode))(params)}
    ocp.PyTreeCheckpointer().save(target, tree)
    if checksums:
        record_checksums(path)
    log.info("wrote the parameters quantized (%s) to %s", mode, path)


def decode(cfg: Config, flags: argparse.Namespace) -> list[list[int]]:
    """Generate for the flags' prompts and print the results; returns the new tokens per prompt."""
    import jax

    from tessera.mesh import create_mesh

    if not cfg.checkpoint.load_parameters_path:
        raise ConfigError("decoding needs load_parameters_path=<checkpoint step folder> (e.g. "
                          "outputs/demo/checkpoints/100) and the model keys it was trained with")
    tokenizer, prompts = encode_prompts(cfg, flags)
    mesh = create_mesh(cfg.mesh)
    model, params = load_model(cfg, mesh, cache_shape(prompts, flags.max_new_tokens))  # (prompts, tokens)
    rows = batch_rows(len(prompts), batch_ways(mesh))
    if rows > len(prompts):
        log.info("decoding %d prompt(s) in %d rows: the mesh splits the batch and the KV cache %d ways over its "
                 "data, fsdp and expert axes", len(prompts), rows, batch_ways(mesh))
    eos_id = flags.eos_id if flags.eos_id is not None else tokenizer.eos_id if tokenizer else None
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        outputs = generate(model, params, prompts, flags.max_new_tokens, flags.temperature, flags.top_k,
                           flags.seed, eos_id)
    seconds = time.perf_counter() - start
    count = sum(len(o) for o in outputs)
    log.info("generated %d tokens for %d prompt(s) in %.2f s (compilation included)", count, len(prompts), seconds)
    for i, (prompt, new) in enumerate(zip(prompts, outputs)):
        if tokenizer is None:
            print(" ".join(map(str, new)))
        else:  # prompt and continuation decoded together, so that the spacing between them is right
            text = tokenizer.decode([t for t in prompt + new if t not in (tokenizer.bos_id, eos_id)])
            print(("\n" if i else "") + text)
    return outputs


class _Terminated(BaseException):  # like KeyboardInterrupt: no `except Exception` on the way swallows it
    """SIGTERM: decoding stops with one line (nothing to save)."""


def main(argv: list[str]) -> int:
    flags, config_args = parse_args(argv)  # --help ends here, before JAX is imported
    with sigterm_raises(_Terminated):
        return _main(flags, config_args)


def _main(flags: argparse.Namespace, config_args: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    from tessera.checkpointing import CheckpointError
    from tessera.memory_fit import EXIT_OUT_OF_MEMORY, OutOfMemory

    try:
        decode(load_config(resolve_config_file(config_args)), flags)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (ConfigError, CheckpointError) as e:
        print(f"{'config' if isinstance(e, ConfigError) else 'checkpoint'} error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OutOfMemory as e:
        print(f"memory error: {e} (exit code {EXIT_OUT_OF_MEMORY})", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated:
        print(f"stopped by SIGTERM (exit code {EXIT_TERMINATED})", file=sys.stderr)
        return EXIT_TERMINATED
    return EXIT_OK


if __name__ == "__main__":
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    use_cpu_on_hosts_without_accelerators()
    sys.exit(main(sys.argv[1:]))
