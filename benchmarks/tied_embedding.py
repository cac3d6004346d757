"""Is a tied embedding's loss rising under Top-K 1% the library's doing or the method's?

A small language model whose output layer shares the embedding's weight, trained by SGD with a
high rate and momentum, rises in loss at 1% with hvd_sparse (2 ranks) where Horovod's falls.
This simulates error-feedback Top-K without hvd_sparse or any collective: two ranks' batches,
their gradients averaged, each tensor's Top-K of (average + residual) applied and the rest kept,
SGD on what was applied. Same model and batches with the weights tied and untied, dense and
sparse. One process, seconds.

    .venv/bin/python benchmarks/tied_embedding.py

Results: benchmarks/results/tied_embedding.json (the two ranks' mean loss at every step) and
tied_embedding.png.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

from common import RESULTS, machine, save

VOCAB, WIDTH, STEPS = 500, 64, 30


class TinyLM(nn.Module):
    """Embedding, one tanh layer applied twice, a head that may share the embedding."""

    def __init__(self, tied):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blk = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.blk(torch.tanh(self.blk(self.emb(x)))))
        return self.head(h)


def run(tied, density, lr=0.5, momentum=0.9, ranks=2):
    torch.manual_seed(0)
    m = TinyLM(tied)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(ranks)]
    residual = {p: torch.zeros_like(p) for p in m.parameters()}
    losses = {}
    for step in range(STEPS):
        avg = {p: torch.zeros_like(p) for p in m.parameters()}
        mean_loss = 0.0
        for g in gens:
            x = torch.randint(0, VOCAB, (16, 8), generator=g)
            y = (x * 7 + 3) % VOCAB
            m.zero_grad()
            loss = nn.functional.cross_entropy(m(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            mean_loss += loss.item() / ranks
            for p in m.parameters():
                avg[p] += p.grad / ranks
        for p in m.parameters():
            acc = (residual[p] + avg[p]).reshape(-1)
            k = acc.numel() if density >= 1 or acc.numel() < 1024 \
                else max(1, int(density * acc.numel()))
            idx = acc.abs().topk(k).indices
            sent = torch.zeros_like(acc)
            sent[idx] = acc[idx]
            residual[p] = (acc - sent).view_as(p)
            p.grad = sent.view_as(p)
        opt.step()
        losses[step] = mean_loss
    return losses


def main():
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    rows = []
    for tied in (True, False):
        for density in (1.0, 0.01):
            losses = run(tied, density)
            rows.append({"tied": tied, "density": density, "loss": losses})
            print(f"tied={tied!s:5} density={density:<5} "
                  + "  ".join(f"{s}: {losses[s]:.2f}" for s in (0, 10, 20, STEPS - 1)),
                  flush=True)
    save("tied_embedding", {"machine": machine(), "lr": 0.5, "momentum": 0.9, "ranks": 2,
                            "steps": STEPS, "rows": rows})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.plot(list(r["loss"]), list(r["loss"].values()),
                ("-" if r["tied"] else "--") + ("k" if r["density"] >= 1 else "r"),
                label=f"{'tied' if r['tied'] else 'untied'}, "
                      f"{'dense' if r['density'] >= 1 else 'Top-K 1% + error feedback'}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean of 2 ranks)")
    ax.set_title("SGD lr 0.5, momentum 0.9, no hvd_sparse (simulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "tied_embedding.png", dpi=120)


if __name__ == "__main__":
    main()
