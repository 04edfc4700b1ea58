"""Build a `Config` from base.yml, a model file, `key=value` overrides and `M_<KEY>` variables.

Precedence, lowest first: `configs/base.yml` < `configs/models/<model_name>.yml` <
`key=value` on the command line < `M_<KEY>` environment variables. Every value is coerced to
the type the schema declares; anything wrong raises `ConfigError` with a message that names
the key, the value, where the value was set and what would be accepted. A value holding the
`<changeme>` placeholder (left in recipes and validation files for the user) is refused, as is
any `<word>` in a path key (a guide's `gs://<bucket>/runs` copied as it is).
The model file is looked for in the `models/` folder beside the config file, then in the
repository's own `configs/models/` (so a copy of base.yml anywhere still finds every model).
A config file may inherit from another with MaxText's `base_config: <file>` line (beside it,
else in the repository's configs/): the parent's keys come first, the child's win.
Path keys (marked `path=` in the schema) are made absolute against the working directory here,
once (`paths.resolve_paths`); URLs such as gs://... are kept.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from tessera.config.checks import validate
from tessera.config.maxtext import (ALIASES, MODEL_NAMES, log_once, maxtext_keys, spelled_as, steps_from_schedule,
                                    translate)
from tessera.config.maxtext_model import IN_CONTEXT, check_in_context
from tessera.config.paths import file_url_path, is_file_url, resolve_paths
from tessera.config.schema import SECTIONS, Config, ConfigError, all_fields, path_keys
from tessera.config.values import coerce, unquoted
from tessera.config.yaml_file import (config_files, is_file, is_run_config, model_folders,
                                      read_yaml)  # read_yaml: also imported from here by tools/estimate.py

log = logging.getLogger("tessera")
ENV_PREFIX = "M_"
PLACEHOLDER = "<changeme>"  # a value left for the user to fill in (recipes, validation files)


def load_config(argv: list[str], env: Mapping[str, str] | None = None) -> Config:
    """`argv` is `[path/to/base.yml, key=value, ...]` as given to train.py. An error about a value
    says where the value was set: base.yml, the model file, the command line or an M_<KEY> variable."""
    _check_first_argument(argv)
    env = os.environ if env is None else env
    base_path = Path(argv[0]).expanduser()  # "~/exp.yml" quoted, or from a job's argument list: as a shell expands it
    # (source, values), lowest precedence first; the model file goes second once model_name is known
    errors: list[str] = []  # every problem found, reported together (unknown keys, bad values, ...)
    files = config_files(base_path)  # the file and the files it inherits from (base_config), parents first
    overrides = _parse_overrides(argv[1:])
    _base_config_argument(overrides, [Path(source) for source, _ in files])
    layers = [(source, _check_known(values, source, errors)) for source, values in (
        *files, ("the command line", overrides), *_env_layers(env, errors))]
    _refuse_placeholders(layers, errors)  # before model_name chooses a file
    model_name = _merge(layers).get("model_name", "default")
    if _is_placeholder(model_name):
        _raise_all(errors)  # no model file to read
    if is_run_config(base_path) and files[-1][1].get("model_name", "default") == model_name:
        return _built(layers, errors)  # a run's config.yml holds its model keys already: read as it stands
    model_file = _model_file(model_name, model_folders(base_path), layers, errors)
    model = read_yaml(model_file, "model file")
    if "model_name" in model and model["model_name"] != model_name:
        raise ConfigError(f"{model_file} sets model_name={model['model_name']!r}; remove that line")
    layers.insert(len(files), (str(model_file), _check_known(model, str(model_file), errors)))
    _warn_model_file_wins(layers[:len(files)], layers[len(files)], _merge(layers[len(files) + 1:]))
    _refuse_placeholders(layers, errors)
    return _built(layers, errors)


def _check_first_argument(argv: list[str]) -> None:
    """ConfigError when the first argument is not a config file: missing, empty or a key=value."""
    script = Path(sys.argv[0] if sys.argv else "train.py")
    program = (f"-m tessera.{script.stem}" if script.resolve().parent.name == "tessera" else script.name
               ) if script.suffix == ".py" else "train.py"
    if script.name == "__main__.py":  # python -m tessera.config
        program = f"-m tessera.{script.resolve().parent.name}"
    if not argv:
        raise ConfigError(f"no config file given: the first argument is a config file, e.g. `.venv/bin/python "
                          f"{program} configs/base.yml ...`")
    if not argv[0].strip():  # `train.py "$CONFIG" ...` with CONFIG unset: Path("") is the working directory
        raise ConfigError(f"no config file given: the first argument is empty ({argv[0]!r}); it is a config file, "
                          f"e.g. `.venv/bin/python {program} configs/base.yml ...`")
    if is_file_url(argv[0]):  # Path() made file:///x/base.yml "file:/x/base.yml", which "does not exist"
        raise ConfigError(f"config file {argv[0]} is a file: URL, which is not read as a local path; write the path "
                          f"itself, {file_url_path(argv[0])}")
    if re.match(r"[A-Za-z_][A-Za-z0-9_]*=", argv[0]) and not is_file(Path(argv[0])):  # MaxText infers its file
        raise ConfigError(f"no config file given: the first argument, {argv[0]!r}, is a key=value; the config file "
                          f"comes first, e.g. `.venv/bin/python {program} configs/base.yml {' '.join(argv)}`")


def _base_config_argument(overrides: dict[str, str], files: list[Path]) -> None:
    """MaxText's llama3.1 405B GPU recipe repeats base_config=base.yml on the command line, where MaxText ignores
    it: taken out of `overrides` (logged) when it names a file already read, `files`; a ConfigError otherwise."""
    if "base_config" not in overrides:
        return
    named = overrides.pop("base_config")
    if any(Path(named).name == f.name for f in files):
        log.info("base_config=%s on the command line has no effect: %s is read already", named, named)
        return
    raise ConfigError(f"base_config={named} on the command line has no effect: a config file names its parent with "
                      f"a `base_config: <file>` line in it; give {named} as the first argument instead (the config "
                      "file comes first)")


def _model_file(model_name: Any, folders: list[Path], layers: list, errors: list[str]) -> Path:
    """The file of `model_name` in `folders`; else every error so far and one for the name, which says what
    to give instead (a close name, the name of a path given as one, an example for an empty name)."""
    if model_name is None or not str(model_name).strip():  # model_name= (or `model_name:` in a file): "no file .yml"
        raise _all_of(errors + [_name_sources(f"model_name={model_name!r} is empty: it names a model file of "
                                              f"{folders[-1]} without its .yml, e.g. model_name=default (the "
                                              "tiny model) or model_name=llama2-7b", layers)])
    def found(name: Any) -> Path | None:
        return next((d / f"{name}.yml" for d in folders if is_file(d / f"{name}.yml")), None)

    model_file = found(model_name)
    if model_file is not None:
        return model_file
    ours = MODEL_NAMES.get(str(model_name).strip().lower())
    if ours and (model_file := found(ours)) is not None:
        log_once(f"model_name={model_name} is MaxText's name for {ours}; reading {model_file}")
        return model_file
    known = sorted({p.stem for d in folders for p in d.glob("*.yml") if p.is_file()})
    # a path to a model file (configs/models/llama2-7b.yml): the name is its file's, without folder and .yml
    stem = re.sub(r"\.ya?ml$", "", str(model_name).replace("\\", "/").rpartition("/")[2])
    close = difflib.get_close_matches(stem.lower(), known, n=3, cutoff=0.6)
    hint = (f"Did you mean {', '.join(close)}? ({len(known)} models in all, a .yml file each there)" if close
            else f"Known models: {', '.join(known) or 'none'}")
    if stem != str(model_name):
        hint = (f"model_name is a model's name, its file's without the folder and .yml: model_name={stem}"
                if stem in known else hint) + (f"; a model file of your own goes in a models/ folder beside the "
                                               f"config file, and model_name={stem} names it")
    raise _all_of(errors + [_name_sources(
        f"model_name={model_name!r}: no file {model_name}.yml in {' or '.join(str(d) for d in folders)}. {hint}",
        layers)])


def _built(layers: list, errors: list[str]) -> Config:
    """The Config of the merged `layers` (placeholders left out); every error in `errors` and the build's,
    each named with the layer that set its key, raised together."""
    build_errors: list[str] = []
    merged = {k: v for k, v in _merge(layers).items() if not _is_placeholder(v)}
    build_errors.extend(filter(None, [steps_from_schedule(merged, _schedule_steps)]))
    cfg = _build(merged, build_errors)
    _raise_all(errors + [_name_sources(line, layers) for line in build_errors])
    return cfg


def _schedule_steps(raw: Any) -> int:
    """learning_rate_schedule_steps read as its schema field reads it (for MaxText's steps=-1)."""
    return coerce("learning_rate_schedule_steps", raw, all_fields()["learning_rate_schedule_steps"][1])


def _warn_model_file_wins(files: list[tuple[str, dict[str, Any]]], model: tuple[str, dict[str, Any]],
                          later: Mapping[str, Any]) -> None:
    """A warning when a config file sets a key that the model file sets otherwise: the model file wins
    (MaxText's order), so an experiment file's `base_num_decoder_layers: 4`, or a flat dump of a
    config (a run's config.yml without yaml_file.RUN_CONFIG_HEADER), trained the model file's value
    without a word (a key the command line or the environment sets too is not lost). A file that sets most keys
    (base.yml, a copy of it, a saved config.yml) counts only its values away from the defaults: the
    others are the defaults every model file replaces."""
    fields, (model_file, model_values) = all_fields(), model
    lost = {}
    for source, values in files:
        full = len(values) > len(fields) // 2
        for name, raw in values.items():
            if name not in model_values or name in later or name == "model_name" or name not in fields:
                continue
            f = fields[name][1]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            try:
                theirs = coerce(name, model_values[name], f)
            except ConfigError:
                continue  # the model file's value: reported with the other errors
            try:
                mine = coerce(name, raw, f)
            except ConfigError:  # never coerced, as the model file's value replaces it: `decoder_block: {}` was
                mine = raw  # dropped without a word, where a valid value gets this warning
            if mine != theirs and (mine != default or not full):
                lost[name] = (source, mine, theirs)
    if lost:
        log.warning("%s; the model file %s sets %s, and a model file's values win over a config file's (MaxText's "
                    "order); to change them, give them on the command line", "; ".join(
                        f"{source} sets {name}={mine}" for name, (source, mine, _) in lost.items()),
                    model_file, ", ".join(f"{name}={theirs}" for name, (_, _, theirs) in lost.items()))


def _raise_all(errors: list[str]) -> None:
    """One ConfigError listing every problem (each on its own line), if there is any."""
    if errors:
        raise _all_of(errors)


def _all_of(errors: list[str]) -> ConfigError:
    """One ConfigError for the (one or more) `errors`: the one, or their count and each on its own line."""
    errors = list(dict.fromkeys(errors))
    if len(errors) == 1:
        return ConfigError(errors[0])
    # a line "... and N more unknown keys" stands for N problems; it goes last, with its advice
    more = {line: int(m[1]) for line in errors if (m := re.match(r"\.\.\. and (\d+) more ", line))}
    errors = [line for line in errors if line not in more] + list(more)
    count = len(errors) - len(more) + sum(more.values())
    return ConfigError(f"{count} problems in the config:\n  " + "\n  ".join(errors))


def _env_layers(env: Mapping[str, str], errors: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """One layer per M_<KEY> variable that names a config key or a MaxText key (other M_ variables
    are not ours; one that is a near miss of a key, a likely typo, gets a warning). The variables
    are one place: an alias and its key set to different values there is a line in `errors` (the
    variables' order, alphabetical, decided which one won). A value in quotes is read as on the command
    line (`docker run --env-file` keeps the quotes of M_RUN_NAME="x": the run's folder was named "x")."""
    fields = {*all_fields(), *maxtext_keys()}
    ours = {name[len(ENV_PREFIX):].lower(): name for name in env if name.startswith(ENV_PREFIX)}
    for alias, (target, whose) in ALIASES.items():
        if alias in ours and target in ours and not spelled_as(env[ours[alias]], (env[ours[target]].strip().lower(),)):
            errors.append(f"{ours[alias]}={env[ours[alias]]} ({whose} name for {target}) disagrees with "
                          f"{ours[target]}={env[ours[target]]}; set only {ours[target]}")
    for name in sorted(env):
        key = name[len(ENV_PREFIX):].lower()
        if name.startswith(ENV_PREFIX) and key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.75)
            if close:
                log.warning("environment variable %s is not a config key and is ignored; did you mean %s%s?",
                            name, ENV_PREFIX, close[0].upper())
    return [(f"the environment variable {name}", {name[len(ENV_PREFIX):].lower(): unquoted(value)})
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


# a <word> in a path or URL: a placeholder copied from a guide (gs://<bucket>/runs), not a folder to make
PATH_PLACEHOLDER = re.compile(r"<[A-Za-z][\w-]*>")


def _refuse_placeholders(layers: list[tuple[str, dict[str, Any]]], errors: list[str]) -> None:
    """No value (a string, or a list of strings) may still hold the `<changeme>` placeholder, nor a
    path key any `<word>` (base_output_directory=gs://<bucket>/runs made a folder named `<bucket>`)."""
    paths = path_keys()
    for key, value in _merge(layers).items():
        if _is_placeholder(value):
            fix = "set it, e.g. run_name=my_run" if key == "run_name" else \
                f"set it to a real value (configs/base.yml describes {key})"
            errors.append(_name_sources(f"{key}={value!r} is a placeholder; {fix}", layers))
        elif key in paths and (found := PATH_PLACEHOLDER.search(str(value))):
            errors.append(_name_sources(f"{key}={value!r} holds the placeholder {found.group()}; put the real path "
                                        "or URL in its place", layers))


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
    several keys, `validate`, run only once every value is good; then MaxText's keys that depend on
    the model, maxtext_model.IN_CONTEXT)."""
    fields = all_fields()
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    in_context = {name: raw for name, raw in flat.items() if name in IN_CONTEXT}
    for name, raw in flat.items():
        if name in in_context:
            continue
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
    errors.extend(check_in_context(in_context, cfg.model))
    return None if errors else cfg


def _parse_overrides(args: list[str]) -> dict[str, str]:
    out, keys = {}, {*all_fields(), *maxtext_keys()}
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        key = name.strip().lstrip("-")
        if not sep and key in keys:  # `steps 100`, `--steps 100` (argparse's form): the key and its value apart
            given = args[i + 1] if i + 1 < len(args) and "=" not in args[i + 1] else "<value>"
            raise ConfigError(f"argument {arg!r} is not of the form key=value: it is the config key {key} without its "
                              f"value; give the two as one argument: {key}={given}")
        colon = None if sep else re.fullmatch(r"-*([A-Za-z_]\w*):(.*)", arg.strip(), re.S)
        if colon and colon[1] in keys:  # YAML's form: `enable_checkpointing: False` (MaxText's 405B GPU recipe)
            given = colon[2].strip() or (args[i + 1] if i + 1 < len(args) and "=" not in args[i + 1] else "<value>")
            raise ConfigError(f"argument {arg!r} is YAML's `key: value` form, which config files take; on the command "
                              f"line give key=value: {colon[1]}={given}")
        if not sep or not name:
            raise ConfigError(f"argument {arg!r} is not of the form key=value (e.g. steps=100)")
        name, value = name.strip(), unquoted(value)
        if name in out and out[name] != value:  # a recipe's overrides come after its own keys on purpose: info
            log.info("%s is given twice on the command line (%s=%s, then %s=%s); the last is used", name, name,
                     out[name], name, value)
        out[name] = value
    return out


MANY_UNKNOWN = 20  # a file with more unknown keys than this is another trainer's config, not typos
UNKNOWN_SHOWN = 10


def _check_known(values: Mapping[str, Any], source: str, errors: list[str]) -> dict[str, Any]:
    """`values` with MaxText's aliases renamed and its keys without effect dropped (maxtext.py); a
    line in `errors` for each unknown key (with its 3 closest keys) and each refused MaxText key.
    A file with many unknown keys (MaxText's whole base.yml of 2026-08-22 has 385) gets one line saying what to
    do after its first few unknown keys, not a screenful of them."""
    found: list[str] = []
    out = translate(values, source, all_fields(), found)
    unknown = [line for line in found if line.startswith("unknown config key")]
    if len(unknown) > MANY_UNKNOWN:
        left_out = set(unknown[UNKNOWN_SHOWN:])
        found = [line for line in found if line not in left_out]
        found.append(f"... and {len(left_out)} more unknown keys in {source} ({len(unknown)} in all): if it is "
                     f"another trainer's config (MaxText's base.yml or a copy of it), start from "
                     f"configs/base.yml instead and give only the keys you changed, on the command line or "
                     f"in a file of your own that starts with base_config: base.yml "
                     f"(getting_started/Coming_from_MaxText.md)")
    errors.extend(found)
    return out


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
