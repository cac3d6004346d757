"""Every sparsifier on real ranks: identical replicas, per-rank counts, mass, resume, convergence.

Run by tests/test_sparsifiers_multirank.py; each rank writes OUTDIR/rank<r>.json.
Data: scikit-learn's bundled digits (real 8x8 handwritten digits, 1797 images, no download).
"""
import copy
import hashlib
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import hvd_sparse as hvd
from hvd_sparse.sparsifiers import threshold_for_k

torch.set_num_threads(1)
STEPS = 100


def digits():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(d.target, dtype=torch.int64)


X, Y = digits()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def batch(step, rank, size, n=32):
    g = torch.Generator().manual_seed(step * 7919 + rank)
    shard = torch.arange(rank, X.shape[0], size)
    idx = shard[torch.randint(0, shard.numel(), (n,), generator=g)]
    return X[idx], Y[idx]


def full_loss(m):
    with torch.no_grad():
        return float(F.cross_entropy(m(X), Y))


def digest(t):
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def same_everywhere(t):
    ds = hvd.allgather_object(digest(t))
    return all(d == ds[0] for d in ds)


def params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def common_threshold(density):
    """Hard-threshold lambda from a batch every rank shares, by the 'sample' rule of thumb."""
    m = model()
    F.cross_entropy(m(X[:256]), Y[:256]).backward()
    g = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    return threshold_for_k(g, int(density * g.numel()))


def configs():
    dens = 0.05
    return {
        "topk": dict(sparsifier="topk"),
        # one bucket for the model, each tensor keeping half its own Top-K (layer_floor)
        "topk_floor": dict(sparsifier="topk", scope="model", layer_floor=0.5),
        "gaussiank": dict(sparsifier="gaussiank"),
        "threshold": dict(sparsifier="threshold", threshold=common_threshold(dens)),
        "adaptive": dict(sparsifier="adaptive", total_steps=STEPS),
        "sbc": dict(sparsifier="sbc"),
        # random-k with error feedback carries stale mass ~1/density steps: no base momentum
        "randomk": dict(sparsifier="randomk", density=0.2, _momentum=0.0),
        "sbc_delay": dict(sparsifier="sbc", local_steps=4, density=0.1),
        # with the density cool-down over steps 20-59 (the resume below checkpoints in it)
        "topk_dgc": dict(sparsifier="topk", momentum_correction=0.9, local_clip_norm=5.0,
                         density_warmup_steps=20, dense_warmup_steps=5, total_steps=60,
                         density_cooldown_steps=40, cooldown_density=0.2),
    }


def build(name, cfg):
    m = model()
    cfg = dict(cfg)
    cfg.setdefault("density", 0.05)
    cfg.setdefault("cost_model", "off")  # these scenarios test the sparse path itself
    momentum = cfg.pop("_momentum", 0.0 if cfg.get("momentum_correction") else 0.9)
    base = torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum)
    opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                   bidirectional=True, min_sparse_numel=0, **cfg)
    return m, opt


def run(m, opt, start, steps, counts=None):
    rank, size = hvd.rank(), hvd.size()
    for step in range(start, start + steps):
        x, y = batch(step, rank, size)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        if counts is not None and opt.communication_stats()["steps"] > 0:
            counts.append(opt.communication_stats()["selected"])


def scenario(name, cfg, res):
    out = res[name] = {}
    m, opt = build(name, cfg)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    out["loss_start"] = full_loss(m)
    counts = []
    run(m, opt, 0, STEPS, counts)
    out["loss_end"] = full_loss(m)
    out["params_equal"] = same_everywhere(params(m))
    down = [v.downlink for v in opt.engine_state().values() if v.downlink is not None]
    out["downlink_equal"] = same_everywhere(torch.cat(down)) if down else None
    out["counts"] = counts
    stats = opt.communication_stats()
    out["stats"] = {k: stats[k] for k in ("bytes_sent", "dense_bytes", "selected", "target",
                                           "bits_per_selected", "steps")}
    out["total_error"] = stats["totals"]["compression_error"]

    # exact resume: 30 steps, checkpoint, 30 more == 60 straight
    m1, o1 = build(name, cfg)
    run(m1, o1, 0, 60)
    m2, o2 = build(name, cfg)
    run(m2, o2, 0, 30)
    ckpt = copy.deepcopy({"m": m2.state_dict(), "o": o2.state_dict()})
    m3, o3 = build(name, cfg)
    m3.load_state_dict(ckpt["m"])
    o3.load_state_dict(ckpt["o"])
    run(m3, o3, 30, 30)
    out["resume_bitwise"] = bool(torch.equal(params(m1), params(m3)))


def scenario_dense_control(res):
    import horovod.torch as real
    m = model()
    opt = real.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=m.named_parameters())
    start = full_loss(m)
    run(m, opt, 0, STEPS)
    res["dense"] = {"loss_start": start, "loss_end": full_loss(m)}


def main():
    outdir = sys.argv[1]
    only = set(sys.argv[2:])
    hvd.init()
    res = {"size": hvd.size(), "rank": hvd.rank()}
    for name, cfg in configs().items():
        if only and name not in only:
            continue
        try:
            scenario(name, cfg, res)
        except Exception:
            res.setdefault("errors", {})[name] = traceback.format_exc()
    try:
        scenario_dense_control(res)
    except Exception:
        res.setdefault("errors", {})["dense"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    hvd.shutdown()


if __name__ == "__main__":
    main()
