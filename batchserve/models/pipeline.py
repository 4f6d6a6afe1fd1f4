"""A pipeline stage of a model: its layers only, the activations received from the stage before and sent to the one
after (layers/parallel.py PipelineStage). The first stage embeds the tokens, the last normalises and projects onto
the vocabulary; the runner samples on the last stage and the others take its tokens (worker/model_runner.py).

The stage runs the model's own Python layers in the model's order (the sequencing of models/llama.py forward without
the native decoder loop, which runs all layers in one call): no operator is written here.
"""

from __future__ import annotations

import torch
from torch import nn

from batchserve.layers.attention import AttentionMetadata, KVCache
from batchserve.layers.parallel import PipelineStage


class NotOnThisStage(nn.Module):
    """The output projection of a stage that is not the last: never called."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the logits are computed on the last pipeline stage only")


class StageModel(nn.Module):
    """The runner's model on one pipeline stage: forward returns the final hidden states on the last stage, None on
    the others (their activations went on to the next stage)."""

    def __init__(self, model: nn.Module, stage: PipelineStage):
        super().__init__()
        self.model = model
        self.stage = stage
        self.decoder_loop = None

    @property
    def config(self):
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        model, stage = self.model, self.stage
        if stage.is_first:
            x, residual = model.embed(input_ids), None
        else:
            dtype = model.norm.weight.dtype
            x, residual = stage.receive_activations((input_ids.shape[0], model.config.hidden_size), dtype, 2)
        tables = model.rope_tables(positions, x.dtype, attn_metadata)
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            cos, sin = tables[layer.self_attn.rope_table]
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
        if not stage.is_last:
            stage.send_activations(x, residual)
            return None
        return model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
