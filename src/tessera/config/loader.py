"""Build a `Config` from base.yml, a model file, `key=value` overrides and `M_<KEY>` variables.

Precedence, lowest first: `configs/base.yml` < `configs/models/<model_name>.yml` <
`key=value` on the command line < `M_<KEY>` environment variables. Every value is coerced to
the type the schema declares; anything wrong raises `ConfigError` with a message that names
the key, the value, where the value was set and what would be accepted. A value holding the
`<changeme>` placeholder (left in recipes and validation files for the user) is refused.
The model file is looked for in the `models/` folder beside the config file, then in the
repository's own `configs/models/` (so a copy of base.yml anywhere still finds every model).
Path keys (marked `path=` in the schema) are made absolute against the working directory here,
once (`resolve_paths`); URLs such as gs://... are kept.
"""

from __future__ import annotations

import dataclasses
import decimal
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from tessera.config.maxtext import maxtext_keys, translate
from tessera.config.schema import (HF_FILE_FORMATS, MOE_BLOCKS, SECTIONS, Config, ConfigError, ModelConfig, all_fields,
                                   path_keys)

ENV_PREFIX = "M_"
PLACEHOLDER = "<changeme>"  # a value left for the user to fill in (recipes, validation files)
REPO_MODELS = Path(__file__).resolve().parents[3] / "configs" / "models"  # the repository's own model files
INT_RANGE = (-2**63, 2**63 - 1)  # int64: what an integer key may hold (JAX and NumPy take no wider integer)


def load_config(argv: list[str], env: Mapping[str, str] | None = None) -> Config:
    """`argv` is `[path/to/base.yml, key=value, ...]` as given to train.py. An error about a value
    says where the value was set: base.yml, the model file, the command line or an M_<KEY> variable."""
    if not argv:
        raise ConfigError("no config file given; run e.g. `python3 train.py configs/base.yml run_name=demo`")
    env = os.environ if env is None else env
    base_path = Path(argv[0])
    # (source, values), lowest precedence first; the model file goes second once model_name is known
    errors: list[str] = []  # every problem found, reported together (unknown keys, bad values, ...)
    layers = [(source, _check_known(values, source, errors)) for source, values in (
        (str(base_path), _read_yaml(base_path, "config file", empty_ok=False)),
        ("the command line", _parse_overrides(argv[1:])), *_env_layers(env))]
    _refuse_placeholders(layers, errors)  # before model_name chooses a file
    model_name = _merge(layers).get("model_name", "default")
    if _is_placeholder(model_name):
        _raise_all(errors)  # no model file to read
    folders = model_folders(base_path)
    model_file = next((d / f"{model_name}.yml" for d in folders if (d / f"{model_name}.yml").is_file()), None)
    if model_file is None:
        known = sorted({p.stem for d in folders for p in d.glob("*.yml") if p.is_file()})
        _raise_all(errors + [_name_sources(
            f"model_name={model_name!r}: no file {model_name}.yml in {' or '.join(str(d) for d in folders)}. "
            f"Known models: {', '.join(known) or 'none'}", layers)])
    model = _read_yaml(model_file, "model file")
    if "model_name" in model and model["model_name"] != model_name:
        raise ConfigError(f"{model_file} sets model_name={model['model_name']!r}; remove that line")
    layers.insert(1, (str(model_file), _check_known(model, str(model_file), errors)))
    _refuse_placeholders(layers, errors)
    build_errors: list[str] = []
    cfg = _build({k: v for k, v in _merge(layers).items() if not _is_placeholder(v)}, build_errors)
    _raise_all(errors + [_name_sources(line, layers) for line in build_errors])
    return cfg


def model_folders(base_path: Path) -> list[Path]:
    """Where `model_name` files are looked for, first match wins: the `models/` folder beside the
    config file, then the repository's configs/models/ (once, when they are the same folder)."""
    folders: list[Path] = []
    for folder in (base_path.parent / "models", REPO_MODELS):
        if not any(os.path.realpath(folder) == os.path.realpath(f) for f in folders):
            folders.append(folder)
    return folders


def _raise_all(errors: list[str]) -> None:
    """One ConfigError listing every problem (each on its own line), if there is any."""
    errors = list(dict.fromkeys(errors))
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} problems in the config:\n  " + "\n  ".join(errors))


def _env_layers(env: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """One layer per M_<KEY> variable that names a config key or a MaxText key (other M_ variables
    are not ours)."""
    fields = {*all_fields(), *maxtext_keys()}
    return [(f"the environment variable {name}", {name[len(ENV_PREFIX):].lower(): value})
            for name, value in sorted(env.items())
            if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):].lower() in fields]


def _merge(layers: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {key: value for _, values in layers for key, value in values.items()}


def _name_sources(message: str, layers: list[tuple[str, dict[str, Any]]]) -> str:
    """`message` followed by where the keys it names (as `key=` or a snake_case key) were set."""
    where = {key: source for source, values in layers for key in values}
    found = re.findall(r"\b([a-z][a-z0-9_]*)(=?)", message)
    keys = list(dict.fromkeys(k for k, eq in found if k in where and (eq or "_" in k)))
    if len(keys) <= 1:
        return f"{message} (from {where[keys[0]]})" if keys else message
    by_source: dict[str, list[str]] = {}
    for k in keys:
        by_source.setdefault(where[k], []).append(k)
    parts = [" and ".join(ks) + f" from {source}" for source, ks in by_source.items()]
    return f"{message} ({'; '.join(parts)})"


def _refuse_placeholders(layers: list[tuple[str, dict[str, Any]]], errors: list[str]) -> None:
    """No value (a string, or a list of strings) may still hold the `<changeme>` placeholder."""
    for key, value in _merge(layers).items():
        if _is_placeholder(value):
            fix = "set it, e.g. run_name=my_run" if key == "run_name" else \
                f"set it to a real value (configs/base.yml describes {key})"
            errors.append(_name_sources(f"{key}={value!r} is a placeholder; {fix}", layers))


def _is_placeholder(value: Any) -> bool:
    return any(PLACEHOLDER in str(v) for v in (value if isinstance(value, list) else [value]))


def build_config(flat: Mapping[str, Any]) -> Config:
    """Coerce and validate a flat {key: value} mapping (missing keys take schema defaults; MaxText's
    aliases are renamed). Every unknown key and bad value is reported in one ConfigError."""
    errors: list[str] = []
    cfg = _build(_check_known(flat, "the config", errors), errors)
    _raise_all(errors)
    return cfg


def _build(flat: Mapping[str, Any], errors: list[str]) -> Config | None:
    """The config from known keys, or None with a line in `errors` per bad value (the checks of
    several keys, `validate`, run only once every value is good)."""
    fields = all_fields()
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, raw in flat.items():
        section, f = fields[name]
        try:
            per_section[section][name] = coerce(name, raw, f)
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        return None
    try:
        cfg = Config(**{s: SECTIONS[s](**vals) for s, vals in per_section.items()})
        resolve_paths(cfg)
        validate(cfg)
    except ConfigError as e:
        errors.append(str(e))
        return None
    return cfg


# --------------------------------------------------------------------------- paths


def absolute_path(text: str) -> str:
    """`text` made absolute against the working directory (`~` expanded, `..` folded); a URL
    (anything with "://", e.g. gs://bucket/runs) and an empty value are kept as they are."""
    if not text or "://" in text:
        return text
    return os.path.abspath(os.path.expanduser(text))


def _is_local(text: str) -> bool:
    """hf_path names a local file or folder (not a format such as parquet, nor a Hub dataset)."""
    if text in HF_FILE_FORMATS or "://" in text:
        return False
    return text.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(text))


def resolve_paths(cfg: Config) -> None:
    """Make every path key of `cfg` absolute, in place (see `PATH_KINDS` in schema.py): the one
    place where relative paths are resolved, against the working directory of this process."""
    fields = all_fields()
    for name, kind in path_keys().items():
        section = getattr(cfg, fields[name][0])
        value = getattr(section, name)
        if kind == "globs":
            value = ",".join(absolute_path(p.strip()) for p in value.split(",") if p.strip())
        elif kind == "path" or _is_local(value):
            value = absolute_path(value)
        setattr(section, name, value)


def _read_yaml(path: Path, what: str, empty_ok: bool = True) -> dict[str, Any]:
    """The `key: value` mapping of a YAML file; a ConfigError (one line) for a file that is missing, a
    directory, unreadable, not UTF-8, not YAML or not a mapping, and without `empty_ok` for one with no key."""
    if path.is_dir():
        example = path / "base.yml" if (path / "base.yml").is_file() else "configs/base.yml"
        raise ConfigError(f"{what} {path} is a directory; a config file is expected, e.g. {example}")
    if not path.is_file():
        state = "is not a regular file" if path.exists() else "does not exist"
        raise ConfigError(f"{what} {path} {state}; pass a path such as configs/base.yml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "it must be a YAML file of key: value lines such as configs/base.yml") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read ({e.strerror or e}); check its permissions") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark, start = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        if start and getattr(e, "context", None):
            problem += f" ({e.context} started at line {start.line + 1})"
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {problem}; correct the file there") from None
    if data is None:
        if empty_ok:
            return {}
        raise ConfigError(f"{what} {path} is empty (no key: value lines); start from a copy of configs/base.yml")
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of key: value lines, got {type(data).__name__}; "
                          "start from a copy of configs/base.yml")
    return data


def _parse_overrides(args: list[str]) -> dict[str, str]:
    out = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        if not sep or not name:
            raise ConfigError(f"argument {arg!r} is not of the form key=value (e.g. steps=100)")
        out[name.strip()] = value
    return out


def _check_known(values: Mapping[str, Any], source: str, errors: list[str]) -> dict[str, Any]:
    """`values` with MaxText's aliases renamed and its keys without effect dropped (maxtext.py); a
    line in `errors` for each unknown key (with its 3 closest keys) and each refused MaxText key."""
    return translate(values, source, all_fields(), errors)


def coerce(name: str, raw: Any, f: dataclasses.Field) -> Any:
    """Convert `raw` (YAML value or command-line string) to the field's declared type."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    value = _convert(name, raw, kind)
    choices, minimum = f.metadata["choices"], f.metadata["minimum"]
    if choices and value not in choices:
        raise ConfigError(f"{name}={raw!r} is not allowed; choose one of: {', '.join(repr(c) for c in choices)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} is too small; it must be >= {minimum}")
    if f.metadata.get("maximum") is not None and value > f.metadata["maximum"]:
        raise ConfigError(f"{name}={raw!r} is too large; it must be <= {f.metadata['maximum']}")
    return value


def _convert(name: str, raw: Any, kind: str) -> Any:
    bad = ConfigError(f"{name}={raw!r} is not a valid {kind}")
    if kind == "str":
        if isinstance(raw, (dict, list)):
            raise bad
        return "" if raw is None else str(raw)
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{name}={raw!r} is not a valid bool; use true or false")
    if kind == "int":  # exact (decimal, never float): 1e3 is 1000, 99999999999999999999999 is refused
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise bad
        try:
            number = decimal.Decimal(raw)
        except decimal.InvalidOperation:
            raise bad from None
        if not number.is_finite() or number != number.to_integral_value():
            raise ConfigError(f"{name}={raw!r} must be a whole number")
        if not INT_RANGE[0] <= number <= INT_RANGE[1]:
            raise ConfigError(f"{name}={raw!r} is out of range; an integer key takes whole numbers from "
                              f"{INT_RANGE[0]} to {INT_RANGE[1]}")
        return int(number)
    if kind == "float":
        if isinstance(raw, bool):
            raise bad
        try:
            number = float(raw)
        except OverflowError:  # an integer beyond 1.8e308
            number = math.inf
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(number):
            raise ConfigError(f"{name}={raw!r} must be a finite number (not nan or inf)")
        return number
    if kind == "list":
        value = raw
        if isinstance(raw, str) and raw.strip().startswith("["):
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ConfigError(f"{name}={raw!r} is not a valid list ({getattr(e, 'problem', None) or 'bad YAML'}); "
                                  f"write it as {name}=[\"a\",\"b\"] or {name}=a,b") from None
        elif isinstance(raw, str):
            value = [s for s in raw.split(",") if s]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}={raw!r} must be a list of strings, e.g. {name}=[\"silu\",\"linear\"]")
        return [v.strip() for v in value]
    raise TypeError(f"schema field {name} has unsupported type {kind}")


def validate(cfg: Config) -> None:
    """Checks that involve more than one key (single-key checks happen in `coerce`)."""
    from tessera.config.schema import ACTIVATIONS

    m = cfg.model
    scale = m.global_parameter_scale
    if scale & (scale - 1):
        raise ConfigError(f"global_parameter_scale={scale} must be a power of two (1, 2, 4, ..., 128, ...)")
    if m.num_query_heads % m.num_kv_heads:
        raise ConfigError(
            f"query heads ({m.num_query_heads}) must be a multiple of kv heads ({m.num_kv_heads}); "
            "change base_num_query_heads or base_num_kv_heads"
        )
    if not 1 <= len(m.mlp_activations) <= 2 or any(a not in ACTIVATIONS for a in m.mlp_activations):
        raise ConfigError(
            f"mlp_activations={m.mlp_activations} must be one or two of {', '.join(ACTIVATIONS)} "
            "(two make a gated MLP, e.g. [\"silu\",\"linear\"])"
        )
    if m.enable_dropout and not 0.0 <= m.dropout_rate < 1.0:
        raise ConfigError(f"dropout_rate={m.dropout_rate} must be in [0, 1)")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"rope_high_freq_factor={m.rope_high_freq_factor} must be larger than "
                          f"rope_low_freq_factor={m.rope_low_freq_factor} with rope_scaling=llama3 (Llama 3.1: 4 and 1)")
    if m.num_experts_per_tok > m.num_experts:
        raise ConfigError(f"num_experts_per_tok={m.num_experts_per_tok} is more than num_experts={m.num_experts}; "
                          "a token cannot be routed to more experts than there are")
    if m.head_dim % 2:
        raise ConfigError(f"head_dim={m.head_dim} must be even (rotary embeddings rotate pairs)")
    _validate_family(m)
    for prefix in ("ici", "dcn"):
        values = {n: getattr(cfg.mesh, n) for n in vars(cfg.mesh) if n.startswith(prefix)}
        fills = [n for n, v in values.items() if v == -1]
        if len(fills) > 1:
            raise ConfigError(f"only one {prefix}_*_parallelism may be -1, but {', '.join(fills)} all are")
        for n, v in values.items():
            if v == 0 or v < -1:
                raise ConfigError(f"{n}={v} must be a positive integer or -1 (fill from device count)")
    for n in ("ici_pipeline_parallelism", "dcn_pipeline_parallelism"):
        if getattr(cfg.mesh, n) == -1:
            raise ConfigError(f"{n} cannot be -1: the stage count must be chosen (1: no pipelining)")
    for n in ("num_pipeline_microbatches", "num_pipeline_repeats", "num_layers_per_pipeline_stage"):
        if getattr(cfg.mesh, n) == 0 or getattr(cfg.mesh, n) < -1:
            raise ConfigError(f"{n}={getattr(cfg.mesh, n)} must be a positive integer or -1 (derived)")
    if cfg.data.per_device_batch_size <= 0:
        raise ConfigError(f"per_device_batch_size={cfg.data.per_device_batch_size} must be > 0")
    if cfg.checkpoint.save_quantized_params_path and not cfg.model.quantization:
        raise ConfigError("save_quantized_params_path needs quantization=int8, fp8 or fp8_full (the stored type)")
    if cfg.checkpoint.checkpoint_is_quantized and not (cfg.model.quantization and cfg.checkpoint.load_parameters_path):
        raise ConfigError("checkpoint_is_quantized=true needs load_parameters_path=<the quantized checkpoint> and the "
                          "quantization=int8|fp8|fp8_full it was written with")
    for name in ("adam_b1", "adam_b2"):
        beta = getattr(cfg.optim, name)
        if beta >= 1.0:
            raise ConfigError(f"{name}={beta:g} must be below 1: it is AdamW's decay of a moment average (1 would never "
                              "update it, and the bias correction would divide by zero); e.g. 0.9 or 0.95")
    keep = cfg.checkpoint.max_num_checkpoints_to_keep
    if keep == 0 or keep < -1:
        raise ConfigError(f"max_num_checkpoints_to_keep={keep} is not allowed; use -1 to keep every checkpoint, "
                          "or N >= 1 to keep the newest N")
    fraction = cfg.compile.compile_hbm_budget_fraction
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"compile_hbm_budget_fraction={fraction:g} must be in (0, 1]: the share of a chip's HBM the "
                          "compiled step may use, e.g. 0.95")
    _validate_eval(cfg.data)
    _validate_vocab_tiling(cfg)


def _validate_vocab_tiling(cfg: Config) -> None:
    """num_vocab_tiling splits the tokens one device holds in a forward pass into equal chunks."""
    tiles, d, accum = cfg.model.num_vocab_tiling, cfg.data, cfg.optim.gradient_accumulation_steps
    tokens = d.per_device_batch_size * d.max_target_length / accum
    if tiles > 1 and (tokens != int(tokens) or int(tokens) % tiles):
        raise ConfigError(f"num_vocab_tiling={tiles} must divide the tokens per device of one forward pass: "
                          f"per_device_batch_size={d.per_device_batch_size:g} x max_target_length={d.max_target_length}"
                          f" / gradient_accumulation_steps={accum} = {tokens:g}; change num_vocab_tiling")


def _validate_eval(d) -> None:
    """eval_steps, when evaluation is on (eval_interval > 0)."""
    if not d.eval_interval:
        return
    if d.eval_steps == 0 or d.eval_steps < -1:
        raise ConfigError(f"eval_steps={d.eval_steps}: use a positive number of batches, or -1 for all of "
                          "the eval data")
    if d.eval_steps == -1 and d.dataset_type == "synthetic":
        raise ConfigError("eval_steps=-1 reads the eval data to its end, but synthetic data never ends; "
                          "set eval_steps (e.g. eval_steps=4)")


def _validate_family(m) -> None:
    """Checks of the keys particular to some decoder block families."""
    if m.decoder_block == "gemma2" and m.num_decoder_layers % 2:
        raise ConfigError(f"decoder_block=gemma2 needs an even number of layers (local and global alternate), "
                          f"not {m.num_decoder_layers}; change base_num_decoder_layers")
    if m.decoder_block == "gemma3" and m.num_decoder_layers < 6:
        raise ConfigError(f"decoder_block=gemma3 needs at least 6 layers (one pattern of 5 local and 1 global layer), "
                          f"not {m.num_decoder_layers}; change base_num_decoder_layers")
    if m.decoder_block == "deepseek":
        _validate_deepseek(m)
    elif m.first_num_dense_layers:
        raise ConfigError(f"first_num_dense_layers={m.first_num_dense_layers} applies to decoder_block=deepseek only")
    if m.n_routing_groups > 1:
        if m.num_experts % m.n_routing_groups or not 1 <= m.topk_routing_group <= m.n_routing_groups:
            raise ConfigError(f"n_routing_groups={m.n_routing_groups} must divide num_experts={m.num_experts}, and "
                              f"topk_routing_group={m.topk_routing_group} must be between 1 and it")
        if m.num_experts_per_tok > m.topk_routing_group * m.num_experts // m.n_routing_groups:
            raise ConfigError(f"num_experts_per_tok={m.num_experts_per_tok} is more experts than the "
                              f"topk_routing_group={m.topk_routing_group} groups a token may use hold")
    if m.fused_qkv and m.num_kv_heads != m.num_query_heads:
        raise ConfigError(f"fused_qkv=true needs multi-head attention (kv heads = query heads), but there are "
                          f"{m.num_kv_heads} kv heads and {m.num_query_heads} query heads; set fused_qkv=false")
    if m.fused_mlp and len(m.mlp_activations) != 2:
        raise ConfigError(f"fused_mlp=true fuses the gate and up projections of a gated MLP, but mlp_activations="
                          f"{m.mlp_activations} has one activation (no gate); set fused_mlp=false")
    if m.fused_mlp and m.decoder_block in MOE_BLOCKS:
        raise ConfigError(f"fused_mlp=true applies to dense MLPs; decoder_block={m.decoder_block}'s experts keep "
                          "separate gate and up projections; set fused_mlp=false")
    if m.capacity_factor != -1 and m.capacity_factor <= 0:
        raise ConfigError(f"capacity_factor={m.capacity_factor} must be > 0, or -1 for no capacity limit")
    if m.ragged_buffer_factor != -1 and m.ragged_buffer_factor <= 0:
        raise ConfigError(f"ragged_buffer_factor={m.ragged_buffer_factor} must be > 0, or -1 for a buffer with room "
                          "for every token copy")


def _validate_deepseek(m) -> None:
    """Multi-head latent attention's widths and the dense layers below the experts."""
    width = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.head_dim != width:
        raise ConfigError(f"decoder_block=deepseek: head_dim={m.head_dim} must be qk_nope_head_dim + qk_rope_head_dim "
                          f"= {width} (the query/key width attention kernels see); set head_dim={width}")
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary positions turn pairs)")
    if m.first_num_dense_layers >= m.num_decoder_layers:
        raise ConfigError(f"first_num_dense_layers={m.first_num_dense_layers} leaves no expert layer of the "
                          f"{m.num_decoder_layers}; use fewer")


def validate_for_build(m: ModelConfig) -> None:
    """Checks for a model that is to be built, not only sized: `build_model`, `python3 -m
    tessera.config` and train_compile run them before any model exists (the estimator does not:
    it sizes any expert count on any block family)."""
    moe = m.decoder_block in MOE_BLOCKS
    if m.num_experts > 1 and not moe:
        raise ConfigError(f"num_experts={m.num_experts}: decoder_block={m.decoder_block} has a dense MLP; use "
                          f"a mixture-of-experts family ({', '.join(MOE_BLOCKS)}), or set num_experts=1")
    if moe and m.num_experts < 2:
        raise ConfigError(f"decoder_block={m.decoder_block} needs num_experts >= 2 (and num_experts_per_tok); e.g. "
                          "num_experts=8 num_experts_per_tok=2")


def flat_dict(cfg: Config) -> dict[str, Any]:
    """Every key with its final value, in schema order."""
    out = {}
    for section in SECTIONS:
        out.update(dataclasses.asdict(getattr(cfg, section)))
    return out


def changed_keys(cfg: Config) -> dict[str, Any]:
    """The keys whose final value differs from the schema default (= configs/base.yml), in schema order."""
    defaults = flat_dict(build_config({}))
    return {k: v for k, v in flat_dict(cfg).items() if v != defaults[k]}


def config_digest(cfg: Config) -> str:
    """Short stable hash of the final config (same keys and values -> same digest)."""
    text = json.dumps(flat_dict(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
