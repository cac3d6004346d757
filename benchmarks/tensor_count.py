"""What the number of tensors costs the engine: the same entries in many tensors or in few.

    .venv/bin/python benchmarks/tensor_count.py [--total 6.5e6] [--lengths 4096 16384 65536 262144 6.5e6]
        [--ranks 2] [--steps 12]

Real models hold tens to hundreds of weight tensors; each of its buckets costs the engine a
fixed share of Python per step (sampling, scanning, picking, encoding, decoding, writing),
whatever its length. For each tensor length, ``total / length`` parameters of about that
length (each a little longer than the last, as a model's are) run the engine as
benchmarks/engine.py runs one (no autograd, no network, P - 1 payloads synthesised per
bucket), Top-K 1% bidirectional, scope "tensor", timed over ``synchronize()``:

* ``alone``: one bucket per tensor (``HVD_SPARSE_PACK_BELOW=0``);
* ``shared``: the default, where short tensors share buckets and are still ranked one Top-K
  per tensor (the same selection, checked here bit for bit after the timed steps);

against, in the same run, a memcpy of 8 bytes per entry (half the pass budget of 16 bytes
per entry, as in benchmarks/engine.py) and one bucket holding all the entries. Writes
benchmarks/results/tensor_count_cpu.json and .png.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from common import RESULTS, machine, save, timeit
from engine import SynthesisedTransport, synthesise
import hvd_sparse


def build(lengths, ranks, density, pack):
    """The optimizer over parameters of these lengths on the synthesised transport."""
    os.environ["HVD_SPARSE_PACK_BELOW"] = str(pack)
    try:
        params = [torch.nn.Parameter(torch.zeros(n)) for n in lengths]
        transport = SynthesisedTransport(ranks, {})
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.0), named_parameters=[
                (f"w{i}", p) for i, p in enumerate(params)], density=density,
            cost_model="off", collective="allgather", check_config=False, transport=transport,
            scope="tensor")
    finally:
        os.environ.pop("HVD_SPARSE_PACK_BELOW", None)
    for name, view in opt.engine_state().items():
        k = max(1, int(density * view.numel))
        transport.others[f"hvd_sparse.0.{name}"] = synthesise(
            name, view.numel, view.index_dtype, k, ranks, "cpu")
    return opt, params


def run(opt, params, grads, steps):
    times = []
    for step in range(steps + 2):
        for p, g in zip(params, grads[step % 3]):
            p.grad = g.clone()
        t = time.perf_counter()
        opt.synchronize()
        times.append(time.perf_counter() - t)
        for p in params:
            p.grad = None
    times = sorted(times[2:])
    return times[len(times) // 2]


def row(length, total, ranks, density, steps):
    count = max(1, int(round(total / length)))
    lengths = [int(length) + 7 * i for i in range(count)]  # no two alike
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(n, generator=gen) * 10.0 ** (i % 3 - 1) for i, n in
              enumerate(lengths)] for _ in range(3)]
    out = {"length": int(length), "tensors": count, "entries": sum(lengths)}
    finals = {}
    for variant, pack in (("alone", 0), ("shared", hvd_sparse.buckets.PACK_BELOW)):
        opt, params = build(lengths, ranks, density, pack)
        out[f"{variant}_s"] = run(opt, params, grads, steps)
        out[f"{variant}_buckets"] = len(opt.engine_state())
        # the selections themselves: the uplink residuals after the same steps
        finals[variant] = [v.uplink for v in opt.engine_state().values()]
    out["same_selection"] = bool(torch.equal(torch.cat(finals["alone"]),
                                             torch.cat(finals["shared"])))
    one, one_params = build([sum(lengths)], ranks, density, 0)
    one_grads = [[torch.cat(g)] for g in grads]
    out["one_bucket_s"] = run(one, one_params, one_grads, steps)
    src = torch.randn(sum(lengths) * 2)
    dst = torch.empty_like(src)
    out["memcpy_floor_s"] = timeit(lambda: np.copyto(dst.numpy(), src.numpy()), repeat=5)
    out["speedup"] = out["alone_s"] / out["shared_s"]
    return out


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['tensors']} x {r['length']:,}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (key, name) in enumerate((("alone_s", "one bucket per tensor"),
                                     ("shared_s", "short tensors sharing buckets (default)"),
                                     ("one_bucket_s", "all entries in one tensor"),
                                     ("memcpy_floor_s", "memcpy floor"))):
        ax.bar(x + (i - 1.5) * 0.2, [r[key] * 1e3 for r in rows], 0.2, label=name)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("engine step, ms")
    ax.set_title(f"Same entries, different tensor counts (Top-K 1%, {rows[0]['ranks']} ranks)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--total", type=float, default=6.5e6)
    p.add_argument("--lengths", nargs="+", type=float,
                   default=[4096, 16384, 65536, 262144, 6.5e6])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for length in a.lengths:
        r = row(length, a.total, a.ranks, a.density, a.steps)
        r["ranks"] = a.ranks
        rows.append(r)
        print(f"{r['tensors']:5d} x {r['length']:>9,}: alone {r['alone_s'] * 1e3:7.1f} ms "
              f"({r['alone_buckets']} buckets), shared {r['shared_s'] * 1e3:7.1f} ms "
              f"({r['shared_buckets']}), x{r['speedup']:.2f}; one bucket "
              f"{r['one_bucket_s'] * 1e3:.1f} ms, memcpy {r['memcpy_floor_s'] * 1e3:.1f} ms; "
              f"same selection: {r['same_selection']}", flush=True)
    save("tensor_count_cpu", {"machine": machine(), "density": a.density, "steps": a.steps,
                              "rows": rows})
    plot(rows, RESULTS / "tensor_count_cpu.png")


if __name__ == "__main__":
    main()
