"""decode.py's command line: the decoding flags (`parse_args`) and the prompts they give, as
token ids checked against the model (`encode_prompts`). See tessera.decode."""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.config import Config, ConfigError
from tessera.seeds import SEED_RANGE
from tessera.tools.cli import config_epilog

if TYPE_CHECKING:
    from tessera.data.tokenizers import Tokenizer

log = logging.getLogger("tessera")

FLOAT32_MAX = 3.4028234663852886e38  # a larger --temperature is inf in float32


class _OneLineErrors(argparse.ArgumentParser):
    """A bad flag is one line on stderr and exit code 2, as every bad input of decode.py is (argparse
    printed its usage block first)."""

    def error(self, message: str):
        if message.startswith(("argument --prompt: expected one argument", "argument --tokens: expected one argument")):
            message += f" (one that starts with '-' is given as {message.split()[1].rstrip(':')}=VALUE)"
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(decoding flags, config arguments): `--flag value` pairs are ours, the rest (the config
    file and key=value overrides) go to `load_config`."""
    parser = _parser()
    flags, rest = parser.parse_known_args(_joined_token_lists(argv))
    stray = _stray_words(_joined_token_lists(argv))
    if stray:  # the config said "argument 'upon' is not of the form key=value"
        flag, value, words = stray
        fix = (f'quote a prompt of several words: --prompt "{" ".join([value, *words])}"' if flag == "--prompt" else
               f"token ids are separated by commas: --tokens {','.join([value, *words])}")
        parser.error(f"{' '.join(words)} after {flag} {value} is neither a flag nor a key=value; {fix}")
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        name = unknown[0].split("=")[0][2:].replace("-", "_")
        meant = f"did you mean --{name}? " if name in vars(flags) else ""
        parser.error(f"unknown flag {unknown[0]}; {meant}config keys are given as key=value")
    as_keys = [a for a in rest if a.split("=")[0] in vars(flags) and "=" in a]
    if as_keys:  # the config's error named the closest config key (max_new_tokens=5: max_num_checkpoints_to_keep)
        name, value = as_keys[0].split("=", 1)
        parser.error(f"{as_keys[0]} is a decoding flag, not a config key: give it as --{name} {value}")
    as_env = sorted(name for name in os.environ if name.startswith("M_") and name[2:].lower() in vars(flags))
    if as_env:  # the config ignored it, with "did you mean M_TEMPERATURE_TUNING?" (a llama4 model key) for M_TEMPERATURE
        name = as_env[0]
        parser.error(f"environment variable {name}={os.environ[name]} is a decoding flag, not a config key: give it "
                     f"as --{name[2:].lower()} {os.environ[name]} (and unset {name})")
    _check_values(parser, flags)
    return flags, rest


def check_parameters_named(cfg: Config) -> None:
    """ConfigError unless load_parameters_path names the parameters to decode with."""
    if not cfg.checkpoint.load_parameters_path and cfg.checkpoint.load_full_state_path:
        raise ConfigError(f"decoding reads parameters from load_parameters_path, not load_full_state_path (training's "
                          f"resume): give load_parameters_path={cfg.checkpoint.load_full_state_path}")
    if not cfg.checkpoint.load_parameters_path:
        raise ConfigError("decoding needs load_parameters_path=<checkpoint step folder> (e.g. "
                          "outputs/demo/checkpoints/100) and the model keys it was trained with")


def exit_if_arguments_fail(argv: list[str]) -> None:
    """What decode.py checks before it imports JAX (about 2 s): --help, a bad flag, a missing config
    file, a config that does not load and one without load_parameters_path end there, with the lines
    and exit code `tessera.decode.main` gives them (argparse's one line, `error: ...`, `config error:
    ...`; exit code 2), in a fraction of a second."""
    import sys

    from tessera.tools.cli import EXIT_USER_ERROR, UsageError, exit_if_config_error, resolve_config_file

    _, config_args = parse_args(argv)
    try:
        resolved = resolve_config_file(config_args)
    except UsageError as e:  # a config file that is not there
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    exit_if_config_error(resolved, check=check_parameters_named)


def _parser() -> argparse.ArgumentParser:
    """The decoding flags' parser (its usage, help and one-line errors)."""
    parser = _OneLineErrors(
        prog=".venv/bin/python -m tessera.decode", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s configs/base.yml load_parameters_path=PATH [tokenizer_path=PATH] [key=value ...] "
              "(--prompt TEXT | --tokens 1,2,3) [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P] [--seed S] "
              "[--eos_id ID ... | --ignore_eos]\n"
              "       .venv/bin/python decode.py ... (the same)",
        description="Generate text from a checkpoint. key=value arguments build the config as for training: "
                    "give the model keys the checkpoint was trained with.",
        epilog=config_epilog(("load_parameters_path", "tokenizer_path", "model_name", "max_target_length",
                              "add_bos", "ici_tensor_parallelism"), ("getting_started/Decode.md",)))
    parser.add_argument("--prompt", action="append", default=[], help="text to continue (repeat for a batch)")
    parser.add_argument("--tokens", action="append", default=[], type=_token_ids,
                        help="token ids to continue, comma-separated (repeat for a batch); no tokenizer needed")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the K most likely tokens (0, or at "
                        "least the vocabulary size: all)")
    parser.add_argument("--top_p", type=float, default=1.0, help="sample among the most likely tokens whose "
                        "probabilities add up to P (nucleus sampling; 1: all)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    parser.add_argument("--eos_id", type=_stop_id, action="append", default=None, help="stop a row at this token; "
                        "repeat for several stop tokens (default: the tokenizer's end-of-sequence token; none with "
                        "--tokens)")
    parser.add_argument("--ignore_eos", action="store_true", help="no stop token: every row generates "
                        "--max_new_tokens tokens (a fixed length, e.g. to time decoding)")
    return parser


def _check_values(parser: argparse.ArgumentParser, flags: argparse.Namespace) -> None:
    """parser.error (exit 2) for a flag's value out of its range."""
    # each written so that nan fails it: every comparison with nan is false
    wrong = [f"--{name} {getattr(flags, name)} {rule}" for name, ok, rule in (
        ("max_new_tokens", flags.max_new_tokens >= 1, "must be at least 1"),
        ("temperature", 0 <= flags.temperature <= FLOAT32_MAX, f"must be a number from 0 (greedy) to {FLOAT32_MAX:g} "
         "(the largest float32)"),
        ("top_k", flags.top_k >= 0, "must be >= 0 (0: all tokens)"),
        ("top_p", 0 < flags.top_p <= 1, "must be in (0, 1] (1: all tokens)"),
        ("seed", -SEED_RANGE <= flags.seed < SEED_RANGE,
         f"must be a whole number from {-SEED_RANGE} to {SEED_RANGE - 1}"),
    ) if not ok]
    if wrong:
        parser.error("; ".join(wrong))
    if flags.ignore_eos and flags.eos_id:
        parser.error("--ignore_eos and --eos_id: give stop tokens or none, not both")
    for stop in flags.eos_id or []:
        if stop < 0:
            parser.error(f"--eos_id {stop} is not a token id (ids are >= 0); leave it out to stop at the "
                         "tokenizer's end-of-sequence token")


def _warn_other_text_keys(path: str, tokenizer_path: str, add_bos: bool) -> None:
    """Warnings when the checkpoint at `path` was trained with another tokenizer than `tokenizer_path` (its
    saved tokenizer_path holds other bytes): the prompts' ids then mean other text to the model, and the
    printed text was garbage without a word; or with another add_bos: every training document began with the
    BOS token, and prompts without it (or the other way round) were decoded silently. A saved path missing here
    is not compared."""
    import filecmp

    from tessera.checkpointing import saved_config

    saved = saved_config(path) if path else {}
    if isinstance(saved.get("add_bos"), bool) and saved["add_bos"] != add_bos:
        given = str(saved["add_bos"]).lower()
        log.warning("load_parameters_path=%s was trained with add_bos=%s, and the prompts are encoded with add_bos=%s "
                    "(%s): give add_bos=%s", path, given, str(add_bos).lower(),
                    "a BOS token the model never saw before its text" if add_bos else
                    "without the BOS token that began every document it learned", given)
    saved = saved.get("tokenizer_path")
    if not saved or not isinstance(saved, str) or saved == tokenizer_path:
        return
    files = []
    for p in (Path(saved), Path(tokenizer_path)):
        if p.is_dir():  # the file load_tokenizer reads in a folder
            p = p / "tokenizer.json" if (p / "tokenizer.json").is_file() else p / "tokenizer.model"
        files.append(p)
    if files[0].is_file() and files[1].is_file() and not filecmp.cmp(*files, shallow=False):
        log.warning("load_parameters_path=%s was trained with tokenizer_path=%s, which differs from tokenizer_path=%s: "
                    "the prompts are encoded, and the output decoded, with another vocabulary than the model learned; "
                    "give tokenizer_path=%s", path, saved, tokenizer_path, saved)


def _stray_words(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """(flag, its value, the words after it) for `--prompt Once upon a time` (no quotes) or `--tokens 1 2 3`:
    words right after a --prompt or --tokens value that are neither a flag, nor a key=value, nor a config file."""
    for i, arg in enumerate(argv):
        flag, joined, value = arg.partition("=")  # --prompt=Once upon too
        if flag not in ("--prompt", "--tokens") or not joined and i + 1 == len(argv):
            continue
        value, after = (value, argv[i + 1:]) if joined else (argv[i + 1], argv[i + 2:])
        words = list(itertools.takewhile(
            lambda a: not a.startswith("-") and "=" not in a and not a.endswith((".yml", ".yaml")), after))
        if flag == "--tokens":
            words = list(itertools.takewhile(lambda a: re.fullmatch(r"[\d,]+", a), words))
        if words:
            return flag, value, words
    return None


def _joined_token_lists(argv: list[str]) -> list[str]:
    """`--tokens -1,2` as `--tokens=-1,2`: argparse takes a value starting with '-' for a flag (and says
    "expected one argument"); joined, the ids reach the check that names what is wrong with them."""
    out = []
    for arg in argv:
        if out and out[-1] == "--tokens" and re.fullmatch(r"-[\d,\s-]*", arg):
            out[-1] = f"--tokens={arg}"
        else:
            out.append(arg)
    return out


def _stop_id(text: str) -> int:
    """One --eos_id; several given as `3,4` are named (argparse said only "invalid int value")."""
    if re.fullmatch(r"[+-]?\d+", text.strip()):
        return int(text)
    ids = [t.strip() for t in text.split(",")]
    if len(ids) > 1 and all(re.fullmatch(r"[+-]?\d+", t) for t in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: give each stop token as its own flag: "
                                          + " ".join(f"--eos_id {t}" for t in ids))
    raise argparse.ArgumentTypeError(f"{text!r} is not a token id (a whole number)")


def _token_ids(text: str) -> list[int]:
    parts = text.replace(" ", "").split(",")
    if all(re.fullmatch(r"[+-]?\d+", t) for t in parts):  # no empty entry: `1,,2` or `1,2,` is a typo, not `1,2`
        return [int(t) for t in parts]
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids (e.g. 1,2,3)")


def encode_prompts(cfg: Config, flags: argparse.Namespace) -> tuple[Tokenizer | None, list[list[int]]]:
    """The tokenizer (None with --tokens) and the prompts as token ids, checked against the config."""
    from tessera.data.tokenizers import check_tokenizer, load_tokenizer

    if bool(flags.prompt) == bool(flags.tokens):
        raise ConfigError("give the prompts as --prompt TEXT (with tokenizer_path=...) or as --tokens 1,2,3, "
                          "not both and not neither")
    tokenizer = None
    prompts = flags.tokens
    if flags.prompt:
        for i, text in enumerate(flags.prompt):
            try:  # bytes that are not UTF-8 reach Python as lone surrogates (U+DC80..U+DCFF)
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # SentencePiece and Hugging Face raised a traceback; tiktoken replaced them
                raise ConfigError(f"prompt {i + 1} ({text!r}) is not UTF-8 text: byte 0x{ord(text[e.start]) & 0xFF:02x} "
                                  f"at character {e.start}; give the prompt in UTF-8 (e.g. `iconv -f latin1 -t utf-8`), "
                                  "or token ids with --tokens") from None
        if not cfg.data.tokenizer_path:  # load_tokenizer's own line spoke of a data pipeline's text columns
            raise ConfigError("reading text needs tokenizer_path (a SentencePiece .model, a tiktoken BPE file or a "
                              "folder with tokenizer.json: the one the model was trained with) to encode --prompt; "
                              "without one, give token ids with --tokens 1,2,3")
        tokenizer = load_tokenizer(cfg.data.tokenizer_path, cfg.data.tokenizer_type)
        _warn_other_text_keys(cfg.checkpoint.load_parameters_path, cfg.data.tokenizer_path, cfg.data.add_bos)
        check_tokenizer(tokenizer, cfg.data.tokenizer_path, cfg.model.vocab_size, cfg.data.add_bos, False)
        bos = [tokenizer.bos_id] if cfg.data.add_bos else []
        encoded = tokenizer.encode_batch(flags.prompt)
        for i, (text, ids) in enumerate(zip(flags.prompt, encoded)):
            if text.strip() and not ids:  # a Hugging Face BPE without an unknown token drops what it lacks
                raise ConfigError(f"prompt {i + 1} ({text!r}) encodes to no tokens with tokenizer_path="
                                  f"{cfg.data.tokenizer_path}: none of its characters is in the tokenizer's "
                                  "vocabulary, and it drops them; give text it knows, or token ids with --tokens")
        prompts = [bos + ids for ids in encoded]
    vocab, limit = cfg.model.vocab_size, cfg.data.max_target_length
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ConfigError(f"prompt {i + 1} is empty; give at least one token")
        if not all(0 <= t < vocab for t in prompt):
            raise ConfigError(f"prompt {i + 1} has token ids outside [0, vocab_size={vocab}): {prompt}")
        if len(prompt) + flags.max_new_tokens > limit:
            raise ConfigError(f"prompt {i + 1} has {len(prompt)} tokens + --max_new_tokens {flags.max_new_tokens} = "
                              f"{len(prompt) + flags.max_new_tokens}, more than max_target_length={limit} (the "
                              "sequence length the model was trained for); shorten the prompt, lower "
                              f"--max_new_tokens or set max_target_length={len(prompt) + flags.max_new_tokens}")
    from tessera.models import BLOCKS

    table = cfg.model.trainable_position_size if BLOCKS[cfg.model.decoder_block].absolute_positions else 0
    longest = max(len(p) for p in prompts)
    if table and longest + flags.max_new_tokens > table:  # raising max_target_length cannot help here
        raise ConfigError(f"{longest} prompt tokens + --max_new_tokens {flags.max_new_tokens} = "
                          f"{longest + flags.max_new_tokens}, more than the trainable_position_size={table} positions "
                          "this model has learned embeddings for; shorten the prompt or lower --max_new_tokens")
    return tokenizer, prompts


def stop_tokens(cfg: Config, flags: argparse.Namespace, tokenizer: Tokenizer | None) -> list[int]:
    """The tokens a row stops at: every --eos_id (none with --ignore_eos); else the tokenizer's end token and the
    `eos_token_id` of a Hugging Face `generation_config.json` beside the tokenizer (Llama 3 instruct ends a turn
    with 128009, which its tokenizer.json does not name as its end token: rows ran on past their answers)."""
    if flags.eos_id or flags.ignore_eos:
        return list(flags.eos_id or [])
    if tokenizer is None:  # --tokens: no end token is known
        return []
    stops = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    found = _generation_config_stops(cfg.data.tokenizer_path, cfg.model.vocab_size)
    if found:
        path, ids = found
        stops += [t for t in ids if t not in stops]
        log.info("a row stops at token(s) %s: the tokenizer's end token and eos_token_id of %s (--eos_id replaces "
                 "them)", ", ".join(map(str, stops)), path)
    return stops


def _generation_config_stops(tokenizer_path: str, vocab_size: int) -> tuple[str, list[int]] | None:
    """(path, eos_token_id as a list) of the generation_config.json in the tokenizer's folder, or None."""
    import json

    given = Path(tokenizer_path).expanduser()
    path = (given if given.is_dir() else given.parent) / "generation_config.json"
    if not path.is_file():
        return None
    fix = "fix it, or give the stop tokens as --eos_id (which replaces it)"
    try:
        ids = json.loads(path.read_text(encoding="utf-8-sig")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:  # AttributeError: not a JSON object
        what = "is not a JSON object" if isinstance(e, AttributeError) else f"cannot be read ({e})"
        raise ConfigError(f"{path} {what}: {fix}") from None
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ConfigError(f"{path}: eos_token_id {token!r} is not a token id in [0, vocab_size={vocab_size}); "
                              f"{fix}")
    return str(path), ids
