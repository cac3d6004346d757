"""The sparsifier interface and the exact Top-K primitive every method builds on.

A sparsifier looks at one flat, error-compensated vector and decides which entries to send and
with which values. It does no communication. Methods that need state (adaptive k) keep it per
bucket and direction and expose it through ``state_dict`` so checkpoints carry it; state that must
agree across ranks is derived only from data every rank has (the aggregate, via ``observe``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class SelectionContext:
    """Where a selection happens: which bucket, which step, which rank, which direction."""

    bucket: str
    step: int = 0
    rank: int = 0
    direction: str = "up"  # "up": this rank's uplink; "down": replicated downlink
    # downlink on the CPU: the engine's list of the residual's positions that can be chosen
    # (:class:`~hvd_sparse.kernels.watch.ResidualWatch`), for methods that can use it; a method
    # that hands it to a selection must return that selection unchanged (the list assumes it)
    watch: Optional[object] = field(default=None, compare=False, repr=False)
    # a bucket of several tensors under ``layer_floor`` > 0: each tensor's (start, end) in the
    # bucket, and the fraction of its own Top-K each keeps (methods that take it, see
    # ``supports_layer_floor``; :mod:`hvd_sparse.sparsifiers.layer_floor`)
    segments: Optional[Tuple[Tuple[int, int], ...]] = None
    layer_floor: float = 0.0
    # the configured density of this direction, where this step's is on a warm-up's or a
    # cool-down's schedule instead (None: the density given is the configured one); a method
    # that plans a budget over the run plans it at this density
    base_density: Optional[float] = None

    @property
    def floored(self) -> bool:
        return self.layer_floor > 0 and self.segments is not None and len(self.segments) > 1


def k_for_density(numel: int, density: float) -> int:
    """Entries kept for a given density: ceil(density * n), at least one, at most n.

    Depends only on (numel, density), so every rank derives the same k for the same bucket.
    The product's rounding is forgiven: ``0.07 * 100`` is 7.000000000000001 in floating
    point, whose ceiling would keep 8 entries where 7 are asked for.
    """
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(density * numel * (1.0 - 1e-12))))


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact Top-K by magnitude with ties broken by lowest index; indices sorted ascending.

    ``torch.topk`` alone does not define which of several equal magnitudes it keeps, which would
    let replicas choose differently. Here the k-th largest magnitude ``t`` is found first, then
    every entry above ``t`` is kept together with the lowest-index entries equal to ``t``: the
    result is a function of the values only.
    """
    return topk_of(x.abs(), k)


def topk_of(mag: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_indices` on precomputed non-negative scores (largest first, lowest index)."""
    n = mag.numel()
    if k >= n:
        return torch.arange(n, device=mag.device, dtype=torch.int64)
    if k <= 0:
        return torch.empty(0, device=mag.device, dtype=torch.int64)
    t = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero(mag > t).squeeze(1)
    missing = k - above.numel()
    if missing > 0:
        ties = torch.nonzero(mag == t).squeeze(1)[:missing]
        above = torch.cat([above, ties])
    return torch.sort(above).values


def threshold_indices(x: torch.Tensor, threshold) -> torch.Tensor:
    """Positions with ``|x| >= threshold``, ascending."""
    return torch.nonzero(x.abs() >= threshold).squeeze(1)


class Sparsifier:
    """Base class. Subclass and implement :meth:`select`; override :meth:`compress` to send
    values other than the selected entries themselves (as SBC does)."""

    name = "base"
    #: the payload carries one value for all positions (SBC) instead of one value per position
    constant_value = False
    #: the method honours ``SelectionContext.layer_floor`` (a per-tensor floor in a bucket)
    supports_layer_floor = False
    #: whether an entry is chosen by its own value alone (a fixed threshold): a bucket of
    #: several tensors then selects exactly what one bucket per tensor would
    elementwise = False

    def select(self, acc: torch.Tensor, density: float, ctx: SelectionContext) -> torch.Tensor:
        """Return int64 positions (ascending, unique) of the entries of ``acc`` to send."""
        raise NotImplementedError

    def compress(self, acc: torch.Tensor, density: float,
                 ctx: SelectionContext) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return (positions, values to send). Default: the selected entries as they are."""
        idx = self.select(acc, density, ctx)
        return idx, acc[idx]

    def fused(self, ops, grad: Optional[torch.Tensor], residual: torch.Tensor, density: float,
              ctx: SelectionContext):
        """This method over ``acc = grad + residual`` with a backend's selection primitives
        (:mod:`hvd_sparse.kernels.select`), reading without writing: a
        :class:`~hvd_sparse.kernels.Selection`, or ``None`` where the method has no such form
        (the engine then runs :meth:`compress` on the accumulated residual). ``grad`` is
        ``None`` on the downlink. Must equal :meth:`compress` on ``acc`` exactly."""
        return None

    def target_count(self, numel: int, density: float, ctx: SelectionContext) -> Optional[int]:
        """The count this method aims at for a bucket (``None`` when it has no fixed target)."""
        return k_for_density(numel, density)

    #: the engine calls :meth:`observe` only for methods that set this
    observes = False

    def observe(self, aggregate: torch.Tensor, ctx: SelectionContext) -> None:
        """See the step's aggregated gradient, as the values of its non-zero support (identical
        on every rank; the positions do not matter to any method here). Default: ignore it."""

    def state_dict(self) -> dict:
        """Algorithm state that must survive a checkpoint (none for stateless methods)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
