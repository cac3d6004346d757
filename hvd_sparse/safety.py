"""Guards that turn silent failure modes into clear errors on every rank.

* :func:`raise_config_mismatch` - before the first exchange every rank compares a digest of what
  it is about to do (parameter names, shapes, dtypes, buckets, sparsifier and exchange options;
  :mod:`hvd_sparse.engine.agreement`); a mismatch raises :class:`ConfigMismatchError` on every
  rank, naming the first difference, instead of a hang or a wrong sum.
* :func:`verify_replicas` - a cheap checksum collective over parameters and replicated downlink
  residuals; raises :class:`ReplicaDivergenceError` naming the first tensor that differs.
* :class:`NonFiniteGradientError` - raised on every rank when any rank's gradient held NaN/Inf
  (each payload carries a flag, so all ranks learn it from the same bytes).
* :func:`check_same_exchange` - the engine's own small collectives made during ``step()``
  (calibration, the finiteness vote; the first exchange's agreement names the difference)
  carry a fingerprint of their optimizer: ranks that step several DistributedOptimizers in
  different orders raise :class:`ExchangeOrderError` instead of pairing one optimizer's
  figures with another's.
"""
from __future__ import annotations

import hashlib
import json

import torch


class ConfigMismatchError(RuntimeError):
    """Ranks disagree on the model or on the optimizer's settings."""


class ExchangeOrderError(ConfigMismatchError):
    """Ranks reached the exchange of different DistributedOptimizers at the same point."""


#: bytes of :func:`exchange_fingerprint`
FINGERPRINT_BYTES = 8


def exchange_fingerprint(bucket_names) -> bytes:
    """Which optimizer a collective belongs to: a digest of its buckets' names, the same on
    every rank for the same optimizer (collectives are matched in order, not by owner)."""
    return hashlib.sha256("\0".join(bucket_names).encode()).digest()[:FINGERPRINT_BYTES]


def same_by_sums(transport, data: bytes, name: str, extra=()):
    """Is ``data`` the same on every rank taking part? One allreduce (which Horovod's ``join``
    serves, unlike an allgather) of a count of the ranks, ``extra`` numbers, and ``data`` in
    16-bit pieces with their squares: a piece is equal everywhere exactly when its sum is the
    count times this rank's and its sum of squares the count times its square (no spread),
    so every rank reaches the same answer, exactly (float64 holds these sums). A rank inside
    ``join()`` adds zeros: it is not counted. Returns (equal, the summed ``extra``)."""
    if len(data) % 2:
        data += b"\0"
    pieces = [float(int.from_bytes(data[i:i + 2], "little")) for i in range(0, len(data), 2)]
    k = len(extra)
    mine = torch.tensor([1.0, *map(float, extra), *pieces, *(p * p for p in pieces)],
                        dtype=torch.float64)
    got = transport.wait(transport.allreduce_async(mine, name, average=False)).cpu().tolist()
    count, sums, squares = got[0], got[1 + k:1 + k + len(pieces)], got[1 + k + len(pieces):]
    equal = all(t == count * p and q == count * p * p
                for t, q, p in zip(sums, squares, pieces))
    return equal, got[1:1 + k]


def check_same_exchange(prints, what: str) -> None:
    """Raise :class:`ExchangeOrderError` (on every rank: all see the same ``prints``) when the
    ranks' fingerprints differ."""
    odd = [r for r, f in enumerate(prints) if f != prints[0]]
    if odd:
        raise exchange_order_error(what, f"rank 0 and rank {odd[0]}")


#: what to do when ranks step several DistributedOptimizers in different orders
SAME_ORDER = "call their step() (and synchronize()) in the same order on every rank"


def exchange_order_error(what: str, who: str = "the ranks") -> ExchangeOrderError:
    return ExchangeOrderError(
        f"{who} reached the {what} of different DistributedOptimizers at the same point. "
        f"With several DistributedOptimizers, {SAME_ORDER}: their exchanges are collectives, "
        "matched in the order the ranks make them.")


class ReplicaDivergenceError(RuntimeError):
    """Parameters or replicated residuals are no longer bitwise equal across ranks."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf on some rank."""


def _gather_bytes(transport, data: bytes, name: str) -> list:
    """Every rank's byte string, in rank order (one variable-size allgather). Each is sent
    behind its length and padded to 8 bytes, so past 2 GiB in all (a rank-0 resume's state)
    MPI's int counts still fit in units of 8."""
    pad = -len(data) % 8
    payload = torch.frombuffer(bytearray(len(data).to_bytes(8, "little") + data + bytes(pad)),
                               dtype=torch.uint8).clone()
    buf = transport.wait(transport.allgather_async(payload, name)).cpu().numpy().tobytes()
    out, pos = [], 0
    for _ in range(transport.size()):
        n = int.from_bytes(buf[pos:pos + 8], "little")
        out.append(buf[pos + 8:pos + 8 + n])
        pos += 8 + n + (-n % 8)
    return out


#: compared first: the options decide how tensors share buckets, so a rank with another
#: method differs in its buckets too, and the method is the cause to name
FIRST = ("world_size", "optimizer", "options", "compression")


def _first_difference(a, b, path=""):
    if type(a) is not type(b):
        return path or "<root>", a, b
    if isinstance(a, dict):
        keys = list(dict.fromkeys(list(a) + list(b)))
        if not path:
            keys = [k for k in FIRST if k in keys] + [k for k in keys if k not in FIRST]
        for k in keys:
            if k not in a or k not in b:
                return f"{path}.{k}".lstrip("."), a.get(k, "<missing>"), b.get(k, "<missing>")
            d = _first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path} (length)", len(a), len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else (path.lstrip("."), a, b)


def raise_config_mismatch(transport, text: bytes, other_optimizer: bool = False) -> None:
    """After digests differed (on every rank): gather the descriptions and raise, naming the
    first difference. ``other_optimizer``: the optimizers' fingerprints differed too, so the
    ranks may also be at the exchanges of different DistributedOptimizers."""
    texts = _gather_bytes(transport, text, "hvd_sparse.config.full")
    descs = [json.loads(t) if t else {} for t in texts]
    hint = (" Or, with several DistributedOptimizers, the ranks are at the first exchanges of "
            f"different ones: {SAME_ORDER}.") if other_optimizer else ""
    for r in range(1, len(descs)):
        diff = _first_difference(descs[0], descs[r])
        if diff:
            where, a, b = diff
            raise ConfigMismatchError(
                f"ranks disagree before the first exchange: '{where}' is {a!r} on rank 0 but "
                f"{b!r} on rank {r}. Every rank must build the same model (names, shapes, "
                "dtypes, listed in the same order) and pass the same hvd_sparse options." + hint)
    raise ConfigMismatchError("ranks disagree on the optimizer's configuration." + hint)


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers that change with any bit of ``t``: a plain and a position-weighted sum
    of its bit patterns (no floating-point rounding involved)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.int64)
    size = flat.element_size()
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    bits = flat.view(int_type).to(torch.int64).cpu()
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64) % 65521
    return torch.stack([bits.sum(), (bits * weights).sum()])


def verify_replicas(transport, named_tensors, step: int) -> None:
    """Compare checksums of ``named_tensors`` across ranks; raise naming the first mismatch."""
    names = [n for n, _ in named_tensors]
    local = torch.stack([checksum(t) for _, t in named_tensors]) if names else \
        torch.zeros((0, 2), dtype=torch.int64)
    raw = local.contiguous().view(torch.uint8).reshape(-1)
    gathered = transport.wait(transport.allgather_async(raw, "hvd_sparse.verify")).cpu()
    table = gathered.view(torch.int64).view(transport.size(), len(names), 2)
    for i, name in enumerate(names):
        ranks = [r for r in range(transport.size()) if not torch.equal(table[r, i], table[0, i])]
        if ranks:
            raise ReplicaDivergenceError(
                f"replicas diverged by step {step}: '{name}' differs between rank 0 and "
                f"rank(s) {ranks}. Something outside hvd_sparse changed parameters on some "
                "ranks only (a rank-dependent update, unsynchronised initialisation, or "
                "non-deterministic kernels).")
