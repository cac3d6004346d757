"""Memory: what a rank holds beyond the wrapped optimizer, per parameter, against dense
Horovod and the step with no exchange, measured in the same run.

    .venv/bin/python benchmarks/memory.py [--ranks 2] [--steps 8]
        [--widths 1500 3000] [--configs local horovod topk_sgd ...]

Each configuration trains a 784-w-w-10 MLP (random batches) at two widths (the 11.4M mlp11m
and a quarter of it) on ``--ranks`` ranks (mpirun) for ``--steps`` steps and reports, per
rank after the last one, resident memory and its peak (``ru_maxrss``: what the machine must
have), and for hvd_sparse the engine's own per-bucket state as ``engine_state()`` shows it
(residuals, velocity, the region of a sharded bucket). "Beyond no exchange" is each figure
less the no-exchange run's (``local``: the same optimizer, never wrapped, after
``hvd.init()``), split by the two sizes into what grows with the model (bytes per parameter,
the slope) and what does not (MB: libraries, numba's compiled kernels, Horovod's buffers).
What an exchange keeps for its speed besides that state (the uplink scan's spare buffer, a
multi-tensor bucket's flat copy, the weights' anchors and the weight change of exchanged
updates, Adam's variance correction) shows in the resident figures.
``HVD_SPARSE_ACC_IN_SCAN=off`` (``*_no_spare``) drops the spare buffer at the cost of a
pass. Sparse configurations run with ``cost_model="off"`` so every large bucket stays sparse
(the default's dense buckets hold the downlink residual only until it is flushed).

Results: benchmarks/results/memory.json (``--name``), and a bar chart memory.png.
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

from common import PY, RESULTS, ROOT, machine, save

WORKER = r"""
import json, os, resource, sys, psutil, torch, torch.nn.functional as F
import hvd_sparse as hvd
import horovod.torch as real
from hvd_sparse.train.models import MODELS

torch.set_num_threads(1)
out, width, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = json.loads(sys.argv[4])
hvd.init()
torch.manual_seed(0)
model = MODELS["mlp11m"](width=width)
numel = sum(p.numel() for p in model.parameters())
base = (torch.optim.Adam(model.parameters(), lr=1e-3) if cfg["base"] == "adam" else
        torch.optim.SGD(model.parameters(), lr=0.01,
                        momentum=0.9 if cfg["base"] == "sgdm" else 0.0))
if cfg["front"] == "horovod":
    opt = real.DistributedOptimizer(base, named_parameters=model.named_parameters())
elif cfg["front"] == "hvd_sparse":
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   cost_model="off", **cfg.get("options", {}))
else:
    opt = base
proc = psutil.Process()
g = torch.Generator().manual_seed(hvd.rank())
for i in range(steps):
    x = torch.randn(64, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
rss = proc.memory_info().rss  # (before engine_state(), which copies the state)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
state = 0
if cfg["front"] == "hvd_sparse":
    for v in opt.engine_state().values():
        for t in (v.uplink, v.downlink, v.velocity, v.shard):
            if t is not None:
                state += t.numel() * t.element_size()
    exchange = opt.communication_stats().get("exchange")
else:
    exchange = None
with open(os.path.join(out, f"rank{hvd.rank()}.json"), "w") as f:
    json.dump({"numel": numel, "rss": rss, "peak": peak, "engine_state": state,
               "exchange": exchange}, f)
"""

# label -> front end, base optimizer, hvd_sparse options
CONFIGS = {
    "local": {"front": "local", "base": "sgdm"},
    "local_adam": {"front": "local", "base": "adam"},
    "horovod": {"front": "horovod", "base": "sgdm"},
    "horovod_adam": {"front": "horovod", "base": "adam"},
    "topk_sgd": {"front": "hvd_sparse", "base": "sgd", "options": {"sparsifier": "topk"}},
    "topk_sgdm": {"front": "hvd_sparse", "base": "sgdm", "options": {"sparsifier": "topk"}},
    "topk_sgd_no_spare": {"front": "hvd_sparse", "base": "sgd",
                           "options": {"sparsifier": "topk"},
                           "env": {"HVD_SPARSE_ACC_IN_SCAN": "off"}},
    "topk_sgdm_gradient": {"front": "hvd_sparse", "base": "sgdm",
                           "options": {"sparsifier": "topk", "exchange": "gradient"}},
    "topk_sgdm_unidirectional": {"front": "hvd_sparse", "base": "sgdm",
                                 "options": {"sparsifier": "topk", "bidirectional": False}},
    "topk_adam": {"front": "hvd_sparse", "base": "adam", "options": {"sparsifier": "topk"}},
    "gaussiank_sgdm": {"front": "hvd_sparse", "base": "sgdm",
                       "options": {"sparsifier": "gaussiank"}},
    "threshold_sgdm": {"front": "hvd_sparse", "base": "sgdm",
                       "options": {"sparsifier": "threshold", "threshold": 1e-3}},
    "sbc_sgdm": {"front": "hvd_sparse", "base": "sgdm", "options": {"sparsifier": "sbc"}},
    "adaptive_sgdm": {"front": "hvd_sparse", "base": "sgdm",
                      "options": {"sparsifier": "adaptive", "total_steps": 1000}},
}


def run(label, width, args):
    cfg = CONFIGS[label]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **cfg.get("env", {}))
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(args.ranks), PY, "-c", WORKER, out, str(width), str(args.steps),
               json.dumps(cfg)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text())
                for r in range(args.ranks)]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--widths", type=int, nargs=2, default=[1500, 3000],
                        help="two widths of the 784-w-w-10 MLP (3000: the 11.4M mlp11m)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--name", default="memory")
    args = parser.parse_args()
    small, large = args.widths
    runs = {label: {w: run(label, w, args) for w in (small, large)} for label in args.configs}
    numel = {w: runs[args.configs[0]][w][0]["numel"] for w in (small, large)}
    rows = []
    for label, by_width in runs.items():
        cfg = CONFIGS[label]
        floor = runs.get("local_adam" if cfg["base"] == "adam" else "local")
        row = {"config": label, **cfg, "exchange": by_width[large][0]["exchange"],
               "numel": numel}
        for key in ("rss", "peak"):
            row[f"{key}_mb"] = {w: statistics.mean(r[key] for r in by_width[w]) / 2 ** 20
                                for w in (small, large)}
            if floor is None:
                continue
            extra = {w: statistics.mean(r[key] - f[key] for r, f in zip(by_width[w], floor[w]))
                     for w in (small, large)}
            row[f"extra_{key}_mb"] = {w: extra[w] / 2 ** 20 for w in (small, large)}
            # what grows with the model (the slope between the two sizes) and what does not
            per = (extra[large] - extra[small]) / (numel[large] - numel[small])
            row[f"extra_{key}_bytes_per_param"] = per
            row[f"extra_{key}_fixed_mb"] = (extra[large] - per * numel[large]) / 2 ** 20
        row["engine_state_bytes_per_param"] = statistics.mean(
            r["engine_state"] for r in by_width[large]) / numel[large]
        rows.append(row)
        nan = float("nan")
        print(f"{label:26s} exchange {str(row['exchange']):8s} at {numel[large]:,}: rss "
              f"{row['rss_mb'][large]:6.1f} peak {row['peak_mb'][large]:6.1f} MB; beyond no "
              f"exchange: rss {row.get('extra_rss_bytes_per_param', nan):5.1f} B/param + "
              f"{row.get('extra_rss_fixed_mb', nan):5.1f} MB, peak "
              f"{row.get('extra_peak_bytes_per_param', nan):5.1f} B/param + "
              f"{row.get('extra_peak_fixed_mb', nan):5.1f} MB; engine state "
              f"{row['engine_state_bytes_per_param']:4.1f} B/param", flush=True)
    save(args.name, {"machine": machine(), "ranks": args.ranks, "widths": args.widths,
                     "numel": numel, "steps": args.steps, "rows": rows})
    plot(rows, args)


def plot(rows, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [r for r in rows if "extra_peak_bytes_per_param" in r and r["front"] != "local"]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(shown))
    width = 0.28
    for i, (key, label) in enumerate((
            ("extra_rss_bytes_per_param", "resident between steps"),
            ("extra_peak_bytes_per_param", "peak resident"),
            ("engine_state_bytes_per_param", "engine state (engine_state())"))):
        ax.bar([x + (i - 1) * width for x in xs], [r[key] for r in shown], width, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["config"] for r in shown], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("bytes per parameter beyond no exchange")
    ax.set_title(f"784-w-w-10 MLP, w = {args.widths[0]} and {args.widths[1]} (slope), "
                 f"{args.ranks} ranks, float32 (4 bytes per parameter)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
