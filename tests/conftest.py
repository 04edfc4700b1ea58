"""Test set-up: CPU only, 8 fake devices. Must run before JAX is imported anywhere."""

import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

import jax  # noqa: E402
import pytest  # noqa: E402

from tessera.config import build_config  # noqa: E402

# Small, mostly odd sizes so that a mixed-up dimension fails loudly.
TINY = dict(
    base_emb_dim=24, base_num_query_heads=4, base_num_kv_heads=2, head_dim=6, base_mlp_dim=40,
    base_num_decoder_layers=3, vocab_size=96, max_target_length=12, per_device_batch_size=1,
    steps=3, log_period=1, enable_tensorboard=False, report_warmup_steps=0, remat_policy="none",
    learning_rate=1e-2, warmup_steps_fraction=0.0,
)


def tiny_config(tmp_path=None, **overrides):
    values = dict(TINY)
    if tmp_path is not None:
        values["base_output_directory"] = str(tmp_path)
        values["run_name"] = "test"
    values.update(overrides)
    return build_config(values)


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "tests need 8 fake CPU devices (XLA_FLAGS set in conftest.py)"
