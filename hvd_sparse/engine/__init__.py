"""The exchange engine: the per-bucket sparse pipeline every front end drives.

* :mod:`.config` - the typed, frozen configuration and its validation;
* :mod:`.state` - what is kept per bucket (residuals, velocity, anchor, cost choice);
* :mod:`.pipeline` - :class:`Engine`, the pipeline in data-flow order;
* :mod:`.sharded` - the sharded collective: region bounds, owners' selections (mixed into it);
* :mod:`.updates` - exchanged weight changes, anchors, outside changes (mixed into it);
* :mod:`.calibration` - link timing, cross-rank agreement and the time cost model's per-bucket
  choices (mixed into it);
* :mod:`.persistence` - replicated and per-rank state, ``state_dict`` (mixed into it);
* :mod:`.agreement` - replicated state compared across ranks before an exchange;
* :mod:`.flat` - tensor helpers the parts share;
* :mod:`.stages` - where a step's time goes.
"""
from .config import EngineConfig, build_config
from .pipeline import BucketView, Engine

__all__ = ["Engine", "EngineConfig", "BucketView", "build_config"]
