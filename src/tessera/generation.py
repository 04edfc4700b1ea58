"""The decoding loop: a batch of prompts continued token by token with a KV cache.

Prompts of different lengths are decoded together, left-padded: one call writes the prompts into
the KV cache (prefill), then each call adds one token per row. Sampling is greedy at temperature
0, else from softmax(logits / temperature) over the top_k most likely tokens (0: all) and the
smallest set of them whose probabilities add up to top_p (1: all). Under a
mesh the batch and the cache are split over it (`generate`). `tessera.decode` is the command line
around it (and re-exports these names); JAX is imported inside the functions, so importing this
module stays cheap.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tessera.models import ModelDef


def sample(logits_bv, key, temperature: float, top_k: int, top_p: float = 1.0):
    """Next token ids [B] from logits [B, V]: the argmax when temperature == 0, else a draw from
    softmax(logits / temperature) restricted to the top_k most likely tokens (exactly k: ties at
    the k-th go to the lower token id; top_k=0, or at least V: all), then to the fewest of those,
    most likely first, whose probabilities in that distribution add up to top_p or more (nucleus
    sampling; the most likely token always stays; top_p=1: all). The logits are shifted so that
    the largest is 0 before they are divided: a temperature near 0 leaves the largest alone (no
    inf - inf), as greedy would."""
    import jax
    import jax.numpy as jnp

    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv.astype(jnp.float32)
    divisor = jnp.float32(max(temperature, float(np.finfo(np.float32).tiny)))  # 1e-46 is 0 in float32
    logits_bv = logits_bv - jnp.max(logits_bv, axis=-1, keepdims=True)
    vocab = logits_bv.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k == vocab and top_p >= 1.0:
        return jax.random.categorical(key, logits_bv / divisor, axis=-1).astype(jnp.int32)
    # most likely first, ranked before the division: a temperature near 3.4e38 makes every difference a
    # subnormal that is flushed to 0, and the top k were then the k lowest ids, not the k most likely
    values_bk, ids_bk = jax.lax.top_k(logits_bv, k)
    values_bk = values_bk / divisor
    if top_p < 1.0:
        probs_bk = jax.nn.softmax(values_bk, axis=-1)
        before_bk = jnp.cumsum(probs_bk, axis=-1) - probs_bk  # the probability of the tokens ahead
        keep_bk = (before_bk < top_p) | (jnp.arange(k) == 0)
        values_bk = jnp.where(keep_bk, values_bk, -jnp.inf)
    choice_b1 = jax.random.categorical(key, values_bk, axis=-1)[:, None]
    return jnp.take_along_axis(ids_bk, choice_b1, axis=-1)[:, 0].astype(jnp.int32)


def _whole(value) -> bool:
    """An int (Python's or NumPy's), and not a bool: True was taken as 1 (top_k=True kept one token)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _real(value) -> bool:
    """A real number, and not a bool; a string was a TypeError traceback from a comparison."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """ValueError naming each sampling argument `sample` cannot honour (a negative or nan temperature
    sampled greedily, or token 0 every time, without a word; so did a top_p of 0 or nan)."""
    wrong = [f"{name}={value!r} {rule}" for name, value, ok, rule in (
        ("temperature", temperature, _real(temperature) and 0 <= temperature <= float(np.finfo(np.float32).max),
         "must be a number from 0 (greedy) to the largest float32"),
        ("top_k", top_k, _whole(top_k) and top_k >= 0, "must be a whole number >= 0 (0: all)"),
        ("top_p", top_p, _real(top_p) and 0 < top_p <= 1, "must be in (0, 1] (1: all tokens)"),
    ) if not ok]  # each written so that nan fails it
    if wrong:
        raise ValueError("; ".join(wrong))


def stop_ids(eos_id) -> list:
    """`generate`'s eos_id as a list of stop tokens: None -> [], one id -> [it], several (a list, tuple or
    1-D array: Llama 3's instruct models end a turn with <|eot_id|> and a text with <|end_of_text|>) -> them."""
    if eos_id is None:
        return []
    if isinstance(eos_id, (list, tuple)) or (isinstance(eos_id, np.ndarray) and eos_id.ndim == 1):
        return list(eos_id)
    return [eos_id]


def check_ids(prompts: list[list[int]], max_new_tokens: int, eos_id, vocab_size: int) -> None:
    """ValueError for what `generate` cannot decode: a token id outside [0, vocab_size) (-1 was read
    as the last token of the table and vocab_size or more gave nan logits, then token 0, without a
    word), an eos_id (or one of several) no row can produce, a max_new_tokens that is not a whole number."""
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not (_whole(t) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"prompt {i + 1} has token ids outside [0, vocab_size={vocab_size}): {bad[:5]}")
    if not _whole(max_new_tokens):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a whole number >= 1")
    for stop in stop_ids(eos_id):
        if not (_whole(stop) and 0 <= stop < vocab_size):
            raise ValueError(f"eos_id={stop!r} is not a token id in [0, vocab_size={vocab_size}): no row would stop "
                             "at it; give None to decode max_new_tokens tokens")


def left_padded(prompts: list[list[int]], width: int = 0):
    """(tokens, positions, segment ids), each int32 [B, P]: prompts right-aligned, padding with
    segment id 0; positions count each prompt's tokens from 0. P: `width`, at least the longest."""
    width = max(width, *(len(p) for p in prompts))
    tokens, positions, segments = (np.zeros((len(prompts), width), np.int32) for _ in range(3))
    for row, prompt in enumerate(prompts):
        start = width - len(prompt)
        tokens[row, start:], positions[row, start:], segments[row, start:] = prompt, np.arange(len(prompt)), 1
    return tokens, positions, segments


def _decode_step(params, tokens_bt, positions_bt, segment_ids_bt, cache, key_data, *, model: ModelDef,
                 temperature: float, top_k: int, top_p: float = 1.0):
    """(next tokens [B], their logits [B, V], whether each row's logits hold no NaN and no +inf [B],
    cache) after the tokens [B, T] (the prompt, then one token). Tokens, logits and flags come back
    whole on every device, so that every process can read them."""
    import jax
    import jax.numpy as jnp

    from tessera.mesh import shard_logically

    logits_bv, cache = model.next_logits(params, tokens_bt, positions_bt, segment_ids_bt, cache)
    token_b = sample(logits_bv, jax.random.wrap_key_data(key_data), temperature, top_k, top_p)
    finite_b = ~jnp.any(jnp.isnan(logits_bv) | (logits_bv == jnp.inf), axis=-1)
    return (shard_logically(token_b, (None,)), shard_logically(logits_bv, (None, None)),
            shard_logically(finite_b, (None,)), cache)


class NonFiniteLogits(ValueError):
    """`generate`: a row's logits hold NaN or +inf, from which argmax and sampling give token 0 (or
    any token) without a word."""


def _check_finite(finite_b: np.ndarray, step: int, dtype: str) -> None:
    """NonFiniteLogits naming the first row (prompt) whose flag from `_decode_step` is false."""
    bad = np.flatnonzero(~finite_b)
    if bad.size:
        raise NonFiniteLogits(
            f"the logits of prompt {bad[0] + 1} hold NaN or inf at new token {step + 1}, so its tokens would be "
            "meaningless (token 0 every time): the parameters hold NaN or inf" + (
                ", or the activations overflow dtype=float16 (at most 65504): try dtype=bfloat16"
                if dtype == "float16" else ""))


@functools.cache
def _jitted_decode_step():
    import jax

    return jax.jit(_decode_step, static_argnames=("model", "temperature", "top_k", "top_p"), donate_argnames="cache")


def cache_shape(prompts: list[list[int]], max_new_tokens: int, ways: int = 1, width: int = 0) -> tuple[int, int]:
    """(rows, tokens) of the KV cache `generate` creates on a mesh whose batch axes split rows
    `ways` ways (`batch_ways`): the prompts are left-padded to the longest (or to `width`,
    `prompt_width`), and their number is rounded up to a multiple of `ways` (`batch_rows`)."""
    return batch_rows(len(prompts), ways), max(width, *map(len, prompts)) + max_new_tokens


def prompt_width(prompts: list[list[int]], attention_kernel: str = "dot_product") -> int:
    """The width the prompts are left-padded to for their prefill: the longest prompt, rounded up
    to a multiple of 128 when the prefill runs splash attention, which tiles the sequence so."""
    from tessera.models.splash import LANE

    width = max(map(len, prompts))
    return -(-width // LANE) * LANE if attention_kernel.startswith("splash") else width


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
    return _jitted_empty_cache()(model, rows, tokens)


@functools.cache
def _jitted_empty_cache():
    """One jitted function for every `empty_cache`: a new one per call was a program compiled at every
    `generate` call, for the same model and cache shape too."""
    import jax

    from tessera.models.kv_cache import KVCache

    return jax.jit(lambda model, rows, tokens: KVCache.shard_tree(model.init_cache(rows, tokens)),
                   static_argnums=(0, 1, 2))


def _inputs_sharding():
    """Where `generate` puts the prompts and the random key when several processes decode together:
    whole on every device of the current mesh (None for one process, which passes them as they are)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.get_mesh()
    if jax.process_count() == 1 or mesh.empty:
        return None
    return NamedSharding(mesh, PartitionSpec())


def _as_input(a: np.ndarray, sharding):
    """`a` as a decoding step's input: itself, or with `sharding` (`_inputs_sharding`) a global
    array that every process builds from its own copy of `a` (the same on each of them)."""
    import jax

    return a if sharding is None else jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def _key_data(key) -> np.ndarray:
    """A random key's raw bits (uint32): plain numbers, which go into a global array like the tokens."""
    import jax

    return np.asarray(jax.random.key_data(key))


def prefill_program(model: ModelDef, params, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0):
    """`generate`'s first call (the prompts' prefill) for these arguments, compiled ahead of time
    for the current mesh from shapes alone (`params` may be ShapeDtypeStructs with shardings):
    `decode.py` reads its temporaries for the memory check before loading anything, then hands it
    to `generate`, which runs it instead of compiling the prefill again."""
    import jax
    import jax.numpy as jnp

    from tessera.models.kv_cache import KVCache

    width = prompt_width(prompts, model.attention_kernel)
    rows, tokens = cache_shape(prompts, max_new_tokens, batch_ways(jax.sharding.get_abstract_mesh()), width)
    prompt = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=_inputs_sharding())
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=_inputs_sharding())
    cache = KVCache.as_empty(cache_abstract(model, rows, tokens))
    return _jitted_decode_step().lower(params, prompt, prompt, prompt, cache, key,
                                       model=model, temperature=temperature, top_k=top_k, top_p=top_p).compile()


def generate(model: ModelDef, params, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, eos_id: int | list[int] | None = None, return_logits: bool = False,
             prefill=None, top_p: float = 1.0):
    """The tokens generated for each prompt (prompt not included), ending at eos_id when a row
    produces it (eos_id may be a list of stop tokens: a row ends at the first it produces). With
    `return_logits`, also each row's logits [n, V] (float32 numpy), the i-th row being the distribution the i-th new token was drawn from. `prefill`: the first call
    compiled already for these arguments (`prefill_program`).

    Under a mesh (`jax.set_mesh`) the batch of prompts is split over its batch axes (`batch_ways`),
    and so is the KV cache. A number of prompts those do not divide is made up with one-token rows
    whose output is dropped: each device then decodes and caches its share of rows instead of a
    copy of all of them. A row whose logits hold NaN or inf (NaN parameters, float16 overflowing) is a
    NonFiniteLogits error: argmax and sampling gave token 0 for it without a word."""
    import jax

    from tessera.models.kv_cache import KVCache
    from tessera.seeds import prng_key

    prompts = _as_prompts(prompts)  # a 2-D numpy array of prompts was a traceback ('truth value of an array')
    _check_request(model, prompts, max_new_tokens, eos_id)
    check_sampling(temperature, top_k, top_p)
    if not _whole(seed):  # 1.5 was a TypeError traceback from the key's bit operations; True was seed 1
        raise ValueError(f"seed={seed!r} must be a whole number (any int; taken modulo 2^64)")
    lengths, stops = np.array([len(p) for p in prompts], np.int32), stop_ids(eos_id)
    step = functools.partial(_jitted_decode_step(), model=model, temperature=temperature, top_k=top_k, top_p=top_p)
    width = prompt_width(prompts, model.attention_kernel)
    rows, length = cache_shape(prompts, max_new_tokens, batch_ways(jax.sharding.get_abstract_mesh()), width)
    filler = rows - len(prompts)
    tokens_bt, positions_bt, segment_ids_bt = left_padded(prompts + [[0]] * filler, width)
    lengths = np.concatenate([lengths, np.ones(filler, np.int32)])
    cache = KVCache.as_empty(empty_cache(model, rows, length))  # the first call's tokens see only each other
    key = prng_key(seed)
    global_ = functools.partial(_as_input, sharding=_inputs_sharding())
    new_tokens, new_logits = [], []
    done = np.arange(rows) >= len(prompts)  # the filler rows count as done from the start
    for i in range(max_new_tokens):
        call = prefill if i == 0 and prefill is not None else step
        token_b, logits_bv, finite_b, cache = call(params, global_(tokens_bt), global_(positions_bt),
                                                   global_(segment_ids_bt), cache,
                                                   global_(_key_data(jax.random.fold_in(key, i))))
        token_b = np.asarray(token_b)
        _check_finite(np.asarray(finite_b) | done, i, model.cfg.dtype)
        new_tokens.append(np.where(done, -1, token_b))  # -1: the row had already stopped
        if return_logits:
            new_logits.append(np.asarray(logits_bv))
        if stops:
            done |= np.isin(token_b, stops)
            if done.all():
                break
        tokens_bt, positions_bt = token_b[:, None], (lengths + i)[:, None]
        segment_ids_bt = np.ones_like(tokens_bt)
    out = [[int(t) for t in row if t >= 0] for row in np.stack(new_tokens, axis=1)[:len(prompts)]]
    if not return_logits:
        return out
    return out, [np.stack(new_logits, axis=1)[row, :len(toks)] for row, toks in enumerate(out)]


def _as_prompts(prompts) -> list[list]:
    """`generate`'s prompts as a list of lists; ValueError for what is not a list of prompts (one prompt
    given as [1, 2, 3], or None, was a TypeError traceback: "'int' object is not iterable")."""
    try:
        return [list(p) for p in prompts]
    except TypeError:
        raise ValueError(f"prompts={prompts!r:.60} is not a list of prompts, each a list of token ids: give one "
                         "prompt as [[1, 2, 3]]") from None


def _check_request(model: ModelDef, prompts: list[list[int]], max_new_tokens: int, eos_id) -> None:
    """ValueError for prompts or a length `generate` cannot serve: none, an empty one, ids outside the
    vocabulary, a max_new_tokens that is not a whole number >= 1 (a string or None was a TypeError
    traceback), or more positions than a model with a position table has."""
    from tessera.models import BLOCKS

    if not _whole(max_new_tokens):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a whole number >= 1")
    if not prompts or any(len(p) == 0 for p in prompts) or max_new_tokens < 1:
        raise ValueError("give at least one prompt, each of at least one token, and max_new_tokens >= 1")
    check_ids(prompts, max_new_tokens, eos_id, model.cfg.vocab_size)
    longest = max(len(p) for p in prompts)
    table = model.cfg.trainable_position_size if BLOCKS[model.cfg.decoder_block].absolute_positions else 0
    if table and longest + max_new_tokens > table:
        raise ValueError(f"{longest} prompt tokens + {max_new_tokens} new tokens exceed the "
                         f"trainable_position_size={table} positions this model has embeddings for")


def cache_abstract(model: ModelDef, rows: int, tokens: int, mesh=None):
    """The KV cache `empty_cache` creates, as ShapeDtypeStructs laid out over `mesh` (default: the
    current one; none: unsharded)."""
    import jax
    from jax.sharding import NamedSharding

    from tessera.mesh import logical_spec
    from tessera.models.kv_cache import KVCache

    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    shapes = jax.eval_shape(lambda: model.init_cache(rows, tokens))
    if mesh.empty:
        return shapes
    leaves, treedef = jax.tree.flatten(shapes)
    return treedef.unflatten([
        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                             sharding=NamedSharding(mesh, logical_spec(names, leaf.shape, dict(mesh.shape))))
        for leaf, names in zip(leaves, KVCache.tree_logical_axes(shapes))])


def kv_cache_bytes(model: ModelDef, rows: int, tokens: int, mesh=None) -> int:
    """Bytes of the KV cache `generate` creates for `rows` prompts of up to `tokens` tokens (prompt
    and new ones): all of it, or with `mesh`, what one device of it holds (`empty_cache`)."""
    import jax

    from tessera.memory_fit import bytes_per_device

    if mesh is None:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(jax.eval_shape(
            lambda: model.init_cache(rows, tokens))))
    leaves = jax.tree.leaves(cache_abstract(model, rows, tokens, mesh))
    return bytes_per_device(leaves, [leaf.sharding for leaf in leaves])
