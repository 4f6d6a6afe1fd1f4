"""Paged attention.

Each step's K/V are first written into the block pool at `slot_mapping` (for every layer, before any sequence reads,
so a prefix block computed in this very step is visible to the requests that share it). Then the batch splits in two:
- decode sequences (one query each) read their context in place through their block tables: the native CPU kernel
  when it is available, else a torch path (gather into a padded copy + SDPA, GQA folded into the query dim);
- prefill chunks (query length > 1, context = cached tokens + this chunk): the native CPU kernel reads their keys in
  place too, causal by absolute position, in tiles of 16 query rows; the torch path pads only their own queries and
  runs SDPA with a causal mask (or, for prompts with no earlier context, one causal SDPA per prompt on its own K/V).
On a CPU with AMX a bfloat16 pool's prefill chunks take the native kernel on the tiles (kernels/prefill_amx.cpp, every
chunk whatever its length, so a prefix-cache hit rounds as the whole prompt), or torch's fused SDPA where that kernel
is not chosen (preferred_prefill_method(); BATCHSERVE_PREFILL_ATTENTION forces one way).
On the CPU all of this is one native call a layer (kernels/step_attention.cpp paged_attention, the same function the
native decoder loop calls) on the step's StepAttention (native_step: built once a step); the Python code below is the
torch path, for other devices and for what the native kernels do not take.
The native kernels' instruction-set path (kernels.attention_path(), chosen once from the CPU or
BATCHSERVE_ATTENTION_PATH): "avx512_bf16" multiplies a bfloat16 pool's K/V as stored with AVX512-BF16, "avx512" widens
them to float32 (a float32 pool takes this code on both), "avx2" runs an 8-wide AVX2 decode kernel and SDPA for
prefill, "portable" the plain C++ decode loop and SDPA for prefill.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from batchserve import env
from batchserve.layers import kernels, kv_quant
from batchserve.layers.gpu import paged_attention as gpu_attention
from batchserve.layers.kernels import paths
from batchserve.layers.windowed_attention import windowed_attention

if TYPE_CHECKING:
    from batchserve.layers.lora import LoRAStep

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, num_kv_heads, head_dim]
PREFILL_METHODS = ("native", "sdpa", "split")  # how prefill chunks attend on the CPU (preferred_prefill_method)
EVERY_CHUNK = 2**62  # native_prefill_rows: no chunk is too long for the native kernel
PREFILL_KERNEL_PATHS = ("avx512_bf16", "avx512")  # the native kernel paths with a prefill kernel
AMX_KERNEL_PATHS = ("amx", "amx_emulated")  # the native prefill kernel's paths on (emulated) AMX tiles
# the start-up line's name of a bfloat16 pool's native prefill kernel, by its path (any other: "vector kernel")
_PREFILL_KERNEL_NAMES = {"amx": "AMX tiles", "amx_emulated": "AMX tiles", "avx512_bf16": "AVX512-BF16 dot products"}


@dataclass
class SeqGroup:
    """The sequences of a step that take one attention path."""

    token_range: tuple[int, int]  # their tokens are rows start..stop-1 of the packed batch
    block_tables: torch.Tensor  # [Bg, max_blocks] int64, padded with 0 (never read beyond seq_len)
    seq_lens: torch.Tensor  # [Bg] context length after this step
    positions: torch.Tensor  # [Tg] absolute positions of their tokens
    max_query_len: int
    query_pad_index: torch.Tensor | None = None  # [Tg] rows in the [Bg * max_query_len] padded layout (prefill)
    query_starts: torch.Tensor | None = None  # [Bg + 1] int64: each sequence's first row within the group (prefill)
    # prefill: per sequence (first row, end row within the group, context before this chunk), on the host
    spans: list[tuple[int, int, int]] | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def fresh(self) -> bool:
        """Prompts with no earlier context (whole, or first chunks): they attend only to this step's own K/V."""
        return self.spans is not None and all(context == 0 for *_, context in self.spans)

    def native_subset(self, max_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunks of at most `max_rows` rows (those the native prefill kernel takes when longer ones take SDPA):
        their sequences' indices in the group, their rows within it, and their query starts among those rows."""
        key = ("native", max_rows)
        if key not in self._masks:
            seqs = [i for i, (start, stop, _) in enumerate(self.spans) if stop - start <= max_rows]
            rows = [r for i in seqs for r in range(self.spans[i][0], self.spans[i][1])]
            lengths = [self.spans[i][1] - self.spans[i][0] for i in seqs]
            starts = torch.tensor([0, *lengths]).cumsum(0)
            device = self.seq_lens.device
            index = functools.partial(torch.tensor, dtype=torch.int64, device=device)
            self._masks[key] = (index(seqs), index(rows), starts)
        return self._masks[key]

    def chunk_mask(self, num_queries: int, context: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_queries, context + num_queries] in `dtype`, added to the scores: 0 where query row r (position
        context + r) sees key j (j <= context + r), -inf elsewhere. SDPA would turn a bool mask into this on every
        call, a pass over the mask per layer; made once a step here (the output is bit-equal)."""
        key = ("chunk", num_queries, context, dtype)
        if key not in self._masks:
            shape, device = (num_queries, context + num_queries), self.seq_lens.device
            hidden = torch.ones(shape, dtype=torch.bool, device=device).triu(context + 1)
            self._masks[key] = torch.zeros(shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        return self._masks[key]

    def decode_mask(self, num_keys: int) -> torch.Tensor:
        """[B, 1, 1, num_keys] bool: key j is visible iff j < seq_len."""
        if num_keys not in self._masks:
            arange = torch.arange(num_keys, device=self.seq_lens.device)
            self._masks[num_keys] = (arange[None, :] < self.seq_lens[:, None])[:, None, None, :]
        return self._masks[num_keys]

    def prefill_mask(self, num_keys: int) -> torch.Tensor:
        """[B, 1, max_q, num_keys] bool: query at position p sees keys 0..p of its own sequence.

        Padding rows get position 0, so they see key 0 and stay finite; their output is dropped.
        """
        if num_keys not in self._masks:
            pos = self.positions.new_zeros(self.num_seqs * self.max_query_len)
            pos[self.query_pad_index] = self.positions
            arange = torch.arange(num_keys, device=pos.device)
            mask = arange[None, None, :] <= pos.view(self.num_seqs, self.max_query_len, 1)
            self._masks[num_keys] = mask[:, None]
        return self._masks[num_keys]


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's packed batch; built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: pool slot of each scheduled token
    positions: torch.Tensor  # [T] int64: absolute position of each scheduled token in its sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64 (whole batch)
    seq_lens: torch.Tensor  # [B] int64: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int64: cu_seqlens of the packed queries
    max_query_len: int
    max_seq_len: int
    query_pad_index: torch.Tensor | None = None  # [T] rows in the whole batch's padded layout
    decode: SeqGroup | None = None
    prefill: SeqGroup | None = None
    # [T] int64, LongRoPE models only: 1 where the token's sequence is longer than the original context
    long_context: torch.Tensor | None = None
    # the step's tokens grouped by LoRA adapter (layers/lora.py), handed to each projection; None: base model only
    lora: LoRAStep | None = None
    # how prefill chunks attend on the CPU: the engine's prefill_attention option (preferred_prefill_method)
    prefill_attention: str = "auto"
    _native_steps: dict = field(default_factory=dict, repr=False)  # native_step's, per (dtypes, head size)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V ([T, Hkv, D]) into the pool at their slots."""
    if kv_quant.is_quantized(kv_cache):
        kv_quant.write(key, value, kv_cache, slot_mapping)
        return
    key_cache, value_cache = kv_cache
    native = kernels.for_tensors(key, value, key_cache, dtypes=kernels.FUSED_DTYPES)
    if native is not None and key.dtype == key_cache.dtype:  # the native store converts no dtype (kv_cache_dtype's)
        native.write_kv_(key, value, key_cache, value_cache, slot_mapping)
        return
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_kv(
    kv_cache: KVCache, block_tables: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read each sequence's context through its block table -> K, V as [B, Hkv, max_blocks * block_size, D] in `dtype`
    (an 8-bit pool's dequantized to it; a float pool of another dtype, kv_cache_dtype's, converted)."""
    key_cache, value_cache = kv_cache
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    flat = block_tables.reshape(-1)
    if kv_quant.is_quantized(kv_cache):
        key_cache, value_cache = kv_quant.read_blocks(kv_cache, flat, dtype)
        flat = torch.arange(flat.shape[0], device=flat.device)
    keys = key_cache.index_select(0, flat).view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    values = value_cache.index_select(0, flat).view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    return keys.transpose(1, 2).to(dtype), values.transpose(1, 2).to(dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D] (this step's tokens, packed) -> output [T, H, D]. A layer with a
    sliding `window` (each query sees its last `window` positions) or soft-capped scores (`softcap`) takes the torch
    code of layers/windowed_attention.py: the native kernels implement neither."""
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    if window is not None or softcap is not None:
        if kv_quant.is_quantized(kv_cache):
            raise NotImplementedError("an 8-bit KV cache (int8, fp8_e4m3) with sliding-window or soft-capped attention")
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        return windowed_attention(query, key, value, kv_cache, metadata, scale, window, softcap)
    step = native_step(query, query.shape[-1], kv_cache, metadata)
    if step is not None:
        return kernels.load().paged_attention(
            query, key, value, kv_cache[0], kv_cache[1], step, scale, *quantized_kv_scales(kv_cache)
        )
    if kv_quant.is_quantized(kv_cache):  # attend to the K/V as the pool holds them, as later steps will
        key, value = kv_quant.write(key, value, kv_cache, metadata.slot_mapping)
    else:
        write_kv(key, value, kv_cache, metadata.slot_mapping)
    prefill = functools.partial(prefill_attention, chosen=metadata.prefill_attention)
    groups = [(g, path) for g, path in ((metadata.decode, decode_attention), (metadata.prefill, prefill)) if g]
    if len(groups) == 1:
        group, path = groups[0]
        return path(query, key, value, kv_cache, group, scale)
    out = torch.empty_like(query)
    for group, path in groups:
        rows = slice(*group.token_range)
        out[rows] = path(query[rows], key[rows], value[rows], kv_cache, group, scale)
    return out


def native_step(like: torch.Tensor, head_dim: int, kv_cache: KVCache, metadata: AttentionMetadata):
    """The step's attention as the native kernels take it (the module's StepAttention, built once a step and read by
    every layer, the native decoder loop's included), or None where the torch path runs: off the CPU or without the
    native kernels, a float pool not of the queries' dtype (the native K/V store takes that or 8-bit codes only),
    decode rows that are not the batch's first, or prefill chunks that attend by the torch code."""
    key = (like.dtype, kv_cache[0].dtype, head_dim)
    if key not in metadata._native_steps:
        metadata._native_steps[key] = _make_native_step(like, head_dim, kv_cache, metadata)
    return metadata._native_steps[key]


def quantized_kv_scales(kv_cache: KVCache) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An 8-bit pool's K and V scales, which the native step takes beside the pool; (None, None) for a float pool."""
    return (kv_cache.k_scale, kv_cache.v_scale) if kv_quant.is_quantized(kv_cache) else (None, None)


def _make_native_step(like: torch.Tensor, head_dim: int, kv_cache: KVCache, meta: AttentionMetadata):
    if kv_quant.is_quantized(kv_cache):  # 8-bit codes: the native step quantizes, stores and reads them itself
        native = kernels.for_tensors(like, dtypes=kernels.FUSED_DTYPES)
    else:
        native = kernels.for_tensors(like, kv_cache[0], dtypes=kernels.FUSED_DTYPES)
        native = native if kv_cache[0].dtype == like.dtype else None
    if native is None:
        return None
    decode, prefill = meta.decode, meta.prefill
    decode_rows = 0 if decode is None else decode.token_range[1]
    if (decode is not None and decode.token_range[0] != 0) or (
        prefill is not None and tuple(prefill.token_range) != (decode_rows, like.shape[0])
    ):
        return None  # the native call takes decodes as the first rows and prefill chunks as the rest
    method = None if prefill is None else prefill_method(like, head_dim, kv_cache, meta.prefill_attention)
    if method == "torch":
        return None
    return native.StepAttention(
        slot_mapping=meta.slot_mapping,
        decode_rows=decode_rows,
        decode_block_tables=None if decode is None else decode.block_tables,
        decode_seq_lens=None if decode is None else decode.seq_lens,
        prefill_block_tables=None if prefill is None else prefill.block_tables,
        prefill_seq_lens=None if prefill is None else prefill.seq_lens,
        prefill_query_starts=None if prefill is None else prefill.query_starts,
        spans=[] if prefill is None else prefill.spans,
        native_prefill_rows=0 if method is None else native_prefill_rows(method),
        path=kernels.attention_path(),
        mask_dtype=like.dtype,
        prefill_path=kernels.prefill_kernel_isa(),
    )


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, group: SeqGroup, scale: float
) -> torch.Tensor:
    """One query per sequence over its whole context in the pool (this step's key/value are already there)."""
    if gpu_attention.supports(query, kv_cache):  # CUDA: the Triton kernel reads the pool in place
        return gpu_attention.decode_attention(query, key, value, kv_cache, group, scale)
    if kv_quant.is_quantized(kv_cache):
        out = kv_quant.native_decode(query, kv_cache, group.block_tables, group.seq_lens, scale)
        if out is not None:
            return out
    native = kernels.for_tensors(query, kv_cache[0], dtypes=(torch.float32, torch.bfloat16, torch.float16))
    if native is not None:
        out = native.paged_decode_attention(
            query.float().contiguous(),
            kv_cache[0],
            kv_cache[1],
            group.block_tables,
            group.seq_lens,
            scale,
            kernels.attention_path(),
        )
        return out.to(query.dtype)
    # Torch path: one query per sequence; fold the query heads sharing a KV head into SDPA's query-length dim.
    keys, values = gather_kv(kv_cache, group.block_tables, query.dtype)
    num_seqs, num_kv_heads, num_keys, head_dim = keys.shape
    num_heads = query.shape[1]
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.decode_mask(num_keys), scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_method(like: torch.Tensor, head_dim: int, kv_cache: KVCache, chosen: str = "auto") -> str:
    """How prefill chunks of queries like `like` (its dtype and device) attend: "sdpa" (one fused attention per
    chunk), "native" (the native prefill kernel), "split" (chunks of at most paths.SHORT_PREFILL_MAX_ROWS rows the
    native kernel, longer ones SDPA) or "torch" (the torch code: gather, pad, SDPA). On the CPU a chunk the native
    kernel cannot take (no AVX-512, another head size) goes to SDPA, which the native step runs too: the torch code
    would send the whole step to the torch path, a slower one. `chosen`: the engine's prefill_attention option."""
    if like.device.type != "cpu":
        return "torch"
    preferred = preferred_prefill_method(kv_cache[0].dtype, chosen)
    if (
        preferred == "native"
        and _amx_by_choice(kv_cache[0].dtype, chosen)
        and head_dim not in paths.AMX_PREFILL_HEAD_DIMS
    ):
        return "sdpa"  # the AMX kernel is chosen by itself only for the head sizes where it was measured faster
    if preferred != "sdpa" and _native_prefill(like, head_dim, kv_cache) is not None:
        return preferred
    return "sdpa"


def native_prefill_rows(method: str) -> int:
    """The longest chunk (query rows) that a prefill `method` (prefill_method's) sends to the native prefill kernel;
    longer ones take SDPA, one call per sequence. Read at each step, so a test can move the threshold."""
    return {"native": EVERY_CHUNK, "split": paths.SHORT_PREFILL_MAX_ROWS}.get(method, 0)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    group: SeqGroup,
    scale: float,
    chosen: str = "auto",
) -> torch.Tensor:
    if gpu_attention.supports(query, kv_cache):  # CUDA: the Triton kernel reads the pool in place
        return gpu_attention.prefill_attention(query, key, value, kv_cache, group, scale)
    mode = prefill_method(query, query.shape[-1], kv_cache, chosen)
    if mode == "torch":
        return _padded_prefill_attention(query, key, value, kv_cache, group, scale)
    max_rows = native_prefill_rows(mode)
    if max_rows == 0:
        return _per_sequence_prefill_attention(query, key, value, kv_cache, group, scale)
    if all(stop - start <= max_rows for start, stop, _ in group.spans):
        return _native_prefill_attention(query, kv_cache, group.block_tables, group.seq_lens, group.query_starts, scale)
    out = _per_sequence_prefill_attention(query, key, value, kv_cache, group, scale, max_rows)
    seqs, rows, starts = group.native_subset(max_rows)
    if len(seqs):  # the short chunks, batched into one call of the native kernel
        tables, lens = group.block_tables[seqs], group.seq_lens[seqs]
        out[rows] = _native_prefill_attention(query[rows], kv_cache, tables, lens, starts, scale)
    return out


def _native_prefill_attention(
    query: torch.Tensor,
    kv_cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The native prefill kernel over prefill chunks: query [T, H, D], their rows in order, query_starts [S + 1].
    bf16 rows of a bf16 pool go to the AMX kernel as they are, any other through float32 (step_attention.cpp's rule)."""
    isa = kernels.prefill_kernel_isa()
    bf16_rows = query.dtype == kv_cache[0].dtype == torch.bfloat16 and isa.name != "avx512"
    out = kernels.load().paged_prefill_attention(
        query if bf16_rows else query.float(),
        kv_cache[0],
        kv_cache[1],
        block_tables,
        seq_lens,
        query_starts,
        scale,
        kernels.attention_path(),
        isa,
    )
    return out.to(query.dtype)


def _padded_prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, group: SeqGroup, scale: float
) -> torch.Tensor:
    """The torch code, off the CPU: whole prompts one SDPA each; chunks after earlier context gathered from the pool,
    padded to the longest chunk and attended in one SDPA under the prefill mask."""
    if group.fresh:
        return _per_sequence_prefill_attention(query, key, value, kv_cache, group, scale)
    keys, values = gather_kv(kv_cache, group.block_tables, query.dtype)
    num_seqs, num_kv_heads, num_keys, head_dim = keys.shape
    num_tokens, num_heads, _ = query.shape
    max_q = group.max_query_len
    padded = query.new_zeros(num_seqs * max_q, num_heads, head_dim)
    padded[group.query_pad_index] = query
    q = padded.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=group.prefill_mask(num_keys),
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out[group.query_pad_index]


def _native_prefill(like: torch.Tensor, head_dim: int, kv_cache: KVCache):
    """The native prefill kernel when it takes this call: CPU, a float32 or bfloat16 pool, a head size it was built
    for, an AVX-512 path (float32 accumulation; bf16 products on the avx512_bf16 path)."""
    native = kernels.for_tensors(like, kv_cache[0], dtypes=(torch.float32, torch.bfloat16))
    if native is None or not native.prefill_attention_available(head_dim):
        return None
    return native if kernels.attention_path().name in PREFILL_KERNEL_PATHS else None


@functools.cache
def preferred_prefill_method(pool_dtype: torch.dtype, chosen: str = "auto") -> str:
    """How prefill chunks attend on the CPU, chosen once per pool dtype and engine option, and logged. `chosen` is
    the engine's prefill_attention option. With "auto": for a bfloat16 pool on a CPU with AMX, "native" where the
    native prefill kernel runs on the tiles (kernels.prefill_kernel_path; every chunk, of the head sizes
    paths.AMX_PREFILL_HEAD_DIMS, in one call: prefill_method), else "sdpa" (torch's fused attention, one call per
    sequence, on the tiles too); "native" (the native kernel where it runs, else SDPA: prefill_method) otherwise, a
    float32 pool included. "split" (chunks of at most paths.SHORT_PREFILL_MAX_ROWS rows the native kernel, batched,
    longer ones SDPA) only when asked for. BATCHSERVE_PREFILL_ATTENTION forces one over `chosen`
    (docs/cpu-kernels.md)."""
    forced = env.prefill_attention()
    if forced is not None and forced not in PREFILL_METHODS:
        raise ValueError(f"BATCHSERVE_PREFILL_ATTENTION={forced!r}: not one of auto, {', '.join(PREFILL_METHODS)}")
    if chosen != "auto" and chosen not in PREFILL_METHODS:
        raise ValueError(f"prefill_attention={chosen!r}: not one of auto, {', '.join(PREFILL_METHODS)}")
    amx = pool_dtype == torch.bfloat16 and "amx_bf16" in kernels.cpu_flags().split()
    auto = "native" if not amx or _amx_by_choice(pool_dtype, chosen) else "sdpa"
    path = forced or (chosen if chosen != "auto" else None) or auto
    kernel = _PREFILL_KERNEL_NAMES.get(kernels.prefill_kernel_path()) if pool_dtype == torch.bfloat16 else None
    where = {
        "native": f" ({kernel or 'vector kernel'}) where it takes the chunk, else sdpa",
        "split": f" (chunks of <= {paths.SHORT_PREFILL_MAX_ROWS} rows native, batched, where it takes them; longer sdpa)",
    }.get(path, "")
    why = " (forced)" if forced else f" (prefill_attention {chosen})" if chosen != "auto" else ""
    logger.info("prefill attention on a %s pool: %s%s%s", pool_dtype, path, where, why)
    return path


def _amx_by_choice(pool_dtype: torch.dtype, chosen: str) -> bool:
    """Whether prefill auto sends a bfloat16 pool's chunks to the native kernel on AMX tiles: nothing forces a prefill
    method, the option is auto, the CPU has AMX and the native prefill kernel's path is the tiles (or their emulation,
    forced). Every chunk then takes it, whatever its length: a row rounds the same in a prefix-cache hit's chunk as in
    the whole prompt (prefill_amx.cpp)."""
    return (
        env.prefill_attention() is None
        and chosen == "auto"
        and pool_dtype == torch.bfloat16
        and "amx_bf16" in kernels.cpu_flags().split()
        and kernels.prefill_kernel_path() in AMX_KERNEL_PATHS
    )


def _per_sequence_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    group: SeqGroup,
    scale: float,
    skip_rows: int = 0,
) -> torch.Tensor:
    """One SDPA per sequence on its own rows, no padding to the longest chunk; chunks of at most `skip_rows` rows
    are left out (their rows unwritten: the native kernel's). A prompt with no earlier context attends to this
    step's K/V as they are (no gather from the pool; causal, so the flash kernel skips the blocks above the
    diagonal); a chunk after earlier context (an earlier chunk, a prefix-cache hit) reads its sequence's blocks from
    the pool, this chunk's included, under the causal mask shifted by the context."""
    out = torch.empty_like(query)
    gqa = query.shape[1] != key.shape[1]
    for i, (start, stop, context) in enumerate(group.spans):
        if stop - start <= skip_rows:
            continue
        q = query[start:stop].transpose(0, 1).unsqueeze(0)
        if context == 0:
            k, v = (t[start:stop].transpose(0, 1).unsqueeze(0) for t in (key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            k, v = _sequence_kv(kv_cache, group.block_tables[i], context + stop - start, query.dtype)
            mask = group.chunk_mask(stop - start, context, query.dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:stop] = o[0].transpose(0, 1)
    return out


def _sequence_kv(
    kv_cache: KVCache, block_table: torch.Tensor, num_keys: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `num_keys` K and V from the pool through its block table -> each [1, Hkv, num_keys, D]."""
    block_size, num_kv_heads, head_dim = kv_cache[0].shape[1:]
    blocks = block_table[: -(-num_keys // block_size)]
    if kv_quant.is_quantized(kv_cache):
        kv_cache, blocks = kv_quant.read_blocks(kv_cache, blocks, dtype), torch.arange(blocks.shape[0])
    return tuple(
        cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:num_keys].transpose(0, 1).unsqueeze(0).to(dtype)
        for cache in kv_cache
    )
