"""Random keys from the run's integer seeds (`init_weights_seed`, decode.py's `--seed`).

`jax.random.key(seed)` keeps only the low 32 bits of a seed unless 64-bit mode is on, so without
it `init_weights_seed=4294967296` starts from the same weights as `init_weights_seed=0`, and -1
from the same as 4294967295: a sweep over large or negative seeds would silently repeat runs.
`prng_key` takes the whole 64-bit seed, as JAX does in 64-bit mode. Seeds from 0 to 2^32-1 give
exactly the key `jax.random.key` gives, so their runs are unchanged.
"""

from __future__ import annotations

import numpy as np

SEED_BITS = 64
SEED_RANGE = 1 << (SEED_BITS - 1)  # seeds are signed 64-bit integers, as every integer config key is
_LOW = (1 << 32) - 1


def prng_key(seed: int):
    """The random key of `seed`, any Python int, taken modulo 2^64 (so the range of a signed
    64-bit integer, which config keys accept, maps one to one; `seed + 1` of the largest wraps to
    the smallest). With JAX's default generator (threefry) it is the key JAX's 64-bit mode makes
    of that seed; with another generator the high half is folded into the low half's key."""
    import jax

    bits = seed % (1 << SEED_BITS)
    high, low = bits >> 32, bits & _LOW
    if jax.config.jax_default_prng_impl == "threefry2x32":
        return jax.random.wrap_key_data(np.array([high, low], np.uint32), impl="threefry2x32")
    key = jax.random.key(low)
    return jax.random.fold_in(key, high) if high else key
