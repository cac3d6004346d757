"""The engine's typed, frozen configuration, built and validated from the optimizer's keywords.

Everything here must agree across ranks (it is part of the configuration digest compared before
the first exchange). ``set_backward_passes_per_step`` replaces the object rather than mutating it.
"""
from __future__ import annotations

import copy
import inspect
import math
import warnings
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from .. import validate, wire
from ..compat import Compression
from ..sparsifiers import HardThreshold, SparseBinary, Sparsifier, canonical, make_sparsifier

COST_MODELS = ("time", "bytes", "off")
COLLECTIVES = ("allgather", "sharded", "auto")
SHARDED_SELECTIONS = ("global", "region")
EXCHANGES = ("auto", "gradient", "update")


def adaptive_optimizer_classes() -> tuple:
    """torch's optimizers that scale each coordinate by its own gradient history."""
    names = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
             "Adafactor", "SparseAdam")
    return tuple(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n))


def resolve_exchange(exchange: str, optimizer, backward_passes_per_step: int,
                     local_steps: int, density: float = 0.01, op=None,
                     momentum_correction: float = 0.0, sparsifier="topk",
                     momentum_masking: float = 0.0) -> str:
    """``"auto"``: exchange each rank's *update* for adaptive optimizers (Adam, AdamW, RMSprop,
    ...), whose per-coordinate normalisation shrinks the rare, accumulated steps a sparse
    gradient gives them, and for SGD with momentum, whose velocity then integrates each rank's
    dense gradient instead of the sparse average (DGC's momentum correction, arrived at by
    another road): updates beat gradients on every SGD workload measured (ResNet -0.43
    against -1.71 pt, char-LSTM +7.0 against +9.2%, a BatchNorm CNN no default was tuned
    on -1.5 against -4.0 pt, a GRU classifier level; benchmarks/convergence.py and
    benchmarks/unseen_models.py, docs/results.md). Gradients otherwise: for SGD with SBC
    (one mean per sign; its own update form is the communication delay, ``local_steps``,
    and every step's update binarized trained worse at 3 ranks in the digits test) or the
    hard threshold (its absolute ``threshold`` is chosen from gradients, as
    ``threshold_for_k`` does: against weight changes it would send another count), plain
    SGD (nothing to gain) and optimizers of unknown kind (Horovod's contract on ``p.grad``);
    also with gradient accumulation, with ``momentum_correction`` (which acts on gradients),
    where nothing is sparsified (``density`` 1: Horovod's own step, bit for bit) and under
    ``op=Sum`` (a sum of gradients, which an adaptive step normalises; a sum of updates
    would be P of them). ``momentum_masking`` asks for updates (it masks the velocity where
    a rank's update was sent), with accumulation too."""
    if exchange != "auto":
        return exchange
    if local_steps > 1 or momentum_correction \
            or (backward_passes_per_step > 1 and not momentum_masking):
        return "gradient"
    from .. import compat

    if (isinstance(density, (int, float)) and density >= 1) \
            or (op is not None and op != compat.Average):
        return "gradient"
    if isinstance(optimizer, adaptive_optimizer_classes()):
        return "update"
    return "update" if sgd_with_momentum(optimizer) and not _reads_gradients(sparsifier) \
        else "gradient"


def sgd_with_momentum(optimizer) -> bool:
    """torch's SGD (or a subclass) with momentum in any parameter group."""
    return isinstance(optimizer, torch.optim.SGD) and any(
        g.get("momentum", 0) for g in optimizer.param_groups)


def _reads_gradients(sparsifier) -> bool:
    """Is the ``sparsifier=`` keyword (a name or an instance) one whose SGD form keeps the
    gradient exchange: Sparse Binary Compression or the hard threshold?"""
    return isinstance(sparsifier, (SparseBinary, HardThreshold)) \
        or canonical(sparsifier) in ("sbc", "threshold")


NONFINITE = ("propagate", "raise", "skip", "ignore")
#: the position codes on the wire, and "auto": per bucket, the time cost model's choice
INDEX_CODINGS = wire.INDEX_CODINGS + ("auto",)


@dataclass(frozen=True)
class EngineConfig:
    density: float = 0.01
    downlink_density: float = 0.01
    bidirectional: bool = True
    sparsifier: Sparsifier = None
    downlink_sparsifier: Sparsifier = None
    average: bool = True
    predivide: float = 1.0
    compression: Any = Compression.none
    sparse_as_dense: bool = False
    backward_passes_per_step: int = 1
    index_coding: str = "plain"
    momentum_correction: float = 0.0
    local_clip_norm: Optional[float] = None
    density_warmup_steps: int = 0
    total_steps: Optional[int] = None  # the run's length in optimizer steps, where known
    density_cooldown_steps: int = 0  # the last steps of total_steps, density rising ...
    cooldown_density: float = 0.2  # ... geometrically to this (dgc.cooldown_density)
    dense_warmup_steps: int = 0
    local_steps: int = 1
    exchange: str = "gradient"  # or "update": each rank's optimizer step is what is exchanged
    # ("auto" is resolved from the wrapped optimizer before the configuration is built)
    track_error: bool = True
    deterministic_dense: bool = True
    cost_model: str = "time"
    calibration_steps: int = 3
    recalibrate_every: int = 0
    value_dtype: Optional[torch.dtype] = None
    nonfinite: str = "propagate"
    verify_every: int = 0
    check_config: bool = True
    collective: str = "auto"  # per bucket; or "allgather", or "sharded" (engine/sharded.py)
    sharded_selection: str = "global"  # Top-K downlink of a sharded bucket: one threshold
    # for the whole bucket (a histogram allreduce), or "region": each owner its own top
    rebalance_every: int = 100  # sharded: steps between checks of the regions' load (0: never)
    # a bucket of several tensors: the share of each tensor's own Top-K it keeps before the
    # rest of the bucket's budget goes to the largest entries anywhere (0: one global Top-K)
    layer_floor: float = 0.0
    # exchanged updates: the share of this rank's momentum buffer removed where it sent (1:
    # zeroed, DGC's masking; 0: left alone)
    momentum_masking: float = 0.0
    # exchanged updates of an Adam-family optimizer: each rank's step uses an estimate of the
    # full batch's second moment (hvd_sparse.variance_correction), not its own batch's
    variance_correction: bool = False

    def describe(self) -> dict:
        """The options as plain values, for the cross-rank configuration digest."""
        out = {}
        for f in fields(self):
            if f.name == "compression":
                continue
            v = getattr(self, f.name)
            out[f.name] = v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
        return out

    @property
    def exchanges_updates(self) -> bool:
        """Weight updates (after a local optimizer step) are exchanged from ``step()``, not
        gradients from the backward hooks: ``exchange="update"`` or ``local_steps > 1``."""
        return self.exchange == "update" or self.local_steps > 1


def passes_per_step(value) -> int:
    """``backward_passes_per_step`` as an int: a positive whole number (``2.0`` too, which
    Horovod takes)."""
    value = validate.plain_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value != int(value) or value < 1:
        # Horovod's words first ("must be > 0"), for code that matches them
        raise ValueError(f"backward_passes_per_step must be > 0 and a positive whole number, "
                         f"got {value!r}")
    return int(value)


_plain_number = validate.plain_number


def _density(name, value):
    value = _plain_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


_nonneg_int = validate.whole


def _takes(sparsifier, keyword) -> bool:
    """Does the method named ``sparsifier`` take ``keyword`` (an instance is configured
    already)?"""
    from ..sparsifiers import SPARSIFIERS, canonical

    cls = SPARSIFIERS.get(canonical(sparsifier)) if isinstance(sparsifier, str) else None
    return cls is not None and keyword in inspect.signature(cls.__init__).parameters


def _compressor(compression):
    if compression is None:
        return Compression.none
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression={compression!r} has no compress/decompress; pass one of "
                        "hvd.Compression.none or hvd.Compression.fp16 or a Compressor class")
    return compression


def masking_strength(value) -> float:
    """``momentum_masking`` as the share of the momentum removed where a rank sent: True is
    1.0 (DGC's masking), False 0.0, a number in [0, 1] itself."""
    value = _plain_number(value)
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if not isinstance(value, (int, float)):
        raise TypeError(f"momentum_masking must be a bool or a number in [0, 1], got {value!r}")
    if not 0.0 <= float(value) <= 1.0:  # (NaN too)
        raise ValueError(f"momentum_masking must be in [0, 1], got {value!r}")
    return float(value)


def build_config(*, op, gradient_predivide_factor, backward_passes_per_step, compression,
                 sparse_as_dense, density, bidirectional, downlink_density, sparsifier,
                 threshold, total_steps, min_density, max_density, sparsifier_options,
                 index_coding, momentum_correction, local_clip_norm, density_warmup_steps,
                 dense_warmup_steps, local_steps, density_cooldown_steps=0,
                 cooldown_density=0.2, track_error, exchange, deterministic_dense,
                 dense_fallback, cost_model, calibration_steps, recalibrate_every, value_dtype,
                 nonfinite, verify_every, check_config, collective="auto",
                 sharded_selection="global", rebalance_every=100,
                 layer_floor=0.0, momentum_masking=False,
                 variance_correction=False) -> EngineConfig:
    """Validate the keywords of :func:`hvd_sparse.DistributedOptimizer` (clear errors naming
    the keyword) and freeze them."""
    from .. import compat

    density = _density("density", density)
    downlink_density = density if downlink_density is None else _density(
        "downlink_density", downlink_density)
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional must be True or False, got {bidirectional!r}")
    if not bidirectional and downlink_density != density:
        warnings.warn(f"downlink_density={downlink_density!r} has no effect: there is no "
                      "downlink selection (bidirectional=False, the default where weight "
                      "updates are exchanged); pass bidirectional=True for one", UserWarning,
                      stacklevel=3)
    op = compat.Average if op is None else op
    if op == compat.Adasum:
        raise ValueError("op=Adasum is not supported by hvd_sparse.DistributedOptimizer: Adasum "
                         "combines whole gradients pairwise and has no sparse form; use "
                         "op=hvd.Average or op=hvd.Sum, or horovod.torch.DistributedOptimizer")
    if op != compat.Average and op != compat.Sum:
        raise ValueError(f"op={op!r} is not supported; use hvd.Average or hvd.Sum")
    average = op == compat.Average
    gradient_predivide_factor = _plain_number(gradient_predivide_factor)
    if isinstance(gradient_predivide_factor, bool) or not isinstance(
            gradient_predivide_factor, (int, float)) or not gradient_predivide_factor > 0 \
            or not math.isfinite(gradient_predivide_factor):
        raise ValueError("gradient_predivide_factor must be a positive number, "
                         f"got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and not average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    backward_passes_per_step = passes_per_step(backward_passes_per_step)
    if sparse_as_dense not in (True, False):  # (1 and 0 too, as Horovod takes them)
        raise TypeError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")
    sparse_as_dense = bool(sparse_as_dense)
    if total_steps is not None:
        total_steps = _nonneg_int("total_steps", total_steps, 1)
    density_cooldown_steps = _nonneg_int("density_cooldown_steps", density_cooldown_steps)
    cooldown_density = _density("cooldown_density", cooldown_density)
    if density_cooldown_steps and total_steps is None:
        raise ValueError("density_cooldown_steps needs total_steps, the run's length in "
                         "optimizer steps: the cool-down takes the last density_cooldown_steps "
                         "of it")
    try:  # a dict, or what dict() takes (pairs)
        method_options = dict(sparsifier_options or {})
    except (TypeError, ValueError):
        raise TypeError("sparsifier_options must be a dict of the method's keywords, got "
                        f"{sparsifier_options!r}") from None
    for key, value in (("threshold", threshold), ("min_density", min_density),
                       ("max_density", max_density)):
        if value is not None:
            method_options[key] = value
    if total_steps is not None and _takes(sparsifier, "total_steps"):
        # adaptive plans its budget over the run's exchanges, the selections it makes: one per
        # local_steps optimizer steps, none in a dense warm-up (counted in optimizer steps,
        # its budget went unplanned, most of it under SBC's communication delay)
        exchanges = total_steps
        if all(isinstance(v, int) and not isinstance(v, bool)  # else errors below
               for v in (total_steps, dense_warmup_steps, local_steps)) and local_steps > 0:
            sparse_steps = max(1, total_steps - max(0, dense_warmup_steps))
            exchanges = -(-sparse_steps // local_steps)
        method_options["total_steps"] = exchanges
    up = make_sparsifier(sparsifier, **method_options)
    floor, ceiling = getattr(up, "min_density", None), getattr(up, "max_density", None)
    if (floor is not None and floor > density) or (ceiling is not None and ceiling < density):
        # (adaptive Top-K: the floor alone would overspend the budget; found here, not in
        # the first step)
        raise ValueError(f"adaptive Top-K needs min_density <= density <= max_density, got "
                         f"{floor!r}, {density!r}, {ceiling!r}")
    # The downlink gets its own instance: a stateful method keeps separate state per direction.
    down = copy.deepcopy(up)
    if index_coding is None:
        index_coding = "golomb" if up.constant_value else "auto"
    if index_coding not in INDEX_CODINGS:
        raise ValueError(f"index_coding must be one of {INDEX_CODINGS}, got {index_coding!r}")
    momentum_correction = _plain_number(momentum_correction)
    if isinstance(momentum_correction, bool) or not isinstance(momentum_correction, (int, float)) \
            or not 0.0 <= momentum_correction < 1.0:
        raise ValueError(f"momentum_correction must be in [0, 1), got {momentum_correction!r}")
    if local_clip_norm is not None:
        local_clip_norm = _plain_number(local_clip_norm)
        if isinstance(local_clip_norm, bool) or not isinstance(local_clip_norm, (int, float)) \
                or not local_clip_norm > 0:
            raise ValueError(f"local_clip_norm must be a positive number (or None), "
                             f"got {local_clip_norm!r}")
        # infinity: no clipping (torch's clip_grad_norm_ idiom), so none is done
        local_clip_norm = None if local_clip_norm == math.inf else float(local_clip_norm)
    density_warmup_steps = _nonneg_int("density_warmup_steps", density_warmup_steps)
    dense_warmup_steps = _nonneg_int("dense_warmup_steps", dense_warmup_steps)
    local_steps = _nonneg_int("local_steps", local_steps, 1)
    if value_dtype is not None and value_dtype not in (torch.float16, torch.bfloat16,
                                                       torch.float32, torch.float64):
        raise ValueError(f"value_dtype must be a floating torch dtype, got {value_dtype!r}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE))}, "
                         f"got {nonfinite!r}")
    verify_every = _nonneg_int("verify_every", verify_every)
    if exchange not in EXCHANGES or exchange == "auto":
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    momentum_masking = masking_strength(momentum_masking)
    if momentum_masking and not (local_steps > 1 or exchange == "update"):
        raise ValueError("momentum_masking applies where weight updates are exchanged "
                         "(exchange='update' or local_steps > 1); where gradients are, "
                         "momentum_correction masks its own velocity")
    if cost_model not in COST_MODELS:
        raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
    if not validate.flag("dense_fallback", dense_fallback):
        cost_model = "off"
    calibration_steps = _nonneg_int("calibration_steps", calibration_steps, 1)
    recalibrate_every = _nonneg_int("recalibrate_every", recalibrate_every)
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    if sharded_selection not in SHARDED_SELECTIONS:
        raise ValueError(f"sharded_selection must be one of {SHARDED_SELECTIONS}, "
                         f"got {sharded_selection!r}")
    rebalance_every = _nonneg_int("rebalance_every", rebalance_every)
    layer_floor = _plain_number(layer_floor)
    if isinstance(layer_floor, bool) or not isinstance(layer_floor, (int, float)) \
            or not 0.0 <= layer_floor <= 1.0:
        raise ValueError(f"layer_floor must be a number in [0, 1], got {layer_floor!r}")
    if layer_floor > 0 and not (up.supports_layer_floor and down.supports_layer_floor):
        raise ValueError(f"layer_floor={layer_floor!r} needs a method that keeps a per-tensor "
                         f"floor (Top-K); {up!r} does not")
    return EngineConfig(
        density=density, downlink_density=downlink_density, bidirectional=bidirectional,
        sparsifier=up, downlink_sparsifier=down, average=average,
        predivide=float(gradient_predivide_factor), compression=_compressor(compression),
        sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step,
        index_coding=index_coding, momentum_correction=float(momentum_correction),
        local_clip_norm=local_clip_norm, density_warmup_steps=density_warmup_steps,
        total_steps=total_steps, density_cooldown_steps=density_cooldown_steps,
        cooldown_density=cooldown_density, dense_warmup_steps=dense_warmup_steps,
        local_steps=local_steps, exchange=exchange,
        track_error=validate.flag("track_error", track_error),
        deterministic_dense=validate.flag("deterministic_dense", deterministic_dense),
        cost_model=cost_model, calibration_steps=calibration_steps,
        recalibrate_every=recalibrate_every, value_dtype=value_dtype, nonfinite=nonfinite,
        verify_every=verify_every, check_config=validate.flag("check_config", check_config),
        collective=collective,
        sharded_selection=sharded_selection, rebalance_every=rebalance_every,
        layer_floor=float(layer_floor), momentum_masking=momentum_masking,
        variance_correction=validate.flag("variance_correction", variance_correction))
