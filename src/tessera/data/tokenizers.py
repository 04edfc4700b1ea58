"""Tokenizers behind one small interface: `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`,
`bos_id`, `eos_id`.

Three file kinds, chosen from `tokenizer_path` (or `tokenizer_type` when the path does not say):
- SentencePiece: a `.model` file (or a folder holding `tokenizer.model`).
- tiktoken-style BPE: a text file of `<base64 token> <rank>` lines (`.tiktoken`, Llama 3's
  `tokenizer.model` is one). Two special tokens are appended after the ranks, begin and end
  of text, as Llama 3 does; the text is split with the GPT-4-style pattern below.
- Hugging Face: a folder with `tokenizer.json` (or the file itself), read with `tokenizers`.
  Begin/end tokens come from `tokenizer_config.json` when present, else from common names.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tessera.config import ConfigError

# How tiktoken-style files split text before BPE (the pattern of cl100k / Llama 3 files).
TIKTOKEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|startoftext|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ \d+\s*$")


class Tokenizer:
    """`encode` returns token ids without begin/end tokens (the pipeline adds them as configured).
    `encode_document` encodes a training document: text that spells a special token (`</s>`,
    `<|end_of_text|>`) is text there, so a document holds no begin/end token the pipeline did not add
    (SentencePiece and tiktoken's `encode_ordinary` do so in `encode` too; Hugging Face's `encode`
    turns such text into the special token, which prompts may want)."""

    def __init__(self, kind: str, vocab_size: int, bos_id: int | None, eos_id: int | None, encode_batch, decode,
                 encode_document=None):
        self.kind, self.vocab_size, self.bos_id, self.eos_id = kind, vocab_size, bos_id, eos_id
        self._encode_batch, self._decode = encode_batch, decode
        self._encode_document = encode_document

    def encode(self, text: str) -> list[int]:
        return self._encode_batch([text])[0]

    def encode_document(self, text: str) -> list[int]:
        return self._encode_document(text) if self._encode_document else self.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encode_batch(texts)

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (generated text, see tessera.decode)."""
        return self._decode(list(ids))


def _hub_name_hint(p: Path) -> str:
    """For a missing tokenizer_path written as a Hugging Face Hub name (MaxText's tokenizer_path=openai/gpt-oss-20b,
    made absolute against the working directory by the config loader): that Tessera does not download it."""
    given = os.path.relpath(p)
    if given.startswith(".") or not re.fullmatch(r"[\w.-]+/[\w.-]+", given):
        return ""
    return (f" (a Hugging Face Hub name such as {given} is not downloaded here, as MaxText does: download the "
            "repository's tokenizer files, tokenizer.json or tokenizer.model, to a folder and give that folder)")


def load_tokenizer(path: str, kind: str = "auto") -> Tokenizer:
    """The tokenizer at `path` (`tokenizer_path`); `kind` is `tokenizer_type`."""
    if not path:
        raise ConfigError("reading text needs tokenizer_path (a SentencePiece .model, a tiktoken BPE file or a "
                          "folder with tokenizer.json), unless the text columns are already token ids")
    if "://" in path:  # Path() made gs://b/t.model the local gs:/b/t.model, which "does not exist"
        raise ConfigError(f"tokenizer_path={path!r} is a URL: the tokenizer is read from a local file or folder; "
                          "copy it to this machine (gcloud storage cp) and give that path")
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"tokenizer_path={path!r} does not exist; give the path of a tokenizer file or "
                          f"folder{_hub_name_hint(p)}")
    kind = _detect(p) if kind == "auto" else kind
    try:
        return {"sentencepiece": _sentencepiece, "tiktoken": _tiktoken, "huggingface": _huggingface}[kind](p)
    except ConfigError:
        raise
    except Exception as e:  # the libraries raise many kinds; all mean "not this format"
        beside = p.parent / "tokenizer.json" if p.is_file() else None
        if beside and beside.is_file() and p.suffix == ".json" and p.name != beside.name:  # tokenizer_config.json, ...
            raise ConfigError(f"tokenizer_path={path!r} is no tokenizer ({e}); give the tokenizer.json beside it, or "
                              f"their folder: tokenizer_path={str(p.parent)!r}") from None
        raise ConfigError(f"tokenizer_path={path!r} could not be read as tokenizer_type={kind}: {e}; "
                          "check the file or set tokenizer_type") from e


def _detect(p: Path) -> str:
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return "huggingface"
        if (p / "tokenizer.model").is_file():
            return _detect(p / "tokenizer.model")
        raise ConfigError(f"tokenizer_path={str(p)!r} is a folder without tokenizer.json or tokenizer.model")
    if p.suffix == ".json":
        return "huggingface"
    if p.suffix == ".tiktoken":
        return "tiktoken"
    with p.open("rb") as f:
        first = f.readline(4096)
    if _TIKTOKEN_LINE.match(first):
        return "tiktoken"
    if p.suffix == ".model":
        return "sentencepiece"
    if p.suffix == ".vocab" and p.with_suffix(".model").is_file():  # SentencePiece writes both; the .vocab lists pieces
        raise ConfigError(f"tokenizer_path={str(p)!r} is SentencePiece's list of pieces, which cannot tokenize; give "
                          f"the model beside it: tokenizer_path={str(p.with_suffix('.model'))!r}")
    raise ConfigError(f"tokenizer_path={str(p)!r}: cannot tell the tokenizer kind from the file; set "
                      "tokenizer_type=sentencepiece, tiktoken or huggingface")


def _sentencepiece(p: Path) -> Tokenizer:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(p / "tokenizer.model" if p.is_dir() else p))
    bos, eos = sp.bos_id(), sp.eos_id()
    return Tokenizer("sentencepiece", sp.get_piece_size(), bos if bos >= 0 else None, eos if eos >= 0 else None,
                     lambda texts: sp.encode(texts), sp.decode)


def _tiktoken(p: Path) -> Tokenizer:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(p))
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # tiktoken then panics (a Rust panic, past any `except Exception`) on text holding one of them
        raise ConfigError(f"tokenizer_path={str(p)!r} has no token for {len(missing)} of the 256 single bytes (e.g. "
                          f"{', '.join(f'0x{b:02x}' for b in missing[:4])}): a byte-level BPE file needs all of "
                          "them to encode any text; use the complete file")
    _check_unique_ranks(ranks, p)
    n = max(ranks.values()) + 1
    specials = {"<|begin_of_text|>": n, "<|end_of_text|>": n + 1}
    enc = tiktoken.Encoding(p.stem, pat_str=TIKTOKEN_SPLIT, mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer("tiktoken", n + 2, n, n + 1, lambda texts: enc.encode_ordinary_batch(texts, num_threads=1),
                     enc.decode)


def _check_unique_ranks(ranks: dict[bytes, int], p: Path) -> None:
    """ConfigError when two tokens of a tiktoken file share a rank, as the last one does in a file cut short
    inside its last number ('Y2F0 260' cut to 'Y2F0 2'): tiktoken then panics (a Rust panic, past any
    `except Exception`), printing its stack backtrace."""
    owners: dict[int, bytes] = {}
    for token, rank in ranks.items():
        if rank in owners:
            raise ConfigError(f"tokenizer_path={str(p)!r} gives rank {rank} to two tokens ({owners[rank]!r} and "
                              f"{token!r}): the file is cut short (its last line ends inside the number) or "
                              "damaged; use the complete file")
        owners[rank] = token


def _huggingface(p: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HfTokenizer

    file = p / "tokenizer.json" if p.is_dir() else p
    tok = HfTokenizer.from_file(str(file))
    vocab = tok.get_vocab(with_added_tokens=True)
    named = _named_specials(file.parent / "tokenizer_config.json")
    bos = _first_in(vocab, [named.get("bos_token"), *_BOS_NAMES])
    eos = _first_in(vocab, [named.get("eos_token"), *_EOS_NAMES])
    size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    return Tokenizer("huggingface", size, bos, eos,
                     lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)], tok.decode,
                     _SpecialsAsText(tok.to_str()))


def _named_specials(config_file: Path) -> dict[str, str | None]:
    """bos_token and eos_token as the folder's tokenizer_config.json names them (none without the file).
    ConfigError naming that file when it is no JSON object or names them by other than a string or
    {"content": ...}: the message blamed tokenizer_path, whose tokenizer.json is fine."""
    if not config_file.is_file():
        return {}
    where = f"tokenizer_path: file {str(config_file)!r} (read for the begin/end tokens beside tokenizer.json)"
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{where} cannot be read as JSON ({type(e).__name__}: {e}); fix or remove it") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where} holds a JSON {type(config).__name__}, not an object; fix or remove it")
    named = {}
    for which in ("bos_token", "eos_token"):
        token = config.get(which)
        named[which] = token.get("content") if isinstance(token, dict) else token
        if not (named[which] is None or isinstance(named[which], str)):
            raise ConfigError(f"{where} holds {which}={token!r}, neither a token's text nor {{\"content\": text}}; "
                              "fix or remove it")
    return named


class _SpecialsAsText:
    """A Hugging Face tokenizer's encode that takes special-token strings as text. Picklable for
    Grain's worker processes: a pickled `tokenizers.Tokenizer` forgets `encode_special_tokens`."""

    def __init__(self, json_text: str):
        self.json_text, self._tok = json_text, None

    def __getstate__(self) -> dict:
        return {"json_text": self.json_text}

    def __setstate__(self, state: dict) -> None:
        self.json_text, self._tok = state["json_text"], None

    def __call__(self, text: str) -> list[int]:
        if self._tok is None:
            from tokenizers import Tokenizer as HfTokenizer

            self._tok = HfTokenizer.from_str(self.json_text)
            self._tok.encode_special_tokens = True
        return self._tok.encode(text, add_special_tokens=False).ids


def _first_in(vocab: dict[str, int], names) -> int | None:
    for name in names:
        if name and name in vocab:
            return vocab[name]
    return None


def check_tokenizer(tok: Tokenizer, path: str, vocab_size: int, add_bos: bool, add_eos: bool) -> None:
    """The model must have room for every token id, and begin/end tokens must exist when asked for."""
    if vocab_size < tok.vocab_size:
        raise ConfigError(f"vocab_size={vocab_size} is smaller than the {tok.vocab_size} tokens of tokenizer_path="
                          f"{path!r}; set vocab_size={tok.vocab_size} or more (a multiple of 128 is fastest)")
    for flag, token_id, what in (("add_bos", tok.bos_id, "begin"), ("add_eos", tok.eos_id, "end")):
        if token_id is None and (add_bos if flag == "add_bos" else add_eos):
            raise ConfigError(f"{flag}=true but tokenizer_path={path!r} has no {what}-of-sequence token; "
                              f"set {flag}=false")
