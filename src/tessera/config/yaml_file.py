"""The config files on disk: reading one YAML file (a config file, a base_config parent or a model
file) as its `key: value` mapping, or a one-line ConfigError that names the file and says what to
fix; a config file's chain of base_config parents; where model files are looked for; and the
header that marks a run's own config.yml."""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path
from typing import Any

import yaml

from tessera.config.schema import ConfigError

log = logging.getLogger("tessera")

REPO_CONFIGS = Path(__file__).resolve().parents[3] / "configs"  # the repository's own config files
REPO_MODELS = REPO_CONFIGS / "models"  # the repository's own model files
BASE_CONFIG = "base_config"  # a config file's parent (MaxText's inheritance key)


def read_yaml(path: Path, what: str, empty_ok: bool = True) -> dict[str, Any]:
    """The `key: value` mapping of a YAML file; a ConfigError (one line) for a file that is missing, a
    directory, unreadable, not UTF-8, not YAML or not a mapping, and without `empty_ok` for one with no key."""
    if path.is_dir():
        example = path / "base.yml" if (path / "base.yml").is_file() else "configs/base.yml"
        raise ConfigError(f"{what} {path} is a directory; a config file is expected, e.g. {example}")
    if not path.is_file():
        if path.exists():
            raise ConfigError(f"{what} {path} is not a regular file; pass a path such as configs/base.yml")
        raise ConfigError(f"{what} {path} does not exist{_where_it_is(path)}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "it must be a YAML file of key: value lines such as configs/base.yml") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read ({e.strerror or e}); check its permissions") from None
    try:
        node, data = _parsed(text)
    except TooManyValues:
        raise ConfigError(f"{what} {path} is not a config file: with its YAML aliases (*name) expanded, its values "
                          f"hold more than {MAX_VALUES:,} items; a config file is key: value lines such as "
                          "configs/base.yml") from None
    except yaml.YAMLError as e:
        mark, start = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        if start and getattr(e, "context", None):
            problem += f" ({e.context} started at line {start.line + 1})"
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {problem}; correct the file there") from None
    except RecursionError:  # [[[[... thousands deep (a corrupt file): a traceback
        raise ConfigError(f"{what} {path} is not a config file: its values are nested hundreds of levels deep; a "
                          "config file is key: value lines such as configs/base.yml") from None
    if data is None:
        if empty_ok:
            return {}
        raise ConfigError(f"{what} {path} is empty (no key: value lines); start from a copy of configs/base.yml")
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of key: value lines, got {type(data).__name__}; "
                          "start from a copy of configs/base.yml")
    _refuse_keys_that_are_not_names(node, f"{what} {path}")
    _warn_repeated_keys(node, f"{what} {path}")
    return _values_as_written(node, data)


# libyaml's parser where PyYAML has it (the same documents, several times faster: every run reads base.yml)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parsed(text: str) -> tuple[Any, Any]:
    """(the document's node tree, its value) from one parse, as yaml.safe_load reads it; the aliases are
    counted (_refuse_aliases_that_multiply) before the value is built from them."""
    loader = _LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _refuse_values_that_explode(node)
        return node, loader.construct_document(node)
    except (TooManyValues, RecursionError):
        raise
    except yaml.YAMLError:  # PyYAML's own parser says where and what in its words (libyaml's differ)
        yaml.load(text, Loader=yaml.SafeLoader)
        raise
    finally:
        loader.dispose()


_OCTAL_OR_SEXAGESIMAL = re.compile(r"[-+]?0[0-7_]+|.*:.*")  # YAML 1.1's 010 (8) and 1:30 (90)


def _values_as_written(document, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the values that YAML 1.1 (PyYAML) reads otherwise than the command line does, read
    as written: an unquoted number or bool of a text key stays its text (`run_name: 010` named the run's
    folder 8, `run_name: 1_000` 1000, `run_name: yes` True), and a number key's `010` and `1:30` are
    10 and an error, as steps=010 and steps=1:30 are (PyYAML read them as 8 and 90 without a word)."""
    from tessera.config.maxtext import ALIASES
    from tessera.config.schema import all_fields

    fields, out = all_fields(), dict(data)
    for key_node, value_node in document.value:  # a mapping: read_yaml checked it
        name = ALIASES.get(key_node.value, (key_node.value,))[0]
        if name not in fields or not isinstance(value_node, yaml.ScalarNode) or value_node.style:
            continue  # quoted or a block: a text already (a plain scalar's style is None, or '' from libyaml)
        kind, resolved = fields[name][1].type, value_node.tag.rpartition(":")[2]
        kind = kind if isinstance(kind, str) else kind.__name__
        if (kind == "str" and resolved in ("int", "float", "bool", "timestamp")) or (
                kind in ("int", "float") and resolved in ("int", "float")
                and _OCTAL_OR_SEXAGESIMAL.fullmatch(value_node.value)):
            out[key_node.value] = value_node.value
    return out


def _where_it_is(path: Path) -> str:
    """The rest of a "does not exist" message: the repository's file of that relative name when the
    command runs from another folder (the docs' commands run from the repository root; from elsewhere
    `configs/base.yml` was missing and the message said to pass configs/base.yml), else the closest
    names in its folder, else an example."""
    in_repo = REPO_CONFIGS.parent / path
    if not path.is_absolute() and is_file(in_repo):
        return (f" in the current folder {Path.cwd()}; the repository's is {in_repo}: run the command from "
                f"{REPO_CONFIGS.parent}, as the docs do, or give that path")
    try:
        files = {p.stem: p.name for p in path.parent.glob("*.y*ml") if p.is_file()}
    except OSError:
        files = {}
    close = difflib.get_close_matches(path.stem, sorted(files), n=3, cutoff=0.6)
    if close:
        return f"; did you mean {', '.join(str(path.parent / files[stem]) for stem in close)}?"
    return "; pass a path such as configs/base.yml"


def _refuse_keys_that_are_not_names(document, where: str) -> None:
    """YAML reads a key such as `5`, `null`, `on` or `yes` as a number, None or a bool, not as a
    name (an AttributeError traceback followed in the unknown-key lookup): one line naming it."""
    for key_node, _ in document.value:  # a mapping: read_yaml checked it
        if key_node.tag not in ("tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"):
            raise ConfigError(f"{where}: the key {key_node.value!r} on line {key_node.start_mark.line + 1} is not a "
                              "name (YAML reads it as a number, null or true/false); keys are names such as steps")


MAX_VALUES = 100_000  # items in a config file's values, YAML's aliases expanded (configs/base.yml: 422)
MAX_DEPTH = 100  # levels of nesting of a config file's values (a list of lists is 3)


class TooManyValues(yaml.YAMLError):
    """_refuse_aliases_that_multiply's finding, for read_yaml to name the file."""


def _refuse_values_that_explode(document) -> None:
    """YAML's aliases (*name) let a few lines stand for billions of items (a list of 9 references to a
    list of 9 ..., the "billion laughs"): a value like that hung the loader, which writes values into
    its messages. Counted with the aliases expanded, up to MAX_VALUES. Values nested deeper than
    MAX_DEPTH (a corrupt file of [[[[...) are a RecursionError, as pure-Python YAML parsing raised it:
    libyaml parses them, and the messages that print the value recursed instead."""
    count, nodes = 0, [(document, 0)]
    while nodes:
        node, depth = nodes.pop()
        count += 1
        if count > MAX_VALUES:
            raise TooManyValues
        if depth > MAX_DEPTH:
            raise RecursionError
        if isinstance(node, yaml.SequenceNode):
            nodes.extend((item, depth + 1) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            nodes.extend((item, depth + 1) for pair in node.value for item in pair)


def _warn_repeated_keys(document, where: str) -> None:
    """A warning per key that a YAML file's top level sets more than once (YAML keeps the last one
    without a word: an edited copy of base.yml with `steps:` added at the end trains with it)."""
    lines: dict[str, list[int]] = {}
    for key_node, _ in document.value:  # a mapping: read_yaml checked it
        lines.setdefault(str(key_node.value), []).append(key_node.start_mark.line + 1)
    for key, at in lines.items():
        if len(at) > 1:
            log.warning("%s sets %s %d times (lines %s); the last, on line %d, is used", where, key, len(at),
                        ", ".join(map(str, at)), at[-1])


RUN_CONFIG_HEADER = ("# the resolved config of a Tessera run (every key, the model file's included); given as a "
                     "config file it is read as it stands\n")


def is_run_config(path: Path) -> bool:
    """`path` is a run's config.yml (it starts with RUN_CONFIG_HEADER): its model keys are final, so
    its model file is not applied over them again (that turned a run's base_emb_dim=48 back into the
    model file's width, and decoding with the run's own config.yml failed on every shape)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline() == RUN_CONFIG_HEADER
    except (OSError, UnicodeDecodeError):
        return False  # read_yaml has reported it already


def config_files(path: Path, including: tuple[Path, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """[(file, its keys)] of the config file `path` and, first, of the files it inherits from: a
    `base_config: <file>` line (MaxText's) names a parent, looked for beside `path`, then in the
    repository's configs/; the child's keys win. A parent that is missing, or a cycle, is a ConfigError."""
    values = read_yaml(path, "config file" if not including else "base_config file", empty_ok=bool(including))
    parent = values.pop(BASE_CONFIG, None)
    if parent is None:
        return [(str(path), values)]
    if not isinstance(parent, str) or not parent.strip():
        raise ConfigError(f"{BASE_CONFIG}={parent!r} in {path} must name a YAML file, e.g. {BASE_CONFIG}: base.yml")
    named = Path(parent).expanduser()  # base_config: ~/experiments/base.yml
    candidates = [named] if named.is_absolute() else [path.parent / named, REPO_CONFIGS / named]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ConfigError(f"{BASE_CONFIG}: {parent} in {path} names no file (looked for "
                          f"{' and '.join(str(c) for c in candidates)}); correct the name or remove the line")
    chain = (*including, path.resolve())
    if found.resolve() in chain:
        raise ConfigError(f"{BASE_CONFIG}: {parent} in {path} names a file that inherits from {path} already: "
                          f"{' -> '.join(str(c) for c in (*chain, found.resolve()))}; remove one {BASE_CONFIG} line")
    return [*config_files(found, chain), (str(path), values)]


def is_file(path: Path) -> bool:
    """Path.is_file, False for a name the file system refuses (a model_name of 300 characters raised OSError)."""
    try:
        return path.is_file()
    except OSError:
        return False


def model_folders(base_path: Path) -> list[Path]:
    """Where `model_name` files are looked for, first match wins: the `models/` folder beside the
    config file, then the repository's configs/models/ (once, when they are the same folder)."""
    folders: list[Path] = []
    for folder in (base_path.parent / "models", REPO_MODELS):
        if not any(os.path.realpath(folder) == os.path.realpath(f) for f in folders):
            folders.append(folder)
    return folders
