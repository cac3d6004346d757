"""A training step of a many-tensor model on one GPU, 2 ranks over mpi4py: where the per-bucket
cost of the sparse path lands against a dense exchange and the no-exchange floor.

    mpirun -np 2 python benchmarks/gpu_step.py [--device cuda] [--layers 8] [--width 512]

Model: a Transformer encoder (``layers`` blocks of four large matrices each, plus biases and
norms: 4 x layers tensors above ``min_sparse_numel``), so the default ``scope`` gives one bucket
per large tensor, the case README lists as about 2 ms of engine step per bucket on a GPU.
Per rank and step: forward, backward, exchange, ``step``. Variants, timed in interleaved rounds
in the same run (all ranks run the same variant at once):

- ``floor``: no exchange (each rank its own ``optimizer.step``);
- ``dense``: one fused ``allreduce_`` of every gradient (what Horovod's fusion buffer does);
- ``sparse_default``: ``hvd_sparse.mpi.DistributedOptimizer`` with its defaults (Top-K 1%, the
  time-based cost model, which may send buckets dense);
- ``sparse_tensor``: the same with ``cost_model="off"``, one bucket per tensor;
- ``sparse_model``: ``cost_model="off"``, ``scope="model"`` (one bucket, one global Top-K);
- ``sparse_bucket``: ``cost_model="off"``, ``scope="bucket"`` (25 MB buckets);
- ``sparse_model_floor``: ``scope="model"`` with ``layer_floor=0.5``;
- ``sparse_model_layerwise``, ``sparse_bucket_layerwise``: ``layer_floor=1.0``, each tensor its
  own Top-K as under ``scope="tensor"``, in one bucket or in 25 MB buckets.

Writes ``results/gpu_step_<device>.json`` (or ``--out``). ``--replot A.json B.json ...`` draws
the runs' steps against their floors into ``results/gpu_step.png`` and stops.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, machine  # noqa: E402

import hvd_sparse.mpi as hvd  # noqa: E402


def build(layers, width, device):
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width,
                                             batch_first=True, dropout=0.0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(block, layers,
                                                            enable_nested_tensor=False),
                                torch.nn.Linear(width, 1))
    return model.to(device)


def variant(name, model, lr=1e-3):
    base = torch.optim.AdamW(model.parameters(), lr=lr)
    if name in ("floor", "dense"):
        return base
    extra = {"sparse_default": {},
             "sparse_tensor": {"cost_model": "off", "scope": "tensor"},
             "sparse_model": {"cost_model": "off", "scope": "model"},
             "sparse_bucket": {"cost_model": "off", "scope": "bucket"},
             "sparse_model_floor": {"cost_model": "off", "scope": "model",
                                    "layer_floor": 0.5},
             "sparse_model_layerwise": {"cost_model": "off", "scope": "model",
                                        "layer_floor": 1.0},
             "sparse_bucket_layerwise": {"cost_model": "off", "scope": "bucket",
                                         "layer_floor": 1.0}}[name]
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    density=0.01, **extra)


def setup(args):
    """``hvd.init()``, this rank's device, a device synchronisation, and this rank's batch
    (its own data, as data parallelism gives each rank)."""
    hvd.init()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(args.batch, args.seq, args.width, generator=gen).to(dev)
    y = torch.randn(args.batch, args.seq, 1, generator=gen).to(dev)
    return dev, sync, x, y


def dense_exchange(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    hvd.allreduce_(flat, op=hvd.Average, name="dense.fused")
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def plot(paths, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - the attribute used below

    runs = [json.loads(Path(p).read_text()) for p in paths]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        names = list(run["variants"])
        ms = [run["variants"][n]["step_s_median"] * 1e3 for n in names]
        ax.barh(names, ms, color=["grey" if n == "floor" else "tab:blue" for n in names])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("step (ms, median, slowest rank)")
        ax.set_title(f"{run['parameters'] / 1e6:.0f}M parameters, "
                     f"{run['tensors_at_least_1024']} tensors >= 1024\n"
                     f"{run['ranks']} ranks on one {run['machine'].get('gpu', run['device'])}",
                     fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--replot":
        return plot(sys.argv[2:], RESULTS / "gpu_step.png")
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps (calibration: 3)")
    ap.add_argument("--variants", nargs="+",
                    default=["floor", "dense", "sparse_default", "sparse_tensor",
                             "sparse_model"])
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, sync, x, y = setup(args)
    runs = {}
    for name in args.variants:
        model = build(args.layers, args.width, dev)
        runs[name] = {"model": model, "opt": variant(name, model), "times": []}

    def one_step(name):
        r = runs[name]
        r["opt"].zero_grad()
        torch.nn.functional.mse_loss(r["model"](x), y).backward()
        if name == "dense":
            dense_exchange(r["model"])
        r["opt"].step()

    for name in args.variants:
        for _ in range(args.warmup):
            one_step(name)
    for _ in range(args.rounds):
        for name in args.variants:
            sync()
            hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")
            for _ in range(args.steps):
                t = time.perf_counter()
                one_step(name)
                sync()
                runs[name]["times"].append(time.perf_counter() - t)
    model = runs[args.variants[0]]["model"]
    big = sum(p.numel() >= 1024 for p in model.parameters())
    out = {"machine": machine(), "ranks": hvd.size(), "device": args.device,
           "parameters": sum(p.numel() for p in model.parameters()),
           "tensors": sum(1 for _ in model.parameters()), "tensors_at_least_1024": big,
           "args": vars(args), "variants": {}}
    floor = None
    for name in args.variants:
        # a step's time is its slowest rank's
        med = statistics.median(runs[name]["times"])
        worst = max(hvd.allgather_object(med))
        floor = worst if name == "floor" else floor
        entry = {"step_s_median": worst}
        opt = runs[name]["opt"]
        if hasattr(opt, "communication_stats"):
            stats = opt.communication_stats()
            entry["stage_seconds_last_step"] = stats["stage_seconds"]
            entry["cost_model"] = stats["cost_model"]
            entry["buckets"] = len(opt.engine_state())
            modes = [c.get("mode") for c in stats["cost_model"]["buckets"].values()]
            entry["bucket_modes"] = {str(m): modes.count(m) for m in set(modes)}
        runs[name]["entry"] = entry
        out["variants"][name] = entry
    for name, entry in out["variants"].items():
        if floor:
            entry["over_floor"] = entry["step_s_median"] / floor
    if hvd.rank() == 0:
        path = Path(args.out) if args.out else RESULTS / f"gpu_step_{args.device}.json"
        path.write_text(json.dumps(out, indent=1, default=str))
        print(f"{out['parameters']:,} parameters in {out['tensors']} tensors "
              f"({big} of at least 1024 entries), {hvd.size()} ranks on {args.device}")
        for name, entry in out["variants"].items():
            print(f"{name:15} {entry['step_s_median'] * 1e3:8.1f} ms"
                  + (f"  ({entry['over_floor']:.2f}x floor)" if "over_floor" in entry else "")
                  + (f"  buckets {entry['buckets']}, modes {entry['bucket_modes']}"
                     if "buckets" in entry else ""))


if __name__ == "__main__":
    main()
