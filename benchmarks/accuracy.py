"""Time and bytes to accuracy: dense Horovod vs hvd_sparse, same epochs and seeds, one run.

    .venv/bin/python benchmarks/accuracy.py [--rate 1gbit] [--epochs 2] [--lstm-epochs 3]

Fashion-MNIST with the ResNet-style CNN at 1% and 0.1% density against dense, and the
Shakespeare character LSTM at 1% against dense, all on 2 ranks behind ``launch/slownet.sh RATE``;
the ``-sharded`` runs use ``--collective sharded`` (select them with ``--only``, and keep them
apart with ``--out``).
Per-epoch records go to benchmarks/results/accuracy.json; accuracy.png plots the metric against
wall-clock time and against bytes sent.
"""
from __future__ import annotations

import argparse
import json

from common import RESULTS, machine, save, slownet, train_run


def runs(args):
    # momentum masking and the cool-down pinned off (the training CLI's SGD default since the
    # twentieth session): each setting names what it uses
    pin = ["--no-momentum-masking", "--density-cooldown-steps", "0"]
    fm = ["--dataset", "fashion-mnist", "--model", "resnet", "--epochs", str(args.epochs), *pin]
    sh = ["--dataset", "shakespeare", "--model", "lstm", "--epochs", str(args.lstm_epochs),
          "--steps-per-epoch", str(args.lstm_steps), *pin]
    # 10% of the Fashion-MNIST run (60,000 images, batch 64 per rank), for the density warm-up
    warm = str(max(1, args.epochs * (60000 // (64 * args.ranks)) // 10))
    return {name: _gradient_unless_named(extra) for name, extra in {
        "fashion/dense": fm + ["--optimizer", "dense"],
        # the sparse method itself: the time cost model could send buckets dense
        "fashion/topk-1%": fm + ["--density", "0.01", "--cost-model", "off",
                                 "--collective", "allgather"],
        "fashion/topk-0.1%": fm + ["--density", "0.001", "--cost-model", "off",
                                   "--collective", "allgather"],
        "fashion/topk-1%-sharded": fm + ["--density", "0.01", "--cost-model", "off",
                                         "--collective", "sharded"],
        # the LSTM's best SGD levers (benchmarks/convergence.py) on the ResNet: DGC's momentum
        # correction, alone and with one global Top-K and the density warm-up over 10% of the
        # run (run with --out accuracy_sgd_levers)
        "fashion/topk-1%-momcorr": fm + ["--density", "0.01", "--cost-model", "off",
                                         "--collective", "allgather", "--momentum-correction"],
        "fashion/topk-1%-momcorr-global-warmup": fm + [
            "--density", "0.01", "--cost-model", "off", "--collective", "allgather",
            "--momentum-correction", "--scope", "model", "--density-warmup-steps", warm],
        # the density warm-up alone over the first 10% of the run (DGC's exponential schedule;
        # the training CLI's default only where weight updates are exchanged)
        "fashion/topk-1%-warmup": fm + ["--density", "0.01", "--cost-model", "off",
                                        "--collective", "allgather",
                                        "--density-warmup-steps", warm],
        # the density cool-down over the last 10% of the run (an option: it cost the ResNet
        # accuracy on 2 of 3 seeds, docs/results.md)
        "fashion/topk-1%-cooldown": fm + ["--density", "0.01", "--cost-model", "off",
                                          "--collective", "allgather",
                                          "--density-cooldown-steps", warm],
        # no downlink re-selection: with the allgather every rank already holds the whole
        # aggregate, and the second residual delays what the first let through
        "fashion/topk-1%-unidirectional": fm + ["--density", "0.01", "--cost-model", "off",
                                                "--collective", "allgather",
                                                "--no-bidirectional"],
        # SGD with cosine decay of the learning rate to zero (the CLI's SGD default is a
        # constant rate, whose last steps leave the test accuracy swinging by points)
        "fashion/dense-cosine": fm + ["--optimizer", "dense", "--lr-schedule", "cosine"],
        "fashion/topk-1%-cosine": fm + ["--density", "0.01", "--cost-model", "off",
                                        "--collective", "allgather", "--lr-schedule", "cosine"],
        # levers against Top-K's gap under the cosine schedule (a stable metric: dense's five
        # seeds within 0.5 pt): DGC's momentum correction, its density warm-up, one global
        # Top-K, and each rank's SGD update exchanged instead of its gradient
        **{f"fashion/topk-1%-cosine-{lever}": fm + [
            "--density", "0.01", "--cost-model", "off", "--collective", "allgather",
            "--lr-schedule", "cosine", *flags] for lever, flags in (
                ("momcorr", ["--momentum-correction"]),
                ("warmup", ["--density-warmup-steps", warm]),
                ("global", ["--scope", "model"]),
                ("update", ["--exchange", "update"]),
                # the library's default for SGD with momentum since the thirty-sixth session:
                # updates without the downlink selection, no warm-up, masking or cool-down
                ("update-unidirectional", ["--exchange", "update",
                                           "--density-warmup-steps", "0"]),
                ("warmup-update", ["--density-warmup-steps", warm, "--exchange", "update"]),
                # the same with one global Top-K (the LSTM's gap narrowed with it)
                ("warmup-update-global", ["--density-warmup-steps", warm, "--exchange",
                                          "update", "--scope", "model"]),
                # the uplink/downlink density split at 4 ranks, where the aggregate holds up
                # to 4 k entries for the downlink's k (with the allgather the downlink
                # selection sends no bytes): no downlink selection, or one of twice the
                # uplink's density
                ("warmup-update-unidirectional", ["--density-warmup-steps", warm,
                                                  "--exchange", "update",
                                                  "--no-bidirectional"]),
                ("warmup-update-down2%", ["--density-warmup-steps", warm, "--exchange",
                                          "update", "--downlink-density", "0.02"]),
                # one bucket with the layer floor (each tensor half its own Top-K first, the
                # rest global): global selection's gain on the LSTM without starving a layer
                ("warmup-update-unidirectional-floor0.5", [
                    "--density-warmup-steps", warm, "--exchange", "update",
                    "--no-bidirectional", "--scope", "model", "--layer-floor", "0.5"]),
                ("warmup-update-unidirectional-floor0.25", [
                    "--density-warmup-steps", warm, "--exchange", "update",
                    "--no-bidirectional", "--scope", "model", "--layer-floor", "0.25"]),
                ("momcorr-floor0.5-warmup-cooldown", [
                    "--momentum-correction", "--scope", "model", "--layer-floor", "0.5",
                    "--density-warmup-steps", warm, "--density-cooldown-steps", warm]),
                # DGC's momentum masking with exchanged updates, alone and with the cool-down
                ("warmup-update-unidirectional-mask", [
                    "--density-warmup-steps", warm, "--exchange", "update",
                    "--no-bidirectional", "--momentum-masking"]),
                ("warmup-update-unidirectional-mask-cooldown", [
                    "--density-warmup-steps", warm, "--exchange", "update",
                    "--no-bidirectional", "--momentum-masking", "--density-cooldown-steps",
                    warm]),
                ("warmup-update-unidirectional-mask0.5-cooldown", [
                    "--density-warmup-steps", warm, "--exchange", "update",
                    "--no-bidirectional", "--momentum-masking", "0.5",
                    "--density-cooldown-steps", warm]),
                # the cool-down without the masking (the held-out GRU's better setting:
                # benchmarks/heldout.py)
                ("warmup-update-unidirectional-cooldown", [
                    "--density-warmup-steps", warm, "--exchange", "update",
                    "--no-bidirectional", "--density-cooldown-steps", warm]),
                # the downlink selection named, since the CLI drops it from 3 ranks
                ("warmup-update-bidirectional", ["--density-warmup-steps", warm,
                                                 "--exchange", "update", "--bidirectional"]))},
        # 0.1% under the cosine schedule: the training CLI's SGD default at that density
        # (updates, the warm-up over 5% of the run, half masking, the cool-down) with the
        # layer-wise selection and with one global Top-K (the held-out TCN and GRU gained
        # from it at 0.1%)
        **{f"fashion/topk-0.1%-cosine-default{tag}": fm + [
            "--density", "0.001", "--cost-model", "off", "--collective", "allgather",
            "--lr-schedule", "cosine", "--density-warmup-steps", str(max(1, int(warm) // 2)),
            "--exchange", "update", "--no-bidirectional", "--momentum-masking", "0.5",
            "--density-cooldown-steps", warm, *flags]
           for tag, flags in (("", []), ("-global", ["--scope", "model"]))},
        # the library's own defaults at 0.1% (one global Top-K below 1%): SGD's gradients, and
        # its updates without the downlink selection (its default since the thirty-sixth
        # session)
        **{f"fashion/topk-0.1%-cosine-library-{kind}": fm + [
            "--density", "0.001", "--cost-model", "off", "--collective", "allgather",
            "--lr-schedule", "cosine", "--scope", "model", "--density-warmup-steps", "0",
            "--exchange", kind] for kind in ("gradient", "update")},
        # and the char-LSTM's best 0.1% setting (gradients, DGC's momentum correction, one
        # global Top-K, the warm-up over 5%, no downlink selection, the cool-down)
        "fashion/topk-0.1%-cosine-momcorr-global-cooldown": fm + [
            "--density", "0.001", "--cost-model", "off", "--collective", "allgather",
            "--lr-schedule", "cosine", "--density-warmup-steps", str(max(1, int(warm) // 2)),
            "--exchange", "gradient", "--momentum-correction", "--scope", "model",
            "--no-bidirectional", "--density-cooldown-steps", warm],
        # the training CLI's SGD default (exchanged updates, the density warm-up) under its
        # constant rate
        "fashion/topk-1%-warmup-update": fm + ["--density", "0.01", "--cost-model", "off",
                                               "--collective", "allgather",
                                               "--density-warmup-steps", warm,
                                               "--exchange", "update"],
        "shakespeare/dense": sh + ["--optimizer", "dense"],
        "shakespeare/topk-1%": sh + ["--density", "0.01", "--cost-model", "off",
                                     "--collective", "allgather"],
        "shakespeare/topk-1%-sharded": sh + ["--density", "0.01", "--cost-model", "off",
                                             "--collective", "sharded"],
    }.items()}


def _gradient_unless_named(extra):
    """The sparse runs exchange gradients (as measured before the training CLI's SGD default
    became the update exchange) unless they name ``--exchange``; below 1% density they select
    per tensor unless they name ``--scope`` (see convergence.pin_layerwise_below_one_percent)."""
    from convergence import pin_layerwise_below_one_percent

    if "--optimizer" in extra:
        return extra
    extra = pin_layerwise_below_one_percent(extra)
    if "--exchange" in extra:
        return extra
    return extra + ["--exchange", "gradient"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lstm-epochs", type=int, default=3)
    p.add_argument("--lstm-steps", type=int, default=300)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--out", default="accuracy", help="results name (JSON and PNG)")
    p.add_argument("--seed", type=int, default=0, help="the training CLI's --seed (names get "
                                                        "@seed<n> unless 0)")
    args = p.parse_args()
    path = RESULTS / f"{args.out}.json"
    # runs already in the file stay (a run named again is replaced)
    results = json.loads(path.read_text())["runs"] if path.exists() else {}
    for name, extra in runs(args).items():
        if args.only and name not in args.only:
            continue
        if args.seed:
            name, extra = f"{name}@seed{args.seed}", extra + ["--seed", str(args.seed)]
        results[name] = train_run(name, extra, launcher=slownet(args.rate, args.ranks),
                                  timeout=5400)
        last = results[name][-1]
        metric = "test_accuracy" if "test_accuracy" in last else "valid_loss"
        print(f"{name:22} {metric} {last[metric]:.4f}  wall {last['wall_s']:.1f} s  "
              f"sent {last['bytes_sent'] / 2**20:.1f} MiB", flush=True)
    save(args.out, {"machine": machine(), "rate": args.rate, "ranks": args.ranks,
                    "runs": results})
    plot(results, RESULTS / f"{args.out}.png")


def plot(results, path):
    """Final metric per setting, one dot per seed (runs named ``setting@seedN``), with the
    MiB each rank sent: curves of dozens of runs were unreadable."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [(t, m) for t, m in (("fashion", "test_accuracy"), ("shakespeare", "valid_loss"))
             if any(n.startswith(t) for n in results)]
    settings = {t: sorted({n.split("@")[0] for n in results if n.startswith(t)})
                for t, _ in tasks}
    fig, axes = plt.subplots(len(tasks), 1, squeeze=False, figsize=(
        9, 1.5 + 0.22 * sum(len(v) for v in settings.values())),
        gridspec_kw={"height_ratios": [max(1, len(settings[t])) for t, _ in tasks]})
    for ax, (task, metric) in zip(axes[:, 0], tasks):
        labels = []
        for i, setting in enumerate(settings[task]):
            runs = [recs for n, recs in results.items() if n.split("@")[0] == setting]
            ax.plot([r[-1][metric] for r in runs], [i] * len(runs), "o", color="C0")
            labels.append(f"{setting.split('/', 1)[1]} ({runs[0][-1]['bytes_sent'] / 2**20:.1f} MiB)")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel(f"final {metric} ({task}; one dot per seed)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
