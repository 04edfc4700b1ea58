"""Real text that exists on every machine that runs Tessera, and a tokenizer for it.

`.venv/bin/python -m tessera.data.first_run_corpus [--out outputs/first_run_data] [--vocab-size 512]`

The text is the docstrings of the Python standard library of the interpreter that runs this
script: English prose written by people (several MB), present wherever Python is, so the
first-run guide needs no download. Each docstring of at least `MIN_CHARS` characters is one
document. Modules are split by a hash of their path: about 1 in 20 goes to the eval file.
Writes `train.jsonl` and `eval.jsonl` (one `{"text": ...}` per line, for `hf_path=json`) and a
SentencePiece BPE model `tokenizer.model` trained on the training text.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import warnings
import zlib
from pathlib import Path

MIN_CHARS = 200
EVAL_EVERY = 20  # about one module in EVAL_EVERY goes to eval.jsonl


def docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of one Python file (empty if it does not parse)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old escape sequences in some modules
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    texts = (ast.get_docstring(n) for n in nodes)
    return [t for t in texts if t and len(t) >= MIN_CHARS]


def build_corpus(stdlib: Path, out: Path) -> dict[str, int]:
    """Write train.jsonl and eval.jsonl; returns document counts per split."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "eval": 0}
    with (out / "train.jsonl").open("w") as train, (out / "eval.jsonl").open("w") as evals:
        for path in sorted(stdlib.rglob("*.py")):
            relative = path.relative_to(stdlib).as_posix()
            if "site-packages" in relative or "/test" in relative or relative.startswith("test"):
                continue
            split = "eval" if zlib.crc32(relative.encode()) % EVAL_EVERY == 0 else "train"
            for text in docstrings(path.read_text(encoding="utf-8", errors="replace")):
                (evals if split == "eval" else train).write(json.dumps({"text": text}) + "\n")
                counts[split] += 1
    return counts


def train_tokenizer(train_file: Path, prefix: Path, vocab_size: int) -> Path:
    """A SentencePiece BPE model (ids: 0 unk, 1 bos, 2 eos) trained on the training documents."""
    import sentencepiece as spm

    lines = (json.loads(line)["text"] for line in train_file.open())
    spm.SentencePieceTrainer.train(sentence_iterator=lines, model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="bpe", character_coverage=1.0, byte_fallback=True,
                                   input_sentence_size=200_000, shuffle_input_sentence=True, minloglevel=2)
    return prefix.with_suffix(".model")


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): the corpus or tokenizer may be incomplete; run the command again "
              "(exit code 130)", file=sys.stderr)
        sys.exit(130)


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/first_run_data", help="output folder")
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer size (the default model's vocab_size)")
    args = parser.parse_args(argv)
    if args.vocab_size < 1:  # SentencePiece's own message for it is empty
        parser.error(f"--vocab-size {args.vocab_size}: give a positive number of tokens (512, the default, is the "
                     "default model's vocab_size)")
    out = Path(args.out)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    try:
        counts = build_corpus(stdlib, out)
    except OSError as e:  # --out is a file, not writable, the disk is full, ...
        parser.error(f"--out {args.out}: cannot write the corpus there ({e.strerror or e}); give a folder you can "
                     "write to")
    size = sum((out / f"{s}.jsonl").stat().st_size for s in counts) / 1e6
    print(f"{counts['train']} training and {counts['eval']} eval documents ({size:.1f} MB) from {stdlib}")
    try:
        model = train_tokenizer(out / "train.jsonl", out / "tokenizer", args.vocab_size)
    except RuntimeError as e:  # SentencePiece's checks, e.g. "Vocabulary size too high (100000). Please set it ..."
        parser.error(f"--vocab-size {args.vocab_size}: SentencePiece cannot build a tokenizer of that size from this "
                     f"text: {str(e).rsplit('] ', 1)[-1]}")
    except OSError as e:
        parser.error(f"--out {args.out}: cannot write the tokenizer there ({e.strerror or e})")
    print(f"tokenizer: {model} ({args.vocab_size} tokens)")


if __name__ == "__main__":
    main()
