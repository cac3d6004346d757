"""The sharded exchange against the allgather: bytes per rank, and what the per-region rule
changes in the downlink selection.

    .venv/bin/python benchmarks/sharded.py [--ranks 2 3 4] [--steps 4]

1. Bytes received per rank per step, measured: the 11.4M-parameter MLP (``--model mlp11m``),
   Top-K 1% bidirectional, every bucket sparse (``--cost-model off``), run with
   ``--collective allgather`` and ``--collective sharded`` at each rank count (2 ranks
   exchange over loopback; only bytes are compared here, never time). Next to them, the
   bytes of a dense ring allreduce, ``2 (P - 1) / P * 4 N``, and of ``k_up + k_down`` pairs.
2. Per-region against global Top-K, on real aggregates: P ranks' gradients of the Fashion-MNIST
   CNN (P different batches, averaged) per parameter tensor; the owners' rule keeps
   ``density`` of each of P equal regions, exact global Top-K keeps ``density`` of the tensor.
   Reported: the share of global Top-K's positions the rule also picks, and the share of
   global Top-K's squared mass it captures, for P = 2 .. 64.

Results: benchmarks/results/sharded.json and sharded.png.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from common import RESULTS, machine, save

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")


def measure_bytes(ranks, collective, steps, density):
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        cmd = [PY, "-m", "hvd_sparse.train", "--ranks", str(ranks), "--model", "mlp11m",
               "--density", str(density), "--cost-model", "off", "--collective", collective,
               "--exchange", "gradient",
               "--benchmark-steps", str(steps), "--no-progress", "--metrics", f.name]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rec = json.loads(Path(f.name).read_text().splitlines()[-1])
    return rec


def region_rule(agg: torch.Tensor, density: float, ranks: int):
    """(share of global Top-K positions kept, share of its squared mass captured)."""
    n = agg.numel()
    k = max(1, int(density * n))
    mag = agg.abs()
    glob = torch.topk(mag, k).indices
    picked = []
    bounds = [n * r // ranks for r in range(ranks + 1)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            kr = max(1, int(density * (hi - lo)))
            picked.append(lo + torch.topk(mag[lo:hi], min(kr, hi - lo)).indices)
    region = torch.cat(picked)
    overlap = torch.isin(glob, region).float().mean().item()
    mass = (agg[region].pow(2).sum() / agg[glob].pow(2).sum()).item()
    return overlap, mass


def region_study(density, rank_counts, batches=64, seed=0):
    from hvd_sparse.train import workloads

    work = workloads.FashionMNIST(model="cnn", batch_size=64, seed=seed)
    torch.manual_seed(seed)
    model = work.model()
    grads = []
    for b in range(batches):
        idx = torch.arange(b * 64, (b + 1) * 64)
        model.zero_grad()
        F.cross_entropy(model(work.x[idx]), work.y[idx]).backward()
        grads.append({n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()})
    out = {}
    for ranks in rank_counts:
        rows = []
        for name, _ in model.named_parameters():
            agg = torch.stack([g[name] for g in grads[:ranks]]).mean(0)
            if agg.numel() < 100 * ranks:
                continue  # tiny tensors go dense in practice (min_sparse_numel)
            overlap, mass = region_rule(agg, density, ranks)
            rows.append({"tensor": name, "numel": agg.numel(), "overlap": overlap,
                         "mass": mass})
        total = sum(r["numel"] for r in rows)
        out[ranks] = {"tensors": rows,
                      "overlap": sum(r["overlap"] * r["numel"] for r in rows) / total,
                      "mass": sum(r["mass"] * r["numel"] for r in rows) / total}
        print(f"P={ranks:3}: per-region rule keeps {100 * out[ranks]['overlap']:.1f}% of "
              f"global Top-K's positions and {100 * out[ranks]['mass']:.1f}% of its squared "
              "mass (weighted by tensor size)", flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 3, 4])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--region-ranks", nargs="+", type=int, default=[2, 4, 8, 16, 32, 64])
    args = p.parse_args()
    rows = []
    for ranks in args.ranks:
        for collective in ("allgather", "sharded"):
            rec = measure_bytes(ranks, collective, args.steps, args.density)
            n = rec["parameters"]
            k = int(args.density * n)
            row = {"ranks": ranks, "collective": collective, "parameters": n,
                   "received_per_step": rec["bytes_received_per_step"],
                   "sent_per_step": rec["bytes_sent_per_step"],
                   "ring_allreduce_bytes": 2 * (ranks - 1) / ranks * 4 * n,
                   "pairs_bytes_up_plus_down": 2 * k * 8}
            row["received_over_pairs"] = row["received_per_step"] / row["pairs_bytes_up_plus_down"]
            rows.append(row)
            print(f"P={ranks} {collective:9}: received {row['received_per_step'] / 1e6:7.3f} MB "
                  f"per step ({row['received_over_pairs']:.2f}x the k_up + k_down pairs; "
                  f"ring allreduce {row['ring_allreduce_bytes'] / 1e6:.1f} MB)", flush=True)
    regions = region_study(args.density, args.region_ranks)
    save("sharded", {"machine": machine(), "density": args.density, "bytes": rows,
                     "region_rule": {str(k): v for k, v in regions.items()}})
    plot(rows, regions)


def plot(rows, regions):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for collective, style in (("allgather", "o-"), ("sharded", "s-")):
        sel = [r for r in rows if r["collective"] == collective]
        a.plot([r["ranks"] for r in sel], [r["received_per_step"] / 1e6 for r in sel], style,
               label=f"{collective} (measured)")
    ranks = sorted({r["ranks"] for r in rows})
    ring = {r["ranks"]: r["ring_allreduce_bytes"] for r in rows}
    a.plot(ranks, [ring[p] / 1e6 for p in ranks], "k:", label="dense ring allreduce")
    a.set_yscale("log")
    a.set_xlabel("ranks")
    a.set_ylabel("MB received per rank per step")
    a.set_title("mlp11m, Top-K 1% bidirectional")
    a.legend(fontsize=7)
    ps = sorted(regions)
    b.plot(ps, [100 * regions[p]["overlap"] for p in ps], "o-", label="global positions kept")
    b.plot(ps, [100 * regions[p]["mass"] for p in ps], "s-", label="global squared mass kept")
    b.set_xscale("log", base=2)
    b.set_xlabel("ranks (regions)")
    b.set_ylabel("% of exact global Top-K")
    b.set_title("per-region rule, Fashion-MNIST CNN aggregates")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "sharded.png", dpi=110)


if __name__ == "__main__":
    main()
