"""The token embedding, built without a random initialisation: its weights always come from a checkpoint. On the meta
device (where models are built before loading) nn.Embedding's own normal_() init imports torch._dynamo, a second or
more of every engine start for values that are overwritten."""

from __future__ import annotations

import torch
from torch import nn


def token_embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> nn.Embedding:
    weight = torch.empty(vocab_size, hidden_size, dtype=dtype)  # on the device of the caller's context (meta)
    return nn.Embedding(vocab_size, hidden_size, _weight=weight)
