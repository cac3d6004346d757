"""The uplink commit during the collective wait: engine steps with a collective that takes W ms.

    .venv/bin/python benchmarks/overlap.py [--sizes 11.4e6] [--waits 0 10 25] [--steps 10]

As in benchmarks/engine.py (one parameter, P - 1 payloads synthesised, no autograd), but each
collective completes only W ms after it was started, as on a slow link: its test answers "not
complete" until then and a wait sleeps the rest, so the time is idle for this process. Each
configuration runs with the commit computed during the wait (the default) and after it
(``HVD_SPARSE_COMMIT_AHEAD=off``), interleaved. Reported per step: the wall time, the part
after the last wait (what the commit ahead shortens) and the stages.
Results: benchmarks/results/overlap_<device>.json and overlap_<device>.png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from common import RESULTS, machine, save
from engine import SynthesisedTransport, synthesise
import hvd_sparse


class SlowLinkTransport(SynthesisedTransport):
    """:class:`SynthesisedTransport` whose collectives complete ``wait_s`` after they start."""

    def __init__(self, world_size, others, wait_s):
        super().__init__(world_size, others)
        self.wait_s = wait_s
        self.last_wait_end = None

    def allgather_async(self, payload, name):
        return (time.perf_counter() + self.wait_s, super().allgather_async(payload, name))

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        return (time.perf_counter() + self.wait_s, tensor)

    def ready(self, handle):
        return time.perf_counter() >= handle[0]

    def wait(self, handle):
        left = handle[0] - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self.last_wait_end = time.perf_counter()
        return handle[1]


def bench(n, ranks, density, wait_s, steps, ahead):
    os.environ["HVD_SPARSE_COMMIT_AHEAD"] = "on" if ahead else "off"
    p = torch.nn.Parameter(torch.zeros(n))
    transport = SlowLinkTransport(ranks, {}, wait_s)
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)], density=density,
        cost_model="off", collective="allgather", check_config=False, transport=transport)
    (name, view), = opt.engine_state().items()
    k = max(1, int(density * n))
    transport.others[f"hvd_sparse.0.{name}"] = synthesise(
        name, view.numel, view.index_dtype, k, ranks, "cpu")
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen) * 0.01 for _ in range(3)]
    times, after = [], []
    for step in range(steps + 2):
        p.grad = grads[step % 3].clone()
        t = time.perf_counter()
        opt.synchronize()
        end = time.perf_counter()
        if step == 1:
            before = dict(opt.communication_stats()["totals"]["stage_seconds"])
        times.append(end - t)
        after.append(end - transport.last_wait_end)
    totals = opt.communication_stats()["totals"]
    stages = {s: (v - before[s]) / steps for s, v in totals["stage_seconds"].items()}
    return {"n": n, "ranks": ranks, "density": density, "wait_s": wait_s,
            "commit_ahead": ahead, "step_s": statistics.median(times[2:]),
            "after_wait_s": statistics.median(after[2:]), "stage_s": stages,
            "uplink_commits": totals["uplink_commits"]}


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({(r["n"], r["wait_s"]) for r in rows})
    labels = [f"{n / 1e6:.1f}M, wait {w * 1e3:.0f} ms" for n, w in keys]
    for i, ahead in enumerate((False, True)):
        vals = [next(r["after_wait_s"] for r in rows if (r["n"], r["wait_s"]) == key
                     and r["commit_ahead"] == ahead) * 1e3 for key in keys]
        ax.bar([x + 0.38 * i for x in range(len(keys))], vals, width=0.38,
               label="commit during the wait" if ahead else "commit after the wait")
    ax.set_xticks([x + 0.19 for x in range(len(keys))], labels)
    ax.set_ylabel("ms per step after the last wait")
    ax.set_title("Engine step behind a collective of W ms (Top-K 1%, P = 2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", type=float, default=[11.4e6])
    ap.add_argument("--waits", nargs="+", type=float, default=[0, 10, 25], help="ms")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in (int(s) for s in args.sizes):
        for wait_ms in args.waits:
            got = {True: [], False: []}
            for _ in range(args.repeats):
                for ahead in (True, False):
                    got[ahead].append(bench(n, args.ranks, args.density, wait_ms / 1e3,
                                            args.steps, ahead))
            for ahead, recs in got.items():
                row = dict(recs[-1])
                row["step_s"] = statistics.median(r["step_s"] for r in recs)
                row["after_wait_s"] = statistics.median(r["after_wait_s"] for r in recs)
                rows.append(row)
                print(f"n={n:,} wait {wait_ms:4.0f} ms  commit "
                      f"{'during' if ahead else 'after '}: step {row['step_s'] * 1e3:6.1f} ms, "
                      f"after the wait {row['after_wait_s'] * 1e3:5.1f} ms, uplink_commit "
                      f"{row['stage_s']['uplink_commit'] * 1e3:5.1f} ms", flush=True)
    os.environ.pop("HVD_SPARSE_COMMIT_AHEAD", None)
    save("overlap_cpu", {"machine": machine(), "threads": args.threads, "rows": rows})
    plot(rows, RESULTS / "overlap_cpu.png")


if __name__ == "__main__":
    main()
