"""The engine's checkpoint: replicated state (the same on every rank) and per-rank state.

Replicated: step counts, downlink residuals, cost choices, anchors, sparsifier state; compared
across ranks before an exchange and broadcast from a root where they differ. Per rank: the
uplink residuals, momentum-correction velocity and, under the sharded collective, the region
residual a rank owns. ``state_dict`` is versioned (``STATE_FORMAT``).
"""
from __future__ import annotations

import copy
import warnings

import torch

from .. import checkpoint
from ..feedback import Residual

STATE_FORMAT = 1


class Checkpointing:
    """The :class:`~hvd_sparse.engine.pipeline.Engine` methods that save and restore it."""

    def replicated_state(self) -> dict:
        """What every rank holds identically (the tensors themselves, not copies)."""
        return {
            "steps": self.steps,
            "local_count": self.local_count,
            "calibrated_at": self.calibrated_at,
            "calibrated_world": self.calibrated_world,
            "buckets": {b.name: {"downlink": self.state[b.index].downlink.buffer,
                                 "mode": self.state[b.index].mode,
                                 "collective": self.state[b.index].collective,
                                 "bounds": self.state[b.index].bounds,
                                 "load": self.state[b.index].load,
                                 "costs": dict(self.state[b.index].costs)}
                        for b in self.buckets if b.sparse},
            "anchors": {b.name: self.state[b.index].anchor for b in self.buckets
                        if self.state[b.index].anchor is not None},
            "sparsifier": self.config.sparsifier.state_dict(),
            "downlink_sparsifier": self.config.downlink_sparsifier.state_dict(),
            **({"switch": self.switch_state()} if self.switchable else {}),
        }

    def load_replicated(self, saved: dict) -> None:
        """Adopt replicated state (from :meth:`replicated_state` or a checkpoint), each tensor
        moved to the device of its bucket's parameters. The library's exchange switch
        first, where both sides may take it: what this rank's residuals hold may change."""
        self.adopt_switch(saved.get("switch"))
        buckets = saved["buckets"]
        for b in self.buckets:
            st = self.state[b.index]
            device = b.params[0].device
            if b.sparse and b.name not in buckets:  # not in a checkpoint: starts afresh
                st.downlink.load(None)
            elif b.sparse:
                entry = buckets[b.name]
                d = entry["downlink"]
                st.downlink.load(None if d is None else d.to(device))
                st.mode = entry.get("mode", "sparse")
                st.collective = entry.get("collective", st.collective)
                bounds = entry.get("bounds")
                st.bounds = None if bounds is None else tuple(int(x) for x in bounds)
                load = entry.get("load")
                st.load = None if load is None else load.double().to(device).clone()
                st.costs = dict(entry.get("costs", {}))
                if self.config.index_coding == "auto":
                    st.index_coding = st.costs.get("index_coding", "plain")
            a = saved.get("anchors", {}).get(b.name)
            st.anchor = None if a is None else a.to(device).clone()
        self.steps = int(saved.get("steps", 0))
        self.local_count = int(saved.get("local_count", 0))
        self.calibrated_at = saved.get("calibrated_at")
        self.calibrated_world = saved.get("calibrated_world")
        self.config.sparsifier.load_state_dict(saved.get("sparsifier", {}))
        self.config.downlink_sparsifier.load_state_dict(saved.get("downlink_sparsifier", {}))

    def adopt_switch(self, switch) -> None:
        """Take another rank's (or a checkpoint's) exchange switch where it differs from
        this rank's: the options and ``dense_only`` as they are there; where the exchanged
        kind changes, this rank's own residuals hold the other kind of mass and start
        afresh (a fresh process's hold none)."""
        if not self.switchable or switch is None or self.on_switch is None \
                or switch == self.switch_state():
            return
        kind = self.exchange_kind()
        self.on_switch(switch)
        if self.exchange_kind() != kind:
            for b in self.buckets:
                st = self.state[b.index]
                for r in (st.uplink, st.velocity):
                    if r is not None:
                        r.load(None)
                st.spare = None
                st.anchor = None

    def consolidate(self) -> None:
        """Collective (every rank, between steps): each sharded bucket's region residuals are
        allgathered, so that this rank's ``state_dict()`` before the next step holds the whole
        downlink residuals, as under the allgather collective, and a file saved by one rank
        resumes every rank without losing the other owners' unsent aggregate."""
        self._consolidated = {
            b.index: self._gather_regions(b) for b in self.buckets
            if b.sparse and self.collective(b) == "sharded"
            and self.state[b.index].shard is not None}

    def state_dict(self) -> dict:
        t = self.transport
        rep = self.replicated_state()
        partial = False  # a region residual of this rank only
        for b in self.buckets:
            if b.sparse:
                st = self.state[b.index]
                entry = rep["buckets"][b.name]
                entry["numel"] = b.numel
                # which parameters' entries it holds, in order: a checkpoint resumed where the
                # tensors are grouped otherwise (shared buckets, another scope) is regrouped
                entry["members"] = [[n, lo, hi] for n, (lo, hi) in zip(b.names, b.slices)]
                entry["downlink"] = st.downlink.state()
                entry["uplink"] = st.uplink.state()
                entry["velocity"] = st.velocity.state() if st.velocity else None
                if b.index in self._snapshots:  # between backward() and step(): see below
                    res, vel = self._snapshots[b.index]
                    entry["uplink"] = None if res is None else res.detach().clone()
                    entry["velocity"] = None if vel is None else vel.clone()
                entry["load"] = None if st.load is None else st.load.clone()
                entry["shard"] = None
                if b.index in self._consolidated:
                    entry["downlink"] = self._consolidated[b.index].clone()
                elif st.shard is not None:
                    entry["shard"] = {"layout": list(st.shard_layout),
                                      "residual": st.shard.state()}
                    partial = partial or st.shard.buffer is not None
        if partial and t.rank() == 0 and t.size() > 1:
            warnings.warn(checkpoint.PARTIAL_STATE_MESSAGE, checkpoint.ShardedStateWarning)
        if self._sparsifier_snapshot is not None:
            # Taken between backward() and step() (a checkpoint hook after backward, say):
            # buckets exchanged by a method's plain form already folded this step's gradient
            # into their residual, and stateful methods (adaptive k) moved on. The state as the
            # step found it was kept for a non-finite step's rollback; that is the one saved,
            # so that repeating the backward after a resume equals not stopping.
            rep["sparsifier"] = copy.deepcopy(self._sparsifier_snapshot[0])
            rep["downlink_sparsifier"] = copy.deepcopy(self._sparsifier_snapshot[1])
        rep["anchors"] = {k: v.clone() for k, v in rep["anchors"].items()}
        # this rank's timings for the time cost model (not yet calibrated on, or to price the
        # next calibration): a process resumed just before the calibration had none and
        # priced its sparse compute at zero
        names = {b.index: b.name for b in self.buckets}
        rep["measured"] = {
            "world": self._measured_world,
            "compute": {names[i]: float(v) for i, v in self._measured.items()},
            "wire": {names[i]: [float(x) for x in v] for i, v in self._wire.items()},
            "coding": {names[i]: v for i, v in self._measured_coding.items()}}
        rep.update({"format": STATE_FORMAT, "world_size": t.size(), "rank": t.rank(),
                    "stats": self.stats.state_dict(), "average": self.config.average,
                    "bidirectional": self.config.bidirectional,
                    "exchange": self.exchange_kind(),
                    # the library's all-dense switch to Horovod's step was taken (absent
                    # before the thirty-sixth session)
                    "horovods_step": bool(self.dense_only)})
        return checkpoint.loadable(rep)

    def checked_state(self, extra: dict) -> dict:
        """A saved engine state made to fit this optimizer, or an error, before anything is
        loaded (the wrapper calls it before the wrapped optimizer's own state is loaded, so
        a refused checkpoint leaves both as they were). Buckets are matched by name; where
        the names differ (no ``named_parameters``, a model wrapped in a container,
        ``torch.compile``) but the buckets are the same in number and size, by position, as
        torch and Horovod load optimizer states. A bucket that is sparse on one side only
        (another density, scope or ``min_sparse_numel``) starts afresh here, and unsent mass
        saved for one that is not sparse here is dropped, with a warning. A bucket of
        another size under the same name is a model mismatch and raises."""
        if not isinstance(extra, dict):
            raise TypeError(f"the state dict's 'hvd_sparse' entry is this optimizer's saved "
                            f"state, a dict (from state_dict()); got {type(extra).__name__}")
        if extra.get("format") != STATE_FORMAT:
            raise ValueError(f"hvd_sparse state has format {extra.get('format')}, "
                             f"this version reads {STATE_FORMAT}")
        order = [b for b in self.buckets if b.sparse]
        mine = {b.name: b for b in order}
        extra = _compiled_names_matched(extra, set(mine), [b.name for b in self.buckets])
        extra = _positions_matched(extra, order, self.buckets,
                                   getattr(self, "known_names", set()))
        extra = _regrouped(extra, order)
        saved = extra["buckets"]
        for bname in sorted(set(saved) & set(mine)):
            if saved[bname]["numel"] != mine[bname].numel:
                raise ValueError(f"bucket '{bname}' has {saved[bname]['numel']} entries in the "
                                 f"checkpoint and {mine[bname].numel} here (another model?)")
        if set(saved) - set(mine):
            lost = sorted(_described(n, saved[n]) for n in set(saved) - set(mine)
                          if _holds_mass(saved[n]))
            if lost:
                warnings.warn(
                    "the checkpoint's sparse buckets differ from this optimizer's (made with "
                    "another density, scope, min_sparse_numel, named_parameters or set of "
                    "trainable parameters?): the "
                    f"unsent mass it holds for {', '.join(lost)}, which are not sparse buckets "
                    f"here (this optimizer's: {', '.join(sorted(mine)) or 'none'}), is dropped; "
                    "resume with the settings it was saved with to keep it")
            extra = dict(extra, buckets={n: v for n, v in saved.items() if n in mine})
        return extra

    def load_state_dict(self, extra: dict) -> None:
        """Restore the engine's state (fitted first by :meth:`checked_state`). The rule for a
        state saved elsewhere:

        * saved by this rank in a job of the same size: everything is restored exactly;
        * saved by another rank, or by a job of another size (a rank-0 checkpoint loaded on all
          ranks, ``hvd.elastic`` after workers came or went): the replicated parts (downlink
          residuals, counters, sparsifier state, cost-model choices) are restored and this rank
          keeps its *own* uplink residuals and velocity as they are in memory (zeros in a fresh
          process). The uplink residual of a rank that is gone (a departed elastic worker) is
          lost: its unsent gradient mass is dropped, a bounded loss of small entries.

        Before the next exchange the ranks compare their replicated state and adopt rank 0's
        where it differs (:mod:`hvd_sparse.engine.agreement`), so loading on rank 0 only and
        then calling ``broadcast_optimizer_state`` on every rank leaves all replicas equal.
        """
        t = self.transport
        extra = self.checked_state(extra)
        mine = {b.name: b for b in self.buckets if b.sparse}
        saved = extra["buckets"]
        saved_kind = extra.get("exchange")  # (absent before the twenty-seventh session)
        other_kind = saved_kind not in (None, self.exchange_kind())
        own = extra["rank"] == t.rank() and extra["world_size"] == t.size() and not other_kind
        fresh = all(self.state[b.index].uplink.buffer is None for b in mine.values())
        if other_kind and any(v.get(k) is not None for v in saved.values()
                              for k in ("uplink", "downlink", "velocity")):
            # gradients where weight changes are expected, or the reverse: applied as they
            # are, a gradient residual moved the weights 55 times as far as a step, uphill
            warnings.warn(
                f"hvd_sparse state saved with exchange=\"{saved_kind}\" loaded where "
                f"\"{self.exchange_kind()}\" is exchanged: its residuals hold the other kind "
                "of mass and are dropped (counters and sparsifier state are restored); resume "
                f"with exchange=\"{saved_kind}\" to keep them")
        elif not own and fresh and any(v["uplink"] is not None for v in saved.values()):
            warnings.warn(
                f"hvd_sparse state from rank {extra['rank']} of {extra['world_size']} loaded on "
                f"rank {t.rank()} of {t.size()}: downlink residuals and counters restored; this "
                "rank's uplink residuals start from zero (save one state dict per rank to keep "
                "them)")
        self.load_replicated(extra)
        # the wrapped optimizer's state in it is per rank: averaged at the next step (agreed)
        self.per_rank_state_loaded = saved_kind == "update" and self.exchange_kind() == "gradient"
        if other_kind:  # every residual, velocity and anchor starts afresh
            for b in self.buckets:
                st = self.state[b.index]
                for r in (st.uplink, st.downlink, st.velocity):
                    if r is not None:
                        r.load(None)
                st.anchor = None
        if own:
            for bname, b in mine.items():
                if bname not in saved:  # not in the checkpoint: as it is
                    continue
                st = self.state[b.index]
                up = saved[bname]["uplink"]
                st.uplink.load(None if up is None else up.to(b.params[0].device))
                if st.velocity is not None:
                    v = saved[bname].get("velocity")
                    st.velocity.load(None if v is None else v.to(b.params[0].device))
        self._load_shards(saved, mine, own, drop=other_kind)
        measured = extra.get("measured")
        if own and measured is not None:  # timings are this rank's own, like its residuals
            index = {b.name: b.index for b in self.buckets}
            self._measured_world = measured["world"]
            self._measured = {index[n]: v for n, v in measured["compute"].items() if n in index}
            self._wire = {index[n]: list(v) for n, v in measured["wire"].items() if n in index}
            self._measured_coding = {index[n]: v for n, v in measured["coding"].items()
                                     if n in index}
        self.stats.load_state_dict(extra.get("stats", {}))
        self._consolidated.clear()
        self.agreement_due = True

    def exchange_kind(self) -> str:
        """What the residuals hold: "gradient" mass, or "update" mass (weight changes)."""
        return "update" if self.config.exchanges_updates else "gradient"

    def take_pending(self) -> dict:
        """The mass loaded residuals hold, per sparse bucket index (flat; only non-zero ones),
        the residuals then emptied. For one process under Horovod, where the wrapped optimizer
        steps alone and nothing is exchanged: a state saved by a larger job (or merged with
        ``merge_rank_states``) joins the next step once, instead of sitting unused and being
        saved again into the next checkpoint (then replayed, stale, at the next resume on
        more ranks)."""
        out = {}
        for b in self.buckets:
            st = self.state[b.index]
            if not b.sparse:
                continue
            parts = [r.buffer for r in (st.uplink, st.downlink) if r.buffer is not None]
            if st.shard is not None and st.shard.buffer is not None:  # this rank's region
                lo, hi = st.shard_layout[2:4]
                whole = st.shard.buffer.new_zeros(b.numel)
                whole[lo:hi] = st.shard.buffer
                parts.append(whole)
            for r in (st.uplink, st.downlink, st.velocity, st.shard):
                if r is not None:
                    r.load(None)
            st.shard, st.shard_layout = None, None
            if parts:
                total = parts[0].double().clone()
                for x in parts[1:]:
                    total.add_(x.double())
                if bool(total.any()):
                    out[b.index] = total
        return out

    def _load_shards(self, saved, mine, own, drop=False) -> None:
        """Sharded exchange: a region residual is restored on the rank that saved it, in a
        job of the same size; elsewhere the region starts from zero, with a warning
        (``drop``: from zero, the caller said why)."""
        dropped = []
        for bname, b in mine.items():
            st = self.state[b.index]
            entry = saved.get(bname, {}).get("shard")
            st.shard, st.shard_layout = None, None
            if entry is None:
                continue
            if own:
                st.shard = Residual(len(range(*entry["layout"][2:])), st.downlink.dtype)
                st.shard.load(entry["residual"].to(b.params[0].device)
                              if entry["residual"] is not None else None)
                st.shard_layout = tuple(entry["layout"])
            elif not drop and entry["residual"] is not None and bool(entry["residual"].any()):
                dropped.append(bname)
        if dropped:
            warnings.warn(
                f"sharded exchange: the region residuals of {', '.join(dropped)} were saved by "
                "another rank or world size and start from zero on rank "
                f"{self.transport.rank()} of {self.transport.size()}: each is held by its "
                "owner alone and cannot be re-sharded from one rank's file; to keep them, "
                "save one state dict per rank and resume each rank from its own with the "
                "same number of ranks, or load hvd_sparse.merge_rank_states(all of them) on "
                "every rank of a job of any size")


#: what ``torch.compile`` puts before the parameter names of the module it wraps
COMPILED_PREFIX = "_orig_mod."


def _compiled_names_matched(extra: dict, sparse: set, names: list) -> dict:
    """``extra`` with its bucket names renamed to this optimizer's where the two differ only by
    ``torch.compile``'s prefix (a checkpoint of the compiled model resumed on the plain one, or
    the reverse, as torch and Horovod load optimizer states by position); else ``extra``."""
    saved = set(extra["buckets"])
    if saved == sparse:
        return extra

    def plain(name):
        return name.replace(COMPILED_PREFIX, "")

    ours = {plain(n): n for n in names}
    if len(ours) != len(names) or {plain(n) for n in saved} != {plain(n) for n in sparse}:
        return extra
    rename = {n: ours[plain(n)] for n in saved}
    return _renamed(extra, lambda k: rename.get(k, ours.get(plain(k), k)))


def _holds_mass(entry: dict) -> bool:
    """Whether a saved sparse bucket holds unsent mass (a non-zero residual or velocity)."""
    shard = entry.get("shard") or {}
    tensors = [entry.get(k) for k in ("uplink", "downlink", "velocity")] + \
        [shard.get("residual")]
    return any(t is not None and bool(t.any()) for t in tensors)


def _positions_matched(extra: dict, order: list, buckets: list, names=frozenset()) -> dict:
    """``extra`` with its sparse bucket names (and anchors') renamed to this optimizer's by
    position where the names are foreign to this model (none of them a bucket or parameter
    name here) but the buckets agree in number and size, in order; else ``extra`` (names
    of this model's own that are not sparse buckets here mean another split, by density,
    scope or a layer frozen: their mass belongs to those parameters, not to others of the
    same size)."""
    saved = extra["buckets"]
    ours = [b.name for b in order]
    known = {b.name for b in buckets} | {n for b in buckets for n in b.names} | set(names)
    if set(saved) == set(ours) or set(saved) & known or len(saved) != len(ours) \
            or [v["numel"] for v in saved.values()] != [b.numel for b in order]:
        return extra
    rename = dict(zip(saved, ours))
    anchors = extra.get("anchors", {})
    if len(anchors) == len(buckets) and not set(anchors) <= {b.name for b in buckets} \
            and [a.numel() for a in anchors.values()] == [b.numel for b in buckets]:
        rename.update(zip(anchors, (b.name for b in buckets)))  # every bucket's, in order
    return _renamed(extra, lambda k: rename.get(k, k))


#: the per-entry tensors of a saved bucket, laid out like its entries
_LAID_OUT = ("uplink", "downlink", "velocity")


def _regrouped(extra: dict, order: list) -> dict:
    """``extra`` with the mass of saved buckets that are not this optimizer's moved, parameter
    by parameter, into this optimizer's buckets that the checkpoint lacks, where any
    parameter slice such a bucket holds is in the checkpoint (the same tensors grouped
    otherwise: short tensors sharing buckets or not, another scope, a layer frozen or
    unfrozen since; the slices it lacks start from zero). A saved bucket's members
    are recorded since the thirty-fourth session; one without them counts as the parameter it
    is named after when its length is that parameter's (one bucket per tensor, as before).
    Residuals, velocity and anchors move; the cost model's choices start afresh for the
    regrouped buckets. Saved buckets not wholly used stay for :meth:`checked_state`'s
    warning."""
    saved = extra["buckets"]
    missing = [b for b in order if b.name not in saved]
    foreign = [n for n in saved if all(n != b.name for b in order)]
    if not missing or not foreign:
        return extra
    numel_of = {n: p.numel() for b in order for n, p in zip(b.names, b.params)}
    anchors = extra.get("anchors", {})
    pieces, source = {}, {}  # (parameter, lo, hi) -> {field: tensor}, and its saved bucket
    for name in foreign:
        entry = saved[name]
        members = entry.get("members")
        if members is None and numel_of.get(name) == entry.get("numel"):
            members = [[name, 0, entry["numel"]]]
        if not members or entry.get("shard") is not None:
            continue
        off = 0
        for pname, lo, hi in members:
            key = (pname, int(lo), int(hi))
            fields = {f: None if entry.get(f) is None else entry[f][off:off + hi - lo]
                      for f in _LAID_OUT}
            a = anchors.get(name)
            fields["anchor"] = None if a is None else a.reshape(-1)[off:off + hi - lo]
            pieces[key], source[key] = fields, name
            off += hi - lo
    placed = set()
    buckets, anchors = dict(saved), dict(anchors)
    for b in missing:
        keys = [(n, lo, hi) for n, (lo, hi) in zip(b.names, b.slices)]
        if not any(k in pieces for k in keys):
            continue
        absent = dict.fromkeys(_LAID_OUT + ("anchor",))  # (a new slice: nothing saved)
        entry = {"numel": b.numel, "mode": "sparse", "bounds": None, "load": None,
                 "costs": {}, "shard": None, "members": [list(k) for k in keys]}
        for f in _LAID_OUT + ("anchor",):
            parts = [pieces.get(k, absent)[f] for k in keys]
            whole = None
            if any(t is not None for t in parts):
                like = next(t for t in parts if t is not None)
                whole = torch.cat([t if t is not None else like.new_zeros(hi - lo)
                                   for t, (_, lo, hi) in zip(parts, keys)])
            if f != "anchor":
                entry[f] = whole
            elif all(t is not None for t in parts):  # (else the engine anchors afresh)
                anchors[b.name] = whole
        buckets[b.name] = entry
        placed.update(keys)
    if not placed:
        return extra
    for name in set(source.values()):  # a saved bucket wholly moved is gone; one moved in
        # part keeps only what was not (for the warning, which then names just that)
        keys = [k for k, v in source.items() if v == name]
        rest = [k for k in keys if k not in placed]
        anchors.pop(name, None)
        if not rest:
            buckets.pop(name, None)
        elif len(rest) < len(keys):
            entry = dict(buckets[name], members=[list(k) for k in rest],
                         numel=sum(hi - lo for _, lo, hi in rest))
            for f in _LAID_OUT:
                parts = [pieces[k][f] for k in rest]
                entry[f] = None if any(t is None for t in parts) else torch.cat(parts)
            buckets[name] = entry
    return dict(extra, buckets=buckets, anchors=anchors)


def _described(name: str, entry: dict) -> str:
    """A saved bucket's name for a warning, with the parameters it still holds where only
    some of its members are left (the rest moved into this optimizer's buckets)."""
    members = entry.get("members")
    if not members or len(members) < 2 and members[0][0] == name:
        return name
    return f"{name} ({', '.join(m[0] for m in members)})"


def _renamed(extra: dict, new_name) -> dict:
    """``extra`` with the bucket names of every per-bucket table renamed by ``new_name``."""
    def keyed(d):
        return {new_name(k): v for k, v in d.items()}

    out = dict(extra, buckets=keyed(extra["buckets"]), anchors=keyed(extra.get("anchors", {})))
    for key in ("sparsifier", "downlink_sparsifier"):
        state = extra.get(key)
        if isinstance(state, dict) and isinstance(state.get("buckets"), dict):
            out[key] = dict(state, buckets=keyed(state["buckets"]))
    measured = extra.get("measured")
    if measured is not None:
        out["measured"] = dict(measured, **{k: keyed(measured[k]) for k in
                                            ("compute", "wire", "coding") if k in measured})
    return out
