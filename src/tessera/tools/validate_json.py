"""Reading the validation suite's JSON file (`tessera.tools.validate`): JSON with no repeated key,
comment keys (`_...`) dropped, {user-id} resolved, no `<changeme>` left; then the entry that the node
count and the --model/--gpu names choose. Each problem is a ValidationInputError that says what to
change; `validate_file` turns the entry into a run's plan."""

from __future__ import annotations

import difflib
import getpass
import json
import os
from pathlib import Path
from typing import Any

from tessera.config.loader import PLACEHOLDER


class ValidationInputError(Exception):
    """The JSON file cannot be used as it is; the message lists what to change."""


def load(path: str) -> dict:
    """The JSON without comment keys, with {user-id} resolved; refuses any <changeme> left."""
    try:
        # utf-8-sig: a file saved with a byte-order mark (Windows editors) was "Unexpected UTF-8 BOM (decode using
        # utf-8-sig)", a fix the user cannot apply
        text = Path(path).read_text(encoding="utf-8-sig")
        if not text.strip():  # was "not valid JSON: Expecting value: line 1 column 1 (char 0)"
            raise ValidationInputError(f"{path} is empty; a validation file is a JSON object with config and "
                                       "model_params sections (configs/cpu/validate_tiny.json is one)")
        data = json.loads(text, object_pairs_hook=_no_repeated_keys)
    except FileNotFoundError:
        raise ValidationInputError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise ValidationInputError(f"{path} is a folder; give the validation JSON file in it") from None
    except OSError as e:
        raise ValidationInputError(f"{path} cannot be read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValidationInputError(f"{path} is not valid JSON: {e}") from None
    except _RepeatedKey as e:
        raise ValidationInputError(f"{path}: {e}") from None
    except RecursionError:  # a corrupt file of [[[[...: a traceback
        raise ValidationInputError(_too_deep(path)) from None
    if not isinstance(data, dict):
        raise ValidationInputError(f"{path} holds a JSON {json_type(data)} at the top; a validation file is an "
                                   "object with config and model_params sections")
    try:
        data = _clean(data, _user_name())
        left = list(_placeholders(data))
    except RecursionError:  # nested just less deep than the JSON parser's limit
        raise ValidationInputError(_too_deep(path)) from None
    if left:
        raise ValidationInputError(
            f"{path} still has {len(left)} {PLACEHOLDER} value(s); set each before running:\n  " + "\n  ".join(left))
    return data


def _too_deep(path: str) -> str:
    return f"{path} is not a validation file: its JSON is nested hundreds of levels deep (a validation file has a few)"


class _RepeatedKey(ValueError):
    """A key twice in one JSON object: json keeps the last value and drops the first without a word."""


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen and not key.startswith("_"):  # comment keys may repeat
            raise _RepeatedKey(f"the key {key!r} appears twice in one object ({json.dumps(seen[key])[:60]} and then "
                               f"{json.dumps(value)[:60]}); JSON would keep only the last: remove one")
        seen[key] = value
    return seen


def _user_name() -> str:
    """What {user-id} becomes: the login name, else (a container's user with no passwd entry) the user id."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no USER/LOGNAME and no passwd entry (KeyError before Python 3.13)
        return str(os.getuid())


def json_type(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


def section(node: Any, where: str) -> dict:
    """`node` when it is a JSON object, else ValidationInputError naming `where` in the file."""
    if not isinstance(node, dict):
        raise ValidationInputError(f"{where} is a JSON {json_type(node)}; it must be an object of name: value")
    return node


def _clean(node: Any, user: str) -> Any:
    """`node` without comment keys, {user-id} resolved in values and in keys: volume_dict's keys are host
    folders ("/home/{user-id}"), which were mounted as a folder named {user-id}."""
    if isinstance(node, dict):
        return {k.replace("{user-id}", user): _clean(v, user) for k, v in node.items() if not k.startswith("_")}
    if isinstance(node, list):
        return [_clean(v, user) for v in node]
    return node.replace("{user-id}", user) if isinstance(node, str) else node


def _placeholders(node: Any, path: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            if PLACEHOLDER in k:  # a key is a setting too (volume_dict: {host folder: container folder})
                yield f"{path}.{k} (the key)" if path else f"{k} (the key)"
            yield from _placeholders(v, f"{path}.{k}" if path else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _placeholders(v, f"{path}[{i}]")
    elif isinstance(node, str) and PLACEHOLDER in node:
        yield f"{path} = {node!r}"


def select(data: dict, multi_node: bool, model: str | None, gpu: str | None) -> tuple[str, dict]:
    """The `model_params.<mode>.<model>.<gpu>` entry to run."""
    _known_keys(data, "", ("config", "model_params"))
    params = data.get("model_params")
    if not isinstance(params, dict) or not params:
        raise ValidationInputError("the file has no model_params section")
    _known_keys(params, "model_params.", ("single_node", "multi_node"))
    wanted = "multi_node" if multi_node else "single_node"  # a file may have both: the one that fits the node count
    mode = wanted if wanted in params else next(iter(params))
    models = section(params[mode], f"model_params.{mode}")
    model = _choose("--model", model, models, f"model_params.{mode}", "<model>: {<gpu>: {train keys}}")
    gpus = section(models[model], f"model_params.{mode}.{model}")
    gpu = _choose("--gpu", gpu, gpus, f"model_params.{mode}.{model}", "<gpu>: {train keys}")
    section(data.get("config", {}), "config")
    return f"{mode}.{model}.{gpu}", section(gpus[gpu], f"model_params.{mode}.{model}.{gpu}")


def _choose(option: str, given: str | None, names: dict, where: str, shape: str) -> str:
    """The entry of `names` that `option` names, or the only one there is."""
    if not names:
        raise ValidationInputError(f"{where} is empty; add an entry to it ({shape})")
    if given is None and len(names) == 1:
        return next(iter(names))
    if given not in names:
        said = "is needed" if given is None else f"{given} is not in {where}"
        raise ValidationInputError(f"{option} {said}; choose from {sorted(names)} ({where})")
    return given


def _known_keys(section: dict, where: str, known: tuple[str, ...]) -> None:
    """A misspelt section (`configs`) would drop every setting in it without a word."""
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {where}{close[0]}? " if close else ""
            raise ValidationInputError(f"{where}{key} is not a section of a validation file; {hint}use "
                                       f"{' or '.join(where + k for k in known)} (keys starting with _ are comments)")
