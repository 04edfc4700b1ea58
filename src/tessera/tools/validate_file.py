"""The validation suite's JSON file (`tessera.tools.validate`): reading it, choosing the entry for
the node count and the --model/--gpu names, and turning it into a `Plan` (environment, train
keys, targets, and every key left out with its reason). Each problem is a ValidationInputError
that says what to change; train keys go through train.py's own loader before anything runs."""

from __future__ import annotations

import dataclasses
import difflib
import getpass
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from tessera.config.loader import PLACEHOLDER, build_config, load_config
from tessera.config.maxtext import ACCEPTED, REFUSED, is_off
from tessera.config.maxtext import ALIASES as KEY_ALIASES
from tessera.config.schema import ConfigError, GpuConfig, all_fields
from tessera.gpu_tuning import effective_settings
from tessera.tools.validate_nodes import train_argv

# config keys turned into environment variables by prefix (NCCL/RCCL/gloo/TE/ROCm settings)
ENV_PREFIXES = ("nccl_", "rccl_", "gloo_", "nvte_", "hsa_", "ucx_", "gpu_max_hw_queues", "cuda_", "hip_")
# config keys with a meaning in Tessera: key -> train key
CONFIG_TRAIN_KEYS = {"training_steps": "steps", "enable_checkpointing": "enable_checkpointing",
                     "log_dir": "base_output_directory"}
# model-param keys of other trainers -> the Tessera train key with the same meaning (the loader's table)
ALIASES = {alias: target for alias, (target, _) in KEY_ALIASES.items()}
IGNORED_WHY = {
    "precision": "Tessera computes in `dtype`; only TE_FP8 has a counterpart (quantization=fp8)",
    "tokenizer_model": "a Hugging Face hub name; Tessera reads tokenizers from local files only",
    "model_size": "informational (the model is defined by the base_* keys)",
    "batch_size": "the global batch of other trainers; Tessera's is per_device_batch_size x devices (x "
                  "gradient_accumulation_steps), which micro_batch_size or per_device_batch_size sets",
    "recompute": "Transformer Engine knob; Tessera uses remat_policy",
    "fsdp": "Transformer Engine knob; Tessera uses ici_fsdp_parallelism",
    "distributed_training": "implied by the node count",
    "nic_type": "informational",
    "data_cache_dir": "not needed with synthetic data",
    "dataset_source": "not needed with synthetic data",
    "nccl_ib_hca_list": "list form of nccl_ib_hca, which is the one NCCL reads",
    "container_name": "the container engine names the container",
}
# model_params precision values that mean float8 training (Transformer Engine): quantization=fp8, on qwix
FP8_PRECISIONS = ("TE_FP8", "FP8")
# XLA flags of older XLA versions that the installed one refuses ("Unknown flag in XLA_FLAGS" ends the run at
# start-up): flag -> {value: the flag that replaces it, "" for none}, and why
GONE_XLA_FLAGS = {
    "xla_gpu_graph_level": ({"0": "--xla_gpu_enable_command_buffer="},
                            "XLA replaced it with xla_gpu_enable_command_buffer: level 0 (no GPU graphs) is passed as "
                            "--xla_gpu_enable_command_buffer= (empty), other levels leave XLA's default graphs"),
}
GPU_KEYS = {f.name for f in dataclasses.fields(GpuConfig)}  # train keys of the gpu section, also read from `config`
METRICS = {"tflops_per_sec_per_gpu": "tflops_per_sec_per_device", "tokens_per_sec_per_gpu": "tokens_per_sec_per_device"}


class ValidationInputError(Exception):
    """The JSON file cannot be used as it is; the message lists what to change."""


@dataclasses.dataclass
class Plan:
    """Everything needed to run one validation: environment, train overrides, targets, notes."""

    name: str
    env: dict[str, str]
    overrides: dict[str, str]
    targets: dict[str, float]
    container: dict[str, Any]
    ignored: dict[str, str]
    nnodes: int
    coordinator: str
    port: str
    tuning: dict[str, str] = dataclasses.field(default_factory=dict)  # optimization level, PGLE, memory fraction
    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # train key -> the file's key that set it


def load(path: str) -> dict:
    """The JSON without comment keys, with {user-id} resolved; refuses any <changeme> left."""
    try:
        data = json.loads(Path(path).read_text(), object_pairs_hook=_no_repeated_keys)
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
        raise ValidationInputError(f"{path} holds a JSON {_json_type(data)} at the top; a validation file is an "
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


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


def _section(node: Any, where: str) -> dict:
    """`node` when it is a JSON object, else ValidationInputError naming `where` in the file."""
    if not isinstance(node, dict):
        raise ValidationInputError(f"{where} is a JSON {_json_type(node)}; it must be an object of name: value")
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
    models = _section(params[mode], f"model_params.{mode}")
    model = _choose("--model", model, models, f"model_params.{mode}", "<model>: {<gpu>: {train keys}}")
    gpus = _section(models[model], f"model_params.{mode}.{model}")
    gpu = _choose("--gpu", gpu, gpus, f"model_params.{mode}.{model}", "<gpu>: {train keys}")
    _section(data.get("config", {}), "config")
    return f"{mode}.{model}.{gpu}", _section(gpus[gpu], f"model_params.{mode}.{model}.{gpu}")


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


def build_plan(data: dict, name: str, entry: dict) -> Plan:
    """Map every key of `config` and of the model entry to the environment, a train key, or 'ignored'."""
    config = dict(data.get("config", {}))
    container = dict(_section(config.pop("container_config", {}), "config.container_config"))
    env = {k: _text(v, f"config.container_config.env_dict.{k}")
           for k, v in _section(container.pop("env_dict", {}), "config.container_config.env_dict").items()}
    overrides: dict[str, str] = {}
    sources: dict[str, str] = {}  # train key -> the file's key that set it, for train.py's error messages
    ignored = _container_settings(container)
    flags = _section(entry.get("xla_flags", {}), f"model_params.{name}.xla_flags")
    xla_flags = [f"--{k}={_text(v, f'model_params.{name}.xla_flags.{k}')}" for k, v in flags.items()]
    xla_flags = _without_gone_flags(xla_flags, ignored, f"model_params.{name}.xla_flags.")
    train_keys = all_fields()
    for key, value in config.items():
        if key in ("result_dict", "xla_flags"):  # listed as "not a setting": the targets were never checked
            raise ValidationInputError(f"config.{key} is read from the model entry only: move it to "
                                       f"model_params.{name}.{key}")
        if key in ("env_dict", "device_list", "volume_dict"):  # the environment was never set
            raise ValidationInputError(f"config.{key} is read from config.container_config only: move it there")
        if key != "container_config" and difflib.get_close_matches(key, ("container_config",), cutoff=0.8):
            raise ValidationInputError(f"config.{key} is not a section of a validation file; did you mean "
                                       "config.container_config? (as it is, its settings would be dropped)")
        if key.startswith(ENV_PREFIXES) or key == "hf_token_file":
            text, variable = _text(value, f"config.{key}"), "HF_TOKEN_PATH" if key == "hf_token_file" else key.upper()
            if env.get(variable, text) != text:  # env_dict's value was replaced without a word
                ignored[f"config.container_config.env_dict.{variable}"] = f"config.{key}={text} is used instead"
            env[variable] = text
        elif key in GPU_KEYS:  # xla_python_client_mem_fraction, optimization_level, ...: the trainer applies them
            overrides[key], sources[key] = _text(value, f"config.{key}"), f"config.{key}"
        elif key.startswith("xla_"):
            text = _text(value, f"config.{key}")
            if key not in flags:
                xla_flags.append(f"--{key}={text}")
            elif _text(flags[key], "") != text:  # after the entry's in XLA_FLAGS, where the last one wins, it won
                ignored[f"config.{key}"] = f"model_params.{name}.xla_flags.{key}={flags[key]} is used instead"
        elif key in CONFIG_TRAIN_KEYS:
            overrides[CONFIG_TRAIN_KEYS[key]], sources[CONFIG_TRAIN_KEYS[key]] = _text(value, f"config.{key}"), \
                f"config.{key}"
        elif key == "mock_data":
            if _flag(value, f"config.{key}"):
                overrides["dataset_type"], sources["dataset_type"] = "synthetic", f"config.{key}"
            elif str(entry.get("dataset_type", "synthetic")).strip().lower() == "synthetic":
                sets = "dataset_type=synthetic" if "dataset_type" in entry else \
                    "no dataset_type (Tessera default: synthetic)"
                ignored["config.mock_data"] = (  # "False" trained on synthetic data without a word
                    f"false, but the run trains on synthetic data: model_params.{name} sets {sets}; for real data "
                    "set dataset_type (hf, tfds, grain) and its data keys there")
        elif key in ("container_image", "shm_size", "nnodes", "coordinator_ip"):
            container[key] = value
        elif key in train_keys or key in ALIASES:  # was "not a setting Tessera has", of model_name too
            ignored[f"config.{key}"] = (f"a train key, which the suite reads from the model entry only: move it to "
                                        f"model_params.{name}")
        else:
            ignored[f"config.{key}"] = IGNORED_WHY.get(key, "not a setting Tessera has")
    # train key -> the config key that set it: a model entry's value for the same train key replaced it silently
    from_config = {CONFIG_TRAIN_KEYS.get(k, k): k for k in config if k in GPU_KEYS or k in CONFIG_TRAIN_KEYS}
    from_config.update({"dataset_type": "mock_data"} if "dataset_type" in overrides else {})
    for key, value in entry.items():
        if key in ("xla_flags", "result_dict"):
            continue
        if key == "precision" and str(value).upper() in FP8_PRECISIONS and not entry.get("quantization"):
            continue  # mapped after this loop
        target = ALIASES.get(key, key)
        text = json.dumps(value) if isinstance(value, list) else str(value)
        if target != key and target in entry:  # an alias next to the key it stands for
            same = str(entry[target]) == text
            ignored[key] = f"same as {target}" if same else f"conflicts with {target}={entry[target]}; {target} is used"
        elif target == "run_name":  # replaced by the suite's own name without a word
            ignored[key] = ("the suite names the run validate_<file>_<date>_<time>_<pid> (its folder, where node 0's "
                            "report.json is read, is new for each run)")
        elif target in train_keys:
            text = _text(value, f"model_params.{name}.{key}")
            if target in from_config and overrides[target] != text:
                ignored[f"config.{from_config[target]}"] = f"model_params.{name}.{key}={text} is used instead"
            overrides[target], sources[target] = text, f"model_params.{name}.{key}"
        elif close := difflib.get_close_matches(key, ("result_dict", "xla_flags"), n=1, cutoff=0.8):
            raise ValidationInputError(f"model_params.{name}.{key} is not a key of a model entry; did you mean "
                                       f"{close[0]}? (as it is, its settings would be dropped)")
        else:
            ignored[key] = IGNORED_WHY.get(key) or _maxtext_why(key, value)
    if str(entry.get("precision", "")).upper() in FP8_PRECISIONS and not entry.get("quantization"):
        # Transformer Engine's fp8 recipe: e4m3 forward, e5m2 gradients; AMD MI300/MI325 use the fnuz formats
        amd_fnuz = name.rsplit(".", 1)[-1].lower().startswith(("mi300", "mi325"))
        overrides["quantization"] = "nanoo_fp8" if amd_fnuz else "fp8"
        sources["quantization"] = f"model_params.{name}.precision"
    xla_flags = _without_gone_flags(xla_flags, ignored, "config.")  # the entry's flags again: already replaced
    if xla_flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "")] + xla_flags).strip()
    targets = _targets(_section(entry.get("result_dict", {}), f"model_params.{name}.result_dict"))
    nnodes = _node_count(container.get("nnodes", env.get("NNODES", 1)))
    coordinator = str(container.get("coordinator_ip") or env.get("JAX_COORDINATOR_IP") or "localhost")
    return Plan(name, env, overrides, targets, container, ignored, nnodes, coordinator,
                env.get("JAX_COORDINATOR_PORT", "8476"), gpu_tuning(overrides, env), sources)


def _container_settings(container: dict) -> dict[str, str]:
    """Check container_config's device_list (strings) and volume_dict (host: container folder) in place, each
    value as its text: a string was passed on letter by letter (`--device /`), an array of volumes was a
    traceback. Returns its other keys, for the ignored list (a misspelt `device_lists` was dropped silently)."""
    where = "config.container_config"
    devices = container.get("device_list", [])
    if not isinstance(devices, list):
        raise ValidationInputError(f"{where}.device_list is a JSON {_json_type(devices)}; give an array of device "
                                   'paths, e.g. ["/dev/kfd", "/dev/dri"]')
    container["device_list"] = [_text(d, f"{where}.device_list[{i}]") for i, d in enumerate(devices)]
    volumes = _section(container.get("volume_dict", {}), f"{where}.volume_dict")
    container["volume_dict"] = {k: _text(v, f"{where}.volume_dict.{k}") for k, v in volumes.items()}
    return {f"{where}.{k}": "not a container setting; the suite uses device_list, volume_dict and env_dict"
            for k in container if k not in ("device_list", "volume_dict")}


def _without_gone_flags(xla_flags: list[str], ignored: dict[str, str], where: str) -> list[str]:
    """`xla_flags` with each flag of GONE_XLA_FLAGS replaced (or left out), each reported in `ignored`."""
    out = []
    for flag in xla_flags:
        key, _, value = flag[2:].partition("=")
        if key not in GONE_XLA_FLAGS:
            out.append(flag)
            continue
        replacements, why = GONE_XLA_FLAGS[key]
        ignored[where + key] = why
        if replacements.get(value.strip()):
            out.append(replacements[value.strip()])
    return out


def _text(value: Any, where: str) -> str:
    """A used value as the text train.py or the environment gets (a list as JSON); null or an object has none."""
    if value is None or isinstance(value, dict):
        raise ValidationInputError(f"{where} is a JSON {'null' if value is None else 'object'}, which has no value "
                                   "to pass on; give a string or a number (\"\" for empty), or leave the key out")
    return json.dumps(value) if isinstance(value, list) else str(value)


def _flag(value: Any, where: str) -> bool:
    """A true/false setting of the file (`"True"`, `"false"`, true, 1, as a train key's bool): "Ture" did nothing."""
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValidationInputError(f"{where}={value!r} is not true or false; give \"True\" (synthetic data) or \"False\" "
                               "(the model entry's dataset_type)")


def _node_count(value: Any) -> int:
    """config.nnodes (or NNODES in env_dict) as a count of nodes; an empty value is 1."""
    text = str(value).strip()
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ValidationInputError(f"config.nnodes={value!r} is not a number of nodes; give a whole number of at "
                                   "least 1 (or leave it out for one node)")
    return int(text)


def _maxtext_why(key: str, value: Any) -> str:
    """Why a model-param key that is not a Tessera train key is left out (MaxText keys: the loader's reason)."""
    if key in ACCEPTED:
        return ACCEPTED[key][1]
    if key in REFUSED:
        off = " (off here, as in Tessera)" if is_off(REFUSED[key], value) else ""
        return f"MaxText key{off}: {REFUSED[key].why}"
    close = difflib.get_close_matches(key, all_fields(), n=1, cutoff=0.8)  # a misspelt train key: its default runs
    return "not a Tessera train key" + (f"; did you mean {close[0]}?" if close else "")


def check_train_keys(plan: Plan, run_name: str, env: dict[str, str]) -> None:
    """The train keys through train.py's own config loader (with the run's M_<KEY> variables in `env`), so that
    a value the trainer refuses stops the suite here, dry run included, with the loader's message."""
    try:
        cfg = load_config(train_argv(plan, run_name)[2:], env=env)
    except ConfigError as e:
        raise ValidationInputError(f"train.py would refuse the train keys of {plan.name}: "
                                   f"{_in_the_file(str(e), plan.sources)}") from None
    steps, warmup = cfg.run.steps, cfg.run.report_warmup_steps
    if steps <= warmup:  # the report's medians would then be taken over the warm-up steps (compilation included)
        raise ValidationInputError(f"{plan.name}: steps={steps} is not more than report_warmup_steps={warmup}, so "
                                   "the measured speed would include compilation and warm-up; raise "
                                   f"{plan.sources.get('steps', 'config.training_steps')} above {warmup} or lower "
                                   "report_warmup_steps")


def _in_the_file(message: str, sources: dict[str, str]) -> str:
    """train.py's error about the suite's train keys, each line's "(from the command line)" (the user wrote no
    command line) naming the file's key instead: steps='ten' came from config.training_steps."""
    lines = []
    for line in message.split("\n"):
        key = re.search(r"\b([a-z][a-z0-9_]*)=", line)
        if key and key[1] in sources and line.endswith("(from the command line)"):
            line = line.removesuffix("(from the command line)") + f"(from {sources[key[1]]})"
        lines.append(line.replace("from the command line", "from the validation file"))
    return "\n".join(lines)


def gpu_tuning(overrides: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """The optimization level, PGLE settings and memory fraction the run will use (keys over the
    file's environment, as the trainer applies them); a bad value stops the suite here."""
    try:
        gpu = build_config({k: v for k, v in overrides.items() if k in GPU_KEYS}).gpu
    except ConfigError as e:
        raise ValidationInputError(str(e)) from None
    return effective_settings(gpu, env)


def tuning_line(plan: Plan) -> str:
    return "gpu tuning: " + ", ".join(f"{k}={v}" for k, v in plan.tuning.items())


def quantization_line(plan: Plan) -> str:
    """What the run quantizes and which library does it ("" when nothing is quantized)."""
    mode = plan.overrides.get("quantization", "")
    kv = plan.overrides.get("quantize_kvcache", "false").lower() in ("true", "1")
    if not mode and not kv:
        return ""
    from tessera.models.quantization import library

    what = [f"training matmuls in {mode}"] if mode else []
    if kv:
        what.append(f"KV cache in {plan.overrides.get('kv_quant_dtype', 'int8')}")
    hardware = {"fp8": "OCP float8 GEMMs: NVIDIA Ada, Hopper, Blackwell or AMD MI350",
                "fp8_full": "OCP float8 GEMMs: NVIDIA Ada, Hopper, Blackwell or AMD MI350",
                "nanoo_fp8": "AMD MI300's fnuz float8 GEMMs", "int8": "int8 GEMMs through XLA"}.get(mode, "XLA")
    return f"quantization: {', '.join(what)}, implemented by {library()} ({hardware})"


def _targets(result_dict: dict) -> dict[str, float]:
    """Each metric's target: a finite number of at least 0 (nan, inf or a negative one can never be met)."""
    out = {}
    for key, value in result_dict.items():
        if key not in METRICS:
            raise ValidationInputError(f"result_dict.{key} is not a known metric; use {sorted(METRICS)}")
        try:
            target = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        except ValueError:
            target = None
        if target is None or not math.isfinite(target) or target < 0:
            raise ValidationInputError(f"result_dict.{key}={value!r} is not a target a run can meet; give a finite "
                                       f"number of at least 0 (the {key} to reach), e.g. \"{key}\": \"100\"")
        out[key] = target
    return out
