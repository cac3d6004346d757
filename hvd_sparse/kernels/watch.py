"""Exact downlink re-selection without a scan: track the few positions that can be chosen.

Between two downlink selections the replicated residual changes only where the step's P
payloads land (the selected entries are then zeroed). So the engine keeps, per bucket, a
*bound* and the short list of positions at or above it (with their values): every other entry
is strictly below the bound. A Top-K needs only the union of that list with the payloads'
positions, as long as at least k of them reach the bound: then no entry outside can beat, or
tie with, the k-th. A hard threshold at or above the bound needs only the payloads' positions;
GaussianK runs its own steps over the candidates while its thresholds stay at or above it.
SBC keeps a bound per sign (it needs each sign's k largest; see :meth:`ResidualWatch.sbc`).
The work per step is O(P k) instead of a pass over the whole residual; where the condition
fails (a young or reloaded residual, k grown past the list) one ordinary scan decides and
refills the list.

The answer is the scan's answer bit for bit (same entries, same ties by lowest index), so a
rank whose list was lost (a resumed or joining worker) stays identical to the others without
the list being checkpointed or agreed. The list is trusted only while the residual is the same
tensor at the same version (torch counts in-place writes) and nothing but the engine's
scatter and commit wrote it; numba's writes bypass that counter, so the engine brackets each
step with :meth:`ResidualWatch.begin` and :meth:`ResidualWatch.end`.
"""
from __future__ import annotations

import weakref
from typing import Optional

import numpy as np
import torch

from . import cpu
from . import select

#: the list is trimmed (the bound raised) when it grows past this many times k
TRIM_FACTOR = 2
#: a candidate costs about this many entries of a scan (merging, selecting among them and
#: keeping the list, against a streaming pass; numba, one core): with more candidates than
#: n / SCAN_RATIO the scan is the cheaper way, and the list is not kept
SCAN_RATIO = 10


class ResidualWatch:
    """The positions of one downlink residual that may be selected next, for the numba
    backend. Counters ``incremental`` and ``scanned`` say how often each path served."""

    def __init__(self):
        # the residual tensor the list describes, weakly: a bucket that goes dense releases it
        self.buffer = None
        self.version = None
        # the listed entries with |r| >= bound, as (int64 positions, float32 values) parts,
        # each in no order, no position in two of them (None: unknown); kept in the parts
        # the selection made (a copy of millions of entries into one array cost more than
        # the rest of an SBC step at 100M entries)
        self.parts = None
        self.bound = None  # every other entry has r < bound ...
        self.bound_neg = None  # ... and r > -bound_neg (the same, but after SBC's steps)
        self.mark = None  # an all-zero bit set over the positions, reused every step
        self.touched = []  # (positions, values after the write) per payload, in rank order
        self.nonfinite = False
        self.used = False
        self.incremental = 0
        self.scanned = 0

    @property
    def idx(self) -> Optional[np.ndarray]:
        """The listed positions in one array (None: unknown), for tests and diagnostics."""
        return None if self.parts is None else _joined(self.parts)[0]

    @property
    def val(self) -> Optional[np.ndarray]:
        """Their values, in the same order."""
        return None if self.parts is None else _joined(self.parts)[1]

    # ----------------------------------------------------------------- the engine's side
    def begin(self, residual: torch.Tensor, fresh: bool) -> "ResidualWatch":
        """Before the payloads are scattered: keep the list only if ``residual`` is the tensor
        it describes and was not written since (``fresh``: just allocated, all zeros)."""
        if fresh:
            self._set(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), select.tiny())
        elif self.buffer is None or self.buffer() is not residual \
                or residual._version != self.version:
            self.parts = None
        self.buffer = weakref.ref(residual)
        self.touched = []
        self.nonfinite = False
        self.used = False
        return self

    def scatter(self, ops, residual, indices, values, scale) -> None:
        """The engine's scatter of one payload, in rank order, noting the positions written
        and their new values."""
        now, bad = ops.scatter_add(residual, indices, values, scale, read=True)
        self.touched.append((indices.numpy(), now))
        self.nonfinite |= bad

    def end(self, residual: torch.Tensor) -> None:
        """After the selection was committed: remember the version, or forget the list when
        the method did not keep it up to date."""
        if not self.used or self.parts is None:
            self.parts = None
            self.buffer = None
        else:
            self.version = residual._version
        self.touched = []

    # ----------------------------------------------------------------- the methods' side
    def topk(self, ops, r: torch.Tensor, k: int) -> select.Selection:
        if self._start():
            return select._empty(r, True)
        n = r.numel()
        cheap = self._cheap(n)
        if self.parts is not None and 0 < k < n and cheap:
            mark = self._marks(n)
            bound = self._sym()
            cidx, cval = cpu.candidates(self._newest_first(), bound, mark)
            if cidx.size >= k:  # k of them reach the bound: nothing outside can compete
                idx, val, rest_idx, rest_val = cpu.pick_unordered(cidx, cval, k)
                self._keep(rest_idx, rest_val, bound, k)
                self.incremental += 1
                val = torch.from_numpy(val)
                return select.Selection(torch.from_numpy(idx), val, val, ordered=False)
        sel, cidx, cval, t = select.topk_scanned(ops, None, r, k)
        self.scanned += 1
        if sel.nonfinite or cidx is None or not cheap:
            self.parts = None
        else:
            self._keep(*cpu.outside(cidx.numpy(), cval.numpy(), sel.idx.numpy(),
                                    self._marks(n)), max(np.float32(t), select.tiny()), k)
        return sel

    def threshold(self, ops, r: torch.Tensor, t) -> select.Selection:
        if self._start():
            return select._empty(r, True)
        t = np.float32(t)
        if self.parts is not None and select.tiny() <= self._sym() <= t \
                and self._cheap(r.numel()):
            # every entry outside is below the bound, hence below t: only the list and the
            # touched positions can be selected
            mark = self._marks(r.numel())
            idx, val = (torch.from_numpy(a) for a in
                        cpu.candidates(self._newest_first(), t, mark))
            self._set(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), t)
            self.incremental += 1
            return select.Selection(idx, val, val, ordered=False)
        sel = select.threshold(ops, None, r, t)
        self.scanned += 1
        if sel.nonfinite or t < select.tiny():
            self.parts = None
        else:  # everything at or above t was taken: the rest lies below it
            self._set(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), t)
        return sel

    def sbc(self, ops, r: torch.Tensor, k: int) -> Optional[select.Selection]:
        """SBC from the list, whose bounds are kept per sign (:meth:`_sbc_listed`), else by a
        scan that refills the list with its candidates and its two thresholds as bounds."""
        if self._start():
            return select._empty(r, True)
        n = r.numel()
        if not select.sbc_fits(n, k):  # the plain path: the list is not kept
            self.parts = None
            return select.sbc(ops, None, r, k)
        cheap = self._cheap(n)
        if self.parts is not None and cheap:
            sel = self._sbc_listed(k, n)
            if sel is not None:
                self.incremental += 1
                return sel
        sel, cidx, cval, bounds = select.sbc_scanned(ops, None, r, k)
        self.scanned += 1
        if sel is None or sel.nonfinite or cidx is None or not cheap:
            # (a non-finite scan has no bounds: the caller's plain path answers; the scan's
            # float32 sum of squares also flags finite entries past 1e19)
            self.parts = None
        else:
            t_pos, t_neg = bounds
            idx, val = cpu.outside(cidx.numpy(), cval.numpy(), sel.idx.numpy(), self._marks(n))
            pi, pv, ni, nv = cpu.split_sides(idx, val)
            floor = select.tiny()
            self._relist([(pi, pv)], [(ni, nv)], sel, max(t_pos, floor), max(t_neg, floor), k)
        return sel

    def _sbc_listed(self, k, n) -> Optional[select.Selection]:
        """SBC's answer from the candidates, or None when they cannot give it. A side's k
        largest lie among them when at least k reach its bound (every entry outside is
        below it), or all of that sign do when its bound is the floor. A side short of that
        may hold entries outside; it is not needed when the other side is known and its mean
        beats every mean the short side can have."""
        floor = select.tiny()
        hi, lo = self.bound, self.bound_neg
        pi, pv, ni, nv = cpu.candidate_sides(self._newest_first(), hi, self._marks(n), lo)
        pos = _largest_of_side(pi, pv, k) if pv.size >= k or hi <= floor else None
        neg = _largest_of_side(ni, nv, k) if nv.size >= k or lo <= floor else None
        if pos is not None and neg is not None:
            positives = torch.from_numpy(pos[0])
            sel = select.binary_choice(positives, torch.from_numpy(pos[1]),
                                       torch.from_numpy(neg[0]), torch.from_numpy(neg[1]))
            sent_positive = sel.idx is positives
        elif pos is not None or neg is not None:
            known, short, short_bound = (pos, nv, lo) if pos is not None else (neg, pv, hi)
            values = torch.from_numpy(known[1])
            mean = select.binary_mean(values)
            if not abs(mean) > _mean_ceiling(short, short_bound):
                return None
            sent_positive = pos is not None
            sel = select.Selection(torch.from_numpy(known[0]), torch.full_like(values, mean),
                                   values)
        else:
            return None
        # listed next, per sign: the sent side's unsent entries, the other side whole, and at
        # the sent positions what the commit leaves there (acc - mean, of either sign)
        if sent_positive:
            pos_parts = [pos[2:]]
            neg_parts = [neg[:2], neg[2:]] if neg is not None else [(ni, nv)]
        else:
            neg_parts = [neg[2:]]
            pos_parts = [pos[:2], pos[2:]] if pos is not None else [(pi, pv)]
        self._relist(pos_parts, neg_parts, sel, hi, lo, k)
        sel.ordered = False
        return sel

    def _relist(self, pos, neg, sel, bound, bound_neg, k) -> None:
        """The list after an SBC step: ``pos`` and ``neg``, lists of (indices, values) at or
        above ``bound`` and at or below ``-bound_neg``, none of them sent; and what the commit
        leaves at the sent positions. Each sign is trimmed on its own
        (:func:`_trimmed_parts`); the parts stay as they are unless a side is trimmed."""
        li, lv, mi, mv = cpu.split_sides(sel.idx.numpy(), _left(sel))
        pos, bound = _trimmed_parts(pos + [(li, lv)], bound, k)
        neg, bound_neg = _trimmed_parts(neg + [(mi, mv)], bound_neg, k)
        self._set_parts(pos + neg, bound, bound_neg)

    def run(self, ops, r: torch.Tensor, k: int, method) -> select.Selection:
        """Any method written over the primitives (GaussianK) on the watched candidates:
        ``method(ops)`` runs on :class:`_WatchedOps`, whose scans count among the candidates,
        as long as every threshold it asks about is at or above the bound (then the counts are
        exact); otherwise it runs again on ``ops`` with scans, and the list is refilled by the
        next watched Top-K or threshold (or this method's next step, from empty)."""
        if self._start():
            return select._empty(r, True)
        n = r.numel()
        if self.parts is not None and self._cheap(n):
            mark = self._marks(n)
            bound = self._sym()
            cidx, cval = cpu.candidates(self._newest_first(), bound, mark)
            try:
                sel = method(_WatchedOps(ops, cidx, cval, bound))
            except _NeedScan:
                pass
            else:
                if not sel.nonfinite:
                    self._keep(*cpu.outside(cidx, cval, sel.idx.numpy(), mark), bound, k)
                    self.incremental += 1
                    sel.ordered = False
                    return sel
        sel = method(ops)
        self.scanned += 1
        if sel.nonfinite or sel.fallback:
            self.parts = None
        else:  # everything at or above its last threshold was taken; the rest lies below
            t = np.float32(np.abs(sel.values.numpy()).min()) if sel.idx.numel() else None
            if t is None or t < select.tiny():
                self.parts = None
            else:
                self._set(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), t)
        return sel

    # ----------------------------------------------------------------- the list
    def _start(self) -> bool:
        """A method takes the watch; True when this step's payloads held NaN/Inf (then the
        selection is empty, as a scan's would be, and the list is forgotten)."""
        self.used = True
        if self.nonfinite:
            self.parts = None
        return self.nonfinite

    def _cheap(self, n) -> bool:
        """Would the list and this step's payloads cost less than a scan?"""
        listed = 0 if self.parts is None else sum(i.size for i, _ in self.parts)
        return (listed + sum(i.size for i, _ in self.touched)) * SCAN_RATIO < n

    def _newest_first(self):
        return self.touched[::-1] + self.parts

    def _marks(self, n):
        if self.mark is None or self.mark.size != (n + 63) // 64:
            self.mark = cpu.position_marks(n)
        return self.mark

    def _set(self, idx, val, bound, bound_neg=None) -> None:
        self._set_parts([(idx, val)], bound, bound_neg)

    def _set_parts(self, parts, bound, bound_neg=None) -> None:
        self.parts = [(i, v) for i, v in parts if i.size]
        self.bound = np.float32(bound)
        self.bound_neg = self.bound if bound_neg is None else np.float32(bound_neg)

    def _sym(self) -> np.float32:
        """One bound for both signs: every entry outside the list has ``|r|`` below it."""
        return max(self.bound, self.bound_neg)

    def _keep(self, idx, val, bound, k) -> None:
        """The unselected entries at or above ``bound``, trimmed (:func:`_trimmed`)."""
        self._set(*_trimmed(idx, val, bound, k))


class _NeedScan(Exception):
    """A threshold below the bound: the candidates cannot answer, a scan must."""


class _WatchedOps:
    """The selection primitives over the watched candidates (all ``|v| >= bound``, every
    other entry below it): scans count and collect among them, exact for thresholds at or above
    the bound; anything else raises :class:`_NeedScan`. Candidates come in no order, so Top-K
    among them breaks ties by index with :func:`cpu.pick_unordered`."""

    def __init__(self, ops, cidx, cval, bound):
        self.ops, self.cidx, self.cval, self.bound = ops, cidx, cval, bound

    def sample(self, g, r, positions):
        return self.ops.sample(None, r, positions)

    def scan(self, g, r, t_hi, t_lo, expect=None):
        t_hi, t_lo = np.float32(t_hi), np.float32(t_lo)
        if min(t_hi, t_lo) < self.bound:
            raise _NeedScan
        take = (self.cval >= t_hi) | (self.cval <= -t_lo)
        idx, val = torch.from_numpy(self.cidx[take]), torch.from_numpy(self.cval[take])
        return cpu.Scan(int(idx.numel()), False, None, idx, val, True, None)

    def gather(self, g, r, s):
        return s.idx, s.values

    def kth_magnitude(self, g, r, k):
        raise _NeedScan

    def pick_topk(self, cidx, cval, k, sign=0):
        if sign:
            raise _NeedScan
        if k >= cval.numel():
            return cidx, cval
        if k <= 0:
            return cidx[:0], cval[:0]
        idx, val, _, _ = cpu.pick_unordered(cidx.numpy(), cval.numpy(), k)
        return torch.from_numpy(idx), torch.from_numpy(val)


def _trimmed(idx, val, bound, k):
    """A list past TRIM_FACTOR * k entries cut to those at or above the k-th largest magnitude,
    which becomes its bound (the entries dropped are below it): (indices, values, bound)."""
    if idx.size > TRIM_FACTOR * k + 1024:
        return cpu.largest(idx, val, k, bound)
    return idx, val, bound


def _trimmed_parts(parts, bound, k):
    """:func:`_trimmed` over (indices, values) parts, joined only when they are trimmed:
    (parts, bound)."""
    if sum(i.size for i, _ in parts) > TRIM_FACTOR * k + 1024:
        idx, val, bound = cpu.largest(*_joined(parts), k, bound)
        return [(idx, val)], bound
    return parts, bound


def _joined(parts):
    """(indices, values) parts as one pair of arrays."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
    return np.concatenate([i for i, _ in parts]), np.concatenate([v for _, v in parts])


def _largest_of_side(idx, val, k):
    """The k largest magnitudes of one sign's candidates (any order; ties by lowest index), or
    all of them when there are at most k: (indices, values, the others' indices, values)."""
    if val.size <= k:
        return idx, val, idx[:0], val[:0]
    return cpu.pick_unordered(idx, val, k)


def _left(sel) -> np.ndarray:
    """What the commit leaves at SBC's sent positions (acc - mean, as :func:`select.commit`
    computes it): unlike the other methods' remainder it need not be zero."""
    return (sel.acc_values - sel.values.to(sel.acc_values.dtype)).numpy()


def _mean_ceiling(listed: np.ndarray, bound) -> float:
    """Above any mean SBC can give a side whose entries at or beyond its ``bound`` are
    ``listed`` (fewer than k; the rest of that sign is below the bound): its k largest hold
    those and entries smaller than each of them, and a side with fewer than k takes all it
    has, so the mean never exceeds the listed ones' mean (or the bound, with none listed).
    The slack covers the fixed-point sum's truncation (under one unit of 2**-37 of the peak)
    and float64 rounding."""
    if listed.size == 0:
        return float(bound)
    mags = np.abs(listed.astype(np.float64))
    return float(mags.sum() / mags.size) * (1 + 1e-9) + float(mags.max()) * 2.0 ** -30
