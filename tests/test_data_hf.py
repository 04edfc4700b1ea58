"""dataset_type=hf: every file format, tokenizers, packing, padding, sharding, resume, bad input."""

import base64
import glob
import json
import os
import re
import subprocess
import sys

import datasets
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, TINY, tiny_config
from tessera.config import ConfigError
from tessera.data import DataError, make_input
from tessera.data.hf import load_stream
from tessera.data.tokenizers import load_tokenizer

WORDS = ("the cat dog sat ran on a mat log red big small fox jumped over lazy and then slept near old tree "
         "house river stone bird sang").split()


def make_docs(n=40, seed=0):
    """Documents of 1 to 30 words (some shorter than a row, some spanning rows), no newlines."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(1, 30))) for _ in range(n)]


def write_corpus(folder, docs, fmt, files=2):
    """docs split over `files` files of format fmt; returns the hf_path and glob to read them."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = np.array_split(np.arange(len(docs)), files)
    for i, idx in enumerate(parts):
        rows = [docs[j] for j in idx]
        path = folder / f"part{i}.{ {'text': 'txt'}.get(fmt, fmt)}"
        if fmt == "json":
            path.write_text("".join(json.dumps({"text": d, "n": len(d)}) + "\n" for d in rows))
        elif fmt == "text":
            path.write_text("".join(d + "\n" for d in rows))
        elif fmt == "parquet":
            pq.write_table(pa.table({"text": rows, "n": [len(d) for d in rows]}), path)
        elif fmt == "arrow":
            table = pa.table({"text": rows})
            with pa.ipc.new_stream(str(path), table.schema) as w:
                w.write_table(table)
        elif fmt == "csv":
            path.write_text("text\n" + "".join(f'"{d}"\n' for d in rows))
    return fmt, str(folder / f"part*.{ {'text': 'txt'}.get(fmt, fmt)}")


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    prefix = tmp_path_factory.mktemp("sp") / "tiny"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(make_docs(400, seed=9)), model_prefix=str(prefix),
                                   vocab_size=80, model_type="bpe", minloglevel=2)
    return str(prefix) + ".model"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), make_docs(), "json")


def hf_config(path_glob, tok, **overrides):
    fmt, files = path_glob
    return tiny_config(dataset_type="hf", hf_path=fmt, hf_train_files=files, tokenizer_path=tok, **overrides)


def take(data, n):
    return [next(data) for _ in range(n)]


def expected_stream(docs, tok_path):
    tok = load_tokenizer(tok_path)
    return [t for d in docs for t in [tok.bos_id, *tok.encode(d), tok.eos_id]]


# ---------------------------------------------------------------- formats and tokenizers


@pytest.mark.parametrize("fmt", ["parquet", "text", "arrow", "csv"])
def test_every_file_format_gives_the_json_batches(fmt, tmp_path, sp_model, corpus):
    want = take(make_input(hf_config(corpus, sp_model).data, 96, 4), 3)
    got = take(make_input(hf_config(write_corpus(tmp_path, make_docs(), fmt), sp_model).data, 96, 4), 3)
    for w, g in zip(want, got):
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])


def test_the_libraries_warnings_are_printed_once_in_the_run_s_format(sp_model, corpus):
    """`datasets` and `huggingface_hub` print with a stderr handler of their own and pass records on to
    the root logger: a Hub retry was printed twice, bare and then timestamped by train.py's handler.
    In a process of its own: pytest's capture holds the libraries' handlers' stream."""
    fmt, files = corpus
    script = (f"import logging, sys; sys.path.insert(0, {str(REPO / 'src')!r})\n"
              "logging.basicConfig(format='RUN %(message)s')\n"
              "from tessera.config import DataConfig\n"
              "from tessera.data.hf import load_stream\n"
              f"load_stream(DataConfig(dataset_type='hf', hf_path={fmt!r}, hf_train_files={files!r}, "
              f"tokenizer_path={sp_model!r}), 'train')\n"
              "for name in ('huggingface_hub.utils._http', 'datasets.load'):\n"
              "    logging.getLogger(name).warning('Retrying in 1s [Retry 1/5].')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-2:] == ["RUN Retrying in 1s [Retry 1/5]."] * 2, proc.stderr[-3000:]


def test_saved_dataset_folder_and_non_streaming(tmp_path, sp_model, corpus):
    want = take(make_input(hf_config(corpus, sp_model).data, 96, 4), 2)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": make_docs()})}).save_to_disk(tmp_path / "ds")
    folder = tiny_config(dataset_type="hf", hf_path=str(tmp_path / "ds"), tokenizer_path=sp_model).data
    not_streamed = hf_config(corpus, sp_model, hf_streaming=False).data
    for cfg in (folder, not_streamed):
        got = take(make_input(cfg, 96, 4), 2)
        np.testing.assert_array_equal(np.stack([g["tokens"] for g in got]), np.stack([w["tokens"] for w in want]))


def _tiktoken_file(path):
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"at", b" cat"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return str(path)


def _hf_tokenizer_dir(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(make_docs(200), trainers.BpeTrainer(vocab_size=70, special_tokens=["<s>", "</s>"]))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_each_tokenizer_kind(tmp_path, sp_model):
    kinds = {"sentencepiece": sp_model, "tiktoken": _tiktoken_file(tmp_path / "bpe.tiktoken"),
             "huggingface": _hf_tokenizer_dir(tmp_path / "hf")}
    for kind, path in kinds.items():
        tok = load_tokenizer(path)
        assert tok.kind == kind
        ids = tok.encode("the cat sat on the mat")
        assert ids and max(ids) < tok.vocab_size and None not in (tok.bos_id, tok.eos_id)
    tik = load_tokenizer(kinds["tiktoken"])
    assert tik.encode(" the cat") == [258, 260] and (tik.bos_id, tik.eos_id, tik.vocab_size) == (261, 262, 263)
    # a tiktoken file without the telling suffix is recognised from its first line
    (tmp_path / "plain").write_text((tmp_path / "bpe.tiktoken").read_text())
    assert load_tokenizer(str(tmp_path / "plain")).kind == "tiktoken"
    # one without some single bytes made tiktoken panic (a Rust panic, a traceback) on text holding them
    lines = (tmp_path / "bpe.tiktoken").read_text().splitlines(keepends=True)
    (tmp_path / "holes.tiktoken").write_text("".join(lines[:0xe6] + lines[0xe8:]))
    with pytest.raises(ConfigError, match=r"has no token for 2 of the 256 single bytes \(e.g. 0xe6, 0xe7\): a "
                                          "byte-level BPE file needs all of them"):
        load_tokenizer(str(tmp_path / "holes.tiktoken"))


def test_a_tiktoken_file_cut_inside_its_last_number_is_refused_not_a_panic(tmp_path):
    # 'IGNhdA== 260' cut to 'IGNhdA== 2': two tokens of rank 2, on which tiktoken panicked (a Rust panic, past any
    # `except Exception`, with its stack backtrace) instead of a config error
    whole = open(_tiktoken_file(tmp_path / "bpe.tiktoken")).read()
    (tmp_path / "cut.tiktoken").write_text(whole.rstrip("\n")[:-2])
    with pytest.raises(ConfigError, match=r"gives rank 2 to two tokens \(b'\\x02' and b' cat'\): the file is cut "
                                          "short"):
        load_tokenizer(str(tmp_path / "cut.tiktoken"))


def test_a_sentencepiece_vocab_file_points_to_the_model_beside_it(sp_model):
    # first_run_corpus and SentencePiece write tokenizer.vocab beside tokenizer.model: given the .vocab, the message
    # said 'cannot tell the tokenizer kind from the file; set tokenizer_type=...', and with
    # tokenizer_type=sentencepiece, 'could not parse ModelProto'
    vocab = sp_model.removesuffix(".model") + ".vocab"
    with pytest.raises(ConfigError, match=rf"tokenizer_path='{re.escape(vocab)}' is SentencePiece's list of pieces, "
                                          rf"which cannot tokenize; give the model beside it: "
                                          rf"tokenizer_path='{re.escape(sp_model)}'"):
        load_tokenizer(vocab)


def test_a_json_file_beside_tokenizer_json_points_to_the_folder(tmp_path):
    # tokenizer_path=<folder>/tokenizer_config.json said 'could not be read as tokenizer_type=huggingface: expected
    # `,` or `}` ...; check the file or set tokenizer_type'
    folder = _hf_tokenizer_dir(tmp_path / "hf")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "hf" / name).write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
        with pytest.raises(ConfigError, match=rf"tokenizer_path='.*{name}' is no tokenizer \(.*\); give the "
                                              rf"tokenizer.json beside it, or their folder: tokenizer_path='{folder}'"):
            load_tokenizer(os.path.join(folder, name))


def test_a_damaged_tokenizer_config_json_is_named_not_the_tokenizer(tmp_path):
    # the message blamed tokenizer_path ('could not be read as tokenizer_type=huggingface: Expecting property name
    # ...; check the file'), whose tokenizer.json is fine; a list for eos_token said "unhashable type: 'list'"
    folder = _hf_tokenizer_dir(tmp_path / "hf")
    config = tmp_path / "hf" / "tokenizer_config.json"
    for text, held in [("{bad", r"cannot be read as JSON \(JSONDecodeError: "), ("[]", "holds a JSON list, not an object"),
                       ('{"eos_token": ["</s>"]}', r"holds eos_token=\['</s>'\], neither a token's text")]:
        config.write_text(text)
        with pytest.raises(ConfigError, match=rf"tokenizer_path: file '.*tokenizer_config.json' \(read for the "
                                              rf"begin/end tokens beside tokenizer.json\) {held}"):
            load_tokenizer(folder)
    config.write_text('{"bos_token": {"content": "</s>"}, "eos_token": "<s>"}')  # as it names them
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id) == (tok.encode("</s>")[0], tok.encode("<s>")[0]) == (1, 0)


def test_text_spelling_a_special_token_is_text_in_every_pipeline(tmp_path):
    """With a Hugging Face tokenizer, a document holding the text `</s>` (web pages and code do) got
    the end token in its middle, and `<s>` a begin token: a document boundary the data does not have.
    SentencePiece and tiktoken take such text as text; so does the pipeline now, in Grain's worker
    processes too (a pickled `tokenizers.Tokenizer` forgets the setting)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    tok_dir = _hf_tokenizer_dir(tmp_path / "hf")
    tok = load_tokenizer(tok_dir)
    text = "the cat </s> sat <s> on the mat"
    assert tok.eos_id in tok.encode(text)  # what Hugging Face's encode does (decode.py's prompts keep it)
    assert {tok.bos_id, tok.eos_id}.isdisjoint(tok.encode_document(text))
    fmt, path = write_corpus(tmp_path / "json", [text] * 6, "json", files=1)
    writer = ArrayRecordWriter(str(tmp_path / "docs.array_record"), "group_size:1")
    for _ in range(6):
        writer.write(text.encode())
    writer.close()
    configs = [hf_config((fmt, path), tok_dir, packing=False, max_target_length=40)] + [
        tiny_config(dataset_type="grain", grain_train_files=str(tmp_path / "docs.array_record"), tokenizer_path=tok_dir,
                    packing=False, max_target_length=40, grain_worker_count=workers) for workers in (0, 1)]
    for cfg in configs:
        batch = next(make_input(cfg.data, 96, 4))
        for row, segments in zip(batch["tokens"], batch["segment_ids"]):
            ids = list(row[segments > 0])
            assert ids == [tok.bos_id, *tok.encode_document(text), tok.eos_id], (cfg.data.dataset_type, ids)


def test_vocab_smaller_than_tokenizer_is_an_error(tmp_path, sp_model, corpus):
    message = r"vocab_size=64 is smaller than the 80 tokens of tokenizer_path=.*tiny.model"
    with pytest.raises(ConfigError, match=message):
        make_input(hf_config(corpus, sp_model).data, 64, 4)


# ---------------------------------------------------------------- packing, padding, sharding


def test_packed_rows_hold_every_token_once_with_restarting_positions(sp_model, corpus):
    batches = take(make_input(hf_config(corpus, sp_model).data, 96, 4), 4)
    rows = [(b["tokens"][i], b["segment_ids"][i], b["positions"][i]) for b in batches for i in range(4)]
    stream = []
    for tokens, segments, positions in rows:
        assert segments.min() >= 1, "packed rows are full: no padding"
        for s in np.unique(segments):
            where = segments == s
            np.testing.assert_array_equal(positions[where], np.arange(where.sum()))
        assert np.all(np.diff(segments) >= 0)
        stream += tokens.tolist()
    want = expected_stream(make_docs(), sp_model)
    assert stream == want[:len(stream)]
    assert max(int(s.max()) for _, s, _ in rows) > 1, "short documents share rows"


def test_without_packing_one_document_piece_per_row_and_padding(sp_model, corpus):
    batch = next(make_input(hf_config(corpus, sp_model, packing=False).data, 96, 8))
    assert set(np.unique(batch["segment_ids"])) <= {0, 1}
    pad = batch["segment_ids"] == 0
    assert pad.any() and np.all(batch["tokens"][pad] == 0)
    # padding only follows the document piece: never before it
    assert np.all(np.diff(batch["segment_ids"], axis=1) <= 0)
    first = load_tokenizer(sp_model).encode(make_docs()[0])
    row0 = batch["tokens"][0][batch["segment_ids"][0] == 1].tolist()
    assert row0 == ([1, *first, 2])[:len(row0)]


@pytest.mark.parametrize("files", [2, 3])
def test_processes_read_disjoint_shares_that_cover_everything(files, tmp_path, monkeypatch):
    docs = [f"doc {i}" for i in range(12)]
    fmt, glob = write_corpus(tmp_path, docs, "json", files=files)
    cfg = tiny_config(dataset_type="hf", hf_path=fmt, hf_train_files=glob).data
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    shares = []
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda r=rank: r)
        shares.append([r["text"] for r in load_stream(cfg, "train")])
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == sorted(docs)
    assert abs(len(shares[0]) - len(shares[1])) <= 1


def test_each_process_builds_only_its_rows(monkeypatch, sp_model, corpus):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    data = make_input(hf_config(corpus, sp_model).data, 96, 8)
    assert next(data)["tokens"].shape == (4, 13) and data.process_local


class _Sharding:
    """A batch sharding's rows per device over `processes` processes of 2 devices each: `rows[d]` is
    device d's (start, stop), None for every row (the batch not split on that device's axis)."""

    def __init__(self, rows):
        self.rows = rows

    def devices_indices_map(self, shape):
        class Device:
            def __init__(self, process):
                self.process_index = process

        return {Device(d // 2): (slice(*r) if r else slice(None), slice(None)) for d, r in enumerate(self.rows)}


def test_processes_holding_the_same_rows_of_the_batch_read_the_same_share(monkeypatch, caplog, sp_model, corpus):
    """With the batch split fewer ways across the processes than there are processes (sequence, tensor
    or pipeline ways across them) each process's devices hold more rows than global_batch / processes:
    each read half of the batch, and the first step failed in make_array_from_process_local_data with a
    traceback ("the process data has 4 elements. Process addresses 8 elements", exit 1). Processes holding
    the same rows now read the same share, all of its rows."""
    from tessera.data import process_shares, restore_state, state_to_save

    single = take(make_input(hf_config(corpus, sp_model).data, 96, 8), 2)  # one process: every row
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    split = _Sharding([(0, 2), (2, 4), (4, 6), (6, 8)])  # process 0 holds rows 0-3, process 1 rows 4-7
    whole = _Sharding([None] * 4)  # every device holds every row (sequence ways across the processes)
    assert process_shares(split, 8) == process_shares(None, 8) == [(0, 2), (1, 2)]
    assert process_shares(whole, 8) == [(0, 1), (0, 1)]
    monkeypatch.setattr(jax, "process_count", lambda: 4)  # stage 0 on processes 0-1, stage 1 on 2-3
    assert process_shares(_Sharding([(0, 2), (2, 4), (4, 6), (6, 8)] * 2), 8) == [(0, 2), (1, 2), (0, 2), (1, 2)]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda r=rank: r)
        data = make_input(hf_config(corpus, sp_model).data, 96, 8, sharding=whole)
        assert data.rows == 8 and data.shares == [(0, 1), (0, 1)]
        for got, want in zip(take(data, 2), single):  # both read everything, as one process does
            np.testing.assert_array_equal(got["tokens"], want["tokens"])
    monkeypatch.setattr("tessera.job_sync.gather_json", lambda name, value, timeout: [value, value])
    saved = state_to_save(data, 2, 10)
    assert saved["shares"] == [[0, 1], [0, 1]] and len(saved["processes"]) == 2
    # resumed with a mesh that splits the batch over the processes: process 1's position is in another share
    other_mesh = make_input(hf_config(corpus, sp_model).data, 96, 8, sharding=split)
    start = other_mesh.get_state()
    with caplog.at_level("WARNING", logger="tessera"):
        restore_state(other_mesh, saved)
    assert other_mesh.get_state() == start and "with this mesh they read one each" in caplog.text
    resumed = make_input(hf_config(corpus, sp_model).data, 96, 8, sharding=whole)
    restore_state(resumed, saved)
    assert resumed.get_state() == data.get_state()


# ---------------------------------------------------------------- resume


def test_resume_from_any_batch_continues_exactly(sp_model, tmp_path):
    # few, long documents: rows end mid-document and the stream wraps into a second epoch
    corpus = write_corpus(tmp_path, make_docs(6, seed=3), "parquet", files=2)
    for packing in (True, False):
        cfg = hf_config(corpus, sp_model, packing=packing).data
        data = make_input(cfg, 96, 4)
        states, batches = [], []
        for _ in range(12):
            states.append(json.loads(json.dumps(data.get_state())))
            batches.append(next(data))
        assert data.epoch >= 1, "the test must cross an epoch boundary"
        for k in (0, 1, 4, 7, 10):
            resumed = make_input(cfg, 96, 4)
            resumed.set_state(states[k])
            for want in batches[k:k + 2]:
                np.testing.assert_array_equal(next(resumed)["tokens"], want["tokens"])


@pytest.mark.parametrize("streaming", [True, False])
def test_every_pass_reads_the_files_in_order(tmp_path, streaming):
    # datasets 5.x reordered the files from the third pass on (its epoch 2), unshuffled data too, where Data.md
    # promises the files in order and the log 'starting again from the first file'; a resume keeps the order
    for i in range(4):  # a document of 13 tokens (a whole row) per file, each of its own tokens
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps({"text": list(range(13 * i + 1, 13 * i + 14))}) + "\n")
    cfg = tiny_config(dataset_type="hf", hf_path="json", hf_train_files=str(tmp_path / "part*.jsonl"),
                      hf_streaming=streaming).data
    data = make_input(cfg, 96, 8)
    firsts = [int(t) for _ in range(4) for t in next(data)["tokens"][:, 0]]
    assert firsts == [1, 14, 27, 40] * 8
    state = json.loads(json.dumps(data.get_state()))
    resumed = make_input(cfg, 96, 8)
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed)["tokens"], next(data)["tokens"])


# ---------------------------------------------------------------- bad input


def test_bad_inputs_name_the_key_and_the_path(tmp_path, sp_model, corpus):
    fmt, files = corpus
    (tmp_path / "broken.parquet").write_bytes(b"this is not parquet")
    (tmp_path / "latin1.json").write_bytes(b'{"text": "caf\xe9"}\n')
    cases = [
        (dict(hf_train_files=str(tmp_path / "none*.json")), r"hf_train_files=.*none\*\.json.* matches no files"),
        (dict(hf_train_files=""), r"hf_path=json reads files: set hf_train_files"),
        (dict(hf_path="parquet", hf_train_files=str(tmp_path / "broken.parquet")),
         r"hf_train_files: file .*broken\.parquet.* cannot be read as parquet"),
        (dict(hf_train_files=str(tmp_path / "latin1.json")), r"hf_train_files: file .*latin1\.json.* cannot be read"),
        (dict(train_data_columns="body"), r"train_data_columns=\['body'\]: column\(s\) \['body'\] not in hf_path"),
        (dict(tokenizer_path=str(tmp_path / "nope.model")), r"tokenizer_path=.*nope\.model.* does not exist"),
        (dict(tokenizer_path=""), r"reading text needs tokenizer_path"),
        (dict(hf_path=str(tmp_path / "missing_dir")), r"hf_path=.*missing_dir.* could not be loaded"),
    ]
    for overrides, message in cases:
        values = dict(hf_path=fmt, hf_train_files=files, tokenizer_path=sp_model) | overrides
        with pytest.raises(ConfigError, match=message):
            make_input(tiny_config(dataset_type="hf", **values).data, 96, 4)


def _cached_as_if_from_the_hub(cache, name: str, records: list[dict], tmp_path) -> None:
    """`records` in `datasets`' cache folder `cache` as a Hub dataset `name` ("org/name") leaves them
    there once loaded: what a host that loaded it once has (nothing can be downloaded here)."""
    source = tmp_path / "records.json"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    datasets.load_dataset("json", data_files=str(source), cache_dir=str(tmp_path / "built"), split="train")
    (built,) = [p for p in glob.glob(str(tmp_path / "built" / "json" / "*" / "*" / "*")) if os.path.isdir(p)]
    org, short = name.split("/")
    target = cache / f"{org}___{short}" / "default" / "0.0.0" / os.path.basename(built)
    target.parent.mkdir(parents=True)
    os.rename(built, target)
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(target / arrow.name.replace("json-", f"{short}-"))


def test_a_hub_dataset_with_no_network_loads_from_the_cache_or_is_one_line_at_once(tmp_path, sp_model, monkeypatch):
    """A Hub name with no network: the Hub client retried the host name five times (about 25 s, a warning
    line each) before `datasets` fell back to its cache or gave up. Now the name is resolved first; when it
    does not resolve, the load runs offline: a cached dataset loads with no request, an uncached one is one
    error naming the cache and what to do. The offline switch is put back after."""
    import socket

    import huggingface_hub.constants

    asked = []

    def no_dns(host, *args, **kwargs):
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    cache = tmp_path / "cache"
    _cached_as_if_from_the_hub(cache, "someone/tiny_corpus", [{"text": "a b c"}, {"text": "d e f"}], tmp_path)
    for variable in ("HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)

    cfg = tiny_config(dataset_type="hf", hf_path="someone/tiny_corpus", tokenizer_path=sp_model)
    assert [r["text"] for r in load_stream(cfg.data, "train")] == ["a b c", "d e f"]
    assert asked == ["huggingface.co"]  # asked once, by Tessera: the clients sent nothing
    cfg = tiny_config(dataset_type="hf", hf_path="someone/not_cached", tokenizer_path=sp_model)
    with pytest.raises(ConfigError, match=re.escape(
            f"hf_path='someone/not_cached' is not in this host's Hugging Face cache ({cache}) and the Hub cannot be "
            "reached (the host name huggingface.co does not resolve: Name or service not known); check the network, "
            "or load it once on a host that reaches the Hub and copy it here (save_to_disk, then hf_path=<that "
            "folder>)")):
        load_stream(cfg.data, "train")
    assert asked == ["huggingface.co"] * 2
    assert datasets.config.HF_HUB_OFFLINE is False and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_the_tokenizer_is_checked_before_the_dataset_is_read(tmp_path, sp_model, monkeypatch):
    """A missing tokenizer_path was named only after the dataset's first record: with a Hub name and
    no network, that name failed first, after 40 s of retries, and the tokenizer only in the next run."""
    import tessera.data.hf

    def read(*args):
        raise AssertionError("the dataset was read before the tokenizer was checked")

    monkeypatch.setattr(tessera.data.hf, "load_stream", read)
    for tok, message in ((str(tmp_path / "nope.model"), r"tokenizer_path=.*nope\.model.* does not exist"),
                         (sp_model, r"vocab_size=64 is smaller than the 80 tokens of tokenizer_path")):
        cfg = tiny_config(dataset_type="hf", hf_path="someone/some_dataset", tokenizer_path=tok, vocab_size=64)
        with pytest.raises(ConfigError, match=message):
            make_input(cfg.data, 64, 4)


def test_an_hf_path_that_is_no_format_for_local_files_names_the_format(tmp_path, sp_model):
    """hf_path=jsonl for .jsonl files (First_run.md's corpus) was looked for on the Hugging Face Hub, and the
    error said only that; a missing folder stands in for it here (no network)."""
    (tmp_path / "train.jsonl").write_text('{"text": "a b c"}\n')
    cfg = tiny_config(dataset_type="hf", hf_path=str(tmp_path / "jsonl"), hf_train_files=str(tmp_path / "train.jsonl"),
                      tokenizer_path=sp_model)
    with pytest.raises(ConfigError, match=r"could not be loaded: .*\. For local files hf_path names their format "
                                          r"\(parquet, json, arrow, text, csv\): for \.jsonl files, hf_path=json$"):
        make_input(cfg.data, 96, 4)


def test_a_glob_matching_only_folders_is_refused_naming_the_folder(tmp_path, sp_model, corpus):
    """A glob that matched folders only expanded to no file at all: hf failed inside `datasets`
    ("Empty 'data_files'"), grain inside ArrayRecord ("Paths sequence can not be of 0 length")."""
    fmt, files = corpus
    folder = str(tmp_path / "shards")
    (tmp_path / "shards").mkdir()
    message = f"hf_train_files={folder!r} matches folder {folder!r} and no file; name the files in it, e.g. " \
              f"hf_train_files={folder + '/*'!r}"
    with pytest.raises(ConfigError) as e:
        make_input(hf_config((fmt, folder), sp_model).data, 96, 4)
    assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"grain_train_files=.* matches 2 folders and no file"):
        (tmp_path / "shards2").mkdir()
        cfg = tiny_config(dataset_type="grain", grain_train_files=str(tmp_path / "shards*"), tokenizer_path=sp_model)
        make_input(cfg.data, 96, 4)
    # a folder that a glob matches beside files is left out, as before
    (tmp_path / "shards" / "a.json").write_text('{"text": "the cat sat"}\n')
    (tmp_path / "shards" / "sub").mkdir()
    data = make_input(hf_config((fmt, folder + "/*"), sp_model).data, 96, 4)
    assert next(data)["segment_ids"].any()


def test_a_pipe_or_device_is_refused_as_no_regular_file_not_called_a_folder(tmp_path, sp_model, corpus):
    # /dev/null, or a pipe (hf_train_files=<(zcat docs.jsonl.gz) gives /dev/fd/63), was 'folder ...' with 'name the
    # files in it'
    os.mkfifo(tmp_path / "docs.jsonl")
    for path in (str(tmp_path / "docs.jsonl"), "/dev/null"):
        with pytest.raises(ConfigError, match=rf"hf_train_files='{path}' matches '{path}', which is no regular file "
                                              r"\(a device, a pipe or a socket"):
            make_input(hf_config((corpus[0], path), sp_model).data, 96, 4)


def test_a_file_two_globs_match_is_refused_not_read_twice(tmp_path, sp_model, corpus):
    """hf_train_files='a.json,*.json' read a.json twice in every pass (grain too), without a word."""
    fmt, files = corpus
    first = sorted(glob.glob(files))[0]
    with pytest.raises(ConfigError) as e:
        make_input(hf_config((fmt, f"{first},{files}"), sp_model).data, 96, 4)
    assert str(e.value) == (f"hf_train_files: file {first!r} is matched by both {first!r} and {files!r}, so it "
                            "would be read twice; give each file once")
    cfg = tiny_config(dataset_type="grain", grain_train_files=f"{first}, {first}", tokenizer_path=sp_model)
    with pytest.raises(ConfigError, match=r"grain_train_files: file .* is matched by '.*' twice"):
        make_input(cfg.data, 96, 4)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_gzipped_files_read_like_plain_ones_and_their_damage_is_named(fmt, tmp_path, sp_model):
    """C4 ships JSON lines as .json.gz, which `datasets` reads: the check of a file's first bytes
    refused it ("cannot be read as json (UnicodeDecodeError ...)"), and the search for a damaged line
    read the compressed bytes."""
    import gzip

    docs = make_docs(12)
    plain_fmt, plain = write_corpus(tmp_path / "plain", docs, fmt, files=1)
    (tmp_path / "gz").mkdir()
    zipped = str(tmp_path / "gz" / "part0.gz")
    with open(next((tmp_path / "plain").glob("part0.*")), "rb") as f:
        (tmp_path / "gz" / "part0.gz").write_bytes(gzip.compress(f.read()))
    want = take(make_input(hf_config((plain_fmt, plain), sp_model).data, 96, 4), 3)
    got = take(make_input(hf_config((fmt, zipped), sp_model).data, 96, 4), 3)
    np.testing.assert_array_equal(np.stack([b["tokens"] for b in got]), np.stack([b["tokens"] for b in want]))
    # a bad line far into the file (past the first bytes checked at start-up) is named by its number
    lines = [json.dumps({"text": d}) if fmt == "json" else d for d in docs * 2000]
    lines[20000] = '{"text": broken' if fmt == "json" else "caf\xe9"
    raw = "\n".join(lines).encode("latin-1") + b"\n"
    damaged = str(tmp_path / "gz" / "damaged.gz")
    (tmp_path / "gz" / "damaged.gz").write_bytes(gzip.compress(raw))
    what = "is not valid JSON (Expecting value at column 10)" if fmt == "json" else \
        "is not UTF-8 text (byte 3 of the line: invalid continuation byte)"
    with pytest.raises(DataError) as e:
        take(make_input(hf_config((fmt, damaged), sp_model, max_target_length=255).data, 96, 64), 200)
    assert str(e.value) == (f"hf_train_files: file {damaged!r} is damaged: line 20001 {what}. Re-create the file, "
                            "or leave it out of hf_train_files")
    # a file cut off mid-stream
    cut = tmp_path / "gz" / "cut.gz"
    cut.write_bytes(gzip.compress(raw)[:4000])
    with pytest.raises(DataError, match=r"file '.*cut\.gz' is damaged: it cannot be read \(EOFError: Compressed file "
                                        r"ended before the end-of-stream marker was reached\)"):
        take(make_input(hf_config((fmt, str(cut)), sp_model, max_target_length=255).data, 96, 64), 200)
    cut.write_bytes(gzip.compress(raw)[:400])  # cut inside the first bytes, checked at start-up
    with pytest.raises(ConfigError, match=r"file '.*cut\.gz' cannot be read as .*EOFError: Compressed file ended"):
        make_input(hf_config((fmt, str(cut)), sp_model).data, 96, 4)


def test_first_run_corpus_splits_docstrings_and_builds_a_tokenizer(tmp_path):
    from tessera.data.first_run_corpus import build_corpus, docstrings, train_tokenizer

    long_doc = ("Explains things. " * 20).strip()
    assert docstrings(f'"""{long_doc}"""\ndef f():\n    """short"""\n') == [long_doc]
    assert docstrings("def broken(:\n") == []
    lib = tmp_path / "lib"
    for i in range(60):
        (lib / "pkg").mkdir(parents=True, exist_ok=True)
        (lib / "pkg" / f"m{i}.py").write_text(f'"""Module {i}. {long_doc}"""\nclass C:\n    """{long_doc} {i}"""\n')
    (lib / "site-packages").mkdir()
    (lib / "site-packages" / "x.py").write_text(f'"""{long_doc}"""')
    counts = build_corpus(lib, tmp_path / "out")
    assert counts["train"] + counts["eval"] == 120 and 0 < counts["eval"] < 30
    lines = (tmp_path / "out" / "eval.jsonl").read_text().splitlines()
    assert all(json.loads(line)["text"].strip() for line in lines)
    model = train_tokenizer(tmp_path / "out" / "train.jsonl", tmp_path / "out" / "tok", 300)
    assert load_tokenizer(str(model)).vocab_size == 300


def test_first_run_corpus_bad_options_are_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """--vocab-size too large or too small for the text, or --out a file, ended in a traceback."""
    from tessera.data import first_run_corpus

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "m.py").write_text('"""' + "Explains things at some length. " * 20 + '"""\n')
    monkeypatch.setattr(first_run_corpus.sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    (tmp_path / "a_file").write_text("")
    cases = [(["--vocab-size", "100000"], r"--vocab-size 100000: SentencePiece cannot build a tokenizer of that size "
                                          r"from this text: Vocabulary size too high \(100000\)\. Please set it to a "
                                          r"value <= \d+\.$"),
             (["--vocab-size", "0"], r"--vocab-size 0: give a positive number of tokens"),
             (["--out", str(tmp_path / "a_file")], r"--out .*a_file: cannot write the corpus there \(File exists\)")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            first_run_corpus.main(["--out", str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, err
        assert re.search("error: " + message, err.strip().splitlines()[-1]), err

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(first_run_corpus, "train_tokenizer", interrupted)  # Ctrl-C was a traceback
    with pytest.raises(SystemExit) as e:
        first_run_corpus.main(["--out", str(tmp_path / "out")])
    assert e.value.code == 130 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted (Ctrl-C): the corpus or tokenizer may be incomplete; run the command again (exit code 130)")


# ---------------------------------------------------------------- damaged or empty data: one message, exit code 2


def damage_row_group(path, group):
    """Overwrite the pages of row group `group` of a Parquet file, leaving its footer intact."""
    column = pq.read_metadata(path).row_group(group).column(0)
    start = min(o for o in (column.dictionary_page_offset, column.data_page_offset) if o is not None)
    data = bytearray(path.read_bytes())
    for i in range(start + 8, start + column.total_compressed_size - 8, 3):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(Exception):  # the damage must be real for the tests below to mean anything
        pq.ParquetFile(path).read_row_group(group)


def train_on(tmp_path, fmt, files, tok, steps=40):
    """train.py as a user runs it, on hf files; a good first file lasts about 8 steps."""
    args = [f"{k}={v}" for k, v in TINY.items() if k != "steps"]
    cmd = [sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml"), "run_name=bad",
           f"base_output_directory={tmp_path / 'out'}", "enable_checkpointing=false", "dataset_type=hf",
           f"hf_path={fmt}", f"hf_train_files={files}", f"tokenizer_path={tok}", f"steps={steps}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def assert_one_message(proc, message):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert message in proc.stderr.splitlines()[-1], proc.stderr[-3000:]


@pytest.mark.slow
def test_damaged_parquet_found_mid_run_names_the_file_and_row_group(tmp_path, sp_model):
    write_corpus(tmp_path, make_docs(80), "parquet")  # part0 (40 documents, good) is read first
    pq.write_table(pa.table({"text": make_docs(40, seed=1)}), tmp_path / "part1.parquet", row_group_size=10)
    damage_row_group(tmp_path / "part1.parquet", 1)
    proc = train_on(tmp_path, "parquet", tmp_path / "part*.parquet", sp_model)
    assert_one_message(proc, f"hf_train_files: file '{tmp_path / 'part1.parquet'}' is damaged: row group 1 (of 4, "
                             "counting from 0) cannot be read")
    assert "Re-create the file, or leave it out of hf_train_files" in proc.stderr
    assert "step     1 |" in proc.stderr  # found while training, not when opening


def test_malformed_json_line_names_the_file_and_line(tmp_path, sp_model):
    docs = make_docs(80)
    write_corpus(tmp_path, docs, "json")
    lines = (tmp_path / "part1.json").read_text().splitlines()
    lines[2] = lines[2][:-5]  # a record cut short
    (tmp_path / "part1.json").write_text("\n".join(lines) + "\n")
    proc = train_on(tmp_path, "json", tmp_path / "part*.json", sp_model)
    assert_one_message(proc, f"hf_train_files: file '{tmp_path / 'part1.json'}' is damaged: line 3 is not valid JSON")
    assert "Failed to load JSON" not in proc.stderr  # the datasets library's own log line is not repeated


def test_empty_text_corpus_says_the_files_hold_no_records(tmp_path, sp_model):
    (tmp_path / "empty.txt").write_text("")
    proc = train_on(tmp_path, "text", tmp_path / "empty.txt", sp_model, steps=1)
    assert_one_message(proc, f"hf_train_files='{tmp_path / 'empty.txt'}': file '{tmp_path / 'empty.txt'}' holds no "
                             "records (hf_path=text: one document per line); add documents or point hf_train_files "
                             "at files that have some")
    assert "train_data_columns" not in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("fmt,name,content,streaming", [
    ("json", "empty.jsonl", b"", True), ("json", "blank.jsonl", b"\n\n", False), ("csv", "header.csv", b"text\n", True),
    ("parquet", "none.parquet", None, True), ("parquet", "none.parquet", None, False),
])
def test_empty_files_of_every_format_hold_no_records(tmp_path, sp_model, fmt, name, content, streaming):
    """The readers fail on empty files in their own words (StopIteration, 'BatchSize must be greater
    than 0'); the message says what is wrong with the files instead."""
    path = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path.write_bytes(content)
    with pytest.raises(DataError) as e:
        make_input(hf_config((fmt, str(path)), sp_model, hf_streaming=streaming).data, 96, 4)
    assert str(e.value) == (f"hf_train_files={str(path)!r}: file {str(path)!r} holds no records; add documents or "
                            "point hf_train_files at files that have some")


def test_damage_is_named_when_not_streaming_and_for_every_format(tmp_path, sp_model):
    fmt, files = write_corpus(tmp_path / "p", make_docs(), "parquet")
    damage_row_group(tmp_path / "p" / "part1.parquet", 0)
    with pytest.raises(DataError, match=r"file .*part1\.parquet' is damaged: row group 0 \(of 1"):
        make_input(hf_config((fmt, files), sp_model, hf_streaming=False).data, 96, 4)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes(b"the cat sat\n" * 7000 + b"caf\xe9\n")  # past the 64 KiB read at open
    with pytest.raises(DataError, match=r"a\.txt' is damaged: line 7001 is not UTF-8 text"):
        data = make_input(hf_config(("text", str(tmp_path / "t" / "a.txt")), sp_model).data, 96, 4)
        take(data, 5)


def test_documents_without_text_are_reported_once(tmp_path, sp_model, corpus, caplog):
    """A text column whose documents are (nearly all) empty trains on begin/end tokens alone: after
    the first 100 documents one warning names the files and the columns; real text gets none."""
    import logging

    def warnings_after(path_glob, batches):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tessera"):
            take(make_input(hf_config(path_glob, sp_model).data, 96, 4), batches)
        return [r.getMessage() for r in caplog.records if "hold no text" in r.getMessage()]

    empty = write_corpus(tmp_path / "empty", [""] * 30, "json")  # 2 tokens each: ~7 documents a row
    lines = warnings_after(empty, 8)  # 8 batches x 4 rows: more than 100 documents, read over several epochs
    assert lines == [f"hf_train_files={empty[1]!r}, train_data_columns=['text']: 100 of the first 100 documents "
                     "hold no text (at most a begin and an end token); the model learns nothing from them: check "
                     "train_data_columns and the files"]
    assert warnings_after(corpus, 40) == []


def test_short_documents_of_token_ids_or_unframed_text_are_not_said_to_hold_no_text(tmp_path, sp_model, caplog):
    """Documents of 2 tokens were taken for a begin and an end token around no text, also where the
    pipeline adds none: token ids (no tokenizer), or text with add_bos=false add_eos=false."""
    import logging

    assert [len(load_tokenizer(sp_model).encode(w)) for w in ("the", "sat")] == [1, 2]
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"ids": [3 + i % 50, 4]}) + "\n" for i in range(120)))
    words = write_corpus(tmp_path / "w", ["the", "sat"] * 60, "json")
    for cfg in (hf_config(("json", str(ids)), "", train_data_columns="ids"),
                hf_config(words, sp_model, add_bos=False, add_eos=False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tessera"):
            take(make_input(cfg.data, 96, 4), 12)  # more than 100 documents
        assert not [r for r in caplog.records if "hold no text" in r.getMessage()]
