"""The API key the gateway requires: read from a file (`--api-key-file`) or from
$PULSEINFER_API_KEY, never from a command line, which every local user can read (`ps`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

API_KEY_ENV = "PULSEINFER_API_KEY"


def read_api_key_file(path: str) -> str:
    """The file's content without surrounding whitespace; a missing, unreadable or empty file is an error."""
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read --api-key-file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"--api-key-file {path} is not UTF-8 text") from e
    if not key:
        raise ValueError(f"--api-key-file {path} is empty")
    return key


def resolve_api_key(path: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key from `path` if given, else $PULSEINFER_API_KEY; None (no key needed) when neither is set."""
    if path is not None:
        return read_api_key_file(path)
    return environ.get(API_KEY_ENV) or None
