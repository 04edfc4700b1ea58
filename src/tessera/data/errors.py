"""`DataError`, and finding the damaged spot of a local data file.

A damaged file usually fails deep inside `datasets` or pyarrow, with a message that names no
file (`OSError: Corrupt snappy compressed data.`, `JSON parse error ... in row 1` counted within
a block). After such a failure, `read_failure` checks the local files one by one, in reading
order (parquet: row group by row group with pyarrow; JSON lines and text: line by line), and
names the first damaged file and its row group or line. Only a failing run pays for the check.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from urllib.parse import urlsplit

from tessera.config import ConfigError

log = logging.getLogger("tessera")

REMOTE_PREFIXES = ("gs://", "s3://", "hf://", "http://", "https://")
# the service each scheme's client talks to (http and https: the URL's own host; s3's endpoint is
# configurable, so left to its client), and the variables that put another host in its place
_SERVICE_HOSTS = {"gs": "storage.googleapis.com", "hf": "huggingface.co"}
_SERVICE_OVERRIDES = {"gs": "STORAGE_EMULATOR_HOST", "hf": "HF_ENDPOINT"}
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def unresolvable_host(url: str) -> str | None:
    """Why the service behind remote URL `url` cannot be reached at all: its host name does not
    resolve (no network, no DNS). Asked first because the clients retry exactly that for about 50 s
    (gcsfs: the credentials' metadata server, then the request) before they give up, logging each
    retry's traceback. None when the name resolves, for a local path, or when the name is not ours
    to resolve (an emulator or mirror set in the environment, or a proxy, which resolves it)."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    host = urlsplit(url).hostname if scheme in ("http", "https") else _SERVICE_HOSTS.get(scheme)
    if not host or os.environ.get(_SERVICE_OVERRIDES.get(scheme, "")) or any(map(os.environ.get, _PROXY_VARIABLES)):
        return None
    try:
        socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the host name {host} does not resolve: {e.strerror}"
    return None


def check_reachable(url: str, setting: str) -> None:
    """ConfigError (one line naming `setting`, e.g. "hf_train_files='gs://b/*.json'") when the host
    behind remote data URL `url` cannot be reached (`unresolvable_host`)."""
    why = unresolvable_host(url)
    if why:
        raise ConfigError(f"{setting} cannot be reached ({why}); check the network and the address, or copy the "
                          "files to a local disk and point the key there")


class DataError(ConfigError):
    """Input data that cannot be used as it is (damaged file, no records). The message names the
    file, the row group or line when known, and what to do. It is a ConfigError, so the trainer
    reports it like any other bad input: one line and exit code 2."""


def describe_files(files: list[str]) -> str:
    """"file 'a.json'" / "the 2 files 'a.json', 'b.json'" / "the 10 files 'a.json', ... and 7 more"."""
    if len(files) == 1:
        return f"file {files[0]!r}"
    shown = ", ".join(repr(f) for f in files[:3])
    return f"the {len(files)} files {shown}" + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def no_records(setting: str, files: list[str], note: str = "") -> DataError:
    """The error for `files` (of `setting`, e.g. "hf_train_files='/data/*.txt'") holding no records."""
    hold = "holds" if len(files) == 1 else "hold"
    key = setting.partition("=")[0]
    return DataError(f"{setting}: {describe_files(files)} {hold} no records{note}; add documents or point {key} at "
                     "files that have some")


def no_tokens(source: str) -> DataError:
    """The error for training data (`source`, e.g. "hf_train_files='a.json', train_data_columns=['text']")
    of which a whole pass gave no token to predict (no document of 2 tokens or more): repeating it would
    never fill a batch, or would train on nothing with a loss of 0."""
    return DataError(f"{source}: a whole pass over the training data holds no tokens to predict (every document "
                     "is empty text, an empty token-id list or a single token: add_bos/add_eos add at most one "
                     "begin/end token each, and a token is predicted only from an earlier one of its document); "
                     "check that train_data_columns names the column with the text, and the files")


def read_failure(error: Exception, files: list[str], fmt: str, setting: str) -> DataError:
    """The DataError for `error`, raised while reading `files` (set by `setting`, e.g.
    "hf_train_files='/data/*.parquet'") in format `fmt`."""
    what = brief(error)
    key = setting.partition("=")[0]
    local = [f for f in files if not f.startswith(REMOTE_PREFIXES)]
    if local and len(local) == len(files) and all(_holds_no_records(f, fmt) for f in local):
        return no_records(setting, files)  # the readers fail on empty files (StopIteration, "BatchSize ... 0")
    if fmt in _FINDERS and local:
        log.info("reading %s failed (%s); checking its %d local file(s) one by one", key, what, len(local))
        for path in local:
            try:
                spot = _FINDERS[fmt](path)
            except (OSError, EOFError) as e:  # gone or unreadable since it was opened, or a cut-off .gz
                spot = f"it cannot be read ({brief(e)})"
            if spot:
                return damaged_file(key, path, spot)
        return DataError(f"reading {setting} failed ({what}); each local file reads cleanly on its own, so look for "
                         "records whose columns or types differ between files, or remote files that cannot be reached")
    return DataError(f"reading {setting} failed ({what}); its files cannot be checked one by one here (remote, or "
                     "not a file format): check them, then re-create or leave out the damaged one")


def _holds_no_records(path: str, fmt: str) -> bool:
    """True for a file that is empty: no bytes, only blank lines (JSON lines, text), a header
    line alone (CSV) or no rows (parquet). False when that cannot be told (unreadable, other formats)."""
    try:
        if os.path.getsize(path) == 0:
            return True
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        if fmt in ("json", "text", "csv"):
            with open_local(path) as f:
                lines = [line for line in f if line.strip()]
            return len(lines) <= (1 if fmt == "csv" else 0)
    except Exception:  # noqa: BLE001 - unreadable or damaged: not "empty"; the damage checks say what it is
        return False
    return False


def open_local(path: str):
    """A local data file opened for reading its bytes, decompressed when its name says it is compressed
    (`.gz`, `.bz2`, `.xz`, ...: `datasets` reads such JSON lines and text files as they are)."""
    import fsspec

    return fsspec.open(path, "rb", compression="infer").open()


def damaged_file(key: str, path: str, spot: str) -> DataError:
    """The error for file `path` of setting `key`, damaged at `spot` (e.g. "line 2 is not valid JSON")."""
    return DataError(f"{key}: file {path!r} is damaged: {spot}. Re-create the file, or leave it out of {key}")


def brief(e: Exception) -> str:
    """`Type: message` on one line, at most 300 characters of message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _parquet_damage(path: str) -> str | None:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        return f"its footer cannot be read ({brief(e)})"
    for group in range(parquet.num_row_groups):
        try:
            parquet.read_row_group(group)
        except Exception as e:  # noqa: BLE001
            return f"row group {group} (of {parquet.num_row_groups}, counting from 0) cannot be read ({brief(e)})"
    return None


def _json_damage(path: str) -> str | None:
    with open_local(path) as f:
        if f.read(64).lstrip().startswith(b"["):  # one JSON document, not JSON lines
            f.seek(0)
            try:
                json.loads(f.read().decode("utf-8"))
                return None
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                return f"it is not valid JSON ({brief(e)})"
    return _first_bad_line(path, parse_json=True)


def _text_damage(path: str) -> str | None:
    return _first_bad_line(path, parse_json=False)


def _first_bad_line(path: str, parse_json: bool) -> str | None:
    """'line N is not ...' for the first line that is not UTF-8 (or, with parse_json, not JSON)."""
    with open_local(path) as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
                if parse_json and line.strip() and not isinstance(json.loads(line), dict):
                    return f"line {number} is not a JSON object (JSON lines hold one {{...}} record per line)"
            except UnicodeDecodeError as e:
                return f"line {number} is not UTF-8 text (byte {e.start} of the line: {e.reason})"
            except json.JSONDecodeError as e:
                return f"line {number} is not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
    return None


def _whole_file_damage(reader):
    def check(path: str) -> str | None:
        try:
            reader(path)
            return None
        except Exception as e:  # noqa: BLE001
            return f"it cannot be read ({brief(e)})"
    return check


def _read_csv(path: str) -> None:
    import pandas  # the reader `datasets` uses for CSV

    pandas.read_csv(path)


def _read_arrow(path: str) -> None:
    import pyarrow as pa

    with pa.memory_map(path) as source:
        try:
            pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            pa.ipc.open_file(source).read_all()


_FINDERS = {"parquet": _parquet_damage, "json": _json_damage, "text": _text_damage,
            "csv": _whole_file_damage(_read_csv), "arrow": _whole_file_damage(_read_arrow)}
