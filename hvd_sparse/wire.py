"""The packed payload: one byte buffer per bucket and rank.

    header (16 bytes) | [Golomb extension (8)] | indices | pad to 8 | values | pad to 8

Header, little endian: magic ``0xB5``, format version, index code, value code, a 32-bit
fingerprint of the bucket (name and length) and the entry count (int64).

* Index codes: ``0`` int32, ``1`` int64 (past 2**31 - 1 entries), ``2`` Golomb-Rice coded gaps
  (the extension holds the stream's byte length and the Rice parameter ``b``).
* Value codes: ``0`` fp32, ``1`` fp16, ``2`` bf16, ``3`` fp64; with bit ``0x80`` set the payload
  holds a single value shared by every position (Sparse Binary Compression).

Sections are padded to 8 bytes so that every section, and every rank's payload inside an
allgathered buffer, starts 8-byte aligned and can be viewed in place. Each payload states its own
length, so the concatenation an allgather returns is split without a second collective, and the
fingerprint lets every rank notice at the first step that another rank sent a different bucket.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from . import golomb

MAGIC = 0xB5
VERSION = 1
HEADER = struct.Struct("<BBBBIq")
HEADER_BYTES = HEADER.size  # 16
GOLOMB_EXT = struct.Struct("<IBxxx")  # stream bytes, Rice parameter
#: the largest Rice parameter an honest payload carries (about log2 of a bucket's length);
#: a larger one would shift past 63 bits and, on a GPU, ask for count * b index entries
MAX_RICE_PARAMETER = 62
INT32_LIMIT = 2**31 - 1
CONSTANT = 0x80
NONFINITE = 0x40  # the sender's gradient held NaN/Inf; the payload carries no entries

_INDEX_DTYPES = {0: torch.int32, 1: torch.int64}
GOLOMB = 2
_VALUE_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16, 3: torch.float64}
_INDEX_CODE = {v: k for k, v in _INDEX_DTYPES.items()}
_VALUE_CODE = {v: k for k, v in _VALUE_DTYPES.items()}
INDEX_CODINGS = ("plain", "golomb")


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


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def payload_nbytes(count: int, index_dtype: torch.dtype, value_dtype: torch.dtype,
                   constant: bool = False) -> int:
    """Exact size in bytes of a plain-index payload with ``count`` entries."""
    ib = count * _size(index_dtype)
    vb = (min(count, 1) if constant else count) * _size(value_dtype)  # none when empty
    return HEADER_BYTES + ib + _pad8(ib) + vb + _pad8(vb)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:  # an empty tensor may carry any stride, which view() rejects
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if t.stride(-1) != 1:  # an expanded one (a constant's value) is "contiguous" at length 1
        t = t.clone(memory_format=torch.contiguous_format)
    return t.contiguous().view(torch.uint8).reshape(-1)


def _bytes_tensor(data: bytes, device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def encode(indices: torch.Tensor, values: torch.Tensor, *, index_dtype: torch.dtype, tag: int,
           numel: int = 0, index_coding: str = "plain", constant: bool = False,
           nonfinite: bool = False) -> torch.Tensor:
    """Pack (indices, values) into one uint8 tensor on the values' device.

    ``constant``: every value equals ``values[0]``, which is sent once. ``index_coding="golomb"``
    codes the (ascending) indices as Golomb-Rice gaps with the parameter for ``count / numel``.
    """
    if constant:  # one shared value, none when there are no positions
        values = values[:1] if indices.numel() else values[:0]
    elif indices.numel() != values.numel():
        raise ValueError("indices and values differ in length")
    if values.dtype not in _VALUE_CODE:
        raise TypeError(f"values of dtype {values.dtype} cannot be put on the wire")
    count = indices.numel()
    device = values.device
    vcode = _VALUE_CODE[values.dtype] | (CONSTANT if constant else 0) | \
        (NONFINITE if nonfinite else 0)
    if index_coding == "golomb":
        if not numel and count:  # the vector's length unknown: at least past the last index
            numel = int(indices.max()) + 1
        b = golomb.optimal_parameter(count / numel if numel else 0.0)
        index_section = golomb.encode_tensor(indices, b).to(device)  # coded where they lie
        head = HEADER.pack(MAGIC, VERSION, GOLOMB, vcode, tag & 0xFFFFFFFF, count) + \
            GOLOMB_EXT.pack(index_section.numel(), b)
    elif index_coding == "plain":
        head = HEADER.pack(MAGIC, VERSION, _INDEX_CODE[index_dtype], vcode, tag & 0xFFFFFFFF,
                           count)
        if values.numel() == 0 or values.stride(-1) == 1:
            return _plain_in_place(head, indices, values, index_dtype, device)
        index_section = _as_bytes(indices.to(index_dtype))
    else:
        raise ValueError(f"index_coding must be one of {INDEX_CODINGS}, got {index_coding!r}")
    parts = [_bytes_tensor(head, device)]
    for section in (index_section, _as_bytes(values)):
        parts.append(section)
        pad = _pad8(section.numel())
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    return torch.cat(parts)


def _plain_in_place(head: bytes, indices, values, index_dtype, device) -> torch.Tensor:
    """A plain-index payload written into its buffer section by section: the indices
    narrowed as they are copied in (no narrowed copy, then a concatenation of copies)."""
    ib = indices.numel() * _size(index_dtype)
    vb = values.numel() * _size(values.dtype)
    out = torch.empty(len(head) + ib + _pad8(ib) + vb + _pad8(vb), dtype=torch.uint8,
                      device=device)
    at = len(head)
    out[:at].copy_(_bytes_tensor(head, device))
    if ib:
        out[at:at + ib].view(index_dtype).copy_(indices)
    out[at + ib:at + ib + _pad8(ib)].zero_()
    at += ib + _pad8(ib)
    if vb:
        out[at:at + vb].view(values.dtype).copy_(values)
    out[at + vb:].zero_()
    return out


@dataclass
class Payload:
    indices: torch.Tensor  # int64, ascending within a payload
    values: torch.Tensor   # one per index (a constant payload is expanded)
    nbytes: int
    nonfinite: bool = False  # the sender saw NaN/Inf and sent nothing
    # Golomb positions decoded on a device: whether the stream held them all (0-dim bool,
    # read with the position checks of decode_all); None where there is nothing to check
    complete: Optional[torch.Tensor] = None


def _host_reader(buf: torch.Tensor):
    """``read(offset, nbytes) -> bytes`` over ``buf``: slices of the host array when ``buf`` is
    on the host, else small copies of just the bytes asked for (headers and Golomb streams),
    so a payload on a device never travels whole to the host to be parsed."""
    if buf.device.type == "cpu":
        host = buf.numpy()
        return lambda offset, nbytes: host[offset:offset + nbytes].tobytes()
    return lambda offset, nbytes: buf[offset:offset + nbytes].cpu().numpy().tobytes()


def decode_one(buf: torch.Tensor, offset: int, read, numel: int = 2**62, known=None):
    """Decode the payload at ``offset`` (``read`` from :func:`_host_reader` fetches its header
    bytes); at most ``numel`` entries are accepted. ``known``: the int64 positions the payload
    is known to hold (this rank's own, as it encoded them): taken instead of decoded.

    Returns the payload, its fingerprint and the offset just past it.
    """
    raw = read(offset, HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise PayloadError("buffer ends inside a payload header")
    magic, version, icode, vcode, tag, count = HEADER.unpack(raw)
    constant = bool(vcode & CONSTANT)
    nonfinite = bool(vcode & NONFINITE)
    vcode &= ~(CONSTANT | NONFINITE)
    if magic != MAGIC or version != VERSION or vcode not in _VALUE_DTYPES \
            or icode not in (0, 1, GOLOMB) or count < 0:
        hint = ("; zeros where a payload belongs come from a rank inside hvd.join(), which "
                "Horovod's allgather cannot stand in for: see docs/robustness.md on join"
                if magic == 0 and version == 0 else "")
        raise PayloadError(f"not an hvd_sparse payload at byte {offset} "
                           f"(magic {magic:#x}, version {version}){hint}")
    if count > numel:
        raise PayloadError(f"payload at byte {offset} claims {count} entries, more than the "
                           f"bucket's {numel}")
    if known is not None:
        known = known if known.dim() == 1 else known.reshape(-1)
        if known.numel() != count:
            raise PayloadError(f"payload at byte {offset} holds {count} entries where this "
                               f"rank sent {known.numel()}")
    vdt = _VALUE_DTYPES[vcode]
    pos = offset + HEADER_BYTES
    complete = None
    if icode == GOLOMB:
        ext = read(pos, GOLOMB_EXT.size)
        if len(ext) < GOLOMB_EXT.size:
            raise PayloadError(f"buffer ends inside the Golomb-Rice header at byte {pos}")
        stream_bytes, b = GOLOMB_EXT.unpack(ext)
        pos += GOLOMB_EXT.size
        if b > MAX_RICE_PARAMETER:  # no density gives more; a larger one is a corrupt header
            raise PayloadError(f"corrupt Golomb-Rice header at byte {offset}: Rice parameter "
                               f"{b} (at most {MAX_RICE_PARAMETER})")
        if pos + stream_bytes > buf.numel():
            raise PayloadError(f"Golomb-Rice stream at byte {pos} runs past the buffer end")
        if known is not None:
            indices = known
        elif buf.device.type != "cpu":  # decoded where it lies; checked in decode_all's read
            indices, complete = golomb.decode_tensor(buf[pos:pos + stream_bytes], count, b)
        else:
            try:
                indices = torch.from_numpy(golomb.decode(read(pos, stream_bytes), count, b))
            except (ValueError, IndexError) as e:
                raise PayloadError(f"corrupt Golomb-Rice positions at byte {offset}: "
                                   f"{e}") from None
        ib = stream_bytes
    else:
        idt = _INDEX_DTYPES[icode]
        ib = count * _size(idt)
        if pos + ib > buf.numel():
            raise PayloadError(f"payload at byte {offset} claims {count} entries, "
                               "past the buffer end")
        indices = known if known is not None else buf[pos:pos + ib].view(idt).to(torch.int64)
    pos += ib + _pad8(ib)
    nvals = min(count, 1) if constant else count
    vb = nvals * _size(vdt)
    if pos + vb > buf.numel():
        raise PayloadError(f"payload at byte {offset} claims {count} entries, past the buffer end")
    values = buf[pos:pos + vb].view(vdt)
    if constant:
        values = values.expand(count) if count else values[:0]
    end = pos + vb + _pad8(vb)
    return Payload(indices, values, end - offset, nonfinite, complete), tag, end


def decode_all(buf: torch.Tensor, ranks: int, *, tag: int, numel: int, bucket: str,
               own=None) -> list:
    """Split an allgathered buffer into ``ranks`` payloads, in rank order, and check them.

    The headers are read on the host (a few bytes each when the buffer lives on a device) and
    each payload's positions are checked with one host read. ``own``: (this rank, the int64
    positions it encoded): its own payload's are taken as they are instead of decoded (a
    Golomb walk costs about a nanosecond per bit), and checked like the others.
    """
    read = _host_reader(buf)
    payloads, offset, checks = [], 0, []
    me, mine = own if own is not None else (-1, None)
    for r in range(ranks):
        try:
            payload, got_tag, offset = decode_one(buf, offset, read, numel,
                                                  mine if r == me else None)
        except PayloadError as e:
            raise PayloadError(f"rank {r}'s payload for bucket '{bucket}': {e}") from None
        if got_tag != (tag & 0xFFFFFFFF):
            raise PayloadError(
                f"rank {r} sent a different bucket than this rank expects for '{bucket}' "
                f"({numel} entries): the ranks disagree on parameter names, shapes, dtypes or "
                "bucketing options")
        idx = payload.indices
        if idx.numel():  # this rank's own too: a user's method may break the contract
            # positions must be in range, ascending and unique (the scatter relies on it):
            # first, last, order and the Golomb stream's completeness, for every payload
            # in one read (on a device each read waits for the queue to drain)
            yes = torch.ones((), dtype=torch.bool, device=idx.device)
            ordered = (idx[1:] > idx[:-1]).all() if idx.numel() > 1 else yes
            whole = payload.complete if payload.complete is not None else yes
            checks.append((r, torch.stack([idx[0], idx[-1], ordered.to(idx.dtype),
                                           whole.to(idx.dtype)])))
        payloads.append(payload)
    by_device = {}
    for r, c in checks:
        by_device.setdefault(c.device, []).append((r, c))
    verdicts = {}
    for group in by_device.values():
        for (r, _), got in zip(group, torch.stack([c for _, c in group]).tolist()):
            verdicts[r] = got
    for r in sorted(verdicts):
        first, last, ok, whole = verdicts[r]
        if not whole:
            raise PayloadError(f"rank {r}'s payload for bucket '{bucket}': corrupt "
                               "Golomb-Rice positions (the stream ends early)")
        if first < 0 or last >= numel:
            raise PayloadError(f"rank {r} sent an index outside bucket '{bucket}' "
                               f"(0..{numel - 1})")
        if not ok:
            raise PayloadError(f"rank {r} sent unsorted or repeated indices for bucket "
                               f"'{bucket}'")
    if offset != buf.numel():
        raise PayloadError(f"{buf.numel() - offset} unexplained bytes after {ranks} payloads "
                           f"for bucket '{bucket}': the ranks disagree on the world size")
    return payloads
