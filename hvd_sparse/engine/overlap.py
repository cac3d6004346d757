"""The uplink commit, computed while this rank waits for its collectives (numba backend).

Nothing is written after the uplink scan until every rank's payload has said "finite": a NaN
anywhere must leave every residual as it was. On a CPU the rank then sits in
``collective_wait`` and only afterwards makes its commit pass (``residual += grad``, a read
of both and a write). Instead, while a collective it waits for is not complete, the engine
computes ``acc = grad + residual`` into a spare buffer, a piece at a time between
non-blocking tests of that collective. Once every verdict is in, the commit is the O(k)
write of the selected positions and an exchange of buffers (the old residual becomes the next
spare); a NaN verdict leaves the spare unused and the residual untouched. The bits are the
in-place commit's (IEEE addition commutes). A bucket whose pass was not started in the wait
is committed in place as before, and one that was started is completed first.

Where the gradient was already copied into a buffer of the engine's own (a multi-parameter
bucket's concatenation, or the weight change of ``exchange="update"``), ``acc`` is written
there and that buffer swaps with the residual: no extra memory. A one-parameter bucket whose
gradient is ``p.grad`` itself costs one spare buffer (allocated on first use) and, where
``p.grad`` must be zeroed for the downlink write, a separate fill after the verdict instead of
zeroes written in the commit pass. It is on where a rank has a core to spare (see
:func:`enabled`); ``HVD_SPARSE_COMMIT_AHEAD=on`` or ``off`` decides instead.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List

import torch

from .. import core_sharing
from ..kernels import cpu

#: entries per piece of work between two tests of a collective (about a millisecond)
PIECE = 1 << 20


def enabled(environ=os.environ) -> bool:
    """``HVD_SPARSE_COMMIT_AHEAD``: ``on``, ``off``, or ``auto`` (default): on where this rank
    has a core to spare beside its training thread. Where it has not, the wait is not idle
    time: Horovod's background thread (or the other ranks) need the core to move the data,
    and the pieces only delay the collective. On the 2-core development machine with 2 ranks
    (1 Gbit/s, mlp11m) the step took 402 and 448 ms with it against 346 and 372 ms without."""
    mode = environ.get("HVD_SPARSE_COMMIT_AHEAD", "auto")
    if mode in ("on", "off"):
        return mode == "on"
    return core_sharing.cores_per_rank(core_sharing.local_size(environ) or 1) >= 2


class _Pending:
    __slots__ = ("state", "grad", "residual", "in_place", "done")

    def __init__(self, state, grad, residual, in_place):
        self.state, self.grad, self.residual = state, grad, residual
        self.in_place, self.done = in_place, 0


class CommitAhead:
    """Pieces of the uplink commits of one step, done in the order the commits will come."""

    def __init__(self):
        self._order: List[int] = []
        self._pending: Dict[int, _Pending] = {}

    def add(self, index: int, state, grad: torch.Tensor, residual: torch.Tensor,
            in_place: bool = False) -> None:
        """Plan bucket ``index``: ``grad + residual`` into ``state.spare``, or into ``grad``
        itself when ``in_place`` (a buffer of the engine's own that nothing reads again, such
        as a multi-parameter bucket's concatenated gradient or a weight change)."""
        self._order.append(index)
        self._pending[index] = _Pending(state, grad, residual, in_place)

    def __bool__(self) -> bool:
        return bool(self._order)

    def work(self, busy: Callable[[], bool], clock) -> None:
        """Pieces of work while ``busy()`` says the awaited collective is not complete; each
        piece is timed as its bucket's ``uplink_commit`` (it is the same work, moved)."""
        while self._order and busy():
            index = self._order[0]
            with clock.stage("uplink_commit", index):
                if self._piece(self._pending[index]):
                    self._order.pop(0)

    def take(self, index: int):
        """Bucket ``index``'s ``acc`` in its spare, completed; ``None`` if no piece was done
        (then the caller commits in place)."""
        p = self._pending.pop(index, None)
        if index in self._order:
            self._order.remove(index)
        if p is None or p.done == 0:
            return None
        while not self._piece(p, p.residual.numel()):
            pass
        return p.grad if p.in_place else p.state.spare

    @staticmethod
    def _piece(p: _Pending, size=None) -> bool:
        n = p.residual.numel()
        out = p.grad if p.in_place else p.state.spare
        if out is None or out.numel() != n or out.dtype != p.residual.dtype \
                or out.device != p.residual.device:
            p.state.spare = out = torch.empty_like(p.residual)
        hi = min(n, p.done + (PIECE if size is None else size))
        cpu.add_into(p.grad, p.residual, out, p.done, hi)
        p.done = hi
        return hi == n
