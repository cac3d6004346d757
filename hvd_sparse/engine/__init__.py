"""The exchange engine: the per-bucket sparse pipeline every front end drives.

* :mod:`.config` - the typed, frozen configuration and its validation;
* :mod:`.state` - what is kept per bucket (residuals, velocity, anchor, cost choice);
* :mod:`.pipeline` - :class:`Engine`, the pipeline in data-flow order;
* :mod:`.calibration` - link timing and cross-rank agreement for the time-based cost model;
* :mod:`.stages` - where a step's time goes.
"""
from .config import EngineConfig, build_config
from .pipeline import BucketView, Engine

__all__ = ["Engine", "EngineConfig", "BucketView", "build_config"]
