"""How bfloat16 matmuls run on XLA:CPU: natively, or as float32 copies of their operands.

Why a choice. XLA:CPU runs a bfloat16 x bfloat16 matmul through its YNNPACK library. On a CPU
with a bfloat16 dot-product instruction (x86 AVX512-BF16 or AMX-BF16) that matmul is two to five
times as fast as the float32 one: measured on `benchmarks/cpu_llama.py`'s 2048^3 matmul, 0.95
against 0.48 TFLOP/s on an AMD EPYC with avx512_bf16, 1.60 against 0.30 on an Intel Xeon with
AMX. Without one, the library widens the operands itself
and the bfloat16 matmul is slower than the float32 one (0.76-0.84x on the earlier reference
machines, Intel and AMD hosts without the instruction). There the fastest bfloat16 matmul is the
float32 matmul of float32 copies. Both accumulate in float32 and round the result to bfloat16
once, so both are the same bfloat16 matmul up to the order of the float32 additions.

`tessera.models.layers.project` (every projection) asks `bf16_matmul()` when it traces a product
of bfloat16 operands only for XLA:CPU. (Attention's products do not ask: on XLA:CPU their queries,
keys and values are float32, see `tessera.models.attention.dot_product_attention`.) The answer:

    TESSERA_CPU_BF16_MATMUL=auto      the default: "native" when the host CPU advertises
                                      avx512_bf16 or amx_bf16 (Linux: /proc/cpuinfo's flags),
                                      else "float32" (also on ARM and macOS, not measured yet)
    TESSERA_CPU_BF16_MATMUL=native    bfloat16 operands straight into the matmul
    TESSERA_CPU_BF16_MATMUL=float32   float32 copies of bfloat16 operands, the result rounded

Each process decides for its own CPU. A multi-process CPU job over hosts of different CPU
models should set the variable to the same value everywhere, so every process compiles the
same program. Accelerators (TPU, GPU) are not affected: their matrix units take bfloat16
directly. Nothing here imports JAX.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from tessera.config import ConfigError

VAR = "TESSERA_CPU_BF16_MATMUL"
CHOICES = ("auto", "native", "float32")
# CPU flags (as /proc/cpuinfo spells them) of instructions that multiply bfloat16 pairs into
# float32 sums, which XLA:CPU's bfloat16 matmul uses
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The host CPU's feature flags (x86 Linux: the first `flags` line), or none when unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def choose(setting: str, flags: frozenset[str]) -> tuple[str, str]:
    """("native" or "float32", why) for a TESSERA_CPU_BF16_MATMUL setting on a CPU with `flags`."""
    if setting not in CHOICES:
        raise ConfigError(f"{VAR}={setting!r} is not one of {', '.join(CHOICES)}; unset it to let the "
                          "CPU's flags decide (auto)")
    if setting != "auto":
        return setting, f"{VAR}={setting}"
    found = [f for f in BF16_DOT_FLAGS if f in flags]
    if found:
        return "native", f"the CPU has {found[0]}: bfloat16 matmuls run natively"
    return "float32", (f"the CPU has none of {', '.join(BF16_DOT_FLAGS)}: bfloat16 operands are "
                       "multiplied as float32 copies, which is faster there")


@functools.cache
def _decided(setting: str) -> tuple[str, str]:
    return choose(setting, cpu_flags())


def decision() -> tuple[str, str]:
    """This process's ("native" or "float32", why); a bad TESSERA_CPU_BF16_MATMUL raises ConfigError."""
    return _decided(os.environ.get(VAR, "auto").strip() or "auto")


def bf16_matmul() -> str:
    """"native" or "float32": how XLA:CPU should multiply bfloat16 operands in this process."""
    return decision()[0]
