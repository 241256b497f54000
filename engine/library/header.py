"""A GGUF file's header (metadata and tensor list) read without its tensor data: from a local file, or from the
first megabytes of a file on the hub through HTTP range requests, so the ledger can judge a file before it is
downloaded."""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

# GGUF value types (the file format's numbering)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 4096  # longer arrays (the tokenizer's) keep only their length


class HeaderTruncated(Exception):
    """The bytes given end before the header does: fetch more."""


class HeaderInvalid(Exception):
    """Not a GGUF file, or a header this reader cannot parse."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type{self.type_id}"

    @property
    def n_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        except (ValueError, KeyError):
            return 0
        return self.n_elements // block * size


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int] = field(default_factory=dict)  # long arrays kept as their length only
    tensors: list[TensorInfo] = field(default_factory=list)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) < n:
        raise HeaderTruncated()
    return data


def _unpack(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    n = _unpack(f, "<Q")
    if n > 1 << 30:
        raise HeaderInvalid(f"a string of {n} bytes")
    return _read(f, n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    raise HeaderInvalid(f"value type {vtype}")


def _array(f: BinaryIO) -> tuple[list | None, int]:
    itype, n = _unpack(f, "<I"), _unpack(f, "<Q")
    keep = n <= _KEEP_ARRAY
    items = []
    if itype in _SCALARS and not keep:  # skip fixed-size items at once
        _read(f, n * struct.calcsize(_SCALARS[itype]))
        return None, n
    if itype == _STRING and not keep:  # skip the tokenizer's strings without decoding them
        for _ in range(n):
            f.seek(_unpack(f, "<Q"), 1)
        return None, n
    for _ in range(n):
        if itype == _ARRAY:
            _array(f)
            item = None
        else:
            item = _value(f, itype)
        if keep:
            items.append(item)
    return (items if keep else None), n


def parse_header(f: BinaryIO) -> GGUFHeader:
    """Parses the header from a stream positioned at the file's start; HeaderTruncated when the stream ends first."""
    if _read(f, 4) != b"GGUF":
        raise HeaderInvalid("no GGUF magic")
    version = _unpack(f, "<I")
    if version not in (2, 3):
        raise HeaderInvalid(f"GGUF version {version}")
    n_tensors, n_kv = _unpack(f, "<Q"), _unpack(f, "<Q")
    header = GGUFHeader(version, {})
    for _ in range(n_kv):
        key, vtype = _string(f), _unpack(f, "<I")
        if vtype == _ARRAY:
            items, n = _array(f)
            if items is None:
                header.array_lengths[key] = n
            else:
                header.metadata[key] = items
        else:
            header.metadata[key] = _value(f, vtype)
    for _ in range(n_tensors):
        name = _string(f)
        dims = _unpack(f, "<I")
        shape = tuple(_unpack(f, "<Q") for _ in range(dims))
        type_id = _unpack(f, "<I")
        _unpack(f, "<Q")  # the tensor's offset in the data section
        header.tensors.append(TensorInfo(name, shape, type_id))
    return header


def read_local_header(path: str | Path) -> GGUFHeader:
    with open(path, "rb") as f:
        try:
            return parse_header(f)
        except HeaderTruncated:
            raise HeaderInvalid("the file ends inside its header") from None


def read_remote_header(url: str, headers: dict[str, str] | None = None, *, first: int = 2 << 20,
                       most: int = 64 << 20) -> GGUFHeader:
    """Fetches the first ``first`` bytes (doubling up to ``most``) until the header parses. Raises HeaderInvalid,
    HeaderTruncated (beyond ``most``) or the HTTP client's errors."""
    from huggingface_hub.utils import get_session

    size = first
    while True:
        request = dict(headers or {}, Range=f"bytes=0-{size - 1}")
        response = get_session().get(url, headers=request, follow_redirects=True)
        response.raise_for_status()
        data = response.content
        try:
            return parse_header(io.BytesIO(data))
        except HeaderTruncated:
            if len(data) < size or size >= most:  # the whole file came back, or the limit: give up
                raise
            size *= 2
