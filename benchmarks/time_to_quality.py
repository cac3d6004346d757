"""Time and bytes to quality: how long, and how many bytes, until a run reaches the validation
loss that dense Horovod ends with.

    .venv/bin/python benchmarks/time_to_quality.py [--rate 1gbit] [--ranks 2] [--steps 300]

Dense trains ``--steps`` steps; each sparse setting trains up to ``--sparse-steps`` (twice as
many by default: at equal steps it ends behind dense, so the question is what it costs to catch
up). All ranks run on this machine behind ``launch/slownet.sh RATE`` and evaluate every
``--every`` steps (``--only NAME ...`` reruns some settings, e.g. longer, and keeps the
others' records; ``--sparse-steps`` then sets their length); the time counted is training time (``train_s``: evaluations left out), the
bytes are those each rank sent. A run "reaches" dense's final loss at the first evaluation at or
below it. Workloads and settings are the convergence study's best per optimizer
(``benchmarks/convergence.py``): the character Transformer with AdamW, updates exchanged (the
default for adaptive optimizers), and the character LSTM with SGD, gradients (the library's
default), with DGC's momentum correction, and with the training CLI's SGD default.

Writes ``benchmarks/results/time_to_quality.json`` (every evaluation, machine, rate) and
``time_to_quality.png`` (validation loss against training time and against bytes, dense's final
loss as a line).
"""
from __future__ import annotations

import argparse
import json

from common import RESULTS, machine, save, slownet, train_run


def workloads(every):
    # momentum masking and the cool-down (the CLI's SGD default since the twentieth session)
    # pinned off, as measured
    common = ["--dataset", "shakespeare", "--steps-per-epoch", str(every), "--cost-model", "off",
              "--no-momentum-masking", "--density-cooldown-steps", "0"]
    return {
        "transformer": common + ["--model", "transformer", "--base-optimizer", "adamw",
                                 "--lr", "3e-3", "--batch-size", "16", "--seq-len", "128"],
        "lstm": common + ["--model", "lstm"],
    }


def settings(workload, steps):
    if workload == "transformer":
        # the library's defaults for AdamW (updates exchanged), and the training CLI's (no
        # downlink selection, DGC's density warm-up over the first 10% of the run)
        return {"dense": ["--optimizer", "dense"],
                "topk1%-update": ["--density", "0.01", "--exchange", "update",
                                  "--bidirectional", "--density-warmup-steps", "0"],
                "topk1%-update-unidirectional-warmup": [
                    "--density", "0.01", "--exchange", "update", "--no-bidirectional",
                    "--density-warmup-steps", str(max(1, steps // 10))]}
    return {"dense": ["--optimizer", "dense"],
            "topk1%-grad": ["--density", "0.01", "--exchange", "gradient"],
            "topk1%-grad-momcorr": ["--density", "0.01", "--exchange", "gradient",
                                    "--momentum-correction"],
            # the training CLI's SGD default since the sixteenth session (each rank's update,
            # no downlink selection, DGC's density warm-up over the first 10% of the run)
            "topk1%-update-unidirectional-warmup": [
                "--density", "0.01", "--exchange", "update", "--no-bidirectional",
                "--density-warmup-steps", str(max(1, steps // 10))]}


def reached(records, target):
    """(steps, training seconds, bytes sent) at the first evaluation at or below ``target``."""
    for r in records:
        if r["valid_loss"] <= target:
            return {"steps": r["steps"], "train_s": r["train_s"], "bytes_sent": r["bytes_sent"]}
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sparse-steps", type=int, default=None)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args()
    sparse_steps = args.sparse_steps or 2 * args.steps
    path = RESULTS / "time_to_quality.json"
    # runs named with --only replace their earlier records; the others are kept
    runs = json.loads(path.read_text())["runs"] if args.only and path.exists() else {}
    for wname, wargs in workloads(args.every).items():
        for sname in settings(wname, sparse_steps):
            name = f"{wname}/{sname}"
            if args.only and name not in args.only:
                continue
            steps = args.steps if sname == "dense" else sparse_steps
            sargs = settings(wname, steps)[sname]
            warm = ["--warmup-steps", str(max(1, steps // 10))] if wname == "transformer" else []
            train_args = ["--epochs", str(steps // args.every), *wargs, *warm, *sargs]
            recs = train_run(name, train_args, launcher=slownet(args.rate, args.ranks))
            runs[name] = {"args": train_args, "records": recs}
            last = recs[-1]
            print(f"{name:32} valid_loss {last['valid_loss']:.4f} after {last['steps']} steps, "
                  f"{last['train_s']:.0f} s, {last['bytes_sent'] / 2**20:.1f} MiB", flush=True)
    summary = {}
    for name, run in runs.items():
        wname = name.split("/")[0]
        dense = runs.get(f"{wname}/dense")
        if dense is None:
            continue
        target = dense["records"][-1]["valid_loss"]
        summary[name] = {"target": target, "reached": reached(run["records"], target)}
    save("time_to_quality", {"machine": machine(), "rate": args.rate, "ranks": args.ranks,
                             "runs": runs, "summary": summary})
    for name, s in summary.items():
        r = s["reached"]
        print(f"{name:32} reaches {s['target']:.4f}: " + (
            f"step {r['steps']}, {r['train_s']:.0f} s, {r['bytes_sent'] / 2**20:.1f} MiB"
            if r else "not within the run"))
    plot(runs, summary, RESULTS / "time_to_quality.png")


def plot(runs, summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads_seen = sorted({n.split("/")[0] for n in runs})
    fig, axes = plt.subplots(len(workloads_seen), 2, figsize=(11, 4 * len(workloads_seen)),
                             squeeze=False)
    for row, wname in enumerate(workloads_seen):
        for name, run in runs.items():
            if not name.startswith(wname + "/"):
                continue
            recs = run["records"]
            loss = [r["valid_loss"] for r in recs]
            axes[row][0].plot([r["train_s"] for r in recs], loss, "-o", ms=3, label=name)
            axes[row][1].plot([r["bytes_sent"] / 2**20 for r in recs], loss, "-o", ms=3,
                              label=name)
        target = summary.get(f"{wname}/dense", {}).get("target")
        for ax in axes[row]:
            if target is not None:
                ax.axhline(target, color="grey", ls="--", lw=1, label="dense, final")
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=7)
        axes[row][0].set_xlabel("training time (s)")
        axes[row][1].set_xlabel("MiB sent per rank")
        axes[row][1].set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
