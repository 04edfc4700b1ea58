"""How bfloat16 matmuls run on XLA:CPU (`tessera.cpu_matmul`): the choice from the CPU's flags
or TESSERA_CPU_BF16_MATMUL, what `project` compiles in each mode, and that both modes compute
the same bfloat16 matmul (float32 accumulation, one rounding)."""

import logging
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera import cpu_matmul
from tessera.config import ConfigError, load_config
from test_checkpointing import REPO, TRAIN

MODES = ("native", "float32")


@pytest.mark.parametrize("flags, want", [
    ({"avx512f", "avx512_bf16"}, "native"),  # AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake and later)
    ({"amx_tile", "amx_bf16"}, "native"),  # AMX (Intel Sapphire Rapids and later)
    ({"avx512f", "avx512_vnni", "avx2"}, "float32"),  # AVX-512 without a bfloat16 dot product
    (set(), "float32"),  # no flags line (ARM, macOS, no /proc)
])
def test_auto_follows_the_cpus_bfloat16_dot_product_instructions(flags, want):
    mode, why = cpu_matmul.choose("auto", frozenset(flags))
    assert mode == want
    assert ("bfloat16 matmuls run natively" in why) == (want == "native")


@pytest.mark.parametrize("setting", MODES)
def test_an_explicit_setting_wins_over_the_flags(setting):
    for flags in (frozenset(), frozenset({"avx512_bf16"})):
        assert cpu_matmul.choose(setting, flags) == (setting, f"TESSERA_CPU_BF16_MATMUL={setting}")


def test_an_unknown_setting_is_a_config_error_that_names_the_choices():
    with pytest.raises(ConfigError, match=r"TESSERA_CPU_BF16_MATMUL='fast' is not one of auto, native, float32; "
                                          r"unset it"):
        cpu_matmul.choose("fast", frozenset())


def test_flags_are_read_from_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_matmul.cpu_flags(info) == {"fpu", "sse2", "avx512_bf16"}
    assert cpu_matmul.cpu_flags(tmp_path / "missing") == frozenset()
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_matmul.cpu_flags(tmp_path / "arm") == frozenset()  # ARM: not measured, so float32 copies


def _compiled_dot_operand_types(fn, *args) -> set[str]:
    """Element types of the operands of the matmuls in fn's compiled program, all of which must
    run in YNNPACK fusions (as the fused computations declare their parameters): a plain `dot`
    left in the program takes XLA:CPU's slow path in bfloat16."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    assert not re.search(r"\bdot\(", hlo[hlo.index("ENTRY"):]), "a matmul outside YNNPACK"
    types = set()
    for block in re.split(r"\n\n", hlo):
        if re.search(r"\bdot\(", block) and "ENTRY" not in block:  # a fused computation holding a matmul
            types.update(re.findall(r"= (bf16|f32)\[[\d,]*\]\{[\d,]*\} parameter\(", block))
    return types


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_projections_accumulate_in_float32_on_cpu(mode, monkeypatch):
    """In both modes a projection of bfloat16 operands is the float32 product rounded once to
    bfloat16: output, input gradient and weight gradient; "native" hands the matmul bfloat16
    operands and "float32" float32 copies (read from the compiled program)."""
    from tessera.models.layers import project

    monkeypatch.setenv(cpu_matmul.VAR, mode)
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (2, 700, 24), jnp.bfloat16)  # 1,400 tokens: a long float32 sum in dw
    w = jax.random.normal(ks[1], (24, 40), jnp.bfloat16)
    g = jax.random.normal(ks[2], (2, 700, 40), jnp.bfloat16)
    x32, w32, g32 = (a.astype(jnp.float32) for a in (x, w, g))
    out, vjp = jax.vjp(lambda x_, w_: project("btd,df->btf", x_, w_), x, w)
    assert out.dtype == jnp.bfloat16
    rounded = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    np.testing.assert_allclose(np.asarray(out, np.float32), rounded(jnp.einsum("btd,df->btf", x32, w32)), rtol=1e-2)
    dx, dw = vjp(g)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(dx, np.float32), rounded(jnp.einsum("btf,df->btd", g32, w32)), rtol=1e-2)
    # float32 accumulation: the bfloat16 weight gradient is within one rounding of the exact product
    # (accumulated in bfloat16, a sum of 1,400 terms would be off by far more)
    exact = np.einsum("btd,btf->df", np.asarray(x32, np.float64), np.asarray(g32, np.float64))
    np.testing.assert_allclose(np.asarray(dw, np.float64), exact, rtol=2**-8, atol=1e-6)
    # preferred_element_type=float32 (attention's scores): the float32 product, not rounded
    scores = project("btd,df->btf", x, w, preferred_element_type=jnp.float32)
    assert scores.dtype == jnp.float32
    np.testing.assert_allclose(scores, jnp.einsum("btd,df->btf", x32, w32), rtol=1e-6, atol=1e-5)

    def loss(x_, w_):
        return jnp.sum(project("btd,df->btf", x_, w_).astype(jnp.float32) ** 2)

    want = {"native": {"bf16"}, "float32": {"f32"}}[mode]
    assert _compiled_dot_operand_types(jax.grad(loss, argnums=(0, 1)), x, w) == want


def test_setup_checks_the_setting_and_logs_the_choice_for_bfloat16_on_cpu(monkeypatch, caplog):
    from tessera.step import setup

    argv = [str(REPO / "configs" / "base.yml"), "base_num_decoder_layers=1", "per_device_batch_size=1"]
    monkeypatch.setenv(cpu_matmul.VAR, "float32")
    with caplog.at_level(logging.INFO, logger="tessera"):
        setup(load_config([*argv, "dtype=bfloat16"], env={}), jax.devices()[:1])
        setup(load_config([*argv, "dtype=float32"], env={}), jax.devices()[:1])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bfloat16 matmuls on CPU")]
    assert lines == ["bfloat16 matmuls on CPU: float32 (TESSERA_CPU_BF16_MATMUL=float32)"]
    monkeypatch.setenv(cpu_matmul.VAR, "fast")
    with pytest.raises(ConfigError, match="TESSERA_CPU_BF16_MATMUL='fast'"):
        setup(load_config([*argv, "dtype=float32"], env={}), jax.devices()[:1])


def test_train_refuses_an_unknown_setting_with_one_line(tmp_path):
    proc = subprocess.run([*TRAIN, "run_name=x", f"base_output_directory={tmp_path}", "steps=1"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, cpu_matmul.VAR: "fast"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("config error: TESSERA_CPU_BF16_MATMUL='fast' is not one of auto, native, float32; unset it to let "
            "the CPU's flags decide (auto)") in proc.stderr
    assert not (tmp_path / "x" / "checkpoints").exists()
