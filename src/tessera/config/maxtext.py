"""MaxText's config keys that are not Tessera keys: what the loader does with each.

MaxText users' commands should run unchanged where Tessera has the feature, and fail with a
reason where it does not. Every MaxText key falls in one of five groups:

- the same name (most keys: `steps`, `per_device_batch_size`, `ici_fsdp_parallelism`, ...):
  nothing to do, they are schema keys;
- `ALIASES`: another spelling of a key we have; the loader renames it and logs that once;
- `ACCEPTED`: a setting Tessera takes from elsewhere (`hardware`: the devices JAX sees); the
  value is checked, logged and has no effect;
- `REFUSED` (maxtext_refused.py): a feature Tessera does not implement. A value that leaves the feature off (the
  `off` values, MaxText's defaults) is accepted and logged; any other value is refused with
  what the key does in MaxText and what to use in Tessera;
- `IN_CONTEXT` (maxtext_model.py): a key whose meaning depends on the model (gemma2's post norms,
  the YaRN factor); kept, and checked against the built model by the loader.

Values are translated too: `VALUE_ALIASES` (MaxText's name for a value of a shared key) and
`MODEL_NAMES` (MaxText's `model_name` where Tessera's file has another name).

getting_started/Coming_from_MaxText.md explains the same groups in prose (a test keeps it
mentioning every refused key). This module imports nothing from JAX.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any, Callable, Mapping

from tessera.config.maxtext_model import IN_CONTEXT
from tessera.config.maxtext_refused import REFUSED, Refused
from tessera.config.schema import ConfigError

log = logging.getLogger("tessera")

# alias -> (our key, whose spelling it is). The GPU validation files' spellings are here too, so
# that tools/validate.py and train.py share one mapping.
ALIASES = {
    "ici_context_parallelism": ("ici_sequence_parallelism", "MaxText's"),
    "dcn_context_parallelism": ("dcn_sequence_parallelism", "MaxText's"),
    "dump_hlo_local_module_name": ("dump_hlo_module_name", "MaxText's local-dump filter"),
    "rope_factor": ("rope_scaling_factor", "MaxText's (rope_type=yarn models)"),
    "original_max_position_embeddings": ("rope_original_max_position", "MaxText's"),
    "learning_rate_final_fraction": ("cosine_learning_rate_final_fraction", "MaxText's newer"),
    "sequence_length": ("max_target_length", "the GPU validation files'"),
    "micro_batch_size": ("per_device_batch_size", "the GPU validation files'"),
    "tensor_parallelism": ("ici_tensor_parallelism", "the GPU validation files'"),
    "pipeline_parallelism": ("ici_pipeline_parallelism", "the GPU validation files'"),
}

COUNT = ("-1", "a whole number >= 1")  # allowed values of a count that is -1 (none) or positive
WHOLE = ("a whole number >= 0",)
FRACTION = ("a number from 0 to 1",)
ANY = ("any value",)


def _allowed(choices: tuple[str, ...], text: str) -> bool:
    """`text` (lower-case) is one of `choices`, or a count when `choices` is COUNT (WHOLE, FRACTION: a
    number of that kind), or anything for ANY."""
    if choices is COUNT:
        return text == "-1" or (text.isdigit() and int(text) >= 1)
    if choices is WHOLE:
        return text.isdigit()
    if choices is FRACTION:
        try:
            return 0 <= float(text) <= 1
        except ValueError:
            return False
    return choices is ANY or text in choices


# the vision encoder's keys in MaxText's gemma3 and llama4 model files, which it reads with use_multimodal=true only
VISION_KEYS = ("vision_encoder_block", "image_size_for_vit", "num_channels_for_vit", "patch_size_for_vit",
               "conv_stride_for_vit", "hidden_size_for_vit", "intermediate_size_for_vit", "num_hidden_layers_for_vit",
               "num_attention_heads_for_vit", "image_placeholder")


# key -> (allowed values, why it has no effect)
ACCEPTED = {
    "hardware": (("tpu", "gpu", "cpu", "gpu_multiprocess"),
                 "Tessera uses the platform of the devices JAX sees at start-up; detection wins over this key"),
    "dump_hlo_delete_local_after": (("true", "false", "1", "0"),
                                    "Tessera does not upload the HLO dump, so it keeps it in dump_hlo_local_dir"),
    # MaxText refuses a model file's key given on the command line unless this is true; here the command
    # line always wins (a shrunk model: model_name=llama2-7b base_num_decoder_layers=2)
    "override_model_config": (("true", "false", "1", "0"),
                              "a key=value on the command line always wins over the model file in Tessera"),
    # MaxText's default (false) refuses a mesh that needs a physical axis split; Tessera's mesh.py always
    # builds it (jax's create_device_mesh with allow_split_physical_axes=True), as MaxText does with true
    "allow_split_physical_axes": (("true", "false", "1", "0"),
                                  "Tessera always lets a mesh axis span part of a physical axis of the slice when "
                                  "the mesh needs it (as MaxText with true)"),
    # MaxText's implementation switches and print-outs (its test commands pass them): the same model and run here
    **{name: (("true", "false", "1", "0"), "MaxText builds its model in Flax Linen or NNX by these switches; Tessera's "
              "one implementation is NNX") for name in ("enable_nnx", "pure_nnx", "pure_nnx_decoder")},
    "log_config": (("true", "false", "1", "0"), "Tessera logs the keys that differ from base.yml at start-up and saves "
                                                "the whole config in the run folder (config.yml)"),
    "debug_sharding": (("true", "false", "1", "0"), "Tessera logs every parameter's shape and sharding at start-up"),
    # every MaxText GPU config sets 32: TransformerEngine's packed attention, and MaxText's grain packing, take at most
    # this many documents in a sequence; Tessera's cuDNN path hands packed batches to the reference attention
    "max_segments_per_seq": (COUNT, "Tessera's cuDNN attention runs packed batches (several documents in a sequence) "
                                    "with the reference attention, which needs no cap, and its packing puts no cap on "
                                    "the documents in a sequence"),
    # Tessera rotates the two halves of each head (MaxText's false, Hugging Face's layout); interleaved pairs are
    # the same model with the head's dimensions in another order
    "rope_interleave": (("true", "false", "1", "0"),
                        "Tessera's rotary embedding turns the two halves of each head (MaxText's false, the Hugging "
                        "Face layout); MaxText's true turns adjacent pairs: the same model with the dimensions of each "
                        "query and key head in another order, which training from scratch cannot tell apart"),
    # MaxText's profile_cleanly=true waits for the step before the trace starts and ends, so that the trace holds
    # whole steps; Tessera's profiler always does (loop_records.Profiler.bounds_before)
    "profile_cleanly": (("true", "false", "1", "0"), "Tessera's trace always starts and ends between finished steps "
                                                     "(as MaxText with true), so that it holds exactly profiler_steps "
                                                     "steps"),
    # how MaxText's sparse matmul differentiates its sort of the tokens by expert: the same gradients either way
    "use_custom_sort_vjp": (("true", "false", "1", "0"),
                            "it chooses how MaxText's sparse matmul computes the gradient of its sort of the tokens by "
                            "expert, the same gradient either way; Tessera's routing has its own"),
    # MaxText stops at start-up when more than this share of the parameters' bytes is not sharded
    "sharding_tolerance": (FRACTION, "Tessera does not check how much of the parameters is replicated; the start-up "
                                     "log gives every parameter's shape and sharding"),
    # MaxText's switches of its reference attention's score precision: Tessera's kernels all take its true
    **{name: (("true", "false", "1", "0"), "Tessera's attention (every kernel) forms the query-key scores with "
              "float32 accumulation, which for bfloat16 queries and keys is their float32 product exactly (the "
              "product of two bfloat16 numbers is exact in float32), and soft-caps, masks and normalizes them in "
              "float32: MaxText's true; its false (the default) rounds the scores to dtype, which Tessera never does")
       for name in ("float32_qk_product", "float32_logits")},
    "goodput_upload_interval_seconds": (WHOLE, "Tessera uploads no goodput (monitor_goodput=true is refused); the run's "
                                               "goodput is in report.json"),
    **{name: (ANY, "MaxText reads it with use_multimodal=true only (a vision encoder before the decoder); Tessera "
                   "trains and decodes text only, as MaxText with use_multimodal=false") for name in VISION_KEYS},
}


# MaxText's model names whose model file Tessera names otherwise: {MaxText's model_name: ours}. Read only when no
# file of MaxText's name is found (a models/ folder beside the config file may hold one of the user's own).
MODEL_NAMES = {"deepseek3-671b": "deepseek-v3", "olmo3_32b": "olmo3-32b"}

# Values of a key Tessera shares with MaxText that MaxText spells otherwise: {key: {MaxText's value: ours}}.
# Tessera's save_dot_except_mlp keeps attention's output (context) with the projections, which MaxText's value
# of that name recomputes and its save_dot_with_context_except_mlp keeps.
# MaxText's cudnn_flash_jax is cuDNN's fused attention through JAX, which is what Tessera's cudnn_flash_te runs on
# NVIDIA GPUs (Tessera has no Transformer Engine path).
VALUE_ALIASES = {"remat_policy": {"save_dot_with_context_except_mlp": "save_dot_except_mlp"},
                 "attention": {"cudnn_flash_jax": "cudnn_flash_te"}}
_MINIMAL_WITH_CONTEXT = ("keep every projection's output and attention's output (context); Tessera's minimal keeps the "
                         "projections' outputs only: remat_policy=custom query_proj=device key_proj=device "
                         "value_proj=device context=device out_proj=device mlpwi_0=device mlpwi_1=device mlpwi=device "
                         "mlpwo=device keeps the same tensors")
# MaxText values of a shared key Tessera does not have: {key: {value: what it does in MaxText; what to use}}
REFUSED_VALUES = {"remat_policy": {"minimal_with_context": _MINIMAL_WITH_CONTEXT,
                                   "minimal_flash": _MINIMAL_WITH_CONTEXT}}


# Keys Tessera shares with MaxText whose "unset" MaxText spells differently (its base.yml holds
# these values): {key: (MaxText's values, Tessera's value, what it means)}. A config file or
# command line written for MaxText means the same here; the translation is logged once.
UNSET = {
    "eval_interval": (("-1",), 0, "never evaluate"),
    "base_moe_mlp_dim": (("-1",), 0, "experts as wide as base_mlp_dim"),
    "trainable_position_size": (("-1",), 0, "no learned position table"),
    "nope_layer_interval": (("-1",), 0, "rotary positions in every layer"),
    "compile_topology_num_slices": (("-1",), 1, "one slice"),
    "max_num_checkpoints_to_keep": (("none", "null", "~", ""), -1, "keep every checkpoint"),
    "routed_score_func": (("",), "softmax", "softmax router scores"),
    "muon_consistent_rms": (("none", "null", "~", ""), 0.0, "Muon's width scaling, sqrt(max(1, fan_out / fan_in))"),
}


def steps_from_schedule(merged: dict[str, Any], whole: Callable[[Any], int]) -> str:
    """MaxText's `steps=-1`: as many steps as `learning_rate_schedule_steps` (in `merged`, the
    config's keys after every layer; set in place and logged). `whole` reads the schedule's value
    as the schema does (1e3, 1000.0 and 1_000 are 1000; ConfigError for a bad one). With the
    schedule's length unset too, the error line to report (neither key gives the other a length);
    '' otherwise."""
    if "steps" not in merged or not spelled_as(merged["steps"], ("-1",)):
        return ""
    schedule = merged.get("learning_rate_schedule_steps", -1)
    if not spelled_as(schedule, ("-1",)):
        try:
            schedule = whole(schedule)
        except ConfigError:
            schedule = 0
        if schedule < 1:  # a bad schedule value (abc, 0, -2) is reported once, under its own name
            del merged["steps"]
            return ""
        log_once(f"steps=-1 is MaxText's spelling of 'as many steps as learning_rate_schedule_steps'; "
                 f"using steps={schedule}")
        merged["steps"] = schedule
        return ""
    del merged["steps"]  # one line about it, not a second "too small"
    return ("steps=-1 (MaxText's spelling of 'as many steps as learning_rate_schedule_steps') needs "
            "learning_rate_schedule_steps set, and it is -1 (as many as steps) too; give steps=<the number of "
            "optimizer steps>")


def render_aliases() -> list[str]:
    """The comment block base.yml ends with: every other key name the loader accepts."""
    lines = ["", "# --- Aliases: other trainers' names for the keys above, accepted and logged when used"]
    lines += [f"# {alias} -> {target}  ({whose} name)" for alias, (target, whose) in ALIASES.items()]
    lines += [f"# {name} [one of: {', '.join(choices)}]: accepted; {why}" for name, (choices, why) in ACCEPTED.items()
              if choices is not ANY]
    lines += [f"# {', '.join(VISION_KEYS)}: accepted; {ACCEPTED[VISION_KEYS[0]][1]}"]
    lines += [f"# {name}={spelled[0] or '(empty)'} (MaxText's spelling of {meaning}) -> {name}={ours}"
              for name, (spelled, ours, meaning) in UNSET.items()]
    lines += [f"# {name}={theirs} (MaxText's name) -> {name}={ours}"
              for name, values in VALUE_ALIASES.items() for theirs, ours in values.items()]
    lines += [f"# {', '.join(IN_CONTEXT)}: MaxText's, accepted where the model does what they ask in MaxText "
              "(gemma2's post norms, ...), else refused with what it does"]
    lines += ["# MaxText keys Tessera does not implement are refused with a reason (left at MaxText's default, off,",
              "# they are ignored): see src/tessera/config/maxtext.py and getting_started/Coming_from_MaxText.md"]
    return lines


def is_off(refused: Refused, value) -> bool:
    """`value` (YAML value or command-line text) leaves the refused feature off."""
    return spelled_as(value, refused.off)


def spelled_as(value, spellings: tuple[str, ...]) -> bool:
    """`value` (YAML value or command-line text) is one of `spellings` (lower-case text; numbers
    compare as numbers: MaxText's base.yml writes -1.0 and 10_000_000)."""
    text = "" if value is None else str(value).strip().lower()
    return text in spellings or any(_same_number(text, s) for s in spellings)


def _same_number(text: str, off: str) -> bool:
    try:
        return float(text.replace("_", "")) == float(off)
    except ValueError:
        return False


def maxtext_keys() -> set[str]:
    """Every non-schema key the loader knows (aliased, accepted or refused)."""
    return set(ALIASES) | set(ACCEPTED) | set(REFUSED) | set(IN_CONTEXT)


def translate(values: Mapping[str, Any], source: str, fields: Mapping[str, Any], errors: list[str]) -> dict:
    """`values` (one layer of the config, set in `source`) with aliases renamed to our keys and
    keys without effect dropped; one line in `errors` per unknown key, refused MaxText key, bad
    `hardware` value or alias that disagrees with its key in the same layer."""
    out = {}
    for name, value in values.items():
        if name in UNSET and spelled_as(value, UNSET[name][0]):
            _, ours, meaning = UNSET[name]
            log_once(f"{name}={value!r} is MaxText's spelling of {meaning}; using {name}={ours!r}")
            out[name] = ours
        elif name in fields and (ours := VALUE_ALIASES.get(name, {}).get(str(value).strip().lower())):
            log_once(f"{name}={value} is MaxText's name for {name}={ours}; using that")
            out[name] = ours
        elif name in fields and (why := REFUSED_VALUES.get(name, {}).get(str(value).strip().lower())):
            errors.append(f"{name}={value!r} is a MaxText value Tessera does not have: it would {why} (from {source})")
        elif name in fields:
            out[name] = value
        elif name in ALIASES:
            target, whose = ALIASES[name]
            if target in values and not spelled_as(value, (str(values[target]).strip().lower(),)):
                errors.append(f"{name}={value!r} ({whose} name for {target}) disagrees with "
                              f"{target}={values[target]!r} in {source}; set only {target}")
                continue
            log_once(f"{name}={value} is {whose} name for {target}; using that")
            out[target] = value
            if name in IN_CONTEXT:  # and checked against the model once it is built
                out[name] = value
        elif name in ACCEPTED:
            choices, why = ACCEPTED[name]
            if _allowed(choices, str(value).strip().lower()):
                log_once(f"{name}={value} has no effect: {why}")
            else:
                errors.append(f"{name}={value!r} is not allowed; choose one of: {', '.join(map(repr, choices))} "
                              f"(from {source})")
        elif name in IN_CONTEXT:
            out[name] = value  # checked against the model once it is built
        elif name in REFUSED:
            if is_off(REFUSED[name], value):
                log_once(f"{name}={value!r} is MaxText's setting with the feature off, as in Tessera; ignored")
            else:
                errors.append(f"{name}={_shown(value)} is a MaxText key Tessera does not implement: "
                              f"{REFUSED[name].why} (from {source})")
        else:
            errors.append(unknown_key(name, source, fields))
    return out


SHOWN_CHARS = 80  # of a refused value in its error line (MaxText's logical_axis_rules runs to 4,000)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 3]}..."


def unknown_key(name: str, source: str, fields: Mapping[str, Any]) -> str:
    """The error line for an unknown key: its 3 closest keys (an alias shows the key it stands for)."""
    named = [*fields, *ALIASES, *(k for k, (choices, _) in ACCEPTED.items() if choices is not ANY)]
    close = difflib.get_close_matches(name.lower().lstrip("-"), named, n=3, cutoff=0.5)
    shown = [f"{c} (= {ALIASES[c][0]})" if c in ALIASES else c for c in close]
    hint = f"; did you mean {', '.join(shown)}?" if close else "; see configs/base.yml for every key"
    return f"unknown config key {name!r} in {source}{hint}"


_logged: set[str] = set()


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)
