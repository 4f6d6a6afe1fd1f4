"""A pooling request's parameters (docs/embeddings.md): plain and frozen, they ride in SamplingParams.pooling from
the front end to the worker, which pools the prompt's hidden states instead of sampling a token."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from batchserve.sampling_params import InvalidRequestError


class PoolingTask(enum.StrEnum):
    EMBED = "embed"  # the pooled hidden state, normalised as the model folder says
    CLASSIFY = "classify"  # the classification head's score on the pooled (last) hidden state


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first N of the embedding (Matryoshka), then normalise again; `normalize`: None takes the
    model's (its sentence-transformers Normalize module, or on for a decoder without one)."""

    task: PoolingTask = PoolingTask.EMBED
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "task", PoolingTask(self.task))
        except ValueError:
            raise InvalidRequestError(f"task must be embed or classify, got {self.task!r}", "task") from None
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}", "dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}", "normalize")
