"""Selection benchmark: the fused feedback+Top-K step against torch.topk and a memory floor.

    .venv/bin/python benchmarks/selection.py [--sizes 1e6 25e6 100e6] [--densities 0.01 0.001]

For each backend present (numba on CPU, CuPy on CUDA) and each size and density, in one run:
  fused  - select (one read-only scan of acc = grad + residual collecting candidates, exact
           Top-K among them) and commit (residual = acc with the selection taken out);
  topk   - torch.topk of |acc| alone (what published Top-K systems pay for selection);
  ref    - the same select and commit on the plain torch primitives;
  floor  - ``residual.add_(grad)``: reads grad and residual, writes residual, the 12 bytes per
           entry any error-feedback step must move (select + commit move 20).
Ratios fused/floor and topk/fused are reported. Results: benchmarks/results/selection_<dev>.json
and a PNG.
"""
from __future__ import annotations

import argparse

import torch

from common import RESULTS, machine, save, timeit
from hvd_sparse.kernels import cpu, cuda, reference, select


def fused_topk(ops, grad, residual, k):
    sel = select.topk(ops, grad, residual, k)
    select.commit(ops, grad, residual, sel, sel.values)
    return sel


def bench(device: str, n: int, density: float, repeat: int) -> dict:
    impl = cuda if device == "cuda" else cpu
    k = max(1, int(n * density))
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g).to(device)
    res = (torch.randn(n, generator=g) * 0.1).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else None
    work = res.clone()
    row = {"n": n, "density": density, "k": k, "device": device}
    row["fused_s"] = timeit(lambda: fused_topk(impl, grad, work, k), repeat, sync=sync)
    row["floor_s"] = timeit(lambda: work.add_(grad), repeat, sync=sync)
    row["topk_s"] = timeit(lambda: torch.topk(work.abs(), k, sorted=False), max(2, repeat // 2),
                           sync=sync)
    row["ref_s"] = timeit(lambda: fused_topk(reference, grad, work, k), max(2, repeat // 2),
                          sync=sync)
    row["fused_over_floor"] = row["fused_s"] / row["floor_s"]
    row["topk_over_fused"] = row["topk_s"] / row["fused_s"]
    row["ref_over_fused"] = row["ref_s"] / row["fused_s"]
    return row


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for density in sorted({r["density"] for r in rows}):
        sel = [r for r in rows if r["density"] == density]
        ns = [r["n"] for r in sel]
        for key, style in (("fused_s", "-o"), ("topk_s", "--s"), ("floor_s", ":^")):
            ax.loglog(ns, [r[key] * 1e3 for r in sel], style,
                      label=f"{key[:-2]} @ {density:g}")
    ax.set_xlabel("entries (float32)")
    ax.set_ylabel("time per pass (ms)")
    ax.set_title(f"Selection on {rows[0]['device']}: fused vs torch.topk vs memory floor")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 25e6, 100e6])
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    devices = []
    if cpu.available():
        devices.append("cpu")
    if cuda.available():
        devices.append("cuda")
    for device in devices:
        rows = []
        for n in args.sizes:
            for d in args.densities:
                row = bench(device, int(n), d, args.repeat)
                rows.append(row)
                print(f"{device} n={row['n']:>11,} density={d:<6g} fused {row['fused_s']*1e3:8.2f} ms"
                      f"  floor {row['floor_s']*1e3:7.2f} ms  topk {row['topk_s']*1e3:9.2f} ms"
                      f"  fused/floor {row['fused_over_floor']:5.2f}"
                      f"  topk/fused {row['topk_over_fused']:6.1f}", flush=True)
        name = f"selection_{device}"
        save(name, {"machine": machine(), "threads": args.threads, "rows": rows})
        plot(rows, RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
