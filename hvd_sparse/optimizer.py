"""The drop-in ``DistributedOptimizer``: a thin Horovod facade over the exchange engine.

Like Horovod's, the returned object is an instance of a subclass of the user's optimizer class
created on the fly, so ``isinstance(opt, torch.optim.SGD)`` still holds and the user's optimizer
state, hooks and schedulers are kept. This module holds only what Horovod's optimizer does
around the exchange: gradient hooks that hand complete buckets to the engine, the
``synchronize``/``skip_synchronize``/``step``/``zero_grad`` guards, ``backward_passes_per_step``,
and ``state_dict`` delegation. The exchange itself is :class:`hvd_sparse.engine.Engine`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
import weakref
from contextlib import contextmanager
from itertools import chain

import torch

from . import buckets as bucketing
from . import validate
from .engine import Engine, build_config
from .engine.config import EXCHANGES, adaptive_optimizer_classes, passes_per_step, resolve_exchange
from .state_broadcast import register_elastic_sync
from .transport import HorovodTransport, make_transport
from .variance_correction import VarianceCorrection

STATE_KEY = "hvd_sparse"
try:  # the loop of torch.amp.GradScaler's unscale_ (and of its inf check for fused steps)
    from torch.amp.grad_scaler import GradScaler as _GradScaler
    _UNSCALE_CODE = _GradScaler._unscale_grads_.__code__
except (ImportError, AttributeError):  # pragma: no cover - torch without it
    _UNSCALE_CODE = None
_LIVE = weakref.WeakSet()  # every optimizer made here, while it lives (for hvd_sparse.join)



def _grad_accumulator(p: torch.Tensor):
    """``p``'s AccumulateGrad node. A hook on it runs once ``p.grad`` is final: after every
    post-accumulate-grad hook, however late the user registered it, which is where Horovod's
    optimizer hooks too (a gradient hook added after wrapping is part of what is exchanged;
    a ``register_post_accumulate_grad_hook`` of ours, made at wrapping, ran before it, read the
    gradient early and raced its in-place edits with the allreduce)."""
    with torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


class _SparseDistributedOptimizer(torch.optim.Optimizer):
    """Methods grafted onto a subclass of the user's optimizer class (see ``DistributedOptimizer``).

    ``_hs_base`` is the user's class; its methods are called explicitly, never through ``super()``,
    because this body is copied into a class created at run time.
    """

    _hs_base = torch.optim.Optimizer

    # ----------------------------------------------------------------- set-up
    def _hs_init(self, named_parameters, engine: Engine, exchange_auto: bool = False,
                 process_set=None, bidirectional_auto: bool = False):
        self._hs_engine = engine
        self._hs_exchange_auto = exchange_auto  # the exchange was the library's choice
        self._hs_bidirectional_auto = bidirectional_auto  # and so was the downlink selection
        self._hs_process_set = process_set
        # p.grad as the last exchange wrote it: (parameter, weak reference) (see
        # _hs_resynchronized)
        self._hs_written = None
        # p.grad as backward handed it to the exchange this step: parameter -> (tensor,
        # version); and whether a write to it after that was already reported
        self._hs_handed = {}
        self._hs_warned_write = False
        self._hs_warned_unexchanged = False
        self._hs_group_sizes, self._hs_outside = None, []  # (see _hs_check_unexchanged)
        self._hs_transport = engine.transport
        self._parameter_names = {p: n for n, p in named_parameters}
        self.backward_passes_per_step = engine.config.backward_passes_per_step
        self._hs_buckets_of = {}  # a parameter split across buckets belongs to several
        for b in engine.buckets:
            for p in b.params:
                self._hs_buckets_of.setdefault(p, []).append(b)
        self._requires_update = set(self._hs_buckets_of)
        self._allreduce_delay = {p: self.backward_passes_per_step for p in self._hs_buckets_of}
        self._hs_ready = {b.index: 0 for b in engine.buckets}
        self._hs_next = 0
        self._hs_touched = False
        self._synchronized = False
        self._should_synchronize = True
        self._hs_synced_for_scaler = False  # (see param_groups)
        self._hs_warned_discard = False  # zero_grad's warning about a discarded exchange
        self._hs_hook_handles = []
        # one process under Horovod (not elastic, where workers may join): Horovod's optimizer
        # is then the wrapped one itself, without hooks or their guards; so is this one
        self._hs_passthrough = (isinstance(engine.transport, HorovodTransport)
                                and engine.transport.size() == 1
                                and os.environ.get("HOROVOD_ELASTIC") != "1")
        self._hs_mark_switchable()
        self._hs_variance = VarianceCorrection() if engine.config.variance_correction else None
        self._hs_grad_accs = []  # the AccumulateGrad nodes hooked: kept alive while we are
        if engine.transport.included() and not self._hs_passthrough:
            for p in self._hs_buckets_of:
                acc = _grad_accumulator(p)
                self._hs_grad_accs.append(acc)
                self._hs_hook_handles.append(acc.register_hook(self._hs_make_hook(p)))

    # ----------------------------------------------------------------- hooks
    def _hs_other_wrapper_hint(self, p) -> str:
        """Where another live DistributedOptimizer hooks ``p`` too (a model wrapped anew while
        the old optimizer is still referenced, by a scheduler, say), its hooks count this
        backward as well: said, since the count alone points at backward_passes_per_step."""
        others = [o for o in list(_LIVE) if o is not self
                  and p in getattr(o, "_requires_update", ())]
        if not others:
            return ""
        return (" Another hvd_sparse DistributedOptimizer over the same parameters is still "
                "alive and hooked to their gradients (a model wrapped anew while the old "
                "optimizer is still referenced, e.g. by an LR scheduler): drop every "
                "reference to the old one (del it) before wrapping again.")

    def _hs_make_hook(self, p):
        # the hook lives on p's AccumulateGrad node, which this optimizer holds and p only
        # references weakly; a strong reference to the optimizer from the hook would still
        # keep it, its residuals and the model alive through autograd's own references
        # (a leak per optimizer made)
        owner = weakref.ref(self)

        def hook(*_):
            self = owner()
            if self is None:
                return
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally." + self._hs_other_wrapper_hint(p))
            self._hs_touched = True
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0 and not self._hs_engine.config.exchanges_updates \
                    and not self._hs_agreement_pending():
                complete = []
                for b in self._hs_buckets_of[p]:
                    self._hs_ready[b.index] += 1
                    if self._hs_ready[b.index] == len(b.params):
                        complete.append(b)
                if complete:
                    self._hs_launch_ready(complete)
        return hook

    def _hs_launch_ready(self, complete):
        """Hand complete buckets to the engine.

        Name-matched transports (Horovod) start a bucket as soon as it is complete.
        Order-matched ones (MPI) start buckets only in the fixed launch order, so every rank
        issues the same sequence of collectives even when gradients arrive differently: from
        the first bucket of that order not yet started, as far as they are complete. Either
        way the work per hook is what it starts, not a walk over every bucket (quadratic in
        the bucket count per step: 160 small tensors, all dense, one process with an echoing
        transport, 8.2 against 6.6 ms per step).
        """
        engine = self._hs_engine
        if not engine.transport.ordered:
            for b in complete:
                if b.index not in engine.inflight:
                    self._hs_launch(b)
            return
        order = engine.launch_order
        i = self._hs_next
        while i < len(order):
            b = order[i]
            if b.index not in engine.inflight:
                if self._hs_ready[b.index] != len(b.params):
                    break
                self._hs_launch(b)
            i += 1
        self._hs_next = i

    def _hs_launch(self, b):
        """Start a bucket during backward and note its gradients as handed over (a later
        in-place write to them is reported by :meth:`_hs_check_handed`)."""
        self._hs_engine.launch(b)
        if self._hs_warned_write:  # said once: nothing more to note
            return
        for p in b.params:
            if p.grad is not None:
                self._hs_handed[p] = (p.grad, p.grad._version)

    def _hs_reset_round(self):
        self._hs_engine.reset_round()
        self._hs_handed.clear()
        self._hs_touched = False
        self._hs_next = 0  # the first bucket of the launch order not yet started
        for k in self._hs_ready:
            self._hs_ready[k] = 0
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def _hs_fill_missing_grads(self):
        """Zero gradients for parameters without one, as Horovod's ``synchronize`` makes them
        (another rank may have computed it; weight decay still applies)."""
        seen_sparse = self._hs_engine.sparse_gradients
        filled = set()
        for p in self._requires_update:
            if p.grad is None:
                # sparse where this rank has had it sparse (an embedding left out of this
                # step): SparseAdam refused the dense zeros
                p.grad = torch.zeros_like(p).to_sparse() if id(p) in seen_sparse \
                    else torch.zeros_like(p)
                filled.add(p)
            elif p.grad.is_sparse:
                seen_sparse.add(id(p))
        return filled

    def _hs_zero_frozen_grads(self):
        """A parameter frozen after wrapping (``requires_grad_(False)``) still takes part in
        the exchange with a zero gradient, as under Horovod, but what the exchange writes back
        for it is set to zero: error feedback still holds mass from before it was frozen, and
        releasing that into it would move a layer the user stopped training (Horovod's zero
        gradient leaves it where it is)."""
        for p in self._hs_frozen():
            if p.grad is not None:
                p.grad.zero_()

    def _hs_frozen(self):
        """The exchanged parameters frozen after wrapping (``requires_grad_(False)``)."""
        return [p for p in self._hs_buckets_of if not p.requires_grad]

    def _hs_record_written(self):
        """Note which tensors the exchange wrote into ``p.grad`` (see _hs_resynchronized)."""
        self._hs_written = [(p, weakref.ref(p.grad))
                            for p in self._hs_buckets_of if p.grad is not None]

    def _hs_check_handed(self):
        """Warn (once) when ``p.grad`` was written in place after backward handed it to the
        exchange: the exchanged gradient of what backward produced is written over it. Under
        Horovod such a write races the in-place allreduce; the common case is
        ``scaler.step(optimizer)`` without ``synchronize()`` first, whose ``unscale_`` would
        be lost and the step taken with the loss scale still in the gradient."""
        if self._hs_warned_write:
            return
        changed = [self._parameter_names.get(p, "?") for p, (g, version) in self._hs_handed.items()
                   if p.grad is not g or g._version != version]
        if changed:
            self._hs_warned_write = True
            warnings.warn(
                f"p.grad of {changed[0]!r}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''} "
                "was written in place after backward() handed it to the exchange (e.g. "
                "GradScaler's unscale_ inside scaler.step(optimizer)); the exchanged gradient "
                "replaces that write. With a loss scaler, call optimizer.synchronize() and "
                "scaler.unscale_(optimizer) first and step inside "
                "optimizer.skip_synchronize(), as Horovod's AMP example does.")

    def _hs_check_unexchanged(self):
        """Warn (once) when a parameter with a gradient is stepped without being exchanged
        (added with ``add_param_group`` or made trainable after wrapping): each rank then
        moves it by its own gradient, and the replicas drift apart. Horovod does the same
        without a word."""
        if self._hs_warned_unexchanged or self._hs_passthrough:
            return
        # the parameters outside the exchange, found again only when the groups change (a
        # per-step walk over every parameter would be hot-path work for a rare mistake)
        sizes = tuple(len(g["params"]) for g in self.param_groups)
        if sizes != self._hs_group_sizes:
            self._hs_group_sizes = sizes
            self._hs_outside = [p for g in self.param_groups for p in g["params"]
                                if p not in self._requires_update]
        if any(p.grad is not None for p in self._hs_outside):
            self._hs_warned_unexchanged = True
            warnings.warn("a parameter with a gradient is not exchanged (added with "
                          "add_param_group or made trainable after the optimizer was wrapped): "
                          "each rank steps it by its own gradient. Wrap the optimizer once its "
                          "parameters are all there.")

    def _hs_resynchronized(self) -> bool:
        """Is this ``synchronize()`` a second one before ``step()`` (a ``step()`` after
        ``synchronize()`` without ``skip_synchronize()``, say) with no backward since and
        ``p.grad`` still the tensors the exchange wrote? Then what it gave stands (clipped in
        between or not), where Horovod's allreduce of identical values would change nothing
        and another exchange would compress an average again.

        Only this, which follows the program's structure and so holds on every rank alike, is
        decided locally. A ``step()`` without a backward since the last one takes part in the
        exchange with the gradient it holds, as under Horovod: whether a rank has something new
        is its own knowledge (it skipped backward on an empty batch, its gradients were
        written through ``.data``), and a rank that skipped the collective alone would pair
        the others' next collectives with the wrong step, or leave them waiting."""
        written = self._hs_written
        return self._synchronized and not self._hs_touched \
            and not self._hs_engine.inflight and written is not None \
            and all(p.grad is not None and p.grad is ref() for p, ref in written)

    # ----------------------------------------------------------------- loss scalers
    @property
    def param_groups(self):
        """The wrapped optimizer's groups (kept in the instance dict, where torch's
        ``__setstate__`` puts them). Read by ``torch.amp.GradScaler``'s unscale while this
        step's exchange is still open (torch's own recipe: ``scaler.step(optimizer)``, or
        ``scaler.unscale_(optimizer)`` and clipping, with no ``synchronize()`` first), the
        exchange is finished first. The scaler then unscales, and checks for Inf/NaN, the
        exchanged gradient, as in Horovod's AMP pattern, and every rank's scaler decides
        alike; else it unscaled a local gradient that the exchange then overwrote, and the step
        was taken with the loss scale still in it (Horovod races its in-place allreduce)."""
        if _UNSCALE_CODE is not None and sys._getframe(1).f_code is _UNSCALE_CODE:
            self._hs_synchronize_for_scaler()
        try:
            return self.__dict__["param_groups"]
        except KeyError:  # (not made yet: what attribute access says)
            raise AttributeError("param_groups") from None

    @param_groups.setter
    def param_groups(self, groups):
        self.__dict__["param_groups"] = groups

    def _hs_synchronize_for_scaler(self):
        """Finish the open exchange (a backward since the last one), unless ``step()`` is
        told not to synchronize (``skip_synchronize()``) or nothing is exchanged."""
        if "_hs_engine" not in self.__dict__ or not self._should_synchronize \
                or self._hs_passthrough or not self._hs_transport.included() \
                or not (self._hs_touched or self._hs_engine.inflight):
            return
        self.synchronize()
        self._hs_synced_for_scaler = True

    # ----------------------------------------------------------------- Horovod's API
    @property
    def op(self):
        from . import compat
        return compat.Average if self._hs_engine.config.average else compat.Sum

    @property
    def gradient_predivide_factor(self) -> float:
        return self._hs_engine.config.predivide

    @property
    def sparse_as_dense(self) -> bool:
        return self._hs_engine.config.sparse_as_dense

    @property
    def process_set(self):
        if self._hs_process_set is not None:
            return self._hs_process_set
        return getattr(self._hs_transport, "process_set", None)

    def synchronize(self):
        """Finish every bucket's exchange and write the result into ``p.grad``."""
        if not self._hs_transport.included():
            self._synchronized = True
            return
        if self._hs_passthrough:  # Horovod's average over one rank: the gradient itself
            self._synchronized = True  # (a missing one stays missing: no hooks, as there)
            return
        self._hs_agree_first()
        if self._hs_engine.config.exchanges_updates:
            # the exchange is of the update, in step(); gradients stay this rank's own. What
            # must agree is whether any rank's gradient is non-finite, so that a loss scaler
            # (unscale_ after synchronize) skips the step on every rank alike; after the
            # agreement (a rank whose configuration differs would meet the vote with it)
            try:
                self._hs_engine.ensure_agreed()
                self._hs_engine.agree_gradients_finite()
            finally:
                self._hs_reset_round()
            self._synchronized = True
            return
        if self._hs_resynchronized():
            return
        self._hs_check_handed()
        try:
            self._hs_engine.finish("grads")
        finally:
            self._hs_reset_round()
        self._hs_zero_frozen_grads()
        self._hs_record_written()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip synchronisation after an explicit ``synchronize()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if closure is not None and self._should_synchronize and not self._hs_passthrough \
                and not isinstance(self, torch.optim.LBFGS):
            # the closure's backward is what is exchanged: it runs first, then the exchange and
            # the wrapped step (handed to the wrapped step, as Horovod does, it would recompute
            # this rank's own gradients after the exchange and the replicas would drift)
            with torch.enable_grad():
                loss = closure()
            self._hs_step(None)
            return loss
        return self._hs_step(closure)

    def _hs_step(self, closure):
        engine = self._hs_engine
        # finished already, inside the loss scaler's unscale (see param_groups)
        scaler_synced, self._hs_synced_for_scaler = self._hs_synced_for_scaler, False
        if self._should_synchronize and not scaler_synced and not self._hs_passthrough \
                and self._hs_transport.included():
            self._hs_agree_first()
        if engine.config.exchanges_updates and not self._hs_passthrough:
            if self._should_synchronize and not scaler_synced:
                if self._synchronized:
                    _warn_step_after_synchronize()
                if engine.exchange_due() and engine.agreed() \
                        and self._hs_transport.included():
                    # what synchronize() does here, as Horovod's step() synchronizes: every
                    # rank learns whether any gradient is non-finite, so all skip alike (from
                    # the second exchange on: the first one's agreement tells a rank whose
                    # configuration differs, which this collective would meet instead)
                    try:
                        engine.agree_gradients_finite()
                    finally:
                        self._hs_reset_round()
            self._synchronized = False
            skip = engine.skip_update  # agreed: a non-finite gradient on some rank
            engine.skip_update = False
            if skip and engine.config.local_steps == 1:
                return None  # no update on any rank: no local step, no exchange
            # communication delay: this local step is skipped on every rank, and the
            # exchange of the earlier local steps' changes keeps its schedule
            return self._hs_local_step(closure, skip_local=skip)
        if self._should_synchronize and not scaler_synced:
            if self._synchronized:
                _warn_step_after_synchronize()
            self.synchronize()
        self._synchronized = False
        if engine.skip_step:  # a non-finite gradient somewhere: no update on any rank
            engine.skip_step = False
            return None
        self._hs_check_unexchanged()
        if self._hs_passthrough:
            return self._hs_passthrough_step(closure)
        if engine.optimizer_state_average_due:  # agreed: per-rank state was loaded
            engine.optimizer_state_average_due = False
            self._hs_average_state()
        return self._hs_base.step(self, closure)

    def _hs_passthrough_step(self, closure):
        """One process under Horovod: the wrapped step, as Horovod's optimizer is then the
        wrapped one. Mass a loaded state left in the residuals (saved by a larger job) joins
        this step once: gradient mass added to ``p.grad`` before the step (after the closure's
        backward, when there is one), weight changes to the parameters after it. The exchange
        counter moves on as it would, so a later resume on more ranks continues its
        schedules."""
        engine = self._hs_engine
        pending = engine.take_pending()
        updates = engine.config.exchanges_updates
        if pending and not updates:
            if closure is None:
                self._hs_add_pending(pending, grads=True)
            else:
                inner, added = closure, []

                def closure():
                    loss = inner()
                    if not added:  # once, also when the wrapped step re-evaluates (LBFGS)
                        self._hs_add_pending(pending, grads=True)
                        added.append(True)
                    return loss
        loss = self._hs_base.step(self, closure)
        if pending and updates:
            self._hs_add_pending(pending, grads=False)
        if engine.config.local_steps == 1 or engine.local_step_done():
            engine.steps += 1
        return loss

    def _hs_add_pending(self, pending, grads):
        """Add each bucket's pending mass to its parameters' gradients (``grads``) or to the
        parameters themselves."""
        with torch.no_grad():
            for b in self._hs_engine.buckets:
                flat = pending.get(b.index)
                if flat is None:
                    continue
                for p, off, (lo, hi) in zip(b.params, b.offsets, b.slices):
                    seg = flat[off:off + hi - lo].to(p.dtype)
                    if not grads:
                        _add_flat(p, lo, hi, seg)
                    elif p.grad is None:
                        p.grad = torch.zeros_like(p)
                        _add_flat(p.grad, lo, hi, seg)
                    elif p.grad.is_sparse:
                        dense = p.grad.to_dense()
                        _add_flat(dense, lo, hi, seg)
                        p.grad = dense.to_sparse()
                    else:
                        _add_flat(p.grad, lo, hi, seg)

    def _hs_local_step(self, closure, skip_local=False):
        """Communication delay (SBC): local steps, then the engine exchanges the weight change."""
        engine = self._hs_engine
        engine.ensure_anchors()
        engine.follow_outside_changes()
        filled = ()
        if self._hs_transport.included():
            filled = self._hs_fill_missing_grads()
            self._hs_check_unexchanged()
        if engine.config.local_clip_norm is not None:
            engine.clip_gradients()
        # a non-finite gradient is not applied locally (the weights would never recover)
        result, hooks = None, None
        if not skip_local and engine.local_step_finite():
            hooks = _StepHooks(self, self._hs_base.step, closure)
            corrected = self._hs_variance is not None and engine.config.exchanges_updates
            stepped = False
            try:
                if corrected:  # the full batch's second moment for this step (a rank outside
                    # the process set steps alone)
                    self._hs_variance.before(
                        self, engine.transport.size() if self._hs_transport.included() else 1,
                        skip=filled)
                result = hooks.run()
                stepped = True
            finally:
                if corrected:
                    self._hs_variance.after(stepped)
        self._hs_reset_round()
        if engine.local_step_done() and self._hs_transport.included():
            try:
                engine.exchange_deltas(hold=self._hs_frozen())
                if engine.config.momentum_masking:
                    self._hs_mask_momentum(engine.take_sent())
                self._hs_to_gradients_when_all_dense()
            finally:
                self._hs_reset_round()
        if hooks is not None:  # after the exchange: they see the replicas' parameters
            hooks.post()
        return result

    def _hs_to_gradients_when_all_dense(self):
        """The library chose to exchange an adaptive optimizer's updates (``exchange="auto"``),
        and the time cost model has just sent every bucket dense (a link fast enough that
        compression does not pay): each rank's own step, averaged, is then no longer worth
        having over Horovod's step on the averaged gradient, which trained better (per-rank
        Adam moments see a P-th of the batch: a peer's probe measured a small MLP 4-5 points
        behind Horovod on loopback). Collective, the same on every rank (the choices are
        agreed): the residuals are released into the weights, the optimizer's state is
        averaged over the ranks (then equal everywhere, as Horovod's is), and from the next
        step gradients are exchanged, as ``exchange="gradient"`` does."""
        engine = self._hs_engine
        if not (self._hs_may_take_horovods_step() and engine.transport.size() > 1
                and engine.goes_all_dense()):
            return
        engine.release_updates(hold=self._hs_frozen())
        self._hs_average_state()
        self._hs_take_horovods_step()

    def _hs_may_take_horovods_step(self) -> bool:
        """An adaptive optimizer's updates exchanged by the library's own choice, every step,
        without masking. Not SGD's: its averaged updates, dense, are Horovod's step up to
        rounding (the step is linear in the gradient and the velocity), so a switch gains it
        nothing. The switch is agreed as replicated state (:meth:`_hs_mark_switchable`)."""
        c = self._hs_engine.config
        return self._hs_exchange_auto and c.exchange == "update" and c.local_steps == 1 \
            and not c.momentum_masking and isinstance(self, adaptive_optimizer_classes())

    def _hs_take_horovods_step(self, dense_only: bool = True) -> None:
        """Gradients exchanged from now on, densely (``dense_only``): later calibrations keep
        Horovod's step (never sparse gradients for an adaptive optimizer)."""
        c = self._hs_engine.config
        self._hs_engine.config = dataclasses.replace(
            c, exchange="gradient",
            bidirectional=True if self._hs_bidirectional_auto else c.bidirectional)
        self._hs_engine.dense_only = dense_only

    def _hs_mark_switchable(self) -> None:
        """Where the all-dense switch may be taken (:meth:`_hs_may_take_horovods_step`),
        the engine agrees on it as replicated state: the exchange (and the downlink
        selection, where the library chose it too) and ``dense_only``. Otherwise the switch is
        a rank's own, and a rank resumed or joining beside switched ranks exchanged updates
        beside their gradients: the job hung (rank 0 alone loaded a switched checkpoint) or
        stopped on a configuration mismatch (a worker joined an elastic job)."""
        engine = self._hs_engine
        if self._hs_may_take_horovods_step():
            engine.switchable = ("exchange",) + \
                (("bidirectional",) if self._hs_bidirectional_auto else ())
            owner = weakref.ref(self)  # (no cycle through the engine: freed when dropped)
            engine.on_switch = lambda switch: owner()._hs_adopt_switch(switch)
        else:
            engine.switchable, engine.on_switch = (), None

    def _hs_adopt_switch(self, switch: dict) -> None:
        """Another rank's switch (the agreement's root, or a checkpoint): its options and
        ``dense_only``. The wrapped optimizer's state is the root's after
        ``broadcast_optimizer_state`` (Horovod's, or an elastic state's sync)."""
        engine = self._hs_engine
        kind = engine.config.exchange
        engine.config = dataclasses.replace(
            engine.config, **{k: switch[k] for k in engine.switchable if k in switch})
        engine.dense_only = bool(switch.get("dense_only", False))
        if self._hs_variance is not None and engine.config.exchange != kind:
            self._hs_variance.load_state_dict(None)  # (its last gradient is from before)

    def _hs_agreement_pending(self) -> bool:
        """Is the agreement due where it may switch what is exchanged? Then no bucket
        starts from the backward hooks: a rank exchanging updates reaches no hook, and the
        agreement, made first in ``synchronize()``/``step()`` on every rank, may change this
        rank's path."""
        engine = self._hs_engine
        return bool(engine.switchable) and not engine.agreed() \
            and engine.transport.size() > 1

    def _hs_agree_first(self) -> None:
        """The agreement, before the gradient and update paths part (see
        :meth:`_hs_agreement_pending`)."""
        if self._hs_agreement_pending() and self._hs_transport.included():
            self._hs_engine.ensure_agreed()

    def _hs_follow_saved_exchange(self, extra: dict) -> None:
        """An adaptive optimizer's state saved with gradients exchanged resumes exchanging
        gradients where the exchange is the library's choice (its residuals hold gradients):
        densely for good if it was saved after the switch of
        :meth:`_hs_to_gradients_when_all_dense` (the loaded optimizer state is then one for
        Horovod's step; a state without the flag is older, and "gradient" then meant the
        switch), else sparse, as it was. SGD takes no switch: its updates stay, and the
        engine drops a gradient state's residuals with a warning."""
        if self._hs_engine.switchable and extra.get("switch") is not None:
            self._hs_engine.adopt_switch(extra["switch"])  # (saved since it is agreed)
        elif extra.get("exchange") == "gradient" and self._hs_may_take_horovods_step():
            took = extra.get("horovods_step")
            self._hs_take_horovods_step(dense_only=True if took is None else bool(took))

    def _hs_average_state(self):
        """Collective: every floating-point tensor of the wrapped optimizer's state averaged
        over the ranks, in one fixed order (where the ranks hold the same state; otherwise, a
        parameter stepped on some ranks only, rank 0's state is taken whole)."""
        from . import safety

        engine = self._hs_engine
        params = [p for b in engine.buckets for p in b.params]
        tensors, layout = [], []
        for i, p in enumerate(params):
            st = self.state.get(p, {})
            for key in sorted(st, key=str):
                v = st[key]
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    tensors.append(v)
                    layout.append(f"{i}:{key}:{tuple(v.shape)}:{v.dtype}")
        same, _ = safety.same_by_sums(engine.transport, "|".join(layout).encode(),
                                      "hvd_sparse.state.layout")
        if not same:
            import io

            blob = b""
            if engine.transport.rank() == 0:
                buf = io.BytesIO()
                torch.save(self._hs_base.state_dict(self), buf)
                blob = buf.getvalue()
            root = safety._gather_bytes(engine.transport, blob, "hvd_sparse.state.whole")[0]
            if engine.transport.rank() != 0:  # (state only: the groups' dicts stay, which
                # an LR scheduler may hold)
                loaded = torch.load(io.BytesIO(root), map_location="cpu",
                                    weights_only=True)["state"]
                order = [(p, g) for g in self.param_groups for p in g["params"]]
                self.state.clear()
                for i, st in loaded.items():
                    p, group = order[int(i)]
                    self.state[p] = {k: _placed(v, k, p, group) for k, v in st.items()}
            return
        with torch.no_grad():
            for j, v in enumerate(tensors):
                avg = engine.transport.wait(engine.transport.allreduce_async(  # (row-major:
                    # Horovod reduces contiguous tensors only; a channels_last parameter's
                    # moments are not)
                    v.detach().clone(memory_format=torch.contiguous_format),
                    f"hvd_sparse.state.{j}", average=True))
                v.copy_(avg.view_as(v))

    def _hs_mask_momentum(self, sent):
        """DGC's momentum factor masking, where weight updates are exchanged: this rank's
        momentum buffer is zeroed (``momentum_masking=True``) or scaled by ``1 - strength``
        at the positions it just sent, so a coordinate whose accumulated change has gone out
        restarts (or damps) its momentum instead of pushing on with a velocity that helped
        build what was sent. Dense buckets are left alone."""
        keep = 1.0 - self._hs_engine.config.momentum_masking
        for b, idx in sent:
            if idx.numel() == 0:
                continue
            cuts = [0, idx.numel()]
            if len(b.params) > 1:  # each parameter's share of the (index-ordered) positions
                if idx.numel() > 1 and not bool((idx[1:] >= idx[:-1]).all()):
                    idx = idx.sort().values
                bounds = torch.tensor(list(b.offsets) + [b.numel], dtype=idx.dtype,
                                      device=idx.device)
                cuts = torch.searchsorted(idx, bounds).tolist()
            for i, (p, off, (lo, hi)) in enumerate(zip(b.params, b.offsets, b.slices)):
                buf = self.state.get(p, {}).get("momentum_buffer")
                if buf is None or cuts[i] == cuts[i + 1]:
                    continue
                at = idx[cuts[i]:cuts[i + 1]].to(device=buf.device, dtype=torch.int64) \
                    + (lo - off)
                flat = buf.reshape(-1)
                if keep:
                    flat.index_copy_(0, at, flat.index_select(0, at).mul_(keep))
                else:
                    flat.index_fill_(0, at, 0)
                if flat.data_ptr() != buf.data_ptr():  # a non-contiguous buffer: copied back
                    buf.copy_(flat.view(buf.shape))

    def zero_grad(self, *args, **kwargs):
        if self._hs_touched or self._hs_engine.inflight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        if self._synchronized and self._hs_engine.kept_unsent and not self._hs_warned_discard:
            self._hs_warned_discard = True
            warnings.warn(
                "hvd_sparse: the gradients exchanged by synchronize() are being discarded "
                "without a step() (Horovod's GAN pattern: another loss's backward reached "
                "this optimizer's parameters, then synchronize() and zero_grad()). What the "
                "sparse exchange did not send of them stays in the error-feedback residuals "
                "and reaches the weights in later steps, which dense Horovod never does. Keep "
                "such a backward away from these parameters instead (requires_grad_(False) "
                "on the module, or detach()), so that nothing is exchanged for it.",
                stacklevel=2)
        self._hs_synced_for_scaler = False  # (a scaler that found Inf skipped the step)
        return self._hs_base.zero_grad(self, *args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        passes = passes_per_step(passes)
        engine = self._hs_engine
        c = engine.config
        if passes > 1 and c.exchanges_updates and self._hs_exchange_auto \
                and c.local_steps == 1 and engine.steps == 0 and engine.local_count == 0 \
                and not c.momentum_masking:  # (masking was asked for: it needs updates)
            # the library's own choice with gradient accumulation is Horovod's contract
            # (gradients), while nothing was exchanged yet; later, updates stay exchanged (the
            # accumulated gradient makes one local step, then the update goes out)
            c = dataclasses.replace(c, exchange="gradient", bidirectional=True
                                    if self._hs_bidirectional_auto else c.bidirectional)
            engine.config = c
            self._hs_mark_switchable()  # (gradients from the start: no switch to agree on)
        self.backward_passes_per_step = passes
        engine.config = dataclasses.replace(c, backward_passes_per_step=passes)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def communication_stats(self) -> dict:
        """This rank's bytes sent/received, dense-equivalent bytes and selected counts; the
        last step's seconds per pipeline stage; the cost model's inputs and choices.

        Top-level keys describe the last synchronised step; ``totals`` sums every step.
        """
        engine = self._hs_engine
        out = engine.stats.as_dict()
        out["stage_seconds"] = dict(engine.clock.last)
        out["totals"]["stage_seconds"] = dict(engine.clock.totals)
        out["totals"]["downlink_selections"] = engine.downlink_paths()
        out["totals"]["uplink_commits"] = dict(engine.commits)
        out["totals"]["gradient_reads"] = dict(engine.gradient_reads)
        out["totals"]["weight_change_reads"] = dict(engine.weight_change_reads)
        out["totals"]["outside_changes"] = engine.outside_changes
        out["cost_model"] = engine.cost_report()
        out["exchange"] = "update" if engine.config.exchanges_updates else "gradient"
        out["bidirectional"] = engine.config.bidirectional
        # each rank's Adam steps on the full batch's second moment (while updates are
        # exchanged: not after the all-dense switch to Horovod's step)
        out["variance_correction"] = self._hs_variance is not None \
            and engine.config.exchanges_updates
        out["transport"] = type(engine.transport).__name__
        return out

    def engine_state(self):
        """Read-only snapshot of the engine's per-bucket state (residuals, velocity, the cost
        model's choice), by bucket name: see :meth:`hvd_sparse.engine.Engine.view`."""
        return self._hs_engine.view()

    # ----------------------------------------------------------------- checkpoints
    def consolidate_state_dict(self):
        """Call on every rank, between steps, before rank 0 alone saves ``state_dict()``: the
        sharded buckets' region residuals are gathered so that the next ``state_dict()`` of any
        rank holds them all (:mod:`hvd_sparse.checkpoint`). Without sharded buckets it
        communicates nothing."""
        self._hs_engine.consolidate()

    def state_dict(self):
        sd = self._hs_base.state_dict(self)
        sd[STATE_KEY] = self._hs_engine.state_dict()
        if self._hs_variance is not None:  # this rank's own, like its uplink residuals
            sd[STATE_KEY]["variance"] = self._hs_variance.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop(STATE_KEY, None)
        variance = None
        if extra is not None:  # refused before anything is loaded, not half way
            if isinstance(extra, dict):  # (checked_state says what else it should be)
                extra = dict(extra)
                variance = extra.pop("variance", None)
            t = self._hs_transport
            if isinstance(extra, dict) and (extra.get("rank") != t.rank()
                                            or extra.get("world_size") != t.size()):
                variance = None  # another rank's noise estimates: this rank starts its own
            extra = self._hs_engine.checked_state(extra)
        self._hs_reset_round()
        self._synchronized = False
        self._should_synchronize = True
        self._hs_synced_for_scaler = False
        self._hs_written = None
        groups = list(self.param_groups)
        self._hs_base.load_state_dict(self, state_dict)
        # torch puts new group dicts in place of the old: an LR scheduler made on the optimizer
        # before it was wrapped holds the old ones (shared with the wrapper) and would go on
        # setting a rate nobody reads. The loaded values go into the old dicts instead.
        for i, (old, new) in enumerate(zip(groups, self.param_groups)):
            if old is not new:
                old.clear()
                old.update(new)
                self.param_groups[i] = old
        if extra is not None:
            self._hs_follow_saved_exchange(extra)
            self._hs_engine.load_state_dict(extra)
            if self._hs_variance is not None:
                self._hs_variance.load_state_dict(variance)


# step() fires the step hooks itself (_StepHooks: post-hooks after the exchange). Marked so
# that torch's __setstate__ (load_state_dict, deepcopy) does not wrap it in its hook runner
# too, which ran every hook twice per step after a resume.
_SparseDistributedOptimizer.step.hooked = True


def _add_flat(t, lo, hi, seg) -> None:
    """``t``'s entries ``lo:hi`` in logical (row-major) order += ``seg``, in place, whatever
    ``t``'s memory layout."""
    if t.is_contiguous():
        t.view(-1)[lo:hi].add_(seg)
    else:
        flat = t.reshape(-1).clone()
        flat[lo:hi].add_(seg)
        t.copy_(flat.view(t.shape))


def _variance_correction(value, optimizer, exchange, local_steps) -> bool:
    """``variance_correction`` resolved: by default on where an Adam-family optimizer's
    updates are exchanged (:mod:`hvd_sparse.variance_correction`); asked for elsewhere, an
    error that says where it applies."""
    from .variance_correction import corrects

    updates = exchange == "update" or local_steps > 1
    if value is None:
        return updates and corrects(optimizer)
    value = validate.flag("variance_correction", value)
    if value and not corrects(optimizer):
        raise ValueError(f"variance_correction=True corrects the second moment of torch's "
                         f"Adam, AdamW, NAdam or RAdam (or a subclass); got "
                         f"{type(optimizer).__name__}")
    if value and not updates:
        raise ValueError("variance_correction=True applies where weight updates are exchanged "
                         "(exchange=\"update\", or local_steps > 1): with gradients exchanged "
                         "the wrapped optimizer sees the averaged gradient already")
    return value


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


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None,
                         *, density=0.01, bidirectional=None, downlink_density=None,
                         sparsifier="topk", threshold=None, total_steps=None, min_density=None,
                         max_density=None, sparsifier_options=None, index_coding=None,
                         momentum_correction=0.0, local_clip_norm=None, density_warmup_steps=0,
                         density_cooldown_steps=0, cooldown_density=0.2,
                         dense_warmup_steps=0, local_steps=1, exchange="auto",
                         track_error=True,
                         deterministic_dense=True, dense_fallback=True, cost_model="time",
                         calibration_steps=3, recalibrate_every=0, value_dtype=None,
                         nonfinite="propagate", verify_every=0, check_config=True,
                         collective="auto", sharded_selection="global",
                         rebalance_every=100, scope="auto", layer_floor=0.0,
                         momentum_masking=False, variance_correction=None,
                         bucket_cap_mb=25.0,
                         min_sparse_numel=1024,
                         max_bucket_numel=None,
                         transport=None, **unknown):
    """Wrap ``optimizer`` so gradients are exchanged sparsely (drop-in for Horovod's).

    Horovod's keywords keep their meaning: ``compression`` sets the value type on the wire (its
    rounding error is kept in the residual), ``op`` is ``Average`` or ``Sum`` (Adasum is refused:
    it needs whole gradients), ``gradient_predivide_factor`` splits the average as in Horovod,
    ``groups``/``num_groups`` define the buckets, ``sparse_as_dense`` is what hvd_sparse always
    does with sparse gradients, ``process_set`` restricts the exchange.

    Sparse options: ``density`` (uplink fraction kept per bucket), ``bidirectional`` (re-sparsify
    the aggregate on every rank, with a replicated residual; ``None``, the default: where
    gradients are exchanged, not where each step's weight update is, ``exchange="update"``,
    whose runs ended better without it: benchmarks/convergence.py, docs/results.md), ``downlink_density`` (``None``: same
    as ``density``), ``sparsifier`` (name or :class:`hvd_sparse.Sparsifier`), ``scope``
    (``"tensor"``, ``"model"`` or ``"bucket"`` with ``bucket_cap_mb``; ``"auto"``, the
    default: ``"model"`` for Top-K below 1% density, where one global selection ended better
    on every model measured, else ``"tensor"``: :func:`hvd_sparse.buckets.resolve_scope`),
    ``layer_floor``
    (Top-K in a bucket of several tensors: each first keeps this share of its own Top-K, the
    rest of the budget goes to the largest entries anywhere; 0, the default, is one Top-K per
    bucket), ``min_sparse_numel``
    (smaller tensors go dense, together, under every scope; with ``groups``, smaller groups:
    see ``deterministic_dense``), ``max_bucket_numel`` (larger buckets, and
    parameters, are split into several; ``min_sparse_numel`` weighs the whole tensor, not
    its pieces), ``transport`` (a :class:`hvd_sparse.transport.Transport`;
    default Horovod's collectives).

    Method keywords: ``threshold`` (for ``"threshold"``), ``min_density``, ``max_density``
    (for ``"adaptive"``), ``sparsifier_options`` (any other constructor keywords),
    ``index_coding``: how positions go on the wire: ``"plain"`` (32- or 64-bit integers),
    ``"golomb"`` (Golomb-Rice gaps, about 8 bits per position at 1%) or ``"auto"`` (the
    default, Golomb-Rice always for ``"sbc"``): per bucket, the time cost model's choice at
    calibration, Golomb-Rice where its codec time (timed at calibration, agreed across ranks)
    costs less than the wire time it saves; plain before calibration, with ``cost_model`` other
    than ``"time"``, on GPUs, without numba and for the sharded exchange.
    ``total_steps`` is the run's length in optimizer steps, where known: adaptive Top-K plans its
    budget over it, and ``density_cooldown_steps`` > 0 raises the density geometrically to
    ``cooldown_density`` (default 0.2) over that many last steps of it (``hvd_sparse.dgc``:
    what error feedback still holds reaches the final model; measured in
    ``benchmarks/convergence.py``).
    DGC's aids: ``momentum_correction`` (velocity factor, with masking; use a base optimizer
    without momentum), ``local_clip_norm``, ``density_warmup_steps``, ``dense_warmup_steps``,
    and where weight updates are exchanged ``momentum_masking`` (the wrapped optimizer's
    ``momentum_buffer``, SGD's, zeroed at the positions this rank sent with ``True``, scaled
    by ``1 - s`` with a strength ``s`` in [0, 1]; with it the density cool-down helps
    exchanged updates: docs/results.md "Convergence"; the training CLI uses 0.5).
    ``local_steps`` > 1 is SBC's communication delay: that many local steps, then the accumulated
    weight update is exchanged instead of gradients. ``exchange="update"`` does that every step:
    each rank steps the wrapped optimizer on its own gradient and the weight change is sparsified
    (error feedback included) and averaged, so adaptive optimizers see dense gradients; their
    state is then per rank, ``p.grad`` stays the local gradient, and ``synchronize()`` only
    agrees across ranks on whether a gradient is non-finite (for loss scalers).
    ``variance_correction`` (default ``None``: on where the updates of torch's Adam, AdamW,
    NAdam or RAdam are exchanged): each rank's step uses an estimate of the full batch's
    second moment instead of its own, which holds P times the gradient noise
    (:mod:`hvd_sparse.variance_correction`; no communication, two or three gradient-sized
    buffers per parameter; ``False`` steps on each rank's own).
    ``exchange="auto"`` (default) picks ``"update"`` for adaptive optimizers (Adam, AdamW,
    RMSprop, Adagrad, ... and their subclasses) and for SGD with momentum (each rank's velocity
    then sees its own dense gradient, as under DGC's momentum correction; updates beat
    gradients on every SGD workload measured: ``benchmarks/convergence.py``,
    ``benchmarks/unseen_models.py``), except with SBC and the hard threshold (absolute
    thresholds chosen on gradients), and ``"gradient"`` otherwise (plain
    SGD, optimizers of other kinds), with ``backward_passes_per_step > 1`` or
    ``momentum_correction``. ``track_error`` keeps the per-step
    compression error ``||acc - sent||^2`` in the statistics (one extra pass per bucket).
    ``deterministic_dense`` (default) exchanges dense buckets at 3 or more ranks by allgather
    and a rank-order sum, so results do not depend on how Horovod fuses and reduces (there an
    allreduce's summation order, hence its rounding, can change from run to run; at 2 ranks
    the sum is one addition either way and the allreduce is kept); ``False`` uses Horovod's
    allreduce, which moves fewer bytes for large dense buckets.
    ``cost_model`` decides per bucket whether to go dense (error feedback included):
    ``"time"`` (default) from the sparse path's measured compute on the first
    ``calibration_steps`` steps and the link's latency and bandwidth timed at the end of them (again
    every ``recalibrate_every`` steps if set), agreed across ranks; ``"bytes"`` from bytes
    alone; ``"off"`` never (``dense_fallback=False`` is the same). See
    :mod:`hvd_sparse.costmodel` and ``communication_stats()["cost_model"]``.
    ``value_dtype`` (``torch.float16``/``bfloat16``/``float32``) sets the value type on the wire;
    the rounding error stays in the residual.

    ``collective``: how a sparse bucket is exchanged. ``"allgather"``: every rank
    receives every rank's selection (traffic per rank grows with the rank count);
    ``"sharded"``: each rank owns one region of every bucket, receives the selections for it
    (an all-to-all), sums them, re-sparsifies them with its own downlink residual and the
    owners' selections are allgathered (traffic per rank about ``k_up + k_down`` pairs at any
    rank count; :mod:`hvd_sparse.engine.sharded`); ``"auto"`` (default): per bucket, the faster
    of the two by the time cost model once it is calibrated (before that, sharded from 4 ranks
    where the downlink selection is on).
    With sharded buckets, call ``consolidate_state_dict()`` on every rank before rank 0 alone
    saves ``state_dict()``. ``sharded_selection``: how owners re-select
    a Top-K downlink: ``"global"`` (default; one threshold for the whole bucket, from every
    owner's magnitude histograms summed by two small allreduces per step, a coarse one and a
    finer one inside the bin of the k-th magnitude: the count is within one 2**-14-wide bin of
    k; a bucket for which an allgather would receive no more bytes than the sharded exchange
    plus its histograms, as every bucket at two ranks and small ones at a few, goes by
    allgather, where the exact global Top-K is picked) or ``"region"`` (each owner the top of
    its own region; no extra collective; every bucket sharded). Other methods select per
    region. ``rebalance_every``: every so many steps (0: never) the owners' load, counted from
    the gathered downlink positions that every rank holds, is checked; when the busiest
    region carries more than 1.5 times the mean, the bounds move to balance it, the same on
    every rank, and the region residuals move with them (where the selection does not depend
    on a region's length: Top-K under the global rule, the hard threshold, and
    ``bidirectional=False``).

    Safety: ``nonfinite`` says what a NaN/Inf gradient on any rank does; it never enters a
    residual, and every rank does the same. ``"propagate"`` (default, as dense Horovod and
    ``torch.amp.GradScaler`` expect): every residual stays as it was and ``p.grad`` gets the
    plain average of the raw gradients, NaN/Inf included, so a scaler skips the step and
    lowers its scale; ``"skip"``: gradients zeroed and ``step()`` skipped on every rank;
    ``"raise"``: :class:`hvd_sparse.safety.NonFiniteGradientError` on every rank;
    ``"ignore"``: no check (NaN/Inf flow into residuals). ``verify_every=N``
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
    if _horovod_wrapped(optimizer):
        raise TypeError("optimizer is already a horovod.torch.DistributedOptimizer: wrap the "
                        "plain torch optimizer with hvd_sparse.DistributedOptimizer instead "
                        "(both would exchange the gradients, and Horovod's step recurses)")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    exchange_auto = exchange == "auto"
    # numbers as the rules below read them (NumPy and torch scalars too), checked first
    density = validate.plain_number(density)
    backward_passes_per_step = passes_per_step(backward_passes_per_step)
    local_steps = validate.whole("local_steps", local_steps, 1)
    exchange = resolve_exchange(exchange, optimizer, backward_passes_per_step, local_steps,
                                density, op, momentum_correction, sparsifier,
                                momentum_masking)
    if exchange_auto and exchange == "gradient" and _looks_adaptive(optimizer) \
            and backward_passes_per_step == 1 and local_steps == 1 and not momentum_correction \
            and not (isinstance(density, (int, float)) and density >= 1):
        warnings.warn(
            f"{type(optimizer).__name__} is not one of torch's adaptive optimizers, so "
            "exchange=\"auto\" exchanges its gradients; its settings (betas/eps) look like an "
            "adaptive one's, whose per-coordinate normalisation spoils sparse gradients (a "
            "hand-written Adam trained 3 points behind dense that way, 1 with its updates "
            "exchanged). Pass exchange=\"update\" (or \"gradient\" to keep this and silence "
            "the warning).", UserWarning, stacklevel=2)
    bidirectional_auto = bidirectional is None
    if bidirectional_auto:
        bidirectional = exchange != "update"
    variance_correction = _variance_correction(variance_correction, optimizer, exchange,
                                               local_steps)
    config = build_config(
        op=op, gradient_predivide_factor=gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step, compression=compression,
        sparse_as_dense=sparse_as_dense, density=density, bidirectional=bidirectional,
        downlink_density=downlink_density, sparsifier=sparsifier, threshold=threshold,
        total_steps=total_steps, min_density=min_density, max_density=max_density,
        sparsifier_options=sparsifier_options, index_coding=index_coding,
        momentum_correction=momentum_correction, local_clip_norm=local_clip_norm,
        density_warmup_steps=density_warmup_steps, dense_warmup_steps=dense_warmup_steps,
        density_cooldown_steps=density_cooldown_steps, cooldown_density=cooldown_density,
        local_steps=local_steps, exchange=exchange, track_error=track_error,
        deterministic_dense=deterministic_dense,
        dense_fallback=dense_fallback, cost_model=cost_model,
        calibration_steps=calibration_steps, recalibrate_every=recalibrate_every,
        value_dtype=value_dtype, nonfinite=nonfinite, verify_every=verify_every,
        check_config=check_config, collective=collective,
        sharded_selection=sharded_selection, rebalance_every=rebalance_every,
        layer_floor=layer_floor, momentum_masking=momentum_masking,
        variance_correction=variance_correction)
    if density_cooldown_steps and (local_steps > 1 or exchange == "update") \
            and isinstance(optimizer, adaptive_optimizer_classes()):
        warnings.warn(
            "density_cooldown_steps with an adaptive optimizer's weight updates exchanged: the "
            "residuals hold changes made at past learning rates, and releasing them at the end "
            "of a decaying schedule can undo training (a character Transformer with AdamW at "
            "density 0.001 diverged in its last steps); SGD's updates gained from it",
            UserWarning, stacklevel=2)
    if momentum_masking and not any(g.get("momentum", 0) for g in optimizer.param_groups):
        raise ValueError(f"momentum_masking={momentum_masking!r} needs a wrapped optimizer "
                         "with momentum (SGD's "
                         "momentum_buffer); this one has no 'momentum' > 0 in its param groups")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)  # Horovod's words
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
    min_sparse_numel = validate.whole("min_sparse_numel", min_sparse_numel, 0)
    bucket_cap_mb = validate.plain_number(bucket_cap_mb)
    if max_bucket_numel is not None:
        max_bucket_numel = validate.whole("max_bucket_numel", max_bucket_numel, 1)
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be a positive number (megabytes per bucket under "
                         f"scope='bucket'), got {bucket_cap_mb!r}")

    named = _named_parameters(optimizer, named_parameters)
    name_of = {id(p): n for n, p in named}
    trainable, listed = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in listed:  # torch only warns; each copy would take a bucket's budget
                raise ValueError(f"parameter '{name_of[id(p)]}' is listed twice in the "
                                 "optimizer's param groups; list each parameter once")
            listed.add(id(p))
            if not p.requires_grad:
                continue  # frozen: not exchanged, as in Horovod
            if not p.dtype.is_floating_point:
                raise TypeError(f"parameter '{name_of[id(p)]}' has dtype {p.dtype}; hvd_sparse "
                                "sparsifies floating-point gradients only")
            trainable.append((name_of[id(p)], p))
    scope = bucketing.resolve_scope(scope, density, sparsifier)
    # one selection per tensor inside a shared bucket (see _may_share)
    pack = bucketing.pack_below() if _may_share(config) else 0

    def plan_with(pack, alone=None):
        return bucketing.plan_buckets(trainable, scope=scope, bucket_cap_mb=bucket_cap_mb,
                                      groups=groups, min_sparse_numel=min_sparse_numel,
                                      max_bucket_numel=max_bucket_numel, pack=pack,
                                      alone=alone)
    plan = plan_with(pack)
    if config.layer_floor > 0 and all(len(b.params) == 1 or b.layerwise
                                      for b in plan if b.sparse):
        warnings.warn(f"layer_floor={config.layer_floor!r} has no effect: every sparse bucket "
                      f"holds one tensor (scope={scope!r}); it shares a bucket's budget among "
                      "its tensors under scope='model' or 'bucket'", UserWarning, stacklevel=2)
    if exchange_auto and config.exchange == "update" and config.local_steps == 1 \
            and not config.momentum_masking and not any(b.sparse for b in plan):
        # nothing can ever go sparse (every tensor below min_sparse_numel): Horovod's own
        # contract, the wrapped step on the averaged gradient, costs nothing here
        config = dataclasses.replace(config, exchange="gradient", bidirectional=True
                                     if bidirectional_auto else config.bidirectional)
    if _sends_everything(config):
        for b in plan:  # Horovod's allreduce from the first step: no allgather, no
            b.sparse = False  # calibration, and hvd.join() works as Horovod's
    transport = make_transport(transport, process_set)
    register_elastic_sync()  # (an elastic TorchState syncs it with hvd_sparse's broadcast)
    alone = _shardable(config, transport.size())
    if alone is not None and any(b.layerwise for b in plan):
        plan = plan_with(pack, alone)
        if _sends_everything(config):
            for b in plan:
                b.sparse = False

    base = type(optimizer)
    body = {k: v for k, v in _SparseDistributedOptimizer.__dict__.items()
            if k not in ("__dict__", "__weakref__")}
    body["_hs_base"] = base
    # Horovod's broadcast_optimizer_state initialises a fresh optimizer's state with the base
    # class's step() only when the optimizer's module is its DistributedOptimizer's; any other
    # optimizer gets step() itself, a collective here, which hangs when only some ranks are fresh
    # (the usual resume: rank 0 loaded a checkpoint). Ours is a Horovod optimizer in that sense.
    body["__module__"] = "horovod.torch.optimizer"
    cls = type(base.__name__, (base,), body)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # same param groups, state and hooks
    _rebind_instance_step(wrapped, optimizer)
    engine = Engine(config, plan, transport)
    engine.wrapped_optimizer = base.__name__  # compared across ranks, named first when it differs
    engine.known_names = {n for n, _ in named}  # frozen parameters' too (checkpoint matching)
    wrapped._hs_init(named, engine, exchange_auto=exchange_auto,
                     bidirectional_auto=bidirectional_auto,
                     process_set=process_set)
    _LIVE.add(wrapped)
    return wrapped


def _may_share(c) -> bool:
    """May short tensors share buckets under scope "tensor" (:func:`buckets._pack_layerwise`)
    and still be selected as one bucket each? With a method that keeps a per-tensor floor
    (Top-K, ranked per tensor by numba) or chooses each entry by itself (the hard threshold),
    where nothing else looks at a bucket as a whole: not with ``local_clip_norm`` (one norm
    per bucket) nor where every bucket is asked to be sharded."""
    from .kernels import cpu

    up, down = c.sparsifier, c.downlink_sparsifier
    return cpu.available() and c.local_clip_norm is None and c.collective != "sharded" and (
        (up.supports_layer_floor and down.supports_layer_floor)
        or (up.elementwise and down.elementwise))


def _shardable(c, size):
    """From 4 ranks the exchange may shard a tensor's bucket, which at many ranks receives far
    fewer bytes than gathering it, while a shared Top-K bucket with a downlink selection is
    always gathered (an owner sees a region, not the tensors): ``None`` where nothing changes
    (an allgather asked for, fewer ranks, no downlink selection, or a method that selects
    each entry by itself, which an owner does alike), else which tensor lengths keep a bucket
    of their own: those the byte rule would shard (every one under the region rule)."""
    from .engine import sharded
    from .sparsifiers import k_for_density

    if c.collective == "allgather" or size < 4 or not c.bidirectional \
            or not c.downlink_sparsifier.supports_layer_floor:
        return None
    if c.sharded_selection != "global":
        return lambda numel: True
    pair = 4 + (c.value_dtype or torch.float32).itemsize  # int32 positions, float values
    return lambda numel: not sharded.allgather_is_cheaper(
        k_for_density(numel, c.density), k_for_density(numel, c.downlink_density), size, pair)


def _sends_everything(c) -> bool:
    """Does the configuration leave every gradient as it is (Top-K or random-k of every entry,
    both ways, gradients exchanged, no velocity or clip)? Then the exchange is Horovod's."""
    whole = ("topk", "randomk")
    return (c.density >= 1 and c.downlink_density >= 1 and not c.exchanges_updates
            and c.sparsifier.name in whole and c.downlink_sparsifier.name in whole
            and not c.momentum_correction and c.local_clip_norm is None)


def join_blockers() -> tuple:
    """Bucket names of the live optimizers that would exchange other than by allreduce next
    step (see :func:`hvd_sparse.join`), and whether one of those optimizers gathers its dense
    buckets (``deterministic_dense`` at 3 or more ranks); optimizers no longer referenced (in
    reference cycles) are collected first."""
    import gc

    gc.collect()
    out, gathers = [], False
    for opt in list(_LIVE):
        if opt._hs_passthrough or not opt._hs_transport.included() \
                or opt._hs_transport.size() == 1:
            continue
        blocked = opt._hs_engine.join_blockers()
        out += blocked
        gathers |= bool(blocked) and opt._hs_engine.dense_flavour() == "gather"
    return out, gathers


def after_join() -> None:
    """Every live optimizer takes the step counters of the rank that stepped longest
    (:meth:`~hvd_sparse.engine.pipeline.Engine.after_join`; a collective per optimizer, named
    from its buckets, so the ranks may list their optimizers in any order)."""
    for opt in list(_LIVE):
        if not opt._hs_passthrough and opt._hs_transport.included() \
                and opt._hs_transport.size() > 1:
            opt._hs_engine.after_join()


def _placed(value, key, param, group):
    """An optimizer state value loaded on the host, where torch's ``load_state_dict`` puts it
    for ``param``: Adam's ``step`` stays on the host unless the group is fused or capturable,
    other tensors go to the parameter's device (rank 0's device index is not this rank's)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.to(param.device) if group.get("fused") or group.get("capturable") \
            else value
    return value.to(param.device)


def _warn_step_after_synchronize():
    warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                  "optimizer.synchronize(). This can cause training slowdown. You may want to "
                  "consider using optimizer.skip_synchronize() context if you use "
                  "optimizer.synchronize() in your code.")


class _StepHooks:
    """The wrapped class's step without torch's hook wrapper, its step pre- and post-hooks
    fired by hand: where weight updates are exchanged the post-hooks must run after the
    exchange (an EMA or a projection in one would otherwise see this rank's own, unexchanged
    parameters, different on every rank), and the pre-hooks still before the local step."""

    def __init__(self, opt, step, closure):
        self.opt = opt
        self.hooked = bool(getattr(step, "hooked", False))
        self.step = step.__wrapped__ if self.hooked else step
        self.args, self.kwargs = (opt,) if closure is None else (opt, closure), {}

    def run(self):
        if not self.hooked:
            return self.step(*self.args, **self.kwargs)
        from torch.optim import optimizer as torch_optimizer

        for hook in chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                          self.opt._optimizer_step_pre_hooks.values()):
            result = hook(self.opt, self.args, self.kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{self.step} must return None or a tuple of "
                                       f"(new_args, new_kwargs), but got {result}.")
                self.args, self.kwargs = result
        with torch.autograd.profiler.record_function(
                f"Optimizer.step#{type(self.opt).__name__}.step"):
            return self.step(*self.args, **self.kwargs)

    def post(self):
        if not self.hooked:
            return
        from torch.optim import optimizer as torch_optimizer

        for hook in chain(self.opt._optimizer_step_post_hooks.values(),
                          torch_optimizer._global_optimizer_post_hooks.values()):
            hook(self.opt, self.args, self.kwargs)


def _rebind_instance_step(wrapped, original) -> None:
    """An LR scheduler made before wrapping left ``original.step`` as an instance attribute (a
    wrapper around the base class's step, bound to ``original``). Copied over, it would run the
    base step with no exchange; drop it, and keep the scheduler's "step() was called" tracking
    on both objects (the scheduler holds ``original``)."""
    inner = wrapped.__dict__.pop("step", None)
    if inner is None or not getattr(inner, "_wrapped_by_lr_sched", False):
        return
    own_step = wrapped.step

    def step(*args, **kwargs):
        original._opt_called = True
        wrapped._opt_called = True
        return own_step(*args, **kwargs)

    step._wrapped_by_lr_sched = True
    wrapped.step = step


def _looks_adaptive(optimizer) -> bool:
    """An optimizer from outside torch (a hand-written Adam, Lion, LAMB) whose defaults carry an
    adaptive method's settings."""
    from .engine.config import adaptive_optimizer_classes

    if isinstance(optimizer, (torch.optim.SGD, *adaptive_optimizer_classes())):
        return False
    keys = set(getattr(optimizer, "defaults", {}))
    return bool(keys & {"betas", "beta1", "beta2"})


def _horovod_wrapped(optimizer) -> bool:
    """Made by Horovod's DistributedOptimizer (plain or Adasum): a class grafted from its body,
    told by the methods it brings (no Horovod import needed)."""
    return any("_allreduce_grad_async" in vars(c) and "_register_hooks" in vars(c)
               for c in type(optimizer).__mro__)


def is_sparse_optimizer(obj) -> bool:
    """True for optimizers returned by :func:`DistributedOptimizer`."""
    return isinstance(obj, torch.optim.Optimizer) and hasattr(obj, "_hs_engine")
