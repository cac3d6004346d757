"""Models and tasks no default was chosen on, trained through the drop-in API against Horovod.

    .venv/bin/python benchmarks/unseen_models.py [--ranks 2] [--densities 0.01 0.001]
        [--tasks vit cnn gpt mlp mlp-rmsprop gru] [--seeds 0] [--variants library tuned]

The convergence study and the held-out check (``benchmarks/heldout.py``) go through the
training CLI. An outside user writes their own loop instead, with models of their own and
only ``density`` set: this benchmark is that user (``benchmarks/unseen_models_worker.py``:
a small ViT, a BatchNorm CNN, a GPT-style decoder with a tied head and clipping, an MLP
regression under Adagrad or RMSprop, a GRU classifier; synthetic data, fixed seeds). Each task
runs with Horovod's own optimizer (``dense``) and with hvd_sparse as

* ``library``: the library's defaults, only ``density`` set (``cost_model="off"`` so that the
  bytes are the compression's: on a link as fast as loopback the time cost model sends the
  buckets of these small models dense);
* ``tuned``: the training CLI's setting for the optimizer (``exchange_defaults``): for SGD
  exchanged updates with half-strength momentum masking, and for every optimizer a density
  warm-up over the first 10% of the run;
* ``gradient``, ``update``, ``update_mask`` (updates, half-strength masking) and
  ``gradient_warm`` (gradients, the warm-up): single levers against the library's defaults,
  the study behind ``exchange="auto"``'s choice for SGD with momentum (``--out`` names the
  file so that such a study does not replace the main results);
* ``no_varcorr``: the library's defaults without the full batch's second moment for
  Adam-family updates (``variance_correction=False``, the default before the thirty-seventh
  session), for the ViT and the GPT decoder (AdamW).

Recorded per run: held-out loss (and accuracy), the mean training loss of the last 20 steps,
bytes sent per rank against dense, whether the replicas ended bitwise identical. Writes
``benchmarks/results/unseen_models.json`` and ``unseen_models.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

from common import PY, RESULTS, ROOT, machine, save

WORKER = ROOT / "benchmarks" / "unseen_models_worker.py"
#: steps per task: enough for dense to learn each task clearly
STEPS = {"vit": 250, "cnn": 200, "gpt": 300, "mlp": 400, "mlp-rmsprop": 400, "gru": 300}
SGD_TASKS = ("cnn", "gru")


def options(task, variant, steps):
    """hvd_sparse's keywords for a variant (``density`` apart)."""
    opts = {"cost_model": "off"}
    if variant in ("gradient", "gradient_warm"):
        opts["exchange"] = "gradient"
    if variant in ("update", "update_mask"):
        opts["exchange"] = "update"
    if variant == "update_mask":
        opts["momentum_masking"] = 0.5
    if variant == "no_varcorr":  # the library's defaults before the thirty-seventh session
        opts["variance_correction"] = False
    if variant == "gradient_warm":
        opts["density_warmup_steps"] = max(1, steps // 10)
    if variant == "tuned":
        opts["density_warmup_steps"] = max(1, steps // 10)
        if task in SGD_TASKS:
            opts.update(exchange="update", momentum_masking=0.5)
    return opts


def run(task, mode, density, seed, ranks, opts=None):
    steps = STEPS[task]
    worker_task, extra = (task, []) if task != "mlp-rmsprop" else ("mlp", ["--opt", "rmsprop"])
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-np", str(ranks), PY, str(WORKER), "--task", worker_task, "--mode", mode,
           "--density", str(density), "--steps", str(steps), "--seed", str(seed),
           "--options", json.dumps(opts or {}), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{task} {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    out["task"] = task
    return out


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = {(r["task"], r["seed"]): r["eval_loss"] for r in rows if r["mode"] == "dense"}
    runs = [r for r in rows if r["mode"] != "dense"]
    labels = [f"{r['task']}\n{r['variant']} {r['density']:g}\nseed {r['seed']}" for r in runs]
    gaps = [100 * (r["eval_loss"] / dense[(r["task"], r["seed"])] - 1)
            if dense[(r["task"], r["seed"])] > 1e-3 else float("nan") for r in runs]
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    colour = {v: f"C{i}" for i, v in enumerate(variants)}
    fig, ax = plt.subplots(figsize=(max(6, 0.75 * len(runs)), 4))
    ax.bar(range(len(runs)), gaps, color=[colour[r["variant"]] for r in runs])
    ax.set_xticks(range(len(runs)), labels, fontsize=6)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("held-out loss against dense (%)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colour[v]) for v in variants],
              labels=variants, fontsize=7)
    ax.set_title("Models no default was tuned on: held-out loss against Horovod's")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--densities", nargs="+", type=float, default=[0.01])
    ap.add_argument("--tasks", nargs="+", default=list(STEPS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--variants", nargs="+", default=["library", "tuned"],
                    choices=["library", "tuned", "gradient", "update", "update_mask",
                             "gradient_warm", "no_varcorr"])
    ap.add_argument("--out", default="unseen_models", help="results name (JSON and PNG)")
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        for task in args.tasks:
            rows.append(dict(run(task, "dense", 1.0, seed, args.ranks), variant="dense"))
            base = rows[-1]
            for density in args.densities:
                for variant in args.variants:
                    r = run(task, "sparse", density, seed, args.ranks,
                            options(task, variant, STEPS[task]))
                    r["variant"] = variant
                    rows.append(r)
                    gap = (100 * (r["eval_loss"] / base["eval_loss"] - 1)
                           if base["eval_loss"] > 1e-3 else float("nan"))
                    acc = "" if r["eval_acc"] is None else \
                        f" acc {r['eval_acc']:.3f} (dense {base['eval_acc']:.3f})"
                    print(f"{task:12} seed {seed} {variant:8} {density:g}: held-out loss "
                          f"{r['eval_loss']:.4f} against {base['eval_loss']:.4f} "
                          f"({gap:+.1f}%){acc}, bytes {r['bytes_sent'] / r['dense_bytes']:.3f}"
                          f" of dense, replicas identical {r['params_identical']}", flush=True)
    save(args.out, {"machine": machine(), "ranks": args.ranks, "rows": rows})
    plot(rows, RESULTS / f"{args.out}.png")


if __name__ == "__main__":
    main()
