"""Random-k: k positions drawn uniformly, the baseline of a selection blind to magnitude.

Values are sent as they are, not scaled by n/k: with error feedback what is not sent stays in
the residual, so no scaling is needed for the sum over steps to be right (a scaled, unbiased
Random-k is the form without error feedback)."""
import zlib

import torch

from .. import validate
from .base import Sparsifier, k_for_density


class RandomK(Sparsifier):
    """k positions drawn without replacement from a private generator.

    The generator is seeded from (seed, bucket, step, rank, direction) and never touches the
    global RNG, so the user's random stream is unchanged. Uplink draws differ per rank; the
    downlink draw is the same on every rank (rank is left out), keeping replicas identical.
    """

    name = "randomk"

    def __init__(self, seed: int = 0):
        value = validate.plain_number(seed)
        try:  # what int() takes without dropping a fraction: 3, 3.0, "3"
            if isinstance(value, bool) or (isinstance(value, float)
                                           and not value.is_integer()):
                raise ValueError
            self.seed = int(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"seed must be an int, got {seed!r}") from None

    def select(self, acc, density, ctx):
        k = k_for_density(acc.numel(), density)
        rank = ctx.rank if ctx.direction == "up" else -1
        key = f"{self.seed}:{ctx.bucket}:{ctx.step}:{rank}:{ctx.direction}".encode()
        gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(key))
        idx = torch.randperm(acc.numel(), generator=gen)[:k]
        return torch.sort(idx).values.to(acc.device)

    def __repr__(self):
        return f"RandomK(seed={self.seed})"
