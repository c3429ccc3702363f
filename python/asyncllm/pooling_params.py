"""How an embedding request pools its prompt, validated once at construction
(vLLM's `PoolingParams`, for the decoder models asyncllm runs).

The engine core pools the final hidden states (after the model's last norm) and
sends the raw vector back; `finish_embedding` applies `dimensions` and
`normalize` in the front end, once per request, so the core's work and the wire
do not depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from asyncllm.errors import ConfigError

# The pooling types the core knows: the last prompt token's hidden state, or the
# mean over every prompt token's (which reads no prefix cache: a cached block
# has no hidden states to add).
POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """`pooling`: "last" or "mean"; `normalize`: scale to unit L2 norm;
    `dimensions`: keep the first this many values (then normalize, when on)."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ConfigError(
                f"PoolingParams.pooling={self.pooling!r} is invalid: must be one of "
                + ", ".join(POOLING_TYPES)
            )
        if not isinstance(self.normalize, bool):
            raise ConfigError(
                f"PoolingParams.normalize={self.normalize!r} is invalid: must be a bool"
            )
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ConfigError(
                f"PoolingParams.dimensions={d!r} is invalid: must be a positive integer or None"
            )


def finish_embedding(raw: Sequence[float], params: PoolingParams) -> list[float]:
    """The embedding a client gets from the core's pooled vector: truncated to
    `dimensions` (checked against the hidden size by the caller), then scaled to
    unit length when `normalize` is on (a zero vector stays zero)."""
    values = list(raw if params.dimensions is None else raw[: params.dimensions])
    if params.normalize:
        norm = math.sqrt(math.fsum(v * v for v in values))
        if norm > 0.0:
            values = [v / norm for v in values]
    return values
