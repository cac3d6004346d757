"""The GPU's two exact Top-K forms against each other, to place the switch between them.

    python benchmarks/topk_paths.py [--sizes 2.5e5 ... 32e6] [--densities 0.01 0.001]
    python benchmarks/topk_paths.py --replot benchmarks/results/topk_paths_cuda.json

``direct``: ``torch.topk`` of the whole vector for the k-th magnitude, then the tie rule with
no count read (one host read, for NaN/Inf); ``scan``: a sampled threshold and one scan that
collects candidates (two host reads, more launches, fewer passes). Timed in the same run, each
as select plus commit on the same vector, and the engine step (2 ranks synthesised, Top-K 1%)
at two bucket sizes with each form. ``hvd_sparse.kernels.cuda.DIRECT_TOPK_MAX`` is set from
where the two curves cross. Results: benchmarks/results/topk_paths_cuda.json and a PNG.
"""
from __future__ import annotations

import argparse
import json

import torch

import engine
from common import RESULTS, machine, save, timeit
from hvd_sparse.kernels import cuda, select

FORMS = (("direct", 1 << 62), ("scan", 0))  # DIRECT_TOPK_MAX for each


def select_commit(n, density, limit, repeat):
    k = max(1, int(n * density))
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g).cuda()
    work = (torch.randn(n, generator=g) * 0.1).cuda()
    cuda.DIRECT_TOPK_MAX = limit

    def step():
        sel = select.topk(cuda, grad, work, k)
        select.commit(cuda, grad, work, sel, sel.values)
    return timeit(step, repeat, warmup=3, sync=torch.cuda.synchronize)


def plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in doc["rows"] if "select_commit_s" in r]
    for density in sorted({r["density"] for r in rows}):
        for form, style in (("direct", "-o"), ("scan", "--s")):
            sel = [r for r in rows if r["density"] == density and r["form"] == form]
            ax.loglog([r["n"] for r in sel], [r["select_commit_s"] * 1e3 for r in sel], style,
                      label=f"{form} @ {density:g}")
    ax.axvline(doc["direct_topk_max"], color="k", lw=0.8, ls=":", label="DIRECT_TOPK_MAX")
    ax.set_xlabel("entries (float32)")
    ax.set_ylabel("select + commit (ms)")
    ax.set_title(f"Exact Top-K on {doc['machine'].get('gpu', 'GPU')}: direct vs scan")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+",
                    default=[2.5e5, 5e5, 1e6, 2e6, 4e6, 8e6, 16e6, 32e6])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--engine-sizes", type=float, nargs="+", default=[1e6, 4e6])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--replot", help="redraw the PNG from this JSON and stop")
    args = ap.parse_args()
    if args.replot:
        plot(json.load(open(args.replot)), RESULTS / "topk_paths_cuda.png")
        return
    if not cuda.available():
        raise SystemExit("topk_paths.py needs a CUDA device and CuPy")
    default = cuda.DIRECT_TOPK_MAX
    rows = []
    try:
        for n in map(int, args.sizes):
            for density in args.densities:
                for form, limit in FORMS:
                    t = select_commit(n, density, limit, args.repeat)
                    rows.append({"n": n, "density": density, "form": form, "select_commit_s": t})
                    print(f"n={n:>11,} density={density:<6g} {form:6s} {t * 1e3:7.3f} ms",
                          flush=True)
        for n in map(int, args.engine_sizes):
            for form, limit in FORMS:
                cuda.DIRECT_TOPK_MAX = limit
                row = engine.bench(n, 2, 0.01, "cuda", 12, "topk")
                rows.append({"n": n, "form": form, "engine_s": row["engine_s"],
                             "stage_s": row["stage_s"]})
                print(f"engine n={n:>11,} {form:6s} {row['engine_s'] * 1e3:7.3f} ms", flush=True)
    finally:
        cuda.DIRECT_TOPK_MAX = default
    doc = {"machine": machine(), "direct_topk_max": default, "rows": rows}
    save("topk_paths_cuda", doc)
    plot(doc, RESULTS / "topk_paths_cuda.png")


if __name__ == "__main__":
    main()
