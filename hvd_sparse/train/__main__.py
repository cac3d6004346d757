"""Train a model on real data with hvd_sparse, or with dense Horovod as the control.

    horovodrun -np 2 .venv/bin/python -m hvd_sparse.train --model cnn --density 0.01 --epochs 2
    .venv/bin/python -m hvd_sparse.train --ranks 2 --dataset shakespeare --model lstm

Rank 0 shows a progress bar and prints, per epoch, the workload's metrics and the bytes this rank
sent against what dense allreduce would have moved; ``--metrics FILE`` appends the same as JSON
lines and ``--tensorboard DIR`` writes TensorBoard scalars. ``--benchmark-steps N`` times N steps
(no evaluation) and reports the median step time; ``--optimizer local`` runs the wrapped optimizer
with no communication at all (the floor for step-time comparisons, one rank).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

from hvd_sparse.buckets import resolve_scope


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hvd_sparse.train", description=__doc__,
                                formatter_class=_HelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist",
                   choices=["fashion-mnist", "shakespeare", "fortunes"],
                   help="fortunes: Debian's fortune cookies, a corpus held out of the "
                        "convergence study")
    p.add_argument("--model", default=None,
                   help="cnn | resnet | mlp11m | mlpdeep (fashion-mnist); "
                        "lstm | gru | tcn | transformer (shakespeare, fortunes) (default: cnn "
                        "for fashion-mnist, lstm for the text sets)")
    p.add_argument("--optimizer", default="sparse", choices=["sparse", "dense", "local"],
                   help="sparse: hvd_sparse; dense: Horovod's own (control); local: no exchange")
    p.add_argument("--sparsifier", default="topk",
                   choices=["topk", "gaussiank", "threshold", "adaptive", "sbc", "randomk"],
                   help="which entries each rank sends")
    p.add_argument("--density", type=float, default=0.01,
                   help="share of each gradient's entries sent per step (uplink)")
    p.add_argument("--downlink-density", type=float, default=None,
                   help="share re-selected from the aggregate (None: --density)")
    p.add_argument("--threshold", type=float, default=None,
                   help="lambda for --sparsifier threshold (default 1e-3; --density is then "
                        "not used)")
    p.add_argument("--bidirectional", action=argparse.BooleanOptionalAction, default=None,
                   help="re-sparsify the aggregate (default: yes, except where each rank's "
                        "update is exchanged; see exchange_defaults)")
    p.add_argument("--scope", default=None, choices=["tensor", "model", "bucket"],
                   help="where Top-K selects (default: the library's auto, one global Top-K "
                        "below 1%% density, else per tensor; see hvd_sparse.buckets.resolve_scope)")
    p.add_argument("--layer-floor", type=float, default=0.0,
                   help="Top-K in a bucket of several tensors (--scope model or bucket): the "
                        "share of each tensor's own Top-K it keeps before the rest of the "
                        "budget goes to the largest entries anywhere")
    p.add_argument("--deterministic-dense", action=argparse.BooleanOptionalAction, default=True,
                   help="dense buckets summed in rank order (bitwise-identical replicas)")
    p.add_argument("--cost-model", default="time", choices=["time", "bytes", "off"],
                   help="per-bucket dense fallback: from measured time (default), bytes, or never")
    p.add_argument("--transport", default=None, choices=["horovod", "mpi", "torch"],
                   help="horovod (the default): Horovod's collectives; mpi: mpi4py, no "
                        "Horovod; torch: torch.distributed under torchrun (with mpi and torch "
                        "--optimizer dense is hvd_sparse at density 1, Horovod's step)")
    p.add_argument("--collective", default="auto", choices=["allgather", "sharded", "auto"],
                   help="how sparse buckets are exchanged (see DistributedOptimizer)")
    p.add_argument("--sharded-selection", default="global", choices=["global", "region"],
                   help="how a sharded Top-K downlink is selected (see DistributedOptimizer)")
    p.add_argument("--cycle-time-ms", type=float, default=None,
                   help="Horovod's background cycle (HOROVOD_CYCLE_TIME, unless already set; "
                        "default: Horovod's own, 1 ms). 5 ms was the default until the "
                        "thirtieth session; since MPI's waiting threads yield their core "
                        "(hvd_sparse.init), 1 ms is faster: mlp11m at 1 Gbit/s 88.5 against "
                        "95.4 ms at 2 ranks, 260 against 279 at 4 (benchmarks/cycle_time.py)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data")
    p.add_argument("--steps-per-epoch", type=int, default=200, help="text data sets only")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per rank (default: 64 for fashion-mnist, 32 for the text sets)")
    p.add_argument("--lr", type=float, default=None,
                   help="default: 3e-3 for AdamW; for SGD per data set and model. SGD's rate, "
                        "given or not, is multiplied by the rank count")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD only")
    p.add_argument("--base-optimizer", default="sgd", choices=["sgd", "adamw"],
                   help="the optimizer wrapped: SGD with momentum (lr scaled by the rank count) "
                        "or AdamW with --warmup-steps of linear warm-up and cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW only")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="learning-rate warm-up, in optimizer steps")
    p.add_argument("--lr-schedule", default="auto", choices=["auto", "constant", "cosine"],
                   help="cosine: --warmup-steps of linear warm-up, then cosine decay to zero "
                        "at the end of the run; auto: cosine for AdamW, constant for SGD")
    p.add_argument("--seq-len", type=int, default=None, help="text data sets only")
    p.add_argument("--density-warmup-steps", type=int, default=None,
                   help="DGC's warm-up: density decays geometrically from dense to --density "
                        "(default: 0, or where updates are exchanged 10%% of the run, 5%% "
                        "below 1%% density; see exchange_defaults)")
    p.add_argument("--density-cooldown-steps", type=int, default=None,
                   help="density rises geometrically to --cooldown-density over this many last "
                        "steps of the run (default: 10%% of the run where SGD's updates are "
                        "exchanged, else 0; see exchange_defaults)")
    p.add_argument("--cooldown-density", type=float, default=0.2,
                   help="where the cool-down ends (0.2: against 0.1, the held-out GRU +1.8%% "
                        "of dense's validation loss instead of +2.2%% over 3 seeds at 1%%; "
                        "docs/results.md)")
    p.add_argument("--dense-warmup-steps", type=int, default=0,
                   help="first steps exchanged dense")
    p.add_argument("--local-steps", type=int, default=1,
                   help="each rank steps its own optimizer this many times between exchanges "
                        "of its accumulated weight change (local_steps; SBC's communication "
                        "delay); an evaluation between exchanges sees rank 0's own weights")
    p.add_argument("--momentum-correction", action="store_true",
                   help="SGD: DGC's momentum correction (the engine keeps the velocity, with "
                        "--momentum as its factor; the wrapped SGD runs without momentum)")
    p.add_argument("--momentum-masking", type=float, nargs="?", const=1.0, default=None,
                   metavar="STRENGTH",
                   help="SGD with exchanged updates: remove this share of each rank's momentum "
                        "where it sent (alone: 1, DGC's masking, the buffer zeroed there; "
                        f"default: {MASKING_STRENGTH} wherever SGD with momentum exchanges "
                        "updates, see exchange_defaults)")
    p.add_argument("--no-momentum-masking", dest="momentum_masking", action="store_const",
                   const=0.0, help="leave the momentum alone where a rank sent")
    p.add_argument("--variance-correction", dest="variance_correction",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="Adam-family optimizers with exchanged updates: each rank steps on an "
                        "estimate of the full batch's second moment (default: the library's, "
                        "on there; hvd_sparse.variance_correction)")
    p.add_argument("--min-sparse-numel", type=int, default=1024,
                   help="tensors with fewer entries are exchanged dense")
    p.add_argument("--index-coding", default=None, choices=["auto", "plain", "golomb"],
                   help="positions on the wire (default: the library's, auto: Golomb-Rice per "
                        "bucket where the time cost model finds it pays)")
    p.add_argument("--exchange", default="auto", choices=["auto", "gradient", "update"],
                   help="what hvd_sparse sparsifies: gradients (Horovod's contract) or each "
                        "rank's optimizer update (auto: updates, except gradients for SGD with "
                        "--momentum-correction; see exchange_defaults)")
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N images")
    p.add_argument("--test-limit", type=int, default=0, help="score only the first N (0: all)")
    p.add_argument("--seed", type=int, default=0, help="model and data order")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--ranks", type=int, default=None,
                   help="start this many local ranks (when not already launched): under "
                        "horovodrun, or mpirun with --transport mpi, or torchrun with "
                        "--transport torch")
    p.add_argument("--benchmark-steps", type=int, default=0,
                   help="time this many steps (after 2 warm-up steps) instead of training")
    p.add_argument("--metrics", default=None, help="append per-epoch JSON lines here (rank 0)")
    p.add_argument("--tensorboard", default=None, help="write TensorBoard scalars here (rank 0)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar or progress lines (the epoch lines stay)")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module's docstring as written, and each option's default after its help where the
    help does not say it already (None: it depends on other options, which the help says)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text \
                and action.option_strings:
            text += " (default: %(default)s)"
        return text


def check_args(parser, args) -> None:
    """Values no run can use, refused before any data is read or rank started: one line
    (argparse's usage and error, exit status 2), where they failed deep inside a run, or ran
    no step at all and exited 0."""
    from .models import CHAR_MODELS, MODELS

    fits = MODELS if args.dataset == "fashion-mnist" else CHAR_MODELS
    if args.model is not None and args.model not in fits:
        parser.error(f"--model {args.model} does not fit --dataset {args.dataset}; choose "
                     f"from {', '.join(sorted(fits))}")
    for name in ("density", "downlink_density", "cooldown_density"):
        v = getattr(args, name)
        if v is not None and not 0.0 < v <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in (0, 1], got {v}")
    # (--epochs is not read when benchmarking, --steps-per-epoch only by the text sets,
    # --ranks 0 is one process as before)
    at_least = {"epochs": 0 if args.benchmark_steps else 1,
                "steps_per_epoch": 1 if args.dataset != "fashion-mnist" else None,
                "batch_size": 1, "seq_len": 1,
                "threads": 1, "ranks": 0, "benchmark_steps": 0, "warmup_steps": 0,
                "train_limit": 0, "test_limit": 0, "min_sparse_numel": 0,
                "dense_warmup_steps": 0, "density_warmup_steps": 0,
                "density_cooldown_steps": 0, "local_steps": 1}
    for name, low in at_least.items():
        v = getattr(args, name)
        if low is not None and v is not None and v < low:
            parser.error(f"--{name.replace('_', '-')} must be at least {low}, got {v}")
    for name in ("lr", "weight_decay", "momentum"):
        v = getattr(args, name)
        if v is not None and not v >= 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0, got {v}")
    if not 0.0 <= args.layer_floor <= 1.0:
        parser.error(f"--layer-floor must be in [0, 1], got {args.layer_floor}")
    if args.local_steps > 1:  # (weight changes go out, not gradients)
        if args.optimizer != "sparse":
            parser.error(f"--local-steps applies to --optimizer sparse, not "
                         f"--optimizer {args.optimizer}")
        if args.momentum_correction or args.sparsifier == "threshold":
            what = "--momentum-correction" if args.momentum_correction else \
                "--sparsifier threshold (its --threshold is chosen for gradients)"
            parser.error(f"--local-steps {args.local_steps} exchanges weight changes, which "
                         f"{what} does not take")
    folder = os.path.dirname(os.path.abspath(args.metrics)) if args.metrics else None
    if folder and not os.path.isdir(folder):  # (TensorBoard makes its own folders)
        parser.error(f"--metrics: the folder {folder} does not exist")
    if args.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            parser.error(f"--tensorboard needs the tensorboard package ({e}); "
                         "`pip install tensorboard`")


DEFAULTS = {"fashion-mnist": {"model": "cnn", "batch_size": 64, "lr": 0.05},
            "shakespeare": {"model": "lstm", "batch_size": 32, "lr": 0.5},
            "fortunes": {"model": "lstm", "batch_size": 32, "lr": 0.5}}
# learning rates that differ from the data set's: AdamW's from the convergence study's
# Transformer, the GRU's and the TCN's SGD rates from their dense runs on fortunes (900 steps,
# 2 ranks; GRU: 0.5 diverged, 0.3 beat 0.2 and 0.1; TCN: 0.2 diverged, 0.1 beat 0.05)
ADAMW_LR = 3e-3
# the share of SGD's momentum removed where a rank sent (exchange_defaults)
MASKING_STRENGTH = 0.5
SGD_LR_BY_MODEL = {"gru": 0.3, "tcn": 0.1}


def workload_defaults(args) -> None:
    """Fill the model, batch size and learning rate where not given."""
    for key, value in DEFAULTS[args.dataset].items():
        if key != "lr" and getattr(args, key) is None:
            setattr(args, key, value)
    if args.lr is None:
        args.lr = ADAMW_LR if args.base_optimizer == "adamw" else SGD_LR_BY_MODEL.get(
            args.model, DEFAULTS[args.dataset]["lr"])


def _launched() -> bool:
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_RANK", "PMI_SIZE",
                                         "PMIX_RANK", "HOROVOD_HOSTNAME", "TORCHELASTIC_RUN_ID"))


def _relaunch(args, argv):
    """``--ranks N`` outside a launcher: run this same command under horovodrun -np N (under
    torchrun with ``--transport torch``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cleaned, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--ranks":
            skip = True
            continue
        if a.startswith("--ranks="):
            continue
        cleaned.append(a)
    if args.transport == "mpi":  # no Horovod needed: Open MPI's own launcher
        runner = shutil.which("mpirun")
        if runner is None:
            raise SystemExit("--ranks with --transport mpi runs mpirun, which is not on PATH "
                             "(apt-get install openmpi-bin, or launch with your MPI's "
                             "launcher and leave --ranks out)")
        extra = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        cmd = [runner, *extra, "--oversubscribe", "--bind-to", "none", "-np", str(args.ranks),
               sys.executable, "-m", "hvd_sparse.train", *cleaned]
        os.execv(cmd[0], cmd)
    runner = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable),
                                                         "horovodrun")
    if args.transport != "torch" and not os.path.exists(runner):
        raise SystemExit(f"--ranks runs horovodrun, which is not at {runner} nor on PATH "
                         "(bash launch/setup.sh builds Horovod; or pass --transport mpi to "
                         "use mpirun, --transport torch for torchrun)")
    cmd = [runner, "-np", str(args.ranks), sys.executable, "-m", "hvd_sparse.train", *cleaned]
    if args.transport == "torch":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.ranks), "-m", "hvd_sparse.train", *cleaned]
    os.execv(cmd[0], cmd)


class _Local:
    """The no-communication floor: one rank, the plain optimizer."""

    Sum = Average = None

    @staticmethod
    def rank():
        return 0

    @staticmethod
    def size():
        return 1

    @staticmethod
    def allreduce(t, op=None, name=None):
        return t


def warmup_share(density: float, total_steps: int) -> int:
    """The density warm-up's length: 10% of the run at 1% density and above, 5% below.

    The warm-up's bytes hardly depend on the final density (its first steps are nearly dense),
    so at 0.1% a 10% warm-up alone sends about 3% of dense's bytes, the whole budget; 5% halves
    that at no loss measured (char-LSTM, 900 steps, 0.1%: 1.7928 with 5% against 1.8003 with
    10%, at 1.6% against 3.0% of dense's bytes)."""
    return max(1, total_steps // (10 if density >= 0.01 else 20))


def exchange_defaults(args, base) -> None:
    """Fill ``--exchange``, ``--bidirectional``, ``--density-warmup-steps``,
    ``--momentum-masking`` and ``--density-cooldown-steps`` where not given, from the
    convergence study (docs/results.md, "Convergence"); each stays overridable.

    * Adaptive optimizers (AdamW here; the library's ``exchange="auto"`` already exchanges their
      updates): no downlink re-sparsification (with the allgather every rank receives every
      payload anyway, so it saves no bytes, only adds delay) and DGC's density warm-up over the
      first 10% of the run (5% below 1% density: :func:`warmup_share`). Character
      Transformer, 300 steps, 3 seeds: +1.6% validation loss against dense at 6.7% of dense's
      bytes, against +4.0% without them.
    * SGD: each rank's update exchanged too (the library's own choice for SGD with momentum
      since the thirty-sixth session; here also without momentum and with SBC), with the same
      warm-up, without the downlink re-selection, and with the density cool-down over the last
      10% of the run. Updates against gradients: ResNet on Fashion-MNIST under cosine decay, 5
      seeds, -0.49 pt test accuracy against dense against -1.89. The cool-down (twenty-first
      session, 3 seeds each, 2 ranks): char-LSTM (900 steps) +3.9% against +4.3% without it,
      held-out GRU on fortune cookies +3.8% against +5.2%, ResNet -0.15 pt (5 seeds) against
      -0.25; ending at 20% rather than 10% (thirtieth session, the default below): GRU at 1%
      +1.8% against +2.2%, at 0.1% +4.7% against +5.4% (3 seeds each), LSTM +0.8 / +1.7%
      against +1.1 / +1.8%, TCN -0.4 / -0.2% against +0.5 / +0.4% (2 seeds), ResNet equal,
      for about 0.5% more of dense's bytes. Where SGD has momentum, DGC's momentum masking at half strength too (the
      momentum scaled by 0.5 where a rank sent, :data:`MASKING_STRENGTH`): full masking
      steadied runs at a model's best dense rate (GRU at 0.3: +3.4 / +3.2% against +2.3 /
      +15.2% without, the latter knocked off course early) but cost below it (GRU at 0.2:
      +6.0% against +3.7%); half was at or near the better of the two in every case measured
      (GRU +2.8 / +2.0% at 0.3, +3.9% at 0.2; LSTM +1.2 / +1.8% against +1.4 / +2.0% with full
      masking; ResNet -0.15 / -0.13 pt; docs/results.md "Convergence"). Where a gradient lever is
      asked for
      (``--momentum-correction``) gradients stay, with the downlink selection, and so they do
      for the hard threshold (its absolute ``--threshold`` is chosen from gradients).

    The warm-up and cool-down need the run's length, which only the run knows, so the library's
    own defaults stay 0."""
    from hvd_sparse.engine.config import adaptive_optimizer_classes, resolve_exchange

    sparse = args.optimizer == "sparse"
    adaptive = isinstance(base, adaptive_optimizer_classes())
    if sparse and args.exchange == "auto" and not adaptive:
        # (the hard threshold's absolute --threshold is chosen from gradients)
        args.exchange = "gradient" if args.momentum_correction \
            or args.sparsifier == "threshold" else "update"
    updates = sparse and resolve_exchange(
        args.exchange, base, 1, 1, args.density,
        momentum_correction=args.momentum if args.momentum_correction else 0.0,
        sparsifier=args.sparsifier) == "update"
    if args.bidirectional is None:
        args.bidirectional = not updates
    if args.density_warmup_steps is None:
        args.density_warmup_steps = warmup_share(args.density, args.total_steps) if updates else 0
    if args.momentum_masking is None:
        args.momentum_masking = MASKING_STRENGTH if updates and not adaptive and any(
            g.get("momentum", 0) for g in base.param_groups) else 0.0
    if args.density_cooldown_steps is None:
        args.density_cooldown_steps = max(1, args.total_steps // 10) \
            if updates and not adaptive else 0
    if args.scope is None:  # the library's default, named (it goes into the metrics)
        args.scope = resolve_scope("auto", args.density, args.sparsifier) if sparse \
            else "tensor"


def build_optimizer(args, model, base, hvd):
    if args.optimizer == "dense" and args.transport in ("torch", "mpi"):
        # no Horovod initialised: hvd_sparse at density 1, Horovod's allreduce step
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        density=1.0)
    if args.optimizer == "dense":
        import horovod.torch as real_hvd
        return real_hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    if args.optimizer == "local":
        return base
    extra = {}
    if args.sparsifier == "threshold":
        extra["threshold"] = args.threshold if args.threshold is not None else 1e-3
    extra["total_steps"] = max(1, args.total_steps)  # adaptive's budget, the cool-down's end
    extra["density_cooldown_steps"] = args.density_cooldown_steps
    extra["cooldown_density"] = args.cooldown_density
    extra["exchange"] = args.exchange
    extra["index_coding"] = args.index_coding
    extra["collective"] = args.collective
    extra["sharded_selection"] = args.sharded_selection
    extra["density_warmup_steps"] = args.density_warmup_steps
    extra["dense_warmup_steps"] = args.dense_warmup_steps
    if args.local_steps != 1:
        extra["local_steps"] = args.local_steps
    extra["min_sparse_numel"] = args.min_sparse_numel
    if args.layer_floor:
        extra["layer_floor"] = args.layer_floor
    if args.momentum_correction:
        extra["momentum_correction"] = args.momentum
    if args.momentum_masking:
        extra["momentum_masking"] = args.momentum_masking
    if args.variance_correction is not None:
        extra["variance_correction"] = args.variance_correction
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    sparsifier=args.sparsifier, density=args.density,
                                    bidirectional=args.bidirectional,
                                    downlink_density=args.downlink_density, scope=args.scope,
                                    deterministic_dense=args.deterministic_dense,
                                    cost_model=args.cost_model, transport=args.transport,
                                    **extra)


def main(argv=None):
    args = parse_args(argv)
    if args.ranks and not _launched() and args.optimizer != "local":
        _relaunch(args, argv)
    elif args.ranks and args.ranks > 1 and not _launched():
        print(f"hvd_sparse.train: --optimizer local runs one process; --ranks {args.ranks} is "
              "not used (for the floor at a rank count, start that many under a launcher)",
              file=sys.stderr, flush=True)
    if args.threshold is not None and args.sparsifier != "threshold":
        print(f"hvd_sparse.train: --threshold applies to --sparsifier threshold; with "
              f"--sparsifier {args.sparsifier} it is not used", file=sys.stderr, flush=True)
    if args.transport == "torch" and not args.ranks and "RANK" not in os.environ \
            and args.optimizer != "local":
        raise SystemExit("hvd_sparse.train: --transport torch needs --ranks N (relaunched "
                         "under torchrun --standalone) or a torchrun launch")
    workload_defaults(args)
    torch.set_num_threads(args.threads)
    from .workloads import WORKLOADS

    if args.optimizer == "local":
        hvd = _Local()
    elif args.transport == "mpi":
        import hvd_sparse.mpi as hvd
        hvd.init()
    elif args.transport == "torch":
        import hvd_sparse.torchdist as hvd
        hvd.init()
    else:
        if args.cycle_time_ms:
            os.environ.setdefault("HOROVOD_CYCLE_TIME", f"{args.cycle_time_ms:g}")
        import hvd_sparse as hvd
        hvd.init()
    rank, size = hvd.rank(), hvd.size()
    try:
        work = WORKLOADS[args.dataset](model=args.model, batch_size=args.batch_size,
                                       train_limit=args.train_limit, test_limit=args.test_limit,
                                       steps_per_epoch=args.steps_per_epoch, seed=args.seed,
                                       seq_len=args.seq_len)
    except FileNotFoundError as e:  # the data set is not installed: one line, every rank alike
        raise SystemExit(f"hvd_sparse.train: {e}") from None
    steps_per_epoch = work.steps_per_epoch(size)
    if steps_per_epoch < 1 and not args.benchmark_steps:  # every rank alike: all leave
        raise SystemExit(f"hvd_sparse.train: no full batch of {args.batch_size} per rank on "
                         f"{size} rank(s) in the training data (--train-limit "
                         f"{args.train_limit}): nothing to train")
    args.total_steps = steps_per_epoch * args.epochs
    torch.manual_seed(args.seed)
    model = work.model()
    if args.base_optimizer == "adamw":
        base = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        momentum = 0.0 if args.momentum_correction and args.optimizer == "sparse" \
            else args.momentum
        base = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=momentum)
    schedule = lr_schedule(args, base)
    exchange_defaults(args, base)
    try:
        opt = build_optimizer(args, model, base, hvd)
    except (ValueError, TypeError) as e:  # an option the library refuses: one line, every
        raise SystemExit(f"hvd_sparse.train: {e}") from None  # rank alike, no traceback
    if args.optimizer != "local":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"hvd_sparse.train: {args.model} ({n_params:,} parameters) on {args.dataset}, "
              f"{size} ranks, optimizer={args.optimizer}"
              + (f", {args.sparsifier} density={args.density}, bidirectional={args.bidirectional}"
                 if args.optimizer == "sparse" else ""), flush=True)
        if args.optimizer == "sparse" and getattr(opt, "_hs_passthrough", False):
            print("hvd_sparse.train: one process under Horovod: the wrapped optimizer steps on "
                  "its own gradient and nothing is exchanged or sparsified (as Horovod's "
                  "optimizer does); run with --ranks N or a launcher to exchange", flush=True)

    def one_step(epoch, step):
        x, y = work.batch(epoch, step, rank, size)
        opt.zero_grad()
        loss = work.loss(model(x), y)
        loss.backward()
        opt.step()
        if schedule is not None:
            schedule.step()
        return loss.item()

    if args.benchmark_steps:
        return _benchmark(args, one_step, rank, size, n_params, opt, steps_per_epoch)

    writer = None
    if args.tensorboard and rank == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise SystemExit(f"--tensorboard needs the tensorboard package ({e}); "
                             "`pip install tensorboard`") from e
        writer = SummaryWriter(args.tensorboard)
    show = rank == 0 and not args.no_progress
    start, steps, records = time.perf_counter(), 0, []
    eval_s = 0.0  # time spent evaluating, left out of train_s
    for epoch in range(args.epochs):
        bar = None
        # under a launcher stdout may be a pseudo-terminal, but carriage returns are held
        # back: a bar only in an interactive, unlaunched run
        if show and sys.stdout.isatty() and not _launched():
            from tqdm import tqdm
            bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch + 1}/{args.epochs}",
                       unit="step", file=sys.stdout, mininterval=1.0)
        running = 0.0
        for step in range(steps_per_epoch):
            loss = one_step(epoch, step)
            steps += 1
            running = 0.98 * running + 0.02 * loss if step else loss
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{running:.3f}", refresh=False)
            elif show and _progress_due(step, steps_per_epoch):
                # launchers hold back carriage returns: plain lines every 5% instead
                print(f"epoch {epoch + 1}/{args.epochs}: step {step + 1}/{steps_per_epoch}, "
                      f"loss {running:.3f}, {time.perf_counter() - start:.0f} s", flush=True)
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - start
        rec = {"epoch": epoch + 1, "steps": steps, "wall_s": round(wall, 3),
               "train_s": round(wall - eval_s, 3), "train_loss": round(running, 5),
               "ranks": size, "dataset": args.dataset, "model": args.model,
               "optimizer": args.optimizer}
        before = time.perf_counter()
        rec.update({k: round(v, 5) for k, v in work.evaluate(model, hvd).items()})
        eval_s += time.perf_counter() - before
        if args.optimizer == "sparse":
            s = opt.communication_stats()
            t = s["totals"]
            rec.update(sparsifier=args.sparsifier, density=args.density,
                       bidirectional=args.bidirectional, bytes_sent=t["bytes_sent"],
                       bytes_received=t["bytes_received"], dense_bytes=t["dense_bytes"],
                       achieved_density=round(t["selected"] / max(t["numel"], 1), 6),
                       compression_error=t["compression_error"])
        else:  # local, or one process: nothing goes anywhere
            exchanged = args.optimizer == "dense" and size > 1
            rec.update(bytes_sent=grad_bytes * steps if exchanged else 0,
                       dense_bytes=grad_bytes * steps)
        records.append(rec)
        if rank == 0:
            metric = {k: v for k, v in rec.items() if k.startswith(("test_", "valid_"))}
            saved = rec["dense_bytes"] / max(rec["bytes_sent"], 1)
            sent = (f", sent {rec['bytes_sent'] / 2**20:.2f} MiB vs dense "
                    f"{rec['dense_bytes'] / 2**20:.2f} MiB ({saved:.1f}x less)"
                    if rec["bytes_sent"] and rec["dense_bytes"] else ", nothing exchanged")
            print(f"epoch {epoch + 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in metric.items())
                  + f"{sent}, {rec['wall_s']:.1f} s", flush=True)
            if args.metrics:
                with open(args.metrics, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            if writer is not None:
                for k in ("train_loss", "bytes_sent", "achieved_density", "compression_error",
                          *metric):
                    if k in rec:
                        writer.add_scalar(k, rec[k], steps)
    if writer is not None:
        writer.close()
    if args.optimizer != "local":
        hvd.shutdown()
    if args.transport == "torch" and args.optimizer != "local" and os.environ.get(
            "TORCHELASTIC_RUN_ID") and __name__ == "__main__":
        # under torchrun, a rare SIGABRT at interpreter exit ("terminate called without an
        # active exception", after the group was destroyed and every result written) made
        # torchrun report the job failed: leave without the interpreter's finalization
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return records


def _progress_due(step: int, total: int, every: float = 0.05) -> bool:
    """True at the steps that complete another ``every`` of the epoch (and at its end)."""
    stride = max(1, int(total * every))
    return (step + 1) % stride == 0 or step + 1 == total


def lr_schedule(args, base):
    """The run's learning-rate schedule (None: constant): ``--lr-schedule``, where ``auto`` is
    cosine decay for AdamW (the Transformer study's recipe) and a constant rate for SGD."""
    cosine = args.lr_schedule == "cosine" or (args.lr_schedule == "auto"
                                              and args.base_optimizer == "adamw")
    return _schedule(base, args.warmup_steps, args.total_steps) if cosine else None


def _schedule(base, warmup: int, total: int):
    """Linear warm-up over ``warmup`` steps, then cosine decay to zero at ``total``."""
    import math

    def factor(step):
        if warmup and step < warmup:
            return (step + 1) / warmup
        span = max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / span)))
    return torch.optim.lr_scheduler.LambdaLR(base, factor)


def _benchmark(args, one_step, rank, size, n_params, opt, steps_per_epoch):
    """Median wall time per step over ``--benchmark-steps`` steps, after two warm-up steps;
    for hvd_sparse also the mean seconds per pipeline stage over the timed steps."""
    times, losses = [], []
    stages0 = None
    for step in range(args.benchmark_steps + 2):
        if step == 2 and args.optimizer == "sparse":
            stages0 = dict(opt.communication_stats()["totals"]["stage_seconds"])
        t = time.perf_counter()
        losses.append(  # the data set's batches in turn, into the next epoch: whole batches
            one_step(step // max(1, steps_per_epoch), step % max(1, steps_per_epoch)))
        times.append(time.perf_counter() - t)
    times = times[2:]
    rec = {"benchmark": True, "ranks": size, "dataset": args.dataset, "model": args.model,
           "parameters": n_params, "optimizer": args.optimizer, "sparsifier": args.sparsifier,
           "density": args.density, "bidirectional": args.bidirectional,
           "steps": len(times), "step_s_median": statistics.median(times),
           "step_s_all": times, "loss_all": losses[2:]}
    if args.optimizer == "sparse":
        s = opt.communication_stats()
        rec.update(bytes_sent_per_step=s["bytes_sent"], bytes_received_per_step=s["bytes_received"],
                   dense_bytes_per_step=s["dense_bytes"], cost_model=s["cost_model"],
                   downlink_selections=s["totals"]["downlink_selections"],
                   stage_s_mean={k: (v - stages0[k]) / len(times)
                                 for k, v in s["totals"]["stage_seconds"].items()})
    if rank == 0:
        print(json.dumps(rec), flush=True)
        if args.metrics:
            with open(args.metrics, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return [rec]


if __name__ == "__main__":
    if hasattr(sys.stdout, "reconfigure"):
        # one write per line: unbuffered (PYTHONUNBUFFERED, as launchers set it), print's
        # text and newline went out apart, and mpirun's --tag-output tagged the newline
        # ("... 1 s[1,0]<stdout>:"); only as a program, not for a caller of main()
        sys.stdout.reconfigure(write_through=False, line_buffering=True)
    main()
