"""The exchange engine alone against its pass-budget floor, in one run.

    .venv/bin/python benchmarks/engine.py [--sizes 11.4e6 100e6] [--ranks 2 4] [--device cpu]

No autograd and no network: one parameter of N entries gets a fresh gradient each step and
``synchronize()`` runs the whole engine (uplink select, encode, the collective, decode, uplink
commit, aggregate, downlink select, write). The collective is a stand-in transport that returns
this rank's payload followed by P - 1 payloads synthesised beforehand (Top-K-like: k random
positions with random values), so the downlink does the work it does at P ranks.

Floor: the pass budget of docs/design.md for bidirectional Top-K on the numba backend is 16
bytes moved per entry (the uplink scan reads 8 and writes acc 4, the zero-fill of p.grad 4; the
O(P k) parts are left out), 20 where the downlink scans its residual (4 more) instead of
answering from its watch; timed as a copy of half that many bytes per entry (a copy reads and
writes). Before acc was written by the scan the budget was 24 (a commit pass of 12 instead of
the scan's 4-byte store); rows record the budget they were measured against. Each row's budget follows
the path its downlink took in most steps.
Results: benchmarks/results/engine_<device>.json and a stacked-bar PNG of the stages.
"""
from __future__ import annotations

import argparse
import time

import torch

from common import RESULTS, machine, save, stacked_stages, timeit
import hvd_sparse
from hvd_sparse import wire
from hvd_sparse.kernels import cpu
from hvd_sparse.transport import Transport

#: by device, the downlink answering from its watch (CuPy: the commit is still a pass of 12)
BUDGET_BYTES_PER_ENTRY = {"cpu": 16, "cuda": 24}
SCAN_BYTES_PER_ENTRY = 4  # what a downlink scan adds


class SynthesisedTransport(Transport):
    """P ranks seen from rank 0: gathers are this rank's payload plus pre-made ones."""

    def __init__(self, world_size, others):
        self.p = world_size
        self.others = others  # name -> list of P - 1 payloads

    def size(self):
        return self.p

    def rank(self):
        return 0

    def allgather_async(self, payload, name):
        extra = self.others.get(name)
        if extra is None:  # configuration digest, calibration: the same bytes from everyone
            return torch.cat([payload] * self.p)
        return torch.cat([payload] + extra)

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        return tensor

    def wait(self, handle):
        return handle


def synthesise(name, numel, index_dtype, k, ranks, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ranks - 1):
        idx = torch.sort(torch.randperm(numel, generator=gen)[:k]).values
        vals = torch.randn(k, generator=gen) * 0.03
        out.append(wire.encode(idx.to(device), vals.to(device), index_dtype=index_dtype,
                               tag=wire.fingerprint(name, numel), numel=numel))
    return out


def build(n, ranks, density, device, steps, sparsifier):
    """An optimizer over one parameter of ``n`` entries on the synthesised transport, and three
    gradients to cycle through (shared with benchmarks/profile_engine.py)."""
    p = torch.nn.Parameter(torch.zeros(n, device=device))
    transport = SynthesisedTransport(ranks, {})
    extra = {"threshold": 2.6e-2} if sparsifier == "threshold" else \
        {"total_steps": steps + 2} if sparsifier == "adaptive" else {}
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)], density=density,
        sparsifier=sparsifier, cost_model="off", collective="allgather", check_config=False,
        transport=transport,
        **extra)
    (name, view), = opt.engine_state().items()
    k = max(1, int(density * n))
    transport.others[f"hvd_sparse.0.{name}"] = synthesise(
        name, view.numel, view.index_dtype, k, ranks, device)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen).to(device) * 0.01 for _ in range(3)]
    return opt, p, grads


def bench(n, ranks, density, device, steps, sparsifier):
    opt, p, grads = build(n, ranks, density, device, steps, sparsifier)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for step in range(steps + 2):
        p.grad = grads[step % 3].clone()
        sync()
        t = time.perf_counter()
        opt.synchronize()
        sync()
        times.append(time.perf_counter() - t)
        if step == 1:
            before = dict(opt.communication_stats()["totals"]["stage_seconds"])
    times = times[2:]
    after = opt.communication_stats()["totals"]["stage_seconds"]
    stages = {k: (v - before[k]) / steps for k, v in after.items()}
    paths = opt.communication_stats()["totals"]["downlink_selections"]
    budget = BUDGET_BYTES_PER_ENTRY[device] + (
        SCAN_BYTES_PER_ENTRY if paths["scanned"] >= paths["incremental"] else 0)
    src = torch.empty(n * budget // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    floor = timeit(lambda: dst.copy_(src), repeat=5, sync=sync if device == "cuda" else None)
    median = sorted(times)[len(times) // 2]
    return {"n": n, "ranks": ranks, "density": density, "device": device,
            "sparsifier": sparsifier, "engine_s": median, "engine_s_all": times,
            "budget_bytes_per_entry": budget, "downlink_selections": paths,
            "floor_s": floor, "over_floor": median / floor, "stage_s": stages}


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    labels = [f"{r['sparsifier']}\n{r['n'] / 1e6:.1f}M P={r['ranks']}" for r in rows]
    stacked_stages(ax, labels, [r["stage_s"] for r in rows])
    ax.scatter(labels, [r["floor_s"] * 1e3 for r in rows], marker="_", s=600, color="k",
               label="pass-budget floor (copy)", zorder=3)
    ax.set_ylabel("ms per step")
    ax.set_title(f"Engine alone on {rows[0]['device']}, stages vs floor")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", type=float, default=[11.4e6, 100e6])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--sparsifiers", nargs="+", default=["topk", "gaussiank", "sbc", "threshold",
                                                          "adaptive"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu.warm_up()
    rows = []
    for n in args.sizes:
        for ranks in args.ranks:
            for sp in args.sparsifiers:
                if sp != "topk" and ranks != args.ranks[0]:
                    continue
                row = bench(int(n), ranks, args.density, args.device, args.steps, sp)
                rows.append(row)
                print(f"{sp:9} n={int(n):>11,} P={ranks}: engine {row['engine_s'] * 1e3:7.1f} ms"
                      f"  floor {row['floor_s'] * 1e3:6.1f} ms  ({row['over_floor']:.2f}x)  "
                      + " ".join(f"{k}={v * 1e3:.1f}" for k, v in row["stage_s"].items() if v),
                      flush=True)
    save(f"engine_{args.device}", {"machine": machine(), "threads": args.threads,
                                   "rows": rows})
    plot(rows, RESULTS / f"engine_{args.device}.png")


if __name__ == "__main__":
    main()
