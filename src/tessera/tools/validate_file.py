"""The validation suite's JSON file (`tessera.tools.validate`) as a run: the chosen entry (read by
`validate_json`) turned into a `Plan` (environment, train keys, targets, and every key left out with
its reason). Each problem is a ValidationInputError that says what to change; train keys go through
train.py's own loader before anything runs."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from typing import Any

from tessera.config.loader import build_config, load_config
from tessera.config.values import parse_bool
from tessera.config.maxtext import ACCEPTED, REFUSED, is_off
from tessera.config.maxtext_model import IN_CONTEXT
from tessera.config.maxtext import ALIASES as KEY_ALIASES
from tessera.config.schema import ConfigError, GpuConfig, all_fields
from tessera.gpu_tuning import effective_settings
from tessera.tools.validate_json import ValidationInputError, json_type, section
from tessera.tools.validate_commands import train_argv

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


@dataclasses.dataclass
class _Reading:
    """What build_plan has read so far: the environment, train keys (with the file's key that set each, for
    train.py's error messages), XLA flags, container settings, and every key left out with its reason."""

    name: str
    env: dict[str, str]
    container: dict[str, Any]
    ignored: dict[str, str]
    xla_flags: list[str]
    overrides: dict[str, str] = dataclasses.field(default_factory=dict)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)


def build_plan(data: dict, name: str, entry: dict) -> Plan:
    """Map every key of `config` and of the model entry to the environment, a train key, or 'ignored'."""
    config = dict(data.get("config", {}))
    container = dict(section(config.pop("container_config", {}), "config.container_config"))
    env = {k: _text(v, f"config.container_config.env_dict.{k}")
           for k, v in section(container.pop("env_dict", {}), "config.container_config.env_dict").items()}
    _refuse_run_folder_variables(env)
    ignored = _container_settings(container)
    flags = section(entry.get("xla_flags", {}), f"model_params.{name}.xla_flags")
    xla_flags = [f"--{k}={_text(v, f'model_params.{name}.xla_flags.{k}')}" for k, v in flags.items()]
    xla_flags = _without_gone_flags(xla_flags, ignored, f"model_params.{name}.xla_flags.")
    r = _Reading(name, env, container, ignored, xla_flags)
    for key, value in config.items():
        _read_config_key(r, key, value, flags, entry)
    # train key -> the config key that set it: a model entry's value for the same train key replaced it silently
    from_config = {CONFIG_TRAIN_KEYS.get(k, k): k for k in config if k in GPU_KEYS or k in CONFIG_TRAIN_KEYS}
    from_config.update({"dataset_type": "mock_data"} if "dataset_type" in r.overrides else {})
    for key, value in entry.items():
        _read_entry_key(r, key, value, entry, from_config)
    if str(entry.get("precision", "")).upper() in FP8_PRECISIONS and not entry.get("quantization"):
        # Transformer Engine's fp8 recipe: e4m3 forward, e5m2 gradients; AMD MI300/MI325 use the fnuz formats
        amd_fnuz = name.rsplit(".", 1)[-1].lower().startswith(("mi300", "mi325"))
        r.overrides["quantization"] = "nanoo_fp8" if amd_fnuz else "fp8"
        r.sources["quantization"] = f"model_params.{name}.precision"
    xla_flags = _without_gone_flags(r.xla_flags, ignored, "config.")  # the entry's flags again: already replaced
    if xla_flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "")] + xla_flags).strip()
    targets = _targets(section(entry.get("result_dict", {}), f"model_params.{name}.result_dict"))
    nnodes = _node_count(container.get("nnodes", env.get("NNODES", 1)))
    coordinator = str(container.get("coordinator_ip") or env.get("JAX_COORDINATOR_IP") or "localhost")
    _refuse_port_in_address(container.get("coordinator_ip"), "config.coordinator_ip")
    _refuse_port_in_address(env.get("JAX_COORDINATOR_IP"), "config.container_config.env_dict.JAX_COORDINATOR_IP")
    return Plan(name, env, r.overrides, targets, container, ignored, nnodes, coordinator,
                env.get("JAX_COORDINATOR_PORT", "8476"), gpu_tuning(r.overrides, env), r.sources)


def _read_config_key(r: _Reading, key: str, value: Any, flags: dict, entry: dict) -> None:
    """A key of the file's `config` section: an environment variable, an XLA flag, a train key, a container
    setting, or left out with its reason; a section in the wrong place is refused."""
    name, env, ignored = r.name, r.env, r.ignored
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
        r.overrides[key], r.sources[key] = _text(value, f"config.{key}"), f"config.{key}"
    elif key.startswith("xla_"):
        text = _text(value, f"config.{key}")
        if key not in flags:
            r.xla_flags.append(f"--{key}={text}")
        elif _text(flags[key], "") != text:  # after the entry's in XLA_FLAGS, where the last one wins, it won
            ignored[f"config.{key}"] = f"model_params.{name}.xla_flags.{key}={flags[key]} is used instead"
    elif key in CONFIG_TRAIN_KEYS:
        r.overrides[CONFIG_TRAIN_KEYS[key]] = _text(value, f"config.{key}")
        r.sources[CONFIG_TRAIN_KEYS[key]] = f"config.{key}"
    elif key == "mock_data":
        if _flag(value, f"config.{key}"):
            r.overrides["dataset_type"], r.sources["dataset_type"] = "synthetic", f"config.{key}"
        elif str(entry.get("dataset_type", "synthetic")).strip().lower() == "synthetic":
            sets = "dataset_type=synthetic" if "dataset_type" in entry else \
                "no dataset_type (Tessera default: synthetic)"
            ignored["config.mock_data"] = (  # "False" trained on synthetic data without a word
                f"false, but the run trains on synthetic data: model_params.{name} sets {sets}; for real data "
                "set dataset_type (hf, tfds, grain) and its data keys there")
    elif key in ("container_image", "shm_size", "nnodes", "coordinator_ip"):
        r.container[key] = value
    elif key in all_fields() or key in ALIASES:  # was "not a setting Tessera has", of model_name too
        ignored[f"config.{key}"] = f"a train key, which the suite reads from the model entry only: move it to " \
                                   f"model_params.{name}"
    else:
        ignored[f"config.{key}"] = IGNORED_WHY.get(key, "not a setting Tessera has")


def _read_entry_key(r: _Reading, key: str, value: Any, entry: dict, from_config: dict[str, str]) -> None:
    """A key of the model entry: a train key (replacing `config`'s, which is then listed), or left out with its
    reason; a misspelt result_dict or xla_flags is refused."""
    name = r.name
    if key in ("xla_flags", "result_dict"):
        return
    if key == "precision" and str(value).upper() in FP8_PRECISIONS and not entry.get("quantization"):
        return  # mapped after the entry's keys
    target = ALIASES.get(key, key)
    text = json.dumps(value) if isinstance(value, list) else str(value)
    if target != key and target in entry:  # an alias next to the key it stands for
        same = str(entry[target]) == text
        r.ignored[key] = f"same as {target}" if same else f"conflicts with {target}={entry[target]}; {target} is used"
    elif target == "run_name":  # replaced by the suite's own name without a word
        r.ignored[key] = ("the suite names the run validate_<file>_<date>_<time>_<pid> (its folder, where node 0's "
                          "report.json is read, is new for each run)")
    elif target in all_fields() or target in IN_CONTEXT:  # the second: train.py checks them against the model
        text = _text(value, f"model_params.{name}.{key}")
        if target in from_config and r.overrides[target] != text:
            r.ignored[f"config.{from_config[target]}"] = f"model_params.{name}.{key}={text} is used instead"
        r.overrides[target], r.sources[target] = text, f"model_params.{name}.{key}"
    elif close := difflib.get_close_matches(key, ("result_dict", "xla_flags"), n=1, cutoff=0.8):
        raise ValidationInputError(f"model_params.{name}.{key} is not a key of a model entry; did you mean "
                                   f"{close[0]}? (as it is, its settings would be dropped)")
    elif key in REFUSED and not is_off(REFUSED[key], value):  # listed as ignored: the run measured without it
        raise ValidationInputError(f"model_params.{name}.{key}={text} is a MaxText key Tessera does not implement: "
                                   f"{REFUSED[key].why}. train.py refuses it, and the suite would measure the entry "
                                   f"without it; remove it from the entry" + (f" (or set it to {REFUSED[key].off[0]})"
                                                                               if REFUSED[key].off else ""))
    else:
        r.ignored[key] = IGNORED_WHY.get(key) or _maxtext_why(key)


def _refuse_run_folder_variables(env: dict[str, str]) -> None:
    """env_dict's M_RUN_NAME or M_BASE_OUTPUT_DIRECTORY, which train.py reads over the run folder the suite gives
    it: node 0's report.json went elsewhere, and the run failed saying every node exited with code 0."""
    for variable in ("M_RUN_NAME", "M_BASE_OUTPUT_DIRECTORY"):
        if variable in env:
            raise ValidationInputError(
                f"config.container_config.env_dict.{variable}={env[variable]} would move the run's folder, where the "
                "suite reads node 0's report.json (config.log_dir/validate_<file>_<date>_<time>_<pid>); remove it "
                "(set config.log_dir for the folder's place)")


def _container_settings(container: dict) -> dict[str, str]:
    """Check container_config's device_list (strings) and volume_dict (host: container folder) in place, each
    value as its text: a string was passed on letter by letter (`--device /`), an array of volumes was a
    traceback. Returns its other keys, for the ignored list (a misspelt `device_lists` was dropped silently)."""
    where = "config.container_config"
    devices = container.get("device_list", [])
    if not isinstance(devices, list):
        raise ValidationInputError(f"{where}.device_list is a JSON {json_type(devices)}; give an array of device "
                                   'paths, e.g. ["/dev/kfd", "/dev/dri"]')
    container["device_list"] = [_text(d, f"{where}.device_list[{i}]") for i, d in enumerate(devices)]
    volumes = section(container.get("volume_dict", {}), f"{where}.volume_dict")
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
    try:
        return parse_bool(where, value)
    except ConfigError:
        raise ValidationInputError(f"{where}={value!r} is not true or false; give \"True\" (synthetic data) or "
                                   "\"False\" (the model entry's dataset_type)") from None


def _refuse_port_in_address(value: Any, where: str) -> None:
    """A coordinator address with its port ("10.0.0.2:1234"): the dry run printed it and every trainer then
    refused it (`distributed._job_layout`); the port is JAX_COORDINATOR_PORT."""
    text = str(value or "").strip()
    if re.fullmatch(r"[^:\[\]]+:\d+|\[[^\]]+\]:\d+", text):  # host:port or [v6]:port; a bare IPv6 has more colons
        host, port = text.rsplit(":", 1)
        raise ValidationInputError(f"{where}={text} holds a port: give the address alone, {host}, and the port as "
                                   f"config.container_config.env_dict.JAX_COORDINATOR_PORT={port}")


def _node_count(value: Any) -> int:
    """config.nnodes (or NNODES in env_dict) as a count of nodes; an empty value is 1."""
    text = str(value).strip()
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ValidationInputError(f"config.nnodes={value!r} is not a number of nodes; give a whole number of at "
                                   "least 1 (or leave it out for one node)")
    return int(text)


def _maxtext_why(key: str) -> str:
    """Why a model-param key that is not a Tessera train key is left out (MaxText keys: the loader's reason)."""
    if key in ACCEPTED:
        return ACCEPTED[key][1]
    if key in REFUSED:  # with the feature off (on, it is refused)
        return f"MaxText key (off here, as in Tessera): {REFUSED[key].why}"
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
