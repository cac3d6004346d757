"""The exchange engine alone against its pass-budget floor, in one run.

    .venv/bin/python benchmarks/engine.py [--sizes 11.4e6 100e6] [--ranks 2 4] [--device cpu]

No autograd and no network: one parameter of N entries (or ``--pieces`` parameters sharing
one bucket, as most models' buckets hold several) gets a fresh gradient each step and
``synchronize()`` runs the whole engine (uplink select, encode, the collective, decode, uplink
commit, aggregate, downlink select, write). The collective is a stand-in transport that returns
this rank's payload followed by P - 1 payloads synthesised beforehand (k random positions with
random values; for SBC, as its ranks send them, one mean of random sign shared by all k and the
positions Golomb coded, so the downlink meets the ties a real SBC aggregate holds), so the
downlink does the work it does at P ranks.

Floor: the pass budget of docs/design.md for bidirectional Top-K on the numba backend is 16
bytes moved per entry (the uplink scan reads 8 and writes acc 4, the zero-fill of p.grad 4; the
O(P k) parts are left out), 20 where the downlink scans its residual (4 more) instead of
answering from its watch; timed as a copy of half that many bytes per entry (a copy reads and
writes). Before acc was written by the scan the budget was 24 (a commit pass of 12 instead of
the scan's 4-byte store); rows record the budget they were measured against. Each row's budget follows
the path its downlink took in most steps.
On the CPU each row also records the same copy through the C library's ``memcpy``
(``memcpy_floor_s``, ``over_memcpy``): torch's ``copy_`` is far from memory speed on one thread,
so the ``floor_s`` ratio flatters the engine.
Exchanged updates (``--exchanges update``, the default for adaptive optimizers): Top-K at the
first rank count, timed over ``step()`` (the wrapped SGD's own step, timed alone on the same
gradients in the same run, is subtracted); its budget is 24 bytes per entry (the finite check
of the gradient 4, the uplink scan of params, anchor and residual writing acc 16 and the
parameters back at the anchor 4; 28 while that reset was a copy after the exchange);
``update-unidirectional`` is the same without the downlink selection (the training CLI's
default wherever updates are exchanged), where the payloads go straight into the anchor.
Results: benchmarks/results/engine_<device>.json and a stacked-bar PNG of the stages.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from common import RESULTS, machine, save, stacked_stages, timeit
import hvd_sparse
from hvd_sparse import wire
from hvd_sparse.kernels import cpu
from hvd_sparse.transport import Transport

#: by device, the downlink answering from its watch (CuPy: the commit is still a pass of 12)
BUDGET_BYTES_PER_ENTRY = {"cpu": 16, "cuda": 24}
UPDATE_BYTES_PER_ENTRY = 24  # exchanged updates on the numba backend (docs/design.md)
UPDATE_LR = 0.5  # the wrapped SGD's rate there: weight changes about the gradients' size
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


def synthesise(name, numel, index_dtype, k, ranks, device, seed=0, binary=False):
    """P - 1 payloads of k random positions; ``binary``: SBC's (one shared mean, Golomb)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ranks - 1):
        idx = torch.sort(torch.randperm(numel, generator=gen)[:k]).values
        if binary:
            sign = 1.0 if float(torch.rand(1, generator=gen)) < 0.5 else -1.0
            vals = torch.full((k,), sign * 0.03)
        else:
            vals = torch.randn(k, generator=gen) * 0.03
        out.append(wire.encode(idx.to(device), vals.to(device), index_dtype=index_dtype,
                               tag=wire.fingerprint(name, numel), numel=numel,
                               constant=binary, index_coding="golomb" if binary else "plain"))
    return out


def calibrated_threshold(grads, density, steps, sample=1 << 20):
    """A hard threshold that sends about ``density`` of the entries over the timed steps, so its
    row compares with Top-K's at the same bytes: the uplink's error feedback (acc = grad +
    residual, entries at or above lambda sent) simulated on a prefix of the same gradients, and
    lambda bisected in log space. A fixed lambda with error feedback sends more and more as the
    residual grows, so a lambda fitted to one gradient alone sends far more than ``density``."""
    gs = [g[:sample].double().cpu() for g in grads]

    def sent(lam):
        residual = torch.zeros_like(gs[0])
        count = 0
        for step in range(steps + 2):
            acc = residual + gs[step % 3]
            keep = acc.abs() >= lam
            residual = torch.where(keep, 0.0, acc)
            if step >= 2:
                count += int(keep.sum())
        return count / (steps * gs[0].numel())

    lo, hi = math.log(float(gs[0].abs().max()) * 1e-3), math.log(float(gs[0].abs().max()) * 1e2)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sent(math.exp(mid)) > density else (lo, mid)
    return math.exp(hi)


class Pieces:
    """The parameters of one multi-parameter bucket, taking a flat gradient as one parameter
    does (``p.grad = flat``): each gets its slice, as a view."""

    def __init__(self, params):
        self.params = params

    @property
    def grad(self):
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    @grad.setter
    def grad(self, flat):
        off = 0
        for p in self.params:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()


def build(n, ranks, density, device, steps, sparsifier, pieces=1, exchange="gradient"):
    """An optimizer over one parameter of ``n`` entries (or ``pieces`` parameters in one
    bucket) on the synthesised transport, and three gradients to cycle through (shared with
    benchmarks/profile_engine.py)."""
    if pieces > 1:
        sizes = [n // pieces + (i < n % pieces) for i in range(pieces)]
        params = [torch.nn.Parameter(torch.zeros(m, device=device)) for m in sizes]
        p = Pieces(params)
        named = [(f"w{i}", q) for i, q in enumerate(params)]
    else:
        p = torch.nn.Parameter(torch.zeros(n, device=device))
        params, named = [p], [("w", p)]
    transport = SynthesisedTransport(ranks, {})
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen).to(device) * 0.01 for _ in range(3)]
    extra = {"threshold": calibrated_threshold(grads, density, steps)} \
        if sparsifier == "threshold" else \
        {"total_steps": steps + 2} if sparsifier == "adaptive" else {}
    update = exchange.startswith("update")
    lr = UPDATE_LR if update else 0.0
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(params, lr=lr), named_parameters=named, density=density,
        sparsifier=sparsifier, cost_model="off", collective="allgather", check_config=False,
        transport=transport, scope="model", exchange="update" if update else exchange,
        bidirectional=exchange != "update-unidirectional", **extra)
    (name, view), = opt.engine_state().items()
    k = max(1, int(density * n))
    transport.others[f"hvd_sparse.0.{name}"] = synthesise(
        name, view.numel, view.index_dtype, k, ranks, device, binary=sparsifier == "sbc")
    return opt, p, grads


def bench(n, ranks, density, device, steps, sparsifier, pieces=1, exchange="gradient"):
    opt, p, grads = build(n, ranks, density, device, steps, sparsifier, pieces, exchange)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    update = exchange.startswith("update")
    run = opt.step if update else opt.synchronize
    times = []
    for step in range(steps + 2):
        p.grad = grads[step % 3].clone()
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
        if step == 1:
            totals = opt.communication_stats()["totals"]
            before = dict(totals["stage_seconds"])
            sent_before = (totals["selected"], totals["numel"])
    times = times[2:]
    base_s = local_step_time(n, device, grads, steps, sync) if update else 0.0
    times = [t - base_s for t in times]
    totals = opt.communication_stats()["totals"]
    after = totals["stage_seconds"]
    stages = {k: (v - before[k]) / steps for k, v in after.items()}
    # what this rank selected over the timed steps: a threshold's count is not fixed
    density = (totals["selected"] - sent_before[0]) / max(1, totals["numel"] - sent_before[1])
    paths = opt.communication_stats()["totals"]["downlink_selections"]
    budget = BUDGET_BYTES_PER_ENTRY[device] + (
        SCAN_BYTES_PER_ENTRY if paths["scanned"] >= paths["incremental"] else 0)
    if update:
        budget = UPDATE_BYTES_PER_ENTRY + (
            SCAN_BYTES_PER_ENTRY if paths["scanned"] >= paths["incremental"] else 0)
    # written, so that the copy reads real memory: an untouched allocation reads the kernel's
    # shared zero page from cache (at 100M a memcpy "moved" 800 MB in 20 ms instead of 62)
    src = torch.full((n * budget // 2,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    floor = timeit(lambda: dst.copy_(src), repeat=5, sync=sync if device == "cuda" else None)
    # the same bytes through the C library's memcpy (streaming stores at this size): torch's
    # copy_ moves them at well under memory speed on one CPU thread (11.4 against 4.75 ms for
    # 91 MB on the development machine), so this is the stricter floor
    memcpy = timeit(lambda: np.copyto(dst.numpy(), src.numpy()), repeat=5) \
        if device == "cpu" else None
    median = sorted(times)[len(times) // 2]
    return {"n": n, "ranks": ranks, "density": density, "device": device,
            "sparsifier": sparsifier, "pieces": pieces, "exchange": exchange,
            "local_step_s": base_s, "engine_s": median, "engine_s_all": times,
            "budget_bytes_per_entry": budget, "downlink_selections": paths,
            "floor_s": floor, "over_floor": median / floor, "stage_s": stages,
            "memcpy_floor_s": memcpy, "over_memcpy": median / memcpy if memcpy else None,
            "uplink_density": density}


def local_step_time(n, device, grads, steps, sync):
    """The wrapped SGD's own step on the same gradients (median), which the update rows'
    ``step()`` includes and the engine's time does not."""
    q = torch.nn.Parameter(torch.zeros(n, device=device))
    base = torch.optim.SGD([q], lr=UPDATE_LR)
    times = []
    for step in range(steps + 2):
        q.grad = grads[step % 3].clone()
        sync()
        t = time.perf_counter()
        base.step()
        sync()
        times.append(time.perf_counter() - t)
    times = sorted(times[2:])
    return times[len(times) // 2]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    labels = [f"{r['sparsifier']}" + {"update": " updates", "update-unidirectional":
                                       " updates\nunidirectional"}.get(r.get("exchange"), "")
              + f"\n{r['n'] / 1e6:.1f}M P={r['ranks']}"
              + (f"\n{r['pieces']} params" if r.get("pieces", 1) > 1 else "") for r in rows]
    stacked_stages(ax, labels, [r["stage_s"] for r in rows])
    ax.scatter(labels, [r["floor_s"] * 1e3 for r in rows], marker="_", s=600, color="k",
               label="pass-budget floor (torch copy)", zorder=3)
    if any(r.get("memcpy_floor_s") for r in rows):
        ax.scatter(labels, [(r.get("memcpy_floor_s") or float("nan")) * 1e3 for r in rows],
                   marker="_", s=600, color="tab:red", label="the same bytes by memcpy",
                   zorder=3)
    ax.set_ylabel("ms per step")
    ax.set_title(f"Engine alone on {rows[0]['device']}, stages vs floor")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def delta_paths(sizes, density, steps, rounds=6):
    """Exchanged updates without the downlink selection: the payloads added straight into the
    anchor (the default while they number at most 1/8 of the bucket) against the full-length
    path (summed into a zeroed buffer, added to the anchor, copied to the parameters), on one
    engine, in interleaved rounds of ``steps`` timed steps (the first step of each round is
    untimed), so that the machine's drift hits both alike. Times include the wrapped SGD's
    step."""
    from hvd_sparse.engine import updates

    rows = []
    for n in sizes:
        opt, p, grads = build(int(n), 2, density, "cpu", steps, "topk", 1,
                              "update-unidirectional")
        got = {"in_place": ([], []), "full_length": ([], [])}
        step = 0
        for _ in range(rounds):
            for mode, share in (("in_place", updates.SPARSE_DELTA_SHARE),
                                ("full_length", 10 ** 12)):
                saved, updates.SPARSE_DELTA_SHARE = updates.SPARSE_DELTA_SHARE, share
                for i in range(steps + 1):
                    p.grad = grads[step % 3].clone()
                    step += 1
                    before = dict(opt.communication_stats()["totals"]["stage_seconds"])
                    t = time.perf_counter()
                    opt.step()
                    dt = time.perf_counter() - t
                    after = opt.communication_stats()["totals"]["stage_seconds"]
                    if i:
                        got[mode][0].append(dt)
                        got[mode][1].append(sum(after[k] - before[k]
                                                for k in ("aggregate", "write")))
                updates.SPARSE_DELTA_SHARE = saved
        row = {"n": int(n), "ranks": 2, "density": density, "rounds": rounds}
        for mode, (step_s, stage_s) in got.items():
            row[mode] = {"step_s_median": float(np.median(step_s)),
                         "aggregate_and_write_s_median": float(np.median(stage_s)),
                         "steps": len(step_s)}
        rows.append(row)
        print(f"n={int(n):>11,}: step {1e3 * row['in_place']['step_s_median']:.1f} ms in place "
              f"against {1e3 * row['full_length']['step_s_median']:.1f} ms full length "
              f"(aggregate and write {1e3 * row['in_place']['aggregate_and_write_s_median']:.1f}"
              f" against {1e3 * row['full_length']['aggregate_and_write_s_median']:.1f} ms)",
              flush=True)
    save("engine_delta_paths_cpu", {"machine": machine(), "rows": rows})


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
    ap.add_argument("--exchanges", nargs="+",
                    default=["gradient", "update", "update-unidirectional"],
                    help="update: Top-K with exchanged weight changes, at the first rank count "
                         "and one parameter; update-unidirectional: the same without the "
                         "downlink selection (the training CLI's default for updates)")
    ap.add_argument("--pieces", nargs="+", type=int, default=[1, 40],
                    help="parameters sharing the bucket; beyond 1, Top-K at the first rank "
                         "count only")
    ap.add_argument("--delta-paths", action="store_true",
                    help="only the A/B of the unidirectional update write (delta_paths)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu.warm_up()
    if args.delta_paths:
        return delta_paths(args.sizes, args.density, 4)
    # one untimed row first: the process's first large buffers pay their first touches (and
    # the core its clock ramp), which made whichever row came first 20-40% slower
    bench(int(min(args.sizes)), args.ranks[0], args.density, args.device, 3, "topk")
    rows = []
    for n in args.sizes:
        for ranks in args.ranks:
            for ex, sp, pieces in [(ex, sp, q) for ex in args.exchanges for q in args.pieces
                                   for sp in args.sparsifiers]:
                if (sp != "topk" and ranks != args.ranks[0]) \
                        or (pieces > 1 and (sp != "topk" or ranks != args.ranks[0])) \
                        or (ex != "gradient" and (sp != "topk" or ranks != args.ranks[0]
                                                or pieces > 1 or args.device != "cpu")):
                    continue
                row = bench(int(n), ranks, args.density, args.device, args.steps, sp, pieces, ex)
                rows.append(row)
                print(f"{sp:9}{'' if ex == 'gradient' else ' ' + ex} n={int(n):>11,} P={ranks} "
                      f"params={pieces}: "
                      f"engine {row['engine_s'] * 1e3:7.1f} ms"
                      f"  floor {row['floor_s'] * 1e3:6.1f} ms  ({row['over_floor']:.2f}x)  "
                      + (f"memcpy {row['memcpy_floor_s'] * 1e3:5.1f} ms "
                         f"({row['over_memcpy']:.2f}x)  " if row["memcpy_floor_s"] else "")
                      + f"sent {row['uplink_density']:.2%}  "
                      + " ".join(f"{k}={v * 1e3:.1f}" for k, v in row["stage_s"].items() if v),
                      flush=True)
    save(f"engine_{args.device}", {"machine": machine(), "threads": args.threads,
                                   "rows": rows})
    plot(rows, RESULTS / f"engine_{args.device}.png")


if __name__ == "__main__":
    main()
