"""Convert checkpoints between Hugging Face (config.json + safetensors) and Tessera (Orbax).

    .venv/bin/python -m tessera.tools.convert hf-to-tessera <hf_dir> <out_dir> model_name=mistral-7b [key=value ...]
    .venv/bin/python -m tessera.tools.convert tessera-to-hf <checkpoint> <out_dir> model_name=mistral-7b [key=value ...]

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
plus `config.json` (whose max_position_embeddings is the length the parameters handle:
hf_config_out.trained_length); RAM holds one shard being assembled plus one restored parameter. hf-to-tessera followed by tessera-to-hf gives back the same tensors, bit for
bit, when weight_dtype is the checkpoint's dtype. Relative paths are read from the working
directory; tessera-to-hf's checkpoint may also be a gs:// URL (the other folders are local).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from tqdm import tqdm

from tessera.config import Config, ConfigError
from tessera.tools.cli import UsageError, command_logging, exit_if_help, help_text, resolve_path, split_overrides, take_options
from tessera.tools.cli_signals import sigterm_raises
from tessera.tools.estimate import load_model_config
from tessera.tools.hf_configs import as_overrides, config_from_hf
from tessera.tools.hf_layouts import layout_for

log = logging.getLogger(__name__)

USAGE = (
    ".venv/bin/python -m tessera.tools.convert hf-to-tessera <hf_dir> <out_dir> model_name=<name> [key=value ...]\n"
    "       .venv/bin/python -m tessera.tools.convert tessera-to-hf <checkpoint> <out_dir> model_name=<name> [key=value ...]"
    " [--max-shard-size BYTES]"
)
OPTIONS = {"--max-shard-size": str(5 * 2**30)}
# Hugging Face tensors that are buffers or duplicates, never parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
# the other parts of a multimodal checkpoint (hf_configs.HF_MULTIMODAL), left out of the conversion
OTHER_MODALITIES = ("vision_model.", "vision_tower.", "multi_modal_projector.")  # Llama 4's, Gemma 3's, both


def check_same_model(cfg: Config, hf_config: dict) -> None:
    """ConfigError listing every model key where the config and the checkpoint disagree."""
    from tessera.config import build_config

    wanted = _as_olmo3(config_from_hf(hf_config), cfg.model)
    expected = build_config(wanted).model
    sized = {"base_emb_dim": "emb_dim", "base_num_query_heads": "num_query_heads", "base_num_kv_heads": "num_kv_heads",
             "base_mlp_dim": "mlp_dim", "base_num_decoder_layers": "num_decoder_layers"}
    problems = []
    for name in wanted:
        if name == "global_parameter_scale":
            continue
        attr = sized.get(name, name)
        # the local layers' theta as built: -1 in a model file is the global layers' theta, which a checkpoint gives
        built = "local_rope_theta" if name == "local_rope_max_timescale" else attr
        ours, theirs = getattr(cfg.model, built), getattr(expected, built)
        if ours != theirs:
            problems.append(f"  {attr}: checkpoint {theirs!r}, config {ours!r}  (set {as_overrides({name: wanted[name]})[0]})")
    scale = cfg.model.global_parameter_scale
    if scale != 1 and any(f"(set {name}=" in p for name in sized for p in problems):  # base_* values multiply by it
        problems.insert(0, f"  global_parameter_scale: checkpoint 1, config {scale}  (set global_parameter_scale=1: "
                           "the base_* sizes below are multiplied by it)")
    if problems:
        raise ConfigError("the checkpoint's config.json describes another model than the Tessera config:\n"
                          + "\n".join(problems))


def _as_olmo3(wanted: dict, m) -> dict:
    """An OLMo 2 checkpoint's keys as decoder_block=olmo3 keys when the config asks for olmo3: OLMo 2 is olmo3 without
    windows whose local layers rotate at the global theta (the same function in 4-layer blocks), so it converts into
    that (a scaled OLMo 2 rotary, every layer's, is not olmo3's, and is refused as another model)."""
    if wanted["decoder_block"] != "olmo2" or m.decoder_block != "olmo3" or wanted.get("rope_scaling", "none") != "none":
        return wanted
    return {**wanted, "decoder_block": "olmo3", "sliding_window_size": 0,
            "local_rope_max_timescale": wanted["rope_max_timescale"]}


def hf_to_tessera(hf_dir: Path, out_dir: Path, cfg: Config) -> Path:
    """Write the Hugging Face checkpoint in `hf_dir` as a Tessera params checkpoint in `out_dir`."""
    from tessera.tools import hf_checkpoint, hf_reader  # JAX and Orbax: imported when converting, not for --help

    reader = hf_reader.Reader(hf_dir)
    check_same_model(cfg, reader.config)
    _check_mtp(cfg.model, reader.config)
    if out_dir.exists():
        raise ConfigError(f"{out_dir} already exists; choose a new output folder (nothing was written)")
    m = cfg.model
    layout = layout_for(m)
    targets = hf_checkpoint.param_targets(cfg)  # our path -> ShapeDtypeStruct
    used: set[str] = set()
    jobs = hf_checkpoint.expand(layout, m.num_decoder_layers, m.scan_layers)
    # every tensor named before any is read: a wrong family or a missing tensor fails in seconds, not at the end
    used.update(n for rule, _, _, fmt in jobs for n in map(fmt, rule.hf))
    _check_all_present(reader.names, used)
    used.update(_mtp_tensors(reader.names, m))
    _check_all_used(reader.names, used, m.logits_via_embedding)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # a new folder of its own beside the output (the same disk): it never deletes one that was there before
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".scratch", dir=out_dir.parent))
    arrays = hf_checkpoint.ScratchArrays(scratch, targets)
    others = _orbax_temporaries(out_dir)  # Orbax writes `<out>.orbax-checkpoint-tmp...` first: those were not ours
    try:
        for rule, prefix, index, fmt in tqdm(jobs, desc="hf-to-tessera", unit="tensor", file=sys.stderr,
                                        disable=None):
            names = [fmt(n) for n in rule.hf]
            shapes = [_layer_shape(targets[prefix + path], index) for path in rule.ours]
            for path, value in zip(rule.ours, _to_ours(rule, names, [reader.get(n) for n in names], shapes)):
                arrays.put(prefix + path, index, value)
        arrays.check_complete()
        # Orbax's writer threads cannot be stopped halfway: a Ctrl-C waits for the write to end, then removes it
        with _interrupts_held("the checkpoint write in progress ends; it is then removed"):
            hf_checkpoint.save_params(out_dir, arrays.tree(), source_config=reader.config)
        with _interrupts_held():  # a Ctrl-C during the removal left the scratch copy of the model behind
            _remove([scratch], arrays)
    except BaseException:  # a damaged input, a full disk, Ctrl-C: what this conversion wrote is removed
        with _interrupts_held():
            _remove([scratch, out_dir, *(_orbax_temporaries(out_dir) - others)], arrays)
        raise
    return out_dir


def _remove(folders: list[Path], arrays) -> None:
    arrays.close()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _orbax_temporaries(out_dir: Path) -> set[Path]:
    from tessera.checkpointing import INCOMPLETE_MARKER

    name = out_dir.name + INCOMPLETE_MARKER
    return {p for p in out_dir.parent.iterdir() if p.name.startswith(name)}


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit, `kill`), raised by `sigterm_raises`: stopped as Ctrl-C is, what
    the conversion wrote removed, exit 143. Python's default ended the process on the spot, leaving the
    scratch copy of the model behind."""


@contextlib.contextmanager
def _interrupts_held(until: str = ""):
    """Ctrl-C and SIGTERM held back until the block ends, then raised: for work that must not stop halfway
    (`until` says what it waits for, logged at the first signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(number, frame):
        if until and not caught:
            log.warning("interrupted: stopping once %s", until)
        caught.append(number)

    previous = {number: signal.signal(number, hold) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if caught:
        raise Terminated if signal.SIGTERM in caught else KeyboardInterrupt


def _layer_shape(target, index: int | None) -> tuple[int, ...]:
    """The shape of one layer's slice of a parameter (`index` in its stacked axis), or its whole shape."""
    return tuple(target.shape if index is None else target.shape[1:])


def _to_ours(rule, names: list[str], tensors: list, shapes: list[tuple[int, ...]]) -> tuple:
    """rule.to_ours(*tensors), checked: each of our arrays has its shape in `shapes`, and the tensors
    have the shapes the rule maps them from. A reshape alone would take a tensor of the right size in
    another shape (stored transposed) and scramble it; going back (to_hf) must give the shapes read.
    ConfigError naming the tensors, their dtypes and shapes otherwise."""
    ints = [f"{n} ({t.dtype})" for n, t in zip(names, tensors) if t.dtype.kind in "biuO"]
    if ints:
        raise ConfigError(f"tensor {', '.join(ints)} holds integers, not weights (a quantized checkpoint?); the "
                          "converter reads float32, bfloat16 and float16 tensors (and gpt-oss's MXFP4 experts)")
    try:
        values = rule.to_ours(*tensors)
        back = rule.to_hf(*values) if values else tensors  # () for tensors not read (DeepSeek's MTP copies)
        fits = ([tuple(v.shape) for v in values] == shapes or not values) and \
            [b.shape for b in back] == [t.shape for t in tensors]
    except ValueError:  # stacking or reshaping tensors of other sizes
        fits = False
    if fits:
        return values
    import numpy as np

    wanted = [tuple(t.shape) for t in rule.to_hf(*(np.zeros(s, np.float32) for s in shapes))]
    given = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors))
    raise ConfigError(f"the checkpoint's tensor shapes do not fit this model: {given}, where it needs "
                      f"{', '.join(map(str, wanted))}; does config.json describe these tensors?")


def _check_all_present(names, needed: set[str]) -> None:
    present = set(names)
    missing = sorted(n for n in needed if n not in present)
    if missing:
        shown = ", ".join(map(repr, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConfigError(f"the checkpoint has no tensor {shown}; is model_name (or decoder_block) right?")


def _mtp_tensors(names, m) -> list[str]:
    """DeepSeek-V3's multi-token-prediction layers (stored after the last decoder layer) past the
    config's mtp_num_layers, and Qwen3-Next's (mtp.*, which transformers does not load either): left
    out of the conversion, with a log line."""
    if m.decoder_block == "qwen3_next":
        mtp = [n for n in names if n.startswith("mtp.")]
        if mtp:
            log.info("left out %d tensors of Qwen3-Next's multi-token-prediction layer (mtp.*; Tessera's qwen3_next "
                     "does not build it, nor does transformers' Qwen3NextForCausalLM)", len(mtp))
        return mtp
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
        if any(n.endswith("_scale_inv") for n in left):  # a block scale whose float8 weight is not there
            raise ConfigError(f"{len(left)} tensors of the checkpoint have no place in this Tessera model: {shown}; "
                              "a *_scale_inv tensor is the block scale of the float8 weight of the same name without "
                              "the suffix, which this checkpoint does not have: is it whole?")
        raise ConfigError(f"{len(left)} tensors of the checkpoint have no place in this Tessera model: {shown}; "
                          "is model_name (or decoder_block) the right family?")


def tessera_to_hf(checkpoint: str, out_dir: Path, cfg: Config, max_shard_size: int) -> Path:
    """Write a Tessera checkpoint's parameters as a Hugging Face checkpoint in `out_dir`."""
    from tessera.tools import hf_checkpoint, hf_config_out

    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} is not empty; choose a new output folder (nothing was written)")
    m = cfg.model
    layout = layout_for(m)
    if m.mtp_num_layers and not layout.mtp_rules:
        log.info("left out the %d multi-token-prediction depths (mtp_*): the Hugging Face format of "
                 "decoder_block=%s has no place for them", m.mtp_num_layers, m.decoder_block)
    # a training step keeps its config: a load that does not fit names the model keys that differ, and one that
    # fits with other model keys (a rotary base, a window) is said to compute something else, as train.py says
    from tessera.checkpointing import mismatch_explained, quantized_explained, warn_model_changes

    model_keys = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
    with quantized_explained(checkpoint, None, "convert the float checkpoint they were written from"), \
            mismatch_explained(checkpoint, model_keys):
        source = hf_checkpoint.ParamSource(checkpoint, hf_checkpoint.param_targets(cfg))
    warn_model_changes(checkpoint, model_keys)
    trained, notes = hf_config_out.trained_length(checkpoint, cfg)
    config = hf_config_out.hf_config(m, trained)  # a model its config.json cannot describe is refused before any write
    notes = notes if "max_position_embeddings" in config else []  # GPT-2's n_positions is its position table's size
    made = not out_dir.exists()
    writer = hf_checkpoint.ShardWriter(out_dir, max_shard_size)
    jobs = hf_checkpoint.expand(layout, m.num_decoder_layers, m.scan_layers)
    try:
        for rule, prefix, index, fmt in tqdm(jobs, desc="tessera-to-hf", unit="tensor", file=sys.stderr,
                                            disable=None):
            values = rule.to_hf(*(source.get(prefix + path, index) for path in rule.ours))
            for name, value in zip(rule.hf, values):
                writer.add(fmt(name), value)
        writer.close()
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for level, note in notes:  # after the write: a failed export's error line stays its only output
            log.log(level, note)
    except BaseException:  # a damaged checkpoint, a full disk, Ctrl-C: leave no half-written output behind
        with _interrupts_held():
            for path in [out_dir] if made else list(out_dir.iterdir()):  # an empty folder given: its contents
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        raise
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
    # imported first: it imports absl.logging, which makes the "absl" logger an ABSLLogger. Created before as a
    # plain Logger by command_logging's getLogger, its records name absl's file, not Orbax's, and quiet_orbax_logs
    # let Orbax's ERROR records through (two tracebacks before the one-line error of a full disk)
    from tessera.checkpointing.storage import quiet_orbax_logs

    quiet_orbax_logs()  # Orbax's own ERROR records (with tracebacks) of what is reported here in one line
    # the log lines on stderr: dtype casts, checksums, tensors left out (as train.py and decode.py); the caller's
    # logging again afterwards
    with command_logging():
        return _main_logged(argv)


def _main_logged(argv: list[str]) -> int:
    from tessera.checkpointing import CheckpointError

    try:
        with sigterm_raises(Terminated):
            return _run(argv)
    except (ConfigError, UsageError, CheckpointError) as e:
        print(f"{'checkpoint ' if isinstance(e, CheckpointError) else ''}error: {e}", file=sys.stderr)
        return 2
    except (OSError, KeyboardInterrupt) as e:  # a full disk mid-write, Ctrl-C: the partial output is removed
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)" \
            if isinstance(e, KeyboardInterrupt) else f"writing failed: {e}"
        print(f"error: {what}; nothing was written (the partial output was removed): convert again", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130 if isinstance(e, KeyboardInterrupt) else 2


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
    # pathlib would make gs://b/x the local folder gs:/b/x: only tessera-to-hf's checkpoint is read from a bucket
    for text, name in ((out, "output folder"), *([(source, what)] if command == "hf-to-tessera" else [])):
        if "://" in text:
            raise UsageError(f"{name} {text}: the converter reads and writes local folders here; copy the model to a "
                             "local folder first, or convert into one and copy that to the bucket afterwards")
    source, out = resolve_path(source, what), resolve_path(out, "output folder", must_exist=False)
    if any(k.strip() == "checkpoint_is_quantized" and v.strip().lower() in ("true", "1") for k, _, v in
           (o.partition("=") for o in overrides)):  # the loader's check asked for load_parameters_path, not used here
        raise UsageError("checkpoint_is_quantized=true: the converter reads float checkpoints only (a quantized one "
                         "is decode.py's); convert the float checkpoint it was written from, and leave the key out")
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
