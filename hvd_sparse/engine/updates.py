"""Exchanged weight changes: each rank steps its own optimizer, the change since the last
exchange (``params - anchor``) is what is sparsified and averaged.

Used under ``exchange="update"`` (the default for adaptive optimizers) and ``local_steps > 1``
(communication delay, SBC's). Every rank restarts from ``anchor + averaged change``, so the
replicas stay bitwise identical; changes made to the parameters outside the optimizer are found
by a few probed positions and re-anchored (:meth:`UpdateExchange.follow_outside_changes`).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch

from .. import aggregation, kernels, safety
from ..kernels import cpu
from .flat import copy_pieces, finite_each, numpy_view, write_flat

#: received weight changes go straight into the anchor while they number at most 1/8 of the
#: bucket: a random touch costs about as much as 20-30 sequential entries, and the full-length
#: path makes four passes
SPARSE_DELTA_SHARE = 8


def probe_positions(n: int, count: int) -> torch.Tensor:
    """Up to ``count`` evenly spaced positions of a vector of ``n`` entries, first and last
    included, in integer arithmetic: a float32 ``linspace`` rounds ``n - 1`` up to ``n``
    beyond 2**24 entries (a 51.2M-entry embedding probed out of bounds)."""
    m = min(n, count)
    if m <= 1:
        return torch.zeros(m, dtype=torch.long)
    return torch.unique(torch.arange(m, dtype=torch.long) * (n - 1) // (m - 1))


class _Probes(NamedTuple):
    """follow_outside_changes' positions for the buckets of one (device, dtype)."""

    buckets: list
    pieces: list  # (parameter, its probed flat positions)
    flats: list  # per bucket: the same positions in its anchor
    owner: torch.Tensor  # per position: the index of its bucket in ``buckets``
    numpy: Optional[tuple] = None  # on the CPU: (pieces, flats, owner) with numpy positions


class UpdateExchange:
    """The :class:`~hvd_sparse.engine.pipeline.Engine` methods of the update exchange."""

    def flat_params(self, b):
        return torch.cat([p.detach().reshape(-1)[lo:hi] for p, (lo, hi) in
                          zip(b.params, b.slices)]).to(aggregation.accumulation_dtype(b.dtype))

    def weight_change(self, b):
        """``params - anchor`` of a bucket, written into its reused flat buffer (no full-size
        allocation per exchange)."""
        anchor = self.state[b.index].anchor
        out = self.state[b.index].flat_buffer(b.numel, anchor.dtype, anchor.device)
        if anchor.device.type != "cpu" and len(b.params) > 1:
            # a GPU: one multi-tensor copy and one subtraction, not a launch per parameter
            # (two passes over the bucket where one would do: cheap next to the launches)
            copy_pieces([out[off:off + hi - lo] for off, (lo, hi) in zip(b.offsets, b.slices)],
                        [p.detach().reshape(-1)[lo:hi] for p, (lo, hi) in
                         zip(b.params, b.slices)])
            return out.sub_(anchor)
        for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
            n = hi - lo
            torch.sub(p.detach().reshape(-1)[lo:hi], anchor[off:off + n], out=out[off:off + n])
        return out

    def clip_gradients(self) -> None:
        """DGC's local gradient clipping where weight updates are exchanged: each bucket's
        ``p.grad`` scaled to L2 norm at most ``local_clip_norm / sqrt(P)`` before the wrapped
        optimizer's local step. Clipping the weight change instead did nothing (its norm is
        far below the limit; Adam's moments saw the unclipped spike)."""
        limit = self.config.local_clip_norm / math.sqrt(self.transport.size())
        for b in self.buckets:
            # a bucket's slices are positions in logical order, which a transposed or
            # channels_last gradient's storage is not: its norm is read in that order (the
            # same bits as a row-major run's) and it is scaled in its own layout
            parts = [(p.grad, lo, hi) for p, (lo, hi) in zip(b.params, b.slices)
                     if p.grad is not None and not p.grad.is_sparse]
            if not parts:
                continue
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.reshape(-1)[lo:hi].float()) for g, lo, hi in parts]))
            scale = torch.clamp(limit / (norm + 1e-12), max=1.0)
            for g, lo, hi in parts:
                if g.is_contiguous():  # in place; write_flat would take a copy
                    g.view(-1)[lo:hi].mul_(scale.to(g.dtype))
                else:
                    write_flat(g, lo, hi, g.reshape(-1)[lo:hi] * scale.to(g.dtype))

    def exchange_due(self) -> bool:
        """Will the next local step be followed by an exchange?"""
        return (self.local_count + 1) % self.config.local_steps == 0

    def local_step_done(self) -> bool:
        """Count a local step; True when it is time to exchange the weight change."""
        self.local_count += 1
        return self.local_count % self.config.local_steps == 0

    def ensure_anchors(self):
        for b in self.buckets:
            st = self.state[b.index]
            if st.anchor is None:
                st.anchor = self.flat_params(b)

    # positions checked per parameter, and parameters per bucket, by follow_outside_changes
    PROBES_PER_PARAM, PROBED_PARAMS = 8, 16

    def follow_outside_changes(self) -> None:
        """Before the first local step after an exchange, where each bucket's parameters
        equal its anchor bit for bit unless something outside the optimizer changed them
        (weights reloaded into the model, a clip after each step, ``p.data`` writes): a bucket
        found changed is re-anchored at its current parameters, so the change stands, as it
        does under Horovod, instead of being taken for part of this rank's update (then sent
        back through error feedback, which undid a reload and let a clip push the weights
        away). Checked at a few fixed positions of up to 16 parameters per bucket (no pass
        over the parameters; a change that misses every position is exchanged as before),
        the same positions on every rank, so identical replicas decide alike without a
        collective; one gather per parameter and one read per device for all buckets."""
        if self.local_count % self.config.local_steps:
            return
        if self._probes is None:
            self._probes = self._probe_plan()
        for buckets, pieces, flats, owner, as_numpy in self._probes:
            views = [self._view(p) for p, _ in pieces] if as_numpy else [None]
            if all(v is not None for v in views):
                pieces_np, flats_np, owner_np = as_numpy
                # numpy views: a fancy index per parameter costs far less than a torch op
                got = np.concatenate([v[local] for v, (_, local) in zip(views, pieces_np)])
                want = np.concatenate([
                    self._view(self.state[b.index].anchor, ("anchor", b.index))[flat]
                    for b, flat in zip(buckets, flats_np)]).astype(got.dtype)
                changed = np.bincount(owner_np, weights=got != want,
                                      minlength=len(buckets)).tolist()
            else:
                got = torch.cat([torch.take(p.detach(), local) for p, local in pieces])
                want = torch.cat([self.state[b.index].anchor[flat].to(got.dtype)
                                  for b, flat in zip(buckets, flats)])
                changed = torch.zeros(len(buckets), dtype=torch.int32, device=got.device)
                changed = changed.index_add_(0, owner, (got != want).to(torch.int32)).tolist()
            for b, c in zip(buckets, changed):
                if c:
                    self.outside_changes += 1
                    anchor = self.state[b.index].anchor
                    for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
                        anchor[off:off + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])

    def _view(self, t, key=None):
        """:func:`_numpy_view` of ``t`` (a parameter, or a bucket's anchor under ``key``),
        kept while ``t`` keeps its memory (made anew after ``p.data = ...`` or a reload)."""
        key = t if key is None else key
        ptr = t.data_ptr()
        kept = self._views.get(key)
        if kept is None or kept[0] != ptr:
            kept = self._views[key] = (ptr, numpy_view(t))
        return kept[1]

    def _probe_plan(self):
        """Per (device, dtype) of the buckets: the buckets, each probed parameter with its
        positions, each bucket's anchor positions, and which bucket each position is of."""
        groups = {}
        for b in self.buckets:
            anchor = self.state[b.index].anchor
            pieces = list(zip(b.params, b.offsets, b.slices))
            g = groups.setdefault((anchor.device, b.dtype), ([], [], [], []))
            flat = []
            for p, off, (lo, hi) in pieces[::max(1, len(pieces) // self.PROBED_PARAMS)]:
                n = hi - lo
                local = probe_positions(n, self.PROBES_PER_PARAM).to(anchor.device)
                g[1].append((p, (local + lo).to(p.device)))
                flat.append(local + off)
                g[3].append(torch.full((local.numel(),), len(g[0]), dtype=torch.long,
                                       device=anchor.device))
            g[0].append(b)
            g[2].append(torch.cat(flat))
        out = []
        for bs, pieces, flats, owner in groups.values():
            owner = torch.cat(owner)
            as_numpy = ([(p, local.numpy()) for p, local in pieces], [f.numpy() for f in flats],
                        owner.numpy()) if owner.device.type == "cpu" else None
            out.append(_Probes(bs, pieces, flats, owner, as_numpy))
        return out

    def exchange_deltas(self, hold=()):
        """Every bucket's change since the last exchange, sparsified with error feedback and
        averaged like a gradient; all ranks restart from ``anchor + averaged change``.

        ``hold``: parameters frozen after wrapping (``requires_grad_(False)``). They end the
        exchange at their anchor, where the last exchange left them, on every rank: the
        averaged change would release into a layer the user stopped training what error
        feedback held from before (the gradient path zeroes what comes back for them)."""
        self.ensure_agreed()  # the anchors must be the same before the deltas are taken
        held = self._anchored_values(hold)
        flagged, self._flag_at_exchange = self._flag_at_exchange, False
        for b in self.launch_order:
            delta = None if flagged else self._weight_change_parts(b)
            flat = self.weight_change(b) if delta is None else delta[0]
            if flagged and self.mode(b):  # a local step saw NaN/Inf under "raise": every
                # rank must learn it, in the collective the others start for a dense bucket
                marked = flat.clone()
                marked.view(-1)[:1] = float("nan")
                self.launch(b, marked)
            elif flagged:
                self._send_nonfinite(b, flat, f"hvd_sparse.{b.index}.{b.name}", frozenset())
            else:
                self.launch(b, flat, delta=None if delta is None else delta[1:])
        self.finish("delta")
        with torch.no_grad():
            for b, p, off, lo, hi, values in held:
                self.state[b.index].anchor[off:off + hi - lo].copy_(values)
                write_flat(p, lo, hi, values)

    def goes_all_dense(self) -> bool:
        """Has the time cost model just sent every bucket dense (a fast link), so that each
        step's exchange is a dense average of the ranks' own updates?"""
        return self.config.cost_model == "time" and self.calibrated_at == self.steps \
            and all(self.state[b.index].mode == "dense" for b in self.buckets if b.sparse)

    def release_updates(self, hold=()) -> None:
        """Collective: what error feedback still holds of the exchanged updates goes into the
        parameters now, averaged over the ranks (the downlink residual, the same everywhere,
        as it is), and the anchors and residuals are dropped: the step that follows
        exchanges gradients. ``hold``: parameters frozen after wrapping, which keep their
        values (as :meth:`exchange_deltas` keeps them)."""
        held = {id(p) for p in hold}
        with torch.no_grad():
            for b in self.buckets:
                st = self.state[b.index]
                mass = [r.buffer for r in (st.uplink, st.downlink) if r.buffer is not None]
                if st.uplink.buffer is not None:
                    mine = st.uplink.buffer.clone()
                    mass[0] = self.transport.wait(self.transport.allreduce_async(
                        mine, f"hvd_sparse.release.{b.index}.{b.name}", average=True))
                for flat in mass:
                    for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
                        if id(p) in held:
                            continue
                        seg = flat[off:off + hi - lo].to(p.dtype)
                        write_flat(p, lo, hi, p.detach().reshape(-1)[lo:hi] + seg)
                for r in (st.uplink, st.downlink):
                    r.load(None)
                st.spare = None
                st.anchor = None
        self.agreement_due = True

    def _anchored_values(self, params):
        """(bucket, parameter, offset, lo, hi, a copy of its anchor) for each of ``params``."""
        ids = {id(p) for p in params}
        if not ids:
            return []
        held = []
        for b in self.buckets:
            anchor = self.state[b.index].anchor
            if anchor is None:
                continue
            for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
                if id(p) in ids:
                    held.append((b, p, off, lo, hi, anchor[off:off + hi - lo].clone()))
        return held

    def take_sent(self):
        """(bucket, positions this rank sent in it) of the last exchange's sparse buckets, for
        ``momentum_masking``; forgotten once taken."""
        sent, self._sent = self._sent, {}
        return [(b, sent[b.index]) for b in self.buckets if b.index in sent]

    def _weight_change_parts(self, b):
        """A bucket's weight change left as ``params - anchor`` for the uplink scan to form
        where it reads them (16 bytes per entry with the residual and ``acc``, against 24 for
        the change written first): (the unfilled flat buffer, [(piece, offset)], anchor), or
        None where :meth:`weight_change` is needed (the conditions of
        :meth:`_gradient_parts` but a clip, which acts on gradients, and float32 parameters
        and anchor)."""
        st = self.state[b.index]
        if not self._acc_in_scan or st.anchor is None or st.anchor.dtype != torch.float32 \
                or st.velocity is not None \
                or not cpu.available() or cpu._threads() != 1:
            return None
        parts = []
        for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous() \
                    or kernels.backend_for(p) != "numba":
                return None
            parts.append((p.detach().reshape(-1)[lo:hi], off))
        flat = st.flat_buffer(b.numel, torch.float32, st.anchor.device)
        return flat, parts, st.anchor

    def _nonfinite_gradients(self) -> list:
        """Names of this rank's parameters whose gradient holds NaN/Inf (one read of each)."""
        named = [(n, p.grad.coalesce().values() if p.grad.is_sparse else p.grad)
                 for b in self.buckets for n, p in zip(b.names, b.params) if p.grad is not None]
        return [n for (n, _), ok in zip(named, finite_each([g for _, g in named])) if not ok]

    def agree_gradients_finite(self) -> None:
        """``synchronize()`` when updates are exchanged: one tiny allreduce says whether any
        rank's gradient holds NaN/Inf; if so, by ``nonfinite``: every rank's gradients become
        NaN ("propagate", so each loss scaler skips the step and lowers its scale) or zero
        ("skip", the local step is then skipped everywhere), or every rank raises."""
        c = self.config
        self.skip_update = self.finite_agreed = False
        if c.nonfinite == "ignore" or self.transport.size() == 1 and c.nonfinite != "raise":
            return
        params = [p for b in self.buckets for p in b.params if p.grad is not None]
        bad = self._nonfinite_gradients()
        flag = torch.tensor([float(len(bad) > 0)], dtype=torch.float32)
        if self.transport.size() > 1:
            flag = self._vote(bool(bad))
        if float(flag.sum()) == 0:
            self.finite_agreed = True  # the local step need not read the gradients again
            return
        mine = f" (this rank: {', '.join(bad)})" if bad else ""
        if c.nonfinite == "raise":
            raise safety.NonFiniteGradientError(
                f"non-finite gradient at step {self.steps} on {int(flag.sum())} rank(s){mine}")
        fill = float("nan") if c.nonfinite == "propagate" else 0.0
        for p in params:
            if p.grad.is_sparse:
                p.grad = torch.full_like(p, fill)
            else:
                p.grad.fill_(fill)
        self.stats.nonfinite_steps += 1
        # the step() that follows (if any: a loss scaler skips it, except with a fused
        # optimizer, which steps with found_inf set) neither steps nor exchanges, on any rank
        self.skip_update = True
        self.stats.skipped += 1

    def _vote(self, bad: bool) -> torch.Tensor:
        """Every rank's say on "non-finite" summed, with this optimizer's fingerprint checked
        (:func:`hvd_sparse.safety.same_by_sums`: one allreduce, which ``join`` serves)."""
        same, (votes,) = safety.same_by_sums(self.transport, self.fingerprint,
                                             "hvd_sparse.finite", extra=(float(bad),))
        if not same:
            raise safety.exchange_order_error("gradient check")
        return torch.tensor([votes], dtype=torch.float32)

    def local_step_finite(self) -> bool:
        """Before a local step (communication delay): are this rank's gradients finite? If
        not, the caller skips the step on this rank only, so no NaN/Inf reaches the weights;
        under "raise" every rank raises at the next exchange. Always True for "ignore"."""
        if self.config.nonfinite == "ignore":
            return True
        if self.finite_agreed:  # every rank's gradient was found finite this round
            self.finite_agreed = False
            return True
        bad = self._nonfinite_gradients()
        if not bad:
            return True
        self._local_nonfinite += bad
        self._flag_at_exchange |= self.config.nonfinite == "raise"
        for b in self.buckets:
            for p in b.params:
                if p.grad is not None:
                    p.grad = torch.zeros_like(p) if p.grad.is_sparse else p.grad.zero_()
        return False

    def _delta_in_place(self, b, payloads) -> bool:
        """Without the downlink selection, are the received weight changes added straight into
        the anchor (O(P k) touches) rather than summed into a zeroed full-length buffer that is
        then added to it (four passes over the bucket)? Where they are few against its length
        and the anchor is the accumulation dtype's."""
        st = self.state[b.index]
        received = sum(p.indices.numel() for p in payloads)
        return st.anchor is not None and st.anchor.dtype == st.downlink.dtype \
            and st.downlink.buffer is None and received * SPARSE_DELTA_SHARE <= b.numel

    def _pending(self, b, lo, hi, device):
        """Without the downlink selection, a downlink residual this engine holds (loaded from a
        checkpoint that ``merge_rank_states`` made, or kept from a run with the selection; the
        same on every rank) joins the next aggregate whole, once (the caller drops it): its
        positions ``lo:hi``, the whole bucket or an owner's region; no mass is lost."""
        st = self.state[b.index]
        return st.downlink.buffer[lo:hi].to(device=device, dtype=st.downlink.dtype)

    def _write_delta_payloads(self, b, payloads, scale, ops):
        """``anchor += scale * payload`` for each payload in rank order (every rank adds the
        same values in the same order: the replicas stay identical), then the parameters:
        where the uplink scan put them back at the old anchor only the touched entries move
        (O(P k)), else they are copied from the anchor once."""
        anchor = self.state[b.index].anchor
        at_anchor = b.index in self._params_at_anchor
        twin = None
        if at_anchor and len(b.params) == 1 and b.params[0].is_contiguous():
            lo, hi = b.slices[0]
            twin = b.params[0].detach().view(-1)[lo:hi]
        for p in payloads:
            if not p.indices.numel():
                continue
            values = p.values.to(anchor.dtype)
            if twin is not None:
                cpu.scatter_add_twin(anchor, twin, p.indices, values, scale)
            elif at_anchor:
                self._write_sparse(b, p.indices, values * scale, frozenset(), "delta", ops,
                                   True)
            else:
                ops.scatter_add(anchor, p.indices, values, scale)
        if not at_anchor:
            self._restore_anchor(b)

    def _write_delta(self, b, out):
        self.state[b.index].anchor.add_(out)  # in place: the anchor is this engine's own
        self._restore_anchor(b)
