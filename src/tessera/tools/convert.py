"""Convert checkpoints between Hugging Face (config.json + safetensors) and Tessera (Orbax).

    python3 -m tessera.tools.convert hf-to-tessera <hf_dir> <out_dir> model_name=mistral-7b [key=value ...]
    python3 -m tessera.tools.convert tessera-to-hf <checkpoint> <out_dir> model_name=mistral-7b [key=value ...]

hf-to-tessera reads `config.json` and the safetensors files (one file or a sharded set with
`model.safetensors.index.json`), checks that the Tessera config describes the same model
(every differing key is listed with the value to set), and writes an Orbax checkpoint holding
{"params": ...} in the layout the config asks for (`scan_layers` true or false) and in
`weight_dtype`. Train from it with `load_parameters_path=<out_dir>`. Memory stays bounded:
tensors are read one at a time into memory-mapped scratch files (in a new hidden folder beside
the output, deleted at the end); Orbax then writes them, copying about one model's worth at its
peak, never two (measured on a 1.35 GB float32 Llama: 1.9 GB peak anonymous memory, of which
~0.5 GB is Python and JAX).

tessera-to-hf restores one parameter at a time from a Tessera checkpoint (a training step
folder or a converted one) and writes safetensors shards of at most `--max-shard-size` bytes
plus `config.json`; RAM holds one shard being assembled plus one restored parameter. hf-to-tessera followed by tessera-to-hf gives back the same tensors, bit for
bit, when weight_dtype is the checkpoint's dtype. Relative paths are read from the working
directory; a checkpoint may also be a gs:// URL.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from tessera.config import Config, ConfigError
from tessera.tools.cli import UsageError, exit_if_help, help_text, resolve_path, split_overrides, take_options
from tessera.tools.estimate import load_model_config
from tessera.tools.hf_configs import as_overrides, config_from_hf
from tessera.tools.hf_layouts import layout_for

log = logging.getLogger(__name__)

USAGE = (
    "python3 -m tessera.tools.convert hf-to-tessera <hf_dir> <out_dir> model_name=<name> [key=value ...]\n"
    "       python3 -m tessera.tools.convert tessera-to-hf <checkpoint> <out_dir> model_name=<name> [key=value ...]"
    " [--max-shard-size BYTES]"
)
OPTIONS = {"--max-shard-size": str(5 * 2**30)}
# Hugging Face tensors that are buffers or duplicates, never parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
# the other parts of a multimodal checkpoint (hf_configs.HF_MULTIMODAL), left out of the conversion
OTHER_MODALITIES = ("vision_model.", "multi_modal_projector.")


def check_same_model(cfg: Config, hf_config: dict) -> None:
    """ConfigError listing every model key where the config and the checkpoint disagree."""
    from tessera.config import build_config

    wanted = config_from_hf(hf_config)
    expected = build_config(wanted).model
    sized = {"base_emb_dim": "emb_dim", "base_num_query_heads": "num_query_heads", "base_num_kv_heads": "num_kv_heads",
             "base_mlp_dim": "mlp_dim", "base_num_decoder_layers": "num_decoder_layers"}
    problems = []
    for name in wanted:
        if name == "global_parameter_scale":
            continue
        attr = sized.get(name, name)
        ours, theirs = getattr(cfg.model, attr), getattr(expected, attr)
        if ours != theirs:
            problems.append(f"  {attr}: checkpoint {theirs!r}, config {ours!r}  (set {as_overrides({name: wanted[name]})[0]})")
    if problems:
        raise ConfigError("the checkpoint's config.json describes another model than the Tessera config:\n"
                          + "\n".join(problems))


def hf_to_tessera(hf_dir: Path, out_dir: Path, cfg: Config) -> Path:
    """Write the Hugging Face checkpoint in `hf_dir` as a Tessera params checkpoint in `out_dir`."""
    from tessera.tools import hf_checkpoint  # JAX and Orbax: imported when converting, not for --help

    reader = hf_checkpoint.Reader(hf_dir)
    check_same_model(cfg, reader.config)
    _check_mtp(cfg.model, reader.config)
    if out_dir.exists():
        raise ConfigError(f"{out_dir} already exists; choose a new output folder (nothing was written)")
    m = cfg.model
    layout = layout_for(m)
    targets = hf_checkpoint.param_targets(cfg)  # our path -> ShapeDtypeStruct
    used: set[str] = set()
    jobs = hf_checkpoint.expand(layout, m.num_decoder_layers, m.scan_layers)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # a new folder of its own beside the output (the same disk): it never deletes one that was there before
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".scratch", dir=out_dir.parent))
    arrays = hf_checkpoint.ScratchArrays(scratch, targets)
    try:
        for rule, prefix, index, fmt in tqdm(jobs, desc="hf-to-tessera", unit="tensor", file=sys.stderr,
                                        disable=None):
            names = [fmt(n) for n in rule.hf]
            values = rule.to_ours(*(reader.get(n) for n in names))
            used.update(names)
            for path, value in zip(rule.ours, values):
                arrays.put(prefix + path, index, value)
        used.update(_mtp_tensors(reader.names, m))
        _check_all_used(reader.names, used, m.logits_via_embedding)
        arrays.check_complete()
        hf_checkpoint.save_params(out_dir, arrays.tree())
    finally:
        arrays.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir


def _mtp_tensors(names, m) -> list[str]:
    """DeepSeek-V3's multi-token-prediction layers (stored after the last decoder layer) past the
    config's mtp_num_layers: left out of the conversion, with a log line."""
    if m.decoder_block != "deepseek":
        return []
    first = m.num_decoder_layers + m.mtp_num_layers
    mtp = [n for n in names if (hit := re.match(r"model\.layers\.(\d+)\.", n)) and int(hit.group(1)) >= first]
    if mtp:
        log.info("left out %d tensors of DeepSeek's multi-token-prediction layers past mtp_num_layers=%d (set "
                 "mtp_num_layers to convert and train them)", len(mtp), m.mtp_num_layers)
    return mtp


def _check_mtp(m, hf_config: dict) -> None:
    """mtp_num_layers > 0 converts DeepSeek-V3's stored multi-token-prediction layers, no more than it has."""
    if not m.mtp_num_layers:
        return
    if m.decoder_block != "deepseek":
        raise ConfigError(f"mtp_num_layers={m.mtp_num_layers}: only DeepSeek-V3 checkpoints store multi-token-"
                          f"prediction layers, not decoder_block={m.decoder_block}'s; convert with mtp_num_layers=0")
    stored = hf_config.get("num_nextn_predict_layers") or 0
    if m.mtp_num_layers > stored:
        raise ConfigError(f"mtp_num_layers={m.mtp_num_layers}, but the checkpoint stores {stored} multi-token-"
                          f"prediction layers (num_nextn_predict_layers); set mtp_num_layers={stored} or fewer")


def _check_all_used(names, used: set[str], tied: bool) -> None:
    other = [n for n in names if n.startswith(OTHER_MODALITIES)]
    if other:
        log.info("left out %d tensors of the checkpoint's vision encoder and projector (Tessera trains the language "
                 "model)", len(other))
    left = [n for n in names if n not in used and not n.endswith(IGNORED_SUFFIXES)
            and not (tied and n == "lm_head.weight") and n not in other]
    if left:
        shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        raise ConfigError(f"{len(left)} tensors of the checkpoint have no place in this Tessera model: {shown}; "
                          "is model_name (or decoder_block) the right family?")


def tessera_to_hf(checkpoint: str, out_dir: Path, cfg: Config, max_shard_size: int) -> Path:
    """Write a Tessera checkpoint's parameters as a Hugging Face checkpoint in `out_dir`."""
    from tessera.tools import hf_checkpoint

    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} is not empty; choose a new output folder (nothing was written)")
    from tessera.checkpointing import CheckpointError

    m = cfg.model
    layout = layout_for(m)
    if m.mtp_num_layers and not layout.mtp_rules:
        log.info("left out the %d multi-token-prediction depths (mtp_*): the Hugging Face format of "
                 "decoder_block=%s has no place for them", m.mtp_num_layers, m.decoder_block)
    source = hf_checkpoint.ParamSource(checkpoint, hf_checkpoint.param_targets(cfg))
    made = not out_dir.exists()
    writer = hf_checkpoint.ShardWriter(out_dir, max_shard_size)
    jobs = hf_checkpoint.expand(layout, m.num_decoder_layers, m.scan_layers)
    try:
        for rule, prefix, index, fmt in tqdm(jobs, desc="tessera-to-hf", unit="tensor", file=sys.stderr,
                                            disable=None):
            values = rule.to_hf(*(source.get(prefix + path, index) for path in rule.ours))
            for name, value in zip(rule.hf, values):
                writer.add(fmt(name), value)
    except (CheckpointError, ConfigError):  # a damaged checkpoint: leave no half-written output behind
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    writer.close()
    (out_dir / "config.json").write_text(json.dumps(hf_checkpoint.hf_config(m), indent=2) + "\n")
    return out_dir


def convert_help() -> str:
    return help_text(
        USAGE,
        "Convert a Hugging Face checkpoint (config.json + safetensors) to a Tessera one, or back. The\n"
        "model keys must describe the checkpoint's model: hf-to-tessera lists each key that differs.",
        options=[("--max-shard-size BYTES", "tessera-to-hf: largest safetensors file to write (default 5 GiB)")],
        keys=("model_name", "scan_layers", "weight_dtype"), docs=("getting_started/Models.md",))


def main(argv: list[str]) -> int:
    exit_if_help(argv, convert_help)
    # the log lines on stderr: dtype casts, checksums, tensors left out (as train.py and decode.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    from tessera.checkpointing import CheckpointError

    try:
        return _run(argv)
    except (ConfigError, UsageError, CheckpointError) as e:
        print(f"{'checkpoint ' if isinstance(e, CheckpointError) else ''}error: {e}", file=sys.stderr)
        return 2
    except (OSError, KeyboardInterrupt) as e:  # a full disk mid-write, Ctrl-C: the output is incomplete
        what = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"writing failed: {e}"
        print(f"error: {what}; the output folder is incomplete: delete it and convert again", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 2


def _run(argv: list[str]) -> int:
    options, args = take_options(argv, OPTIONS)
    if not options["--max-shard-size"].isdigit():
        raise UsageError("--max-shard-size needs a number of bytes, e.g. --max-shard-size 5000000000")
    positional, overrides = split_overrides(args)
    if len(positional) != 3 or positional[0] not in ("hf-to-tessera", "tessera-to-hf"):
        raise UsageError(f"give hf-to-tessera or tessera-to-hf, then two folders (got {positional})\nusage: {USAGE}")
    command, source, out = positional
    if command == "hf-to-tessera" and any(a.partition("=")[0] == "--max-shard-size" for a in argv):
        raise UsageError("--max-shard-size sizes the safetensors files tessera-to-hf writes; hf-to-tessera writes an "
                         "Orbax checkpoint: leave the option out")
    what = "Hugging Face folder" if command == "hf-to-tessera" else "checkpoint"
    source, out = resolve_path(source, what), resolve_path(out, "output folder", must_exist=False)
    cfg = load_model_config(None, overrides)
    from tessera.checkpointing import check_writable  # before reading gigabytes: a parent that is a file, no permission

    check_writable(out, "output folder")
    if command == "hf-to-tessera":
        done = hf_to_tessera(Path(source), Path(out), cfg)
        print(f"wrote {done} (train from it with load_parameters_path={done})")
    else:
        done = tessera_to_hf(source, Path(out), cfg, int(options["--max-shard-size"]))
        print(f"wrote {done} (config.json and safetensors)")
    return 0


if __name__ == "__main__":
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    use_cpu_on_hosts_without_accelerators()
    sys.exit(main(sys.argv[1:]))
