"""Resuming a sharded job on another rank count (run by tests/test_sharded.py): ``save`` trains
on one world size and writes one state dict per rank to $HVD_SPARSE_RESHARD_DIR; ``load``, on
another world size, merges them with ``merge_rank_states`` and trains on. Each rank writes
OUTDIR/rank<r>.json."""
import glob
import os
import warnings

import torch

import hvd_sparse as hvd
import scenario_runner as runner  # noqa: E402
import sharded_scenarios as base  # noqa: E402

DIR = os.environ.get("HVD_SPARSE_RESHARD_DIR", "")
#: without the downlink selection: no regions kept; the merged residual joins the owners' sums
UNI = os.environ.get("HVD_SPARSE_RESHARD_UNIDIRECTIONAL") == "1"


def make(m):
    return base.make(m, bidirectional=not UNI)


def save(res):
    m = base.model()
    opt = make(m)
    base.train(m, opt, 10)
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()},
               os.path.join(DIR, f"state{hvd.rank()}.pt"))
    res["saved_shards"] = all(v.shard is not None for v in opt.engine_state().values()
                              if v.sparse)


def load(res):
    files = sorted(glob.glob(os.path.join(DIR, "state*.pt")))
    states = [torch.load(f, weights_only=False) for f in files]
    res["old_size"] = len(states)
    merged = hvd.merge_rank_states([s["opt"] for s in states])
    # what the merge must hold: the regions in rank order plus every rank's unsent gradient
    # as it would have entered the average
    want = {}
    for name, entry in merged["hvd_sparse"]["buckets"].items():
        pieces = sorted((s["opt"]["hvd_sparse"] for s in states), key=lambda e: e["rank"])
        unsent = sum(p["buckets"][name]["uplink"] for p in pieces) * (1.0 / len(pieces))
        want[name] = unsent if UNI else unsent + torch.cat(
            [p["buckets"][name]["shard"]["residual"] for p in pieces])
    m = base.model(seed=5)
    m.load_state_dict(states[0]["model"])
    opt = make(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(merged)
    res["load_warnings"] = [str(w.message) for w in caught if "hvd_sparse" in str(w.message)
                            or "residual" in str(w.message)]
    view = opt.engine_state()
    res["merged_exact"] = all(torch.equal(view[n].downlink, w) for n, w in want.items())
    res["merged_has_mass"] = all(bool(w.any()) for w in want.values())
    # gathering the regions before any step (as a switch to allgather would) finds the
    # whole residual again: each rank's region is cut from it first, not taken as zeros
    engine = opt._hs_engine
    res["gathered_before_step_exact"] = UNI or all(
        torch.equal(engine._gather_regions(b), want[b.name]) for b in engine.buckets if b.sparse)
    base.train(m, opt, 6, start=10)
    after = opt.engine_state()
    # without the downlink selection no region is kept: each owner took its region of the
    # merged residual into its first sum, and nothing of it is left
    res["cut_into_regions"] = all((UNI or v.shard is not None) and v.downlink is None
                                  for v in after.values() if v.sparse)
    res["replicas_equal"] = runner.same_everywhere(hvd, base.params(m))
    res["finite"] = bool(torch.isfinite(base.params(m)).all())


if __name__ == "__main__":
    runner.run_scenarios(hvd, [save, load])
