"""Where the density cool-down should end: 10% against 20% of the entries, SGD models.

    .venv/bin/python benchmarks/cooldown_end.py [--only NAME ...] [--import DIR]

The training CLI's SGD runs exchange each rank's update and raise the density geometrically
over the last 10% of the run (DGC's warm-up, run backwards, so that what error feedback still
holds reaches the final model). This study compares where that ramp ends (``--cooldown-density``
0.1, the default until the thirtieth session, against 0.2) on the recurrent and convolutional
character models, the ones that trailed dense: the held-out GRU on fortune cookies (SGD with
momentum, rate 0.3, 900 steps; 3 seeds at 1%, 3 at 0.1%), the char-LSTM on Shakespeare and the
TCN on fortune cookies (seeds 0 and 1); and the Fashion-MNIST ResNet (test accuracy, seed 0, under
``accuracy.py``'s SGD settings). Everything else is the CLI's default, ``--cost-model off``, 2
ranks, equal steps; dense's figures are those of ``heldout.json`` / ``convergence.json`` /
``accuracy_cosine.json`` (Horovod's own optimizer, unchanged since).

``--import DIR`` reads runs already made (``DIR/NAME.jsonl``, the CLI's metrics) instead of
running them. Writes ``benchmarks/results/cooldown_end.json`` and ``cooldown_end.png``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import RESULTS, machine, save, train_run

GRU = ["--dataset", "fortunes", "--epochs", "6", "--steps-per-epoch", "150", "--cost-model", "off",
       "--model", "gru", "--lr", "0.3"]
LSTM = ["--dataset", "shakespeare", "--epochs", "6", "--steps-per-epoch", "150", "--cost-model",
        "off", "--model", "lstm"]
TCN = ["--dataset", "fortunes", "--epochs", "6", "--steps-per-epoch", "150", "--cost-model", "off",
       "--model", "tcn", "--lr", "0.1"]
#: the ResNet under the CLI's SGD settings of accuracy.py's "...-mask0.5-cooldown" lever
#: (cosine rate, warm-up and cool-down over 93 steps, 10% of the run)
RESNET = ["--dataset", "fashion-mnist", "--model", "resnet", "--epochs", "2", "--cost-model", "off",
          "--collective", "allgather", "--lr-schedule", "cosine", "--density-warmup-steps", "93",
          "--exchange", "update", "--no-bidirectional", "--momentum-masking", "0.5",
          "--density-cooldown-steps", "93"]
#: dense Horovod's final validation loss for the same workload and seed (heldout.json,
#: convergence.json); the ResNet's test accuracy (accuracy_cosine.json)
DENSE = {("gru", 0): 1.6259, ("gru", 1): 1.6286, ("gru", 2): 1.6139, ("lstm", 0): 1.6819,
         ("lstm", 1): 1.6883, ("tcn", 0): 1.7096, ("tcn", 1): 1.6962, ("resnet", 0): 0.8944}


def runs() -> dict:
    out = {}
    for seed in (0, 1, 2):
        for density, tag in (("0.01", ""), ("0.001", "g01")):
            for end, label in (("0.1", "def"), ("0.2", "cd02")):
                out[f"{tag}{label}_s{seed}"] = ("gru", seed, density, end,
                                                GRU + ["--density", density, "--seed", str(seed),
                                                       "--cooldown-density", end])
    for model, base, seeds in (("lstm", LSTM, (0, 1)), ("tcn", TCN, (0, 1)),
                               ("resnet", RESNET, (0,))):
        for seed in seeds:
            for end, label in (("0.1", "def"), ("0.2", "cd02")):
                out[f"{model}{label}_s{seed}"] = (model, seed, "0.01", end,
                                                  base + ["--density", "0.01", "--seed",
                                                          str(seed), "--cooldown-density", end])
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--import", dest="imported", default=None,
                   help="a folder of NAME.jsonl metrics from runs already made")
    args = p.parse_args()
    rows = []
    for name, (model, seed, density, end, train_args) in runs().items():
        if args.only and name not in args.only:
            continue
        if args.imported:
            path = Path(args.imported) / f"{name}.jsonl"
            if not path.exists():
                continue
            records = [json.loads(line) for line in path.read_text().splitlines()]
        else:
            records = train_run(name, ["--ranks", "2", *train_args])
        last = records[-1]
        dense = DENSE[(model, seed)]
        row = {"name": name, "model": model, "seed": seed, "density": float(density),
               "cooldown_density": float(end), "args": train_args,
               "bytes_of_dense": last["bytes_sent"] / last["dense_bytes"], "records": records}
        if model == "resnet":  # test accuracy, in points against dense's
            row.update(test_accuracy=last["test_accuracy"], dense_test_accuracy=dense,
                       gap_points=100 * (last["test_accuracy"] - dense))
            said = f"{100 * last['test_accuracy']:.2f}% ({row['gap_points']:+.2f} pt)"
        else:
            row.update(valid_loss=last["valid_loss"], dense_valid_loss=dense,
                       gap_percent=100 * (last["valid_loss"] / dense - 1))
            said = f"{last['valid_loss']:.5f} ({row['gap_percent']:+.2f}%)"
        rows.append(row)
        print(f"{name:14} {said} {100 * row['bytes_of_dense']:.2f}% of dense's bytes", flush=True)
    save("cooldown_end", {"machine": machine(), "rows": rows,
                          "note": "2 ranks, deterministic runs, --cost-model off; dense from "
                                  "heldout.json / convergence.json"})
    plot(rows, RESULTS / "cooldown_end.png")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "gap_percent" in r]  # (the ResNet's is in points)
    groups = sorted({(r["model"], r["density"], r["seed"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(groups)), 4))
    width = 0.38
    for k, end in enumerate((0.1, 0.2)):
        vals = [next((r["gap_percent"] for r in rows if (r["model"], r["density"], r["seed"]) == g
                      and r["cooldown_density"] == end), 0.0) for g in groups]
        ax.bar([i + k * width for i in range(len(groups))], vals, width,
               label=f"cool-down to {end:g}")
    ax.set_xticks([i + width / 2 for i in range(len(groups))],
                  [f"{m}\n{d:g}, s{s}" for m, d, s in groups], fontsize=8)
    ax.axhline(2, color="grey", lw=0.8, ls="--")
    ax.axhline(5, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("validation loss over dense's, %")
    ax.set_title("Where the density cool-down ends (2 ranks, equal steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
