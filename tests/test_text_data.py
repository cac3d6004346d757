"""The text corpora and character models of the training CLI, on small files made here."""
from __future__ import annotations

import os

import pytest
import torch

from hvd_sparse.train import data
from hvd_sparse.train.models import CHAR_MODELS
from hvd_sparse.train.workloads import WORKLOADS


@pytest.fixture
def cookie_dir(tmp_path, monkeypatch):
    """A fortune folder as Debian lays it out: texts, ``.dat`` indexes, ``.u8`` links."""
    (tmp_path / "b-file").write_text("beta one\n%\nbeta two\n\t-- someone\n%\nbeta three\n")
    (tmp_path / "a-file").write_text("".join(f"alpha {i}\n%\n" for i in range(40)))
    (tmp_path / "a-file.dat").write_bytes(b"\x00\x01\x02DAT")
    os.symlink("a-file", tmp_path / "a-file.u8")
    monkeypatch.setattr(data, "FORTUNES_DIRS", ["", str(tmp_path)])
    return tmp_path


def test_fortunes_reads_each_cookie_once_in_file_order(cookie_dir):
    cookies = data.fortunes_text()
    assert cookies == [f"alpha {i}" for i in range(40)] + [
        "beta one", "beta two\n\t-- someone", "beta three"]


def test_fortunes_holds_out_every_twentieth_cookie(cookie_dir):
    train, valid, vocab = data.fortunes(valid_every=20)
    text = lambda ids: "".join(vocab[i] for i in ids.tolist())
    assert text(valid) == "alpha 19\n%\nalpha 39"
    assert "alpha 19" not in text(train) and "beta three" in text(train)
    assert vocab == sorted(set(vocab)) and "D" not in vocab  # the .dat index is not text


def test_fortunes_missing_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "FORTUNES_DIRS", ["", str(tmp_path / "absent")])
    with pytest.raises(FileNotFoundError, match="apt-get install fortunes"):
        data.fortunes_text()


def test_char_ids_share_one_vocabulary():
    train, valid, vocab = data.char_ids("abca", "cd")
    assert vocab == ["a", "b", "c", "d"]
    assert train.tolist() == [0, 1, 2, 0] and valid.tolist() == [2, 3]


@pytest.mark.parametrize("name", sorted(CHAR_MODELS))
def test_character_models_predict_every_position(name):
    torch.manual_seed(0)
    model = CHAR_MODELS[name](30)
    out = model(torch.randint(0, 30, (3, 17)))
    assert out.shape == (3, 17, 30) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(CHAR_MODELS))
def test_character_models_see_no_later_character(name):
    """A language model's prediction at position t depends on characters up to t only."""
    torch.manual_seed(0)
    model = CHAR_MODELS[name](30).eval()
    x = torch.randint(0, 30, (2, 40))
    later = x.clone()
    later[:, 25:] = (later[:, 25:] + 1) % 30
    with torch.no_grad():
        a, b = model(x), model(later)
    assert torch.allclose(a[:, :25], b[:, :25], atol=1e-6)
    assert not torch.allclose(a[:, 25:], b[:, 25:])


def test_fortunes_workload_trains_a_gru_on_its_windows(cookie_dir):
    work = WORKLOADS["fortunes"](model="gru", batch_size=4, seq_len=8, valid_windows=2)
    x, y = work.batch(0, 3, 1, 2)
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    assert type(work.model()).__name__ == "CharGRU"
    with pytest.raises(ValueError, match="choose from"):
        WORKLOADS["fortunes"](model="resnet")
