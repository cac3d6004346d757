"""The optimizer's option values: wrong ones refused when it is built, naming the option (never
inside a step, never silently); NumPy and torch scalars taken as the numbers they hold,
everywhere, including the rules that pick the exchange and the scope."""
import math

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse.transport import LocalTransport


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _wrap(opt_cls=torch.optim.SGD, **kw):
    m = _model()
    base = opt_cls(m.parameters(), lr=0.1, **({"momentum": 0.9} if opt_cls is torch.optim.SGD
                                              else {}))
    kw.setdefault("min_sparse_numel", 0)
    return m, hvd_sparse.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                              transport=LocalTransport(), **kw)


@pytest.mark.parametrize("kw,match", [
    ({"gradient_predivide_factor": math.nan}, "gradient_predivide_factor"),
    ({"gradient_predivide_factor": math.inf}, "gradient_predivide_factor"),
    ({"track_error": "no"}, "track_error"),
    ({"check_config": "no"}, "check_config"),
    ({"deterministic_dense": 0.5}, "deterministic_dense"),
    ({"dense_fallback": "yes"}, "dense_fallback"),
    ({"local_clip_norm": True}, "local_clip_norm"),
    ({"local_clip_norm": -1.0}, "local_clip_norm"),
    ({"local_steps": "2"}, "local_steps"),
    ({"local_steps": None}, "local_steps"),
    ({"backward_passes_per_step": "2"}, "backward_passes_per_step"),
    ({"sparsifier_options": 5}, "sparsifier_options"),
    ({"sparsifier_options": "x"}, "sparsifier_options"),
    ({"sparsifier": "gaussiank", "sparsifier_options": {"slack": "2"}}, "slack"),
    ({"sparsifier": "gaussiank", "sparsifier_options": {"slack": math.nan}}, "slack"),
    ({"sparsifier": "gaussiank", "sparsifier_options": {"max_passes": math.inf}}, "max_passes"),
    ({"sparsifier": "randomk", "sparsifier_options": {"seed": "abc"}}, "seed"),
    ({"sparsifier": "randomk", "sparsifier_options": {"seed": 2.5}}, "seed"),  # not truncated
    ({"sparsifier": "threshold", "threshold": math.inf}, "threshold"),  # would select nothing
    ({"sparsifier": "threshold", "sparsifier_options": {"threshold": math.inf}}, "threshold"),
    ({"sparsifier": "threshold", "threshold": torch.tensor(math.inf)}, "threshold"),
    ({"sparsifier": "threshold", "threshold": math.nan}, "threshold"),
    ({"sparsifier": "adaptive", "min_density": 2}, "min_density"),
    ({"sparsifier": "adaptive", "min_density": -1, "max_density": 2}, "min_density"),
    ({"sparsifier": "adaptive", "max_density": math.nan}, "max_density"),
    ({"sparsifier": "adaptive", "min_density": 0.05, "max_density": 0.02}, "min_density"),
    ({"sparsifier": "adaptive", "min_density": 0.05}, "min_density <= density"),
    ({"sparsifier": "adaptive", "sparsifier_options": {"gamma": math.nan}}, "gamma"),
    ({"min_sparse_numel": 1024.5}, "min_sparse_numel"), ({"min_sparse_numel": -1}, "min_sp"),
    ({"max_bucket_numel": 0}, "max_bucket_numel"), ({"max_bucket_numel": True}, "max_bucket"),
    ({"scope": "layer"}, "'auto'"),  # (the default is named among the choices)
])
def test_a_wrong_value_is_refused_when_the_optimizer_is_built(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _wrap(**kw)


@pytest.mark.parametrize("kw", [
    {"momentum_correction": np.float32(0.9)}, {"layer_floor": np.float32(0.5)},
    {"local_clip_norm": np.float32(1.0)}, {"min_sparse_numel": np.int64(1024)},
    {"max_bucket_numel": np.int64(2048)}, {"bucket_cap_mb": np.float64(1.0)},
    {"backward_passes_per_step": np.int64(2)}, {"local_steps": np.int64(2)},
    {"gradient_predivide_factor": np.float32(2.0)}, {"track_error": np.True_},
    {"density": torch.tensor(0.05)},
    # what was taken before and stays taken: infinity as "no clipping", None as False,
    # whole floats, int-like seeds, a zero floor, options as pairs
    {"local_clip_norm": math.inf}, {"track_error": None}, {"dense_fallback": None},
    {"track_error": torch.tensor(True)},
    {"sparsifier": "gaussiank", "sparsifier_options": {"max_passes": 5.0}},
    {"sparsifier": "randomk", "sparsifier_options": {"seed": 3.0}},
    {"sparsifier": "randomk", "sparsifier_options": [("seed", 3)]},
    {"sparsifier": "adaptive", "min_density": 0.0, "total_steps": 10},
    # whole floats for the bucket sizes too (refused before, unlike every other int option)
    {"min_sparse_numel": 1024.0}, {"max_bucket_numel": 4096.0},
])
def test_numpy_and_torch_scalars_are_taken_as_their_numbers(kw):
    m, opt = _wrap(**kw)
    before = [p.detach().clone() for p in m.parameters()]
    for _ in range(2):
        opt.zero_grad()
        m(torch.randn(8, 64)).pow(2).sum().backward()
        opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, m.parameters()))


@pytest.mark.parametrize("density", [np.float32(1.0), torch.tensor(1.0)])
def test_a_scalar_density_of_one_is_horovods_step_for_adam(density):
    """exchange="auto" gives gradients at density 1 (Horovod's step, bit for bit): it read
    the raw value, so a NumPy float32 or a tensor fell through to exchanged updates."""
    _, opt = _wrap(torch.optim.Adam, density=density)
    assert opt.communication_stats()["exchange"] == "gradient"


@pytest.mark.usefixtures("one_bucket_per_tensor")
def test_a_scalar_density_picks_the_same_scope_as_the_float():
    names = [list(_wrap(density=d)[1].engine_state())
             for d in (0.001, np.float32(0.001), np.float32(0.05))]
    assert names[0] == names[1] and len(names[0]) == 1  # one global Top-K below 1%
    assert len(names[2]) == 4  # one per tensor from 1% up
