"""One tensor-parallel rank's shard of a model (Megatron's split): which rows or columns of each checkpoint tensor the
rank holds, read from the file slice by slice (a safetensors file is read only where the rank's slice lies: no rank
ever holds a whole projection, let alone the whole model), and the model built over them.

- q/k/v, gate/up (and each expert's): column-parallel, the rank's heads / intermediate columns (their rows of the
  [out, in] weight). K/V heads fewer than the ranks are replicated: rank r takes KV head r // (size / kv heads), the
  one its query heads read.
- o_proj, down (and each expert's): row-parallel, the matching columns of [out, in]; their outputs are partial sums
  (layers/parallel.py ReducedOutput all-reduces them). An o_proj bias is added by rank 0 only.
- embedding and output matrix: vocabulary-parallel rows (padded to a multiple of the ranks).
- norms, router weights, q/k norms: replicated.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from batchserve.config import ConfigError, ModelConfig
from batchserve.layers.parallel import (
    GatheredLogits,
    PipelineStage,
    ReducedOutput,
    TensorParallel,
    VocabParallelEmbedding,
    vocab_shard,
)
from batchserve.models import registry

# (dimension counted from the end, [(start, stop), ...]) of a tensor's slice this rank holds; None: all of it
Cut = tuple[int, list[tuple[int, int]]]

_LAYER = re.compile(r"layers\.(\d+)\.")
_COLUMN_PARALLEL = (".gate_proj.", ".up_proj.", ".w1.", ".w3.")
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.", ".w2.")


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel size the model's shapes cannot split evenly, naming both numbers."""
    if size == 1:
        return
    checks = [("num_attention_heads", config.num_heads), ("intermediate_size", config.intermediate_size)]
    if config.num_experts:
        checks.append(("moe_intermediate_size", config.moe_intermediate_size or config.intermediate_size))
    for name, value in checks:
        if value % size:
            raise ConfigError(f"tensor_parallel_size {size} does not divide the model's {name} {value}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(
            f"tensor_parallel_size {size} and the model's num_key_value_heads {kv}: one must divide the other "
            "(KV heads are split, or replicated when fewer than the ranks)"
        )


def check_pipeline_parallel(config: ModelConfig, stages: int) -> None:
    """Refuse more pipeline stages than the model has layers, naming both numbers."""
    if stages > config.num_layers:
        raise ConfigError(
            f"pipeline_parallel_size {stages} is more than the model's num_hidden_layers {config.num_layers}"
        )


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank computes: its share of the query heads, KV heads (at least one) and intermediate columns;
    the vocabulary stays whole (the runner samples over all of it)."""
    check_tensor_parallel(config, size)
    moe_inter = config.moe_intermediate_size
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=None if moe_inter is None else moe_inter // size,
    )


@dataclasses.dataclass(frozen=True)
class ShardCutter:
    """Where each checkpoint tensor (HF names) is cut for one rank."""

    config: ModelConfig
    tp: TensorParallel
    stage: PipelineStage = dataclasses.field(default_factory=PipelineStage)

    def rename(self, name: str) -> str | None:
        """A checkpoint name as this rank's model names it: a layer of another pipeline stage is None, one of this
        stage renumbered from 0."""
        match = _LAYER.search(name)
        if match is None or self.stage.count == 1:
            return name
        index = int(match.group(1))
        if index not in self.stage.layers:
            return None
        return name[: match.start(1)] + str(index - self.stage.first_layer) + name[match.end(1) :]

    def holds_vocab(self, name: str) -> bool:
        """The embedding on the first stage (and the last, whose output matrix it is when tied); the output matrix on
        the last stage. Another stage holds an empty one."""
        stage = self.stage
        if name.endswith("lm_head.weight"):
            return stage.is_last
        return stage.is_first or (stage.is_last and self.config.tie_word_embeddings)

    def cut(self, name: str, shape: tuple[int, ...]) -> Cut | None:
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        c = self.config
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            if not self.holds_vocab(name):
                return len(shape), [(0, 0)]
            start, rows = vocab_shard(c.vocab_size, self.tp)
            return len(shape), [(start, min(start + rows, c.vocab_size))]
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if ".q_proj." in name:
            return len(shape), [self._even(0, q)]
        if ".k_proj." in name or ".v_proj." in name:
            return len(shape), [self._kv(0)]
        if ".qkv_proj." in name:  # Phi-3's fused q/k/v
            return len(shape), [self._even(0, q), self._kv(q), self._kv(q + kv)]
        if ".gate_up_proj" in name:  # Phi-3's fused gate/up, or transformers 5's stacked experts [E, 2I, H]
            half = shape[-2] // 2
            return 2, [self._even(0, half), self._even(half, half)]
        if any(part in name for part in _COLUMN_PARALLEL):
            rows = min(len(shape), 2)  # a weight's rows ([I, H]), a bias's entries
            return rows, [self._even(0, shape[-rows])]
        if any(part in name for part in _ROW_PARALLEL) or name.endswith("experts.down_proj"):
            return 1, [self._even(0, shape[-1])]
        return None

    def _even(self, offset: int, total: int) -> tuple[int, int]:
        per = total // self.tp.size
        return offset + self.tp.rank * per, offset + (self.tp.rank + 1) * per

    def _kv(self, offset: int) -> tuple[int, int]:
        c, size, rank = self.config, self.tp.size, self.tp.rank
        if c.num_kv_heads >= size:
            return self._even(offset, c.num_kv_heads * c.head_dim)
        head = rank // (size // c.num_kv_heads)  # replicated: the KV head this rank's query heads read
        return offset + head * c.head_dim, offset + (head + 1) * c.head_dim

    def take(self, name: str, shape: tuple[int, ...], read) -> torch.Tensor:
        """This rank's slice of tensor `name`; `read(index)` reads the part an index tuple selects."""
        if name.endswith("o_proj.bias") and self.tp.rank != 0:
            return torch.zeros(shape, dtype=read((slice(0, 1),) * len(shape)).dtype)  # summed once, by rank 0
        cut = self.cut(name, shape)
        if cut is None:
            return read((slice(None),) * len(shape))
        from_end, ranges = cut
        dim = len(shape) - from_end
        lead = (slice(None),) * dim
        parts = [read((*lead, slice(start, stop))) for start, stop in ranges]
        joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        return self._padded_vocab(name, joined, dim)

    def _padded_vocab(self, name: str, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The last rank's vocabulary rows padded with zeros to the rows every rank holds."""
        if not name.endswith(("embed_tokens.weight", "lm_head.weight")) or not self.holds_vocab(name):
            return tensor
        _, rows = vocab_shard(self.config.vocab_size, self.tp)
        missing = rows - tensor.shape[dim]
        if missing <= 0:
            return tensor
        pad = torch.zeros((missing, *tensor.shape[1:]), dtype=tensor.dtype)
        return torch.cat((tensor, pad), dim=0)


def iter_sharded_weights(path: Path, cutter: ShardCutter) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors cut for one rank: safetensors read slice by slice; .bin files (whole tensors in
    pickles) cut after reading."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        from batchserve.models.loader import iter_hf_weights

        for name, tensor in iter_hf_weights(path):
            if (local := cutter.rename(name)) is not None:
                yield local, cutter.take(name, tuple(tensor.shape), lambda index, t=tensor: t[index].clone())
        return
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if (local := cutter.rename(name)) is None:
                    continue  # another pipeline stage's layer
                part = f.get_slice(name)
                yield local, cutter.take(name, tuple(part.get_shape()), lambda index, p=part: p[index])


def load_sharded_model(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel,
    stage: PipelineStage | None = None,
) -> nn.Module:
    """The model as this rank computes it: built on the meta device at the rank's shapes (its pipeline stage's layers
    only), filled from its slices of the checkpoint, its row-parallel outputs all-reduced and its logits gathered. A
    GGUF file is read through its float conversion (models/loader.py)."""
    from batchserve.models.loader import ensure_gguf_cache, is_gguf, materialize
    from batchserve.models.pipeline import NotOnThisStage, StageModel

    if device.type != "cpu":
        raise ConfigError("tensor and pipeline parallelism run on the CPU only (their collectives are gloo's)")
    stage = stage or PipelineStage(stop_layer=config.num_layers)
    cutter = ShardCutter(config, tp, stage)
    local = local_config(config, tp.size)
    _, vocab_rows = vocab_shard(config.vocab_size, tp)
    model_class = registry.model_class(registry.lookup(model_type=config.architecture))
    with torch.device("meta"):
        model = model_class(dataclasses.replace(local, vocab_size=vocab_rows), dtype=dtype)
        embed_rows = None if cutter.holds_vocab("embed_tokens.weight") else 0
        model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype, embed_rows)
        model.layers = nn.ModuleList(list(model.layers)[stage.first_layer : stage.stop_layer])
        if not stage.is_last:
            model.lm_head = None
            model.output_proj = NotOnThisStage()
    materialize(model, device)
    model.rotary.reset(device)
    folder = ensure_gguf_cache(path) if is_gguf(path) else path
    model.load_weights((name, tensor.to(dtype)) for name, tensor in iter_sharded_weights(folder, cutter))
    model.eval()
    model.requires_grad_(False)
    model.use_cpu_linear_layouts()
    parallelize(model, config.vocab_size, tp, stage)
    return model if stage.count == 1 else StageModel(model, stage)


def parallelize(model: nn.Module, vocab_size: int, tp: TensorParallel, stage: PipelineStage) -> None:
    """The collectives put in a loaded shard: after each o_proj and each MLP (dense or MoE) the ranks' partial sums
    are all-reduced; the logits are gathered. The native decoder loop has no all-reduce inside its layer: the Python
    layers run every step (modes.py parallel_ranks_run_python_layers)."""
    for layer in model.layers:
        layer.self_attn.o_proj = ReducedOutput(layer.self_attn.o_proj, tp)
        layer.mlp = ReducedOutput(layer.mlp, tp)
    if stage.is_last:
        model.output_proj = GatheredLogits(model.output_proj, vocab_size, tp)
    model.decoder_loop = None
