"""The drop-in ``DistributedOptimizer``: sparse allgather with error feedback, both directions.

Like Horovod's, the returned object is an instance of a subclass of the user's optimizer class
created on the fly, so ``isinstance(opt, torch.optim.SGD)`` still holds and the user's optimizer
state, hooks and schedulers are kept. Only the gradient exchange differs:

  hook (per parameter, during backward)   when a bucket is complete:
      acc = flat(grads) + uplink residual; idx = sparsifier(acc); residual keeps the rest;
      payload = header|idx|values; allgather_async(payload, name derived from parameter names)
  synchronize() (from step())
      buckets not launched yet (no gradient on this rank, or fewer backward passes) go now,
      with zeros for missing gradients, as Horovod does;
      decode P payloads in rank order; dense = sum; average;
      bidirectional: agg = dense + downlink residual; idx' = sparsifier(agg); p.grad <- agg[idx']
      (every rank computes the same idx' from the same bytes, so no server is needed).
"""
from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import NamedTuple, Optional

import torch

from . import aggregation, buckets as bucketing, costmodel, kernels, safety, wire
from .compat import Compression
from .dgc import MomentumCorrection, clip_local, warmup_density
from .feedback import Residual
from .sparsifiers import SelectionContext, Sparsifier, make_sparsifier
from .stats import CommunicationStats
from .transport import make_transport

STATE_KEY = "hvd_sparse"
STATE_FORMAT = 1


def _itemsize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class _InFlight(NamedTuple):
    """A bucket whose exchange has been launched."""

    kind: str  # "sparse" (allgather of payloads) or "dense" (allreduce)
    handle: object
    ctx: object  # the compressor's context
    nbytes: int  # this rank's bytes on the wire
    sparse_grads: list  # parameters whose gradient was sparse and is handed back sparse
    selected: int
    target: Optional[int]
    error: Optional[torch.Tensor]  # ||residual||^2 after selection (total-error statistic)


class _Options:
    """Validated configuration of one optimizer (everything that must agree across ranks)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _SparseDistributedOptimizer(torch.optim.Optimizer):
    """Methods grafted onto a subclass of the user's optimizer class (see ``DistributedOptimizer``).

    ``_hs_base`` is the user's class; its methods are called explicitly, never through ``super()``,
    because this body is copied into a class created at run time.
    """

    _hs_base = torch.optim.Optimizer

    # ----------------------------------------------------------------- set-up
    def _hs_init(self, named_parameters, transport, options: _Options, buckets):
        self._hs = options
        self._hs_transport = transport
        self._parameter_names = {p: n for n, p in named_parameters}
        self.backward_passes_per_step = options.backward_passes_per_step
        self._hs_buckets = buckets
        # Backward produces gradients last layer first: launching in that order lets an
        # order-matched transport start early buckets while backward is still running.
        self._hs_launch_order = list(reversed(buckets))
        self._hs_buckets_of = {}  # a parameter split across buckets belongs to several
        for b in buckets:
            for p in b.params:
                self._hs_buckets_of.setdefault(p, []).append(b)
        self._requires_update = set(self._hs_buckets_of)
        self._allreduce_delay = {p: self.backward_passes_per_step for p in self._hs_buckets_of}
        self._hs_ready = {b.index: 0 for b in buckets}
        self._hs_inflight = {}
        self._hs_touched = False
        self._synchronized = False
        self._should_synchronize = True
        sparse = [b for b in buckets if b.sparse]
        acc_dtype = aggregation.accumulation_dtype
        self._hs_uplink = {b.index: Residual(b.numel, acc_dtype(b.dtype)) for b in sparse}
        self._hs_downlink = {b.index: Residual(b.numel, acc_dtype(b.dtype)) for b in sparse}
        self._hs_velocity = ({b.index: MomentumCorrection(options.momentum_correction)
                              for b in sparse} if options.momentum_correction else {})
        self._hs_anchor = {}  # communication delay: parameters at the last exchange
        self._hs_local_count = 0
        self._hs_stats = CommunicationStats()
        self._hs_steps = 0
        self._hs_config_checked = not options.check_config
        self._hs_skip_step = False
        self._hs_snapshots = {}  # nonfinite="skip": residuals before this step, to roll back
        self._hs_local_nonfinite = []  # this rank's parameters that held NaN/Inf this step
        self._hs_hook_handles = []
        if transport.included():
            for p in self._hs_buckets_of:
                self._hs_hook_handles.append(
                    p.register_post_accumulate_grad_hook(self._hs_make_hook(p)))

    # ----------------------------------------------------------------- hooks
    def _hs_make_hook(self, p):
        def hook(_param):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            self._hs_touched = True
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0 and self._hs.local_steps == 1:
                complete = False
                for b in self._hs_buckets_of[p]:
                    self._hs_ready[b.index] += 1
                    complete |= self._hs_ready[b.index] == len(b.params)
                if complete:
                    self._hs_launch_ready()
        return hook

    def _hs_launch_ready(self):
        """Start the exchange of complete buckets.

        Name-matched transports (Horovod) start any complete bucket at once. Order-matched ones
        (MPI) start buckets only in the fixed launch order, so every rank issues the same
        sequence of collectives even when gradients arrive differently.
        """
        ordered = self._hs_transport.ordered
        for b in self._hs_launch_order:
            if b.index in self._hs_inflight:
                continue
            if self._hs_ready[b.index] == len(b.params):
                self._hs_launch(b, *self._hs_flat_grad(b))
            elif ordered:
                break

    # ----------------------------------------------------------------- one bucket
    def _hs_flat_grad(self, b):
        """Flatten the bucket's gradients (zeros where a parameter has none, as Horovod does)."""
        flats, sparse_grads = [], []
        for p, name, (lo, hi) in zip(b.params, b.names, b.slices):
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            g = p.grad
            if not (g.dtype.is_floating_point):
                raise TypeError(f"parameter '{name}' has a gradient of dtype {g.dtype}; "
                                "hvd_sparse sparsifies floating-point gradients only")
            if g.is_sparse:
                # A sparse gradient is sent as the dense vector it stands for and handed back
                # sparse (Horovod's sparse_as_dense), since selection needs the dense values.
                sparse_grads.append(p)
                g = g.to_dense()
            flats.append(g.reshape(-1)[lo:hi])
        flat = torch.cat(flats) if len(flats) > 1 else flats[0].clone()
        return flat, sparse_grads

    def _hs_context(self, b, direction):
        return SelectionContext(bucket=b.name, step=self._hs_steps,
                                rank=self._hs_transport.rank(), direction=direction)

    def _hs_density(self):
        o = self._hs
        return warmup_density(self._hs_steps, o.density, o.density_warmup_steps), \
            warmup_density(self._hs_steps, o.downlink_density, o.density_warmup_steps)

    def _hs_dense_mode(self, b):
        """How a bucket goes dense this step: ``None`` (it does not), ``"gather"`` or ``"reduce"``.

        Dense exchanges are gathered and summed in rank order when ``deterministic_dense``
        (bitwise-exact resume), else allreduced (fewer bytes at scale, but with 3 or more ranks
        its summation order may vary between runs). Buckets too small to sparsify and the dense
        warm-start always go dense; the cost model's fallback does when the chosen dense
        exchange would move no more bytes than the sparse allgather.
        """
        o = self._hs
        mode = "gather" if o.deterministic_dense else "reduce"
        if not b.sparse or self._hs_steps < o.dense_warmup_steps:
            return mode
        if o.dense_fallback:
            up, _ = self._hs_density()
            k = o.sparsifier.target_count(b.numel, up, self._hs_context(b, "up"))
            if k is not None and costmodel.prefer_dense(
                    b.numel, k, self._hs_transport.size(), _itemsize(b.index_dtype),
                    _itemsize(o.value_dtype or b.dtype), _itemsize(b.dtype),
                    dense_by="gather" if mode == "gather" else "ring"):
                return mode
        return None

    def _hs_describe(self) -> dict:
        """What must be the same on every rank (compared before the first exchange)."""
        o = self._hs
        return {
            "world_size": self._hs_transport.size(),
            "buckets": [{"name": b.name, "numel": b.numel, "dtype": str(b.dtype),
                         "sparse": b.sparse, "params": [
                             [n, list(p.shape), str(p.dtype), list(sl)]
                             for n, p, sl in zip(b.names, b.params, b.slices)]}
                        for b in self._hs_buckets],
            "options": {k: (repr(v) if not isinstance(v, (int, float, str, bool, type(None)))
                            else v)
                        for k, v in sorted(o.__dict__.items())
                        if k not in ("compression",)},
            "compression": getattr(o.compression, "__name__", type(o.compression).__name__),
        }

    def _hs_launch(self, b, flat, sparse_grads):
        o = self._hs
        if not self._hs_config_checked:
            self._hs_config_checked = True
            safety.check_same_config(self._hs_transport, self._hs_describe())
        name = f"hvd_sparse.{b.index}.{b.name}"
        if o.local_clip_norm is not None:
            flat = clip_local(flat, o.local_clip_norm, self._hs_transport.size())
        dense_mode = self._hs_dense_mode(b)
        if dense_mode:
            if b.sparse:  # dense warm-start: flush what error feedback holds into this exchange
                source = self._hs_velocity[b.index].apply(flat) if self._hs_velocity else flat
                flat = self._hs_uplink[b.index].accumulate(source).clone()
                self._hs_uplink[b.index].buffer.zero_()
                if self._hs_velocity:
                    self._hs_velocity[b.index].velocity.zero_()
            wire_t, ctx = o.compression.compress(flat)
            nbytes = wire_t.numel() * wire_t.element_size()
            if dense_mode == "gather":  # rank-order sum of gathered vectors: same bits every run
                handle = self._hs_transport.allgather_async(wire_t, name)
                kind = "dense_gather"
            else:
                prescale, postscale = (1.0 / o.predivide, o.predivide) if o.average else (1.0, 1.0)
                handle = self._hs_transport.allreduce_async(
                    wire_t, name, average=o.average, prescale=prescale, postscale=postscale)
                kind = "dense"
            self._hs_inflight[b.index] = _InFlight(kind, handle, ctx, nbytes, sparse_grads,
                                                   b.numel, None, None)
            return
        up_density, _ = self._hs_density()
        residual = self._hs_uplink[b.index]
        velocity = self._hs_velocity.get(b.index)
        ctx_sel = self._hs_context(b, "up")
        if o.nonfinite != "ignore" and not bool(torch.isfinite(flat).all()):
            # keep NaN/Inf out of the residual; tell every rank through the payload's flag
            self._hs_local_nonfinite += [n for n, p in zip(b.names, b.params)
                                         if not bool(torch.isfinite(p.grad).all())]
            empty, ctx = o.compression.compress(flat[:0].to(o.value_dtype or b.dtype))
            self._hs_send(b, name, torch.empty(0, dtype=torch.int64, device=flat.device), empty,
                          None, ctx, sparse_grads, 0, residual, nonfinite=True)
            return
        if o.nonfinite == "skip":
            self._hs_snapshots[b.index] = (residual.state(),
                                           velocity.state() if velocity else None)
        target = o.sparsifier.target_count(b.numel, up_density, ctx_sel)
        fused = kernels.fused_select(o.sparsifier, flat, residual.ensure(flat), up_density,
                                     ctx_sel) if self._hs_fusable(b) else None
        if fused is not None:
            # one fused pass did acc, selection and residual update (values go out exactly)
            idx, values = fused
            self._hs_send(b, name, idx, values, values, None, sparse_grads, target, residual)
            return
        acc = residual.accumulate(velocity.apply(flat) if velocity else flat)
        idx, values = o.sparsifier.compress(acc, up_density, ctx_sel)
        scaled = values.to(o.value_dtype or b.dtype)
        if o.average and o.predivide != 1.0:
            scaled = scaled * (1.0 / o.predivide)
        wire_values, ctx = o.compression.compress(scaled)
        sent = o.compression.decompress(wire_values, ctx).to(values.dtype)
        if o.average and o.predivide != 1.0:
            sent = sent * o.predivide
        residual.settle(idx, sent)  # what the wire lost (selection, rounding) stays for later
        if velocity:
            velocity.mask(idx)
        self._hs_send(b, name, idx, wire_values, sent, ctx, sparse_grads, target, residual)

    def _hs_fusable(self, b) -> bool:
        """The fused kernels apply when the wire carries the selected values unchanged."""
        o = self._hs
        acc_dtype = aggregation.accumulation_dtype(b.dtype)
        return (acc_dtype == b.dtype and o.compression is Compression.none
                and (o.value_dtype is None or o.value_dtype == b.dtype)
                and not (o.average and o.predivide != 1.0) and not self._hs_velocity)

    def _hs_send(self, b, name, idx, wire_values, sent, ctx, sparse_grads, target, residual,
                 nonfinite=False):
        o = self._hs
        error = residual.energy() if o.track_error and residual.buffer is not None else None
        payload = wire.encode(idx, wire_values, index_dtype=b.index_dtype, tag=b.tag,
                              numel=b.numel, index_coding=o.index_coding,
                              constant=o.sparsifier.constant_value, nonfinite=nonfinite)
        handle = self._hs_transport.allgather_async(payload, name)
        self._hs_inflight[b.index] = _InFlight("sparse", handle, ctx, payload.numel(),
                                               sparse_grads, idx.numel(), target, error)

    def _hs_receive(self, b):
        """Wait for a bucket's exchange and decode it; returns (dense result or payloads, bad
        ranks). Nothing is aggregated yet, so a non-finite flag can still cancel the step."""
        o = self._hs
        job = self._hs_inflight[b.index]
        size = self._hs_transport.size()
        received = self._hs_transport.wait(job.handle)
        if job.kind == "sparse":
            payloads = wire.decode_all(received, size, tag=b.tag, numel=b.numel, bucket=b.name)
            bad = [r for r, p in enumerate(payloads) if p.nonfinite]
            return (payloads, received.numel()), bad
        acc_dtype = aggregation.accumulation_dtype(b.dtype)
        if job.kind == "dense_gather":
            parts = received.view(size, -1)
            out = torch.zeros(b.numel, dtype=acc_dtype, device=parts.device)
            for r in range(size):  # rank order, never a reduction tree
                out.add_(o.compression.decompress(parts[r], job.ctx).to(acc_dtype))
            if o.average and size != 1:
                out.mul_(1.0 / size)
            received_bytes = (size - 1) * job.nbytes
            bad = [r for r in range(size) if not bool(torch.isfinite(parts[r].float()).all())] \
                if o.nonfinite != "ignore" else []
        else:
            out = o.compression.decompress(received, job.ctx)
            received_bytes = job.nbytes
            bad = ([-1] if not bool(torch.isfinite(out).all()) else []) \
                if o.nonfinite != "ignore" else []
        return (out, received_bytes), bad

    def _hs_apply(self, b, received):
        """Aggregate a received bucket, run the downlink step; return the flat update."""
        o = self._hs
        job = self._hs_inflight[b.index]
        size = self._hs_transport.size()
        acc_dtype = aggregation.accumulation_dtype(b.dtype)
        if job.kind != "sparse":
            out, received_bytes = received
            if b.sparse and self._hs.bidirectional:  # dense warm-start: flush the downlink too
                residual = self._hs_downlink[b.index]
                out = residual.accumulate(out.to(acc_dtype)).clone()
                residual.buffer.zero_()
            self._hs_stats.record(b.name, sent=job.nbytes, received=received_bytes,
                                  dense=b.nbytes, selected=b.numel, numel=b.numel,
                                  target=b.numel)
            return out
        payloads, gathered_bytes = received
        for p in payloads:
            p.values = o.compression.decompress(p.values, job.ctx)
        device = b.params[0].device
        dense = aggregation.aggregate(payloads, b.numel, acc_dtype, device)
        scale = (o.predivide / size) if o.average else 1.0
        if scale != 1.0:
            dense.mul_(scale)
        ctx_down = self._hs_context(b, "down")
        o.sparsifier.observe(dense, self._hs_context(b, "up"))
        o.downlink_sparsifier.observe(dense, ctx_down)
        if o.bidirectional:
            residual = self._hs_downlink[b.index]
            down_density = self._hs_density()[1]
            # the downlink sends values unchanged, so the fused kernels apply whenever the
            # method has a fused form (same result as accumulate + compress + settle)
            fused = kernels.fused_select(o.downlink_sparsifier, dense, residual.ensure(dense),
                                         down_density, ctx_down)
            if fused is not None:
                idx, values = fused
            else:
                agg = residual.accumulate(dense)
                idx, values = o.downlink_sparsifier.compress(agg, down_density, ctx_down)
                residual.settle(idx, values)
            out = torch.zeros(b.numel, dtype=acc_dtype, device=device)
            out[idx] = values
            down_selected = idx.numel()
        else:
            out, down_selected = dense, None
        self._hs_stats.record(b.name, sent=job.nbytes, received=gathered_bytes - job.nbytes,
                              dense=b.nbytes, selected=job.selected, numel=b.numel,
                              target=job.target, error=job.error,
                              downlink_selected=down_selected)
        return out

    def _hs_nonfinite(self, bad: dict) -> None:
        """Some rank's gradient held NaN/Inf: raise, or skip the step, the same on every rank."""
        where = "; ".join(f"bucket '{name}' on rank(s) {ranks}" if ranks != [-1]
                          else f"bucket '{name}' (after the allreduce)"
                          for name, ranks in bad.items())
        mine = f" (this rank: {', '.join(self._hs_local_nonfinite)})" \
            if self._hs_local_nonfinite else ""
        if self._hs.nonfinite == "raise":
            raise safety.NonFiniteGradientError(
                f"non-finite gradient at step {self._hs_steps}: {where}{mine}. Nothing of it "
                "entered the residuals on the rank that saw it. Pass nonfinite='skip' to skip "
                "such steps on all ranks instead (as a loss scaler does).")
        # skip: roll the residuals back to before this step, on every rank, and drop the grads
        for index, (res, vel) in self._hs_snapshots.items():
            self._hs_uplink[index].load(res)
            if vel is not None or index in self._hs_velocity:
                self._hs_velocity[index].load(vel)
        for b in self._hs_buckets:
            for p in b.params:
                if p.grad is not None:
                    p.grad = torch.zeros_like(p) if p.grad.is_sparse else p.grad.zero_()
        self._hs_skip_step = True
        self._hs_stats.skipped += 1
        warnings.warn(f"skipping step {self._hs_steps} on every rank: non-finite gradient in "
                      f"{where}{mine}")

    def _hs_write_grads(self, b, out, sparse_grads):
        for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
            seg = out[off:off + hi - lo].to(p.dtype)
            if p in sparse_grads:  # handed back sparse, as Horovod's sparse_as_dense does
                dense = p.grad.to_dense() if p.grad.is_sparse else p.grad
                dense.reshape(-1)[lo:hi] = seg
                p.grad = dense.to_sparse()
            else:
                if not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                p.grad.view(-1)[lo:hi].copy_(seg)

    def _hs_exchange_all(self, write):
        """Launch what is not in flight, finish every bucket in order, hand each result on."""
        for b in self._hs_launch_order:
            if b.index not in self._hs_inflight:
                self._hs_launch(b, *self._hs_flat_grad(b))
        try:
            received, bad = {}, {}
            for b in self._hs_buckets:
                received[b.index], bad_ranks = self._hs_receive(b)
                if bad_ranks:
                    bad[b.name] = bad_ranks
            if bad:
                self._hs_nonfinite(bad)
            else:
                for b in self._hs_buckets:
                    write(b, self._hs_apply(b, received[b.index]),
                          self._hs_inflight[b.index].sparse_grads)
        finally:
            self._hs_reset_round()
            self._hs_snapshots.clear()
            self._hs_local_nonfinite = []
        self._hs_stats.end_step()
        self._hs_steps += 1
        every = self._hs.verify_every
        if every and self._hs_steps % every == 0:
            named = list({n: p for b in self._hs_buckets
                          for n, p in zip(b.names, b.params)}.items())
            named += [(f"downlink residual of bucket '{b.name}'", r.buffer)
                      for b in self._hs_buckets
                      for r in [self._hs_downlink.get(b.index)] if r is not None
                      and r.buffer is not None]
            safety.verify_replicas(self._hs_transport, named, self._hs_steps)

    # ----------------------------------------------------------------- Horovod's API
    def synchronize(self):
        """Finish every bucket's exchange and write the result into ``p.grad``."""
        if not self._hs_transport.included():
            self._synchronized = True
            return
        if self._hs.local_steps > 1:
            raise RuntimeError("synchronize() exchanges gradients, but this optimizer was made "
                               "with local_steps > 1 and exchanges weight updates from step()")
        self._hs_exchange_all(self._hs_write_grads)
        self._synchronized = True

    def _hs_reset_round(self):
        self._hs_inflight.clear()
        self._hs_touched = False
        for k in self._hs_ready:
            self._hs_ready[k] = 0
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    @contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip synchronisation after an explicit ``synchronize()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._hs.local_steps > 1:
            return self._hs_local_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        if self._hs_skip_step:  # a non-finite gradient somewhere: no update on any rank
            self._hs_skip_step = False
            return None
        return self._hs_base.step(self, closure)

    def _hs_flat_params(self, b):
        return torch.cat([p.detach().reshape(-1)[lo:hi] for p, (lo, hi) in
                          zip(b.params, b.slices)]).to(
            aggregation.accumulation_dtype(b.dtype))

    def _hs_local_step(self, closure):
        """Communication delay (SBC): local steps, then exchange the accumulated weight update.

        Every ``local_steps`` steps, each bucket's change since the last exchange is sparsified
        (with error feedback) and averaged like a gradient, and all ranks restart from
        ``anchor + averaged change``, which is bitwise the same everywhere.
        """
        if not self._hs_anchor:
            self._hs_anchor = {b.index: self._hs_flat_params(b) for b in self._hs_buckets}
        result = self._hs_base.step(self, closure)
        self._hs_reset_round()
        self._hs_local_count += 1
        if self._hs_local_count % self._hs.local_steps == 0 and self._hs_transport.included():
            for b in self._hs_launch_order:
                self._hs_launch(b, self._hs_flat_params(b) - self._hs_anchor[b.index], [])
            self._hs_exchange_all(self._hs_apply_delta)
        return result

    def _hs_apply_delta(self, b, out, _sparse):
        new = self._hs_anchor[b.index] + out.to(self._hs_anchor[b.index].dtype)
        self._hs_anchor[b.index] = new
        with torch.no_grad():
            for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
                p.view(-1)[lo:hi].copy_(new[off:off + hi - lo])

    def zero_grad(self, *args, **kwargs):
        if self._hs_touched or self._hs_inflight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return self._hs_base.zero_grad(self, *args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        if int(passes) <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = int(passes)
        self._hs.backward_passes_per_step = int(passes)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def communication_stats(self) -> dict:
        """This rank's bytes sent/received, dense-equivalent bytes and selected counts.

        Top-level keys describe the last synchronised step; ``totals`` sums every step.
        """
        return self._hs_stats.as_dict()

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self):
        sd = self._hs_base.state_dict(self)
        sd[STATE_KEY] = self._hs_state()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop(STATE_KEY, None)
        self._hs_reset_round()
        self._synchronized = False
        self._should_synchronize = True
        self._hs_base.load_state_dict(self, state_dict)
        if extra is not None:
            self._hs_load(extra)

    def _hs_state(self) -> dict:
        t = self._hs_transport
        return {
            "format": STATE_FORMAT,
            "world_size": t.size(),
            "rank": t.rank(),
            "steps": self._hs_steps,
            "local_count": self._hs_local_count,
            "buckets": {b.name: {"numel": b.numel,
                                 "uplink": self._hs_uplink[b.index].state(),
                                 "downlink": self._hs_downlink[b.index].state(),
                                 "velocity": (self._hs_velocity[b.index].state()
                                              if self._hs_velocity else None)}
                        for b in self._hs_buckets if b.sparse},
            "anchors": {b.name: self._hs_anchor[b.index].clone()
                        for b in self._hs_buckets if b.index in self._hs_anchor},
            "sparsifier": self._hs.sparsifier.state_dict(),
            "downlink_sparsifier": self._hs.downlink_sparsifier.state_dict(),
            "stats": self._hs_stats.state_dict(),
        }

    def _hs_load(self, extra: dict) -> None:
        """Restore hvd_sparse's state. The rule for a state saved elsewhere:

        * saved by this rank in a job of the same size: everything is restored exactly;
        * saved by another rank, or by a job of another size (a rank-0 checkpoint loaded on all
          ranks, ``broadcast_optimizer_state``, ``hvd.elastic`` sync after workers came or went):
          the replicated parts (downlink residuals, counters, sparsifier state) are restored and
          this rank keeps its *own* uplink residuals as they are in memory (zeros in a fresh
          process). The uplink residual of a rank that is gone (a departed elastic worker) is
          lost: its unsent gradient mass is dropped, a bounded loss of small entries.
        """
        t = self._hs_transport
        if extra.get("format") != STATE_FORMAT:
            raise ValueError(f"hvd_sparse state has format {extra.get('format')}, "
                             f"this version reads {STATE_FORMAT}")
        saved = extra["buckets"]
        mine = {b.name: b for b in self._hs_buckets if b.sparse}
        if set(saved) != set(mine):
            raise ValueError("the checkpoint's sparse buckets differ from this optimizer's: "
                             f"missing {sorted(set(mine) - set(saved))}, "
                             f"unexpected {sorted(set(saved) - set(mine))}")
        for name, b in mine.items():
            if saved[name]["numel"] != b.numel:
                raise ValueError(f"bucket '{name}' has {saved[name]['numel']} entries in the "
                                 f"checkpoint and {b.numel} here")
        own = extra["rank"] == t.rank() and extra["world_size"] == t.size()
        fresh = all(self._hs_uplink[b.index].buffer is None for b in mine.values())
        if not own and fresh and any(v["uplink"] is not None for v in saved.values()):
            warnings.warn(
                f"hvd_sparse state from rank {extra['rank']} of {extra['world_size']} loaded on "
                f"rank {t.rank()} of {t.size()}: downlink residuals and counters restored; this "
                "rank's uplink residuals start from zero (save one state dict per rank to keep "
                "them)")
        for name, b in mine.items():
            self._hs_downlink[b.index].load(saved[name]["downlink"])
            if own:
                self._hs_uplink[b.index].load(saved[name]["uplink"])
                if self._hs_velocity:
                    self._hs_velocity[b.index].load(saved[name].get("velocity"))
        anchors = extra.get("anchors", {})
        self._hs_anchor = {b.index: anchors[b.name].clone() for b in self._hs_buckets
                           if b.name in anchors}
        self._hs_local_count = int(extra.get("local_count", 0))
        self._hs.sparsifier.load_state_dict(extra.get("sparsifier", {}))
        self._hs.downlink_sparsifier.load_state_dict(extra.get("downlink_sparsifier", {}))
        self._hs_steps = int(extra.get("steps", 0))
        self._hs_stats.load_state_dict(extra.get("stats", {}))


def _check_density(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def _named_parameters(optimizer, named_parameters):
    """Horovod's checks on ``named_parameters``, with its messages."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                            for i, group in enumerate(optimizer.param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in named_parameters]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    all_ids = {id(v) for g in optimizer.param_groups for v in g["params"]}
    unnamed = all_ids - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
    return named_parameters


def _compressor(compression):
    if compression is None:
        return Compression.none
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression={compression!r} has no compress/decompress; pass one of "
                        "hvd.Compression.none or hvd.Compression.fp16 or a Compressor class")
    return compression


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None,
                         *, density=0.01, bidirectional=True, downlink_density=None,
                         sparsifier="topk", threshold=None, total_steps=None, min_density=None,
                         max_density=None, sparsifier_options=None, index_coding=None,
                         momentum_correction=0.0, local_clip_norm=None, density_warmup_steps=0,
                         dense_warmup_steps=0, local_steps=1, track_error=True,
                         deterministic_dense=True, dense_fallback=True, value_dtype=None,
                         nonfinite="raise", verify_every=0, check_config=True,
                         scope="tensor", bucket_cap_mb=25.0, min_sparse_numel=1024,
                         max_bucket_numel=None,
                         transport=None, **unknown):
    """Wrap ``optimizer`` so gradients are exchanged sparsely (drop-in for Horovod's).

    Horovod's keywords keep their meaning: ``compression`` sets the value type on the wire (its
    rounding error is kept in the residual), ``op`` is ``Average`` or ``Sum`` (Adasum is refused:
    it needs whole gradients), ``gradient_predivide_factor`` splits the average as in Horovod,
    ``groups``/``num_groups`` define the buckets, ``sparse_as_dense`` is what hvd_sparse always
    does with sparse gradients, ``process_set`` restricts the exchange.

    Sparse options: ``density`` (uplink fraction kept per bucket), ``bidirectional`` (re-sparsify
    the aggregate on every rank, with a replicated residual), ``downlink_density`` (``None``: same
    as ``density``), ``sparsifier`` (name or :class:`hvd_sparse.Sparsifier`), ``scope``
    (``"tensor"``, ``"model"`` or ``"bucket"`` with ``bucket_cap_mb``), ``min_sparse_numel``
    (smaller buckets are allreduced dense), ``max_bucket_numel`` (larger buckets, and
    parameters, are split into several), ``transport`` (a :class:`hvd_sparse.transport.Transport`;
    default Horovod's collectives).

    Method keywords: ``threshold`` (for ``"threshold"``), ``total_steps``, ``min_density``,
    ``max_density`` (for ``"adaptive"``), ``sparsifier_options`` (any other constructor keywords),
    ``index_coding`` (``"plain"`` or ``"golomb"``; default Golomb for ``"sbc"``).
    DGC's aids: ``momentum_correction`` (velocity factor, with masking; use a base optimizer
    without momentum), ``local_clip_norm``, ``density_warmup_steps``, ``dense_warmup_steps``.
    ``local_steps`` > 1 is SBC's communication delay: that many local steps, then the accumulated
    weight update is exchanged instead of gradients. ``track_error`` keeps the per-step
    compression error ``||acc - sent||^2`` in the statistics (one extra pass per bucket).
    ``deterministic_dense`` (default) exchanges dense buckets by allgather and a rank-order sum,
    so results do not depend on how Horovod fuses and reduces (with 3 or more ranks an allreduce's
    summation order, hence its rounding, can change from run to run); ``False`` uses
    Horovod's allreduce, which moves fewer bytes for large dense buckets.
    ``dense_fallback`` (default) sends a bucket by dense allreduce, error feedback included,
    when the cost model (:mod:`hvd_sparse.costmodel`) says the allgather would move more bytes.
    ``value_dtype`` (``torch.float16``/``bfloat16``/``float32``) sets the value type on the wire;
    the rounding error stays in the residual.

    Safety: ``nonfinite`` (``"raise"``, default, or ``"skip"`` the step on every rank, or
    ``"ignore"``) for NaN/Inf gradients, which never enter a residual; ``verify_every=N``
    checks every N steps that parameters and downlink residuals are bitwise equal on all ranks;
    ``check_config`` (default) compares models and options across ranks before the first
    exchange (:mod:`hvd_sparse.safety`).
    """
    if unknown:
        raise TypeError("hvd_sparse.DistributedOptimizer got unexpected keyword argument(s): "
                        + ", ".join(sorted(unknown)))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_sparse_optimizer(optimizer):
        raise TypeError("optimizer is already an hvd_sparse.DistributedOptimizer")
    from . import compat

    density = _check_density("density", density)
    downlink_density = density if downlink_density is None else _check_density(
        "downlink_density", downlink_density)
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional must be True or False, got {bidirectional!r}")
    op = compat.Average if op is None else op
    if op == compat.Adasum:
        raise ValueError("op=Adasum is not supported by hvd_sparse.DistributedOptimizer: Adasum "
                         "combines whole gradients pairwise and has no sparse form; use "
                         "op=hvd.Average or op=hvd.Sum, or horovod.torch.DistributedOptimizer")
    if op != compat.Average and op != compat.Sum:
        raise ValueError(f"op={op!r} is not supported; use hvd.Average or hvd.Sum")
    average = op == compat.Average
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor,
                                                                     (int, float)) \
            or gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be a positive number, "
                         f"got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and not average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.", DeprecationWarning)
        groups = num_groups if groups is None else groups
    if groups is not None:
        if isinstance(groups, bool) or not (isinstance(groups, list)
                                            or (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or "
                             "a list of list of torch.Tensor.")
        if isinstance(groups, list):
            seen = set()
            for g in groups:
                for p in g:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")
    method_options = dict(sparsifier_options or {})
    for key, value in (("threshold", threshold), ("total_steps", total_steps),
                       ("min_density", min_density), ("max_density", max_density)):
        if value is not None:
            method_options[key] = value
    up = make_sparsifier(sparsifier, **method_options)
    # The downlink gets its own instance: a stateful method keeps separate state per direction.
    down = copy.deepcopy(up)
    if index_coding is None:
        index_coding = "golomb" if up.constant_value else "plain"
    if index_coding not in wire.INDEX_CODINGS:
        raise ValueError(f"index_coding must be one of {wire.INDEX_CODINGS}, got {index_coding!r}")
    if isinstance(momentum_correction, bool) or not isinstance(momentum_correction, (int, float)) \
            or not 0.0 <= momentum_correction < 1.0:
        raise ValueError(f"momentum_correction must be in [0, 1), got {momentum_correction!r}")
    if local_clip_norm is not None and not (isinstance(local_clip_norm, (int, float))
                                            and local_clip_norm > 0):
        raise ValueError(f"local_clip_norm must be a positive number, got {local_clip_norm!r}")
    for key, value in (("density_warmup_steps", density_warmup_steps),
                       ("dense_warmup_steps", dense_warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key} must be a non-negative int, got {value!r}")
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
    if value_dtype is not None and value_dtype not in (torch.float16, torch.bfloat16,
                                                       torch.float32, torch.float64):
        raise ValueError(f"value_dtype must be a floating torch dtype, got {value_dtype!r}")
    if nonfinite not in ("raise", "skip", "ignore"):
        raise ValueError(f"nonfinite must be 'raise', 'skip' or 'ignore', got {nonfinite!r}")
    if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
        raise ValueError(f"verify_every must be a non-negative int, got {verify_every!r}")
    if local_steps > 1 and backward_passes_per_step != 1:
        raise ValueError("local_steps > 1 (communication delay) and backward_passes_per_step > 1 "
                         "cannot be combined")
    compression = _compressor(compression)
    if isinstance(min_sparse_numel, bool) or not isinstance(min_sparse_numel, int) \
            or min_sparse_numel < 0:
        raise ValueError(f"min_sparse_numel must be a non-negative int, got {min_sparse_numel!r}")

    named = _named_parameters(optimizer, named_parameters)
    name_of = {id(p): n for n, p in named}
    trainable = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue  # frozen: not exchanged, as in Horovod
            if not p.dtype.is_floating_point:
                raise TypeError(f"parameter '{name_of[id(p)]}' has dtype {p.dtype}; hvd_sparse "
                                "sparsifies floating-point gradients only")
            trainable.append((name_of[id(p)], p))
    if max_bucket_numel is not None and (isinstance(max_bucket_numel, bool) or
                                         not isinstance(max_bucket_numel, int) or
                                         max_bucket_numel <= 0):
        raise ValueError(f"max_bucket_numel must be a positive int, got {max_bucket_numel!r}")
    plan = bucketing.plan_buckets(trainable, scope=scope, bucket_cap_mb=bucket_cap_mb,
                                  groups=groups, min_sparse_numel=min_sparse_numel,
                                  max_bucket_numel=max_bucket_numel)
    transport = make_transport(transport, process_set)

    base = type(optimizer)
    body = {k: v for k, v in _SparseDistributedOptimizer.__dict__.items()
            if k not in ("__dict__", "__weakref__")}
    body["_hs_base"] = base
    cls = type(base.__name__, (base,), body)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # same param groups, state and hooks
    options = _Options(density=density, downlink_density=downlink_density,
                       bidirectional=bidirectional, sparsifier=up, downlink_sparsifier=down,
                       average=average, predivide=float(gradient_predivide_factor),
                       compression=compression, sparse_as_dense=sparse_as_dense,
                       backward_passes_per_step=backward_passes_per_step,
                       index_coding=index_coding, momentum_correction=float(momentum_correction),
                       local_clip_norm=local_clip_norm,
                       density_warmup_steps=density_warmup_steps,
                       dense_warmup_steps=dense_warmup_steps, local_steps=local_steps,
                       track_error=bool(track_error), deterministic_dense=bool(deterministic_dense),
                       dense_fallback=bool(dense_fallback), value_dtype=value_dtype,
                       nonfinite=nonfinite, verify_every=verify_every,
                       check_config=bool(check_config))
    wrapped._hs_init(named, transport, options, plan)
    return wrapped


def is_sparse_optimizer(obj) -> bool:
    """True for optimizers returned by :func:`DistributedOptimizer`."""
    return isinstance(obj, torch.optim.Optimizer) and hasattr(obj, "_hs_transport")
