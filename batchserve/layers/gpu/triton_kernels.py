"""The raw Triton kernels of paged attention; paged_attention.py launches them.

Pool layout: K and V are each [num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in block
block_tables[seq, t // block_size] at offset t % block_size. Every kernel accumulates in float32 with an online
softmax (running max and sum per query row). DOT_FP32 widens both operands of each product to float32 first, with
PRECISION "ieee" (no TF32): for a float32 pool (so greedy output matches the reference) and under the interpreter,
whose bfloat16 products are not usable; on a GPU a bfloat16 / float16 pool multiplies as stored, on the tensor cores.
"""

from __future__ import annotations

import triton.language as tl

LOG2E = 1.4426950408889634


def decode_split(
    q_ptr, k_cache, v_cache, block_tables, seq_lens, out_ptr, part_acc, part_max, part_sum, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, KV head, context split): the GROUP query heads that share the KV head attend to
    this split's tokens together, so each K/V tile is read once for all of them. With one split the program writes
    the normalised output; otherwise the unnormalised sum, its max and its softmax sum go to part_* for
    decode_combine. qk_scale is the softmax scale times log2(e) (exp2 in place of exp)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        toks = tile + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        block = tl.load(block_tables + seq * stride_bt + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        offs = block * stride_kb + (toks % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        kv_mask = tok_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)  # fmt: skip
    else:
        # part_*: [num_seqs, num_heads, NUM_SPLITS(, BLOCK_D)], contiguous
        stat = (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_max + stat, m_i, mask=row_ok)
        tl.store(part_sum + stat, l_i, mask=row_ok)
        tl.store(part_acc + stat[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)


def decode_combine(
    out_ptr, part_acc, part_max, part_sum, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, query head): the splits' partial results merged under their common max. A split
    past the end of a short sequence holds max -inf and sum 0, and weighs nothing."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    stat = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits
    m = tl.load(part_max + stat, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_sum + stat, mask=split_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)
    total = tl.sum(l_s * w, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(part_acc + stat[:, None] * BLOCK_D + d[None, :], mask=split_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def prefill(
    q_ptr, k_cache, v_cache, block_tables, seq_lens, query_starts, out_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, query head, tile of BLOCK_M query rows) of a prefill chunk: the chunk's queries sit
    at positions context..seq_len-1 (context = the sequence's tokens before this chunk) and attend causally to the
    sequence's keys in the pool, this chunk's included (already stored). A tile past the chunk's end does nothing."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(query_starts + seq).to(tl.int32)
    q_len = tl.load(query_starts + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens + seq).to(tl.int32)
    context = seq_len - q_len
    kv_head = head // GROUP

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = context + rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # keys up to the tile's last query (causal), none for a tile past the chunk
    kv_end = tl.where(m_tile * BLOCK_M < q_len, tl.minimum(seq_len, context + (m_tile + 1) * BLOCK_M), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(0, kv_end, BLOCK_N):
        toks = tile + tl.arange(0, BLOCK_N)
        tok_ok = toks < kv_end
        block = tl.load(block_tables + seq * stride_bt + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        offs = block * stride_kb + (toks % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        kv_mask = tok_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = tok_ok[None, :] & (toks[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # a row may see no key of a later tile: its max stays that of earlier tiles (key 0 is always visible)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)  # fmt: skip


def rms_norm_residual(
    x_ptr, residual_ptr, weight_ptr, out_ptr, eps, stride_x, stride_r, stride_o, hidden,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One program per row: (x + residual) rounded to the dtype and stored back as the residual, then RMSNorm of it
    in float32, rounded to the dtype, times the weight: layers/norm.py's arithmetic in half precision."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    y = xf / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = w * y.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


KERNELS = {
    "decode_split": decode_split,
    "decode_combine": decode_combine,
    "prefill": prefill,
    "rms_norm_residual": rms_norm_residual,
}
