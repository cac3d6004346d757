"""The exchange engine: one bucket's trip through the sparse pipeline, in data-flow order.

    uplink (when a bucket's gradients are ready)
      gradient   read p.grad where it lies (a flat buffer only for multi-parameter buckets)
      select     one scan of acc = grad + residual: candidates, NaN/Inf, energy; on CPU it
                 also writes acc into a buffer of its own (the residual is not written)
      encode     header | indices | values, one payload per bucket
      collective allgather, named from the bucket; the residual is not written yet
    finish (from synchronize / step)
      wait, decode     P payloads in rank order; a NaN flag from any rank stops here, with
                       every residual exactly as it was
      commit uplink    residual = acc, minus what was sent (on CPU an O(k) write and a buffer
                       swap, else one pass)
      aggregate        payloads scattered, in rank order, straight into the downlink residual
      downlink select  one read-only scan of it, then the selected entries taken out
      write            p.grad = zero-fill + scatter of the selected entries (without the
                       downlink selection, the payloads are summed straight into p.grad)

Front ends (the Horovod facade in :mod:`hvd_sparse.optimizer`, :mod:`hvd_sparse.mpi`) hand it
ready buckets and call :meth:`Engine.finish`; they never touch its state directly.
:meth:`Engine.view` is the read-only window for tests, benchmarks and users.
"""
from __future__ import annotations

import io
import os
import warnings
from types import MappingProxyType
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import aggregation, costmodel, kernels, safety, wire
from ..compat import Compression
from ..dgc import clip_local, cooldown_density, warmup_density
from ..kernels import cpu, select as fused, stream
from ..sparsifiers import SelectionContext
from ..stats import CommunicationStats
from . import agreement, dense_regions, sharded
from .calibration import LinkPricing
from .config import EngineConfig
from .flat import all_finite, copy_pieces, write_flat
from .persistence import Checkpointing
from .sharded import ShardedExchange
from .stages import StageClock
from .state import BucketState, InFlight
from .updates import UpdateExchange


class BucketView(NamedTuple):
    """A read-only snapshot of one bucket (tensors are copies)."""

    name: str
    numel: int
    dtype: torch.dtype
    index_dtype: torch.dtype
    sparse: bool
    mode: str
    parameters: tuple
    uplink: Optional[torch.Tensor]
    downlink: Optional[torch.Tensor]
    velocity: Optional[torch.Tensor]
    shard: Optional[torch.Tensor] = None  # sharded exchange: this rank's region residual
    collective: str = "allgather"
    bounds: Optional[tuple] = None  # sharded exchange: the region bounds (P + 1 positions)


def _finite_after_all(accumulating, flat, residual) -> bool:
    """The uplink scan flagged NaN/Inf: is every entry of ``acc`` finite after all? Its check
    is a float32 sum of squares, which also overflows for finite entries of magnitude 1e19
    and above (a rare path: one exact pass over ``acc``, from where the scan wrote it or
    summed again)."""
    if accumulating is not None and accumulating.written:
        acc = accumulating.into
    else:
        acc = flat + residual
    return bool(torch.isfinite(acc).all())


class Engine(ShardedExchange, UpdateExchange, LinkPricing, Checkpointing):
    """Per-bucket sparse exchange with error feedback in both directions (see module doc).

    The data flow is here; the parts that only some configurations use are mixed in from
    their own modules: the sharded collective's regions (:mod:`.sharded`), exchanged weight
    changes (:mod:`.updates`), the time cost model's calibration (:mod:`.calibration`) and
    checkpoints (:mod:`.persistence`)."""

    def __init__(self, config: EngineConfig, buckets, transport):
        self.config = config
        self.wrapped_optimizer = None  # its class name, set by the front end
        self.buckets = list(buckets)
        self.any_sparse = any(b.sparse for b in self.buckets)  # fixed by the plan
        self.transport = transport
        # Backward produces gradients last layer first: launching in that order lets an
        # order-matched transport start early buckets while backward is still running.
        self.launch_order = list(reversed(self.buckets))
        # carried by the engine's own collectives in step() (safety.check_same_exchange)
        self.fingerprint = safety.exchange_fingerprint([b.name for b in self.buckets])
        self.state: Dict[int, BucketState] = {
            b.index: BucketState.for_bucket(b, config.momentum_correction) for b in self.buckets}
        if config.collective == "auto" and transport.size() >= 4 and config.bidirectional:
            # before the time model is calibrated: bytes alone (received per rank, P payloads
            # against about two) favour the sharded exchange from 4 ranks on; not without the
            # downlink selection, where each owner sends its region's whole sum (the union of
            # the ranks' selections there: up to P payloads in all, one more than the
            # allgather's)
            for b in self.buckets:
                self.state[b.index].collective = \
                    "allgather" if self._exact_by_allgather(b) else "sharded"
        self.inflight: Dict[int, InFlight] = {}
        # parameters whose gradient has come sparse on this rank (an embedding with
        # sparse=True): a step where one has none (not used on this rank) hands it back sparse
        # too, in the layout the other ranks hand theirs back in
        self.sparse_gradients: set = set()
        # set where the library switched an adaptive optimizer to Horovod's step because every
        # bucket went dense (hvd_sparse.optimizer): later calibrations keep them dense
        self.dense_only = False
        # options that follow that switch (set by the optimizer where it may take it): they
        # and dense_only are replicated state, agreed before a step's paths part (a rank's
        # own, a rank resumed or joining beside switched ranks exchanged the other kind)
        self.switchable: Tuple[str, ...] = ()
        self.on_switch: Optional[Callable[[dict], None]] = None  # applies another rank's
        self.steps = 0
        self.local_count = 0
        self.stats = CommunicationStats()
        self.clock = StageClock()
        # fused uplink commits since the start: acc written by the selection's scan
        # ("in_scan") or by a pass after the collective ("in_place")
        self.commits = {"in_scan": 0, "in_place": 0}
        # multi-parameter gradients: read by the uplink scan in their p.grad pieces, or
        # copied into one flat buffer first
        self.gradient_reads = {"in_pieces": 0, "copied": 0}
        # exchanged updates: the weight change formed by the uplink scan from params and
        # anchor, or written whole first
        self.weight_change_reads = {"in_scan": 0, "written": 0}
        # exchanged updates: buckets whose parameters were found changed outside the optimizer
        # between an exchange and the next local step, and re-anchored (follow_outside_changes)
        self.outside_changes = 0
        self._probes = None  # follow_outside_changes' positions (_probe_plan), made once
        self._views = {}  # parameter or bucket index -> (data pointer, numpy view of it/anchor)
        # HVD_SPARSE_ACC_IN_SCAN=off: no acc written by the uplink scan, one commit pass after
        # the collective instead (the same bits; saves a spare buffer per one-parameter bucket)
        self._acc_in_scan = os.environ.get("HVD_SPARSE_ACC_IN_SCAN", "on") != "off"
        self.link: Optional[costmodel.Link] = None
        self.calibrated_at: Optional[int] = None
        self.calibrated_world: Optional[int] = None  # the world size it calibrated at
        self._steps_here = 0  # steps this process ran (not replicated, not saved)
        self._measured_world = transport.size()  # the world size of the measurements
        self._measured: Dict[int, float] = {}  # per bucket: least sparse compute seen
        # per bucket: [gathered bytes, gathered positions, exchanges] summed (the cost model
        # prices the mean: adaptive Top-K's k ranges over 100x, and its largest payload,
        # priced before, tipped buckets dense)
        self._wire: Dict[int, list] = {}
        self._measured_coding: Dict[int, str] = {}  # per bucket: the code those were seen with
        self.codec: Optional[list] = None  # Golomb-Rice [encode, decode] s per position, agreed
        # replicated state is compared (and, if it differs, taken from the root) before the
        # first exchange, after load_state_dict and when the world size changes: agreement.py
        self.agreement_due = True
        self.agreement_root = 0
        self._agreed_size: Optional[int] = None
        # a state saved with updates exchanged (the wrapped optimizer's state then this rank's
        # own) loaded where gradients are: this rank's flag, then the agreement's (any rank)
        self.per_rank_state_loaded = False
        self.optimizer_state_average_due = False
        self.skip_step = False
        # exchanged updates: the agreement before the step found a non-finite gradient
        self.skip_update = False
        self.finite_agreed = False  # ... or found every gradient finite (no second read)
        # the last finish() kept unsent mass in residuals (a sparse exchange that was not
        # rolled back): what it wrote is owed a step (see the optimizer's zero_grad)
        self.kept_unsent = False
        self._snapshots = {}  # residuals a non-finite step must give back (plain path, flush)
        self._sent = {}  # momentum_masking: per bucket, the positions this rank sent last
        # buckets whose uplink scan put the parameters back at the anchor (exchanged updates)
        self._params_at_anchor = set()
        self._sparsifier_snapshot = None  # sparsifier state at the start of the round
        self._local_nonfinite: List[str] = []
        self._flag_at_exchange = False  # communication delay: a local step saw NaN/Inf
        self._serving = {}  # sharded buckets: this rank's region selection, being allgathered
        self._histogram_bytes = {}  # sharded buckets under the global rule: this step's share
        self._consolidated = {}  # sharded buckets: whole downlink residuals, until the next step
        # HVD_SPARSE_DOWNLINK_WATCH=off: scan the downlink residual every step (a diagnostic:
        # the selections are the same bits either way)
        self._watching = os.environ.get("HVD_SPARSE_DOWNLINK_WATCH", "on") != "off"

    # ----------------------------------------------------------------- small helpers
    def _ctx(self, b, direction, watch=None, whole=True):
        """``whole``: the selection is over the whole bucket (not a sharded region), where a
        layer floor applies."""
        c = self.config
        floor = self._floor(b) if whole else 0.0
        base = None if self._at_target_density() else \
            (c.density if direction == "up" else c.downlink_density)
        return SelectionContext(bucket=b.name, step=self.steps, rank=self.transport.rank(),
                                direction=direction, watch=watch,
                                segments=b.segments if floor else None, layer_floor=floor,
                                base_density=base)

    def _floor(self, b) -> float:
        """The layer floor of a bucket's selection: 1 in a shared bucket of scope "tensor"
        (one Top-K per tensor; a method that chooses each entry by itself needs none), the
        configured one in a bucket of several tensors, else 0."""
        if b.layerwise:
            return 1.0 if self.config.sparsifier.supports_layer_floor else 0.0
        return self.config.layer_floor if len(b.params) > 1 else 0.0

    def densities(self):
        """This step's (uplink, downlink) density: the targets, or on the warm-up's and the
        cool-down's schedules (the higher of the two where they meet)."""
        c = self.config
        step = self.schedule_step()
        up = cooldown_density(step, c.density, c.cooldown_density, c.total_steps,
                              c.density_cooldown_steps)
        down = min(1.0, c.downlink_density * (up / c.density))
        return (max(up, warmup_density(step, c.density, c.density_warmup_steps)),
                max(down, warmup_density(step, c.downlink_density, c.density_warmup_steps)))

    def schedule_step(self) -> int:
        """The optimizer step the schedules (warm-ups, cool-down, ``total_steps``) read: the
        exchange count, or under ``local_steps`` = τ > 1 the optimizer step this exchange
        ends (one exchange per τ steps: scheduled by exchanges, a cool-down over the last 40
        of 200 steps at τ = 4 never began)."""
        if self.config.local_steps > 1:
            return max(0, self.local_count - 1)
        return self.steps

    def describe(self) -> dict:
        """What must be the same on every rank (compared before the first exchange)."""
        c = self.config
        return {
            "world_size": self.transport.size(),
            # the wrapped optimizer's class: it decides what is exchanged (exchange="auto"),
            # so a rank with another one differs in options too, but this says why
            "optimizer": self.wrapped_optimizer,
            "buckets": [{"name": b.name, "numel": b.numel, "dtype": str(b.dtype),
                         "sparse": b.sparse, "params": [
                             [n, list(p.shape), str(p.dtype), list(sl)]
                             for n, p, sl in zip(b.names, b.params, b.slices)]}
                        for b in self.buckets],
            "options": {k: "agreed as replicated state" if k in self.switchable else v
                        for k, v in c.describe().items()},
            "switchable": list(self.switchable),
            "compression": getattr(c.compression, "__name__", type(c.compression).__name__),
        }

    def view(self) -> "MappingProxyType[str, BucketView]":
        """Read-only snapshot of every bucket's state, by bucket name."""
        def copy(t):
            return None if t is None else t.detach().clone()

        out = {}
        for b in self.buckets:
            st = self.state[b.index]
            out[b.name] = BucketView(
                b.name, b.numel, b.dtype, b.index_dtype, b.sparse,
                st.mode if b.sparse else "dense", tuple(b.names), copy(st.uplink.buffer),
                copy(st.downlink.buffer), copy(st.velocity.velocity if st.velocity else None),
                copy(st.shard.buffer if st.shard else None), self.collective(b),
                tuple(self._bounds(b)) if self.collective(b) == "sharded" else None)
        return MappingProxyType(out)

    # ----------------------------------------------------------------- agreement
    def ensure_agreed(self) -> None:
        """Run the cross-rank agreement when due (see :mod:`hvd_sparse.engine.agreement`).
        Checked at a step's first launch: the world does not change within a step."""
        if self.inflight and not self.agreement_due:
            return
        size = self.transport.size()
        if not self.agreement_due and size == self._agreed_size:
            return
        self.agreement_due = False
        world_changed = size != self._agreed_size  # also a fresh job, or a joining worker
        self._agreed_size = size
        root, self.agreement_root = self.agreement_root, 0
        if world_changed:
            if self.holds_replicated_state():
                self._recover_regions()
            self._warn_changed_dtypes()
        if size == 1:
            return
        # Gradients exchanged: the wrapped optimizer's state must be the same on every rank. A
        # checkpoint saved while updates were exchanged holds each rank's own (momentum, Adam's
        # moments); one saved per rank and resumed here (finishing dense, say) trained another
        # model on every rank. Where any rank loaded one (told in the agreement's collective),
        # the optimizer averages its state before its next step (the switch's rule).
        loaded = self.per_rank_state_loaded and self.exchange_kind() == "gradient"
        self.per_rank_state_loaded = False
        if not self.holds_replicated_state():
            # (Horovod's step: nothing replicated to agree on)
            self.optimizer_state_average_due = self._check_dense_pairing(loaded)
            return
        theirs, self.optimizer_state_average_due = agreement.agree(
            self.transport, self.describe() if self.config.check_config else None,
            self.replicated_state(), root, self.fingerprint, flag=loaded)
        if theirs is not None:
            self.load_replicated(theirs)

    def _check_dense_pairing(self, flag: bool = False) -> bool:
        """Every bucket allreduced on ``p.grad``: the buckets must still pair up across ranks.
        With a rank-dependent parameter order (a list built from a set, say) their names
        differed and Horovod stalled, or, packed under the same name and length, unrelated
        entries were summed in silence. One allreduce of the configuration's digest
        (:func:`hvd_sparse.safety.same_by_sums`, which ``hvd.join()`` serves as it serves
        the exchange itself); where it differs, the full comparison names the difference.
        Returns whether any rank raised ``flag`` (summed in the same allreduce; without
        ``check_config``, where gradients are exchanged, the allreduce carries only that)."""
        import hashlib
        import json

        if not self.config.check_config:
            if self.exchange_kind() != "gradient":
                return False
            _, (anyone,) = safety.same_by_sums(self.transport, b"", "hvd_sparse.agree.dense",
                                               extra=(float(flag),))
            return anyone > 0
        text = json.dumps(self.describe(), sort_keys=True, default=str).encode()
        same, (anyone,) = safety.same_by_sums(self.transport,
                                              self.fingerprint + hashlib.sha256(text).digest(),
                                              "hvd_sparse.agree.dense", extra=(float(flag),))
        if not same:
            safety.raise_config_mismatch(self.transport, text, other_optimizer=True)
        return anyone > 0

    def switch_state(self) -> dict:
        """The library's exchange switch as replicated state (see ``switchable``)."""
        return {"dense_only": bool(self.dense_only),
                **{k: getattr(self.config, k) for k in self.switchable}}

    def agreed(self) -> bool:
        """Has the cross-rank agreement run for this world (so that every rank is known to
        run the same configuration, and a collective of the facade's own cannot meet
        another rank's agreement)?"""
        return not self.agreement_due and self._agreed_size == self.transport.size()

    def _warn_changed_dtypes(self) -> None:
        """A model cast after wrapping (``model.double()``, ``model.half()``): the buckets keep
        the dtype they were planned with, so its gradients are rounded to it in the exchange.
        Said once, at the first exchange, where checking costs nothing per step."""
        changed = [(n, p.dtype, b.dtype) for b in self.buckets for n, p in zip(b.names, b.params)
                   if p.dtype != b.dtype]
        if changed:
            n, now, was = changed[0]
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            warnings.warn(f"parameter {n!r}{more} is {now} but was {was} when the optimizer was "
                          f"wrapped: its gradient is exchanged as {was}. Cast the model "
                          "(model.double(), .half(), ...) before wrapping the optimizer.")

    def _recover_regions(self) -> None:
        """After the world changed (an elastic reset), the regions that surviving owners hold,
        made for the old world, are gathered by every rank and put back together into whole
        downlink residuals, which the next step cuts for the new world: only the regions of
        departed workers are lost (with a warning). Every rank of the new world calls this
        (a fresh process too, with nothing to give), so it costs one small allgather at the
        start of a job."""
        size, rank = self.transport.size(), self.transport.rank()
        mine = {b.name: (tuple(st.shard_layout), st.shard.buffer.detach().cpu())
                for b in self.buckets for st in [self.state[b.index]]
                if b.sparse and st.shard is not None and st.shard.buffer is not None
                and st.shard_layout is not None and tuple(st.shard_layout[:2]) != (size, rank)}
        blob = b""
        if mine:
            buf = io.BytesIO()
            torch.save(mine, buf)
            blob = buf.getvalue()
        held = [torch.load(io.BytesIO(d), weights_only=True)
                for d in safety._gather_bytes(self.transport, blob, "hvd_sparse.regions.recover")
                if d]
        lost = []
        for b in self.buckets:
            pieces = [(lay[2], lay[3], res) for h in held if b.name in h
                      for lay, res in [h[b.name]]]
            if not pieces:
                continue
            st = self.state[b.index]
            whole, covered = sharded.whole_from_regions(b.numel, pieces, st.downlink.dtype)
            st.downlink.load(whole.to(b.params[0].device))
            st.shard, st.shard_layout = None, None
            if covered < b.numel:
                lost.append(f"{b.name} ({b.numel - covered} of {b.numel} entries)")
        if lost:
            warnings.warn("the world changed: the region residuals of departed workers are lost "
                          f"for {', '.join(lost)}; the survivors' regions are kept")

    def request_agreement(self, root: int = 0) -> None:
        """Compare replicated state across ranks before the next exchange, adopting ``root``'s
        where it differs. Must be called on every rank (``broadcast_optimizer_state`` does)."""
        self.agreement_due = True
        self.agreement_root = int(root)


    # ----------------------------------------------------------------- uplink
    def gradient(self, b):
        """The bucket's gradient as one flat vector, read where it lies: a view of ``p.grad``
        for a single-parameter bucket, a reused buffer otherwise; zeros where a parameter has
        no gradient (as Horovod does; handed back sparse where this rank has had it sparse).
        Returns (flat, ids of sparse-gradient parameters)."""
        if len(b.params) == 1:  # the common case first: one whole, contiguous gradient
            g = b.params[0].grad
            if g is not None and g.layout == torch.strided and g.dtype.is_floating_point \
                    and g.is_contiguous() and g.numel() == b.numel:
                return g.view(-1), frozenset()
        elif b.whole:
            grads = [p.grad for p in b.params]
            dtype = grads[0].dtype if grads[0] is not None else None
            if dtype is not None and dtype.is_floating_point and all(
                    g is not None and g.layout == torch.strided and g.dtype == dtype
                    and g.is_contiguous() for g in grads):
                st = self.state[b.index]
                flat = st.flat_buffer(b.numel, dtype, grads[0].device)
                torch._foreach_copy_(st.shaped(flat, b), grads)
                return flat, frozenset()
        sparse_ids = set()
        parts = []
        for p, name, (lo, hi) in zip(b.params, b.names, b.slices):
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if id(p) in self.sparse_gradients:
                    sparse_ids.add(id(p))
            g = p.grad
            if not g.dtype.is_floating_point:
                raise TypeError(f"parameter '{name}' has a gradient of dtype {g.dtype}; "
                                "hvd_sparse sparsifies floating-point gradients only")
            if g.is_sparse:
                # sent as the dense vector it stands for and handed back sparse (Horovod's
                # sparse_as_dense), since selection needs the dense values
                sparse_ids.add(id(p))
                self.sparse_gradients.add(id(p))
                g = g.to_dense()
            elif not g.is_contiguous():
                p.grad = g = g.contiguous()
            parts.append(g.reshape(-1)[lo:hi])
        if len(parts) == 1:
            flat = parts[0]
        else:
            flat = self.state[b.index].flat_buffer(b.numel, parts[0].dtype, parts[0].device)
            torch.cat(parts, out=flat)
        return flat, frozenset(sparse_ids)

    def dense_flavour(self) -> str:
        """``"gather"`` (allgather, rank-order sum: same bits every run) with
        ``deterministic_dense`` at 3 or more ranks, else ``"reduce"`` (an allreduce)."""
        size = self._agreed_size or self.transport.size()  # (agreed at the step's start)
        return "gather" if (self.config.deterministic_dense and size > 2) else "reduce"

    def index_coding(self, b) -> str:
        """The positions' code for the bucket's payloads: the configured one, or under
        ``"auto"`` the time cost model's choice (plain before it has chosen, on a device, and
        for the sharded exchange, whose payloads are split by region)."""
        coding = self.config.index_coding
        if coding != "auto":
            return coding
        return "plain" if self.collective(b) == "sharded" else self.state[b.index].index_coding

    def collective(self, b) -> str:
        """How a sparse bucket is exchanged this step: ``"allgather"`` or ``"sharded"`` (the
        same on every rank: from the configuration, or the agreed cost model under "auto")."""
        c = self.config
        if c.collective == "allgather" or self.transport.size() == 1:
            return "allgather"
        if c.collective == "sharded":
            return "allgather" if self._exact_by_allgather(b) else "sharded"
        return self.state[b.index].collective

    def _exact_by_allgather(self, b) -> bool:
        """A downlink under a layer floor, or a Top-K downlink under the global rule whose
        histograms would cost more than sharding saves (small buckets at a few ranks, every
        bucket at two) goes by allgather, where every rank picks the exact selection itself;
        from the configured densities, so the choice stays the same through a density
        warm-up."""
        c = self.config
        if c.bidirectional and self._floor(b):
            return True  # an owner sees one region: the layer floor needs the whole bucket
        if not self._global_rule(b):
            return False
        pair = b.index_dtype.itemsize + (c.value_dtype or b.dtype).itemsize
        return sharded.allgather_is_cheaper(int(c.density * b.numel),
                                            int(c.downlink_density * b.numel),
                                            self.transport.size(), pair)

    def mode(self, b) -> Optional[str]:
        """How a bucket goes dense this step: ``None`` (it does not), ``"gather"`` or
        ``"reduce"``. A dense exchange is an allreduce, except with ``deterministic_dense`` at 3
        or more ranks, where the summation order of an allreduce can change between runs: then
        an allgather and a sum in rank order."""
        c = self.config
        dense = self.dense_flavour()
        if not b.sparse or self.schedule_step() < c.dense_warmup_steps:
            return dense
        if c.cost_model == "time":
            return dense if self.state[b.index].mode == "dense" else None
        if c.cost_model == "bytes":
            up, _ = self.densities()
            k = c.sparsifier.target_count(b.numel, up, self._ctx(b, "up"))
            size = self.transport.size()
            form, wire_bytes, sums_bytes = self._dense_form(b, dense, size)
            if k is not None and costmodel.prefer_dense(
                    b.numel, k, size, b.index_dtype.itemsize,
                    (c.value_dtype or b.dtype).itemsize, wire_bytes // b.numel,
                    dense_by="ring" if form == "reduce" else form,
                    sum_value_bytes=(sums_bytes or 0) // b.numel):
                return dense
        return None

    def holds_replicated_state(self) -> bool:
        """Is there anything ranks must hold alike beyond the parameters (a sparse-capable
        bucket, anchors of exchanged updates)? Without, the exchange is Horovod's allreduce
        on ``p.grad`` alone: no agreement, no calibration, and ``hvd.join()`` works as
        Horovod's (their allgathers crashed a rank that joined early with a small model)."""
        return self.config.exchanges_updates or self.any_sparse

    def after_join(self) -> None:
        """Collective, after Horovod's ``join``: the step counters of the rank that stepped
        longest (the last to join; the largest counters, which needs no mapping of Horovod's
        global rank into a process set), on every rank. Ranks that joined early skipped
        steps, and what is keyed on the counter (``verify_every``'s collective, the
        schedules, the calibration) must fall on the same step everywhere."""
        mine = torch.tensor([self.steps, self.local_count], dtype=torch.int64)
        name = f"hvd_sparse.join.{self.buckets[0].name}" if self.buckets else "hvd_sparse.join"
        got = self.transport.wait(self.transport.allgather_async(mine.view(torch.uint8), name))
        steps, local = got.view(torch.int64).view(-1, 2).max(dim=0).values.tolist()
        self.steps, self.local_count = int(steps), int(local)
        if not self.holds_replicated_state() and self.transport.size() > 1:
            # a rank that joined before its first step would make the pairing check alone
            # at its next one, against the others' gradient allreduces: made here, on every
            # rank together (again where it was made already)
            self._check_dense_pairing()
            self._agreed_size, self.agreement_due = self.transport.size(), False

    def join_blockers(self) -> List[str]:
        """The buckets whose next exchange is not an allreduce (a sparse allgather or
        all-to-all, a dense gather): a rank inside Horovod's ``join()`` stands in for
        allreduces only, with zeros. Also a bucket allreduced for now only: in a dense
        warm-up, or before (or between) the time cost model's calibrations, whose link probes
        are allgathers too; the other ranks then failed when the warm-up ended."""
        c = self.config
        if self.holds_replicated_state() and self.transport.size() > 1 and (
                self.agreement_due or self._agreed_size != self.transport.size()):
            return [b.name for b in self.buckets]  # the agreement's allgather comes first
        pending = c.cost_model == "time" and (self.calibrated_at is None
                                              or bool(c.recalibrate_every))
        return [b.name for b in self.buckets if self.mode(b) != "reduce" or (
            b.sparse and (pending or self.schedule_step() < c.dense_warmup_steps))]

    def launch(self, b, flat=None, sparse_ids=frozenset(), delta=None):
        """Run a bucket's uplink and start its collective (``flat``: given by the
        communication-delay path; otherwise the gradients are read). ``delta``: ``flat`` is
        still unfilled and stands for the weight change ``pieces - anchor``, ``(pieces,
        anchor)`` from :meth:`_weight_change_parts`, which the uplink scan reads as such."""
        c = self.config
        self.ensure_agreed()
        if self._sparsifier_snapshot is None and c.nonfinite != "ignore":
            # a non-finite step must leave stateful methods (adaptive k) as they were on
            # every rank, also on those that selected normally
            self._sparsifier_snapshot = (c.sparsifier.state_dict(),
                                         c.downlink_sparsifier.state_dict())
        given = flat is not None
        dense_mode = self.mode(b)
        parts, minus = delta if delta is not None else (None, None)
        if delta is not None and dense_mode:
            flat = self.weight_change(b)  # read whole: the dense path needs it
            parts = minus = None
        if not given:
            lazy = None if dense_mode else self._gradient_parts(b)
            if lazy is not None:
                flat, sparse_ids, parts = lazy
            else:
                flat, sparse_ids = self.gradient(b)
        name = f"hvd_sparse.{b.index}.{b.name}"
        if c.local_clip_norm is not None and not given:  # a weight change is not clipped:
            flat = clip_local(flat, c.local_clip_norm, self.transport.size())  # its p.grad was
        if dense_mode:
            with self.clock.stage("dense"):
                self._launch_dense(b, flat, sparse_ids, name, dense_mode)
            return
        st = self.state[b.index]
        up_density, _ = self.densities()
        ctx = self._ctx(b, "up")
        sparsifier = c.sparsifier
        target = sparsifier.target_count(b.numel, up_density, ctx)
        residual = st.uplink.ensure(flat)
        sel = accumulating = None
        with self.clock.stage("uplink_select", b.index):
            if st.velocity is None:
                ops = kernels.ops_for(residual) if flat.dtype == residual.dtype \
                    else kernels.reference
                # (never None where parts were taken: _gradient_parts asks what it asks)
                accumulating = self._accumulating(st, ops, flat, residual, parts, minus)
                if accumulating is None and minus is not None:  # (not expected: the same
                    flat = self.weight_change(b)  # conditions) the change, written whole
                sel = sparsifier.fused(accumulating or ops, flat, residual, up_density, ctx)
                if sel is not None and sel.nonfinite and (
                        c.nonfinite == "ignore"  # NaN/Inf flow on, as the plain path lets them
                        or _finite_after_all(accumulating, flat, residual)):
                    sel = None
        pieces = accumulating is not None and accumulating.read_pieces
        if len(b.params) > 1 and not given:
            self.gradient_reads["in_pieces" if pieces else "copied"] += 1
        elif given and delta is not None:
            self.weight_change_reads["in_scan" if pieces and minus is not None
                                     else "written"] += 1
        if sel is not None and sel.nonfinite:
            self._send_nonfinite(b, flat, name, sparse_ids)
            return
        if accumulating is not None and accumulating.reset_done:
            self._params_at_anchor.add(b.index)
        if sel is None:
            if accumulating is not None and accumulating.pending:
                accumulating.materialize()  # the method decided without a scan
            elif accumulating is not None and accumulating.reset_done:
                # the parameters are back at the anchor, so the change cannot be read again:
                # acc is in flat; with the residual folded in (zeroed), the plain path reads
                # acc + 0 = acc
                residual.zero_()
            elif accumulating is not None and accumulating.written and accumulating.into is flat:
                # the scan left acc in the engine's own copy: the plain path needs the input
                flat = self.weight_change(b) if given else self.gradient(b)[0]
                if c.local_clip_norm is not None and not given:
                    flat = clip_local(flat, c.local_clip_norm, self.transport.size())
            self._launch_plain(b, flat, sparse_ids, name, target)
            return
        with self.clock.stage("encode", b.index):
            wire_values, sent, ctx_codec = self._to_wire(b, sel.values)
            acc = accumulating.into if accumulating is not None and accumulating.written \
                else None
            commit = (ops, flat, sel, sent, acc)
        self._send(b, name, sel.idx, wire_values, ctx_codec, sparse_ids, target, None, commit)

    def _gradient_parts(self, b):
        """A multi-parameter bucket's gradient left in its ``p.grad`` pieces for the uplink
        scan to read (no concatenation pass, see :meth:`_accumulating`): (the flat buffer,
        still unfilled, sparse ids, [(piece, offset)]), or None where :meth:`gradient`'s
        copy is needed (one parameter, sparse or non-float32 gradients, clipping, momentum
        correction, threads for the parallel scan; the caller rules out a dense step)."""
        c = self.config
        if len(b.params) < 2 or not self._acc_in_scan or b.dtype != torch.float32 \
                or c.local_clip_norm is not None \
                or self.state[b.index].velocity is not None \
                or not cpu.available() or cpu._threads() != 1:
            return None
        parts = []
        for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
            g = p.grad
            if g is None or g.is_sparse or g.dtype != torch.float32 or g.device.type != "cpu" \
                    or not g.is_contiguous() or kernels.backend_for(g) != "numba":
                return None
            parts.append((g.reshape(-1)[lo:hi], off))
        flat = self.state[b.index].flat_buffer(b.numel, torch.float32, parts[0][0].device)
        return flat, frozenset(), parts

    def _accumulating(self, st, ops, flat, residual, parts=None, minus=None):
        """The numba primitives that also write ``acc`` in the selection's scan (see
        :class:`~hvd_sparse.kernels.cpu.AccumulatingOps`), or None: into the engine's own copy
        of the gradient where there is one (a multi-parameter bucket's concatenation, a weight
        change), else into a spare buffer kept across steps (a one-parameter bucket reads
        ``p.grad`` where it lies, and ``p.grad`` must hold the gradient until every rank has
        said "finite")."""
        if not self._acc_in_scan or ops is not kernels.cpu or flat.dtype != torch.float32 \
                or residual.dtype != torch.float32 or flat.numel() != residual.numel():
            return None
        if flat is st.scratch:  # the gradient in its pieces, or concatenated there
            # (a weight change: the scan also puts the parameters back at the anchor, so
            # that the write after the exchange is O(k), :meth:`_write_sparse`)
            return cpu.AccumulatingOps(flat, residual, flat, parts, minus,
                                       reset=minus is not None)
        spare = st.spare
        if spare is None or spare.numel() != residual.numel():
            st.spare = spare = torch.empty_like(residual)
        return cpu.AccumulatingOps(flat, residual, spare)

    def _to_wire(self, b, values, prescale=True):
        """(values as the wire carries them, the same as the receiver will read them, codec
        context). With no codec, cast or pre-scaling the three are the selected values.
        ``prescale=False``: values already averaged (an owner's region selection)."""
        c = self.config
        pre = prescale and c.average and c.predivide != 1.0
        if c.compression is Compression.none and c.value_dtype is None and not pre \
                and values.dtype == b.dtype:
            return values, values, None
        wire_dtype = c.value_dtype or b.dtype
        if torch.finfo(wire_dtype).max < torch.finfo(values.dtype).max:
            # past the wire type's range (65504 in fp16) a finite value would arrive as Inf:
            # send the largest finite value instead; error feedback keeps the rest
            big = torch.finfo(wire_dtype).max
            values_in_range = values.clamp(-big, big)
        else:
            values_in_range = values
        scaled = values_in_range.to(wire_dtype)
        if pre:
            scaled = scaled * (1.0 / c.predivide)
        wire_values, ctx = c.compression.compress(scaled)
        if wire_values.dtype != scaled.dtype and wire_values.dtype.is_floating_point \
                and not all_finite(wire_values) and all_finite(scaled):
            big = torch.finfo(wire_values.dtype).max  # the codec narrows (Compression.fp16)
            wire_values, ctx = c.compression.compress(scaled.clamp(-big, big))
        sent = c.compression.decompress(wire_values, ctx).to(values.dtype)
        if pre:
            sent = sent * c.predivide
        return wire_values, sent, ctx

    @staticmethod
    def _uplink_error(sel, sent):
        """||residual||^2 after this step's commit, from the scan's energy (sum of acc^2) and
        the selected entries alone; ``None`` when the backend's scan gave no energy."""
        if sel.energy is None:
            return None
        a = sel.acc_values.double()
        left = float((a - sent.double()).pow(2).sum()) if sent is not sel.acc_values else 0.0
        return torch.tensor(max(sel.energy - float(a.pow(2).sum()) + left, 0.0),
                            dtype=torch.float64)

    def _send_nonfinite(self, b, flat, name, sparse_ids):
        """Keep NaN/Inf out of the residual; tell every rank through the payload's flag."""
        c = self.config
        self._local_nonfinite += [n for n, p in zip(b.names, b.params)
                                  if p.grad is not None and not bool(
                                      torch.isfinite(p.grad.to_dense() if p.grad.is_sparse
                                                     else p.grad).all())]
        empty, ctx = c.compression.compress(flat[:0].to(c.value_dtype or b.dtype))
        self._send(b, name, torch.empty(0, dtype=torch.int64, device=flat.device), empty, ctx,
                   sparse_ids, 0, None, None, nonfinite=True)

    def _launch_plain(self, b, flat, sparse_ids, name, target):
        """Methods without a fused form, momentum correction, and NaN under "ignore": the
        sparsifier's torch definition on the accumulated residual, written at once."""
        c = self.config
        st = self.state[b.index]
        with self.clock.stage("uplink_select", b.index):
            if c.nonfinite != "ignore" and not all_finite(flat):
                self._send_nonfinite(b, flat, name, sparse_ids)
                return
            if c.nonfinite != "ignore":
                self._snapshots[b.index] = (st.uplink.state(),
                                            st.velocity.state() if st.velocity else None)
            up_density, _ = self.densities()
            acc = st.uplink.accumulate(st.velocity.apply(flat) if st.velocity else flat)
            idx, values = c.sparsifier.compress(acc, up_density, self._ctx(b, "up"))
        with self.clock.stage("encode", b.index):
            wire_values, sent, ctx = self._to_wire(b, values)
            st.uplink.settle(idx, sent)  # what the wire lost (selection, rounding) stays
            if st.velocity:
                st.velocity.mask(idx)
            error = st.uplink.energy() if c.track_error else None
        self._send(b, name, idx, wire_values, ctx, sparse_ids, target, error, None)

    def _send(self, b, name, idx, wire_values, ctx, sparse_ids, target, error, commit,
              nonfinite=False):
        c = self.config
        if c.momentum_masking:
            self._sent[b.index] = idx
        if self.collective(b) == "sharded":
            rank = self.transport.rank()
            with self.clock.stage("encode", b.index):
                payload, splits = sharded.encode_parts(
                    idx, wire_values, self._bounds(b),
                    constant=c.sparsifier.constant_value, index_dtype=b.index_dtype, tag=b.tag,
                    numel=b.numel, index_coding=self.index_coding(b), nonfinite=nonfinite)
            with self.clock.stage("collective_wait"):  # mpi4py exchanges the sizes first
                handle = self.transport.alltoall_async(payload, splits, name)
            self.inflight[b.index] = InFlight("sharded", handle, ctx,
                                              payload.numel() - splits[rank], sparse_ids,
                                              idx.numel(), target, error, commit,
                                              own_bytes=splits[rank])
            return
        st = self.state[b.index]
        if st.shard is not None:
            # sharded before, gathered now (the world size changed the rule's choice): the
            # region residual was made for another world and cannot be gathered back
            if st.shard.buffer is not None and bool(st.shard.buffer.any()):
                warnings.warn(f"bucket '{b.name}': the world changed and the bucket is now "
                              "exchanged by allgather; this rank's region residual is dropped")
            st.shard, st.shard_layout = None, None
        with self.clock.stage("encode", b.index):
            payload = wire.encode(idx, wire_values, index_dtype=b.index_dtype, tag=b.tag,
                                  numel=b.numel, index_coding=self.index_coding(b),
                                  constant=c.sparsifier.constant_value, nonfinite=nonfinite)
        with self.clock.stage("collective_wait"):  # may block (mpi4py exchanges sizes first)
            handle = self.transport.allgather_async(payload, name)
        self.inflight[b.index] = InFlight("sparse", handle, ctx, payload.numel(), sparse_ids,
                                          idx.numel(), target, error, commit, positions=idx)

    def _launch_dense(self, b, flat, sparse_ids, name, dense_mode, flush=True):
        """A bucket that goes dense: like Horovod, one allreduce in place on the gradient.

        What error feedback holds (uplink residual, velocity) is flushed into the first dense
        exchange and the buffers are released, so later dense steps cost no extra pass."""
        c = self.config
        st = self.state[b.index]
        if flush and b.sparse and (st.uplink.buffer is not None
                                   or (st.velocity is not None
                                       and st.velocity.velocity is not None)):
            # kept until the step is known finite on every rank (a non-finite step rolls back)
            self._snapshots[b.index] = (st.uplink.buffer,
                                        st.velocity.state() if st.velocity else None)
            source = st.velocity.apply(flat) if st.velocity else flat
            flat = source + st.uplink.buffer.to(source.dtype) \
                if st.uplink.buffer is not None else source.clone()
            st.uplink.buffer = st.spare = None
            if st.velocity is not None:
                st.velocity.velocity = None  # restarts from the gradient when sparse again
        wire_t, ctx = c.compression.compress(flat)
        nbytes = wire_t.numel() * wire_t.element_size()
        acc_item = aggregation.accumulation_dtype(b.dtype).itemsize
        if dense_mode == "gather" and dense_regions.applies(
                self.transport, self.transport.size(), nbytes, wire_t.element_size(), acc_item):
            # the same rank-order sum, region by region (an all-to-all, then an allgather)
            handle = dense_regions.start(self.transport, wire_t, name)
            nbytes = dense_regions.sent_bytes(handle, acc_item, self.transport.rank())
            kind = "dense_regions"
        elif dense_mode == "gather":  # rank-order sum of gathered vectors: same bits every run
            handle = self.transport.allgather_async(wire_t, name)
            kind = "dense_gather"
        else:
            # Horovod reduces in place: on p.grad itself when the bucket is one gradient
            # (nothing else needs it), else on this bucket's own flat copy
            prescale, postscale = (1.0 / c.predivide, c.predivide) if c.average else (1.0, 1.0)
            handle = self.transport.allreduce_async(
                wire_t, name, average=c.average, prescale=prescale, postscale=postscale)
            kind = "dense"
        self.inflight[b.index] = InFlight(kind, handle, ctx, nbytes, sparse_ids, b.numel, None)

    # ----------------------------------------------------------------- finish
    def finish(self, write: str = "grads") -> None:
        """Launch what is not in flight, finish every bucket, and write the result: into
        ``p.grad`` (``"grads"``) or as the averaged weight change (``"delta"``)."""
        for b in self.launch_order:
            if b.index not in self.inflight:
                self.launch(b)
        self.kept_unsent = False
        try:
            received, bad = {}, {}
            check = self._dense_check_needed(write)
            for b in self.launch_order:  # every region sum on its way before any wait below
                if self.inflight[b.index].kind == "dense_regions":
                    self._sum_region(b)
            # in the order they went out: the last bucket's collective, still in flight, then
            # overlaps the decoding of those before it
            for b in self.launch_order:
                received[b.index], bad_ranks = self._receive(b, check)
                if bad_ranks:
                    bad[b.name] = bad_ranks
            if bad:
                bad = {b.name: bad[b.name] for b in self.buckets if b.name in bad}
                self._nonfinite(bad, received, write)
            else:
                self.kept_unsent = write == "grads" and any(
                    self.inflight[b.index].kind in ("sparse", "sharded") for b in self.buckets)
                served = []
                for b in self.buckets:
                    self._commit_uplink(b, write)
                    if self.inflight[b.index].kind == "sharded":
                        self._serve_region(b, received[b.index])
                        served.append(b)
                    else:
                        self._apply(b, received[b.index], write)
                thresholds = self._global_thresholds(served)
                for b in served:
                    self._select_region(b, thresholds.get(b.index))
                for b in served:  # the owners' selections, allgathered above
                    self._apply_regions(b, write)
        finally:
            self._serving.clear()
            self._histogram_bytes.clear()
            self.inflight.clear()
            self._params_at_anchor.clear()
            self._snapshots.clear()
            self._sparsifier_snapshot = None
            self._local_nonfinite = []
        self._end_step()

    def _dense_check_needed(self, write) -> bool:
        """Must dense results be read for NaN/Inf? Not when nothing can be rolled back and the
        result goes to ``p.grad`` as it is: every bucket dense this step (no residual was
        touched or flushed) under "propagate", which is then exactly Horovod's step; the check
        would be one more read of every gradient."""
        c = self.config
        if c.nonfinite == "ignore":
            return False
        return (c.nonfinite != "propagate" or write != "grads" or bool(self._snapshots)
                or any(j.kind in ("sparse", "sharded") for j in self.inflight.values()))

    def _receive(self, b, check=True):
        """Wait for a bucket's exchange and decode it; returns (payloads or dense result,
        received bytes), bad ranks. Nothing is written yet, so a flag can still cancel.
        ``check``: read dense results for NaN/Inf (:meth:`_dense_check_needed`)."""
        c = self.config
        job = self.inflight[b.index]
        size = self.transport.size()
        if job.kind == "dense_regions":
            if job.handle.gather is None:
                self._sum_region(b)
            with self.clock.stage("collective_wait"):
                out = dense_regions.result(self.transport, job.handle)
            with self.clock.stage("dense"):
                bad = [-1] if check and not all_finite(out) else []
            return (out, job.handle.received_bytes), bad
        with self.clock.stage("collective_wait"):
            received = self.transport.wait(job.handle)
        if job.kind in ("sparse", "sharded"):
            with self.clock.stage("decode", b.index):
                own = None if job.positions is None else (self.transport.rank(),
                                                          job.positions)
                payloads = wire.decode_all(received, size, tag=b.tag, numel=b.numel,
                                           bucket=b.name, own=own)
                bad = [r for r, p in enumerate(payloads) if p.nonfinite]
            return (payloads, received.numel()), bad
        with self.clock.stage("dense"):
            acc_dtype = aggregation.accumulation_dtype(b.dtype)
            if job.kind == "dense_gather":
                parts = received.view(size, -1)
                # (gathered from 3 ranks on only: dense_flavour)
                first = c.compression.decompress(parts[0], job.ctx).to(acc_dtype)
                out = torch.add(first, c.compression.decompress(parts[1], job.ctx).to(acc_dtype),
                                out=self.state[b.index].sum_buffer(first.numel(), acc_dtype,
                                                                   first.device))
                for r in range(2, size):  # rank order, never a reduction tree
                    out.add_(c.compression.decompress(parts[r], job.ctx).to(acc_dtype))
                if c.average and size != 1:
                    out.mul_(1.0 / size)
                received_bytes = (size - 1) * job.nbytes
            else:
                out = c.compression.decompress(received, job.ctx)
                received_bytes = job.nbytes
            bad = [-1] if check and not all_finite(out) else []
        return (out, received_bytes), bad

    def _sum_region(self, b):
        """A ``"dense_regions"`` bucket's first half: its region from every rank, summed in
        rank order, and the allgather of the sums started."""
        job = self.inflight[b.index]
        c = self.config
        with self.clock.stage("collective_wait"):
            got = self.transport.wait(job.handle.exchange)
        with self.clock.stage("dense"):
            dense_regions.sum_region(self.transport, job.handle, got,
                                     lambda t: c.compression.decompress(t, job.ctx),
                                     aggregation.accumulation_dtype(b.dtype), c.average,
                                     self.state[b.index].sum_buffer)

    def _commit_uplink(self, b, write):
        job = self.inflight[b.index]
        if job.commit is not None:
            with self.clock.stage("uplink_commit", b.index):
                ops, flat, sel, sent, acc = job.commit
                st = self.state[b.index]
                residual = st.uplink
                # p.grad is about to be rewritten from zeros: zero it in this same pass when
                # the flat gradient is p.grad itself
                p = b.params[0]
                # (without the downlink selection the payloads are summed straight into it,
                # which gives the bits of a sum in the accumulation dtype only in that dtype)
                job.zeroed = (write == "grads" and len(b.params) == 1
                              and id(p) not in job.sparse_grads
                              and p.grad is not None and flat.data_ptr() == p.grad.data_ptr()
                              and flat.numel() == p.grad.numel()
                              and (self.config.bidirectional or flat.dtype == st.downlink.dtype))
                self.commits["in_place" if acc is None else "in_scan"] += 1
                if acc is None:
                    fused.commit(ops, flat, residual.buffer, sel, sent, zero_grad=job.zeroed)
                else:  # acc = grad + residual is ready: what was sent leaves it, then a swap
                    fused.commit(ops, None, acc, sel, sent)
                    if acc is st.scratch:
                        st.scratch, residual.buffer = residual.buffer, acc
                    else:
                        st.spare, residual.buffer = residual.buffer, acc
                    if job.zeroed:
                        stream.zero_(flat)
                if self.config.track_error:
                    job.error = self._uplink_error(sel, sent)
                    if job.error is None:  # the backend's scan measured no energy
                        job.error = residual.energy()

    def _apply(self, b, received, write):
        c = self.config
        job = self.inflight[b.index]
        st = self.state[b.index]
        if job.kind != "sparse":
            with self.clock.stage("dense"):
                out, received_bytes = received
                if b.sparse and st.downlink.buffer is not None:
                    # dense warm-start or fallback: flush the downlink residual once, too
                    out = out.to(st.downlink.dtype) + st.downlink.buffer
                    st.downlink.buffer = None
                self.stats.record(b.name, sent=job.nbytes, received=received_bytes,
                                  dense=b.nbytes, selected=b.numel, numel=b.numel,
                                  target=b.numel)
                self._write_dense(b, out, job.sparse_grads, write)
            return
        payloads, gathered_bytes = received
        size = self.transport.size()
        scale = (c.predivide / size) if c.average else 1.0
        device = b.params[0].device
        with self.clock.stage("aggregate", b.index):
            for p in payloads:
                p.values = c.compression.decompress(p.values, job.ctx)
            if c.sparsifier.observes or c.downlink_sparsifier.observes:
                dtype = st.downlink.dtype

                def scratch():  # made once, only for a backend that asks (all zero between uses)
                    s = st.support_scratch
                    if s is None or s.device != device or s.dtype != dtype:
                        st.support_scratch = s = torch.zeros(b.numel, dtype=dtype,
                                                             device=device)
                    return s

                ops = kernels.ops_for(torch.empty(0, dtype=dtype, device=device))
                support = ops.support_sum(payloads, scale, dtype, device, scratch)
                c.sparsifier.observe(support, self._ctx(b, "up"))
                c.downlink_sparsifier.observe(support, self._ctx(b, "down"))
            watch = None
            if c.bidirectional:
                fresh = st.downlink.buffer is None
                target = st.downlink.ensure(torch.empty(0, device=device))
                if self._watching and kernels.ops_for(target) is kernels.cpu:
                    watch = st.watch.begin(target, fresh)
            elif job.zeroed:  # p.grad, zeroed by the uplink commit: the sum lands there
                target = b.params[0].grad.view(-1)
            elif write == "delta" and self._delta_in_place(b, payloads):
                target = None  # the payloads go straight into the anchor, below
            else:
                target = st.flat_buffer(b.numel, st.downlink.dtype, device)
                stream.zero_(target)
            ops = kernels.ops_for(target if target is not None else st.anchor)
            for p in payloads if target is not None else ():  # rank order; indices unique
                if p.indices.numel() and watch is not None:  # within a payload
                    watch.scatter(ops, target, p.indices, p.values, scale)
                elif p.indices.numel():
                    ops.scatter_add(target, p.indices, p.values, scale)
            if not c.bidirectional and st.downlink.buffer is not None:
                target.add_(self._pending(b, 0, b.numel, device))
                st.downlink.buffer = None
        if c.bidirectional:
            residual = target
            _, down_density = self.densities()
            ctx = self._ctx(b, "down", watch)
            with self.clock.stage("downlink_select", b.index):
                sel = c.downlink_sparsifier.fused(ops, None, residual, down_density, ctx)
                if sel is not None and not sel.nonfinite:
                    fused.commit(ops, None, residual, sel, sel.values)
                    idx, values = sel.idx, sel.values
                    if not sel.ordered and len(b.params) > 1 and not self._groups(b, ops, values):
                        # split by parameter below: in index order, unless a kernel groups it
                        order = torch.argsort(idx)
                        idx, values = idx[order], values[order]
                else:
                    idx, values = c.downlink_sparsifier.compress(residual, down_density, ctx)
                    st.downlink.settle(idx, values)
                if watch is not None:
                    watch.end(residual)
            with self.clock.stage("write", b.index):
                self._write_sparse(b, idx, values, job.sparse_grads, write, ops, job.zeroed)
            down_selected = idx.numel()
        elif target is None:
            with self.clock.stage("write", b.index):
                self._write_delta_payloads(b, payloads, scale, ops)
            down_selected = None
        else:
            with self.clock.stage("write", b.index):
                self._write_dense(b, target, job.sparse_grads, write)
            down_selected = None
        self.stats.record(b.name, sent=job.nbytes, received=gathered_bytes - job.nbytes,
                          dense=b.nbytes, selected=job.selected, numel=b.numel,
                          target=job.target, error=job.error, downlink_selected=down_selected)
        if self._at_target_density():
            self._note_wire(b, gathered_bytes, sum(p.indices.numel() for p in payloads))
            self._measured_coding[b.index] = self.index_coding(b)

    # ----------------------------------------------------------------- write
    def _write_sparse(self, b, idx, values, sparse_ids, write, ops, zeroed):
        """``p.grad`` = zeros with the selected entries (no intermediate dense vector);
        ``zeroed``: the uplink commit already zeroed it in its pass."""
        if write == "delta":  # anchor += the selected change (O(k)), then params = anchor
            anchor = self.state[b.index].anchor
            if b.index not in self._params_at_anchor:
                ops.scatter_add(anchor, idx, values.to(anchor.dtype), 1.0)
                return self._restore_anchor(b)
            # the uplink scan put the parameters back at the old anchor: only the selected
            # entries move, to their new anchor values (handed back by the scatter, O(k))
            now, _ = cpu.scatter_add(anchor, idx, values.to(anchor.dtype), 1.0, read=True)
            values, zeroed = torch.from_numpy(now), True
        single = len(b.params) == 1
        grouped = cuts = None
        st = self.state[b.index]
        if not single and self._groups(b, ops, values):
            grouped = cpu.group(idx, values, st.edges(b.offsets, b.numel))
        elif not single:  # idx is sorted: every parameter's range from one search, one read
            cuts = torch.searchsorted(idx, st.edges_on(b.offsets, b.numel, idx)).tolist()
        if write != "delta":  # backward's gradients were made contiguous when read; one
            # the user put in place since then (any layout) is overwritten here, as Horovod's
            # synchronize() overwrites it
            for p in b.params:
                if id(p) not in sparse_ids and not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
        segs = [None if id(p) in sparse_ids
                else (p.detach() if write == "delta" else p.grad).view(-1)[lo:hi]
                for p, (lo, hi) in zip(b.params, b.slices)]
        if not zeroed:
            self._zero_all([s for s in segs if s is not None])
        for j, (p, off, (lo, hi)) in enumerate(zip(b.params, b.offsets, b.slices)):
            if single:
                sub_idx, sub_val = idx, values
            elif grouped is not None:
                a, e = grouped[2][j], grouped[2][j + 1]
                sub_idx, sub_val = grouped[0][a:e], grouped[1][a:e]
            else:
                a, e = cuts[j], cuts[j + 1]
                sub_idx, sub_val = idx[a:e] - off, values[a:e]
            if segs[j] is None:  # handed back sparse, as Horovod's sparse_as_dense does
                dense = p.grad.to_dense() if p.grad.is_sparse else p.grad
                flat = dense.reshape(-1)
                flat[lo:hi] = 0
                flat[lo + sub_idx] = sub_val.to(p.dtype)
                p.grad = self._sparse_again(dense)
                continue
            if single or a != e:
                ops.set_at(segs[j], sub_idx, sub_val)

    @staticmethod
    def _zero_all(segs) -> None:
        """Zero the parameters' segments: one multi-tensor launch on a GPU (a launch per
        parameter costs more than the zeroing of a small one), streaming stores on the CPU."""
        if segs and segs[0].device.type != "cpu":
            torch._foreach_zero_(segs)
            return
        # on the CPU too, the short ones in one call (a shared bucket holds hundreds); the
        # long ones with streaming stores
        short, long = [], []
        for s in segs:
            (short if s.numel() * s.element_size() < stream.MIN_BYTES else long).append(s)
        if short:
            torch._foreach_zero_(short)
        for s in long:
            stream.zero_(s)

    def _sparse_again(self, dense):
        """A sparse gradient handed back in the layout Horovod's optimizer gives it: with
        ``sparse_as_dense`` the dense result made sparse entry by entry (Horovod's
        ``to_sparse()``), otherwise by rows (one sparse dimension, values of shape
        ``[rows, ...]``), as Horovod's sparse allgather returns an embedding's gradient."""
        if self.config.sparse_as_dense or dense.dim() < 2:
            return dense.to_sparse()
        return dense.to_sparse(sparse_dim=1)

    @staticmethod
    def _groups(b, ops, values) -> bool:
        """Does the numba kernel split this bucket's selection by parameter (no sort)?"""
        return ops is cpu and values.dtype == torch.float32 and len(b.params) > 1 \
            and values.device.type == "cpu"

    def _write_dense(self, b, out, sparse_ids, write):
        if write == "delta":
            return self._write_delta(b, out)
        if len(b.params) > 1 and b.whole and not sparse_ids:
            grads = [p.grad for p in b.params]
            if all(g is not None and g.layout == torch.strided and g.dtype == out.dtype
                   for g in grads):
                torch._foreach_copy_(grads, self.state[b.index].shaped(out, b))
                return
        for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
            if p.grad is not None and not p.grad.is_sparse and id(p) not in sparse_ids \
                    and out.data_ptr() == p.grad.data_ptr() \
                    and out.dtype == p.grad.dtype and out.numel() == p.grad.numel():
                continue  # reduced in place on p.grad: already there
            seg = out[off:off + hi - lo].to(p.dtype)
            if id(p) in sparse_ids:
                dense = p.grad.to_dense() if p.grad.is_sparse else p.grad
                dense.reshape(-1)[lo:hi] = seg
                p.grad = self._sparse_again(dense)
            else:
                if not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                p.grad.view(-1)[lo:hi].copy_(seg)

    # ----------------------------------------------------------------- non-finite
    def _nonfinite(self, bad: dict, received: dict, write: str) -> None:
        """Some rank's gradient held NaN/Inf (every rank knows it from the same bytes). Every
        residual and the sparsifiers' state stay as they were before the step; then, by
        ``nonfinite``: "propagate" writes into ``p.grad`` what dense Horovod would (the
        average of the raw gradients, NaN/Inf included, so a loss scaler sees them and skips
        the step), "skip" zeroes the gradients and skips the step, "raise" raises."""
        c = self.config
        for b in self.buckets:  # what went over the wire all the same (nothing selected)
            job, got = self.inflight[b.index], received[b.index][1]
            own = job.nbytes if job.kind in ("sparse", "sharded") else 0
            self.stats.record(b.name, sent=job.nbytes, received=got - own, dense=b.nbytes,
                              selected=0, numel=b.numel, target=0, downlink_selected=0)
        where = "; ".join(f"bucket '{name}' on rank(s) {ranks}" if ranks != [-1]
                          else f"bucket '{name}' (after the allreduce)"
                          for name, ranks in bad.items())
        mine = f" (this rank: {', '.join(self._local_nonfinite)})" \
            if self._local_nonfinite else ""
        for index, (res, vel) in self._snapshots.items():
            st = self.state[index]
            st.uplink.load(res)
            if st.velocity is not None:
                st.velocity.load(vel)
        if self._sparsifier_snapshot is not None:
            c.sparsifier.load_state_dict(self._sparsifier_snapshot[0])
            c.downlink_sparsifier.load_state_dict(self._sparsifier_snapshot[1])
        self.stats.nonfinite_steps += 1
        # exchanged updates: the local step's change went non-finite (from a non-finite
        # gradient, or in the step itself, as AdamW's in float16 with eps=1e-8)
        what = "weight change (a rank's optimizer step)" if write == "delta" else "gradient"
        if c.nonfinite == "raise":
            again = ""
            if write == "delta":  # every rank restarts from the same weights, as under
                again = (" Every rank's weights are back where the last exchange left "
                         "them.")  # "skip": kept, a rank's own steps would part the replicas
                self._restore_anchors()
            raise safety.NonFiniteGradientError(
                f"non-finite {what} at step {self.steps}: {where}{mine}. Nothing of it "
                f"entered the residuals on any rank.{again} Pass nonfinite='propagate' to "
                "hand it to a loss scaler as dense Horovod does, or 'skip' to skip such "
                "steps.")
        if c.nonfinite == "propagate" and write == "grads":
            self._exchange_raw(received)
            return
        for b in self.buckets:
            for p in b.params:
                if p.grad is not None:
                    p.grad = torch.zeros_like(p) if p.grad.is_sparse else p.grad.zero_()
        if write == "delta":
            self._restore_anchors()  # the weight change was not finite: start again
        self.skip_step = True
        self.stats.skipped += 1
        warnings.warn(f"skipping step {self.steps} on every rank: non-finite {what} in "
                      f"{where}{mine}")

    def _exchange_raw(self, received: dict) -> None:
        """Dense Horovod's result for every bucket: buckets that went sparse are exchanged
        again as the plain average of the raw gradients (no residual involved)."""
        raw = [b for b in self.launch_order
               if self.inflight[b.index].kind in ("sparse", "sharded")]
        raw_ids = {b.index for b in raw}
        for b in raw:
            flat, sparse_ids = self.gradient(b)
            self._launch_dense(b, flat, sparse_ids, f"hvd_sparse.{b.index}.{b.name}.raw",
                               self.dense_flavour(), flush=False)
        for b in self.buckets:
            if b.index in raw_ids:
                (out, got), _ = self._receive(b)
                self.stats.record(b.name, sent=self.inflight[b.index].nbytes, received=got,
                                  dense=0, selected=0, numel=0, target=0, downlink_selected=0)
            else:
                out = received[b.index][0]
            self._write_dense(b, out, self.inflight[b.index].sparse_grads, "grads")

    def _restore_anchors(self) -> None:
        """Every bucket with an anchor back at it (the weights of the last exchange)."""
        for b in self.buckets:
            if self.state[b.index].anchor is not None:
                self._restore_anchor(b)

    def _restore_anchor(self, b) -> None:
        anchor = self.state[b.index].anchor
        whole = [(p, off, lo, hi) for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices)
                 if p.is_contiguous()]  # the rest: write_flat's logical order
        with torch.no_grad():
            copy_pieces([p.view(-1)[lo:hi] for p, _, lo, hi in whole],
                        [anchor[off:off + hi - lo] for _, off, lo, hi in whole])
            for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
                if not p.is_contiguous():
                    write_flat(p, lo, hi, anchor[off:off + hi - lo])

    # ----------------------------------------------------------------- end of step
    def _end_step(self):
        c = self.config
        size = self.transport.size()
        if self._measured_world != size:  # what was measured at another world size is not
            for seen in (self._measured, self._wire, self._measured_coding):  # this one's
                seen.clear()
            self._measured_world = size
        if self._at_target_density():  # what the cost model weighs is the steady state
            for index, dt in self.clock.bucket_compute.items():
                # this process's first step pays compilation and first allocations (a run
                # resumed just before its calibration priced them and went dense for good)
                if self._steps_here >= 1 or c.calibration_steps == 1:
                    self._measured[index] = min(self._measured.get(index, dt), dt)
        self.stats.end_step()
        self.clock.end_step()
        self.steps += 1
        self._steps_here += 1
        self._consolidated.clear()
        if c.cost_model == "time" and size > 1 and self.any_sparse and (
                self.steps == self.calibration_step()
                or (c.recalibrate_every and self.calibrated_at is not None
                    and self.steps - self.calibrated_at >= c.recalibrate_every)
                # resumed on, or grown or shrunk to, another world size: its choices priced
                # another number of payloads (replicated state: every rank sees the same)
                or (self.calibrated_at is not None
                    and self.calibrated_world not in (None, size))):
            self.calibrate()
        if c.rebalance_every and self.steps % c.rebalance_every == 0:
            for b in self.buckets:
                if b.sparse and self._rebalances(b):
                    self._rebalance(b)
        if c.verify_every and self.steps % c.verify_every == 0:
            named = list({n: p for b in self.buckets
                          for n, p in zip(b.names, b.params)}.items())
            named += [(f"downlink residual of bucket '{b.name}'", self.state[b.index]
                       .downlink.buffer) for b in self.buckets
                      if self.state[b.index].downlink.buffer is not None]
            safety.verify_replicas(self.transport, named, self.steps)

    def downlink_paths(self) -> dict:
        """How the CPU downlink selections were made since the start: from the watched
        positions (``incremental``) or by a scan of the residual (``scanned``)."""
        watches = [self.state[b.index].watch for b in self.buckets]
        return {"incremental": sum(w.incremental for w in watches),
                "scanned": sum(w.scanned for w in watches)}

    def reset_round(self):
        self.inflight.clear()
        self._params_at_anchor.clear()
        self._snapshots.clear()
        self._sparsifier_snapshot = None
