"""Real data sets available offline, loaded without any download at run time."""
from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch

FASHION_MNIST_DIRS = [os.environ.get("FASHION_MNIST_DIR", ""), "/usr/share/datasets/fashion-mnist"]


def _read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST family's format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(name: str) -> Path:
    for d in FASHION_MNIST_DIRS:
        if not d:
            continue
        for cand in (Path(d) / name, Path(d) / (name + ".gz")):
            if cand.exists():
                return cand
    raise FileNotFoundError(
        f"Fashion-MNIST file {name} not found in {[d for d in FASHION_MNIST_DIRS if d]}; "
        "install it with `apt-get install dataset-fashion-mnist` (launch/setup.sh does) "
        "or set FASHION_MNIST_DIR")


def fashion_mnist(split: str = "train"):
    """Fashion-MNIST as normalised float tensors (N, 1, 28, 28) and int64 labels."""
    prefix = "train" if split == "train" else "t10k"
    x = _read_idx(_find(f"{prefix}-images-idx3-ubyte"))
    y = _read_idx(_find(f"{prefix}-labels-idx1-ubyte"))
    x = torch.from_numpy(x.astype(np.float32) / 255.0).sub_(0.2860).div_(0.3530).unsqueeze(1)
    return x, torch.from_numpy(y.astype(np.int64))


def shard_indices(n: int, rank: int, size: int, epoch: int, seed: int = 0) -> torch.Tensor:
    """This rank's slice of an epoch's permutation (same permutation on every rank)."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    perm = torch.randperm(n, generator=g)
    per_rank = n // size
    return perm[rank * per_rank:(rank + 1) * per_rank]
