"""Checkpoints of a sharded exchange: one rank's file made whole, or all ranks' files merged.

With ``collective="sharded"`` (or ``"auto"`` when it shards) a region's downlink residual lives
on its owner alone, and every rank's uplink residual is its own; a single rank's state dict
holds neither the other regions nor the other ranks' unsent gradient.

The usual Horovod checkpoint, saved by rank 0 alone, keeps the regions when every rank first
calls ``optimizer.consolidate_state_dict()`` (a collective, as for PyTorch's
``ZeroRedundancyOptimizer``): rank 0's next ``state_dict()`` then holds the whole downlink
residuals, and loads on any number of ranks. Without it, rank 0's ``state_dict()`` warns
(:class:`ShardedStateWarning`, once) that it holds region 0 only.

To keep every rank's unsent gradient too, and resume with a different rank count, save one state
dict per rank, then on the new job::

    states = [torch.load(f"opt_rank{r}.pt") for r in range(old_world_size)]
    opt.load_state_dict(hvd_sparse.merge_rank_states(states))   # on every rank

The merged state is whole and replicated: each bucket's downlink residual is the owners'
regions put back together in rank order, and what every rank had not sent yet (its uplink
residual) is added to it as it would have entered the aggregate (divided by the old rank count
under ``op=Average``), so no gradient mass is lost; the new job cuts its own regions from it
on its first step. Everything else (counters, sparsifier state, the wrapped optimizer's state)
is rank 0's. Per-rank momentum-correction velocities cannot be combined and start from zero.
With ``bidirectional=False`` the engine keeps no downlink residual of its own: it adds the
loaded one whole to its first aggregate after loading (an owner its region of it), so the
unsent mass arrives in one step instead of being dropped.
"""
from __future__ import annotations

import copy
from typing import List

import torch

STATE_KEY = "hvd_sparse"


def loadable(obj):
    """``obj`` with numpy scalars and arrays made Python numbers and tensors (nested dicts,
    lists and tuples): what ``torch.load`` reads with its default ``weights_only=True``
    (torch >= 2.6), so a checkpoint holding this state loads as a plain optimizer's does."""
    if isinstance(obj, dict):
        return {k: loadable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [loadable(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if type(obj).__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            return torch.from_numpy(obj.copy())
        return obj.item()
    return obj


class ShardedStateWarning(UserWarning):
    """A state dict that holds this rank's regions of a sharded exchange only."""


PARTIAL_STATE_MESSAGE = (
    "hvd_sparse: sharded buckets keep each region's downlink residual on its owner, so this "
    "state dict holds rank 0's regions only. If rank 0 alone saves it, call "
    "optimizer.consolidate_state_dict() on every rank first (or use collective='allgather'), "
    "or the other regions' unsent aggregate is lost on resume; if every rank saves its own "
    "state dict, nothing is lost and this warning can be ignored.")


def merge_rank_states(states: List[dict]) -> dict:
    """One optimizer state dict from the per-rank state dicts of one job (one per rank, any
    order), loadable on any number of ranks."""
    if not states:
        raise ValueError("merge_rank_states needs the state dict of every rank; got none")
    extras = [s.get(STATE_KEY) if isinstance(s, dict) else None for s in states]
    if any(e is None for e in extras):
        raise ValueError("merge_rank_states takes hvd_sparse optimizer state dicts "
                         "(optimizer.state_dict() of hvd_sparse.DistributedOptimizer)")
    if any(e.get("merged") for e in extras):
        raise ValueError("these state dicts were merged already; load the merged one directly")
    size = extras[0]["world_size"]
    ranks = sorted(e["rank"] for e in extras)
    if any(e["world_size"] != size for e in extras) or ranks != list(range(size)):
        raise ValueError(
            f"merge_rank_states needs exactly one state dict per rank of one job: got ranks "
            f"{ranks} of world sizes {sorted({e['world_size'] for e in extras})}")
    by_rank = {e["rank"]: (s, e) for s, e in zip(states, extras)}
    first, extra0 = by_rank[0]
    out = copy.copy(first)
    merged = copy.deepcopy(extra0)
    scale = 1.0 / size if extra0.get("average", True) else 1.0
    for name, entry in merged["buckets"].items():
        pieces = [by_rank[r][1]["buckets"][name] for r in range(size)]
        full = _whole_downlink(name, entry["numel"], pieces)
        uplinks = [p["uplink"] for p in pieces if p.get("uplink") is not None]
        # the ranks' unsent mass, as the aggregate would carry it: the downlink residual
        # (without the downlink selection the engine adds it whole to its next aggregate)
        if uplinks:
            unsent = torch.zeros(entry["numel"], dtype=uplinks[0].dtype)
            for u in uplinks:  # rank order
                unsent += u.detach().cpu().reshape(-1)
            full = unsent.mul_(scale) if full is None else full.add_(unsent.to(full.dtype) * scale)
        entry["downlink"] = full
        entry["shard"] = None
        entry["uplink"] = None
        entry["velocity"] = None
    merged["merged"] = True
    merged["rank"] = -1
    out[STATE_KEY] = merged
    return out


def _whole_downlink(name, numel, pieces):
    """The bucket's downlink residual: the replicated one, or the owners' regions in order."""
    shards = [p.get("shard") for p in pieces]
    if all(s is None for s in shards):
        d = pieces[0].get("downlink")
        return None if d is None else d.detach().cpu().reshape(-1).clone()
    present = [s["residual"] for s in shards if s is not None and s["residual"] is not None]
    present += [p["uplink"] for p in pieces if p.get("uplink") is not None]
    full = torch.zeros(numel, dtype=present[0].dtype if present else torch.float32)
    covered = 0
    for r, s in enumerate(shards):
        if s is None:
            raise ValueError(f"bucket '{name}': rank {r} holds no region residual while others "
                             "do; the state dicts come from different steps or jobs")
        _size, _rank, lo, hi = s["layout"]
        if lo != covered:
            raise ValueError(f"bucket '{name}': rank {r}'s region starts at {lo}, expected "
                             f"{covered}; the state dicts come from different jobs")
        res = s["residual"]
        if res is not None:
            full[lo:hi] = res.detach().cpu().reshape(-1).to(full.dtype)
        covered = hi
    if covered != numel:
        raise ValueError(f"bucket '{name}': the regions cover {covered} of {numel} entries")
    return full
