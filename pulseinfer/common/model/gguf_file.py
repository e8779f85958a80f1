"""A minimal GGUF reader: metadata as Python values, tensors as memory-mapped byte arrays.

gguf.GGUFReader wraps every array element (49k vocabulary strings) in numpy views and
takes seconds; this parses the same header with struct in a fraction of that.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major (outermost first), the reverse of ggml's ne order
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw bytes [rows, bytes per row]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.scalar("I"), self.scalar("Q")
            if elem in _SCALARS:
                fmt = f"<{count}{_SCALARS[elem]}"
                values = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += struct.calcsize(fmt)
                return values
            return [self.value(elem) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: Path) -> tuple[dict, list[GGUFTensor]]:
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = memoryview(mapped)
    try:
        if bytes(buf[:4]) != _MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file (bad magic)")
        cur = _Cursor(buf)
        cur.pos = 4
        version, n_tensors, n_kv = cur.scalar("I"), cur.scalar("Q"), cur.scalar("Q")
        if version < 2:
            raise GGUFFormatError(f"GGUF version {version} is not supported")
        fields = {}
        for _ in range(n_kv):
            key = cur.string()
            fields[key] = cur.value(cur.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
            infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
        alignment = int(fields.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        tensors = [_tensor(mapped, data_start, *info) for info in infos]
    except (struct.error, UnicodeDecodeError, IndexError) as e:
        raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from e
    return fields, tensors


def _tensor(mapped: mmap.mmap, data_start: int, name: str, dims: list[int], qtype_id: int, offset: int) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(qtype_id)
    except ValueError as e:
        raise GGUFFormatError(f"tensor {name}: unknown ggml type {qtype_id}") from e
    block, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = dims[0] // block * type_size
    rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    start = data_start + offset
    if start + rows * row_bytes > len(mapped):
        raise GGUFFormatError(f"tensor {name} extends past the end of the file")
    data = np.frombuffer(mapped, dtype=np.uint8, count=rows * row_bytes, offset=start).reshape(rows, row_bytes)
    return GGUFTensor(name, tuple(reversed(dims)), qtype, data)
