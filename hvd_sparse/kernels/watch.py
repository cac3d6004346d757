"""Exact downlink re-selection without a scan: track the few positions that can be chosen.

Between two downlink selections the replicated residual changes only where the step's P
payloads land (the selected entries are then zeroed). So the engine keeps, per bucket, a
*bound* and the short list of positions at or above it (with their values): every other entry
is strictly below the bound. A Top-K needs only the union of that list with the payloads'
positions, as long as at least k of them reach the bound: then no entry outside can beat, or
tie with, the k-th. A hard threshold at or above the bound needs only the payloads' positions;
GaussianK runs its own steps over the candidates while its thresholds stay at or above it.
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
        self.idx = None  # int64 positions, in no order, with |r| >= bound (None: unknown)
        self.val = None  # their values
        self.bound = None  # every other entry has |r| < bound
        self.mark = None  # an all-zero bit set over the positions, reused every step
        self.touched = []  # (positions, values after the write) per payload, in rank order
        self.nonfinite = False
        self.used = False
        self.incremental = 0
        self.scanned = 0

    # ----------------------------------------------------------------- the engine's side
    def begin(self, residual: torch.Tensor, fresh: bool) -> "ResidualWatch":
        """Before the payloads are scattered: keep the list only if ``residual`` is the tensor
        it describes and was not written since (``fresh``: just allocated, all zeros)."""
        if fresh:
            self._set(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), select.tiny())
        elif self.buffer is None or self.buffer() is not residual \
                or residual._version != self.version:
            self.idx = None
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
        if not self.used or self.idx is None:
            self.idx = None
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
        if self.idx is not None and 0 < k < n and cheap:
            mark = self._marks(n)
            cidx, cval = cpu.candidates(self._newest_first(), self.bound, mark)
            if cidx.size >= k:  # k of them reach the bound: nothing outside can compete
                idx, val, rest_idx, rest_val = cpu.pick_unordered(cidx, cval, k)
                self._keep(rest_idx, rest_val, self.bound, k)
                self.incremental += 1
                val = torch.from_numpy(val)
                return select.Selection(torch.from_numpy(idx), val, val, ordered=False)
        sel, cidx, cval, t = select.topk_scanned(ops, None, r, k)
        self.scanned += 1
        if sel.nonfinite or cidx is None or not cheap:
            self.idx = None
        else:
            self._keep(*cpu.outside(cidx.numpy(), cval.numpy(), sel.idx.numpy(),
                                    self._marks(n)), max(np.float32(t), select.tiny()), k)
        return sel

    def threshold(self, ops, r: torch.Tensor, t) -> select.Selection:
        if self._start():
            return select._empty(r, True)
        t = np.float32(t)
        if self.idx is not None and select.tiny() <= self.bound <= t and self._cheap(r.numel()):
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
            self.idx = None
        else:  # everything at or above t was taken: the rest lies below it
            self._set(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), t)
        return sel

    def run(self, ops, r: torch.Tensor, k: int, method) -> select.Selection:
        """Any method written over the primitives (GaussianK) on the watched candidates:
        ``method(ops)`` runs on :class:`_WatchedOps`, whose scans count among the candidates,
        as long as every threshold it asks about is at or above the bound (then the counts are
        exact); otherwise it runs again on ``ops`` with scans, and the list is refilled by the
        next watched Top-K or threshold (or this method's next step, from empty)."""
        if self._start():
            return select._empty(r, True)
        n = r.numel()
        if self.idx is not None and self._cheap(n):
            mark = self._marks(n)
            cidx, cval = cpu.candidates(self._newest_first(), self.bound, mark)
            try:
                sel = method(_WatchedOps(ops, cidx, cval, self.bound))
            except _NeedScan:
                pass
            else:
                if not sel.nonfinite:
                    self._keep(*cpu.outside(cidx, cval, sel.idx.numpy(), mark), self.bound, k)
                    self.incremental += 1
                    sel.ordered = False
                    return sel
        sel = method(ops)
        self.scanned += 1
        if sel.nonfinite or sel.fallback:
            self.idx = None
        else:  # everything at or above its last threshold was taken; the rest lies below
            t = np.float32(np.abs(sel.values.numpy()).min()) if sel.idx.numel() else None
            if t is None or t < select.tiny():
                self.idx = None
            else:
                self._set(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), t)
        return sel

    # ----------------------------------------------------------------- the list
    def _start(self) -> bool:
        """A method takes the watch; True when this step's payloads held NaN/Inf (then the
        selection is empty, as a scan's would be, and the list is forgotten)."""
        self.used = True
        if self.nonfinite:
            self.idx = None
        return self.nonfinite

    def _cheap(self, n) -> bool:
        """Would the list and this step's payloads cost less than a scan?"""
        listed = 0 if self.idx is None else self.idx.size
        return (listed + sum(i.size for i, _ in self.touched)) * SCAN_RATIO < n

    def _newest_first(self):
        return self.touched[::-1] + [(self.idx, self.val)]

    def _marks(self, n):
        if self.mark is None or self.mark.size != (n + 63) // 64:
            self.mark = cpu.position_marks(n)
        return self.mark

    def _set(self, idx, val, bound) -> None:
        self.idx, self.val, self.bound = idx, val, np.float32(bound)

    def _keep(self, idx, val, bound, k) -> None:
        """The unselected entries at or above ``bound``; past TRIM_FACTOR * k of them the
        bound rises to the k-th largest magnitude (those dropped are below it)."""
        if idx.size > TRIM_FACTOR * k + 1024:
            idx, val, bound = cpu.largest(idx, val, k, bound)
        self._set(idx, val, bound)


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
