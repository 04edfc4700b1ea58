"""Path keys (marked `path=` in the schema, `PATH_KINDS` in fields.py): made absolute against the
working directory once, when a config is built (`resolve_paths`); URLs such as gs://... are kept.
Refused, each in one line: a URL that lost a slash after its scheme or names no bucket, a file: URL
(no client reads one), ~user for a user that does not exist, a name longer than file systems take."""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from tessera.config.checks import NAME_MAX_BYTES
from tessera.config.fields import HF_FILE_FORMATS
from tessera.config.schema import Config, ConfigError, all_fields, path_keys


def absolute_path(text: str) -> str:
    """`text` made absolute against the working directory (`~` expanded, `..` folded); a URL
    (anything with "://", e.g. gs://bucket/runs) and an empty value are kept as they are."""
    if not text or "://" in text:
        return text
    return os.path.abspath(os.path.expanduser(text))


def is_file_url(text: str) -> bool:
    """file:///data/x, FILE:x: a URL that neither etils nor Orbax has a client for."""
    return text[:5].lower() == "file:"


def file_url_path(text: str) -> str:
    """The absolute local path file: URL `text` names (file:///data/my%20run -> /data/my run)."""
    return absolute_path(unquote(urlsplit(text).path) or ".")


# "gs:/bucket/x": a URL that lost a slash (two or more letters before the colon, so not a drive letter)
_LOST_SLASH = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/(?!/)")


def _is_local(text: str) -> bool:
    """hf_path names a local file or folder (not a format such as parquet, nor a Hub dataset)."""
    if text in HF_FILE_FORMATS or "://" in text:
        return False
    return text.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(text))


def resolve_paths(cfg: Config) -> None:
    """Make every path key of `cfg` absolute, in place (see `PATH_KINDS` in fields.py): the one
    place where relative paths are resolved, against the working directory of this process."""
    fields = all_fields()
    if not cfg.run.base_output_directory:  # MaxText's default, "": the working directory (checkpoints went to
        cfg.run.base_output_directory = os.getcwd()  # /run_name/checkpoints, the other files to ./run_name)
    for name, kind in path_keys().items():
        section = getattr(cfg, fields[name][0])
        value = getattr(section, name)
        for text in value.split(",") if kind == "globs" else [value]:
            _refuse_url_lookalike(name, value, text.strip())
            _refuse_unknown_home(name, value, text.strip())
        if kind == "globs":
            value = ",".join(absolute_path(p.strip()) for p in value.split(",") if p.strip())
        elif kind == "path" or _is_local(value):
            value = absolute_path(value)
        for text in value.split(",") if kind == "globs" else [value]:
            if text.startswith("/"):  # local (a bucket's object names may be longer)
                _refuse_long_name(name, text)
        setattr(section, name, value)


def _refuse_url_lookalike(name: str, value: str, text: str) -> None:
    """ConfigError for `text` (key `name`, whole value `value`) that looks like a URL no client reads:
    file:///data/x (etils and Orbax have no file:// client: a KeyError traceback, or "cannot be
    reached ... check the network"), a URL without a bucket (gs://, gs:///x: Orbax's ValueError), or
    gs:/b/x, which would be the local folder ./gs:/b/x, written without a word."""
    if is_file_url(text):
        raise ConfigError(f"{name}={value} is a file: URL, which is not read as a local path; write the path "
                          f"itself, {file_url_path(text)}")
    if "://" in text and not urlsplit(text).netloc:  # Orbax: a ValueError traceback after the model was built
        scheme, rest = text.split("://", 1)
        raise ConfigError(f"{name}={value} names no bucket after {scheme}://; write {scheme}://<bucket>/<folder>, "
                          f"e.g. {scheme}://my-bucket/{rest.strip('/') or 'runs'}")
    if _LOST_SLASH.match(text):
        url = re.sub(r"^([^:]+):/+", r"\1://", text)
        raise ConfigError(f"{name}={value} is a URL with one slash after its scheme, which would be read as "
                          f"the local folder {absolute_path(text)}; write {url} (pathlib's "
                          "Path('gs://b/x') drops one slash)")


def _refuse_unknown_home(name: str, value: str, text: str) -> None:
    """ConfigError for ~someone/x where no user someone exists: expanduser keeps it, and the run wrote
    into a folder named ~someone under the working directory."""
    if text.startswith("~") and os.path.expanduser(text) == text:
        user = text[1:].split("/", 1)[0]
        raise ConfigError(f"{name}={value}: {'~' + user} is the home folder of a user {user!r}, and there is none "
                          f"here{'' if user else ' (HOME is not set)'}; write the folder's full path")


def _refuse_long_name(name: str, path: str) -> None:
    """ConfigError for local path `path` (key `name`) with a part longer than file systems take: the
    first look at it (Path.is_dir, os.stat) raised OSError "File name too long", a traceback."""
    why = too_long_name(path)
    if why:
        raise ConfigError(f"{name}={why}; use a shorter name")


def too_long_name(path: str) -> str:
    """"<path, its long part cut> has a file or folder name of N bytes, ..." when a part of `path` is
    longer than file systems take (NAME_MAX); "" when none is."""
    longest = max(path.split("/"), key=lambda part: len(part.encode()))
    if len(longest.encode()) <= NAME_MAX_BYTES:
        return ""
    return (f"{path.replace(longest, longest[:20] + '...')} has a file or folder name of {len(longest.encode())} "
            f"bytes, and file systems take names of at most {NAME_MAX_BYTES} bytes")
