"""What the engine keeps per bucket between steps, and what it keeps while a bucket is in flight."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np
import torch

from ..aggregation import accumulation_dtype
from ..dgc import MomentumCorrection
from ..feedback import Residual
from ..kernels.watch import ResidualWatch


@dataclass
class BucketState:
    """One bucket's memory: residuals (uplink: this rank's; downlink: replicated), the
    momentum-correction velocity, the communication-delay anchor, and the cost model's choice."""

    uplink: Residual
    downlink: Residual
    velocity: Optional[MomentumCorrection] = None
    anchor: Optional[torch.Tensor] = None
    mode: str = "sparse"  # the cost model's choice for a sparse-capable bucket: sparse or dense
    scratch: Optional[torch.Tensor] = None  # reused flat buffer (multi-parameter gradients)
    support_scratch: Optional[torch.Tensor] = None  # all zeros between steps (adaptive k)
    costs: Dict[str, float] = field(default_factory=dict)  # the last decision's inputs
    # sharded exchange: the residual of the region this rank owns, and the (world size, rank,
    # bounds) it was made for; "auto" keeps its per-bucket choice of collective here
    shard: Optional[Residual] = None
    shard_layout: Optional[tuple] = None
    collective: str = "allgather"
    # index_coding="auto": the positions' code the cost model chose (plain until it has)
    index_coding: str = "plain"
    region_scratch: Optional[torch.Tensor] = None  # sharded, unidirectional: the region's sum
    # replicated: the region bounds (None: equal regions) and the load counted since the last
    # check, per position bin (sharded.load_counts of the gathered downlink positions)
    bounds: Optional[tuple] = None
    load: Optional[torch.Tensor] = None
    # the downlink residual's positions that can be selected next (exact re-selection
    # without a scan, numba backend); rebuilt by one scan whenever it cannot be trusted
    watch: ResidualWatch = field(default_factory=ResidualWatch)
    # acc written by the uplink scan of a one-parameter bucket (Engine._accumulating), which
    # swaps with the residual at the commit; not state: no information between steps
    spare: Optional[torch.Tensor] = None
    # (flat buffer, its views in the parameters' shapes) for whole-gradient copies
    shaped_views: Optional[tuple] = None
    sums: Optional[torch.Tensor] = None  # a dense bucket's rank-order sum (gather, regions)
    param_edges: Optional[np.ndarray] = None  # where each parameter starts, then the length
    edges_tensor: Optional[torch.Tensor] = None  # the same on the selection's device

    @classmethod
    def for_bucket(cls, b, momentum_correction: float) -> "BucketState":
        dtype = accumulation_dtype(b.dtype)
        return cls(Residual(b.numel, dtype), Residual(b.numel, dtype),
                   MomentumCorrection(momentum_correction) if momentum_correction else None)

    def edges(self, offsets, numel) -> np.ndarray:
        """The parameters' start offsets in the flat bucket, then its length (int64), made
        once: what :func:`~hvd_sparse.kernels.cpu.group` splits a selection by."""
        if self.param_edges is None:
            self.param_edges = np.array(list(offsets) + [numel], dtype=np.int64)
        return self.param_edges

    def edges_on(self, offsets, numel, like: torch.Tensor) -> torch.Tensor:
        """:meth:`edges` as a tensor of ``like``'s dtype on its device, kept across steps
        (no host-to-device copy per step)."""
        t = self.edges_tensor
        if t is None or t.device != like.device or t.dtype != like.dtype:
            t = torch.from_numpy(self.edges(offsets, numel)).to(like.device, like.dtype)
            self.edges_tensor = t
        return t

    def shaped(self, flat, b) -> list:
        """``flat`` cut into views of the parameters' shapes (kept while ``flat`` is the same
        buffer): every gradient of a bucket then goes in or out in one ``torch._foreach_copy_``,
        not a Python-level slice, reshape and copy per parameter (~15 us each, which on a
        404-tensor model sent dense cost 9 ms a step)."""
        v = self.shaped_views
        if v is None or v[0] is not flat:
            views = [flat[off:off + p.numel()].view(p.shape)
                     for p, off in zip(b.params, b.offsets)]
            if flat is not self.scratch:
                return views
            self.shaped_views = v = (flat, views)
        return v[1]

    def sum_buffer(self, numel, dtype, device) -> torch.Tensor:
        """Where a dense bucket's rank-order sum is written, kept across steps on the CPU: a
        fresh tensor per step cost as much as the additions there (its pages are touched
        anew; 2.6 against 1.5 ms for 4 x 2.85M float32 entries). On a GPU the caching
        allocator reuses memory across buckets, so nothing is kept."""
        if torch.device(device).type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        s = self.sums
        if s is None or s.dtype != dtype or s.device != device or s.numel() != numel:
            self.sums = s = torch.empty(numel, dtype=dtype, device=device)
        return s

    def flat_buffer(self, numel, dtype, device) -> torch.Tensor:
        """A flat buffer kept across steps (no full-size allocation per step)."""
        s = self.scratch
        if s is None or s.dtype != dtype or s.device != device or s.numel() != numel:
            self.shaped_views = None  # (they would keep the old buffer alive)
            self.scratch = s = torch.empty(numel, dtype=dtype, device=device)
        return s


@dataclass
class InFlight:
    """A bucket whose exchange has been launched and not yet finished."""

    kind: str  # "sparse" (allgather of payloads), "sharded" (all-to-all of them), "dense"
    # (allreduce), "dense_gather"
    handle: Any
    ctx: Any  # the value codec's context
    nbytes: int  # this rank's bytes on the wire
    sparse_grads: frozenset  # ids of parameters whose gradient is handed back sparse
    selected: int
    target: Optional[int]
    error: Optional[torch.Tensor] = None  # ||residual||^2 after selection
    # deferred uplink residual update: (ops, grad, selection, sent, acc written by the scan or
    # None)
    commit: Any = None
    zeroed: bool = False  # the uplink commit zeroed p.grad in its pass
    own_bytes: int = 0  # sharded: the part of this rank's all-to-all that stays with it
    positions: Any = None  # allgather: the positions this rank sent (its payload's, known)
