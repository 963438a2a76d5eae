"""A GGUF file read directly: header, metadata, tensor table, and tensors as float32 in torch's dim order.

The layout (GGUF versions 2 and 3, little-endian; llama.cpp's docs/gguf.md):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type: u32, value)      string = u64 length + UTF-8 bytes
    tensor_count x  (name: string, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64)
    padding to `general.alignment` (default 32), then the tensor data; each offset is relative to its start

A value is a scalar, a string or an array (element type u32, count u64, elements). Dims are listed innermost
first (ne0 is the contiguous one), so a [rows, cols] torch matrix is stored as dims (cols, rows).

The metadata is parsed with `struct.unpack_from` over an mmap of the file, so a 49152-token vocabulary and its
merges take tens of milliseconds; tensors are read on demand from the same mapping. Quantized blocks are expanded
by `gguf.quants.dequantize`; F32, F16 and BF16 are read as they are.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtllm_dustin.models.errors import ModelLoadError

__all__ = ["DEFAULT_ALIGNMENT", "GGUF_VERSIONS", "GGUFFile", "GGUFTensorInfo"]

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # version 1 used 32-bit counts and lengths; llama.cpp has written 3 since 2023
DEFAULT_ALIGNMENT = 32  # of the tensor data, when the file sets no general.alignment
MAX_DIMS = 4  # ggml tensors have at most four dims

_STRING, _ARRAY = 8, 9  # the two non-scalar value types
_SCALARS = {0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
            4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), 7: struct.Struct("<?"),
            10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d")}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
# ggml types read without the gguf package: id -> torch dtype of the stored elements
_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order, outermost first (the file's dims reversed)
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file
    nbytes: int  # stored bytes (quantized blocks included)

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name


class _Cursor:
    """Reads values from a buffer at a moving position; struct.error / IndexError mean the file ended early."""

    def __init__(self, buf: mmap.mmap, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self) -> str:
        n = self.scalar(_U64)
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error(f"a {n}-byte string runs past the end")
        text = self.buf[self.pos:end].decode("utf-8")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata value type {value_type}")

    def array(self) -> list[Any]:
        element_type, count = self.scalar(_U32), self.scalar(_U64)
        if count > len(self.buf) - self.pos:  # every element takes at least one byte: a corrupt count
            raise struct.error(f"an array of {count} elements runs past the end")
        if element_type in _SCALARS:  # one unpack for the whole array (token types, scores)
            fmt = _SCALARS[element_type].format[1:]
            values = list(struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos))
            self.pos += count * _SCALARS[element_type].size
            return values
        if element_type == _STRING:  # the vocabulary and the merges: ~10^5 strings, the hot loop of the parse
            buf, pos, out, size = self.buf, self.pos, [], len(self.buf)
            unpack = _U64.unpack_from
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                try:
                    out.append(buf[pos:pos + n].decode("utf-8"))
                except UnicodeDecodeError:
                    if pos + n > size:  # the slice was cut short by the end of the file
                        raise struct.error("a string array runs past the end") from None
                    raise
                pos += n
            if pos > size:
                raise struct.error("a string array runs past the end")
            self.pos = pos
            return out
        return [self.value(element_type) for _ in range(count)]


class GGUFFile:
    """An opened GGUF file: `metadata` (key -> int | float | bool | str | list) and `tensors` (name -> info), parsed
    once at open; `tensor(name)` reads one tensor. Errors are ModelLoadError naming the file."""

    def __init__(self, path: Path, version: int, metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo],
                 alignment: int, data: mmap.mmap) -> None:
        self.path, self.version, self.metadata, self.tensors = path, version, metadata, tensors
        self.alignment = alignment
        self._data = data  # a private (copy-on-write) mapping: tensors may be views of it, the file never changes

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
            raise ModelLoadError(f"{path} cannot be read as a GGUF file ({e})") from e
        return cls._parse(path, data)

    @classmethod
    def _parse(cls, path: Path, data: mmap.mmap) -> GGUFFile:
        size = len(data)
        if size < _HEADER.size:
            raise ModelLoadError(f"{path} is truncated ({size} bytes, shorter than a GGUF header); re-download it")
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(data, 0)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        if version not in GGUF_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = "a big-endian file; convert it little-endian" if swapped in GGUF_VERSIONS else \
                "re-convert it with a recent llama.cpp (convert_hf_to_gguf.py)"
            raise ModelLoadError(f"{path} has GGUF version {version}; versions {GGUF_VERSIONS} are supported: {hint}")
        cursor = _Cursor(data, _HEADER.size)
        try:
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.scalar(_U32))
            raw = [cls._tensor_entry(cursor) for _ in range(n_tensors)]
        except (struct.error, IndexError) as e:
            raise ModelLoadError(f"{path} is truncated or corrupt near byte {cursor.pos} ({e}); re-download it") from e
        except (UnicodeDecodeError, ValueError) as e:
            raise ModelLoadError(f"{path} is corrupt near byte {cursor.pos} ({e}); re-download it") from e
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ModelLoadError(f"{path}: general.alignment={alignment!r} must be a power of two")
        start = -(-cursor.pos // alignment) * alignment
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in raw:
            if name in tensors:
                raise ModelLoadError(f"{path} lists tensor {name!r} twice; the file is corrupt")
            info = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start + offset,
                                  _nbytes(path, name, dims, ggml_type))
            if offset % alignment:
                raise ModelLoadError(f"{path}: tensor {name} starts at data offset {offset}, not a multiple of the "
                                     f"alignment {alignment}; the file is corrupt")
            if info.offset + info.nbytes > size:
                raise ModelLoadError(f"{path} is truncated: tensor {name} ends at byte {info.offset + info.nbytes} "
                                     f"but the file has {size}; re-download it")
            tensors[name] = info
        return cls(path, version, metadata, tensors, alignment, data)

    @staticmethod
    def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string()
        n_dims = cursor.scalar(_U32)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dims (ggml allows 1 to {MAX_DIMS})")
        dims = tuple(cursor.scalar(_U64) for _ in range(n_dims))
        return name, dims, cursor.scalar(_U32), cursor.scalar(_U64)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` as float32 in torch's dim order, dequantized if stored in blocks (an F32 tensor is a view
        of the file's private mapping: copy it before writing to it)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path} has no tensor {name!r}")
        if info.ggml_type in _FLOAT_TYPES:
            dtype = _FLOAT_TYPES[info.ggml_type]
            count = info.nbytes // dtype.itemsize
            return torch.frombuffer(self._data, dtype=dtype, count=count, offset=info.offset).view(info.shape).float()
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(info.ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = np.frombuffer(self._data, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = blocks.reshape(*info.shape[:-1], info.shape[-1] // block * block_bytes)  # [..., bytes of a row]
        try:
            values = dequantize(rows, qtype)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path}: tensor {name} is stored as {qtype.name}, which gguf cannot "
                                 f"dequantize ({e}); re-quantize the model to a supported type (Q4_0/Q8_0/Q4_K...)"
                                 ) from e
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(info.shape)


def _nbytes(path: Path, name: str, dims: tuple[int, ...], ggml_type: int) -> int:
    """Stored bytes of a tensor: whole blocks of the innermost dim."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {name} has ggml type {ggml_type}, unknown to the installed gguf package "
                             "(upgrade it: `pip install -U gguf`)") from e
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise ModelLoadError(f"{path}: tensor {name} has {dims[0]} elements per row, not a multiple of the "
                             f"{qtype.name} block of {block}; the file is corrupt")
    elements = 1
    for d in dims:
        elements *= d
    return elements // block * block_bytes
