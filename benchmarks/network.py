"""Step time against the network: dense Horovod vs hvd_sparse behind a shaped link.

    .venv/bin/python benchmarks/network.py [--rates 1gbit none] [--ranks 2 4] [--repeats 2]

Every configuration runs through ``launch/slownet.sh`` (ranks in a private network namespace,
MPI over TCP on a loopback shaped with tc) and ``python -m hvd_sparse.train --benchmark-steps``.
The floor is the same model and batch with no communication at all, run by the same number of
ranks at once (``--optimizer local`` under the same launcher), since ranks on one machine share
its cores and memory bandwidth. Configurations are interleaved (floor, dense, each sparse
variant, then again) so slow drifts of the machine hit all of them alike; each repeat times
``--steps`` steps after two warm-up steps and the row keeps the median over repeats.

Sparse variants exchange gradients unless named ``_update``: ``topk`` is bidirectional Top-K on
gradients (the time-based cost model may send buckets dense), the library's default for
plain SGD (the benchmark's SGD has momentum); ``topk_update_library`` is the library's default for SGD with momentum since the
thirty-sixth session (each rank's update exchanged, no downlink selection, no masking);
``topk_update`` is the training CLI's SGD default (the same with momentum masking); ``topk_mpi4py`` is the same defaults on the mpi4py front end (``--transport
mpi``: no Horovod, so no background loop waking every cycle); ``topk_sparse`` (allgather),
``topk_sharded`` (``--collective sharded``) and
the other methods run with ``--cost-model off``, so they show the sparse path itself. Their per-stage means (uplink select, encode, collective wait,
decode, uplink commit, aggregate, downlink select, write, dense) are kept.

Results: benchmarks/results/network.json, network.png (step times) and network_stages.png (a
stacked bar per sparse run). Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, machine, save, stacked_stages

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")

OFF = ["--cost-model", "off"]
#: the sparse rows exchange gradients (bidirectional Top-K, what issue 9's targets name) unless
#: named otherwise: the library's default for SGD with momentum and the training CLI's exchange
#: updates (``topk_update_library``, ``topk_update``)
SPARSE = ["--optimizer", "sparse", "--exchange", "gradient"]
OPTIMIZERS = {
    "floor": ["--optimizer", "local"],
    "dense": ["--optimizer", "dense"],
    "topk": [*SPARSE, "--sparsifier", "topk"],
    # the default with plain positions (index_coding="auto" lets the time cost model choose
    # Golomb-Rice per bucket)
    "topk_plain": [*SPARSE, "--sparsifier", "topk", "--index-coding", "plain"],
    # one Top-K per tensor, named (below 1% density the default is one over the model)
    "topk_layerwise": [*SPARSE, "--sparsifier", "topk", "--scope", "tensor"],
    "topk_sparse": [*SPARSE, "--sparsifier", "topk", "--collective", "allgather",
                    *OFF],
    "topk_sharded": [*SPARSE, "--sparsifier", "topk", "--collective", "sharded",
                     *OFF],
    # the mpi4py front end (hvd_sparse.mpi): the same engine with no Horovod background loop
    "topk_mpi4py": [*SPARSE, "--sparsifier", "topk", "--transport", "mpi"],
    "gaussiank": [*SPARSE, "--sparsifier", "gaussiank", *OFF],
    "threshold": [*SPARSE, "--sparsifier", "threshold", "--threshold", "6e-3",
                  *OFF],
    "adaptive": [*SPARSE, "--sparsifier", "adaptive", *OFF],
    "sbc": [*SPARSE, "--sparsifier", "sbc", *OFF],
    # the training CLI's SGD default: each rank's update exchanged, after a density warm-up
    # (which the benchmark's two warm-up steps do not reach: --density-warmup-steps 0), with
    # momentum masking since the twentieth session (its cool-down lies beyond the timed steps)
    "topk_update": ["--optimizer", "sparse", "--sparsifier", "topk", "--exchange", "update",
                    "--density-warmup-steps", "0"],
    # the library's default for SGD with momentum: updates, without the CLI's extras
    "topk_update_library": ["--optimizer", "sparse", "--sparsifier", "topk", "--exchange",
                            "update", "--density-warmup-steps", "0",
                            "--density-cooldown-steps", "0", "--no-momentum-masking"],
    # the default with acc left to a commit pass after the collective instead of written by
    # the uplink's scan (HVD_SPARSE_ACC_IN_SCAN=off)
    "topk_commit_pass": [*SPARSE, "--sparsifier", "topk"],
    # the default with one bucket per tensor (before short tensors shared buckets)
    "topk_alone": [*SPARSE, "--sparsifier", "topk"],
}
#: environment a configuration runs under, beside the launcher's
ENV = {"topk_commit_pass": {"HVD_SPARSE_ACC_IN_SCAN": "off"},
       "topk_alone": {"HVD_SPARSE_PACK_BELOW": "0"}}
PER_RANK_COUNT = ("floor", "dense", "topk", "topk_plain", "topk_layerwise", "topk_update",
                  "topk_update_library",
                  "topk_sparse", "topk_sharded", "topk_mpi4py", "topk_commit_pass",
                  "topk_alone")


def run(cmd, timeout, env=None):
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        proc = subprocess.run(cmd + ["--metrics", f.name], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT,
                              env={**os.environ, **env} if env else None)
        lines = Path(f.name).read_text().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    recs = [json.loads(line) for line in lines]
    # the floor's ranks are independent one-rank jobs: each writes a record; take the median
    rec = dict(recs[-1])
    rec["step_s_median"] = statistics.median(r["step_s_median"] for r in recs)
    return rec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rates", nargs="+", default=["1gbit", "none"])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--models", nargs="+", default=["mlp11m"])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    p.add_argument("--methods-at", nargs="+", type=int, default=[2],
                   help="rank counts at which the methods other than Top-K are run")
    p.add_argument("--density", default="0.01")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--merge", action="store_true",
                   help="keep the existing network.json's rows except those this run "
                        "measures again (same model, rate, ranks, density and optimizer)")
    args = p.parse_args()
    rows = []
    here = machine()
    if args.merge and (RESULTS / "network.json").exists():
        saved = json.loads((RESULTS / "network.json").read_text())
        old = [{"machine": saved.get("machine"), **r} for r in saved["rows"]]
        rows = [r for r in old if not (r["model"] in args.models and r["rate"] in args.rates
                                       and r["ranks"] in args.ranks
                                       and r.get("density") == float(args.density)
                                       and r["optimizer"] in args.optimizers)]
    for model in args.models:
        for rate in args.rates:
            for ranks in args.ranks:
                names = [n for n in args.optimizers
                         if n in PER_RANK_COUNT or ranks in args.methods_at]
                got = {n: [] for n in names}
                for rep in range(args.repeats):
                    for name in names:
                        cmd = [str(ROOT / "launch" / "slownet.sh"), rate, str(ranks), "--", PY,
                               "-m", "hvd_sparse.train", "--model", model, "--density",
                               args.density, "--benchmark-steps", str(args.steps),
                               *OPTIMIZERS[name]]
                        rec = run(cmd, 1200, ENV.get(name))
                        got[name].append(rec)
                        print(f"{model} {rate:6} np={ranks} rep {rep} {name:12} "
                              f"{rec['step_s_median'] * 1e3:8.1f} ms", flush=True)
                floor_s = statistics.median(r["step_s_median"] for r in got["floor"]) \
                    if "floor" in got else None
                dense_s = statistics.median(r["step_s_median"] for r in got["dense"]) \
                    if "dense" in got else None
                for name, recs in got.items():
                    step = statistics.median(r["step_s_median"] for r in recs)
                    row = {"machine": here, "model": model, "optimizer": name, "rate": rate,
                           "ranks": ranks,
                           "density": float(args.density), "step_s": step,
                           "step_s_repeats": [r["step_s_median"] for r in recs],
                           # per repeat, to see where a slow repeat's time went
                           "stage_s_mean_repeats": [r.get("stage_s_mean") for r in recs],
                           "timed_steps": args.steps,
                           "parameters": recs[0]["parameters"], "floor_s": floor_s,
                           "over_floor": step / floor_s if floor_s else None,
                           "speedup_vs_dense": dense_s / step if dense_s else None}
                    last = recs[-1]
                    for key in ("bytes_sent_per_step", "dense_bytes_per_step", "stage_s_mean",
                                "downlink_selections"):
                        if key in last:
                            row[key] = last[key]
                    if "cost_model" in last:
                        row["buckets_dense"] = sum(
                            b["mode"] == "dense" for b in last["cost_model"]["buckets"].values())
                        # what the cost model chose per bucket (dense, or the sparse collective)
                        row["choices"] = {
                            name: "dense" if b["mode"] == "dense" else b.get("collective")
                            for name, b in last["cost_model"]["buckets"].items()}
                        row["index_codings"] = {
                            name: b.get("index_coding")
                            for name, b in last["cost_model"]["buckets"].items()}
                        row["buckets_sparse_capable"] = len(last["cost_model"]["buckets"])
                    rows.append(row)
    save("network", {"machine": here, "steps": args.steps, "repeats": args.repeats,
                     "rows": rows,
                     "note": "all ranks on one 2-core machine; the shaped loopback is shared by "
                             "every rank's traffic; the floor runs the same number of ranks at "
                             "once with no exchange"})
    plot(rows, RESULTS / "network.png")
    plot_stages(rows, RESULTS / "network_stages.png")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["ranks"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    for ax, (m, n) in zip(axes[0], keys):
        sel = [r for r in rows if r["model"] == m and r["ranks"] == n]
        rates = list(dict.fromkeys(x["rate"] for x in sel))
        opts = list(dict.fromkeys(x["optimizer"] for x in sel))
        width = 0.8 / max(1, len(opts))
        for k, o in enumerate(opts):
            vals = [next((x["step_s"] for x in sel if x["rate"] == rt and x["optimizer"] == o),
                         0) for rt in rates]
            ax.bar([q + k * width for q in range(len(rates))], vals, width, label=o)
        ax.set_yscale("log")
        ax.set_xticks([q + 0.4 - width / 2 for q in range(len(rates))], rates)
        ax.set_title(f"{m}, {n} ranks (floor: same ranks, no exchange)")
        ax.set_ylabel("s / step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_stages(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r.get("stage_s_mean")]
    if not sel:
        return
    labels = [f"{r['optimizer']}\n{r['rate']} P={r['ranks']}" for r in sel]
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(sel)), 4.5))
    stacked_stages(ax, labels, [r["stage_s_mean"] for r in sel])
    over = [max(0.0, (r["step_s"] - r["floor_s"]) * 1e3) if r["floor_s"] else 0 for r in sel]
    ax.scatter(labels, over, marker="_", s=500, color="k", zorder=3,
               label="step minus floor")
    ax.set_ylabel("ms per step (mean over timed steps, rank 0)")
    ax.set_title("Where the sparse step's own time goes")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
