"""Convergence study: which levers make sparse training match dense on language models.

    .venv/bin/python benchmarks/convergence.py [--ranks 2] [--steps 300] [--only NAME ...]

Each run is ``python -m hvd_sparse.train`` on real data with the same seed, steps and batches,
on ``--ranks`` ranks over loopback (``launch/slownet.sh`` not needed: quality does not depend on
the link); the validation loss is read at ``--evals`` points along the run. Workloads:

* ``transformer``: a 3-layer character Transformer (652k parameters) on Shakespeare, AdamW
  (lr 3e-3, 10% linear warm-up, cosine decay), batch 16 x 128 per rank;
* ``lstm``: the character LSTM on Shakespeare, SGD with momentum (the training CLI's defaults);
* ``lstm-adamw``: the same LSTM with the Transformer's AdamW schedule, where the levers for
  adaptive optimizers are checked on a model they were not chosen on.

Levers, each with its reason:

* ``grad`` vs ``update`` (``exchange="update"``): with gradient exchange, an adaptive optimizer
  sees each coordinate's accumulated gradient only when it is selected, so its second-moment
  normalisation shrinks the rare large steps (the mismatch 1-bit Adam, Tang et al. 2021,
  avoids by compressing after the adaptive step); exchanging each rank's AdamW update keeps the
  adaptive step dense locally and sparsifies the weight change with error feedback, as local
  SGD with sparse updates does (Shi et al.'s and SBC's delayed weight-update exchange);
* ``unidirectional`` (``bidirectional=False``): whether the downlink re-sparsification costs
  quality (Zou et al. bound its extra error);
* ``global`` (``scope="model"``): one Top-K over all parameters instead of one per tensor, so
  layers compete for the budget (global Top-K as analysed by Shi et al., 2019, against DGC's
  layer-wise selection);
* ``warmup`` (``density_warmup_steps`` = 10% of the run): DGC's exponentially decaying density
  (Lin et al., ICLR 2018), so the first steps, when gradients change fastest, are nearly dense;
* ``momcorr`` (SGD only): DGC's momentum correction (Lin et al., 2018): each rank keeps the
  velocity and error feedback acts on it, so a coordinate released after many steps arrives
  with the momentum it would have had; the wrapped SGD runs without momentum;
* ``smalldense`` (``min_sparse_numel``): small tensors (embeddings, biases, output layers)
  sent dense, as DGC leaves its small layers uncompressed; with ``scope="model"`` (one bucket)
  it changes nothing;
* ``cooldown`` (``density_cooldown_steps`` = 10% of the run, up to 10% density): the mirror of
  DGC's warm-up at the run's end, so the mass error feedback still holds reaches the final model
  gradually (the iterate error feedback returns trails the one that converges like SGD by the
  residuals: Stich et al., NeurIPS'18; Karimireddy et al., ICML'19);
* ``floor<f>`` (``scope="model"``, ``layer_floor=f``): one bucket where each tensor first keeps
  the share ``f`` of its own Top-K and the rest of the budget goes to the largest entries of
  any tensor (``f=0``: global Top-K; ``f=1``: layer-wise), so no layer starves (the ResNet's
  loss under global selection) while the budget still flows to the large magnitudes;
* ``varcorr`` (adaptive optimizers, exchanged updates): each rank's Adam steps on an estimate
  of the full batch's second moment, its own minus (1 - 1/P) times the gradient noise that
  half the squared difference of consecutive gradients estimates (each rank sees a P-th of
  the batch, so its own second moment holds P times the noise; the same argument as the
  gradient-noise scale of McCandlish et al., 2018, made per coordinate from time instead of
  from two batch sizes); ``update-dense`` (density 1) isolates what per-rank moments cost;
* density 1% and 0.1%, and the run's length (``--steps``: names get ``@<steps>steps`` unless
  300), since error feedback's delay weighs less in a longer run.

Writes ``benchmarks/results/convergence.json`` (every evaluation of every run, bytes, wall time,
machine) and ``convergence.png`` (validation loss against steps and against bytes sent).
"""
from __future__ import annotations

import argparse
import json

from common import RESULTS, machine, save, train_run


def pin_layerwise_below_one_percent(args):
    """A run below 1% density that names no ``--scope`` gets ``--scope tensor``: the study's
    runs there were measured with the per-tensor selection, before the training CLI's default
    became one global selection below 1% (twenty-third session), and keep their meaning."""
    if "--scope" in args or "--density" not in args \
            or float(args[args.index("--density") + 1]) >= 0.01:
        return args
    return args + ["--scope", "tensor"]


def levers(steps):
    """Each lever's training-CLI arguments (below 1% density pinned per tensor unless named)."""
    return {name: pin_layerwise_below_one_percent(args)
            for name, args in _levers(steps).items()}


def _levers(steps):
    warm = ["--density-warmup-steps", str(max(1, steps // 10))]
    warm5 = ["--density-warmup-steps", str(max(1, steps // 20))]
    warm15 = ["--density-warmup-steps", str(max(1, (3 * steps) // 20))]
    cool = ["--density-cooldown-steps", str(max(1, steps // 10))]
    small = ["--min-sparse-numel", "20000"]
    grad, update = ["--exchange", "gradient"], ["--exchange", "update"]
    return {
        "dense": ["--optimizer", "dense"],
        "topk1%-grad": ["--density", "0.01", *grad],
        "topk1%-grad-sharded": ["--density", "0.01", *grad, "--collective", "sharded"],
        "topk1%-update": ["--density", "0.01", *update],
        "topk1%-update-sharded": ["--density", "0.01", *update, "--collective", "sharded"],
        "topk1%-grad-unidirectional": ["--density", "0.01", *grad, "--no-bidirectional"],
        "topk1%-update-unidirectional": ["--density", "0.01", *update, "--no-bidirectional"],
        "topk1%-grad-warmup": ["--density", "0.01", *grad, *warm],
        "topk1%-update-warmup": ["--density", "0.01", *update, *warm],
        "topk1%-update-global": ["--density", "0.01", *update, "--scope", "model"],
        # SGD only (run with --only lstm/...): DGC's momentum correction
        "topk1%-grad-momcorr": ["--density", "0.01", *grad, "--momentum-correction"],
        "topk1%-grad-momcorr-global": ["--density", "0.01", *grad, "--momentum-correction",
                                       "--scope", "model"],
        # the sharded exchange where it really shards at 4 ranks (k above ~4,000 under the
        # global rule; at 1% these models' buckets all go by allgather): issue 11's accuracy
        "topk10%-grad": ["--density", "0.1", *grad, "--collective", "allgather"],
        "topk10%-grad-sharded": ["--density", "0.1", *grad, "--collective", "sharded"],
        # Sahu et al. (NeurIPS'21): a hard threshold with error feedback minimises the total
        # error for a total communication budget, where Top-K spends the same k every step.
        # Lambda depends on the gradients' scale: these are set for the LSTM (--only lstm/...)
        # so that the run sends about Top-K 1%'s bytes
        "threshold3.6e-3-grad": ["--sparsifier", "threshold", "--threshold", "3.6e-3", *grad],
        "threshold2e-2-grad-momcorr": ["--sparsifier", "threshold", "--threshold", "2e-2",
                                       *grad, "--momentum-correction"],
        # and for the Transformer's AdamW updates (--only transformer/...)
        "threshold1e-2-update": ["--sparsifier", "threshold", "--threshold", "1e-2", *update],
        "threshold2e-2-update": ["--sparsifier", "threshold", "--threshold", "2e-2", *update],
        # the levers that each helped a little, together
        "topk1%-grad-momcorr-global-warmup": ["--density", "0.01", *grad,
                                              "--momentum-correction", "--scope", "model",
                                              *warm],
        # the LSTM's best SGD setting with a longer warm-up, or without the downlink selection
        "topk1%-grad-momcorr-global-warmup15": ["--density", "0.01", *grad,
                                                "--momentum-correction", "--scope", "model",
                                                *warm15],
        "topk1%-grad-momcorr-global-warmup-unidirectional": [
            "--density", "0.01", *grad, "--momentum-correction", "--scope", "model", *warm,
            "--no-bidirectional"],
        # the density cool-down over the last 10% of the run, up to 10% (hvd_sparse.dgc)
        "topk1%-grad-cooldown": ["--density", "0.01", *grad, *cool],
        "topk1%-grad-momcorr-global-warmup-cooldown": ["--density", "0.01", *grad,
                                                       "--momentum-correction", "--scope",
                                                       "model", *warm, *cool],
        "topk1%-update-global-warmup": ["--density", "0.01", *update, "--scope", "model",
                                        *warm],
        # the ResNet's best SGD setting under a cosine rate (exchanged updates with the density
        # warm-up, benchmarks/accuracy.py) on the LSTM, with and without the cool-down
        "topk1%-update-warmup-cooldown": ["--density", "0.01", *update, *warm, *cool],
        # the two levers that helped the Transformer most, together, within the byte
        # budget (10% of dense): DGC's density warm-up, or the first 10 steps dense
        "topk1%-update-unidirectional-warmup": ["--density", "0.01", *update,
                                                "--no-bidirectional", *warm],
        # the full batch's second moment for each rank's Adam (hvd_sparse.variance_correction:
        # each rank's own second moment holds P times the full batch's gradient noise);
        # updates averaged densely, without and with it, show what per-rank moments cost
        "topk1%-update-unidirectional-warmup-varcorr": ["--density", "0.01", *update,
                                                        "--no-bidirectional", *warm,
                                                        "--variance-correction"],
        "topk0.1%-update-unidirectional-warmup5-global-varcorr": [
            "--density", "0.001", *update, "--no-bidirectional", *warm5, "--scope", "model",
            "--variance-correction"],
        # the same at 0.1% with one lever changed: per-tensor selection, the layer floor, the
        # downlink selection, the cool-down, the longer warm-up
        **{f"topk0.1%-update-{tag}-varcorr": [
            "--density", "0.001", *update, *rest, "--variance-correction"]
           for tag, rest in (
               ("unidirectional-warmup5", ["--no-bidirectional", *warm5, "--scope", "tensor"]),
               ("unidirectional-warmup5-global-floor0.5",
                ["--no-bidirectional", *warm5, "--scope", "model", "--layer-floor", "0.5"]),
               ("warmup5-global", [*warm5, "--scope", "model"]),
               ("unidirectional-warmup5-global-cooldown",
                ["--no-bidirectional", *warm5, "--scope", "model", *cool]),
               ("unidirectional-warmup-global", ["--no-bidirectional", *warm, "--scope",
                                                 "model"]),
               ("unidirectional-dense4-warmup5-global",
                ["--no-bidirectional", "--dense-warmup-steps", "4", *warm5, "--scope",
                 "model"]))},
        # the same bytes as 0.1% a step, sent as 1% every 10 steps (2.5% every 4): each rank
        # steps its own AdamW in between (local_steps, SBC's communication delay), so its
        # parameters hold its own unsent change, where an exchanged update's residual waits
        **{f"topk{d}-local{h}-{tag}-varcorr": [
            "--density", str(float(d[:-1]) / 100), "--local-steps", str(h), *rest,
            "--variance-correction"]
           for d, h in (("1%", 10), ("0.25%", 4))
           for tag, rest in (("unidirectional", ["--no-bidirectional"]),
                             ("unidirectional-warmup5-global",
                              ["--no-bidirectional", *warm5, "--scope", "model"]))},
        "update-dense": ["--density", "1.0", *update, "--no-bidirectional"],
        "update-dense-varcorr": ["--density", "1.0", *update, "--no-bidirectional",
                                 "--variance-correction"],
        "topk1%-update-unidirectional-warmup-cooldown": ["--density", "0.01", *update,
                                                         "--no-bidirectional", *warm, *cool],
        # DGC's momentum factor masking with exchanged updates (each rank's SGD momentum zeroed
        # where it sent), alone and with the cool-down, which did nothing for updates without it
        "topk1%-update-unidirectional-warmup-mask": ["--density", "0.01", *update,
                                                     "--no-bidirectional", *warm,
                                                     "--momentum-masking"],
        "topk1%-update-unidirectional-warmup-mask-cooldown": [
            "--density", "0.01", *update, "--no-bidirectional", *warm, *cool,
            "--momentum-masking"],
        # masking at half strength (the momentum scaled by 0.5 where sent; the CLI's default
        # since the twenty-second session)
        "topk1%-update-unidirectional-warmup-mask0.5-cooldown": [
            "--density", "0.01", *update, "--no-bidirectional", *warm, *cool,
            "--momentum-masking", "0.5"],
        "topk1%-update-unidirectional-dense10": ["--density", "0.01", *update,
                                                 "--no-bidirectional",
                                                 "--dense-warmup-steps", "10"],
        # how small tensors are treated (DGC leaves biases and other small layers dense): on
        # the LSTM every tensor but its two weight matrices (embedding, biases, the output
        # layer: 6.5% of the entries) goes dense; tensors below 1,024 entries always do
        "topk1%-grad-smalldense": ["--density", "0.01", *grad, *small],
        "topk1%-update-smalldense": ["--density", "0.01", *update, *small],
        "topk1%-grad-momcorr-smalldense": ["--density", "0.01", *grad, "--momentum-correction",
                                           *small],
        # and under the training CLI's SGD default (updates, no downlink selection, warm-up)
        "topk1%-update-unidirectional-warmup-smalldense": ["--density", "0.01", *update,
                                                           "--no-bidirectional", *warm, *small],
        # the CLI's defaults for adaptive optimizers at 0.1%, with the warm-up at 10% and at 5%
        # of the run (the budget at 0.1% is 3% of dense's bytes)
        "topk0.1%-update-unidirectional-warmup": ["--density", "0.001", *update,
                                                  "--no-bidirectional", *warm],
        "topk0.1%-update-unidirectional-warmup5": ["--density", "0.001", *update,
                                                   "--no-bidirectional", *warm5],
        "topk0.1%-update-unidirectional-warmup5-global": ["--density", "0.001", *update,
                                                          "--no-bidirectional", *warm5,
                                                          "--scope", "model"],
        # the CLI's SGD default since the twentieth session (masking, the cool-down) at 0.1%
        "topk0.1%-update-unidirectional-warmup5-mask-cooldown": [
            "--density", "0.001", *update, "--no-bidirectional", *warm5, *cool,
            "--momentum-masking"],
        "topk0.1%-update-unidirectional-warmup5-mask0.5-cooldown": [
            "--density", "0.001", *update, "--no-bidirectional", *warm5, *cool,
            "--momentum-masking", "0.5"],
        # the same with one global Top-K (at 0.1% a layer-wise selection leaves each tensor a
        # thousandth of its entries; the held-out TCN and GRU gained from one selection)
        "topk0.1%-update-unidirectional-warmup5-mask0.5-cooldown-global": [
            "--density", "0.001", *update, "--no-bidirectional", *warm5, *cool,
            "--momentum-masking", "0.5", "--scope", "model"],
        # the LSTM's best SGD levers together, with the small tensors dense; and at 0.1%
        "topk1%-grad-momcorr-global-warmup-smalldense": ["--density", "0.01", *grad,
                                                         "--momentum-correction", "--scope",
                                                         "model", *warm, *small],
        "topk0.1%-grad-momcorr-global-warmup5": ["--density", "0.001", *grad,
                                                 "--momentum-correction", "--scope", "model",
                                                 *warm5],
        "topk0.1%-grad-momcorr-global-warmup5-unidirectional": [
            "--density", "0.001", *grad, "--momentum-correction", "--scope", "model", *warm5,
            "--no-bidirectional"],
        "topk0.1%-grad-momcorr-global-warmup-unidirectional": [
            "--density", "0.001", *grad, "--momentum-correction", "--scope", "model", *warm,
            "--no-bidirectional"],
        "topk0.1%-grad-momcorr-global-warmup5-unidirectional-cooldown": [
            "--density", "0.001", *grad, "--momentum-correction", "--scope", "model", *warm5,
            "--no-bidirectional", *cool],
        "topk0.1%-update-unidirectional-warmup5-cooldown": ["--density", "0.001", *update,
                                                            "--no-bidirectional", *warm5, *cool],
        # the uplink/downlink density split (Zou et al. bound the downlink's extra error by its
        # own compression ratio; with the allgather collective the downlink selection sends no
        # bytes, so its density is free to choose): the CLI's SGD default with the downlink
        # selecting half, a quarter or twice the uplink's density
        "topk1%-update-warmup-down0.5%": ["--density", "0.01", *update, *warm,
                                          "--downlink-density", "0.005"],
        "topk1%-update-warmup-down0.25%": ["--density", "0.01", *update, *warm,
                                           "--downlink-density", "0.0025"],
        "topk1%-update-warmup-down2%": ["--density", "0.01", *update, *warm,
                                        "--downlink-density", "0.02"],
        # the layer floor (scope="model" with layer_floor): one bucket, each tensor first keeps
        # a share of its own Top-K, the rest of the budget is global; between the layer-wise
        # selection (DGC) that never starves a layer and the global one (Shi et al., 2019)
        # that the LSTM gained from and the ResNet lost by (benchmarks/accuracy.py)
        **{f"topk1%-update-unidirectional-warmup-floor{f}": [
            "--density", "0.01", *update, "--no-bidirectional", *warm, "--scope", "model",
            "--layer-floor", f] for f in ("0", "0.25", "0.5")},
        **{f"topk1%-grad-momcorr-floor{f}-warmup-cooldown": [
            "--density", "0.01", *grad, "--momentum-correction", "--scope", "model",
            "--layer-floor", f, *warm, *cool] for f in ("0.25", "0.5")},
        "topk0.1%-grad": ["--density", "0.001", *grad],
        "topk0.1%-update": ["--density", "0.001", *update],
        # the library's own defaults (no warm-up, cool-down or masking: the first two need the
        # run's length), per tensor and with one global Top-K: whether the library, not only
        # the CLI, should select so below 1%
        **{f"topk0.1%-{ex[1]}-lib{tag}": [
            "--density", "0.001", *ex, "--density-warmup-steps", "0",
            "--density-cooldown-steps", "0", "--no-momentum-masking", "--scope", scope]
           for ex in (grad, update) for tag, scope in (("", "tensor"), ("-global", "model"))},
    }


def workloads(steps, evals):
    per = max(1, steps // evals)
    # the library's defaults unless a lever says otherwise (the training CLI's own defaults
    # are this study's best levers: topk1%-update-unidirectional-warmup for adaptive
    # optimizers, topk1%-update-unidirectional-warmup-mask-cooldown for SGD with momentum)
    common = ["--dataset", "shakespeare", "--epochs", str(evals), "--steps-per-epoch", str(per),
              "--cost-model", "off", "--bidirectional", "--density-warmup-steps", "0",
              "--density-cooldown-steps", "0", "--no-momentum-masking",
              # (the library's default for AdamW's updates since the thirty-seventh session,
              # named by the levers that use it: ``-varcorr``)
              "--no-variance-correction"]
    return {
        "transformer": common + ["--model", "transformer", "--base-optimizer", "adamw",
                                 "--lr", "3e-3", "--warmup-steps", str(max(1, steps // 10)),
                                 "--batch-size", "16", "--seq-len", "128"],
        "lstm": common + ["--model", "lstm"],
        # a check of the adaptive-optimizer defaults on a model they were not chosen on: the
        # same LSTM trained with AdamW (the Transformer's schedule)
        "lstm-adamw": common + ["--model", "lstm", "--base-optimizer", "adamw", "--lr", "3e-3",
                                "--warmup-steps", str(max(1, steps // 10))],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--evals", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", default=None, help="run names like transformer/dense")
    p.add_argument("--lr", type=float, default=None,
                   help="another learning rate than the workload's (names get @lr<rate>)")
    args = p.parse_args()
    path = RESULTS / "convergence.json"
    old = json.loads(path.read_text())["runs"] if path.exists() else {}
    results = dict(old)
    for wname, wargs in workloads(args.steps, args.evals).items():
        for lname, largs in levers(args.steps).items():
            name = f"{wname}/{lname}"
            if args.only and name not in args.only:
                continue
            name = tagged(name, args.seed, args.ranks, args.steps if args.steps != 300 else None,
                          args.lr)
            rate = ["--lr", str(args.lr)] if args.lr is not None else []
            recs = train_run(name, ["--ranks", str(args.ranks), "--seed", str(args.seed),
                                    *wargs, *largs, *rate])
            results[name] = {"args": wargs + largs + rate, "seed": args.seed,
                             "ranks": args.ranks, "records": recs}
            report(name, recs)
            save("convergence", {"machine": machine(), "runs": results})
    save("convergence", {"machine": machine(), "runs": results})
    plot(results, RESULTS / "convergence.png")
    table(results)
    seeds(results)


def tagged(name, seed, ranks, steps=None, lr=None):
    """A run's name with what differs from the main setting (seed 0, 2 ranks, the workload's
    length and rate): ``@seed<n>``, ``@<n>ranks``, ``@<n>steps``, ``@lr<rate>``."""
    if seed:
        name += f"@seed{seed}"
    if ranks != 2:
        name += f"@{ranks}ranks"
    if steps:
        name += f"@{steps}steps"
    if lr is not None:
        name += f"@lr{lr:g}"
    return name


def report(name, recs):
    last = recs[-1]
    print(f"{name:40} valid_loss {last['valid_loss']:.4f}  sent "
          f"{last['bytes_sent'] / 2**20:8.2f} MiB of {last['dense_bytes'] / 2**20:8.2f}"
          f"  wall {last['wall_s']:.0f} s", flush=True)


def table(results):
    """Markdown rows: final validation loss against the same workload's dense run."""
    print("| run | valid loss | vs dense | bytes sent per rank | of dense |")
    print("|---|---|---|---|---|")
    for name, run in results.items():
        w = name.split("/")[0]
        suffix = name.split("@", 1)[1] if "@" in name else None
        dense = results.get(f"{w}/dense" + (f"@{suffix}" if suffix else ""))
        last = run["records"][-1]
        ref = dense["records"][-1]["valid_loss"] if dense else None
        rel = f"{100 * (last['valid_loss'] / ref - 1):+.1f}%" if ref else "-"
        print(f"| {name} | {last['valid_loss']:.3f} | {rel} | "
              f"{last['bytes_sent'] / 2**20:.1f} MiB | "
              f"{100 * last['bytes_sent'] / last['dense_bytes']:.1f}% |")


def seeds(results):
    """Mean (min..max) gap to dense over the seeds run at 2 ranks, per workload, lever and run
    length."""
    groups = {}
    for name, run in results.items():
        base, _, suffix = name.partition("@")
        rest = [t for t in suffix.split("@") if t and not t.startswith("seed")]
        if any(t.endswith("ranks") for t in rest):
            continue
        dense = results.get(name.replace(base, base.split("/")[0] + "/dense", 1))
        if dense is None or base.endswith("/dense"):
            continue
        gap = run["records"][-1]["valid_loss"] / dense["records"][-1]["valid_loss"] - 1
        groups.setdefault(base + "".join("@" + t for t in rest), []).append(100 * gap)
    print("| run | seeds | gap to dense, mean (min..max) |")
    print("|---|---|---|")
    for base, gaps in groups.items():
        if len(gaps) > 1:
            print(f"| {base} | {len(gaps)} | {sum(gaps) / len(gaps):+.1f}% "
                  f"({min(gaps):+.1f}..{max(gaps):+.1f}) |")


def plot(results, path):
    """Validation loss against steps and against bytes, seed 0 at 2 ranks: one row per workload
    at the default length, and one per workload and longer run (names ending ``@<n>steps``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for name, run in results.items():
        task, _, suffix = name.partition("@")
        tags = suffix.split("@") if suffix else []
        if any(t.startswith("seed") or t.endswith("ranks") for t in tags):
            continue  # the curves of the main setting (seed 0, 2 ranks)
        row = task.split("/")[0] + "".join("@" + t for t in tags)
        rows.setdefault(row, []).append((task.split("/", 1)[1], run["records"]))
    fig, axes = plt.subplots(len(rows), 2, figsize=(15, 4.2 * len(rows)), squeeze=False)
    for ax_row, (row, runs) in zip(axes, sorted(rows.items())):
        dense = [recs for label, recs in runs if label == "dense"]
        # diverged runs would squash the others: the axis stops at 1.5x dense's first value
        top = 1.5 * dense[0][0]["valid_loss"] if dense else None
        for label, recs in runs:
            ax_row[0].plot([r["steps"] for r in recs], [r["valid_loss"] for r in recs], "-o",
                           ms=3, label=label)
            ax_row[1].plot([r["bytes_sent"] / 2**20 for r in recs],
                           [r["valid_loss"] for r in recs], "-o", ms=3, label=label)
        ax_row[0].set(title=f"{row}: validation loss vs steps", xlabel="step",
                      ylabel="validation loss")
        ax_row[1].set(title=f"{row}: vs bytes sent per rank", xlabel="MiB sent", xscale="log")
        if top:
            for ax in ax_row:
                ax.set_ylim(top=top)
        ax_row[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
