"""The selection primitives in plain torch: every dtype and device, and the yardstick the
numba and CuPy forms are tested against (same arguments, same results, bit for bit).

Each primitive materialises ``acc = g + r`` and a mask, so this backend makes extra passes and
allocations; it serves what the fast ones do not take (float64, other devices) and the tests.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

name = "torch"


def available() -> bool:
    return True


def _acc(g, r):
    return r if g is None else r + g.to(r.dtype)


class Scan(NamedTuple):
    count: int
    nonfinite: bool
    idx: torch.Tensor
    values: torch.Tensor
    energy: float  # sum of acc^2


def _threshold(t, dtype):
    return torch.tensor(float(t), dtype=dtype)


def scan(g, r, t_hi, t_lo, expect=None) -> Scan:
    acc = _acc(g, r)
    thi, tlo = _threshold(t_hi, acc.dtype).to(acc.device), _threshold(t_lo, acc.dtype).to(acc.device)
    mask = (acc >= thi) | (acc <= -tlo)
    idx = torch.nonzero(mask).squeeze(1)
    return Scan(int(idx.numel()), not bool(torch.isfinite(acc).all()), idx, acc[idx],
                float(acc.double().pow(2).sum()))


def gather(g, r, s: Scan):
    return s.idx, s.values


_device_positions = {}


def _positions_on(positions: np.ndarray, device) -> torch.Tensor:
    """``positions`` as an index tensor on ``device``, copied once per array and device (the
    samplers pass the same cached array every step; the entry keeps the array alive, so its
    id cannot be reused while cached)."""
    if device.type == "cpu":
        return torch.from_numpy(positions)
    key = (id(positions), str(device))
    hit = _device_positions.get(key)
    if hit is None or hit[0] is not positions:
        if len(_device_positions) > 512:
            _device_positions.clear()
        hit = _device_positions[key] = (positions, torch.from_numpy(positions).to(device))
    return hit[1]


def sample(g, r, positions: np.ndarray) -> np.ndarray:
    pos = _positions_on(positions, r.device)
    out = r[pos] if g is None else r[pos] + g[pos].to(r.dtype)
    return out.cpu().numpy()


def kth_magnitude(g, r, k: int):
    """The exact k-th largest ``|acc|`` (any ``t`` with at least k entries at or above it and
    no more than the k-th's bin serves the callers; the exact value is such a ``t``)."""
    mag = _acc(g, r).abs()
    return torch.topk(mag, k, sorted=False).values.min().item()


def pick_topk(cidx, cval, k, sign=0):
    """The k largest candidates by ``|v|`` (or ``sign * v``), ties by lowest index, in index order.

    No sort: the exact k-th largest score (a selection), every candidate above it, and the
    first of those equal to it, counted in index order (candidates come in index order)."""
    score = cval.abs() if sign == 0 else (cval if sign > 0 else -cval)
    if k >= score.numel():
        return cidx, cval
    kth = torch.topk(score, k, sorted=False).values.min()
    above = score > kth
    tied = score == kth
    keep = above | (tied & (torch.cumsum(tied, 0) <= k - above.sum()))
    where = nonzero_k(keep, k)
    return cidx[where], cval[where]


_STATIC_NONZERO = {"ok": hasattr(torch, "nonzero_static")}


def nonzero_k(mask, k, fill_value=None):
    """Positions of the ``k`` set entries of a flat ``mask``; no host read where torch offers
    it on the device (``nonzero_static``: a torch without its CUDA kernel raises, once, and
    the counted form, one host read, is taken from then on). With ``fill_value``, ``mask``
    may hold fewer than ``k`` set entries: the positions are padded with it to ``k``."""
    if mask.device.type != "cpu" and _STATIC_NONZERO["ok"]:
        try:
            if fill_value is None:
                return torch.nonzero_static(mask, size=k).reshape(-1)
            return torch.nonzero_static(mask, size=k, fill_value=fill_value).reshape(-1)
        except (NotImplementedError, RuntimeError):
            _STATIC_NONZERO["ok"] = False
    where = torch.nonzero(mask).reshape(-1)
    if fill_value is None:
        return where
    if where.numel() >= k:
        return where[:k]
    pad = torch.full((k - where.numel(),), fill_value, dtype=where.dtype, device=where.device)
    return torch.cat([where, pad])



def commit(g, r, idx, remainder, zero_grad=False) -> None:
    """``r += g`` (then ``g = 0`` when asked), and ``r[idx] = remainder``."""
    if g is not None:
        r.add_(g.to(r.dtype))
        if zero_grad:
            g.zero_()
    if idx.numel():
        r[idx] = remainder.to(r.dtype)


def scatter_add(target, idx, vals, scale: float) -> None:
    """``target[idx] += vals * scale`` (indices unique within one call)."""
    vals = vals.to(device=target.device, dtype=target.dtype)
    target.index_add_(0, idx.to(device=target.device, dtype=torch.int64),
                      vals * scale if scale != 1.0 else vals)


def set_at(target, idx, vals) -> None:
    """``target[idx] = vals``."""
    target[idx.to(device=target.device, dtype=torch.int64)] = vals.to(target.dtype)


def support_sum(payloads, scale: float, dtype, device, scratch=None):
    """The aggregate's values on the union of the payloads' positions, summed in rank order
    (``scratch``, a full-length zero buffer some backends ask for, is not needed here)."""
    nonempty = [p for p in payloads if p.indices.numel()]
    if not nonempty:
        return torch.zeros(0, dtype=dtype, device=device)
    union, inverse = torch.unique(torch.cat([p.indices.to(device) for p in nonempty]),
                                  return_inverse=True)
    out = torch.zeros(union.numel(), dtype=dtype, device=device)
    start = 0
    for p in nonempty:
        m = p.indices.numel()
        vals = p.values.to(device=device, dtype=dtype)
        out.index_add_(0, inverse[start:start + m], vals * scale if scale != 1.0 else vals)
        start += m
    return out


def magnitude_histogram(r, shift: int, bins: int, within_shift: int = 31,
                        within: int = 0) -> torch.Tensor:
    """Counts of ``|r|`` per bin of its float32 bits: bin ``(bits >> shift) % bins`` of the
    entries whose ``bits >> within_shift`` equals ``within``, as float64 on the host."""
    bits = (r.detach().float().contiguous().view(torch.int32) & 0x7FFFFFFF).reshape(-1)
    if within_shift < 31:
        bits = bits[(bits >> within_shift) == within]
    return torch.bincount(((bits >> shift) & (bins - 1)).long(),
                          minlength=bins).double().cpu()
