"""Opening corpus files: gzip is recognized by its magic bytes, not by the name, so a compressed
file under a plain name (or the reverse) is read correctly instead of failing as malformed."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

GZIP_MAGIC = b"\x1f\x8b"


def open_binary(path: Path):
    """A binary handle on the (decompressed) contents of `path`."""
    with open(path, "rb") as probe:
        compressed = probe.read(2) == GZIP_MAGIC
    return gzip.open(path, "rb") if compressed else open(path, "rb")


def open_text(path: Path):
    """UTF-8 text; a leading byte-order mark (Windows editors write one) is skipped."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig")
