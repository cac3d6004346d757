"""Train a model on real data with hvd_sparse (or dense Horovod as the control).

    horovodrun -np 2 .venv/bin/python -m hvd_sparse.train --model cnn --density 0.01 --epochs 2

Rank 0 shows a progress bar and prints, per epoch, test accuracy and the bytes this rank sent
against what dense allreduce would have moved; ``--metrics FILE`` appends the same as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hvd_sparse.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn", choices=["cnn", "resnet"])
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist"])
    p.add_argument("--optimizer", default="sparse", choices=["sparse", "dense"],
                   help="sparse: hvd_sparse.DistributedOptimizer; dense: Horovod's own (control)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--downlink-density", type=float, default=None)
    p.add_argument("--bidirectional", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scope", default="tensor", choices=["tensor", "model", "bucket"])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N training images")
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--metrics", default=None, help="append per-epoch JSON lines here (rank 0)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def evaluate(model, x, y, hvd, batch=1000):
    """Accuracy and loss over the whole test set, each rank scoring its share."""
    model.eval()
    rank, size = hvd.rank(), hvd.size()
    idx = torch.arange(rank, x.shape[0], size)
    correct = torch.zeros(1, dtype=torch.float64)
    loss = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for s in range(0, idx.numel(), batch):
            b = idx[s:s + batch]
            out = model(x[b])
            correct += (out.argmax(1) == y[b]).sum().item()
            loss += F.cross_entropy(out, y[b], reduction="sum").item()
    both = hvd.allreduce(torch.cat([correct, loss]), op=hvd.Sum, name="eval.sum")
    model.train()
    return float(both[0] / x.shape[0]), float(both[1] / x.shape[0])


def main(argv=None):
    args = parse_args(argv)
    import hvd_sparse as hvd
    from .data import fashion_mnist, shard_indices
    from .models import MODELS

    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train = fashion_mnist("train")
    x_test, y_test = fashion_mnist("test")
    if args.train_limit:
        x_train, y_train = x_train[:args.train_limit], y_train[:args.train_limit]
    if args.test_limit:
        x_test, y_test = x_test[:args.test_limit], y_test[:args.test_limit]

    torch.manual_seed(args.seed)
    model = MODELS[args.model]()
    base = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=args.momentum)
    if args.optimizer == "sparse":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       density=args.density, bidirectional=args.bidirectional,
                                       downlink_density=args.downlink_density, scope=args.scope)
    else:
        import horovod.torch as real_hvd
        opt = real_hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    n_params = sum(p.numel() for p in model.parameters())

    show = rank == 0 and not args.no_progress
    if rank == 0:
        print(f"hvd_sparse.train: {args.model} ({n_params:,} parameters) on {args.dataset}, "
              f"{size} ranks, optimizer={args.optimizer}"
              + (f", density={args.density}, bidirectional={args.bidirectional}"
                 if args.optimizer == "sparse" else ""), flush=True)
    start = time.perf_counter()
    steps = 0
    records = []
    for epoch in range(args.epochs):
        idx = shard_indices(x_train.shape[0], rank, size, epoch, args.seed)
        n_batches = idx.numel() // args.batch_size
        bar = None
        if show:
            from tqdm import tqdm
            bar = tqdm(total=n_batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step",
                       file=sys.stdout, leave=True, mininterval=1.0)
        running = 0.0
        for b in range(n_batches):
            sel = idx[b * args.batch_size:(b + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[sel]), y_train[sel])
            loss.backward()
            opt.step()
            steps += 1
            running = 0.98 * running + 0.02 * loss.item() if b else loss.item()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{running:.3f}", refresh=False)
        if bar is not None:
            bar.close()
        acc, test_loss = evaluate(model, x_test, y_test, hvd)
        rec = {"epoch": epoch + 1, "steps": steps, "wall_s": round(time.perf_counter() - start, 3),
               "train_loss": round(running, 5), "test_loss": round(test_loss, 5),
               "test_accuracy": round(acc, 5), "ranks": size, "model": args.model,
               "optimizer": args.optimizer}
        if args.optimizer == "sparse":
            s = opt.communication_stats()["totals"]
            rec.update(density=args.density, bidirectional=args.bidirectional,
                       bytes_sent=s["bytes_sent"], bytes_received=s["bytes_received"],
                       dense_bytes=s["dense_bytes"],
                       achieved_density=round(s["selected"] / max(s["numel"], 1), 6))
        else:
            rec.update(bytes_sent=grad_bytes * steps, dense_bytes=grad_bytes * steps)
        records.append(rec)
        if rank == 0:
            saved = rec["dense_bytes"] / max(rec["bytes_sent"], 1)
            print(f"epoch {epoch + 1}: test accuracy {acc:.4f}, test loss {test_loss:.4f}, "
                  f"sent {rec['bytes_sent'] / 2**20:.2f} MiB vs dense {rec['dense_bytes'] / 2**20:.2f}"
                  f" MiB ({saved:.1f}x less), {rec['wall_s']:.1f} s", flush=True)
            if args.metrics:
                with open(args.metrics, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    hvd.shutdown()
    return records


if __name__ == "__main__":
    main()
