"""The packed payload: one byte buffer per bucket and rank, ``header | indices | values``.

Header (16 bytes, little endian): magic ``0xB5``, format version, index code, value code,
a 32-bit fingerprint of the bucket (name and length) and the entry count (int64). Index and value
sections are padded to 8 bytes so that every section, and every rank's payload inside an
allgathered buffer, starts 8-byte aligned and can be viewed without copying.

Because each payload states its own count and widths, a concatenation of payloads from all ranks
(what an allgather returns) is split exactly, without a second collective for the sizes. The
fingerprint lets every rank notice, on the first step, that another rank sent a different bucket.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = 0xB5
VERSION = 1
HEADER = struct.Struct("<BBBBIq")
HEADER_BYTES = HEADER.size  # 16
INT32_LIMIT = 2**31 - 1

_INDEX_DTYPES = {0: torch.int32, 1: torch.int64}
_VALUE_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16, 3: torch.float64}
_INDEX_CODE = {v: k for k, v in _INDEX_DTYPES.items()}
_VALUE_CODE = {v: k for k, v in _VALUE_DTYPES.items()}


class PayloadError(RuntimeError):
    """A gathered buffer does not hold what this rank expected (mismatched ranks or corruption)."""


def index_dtype_for(numel: int) -> torch.dtype:
    """int32 while every position fits, int64 beyond 2**31 - 1 entries."""
    return torch.int32 if numel - 1 <= INT32_LIMIT else torch.int64


def fingerprint(name: str, numel: int) -> int:
    """A 32-bit tag of a bucket, equal on ranks that agree on the bucket's name and size."""
    return zlib.crc32(f"{name}:{numel}".encode())


def _pad8(nbytes: int) -> int:
    return (-nbytes) % 8


def payload_nbytes(count: int, index_dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """Exact size in bytes of a payload with ``count`` entries."""
    ib = count * torch.empty(0, dtype=index_dtype).element_size()
    vb = count * torch.empty(0, dtype=value_dtype).element_size()
    return HEADER_BYTES + ib + _pad8(ib) + vb + _pad8(vb)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def encode(indices: torch.Tensor, values: torch.Tensor, *, index_dtype: torch.dtype,
           tag: int) -> torch.Tensor:
    """Pack (indices, values) into one uint8 tensor on the values' device."""
    if indices.numel() != values.numel():
        raise ValueError("indices and values differ in length")
    if values.dtype not in _VALUE_CODE:
        raise TypeError(f"values of dtype {values.dtype} cannot be put on the wire")
    count = indices.numel()
    header = HEADER.pack(MAGIC, VERSION, _INDEX_CODE[index_dtype], _VALUE_CODE[values.dtype],
                         tag & 0xFFFFFFFF, count)
    device = values.device
    parts = [torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)]
    for section in (_as_bytes(indices.to(index_dtype)), _as_bytes(values)):
        parts.append(section)
        pad = _pad8(section.numel())
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    return torch.cat(parts)


@dataclass
class Payload:
    indices: torch.Tensor  # int64
    values: torch.Tensor
    nbytes: int


def decode_one(buf: torch.Tensor, offset: int = 0, header_bytes: bytes | None = None):
    """Decode the payload starting at ``offset``; return it and the offset just past it."""
    raw = header_bytes if header_bytes is not None else bytes(
        buf[offset:offset + HEADER_BYTES].cpu().numpy().tobytes())
    if len(raw) < HEADER_BYTES:
        raise PayloadError("buffer ends inside a payload header")
    magic, version, icode, vcode, tag, count = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or icode not in _INDEX_DTYPES or vcode not in _VALUE_DTYPES:
        raise PayloadError(f"not an hvd_sparse payload at byte {offset} (magic {magic:#x}, version {version})")
    idt, vdt = _INDEX_DTYPES[icode], _VALUE_DTYPES[vcode]
    nbytes = payload_nbytes(count, idt, vdt)
    if offset + nbytes > buf.numel():
        raise PayloadError(f"payload at byte {offset} claims {count} entries, past the buffer end")
    pos = offset + HEADER_BYTES
    ib = count * torch.empty(0, dtype=idt).element_size()
    indices = buf[pos:pos + ib].view(idt).to(torch.int64)
    pos += ib + _pad8(ib)
    vb = count * torch.empty(0, dtype=vdt).element_size()
    values = buf[pos:pos + vb].view(vdt)
    return Payload(indices, values, nbytes), tag, offset + nbytes


def decode_all(buf: torch.Tensor, ranks: int, *, tag: int, numel: int, bucket: str) -> list:
    """Split an allgathered buffer into ``ranks`` payloads, in rank order, and check them.

    The headers are read on the host in one transfer when the buffer lives on a device.
    """
    host = buf if buf.device.type == "cpu" else buf.cpu()
    host_np = host.numpy()
    payloads, offset = [], 0
    for r in range(ranks):
        payload, got_tag, offset = decode_one(
            host if buf.device.type == "cpu" else buf, offset,
            header_bytes=host_np[offset:offset + HEADER_BYTES].tobytes())
        if got_tag != (tag & 0xFFFFFFFF):
            raise PayloadError(
                f"rank {r} sent a different bucket than this rank expects for '{bucket}' "
                f"({numel} entries): the ranks disagree on parameter names, shapes, dtypes or "
                "bucketing options")
        if payload.indices.numel() and int(payload.indices.max()) >= numel:
            raise PayloadError(f"rank {r} sent an index past the end of bucket '{bucket}'")
        payloads.append(payload)
    if offset != buf.numel():
        raise PayloadError(f"{buf.numel() - offset} unexplained bytes after {ranks} payloads "
                           f"for bucket '{bucket}': the ranks disagree on the world size")
    return payloads
