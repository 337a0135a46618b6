"""Strict stand-ins for the GPU-only kernels the model calls, for the CPU suite: each checks every argument against
what the kernel's documentation says it assumes, then computes exactly what the kernel is documented to compute.

varlen_attn (torch.nn.attention.varlen, flash attention over packed sequences): query [T_q, H, D], key and value
[T_k, H_kv, D] in bf16 or fp16 (D a multiple of 8, at most 256); cu_seq_q, cu_seq_k [N + 1] int32 on the same
device, from 0 to T, non-decreasing; max_q, max_k the longest query / key span (the kernel sizes its launch grid
from them: positions past them are never computed, forward or backward); window_size (left, right), -1 for
unbounded, (W, 0) causal within W keys back; enable_gqa when H_kv < H, H a multiple of H_kv."""
import math

import torch


def check_varlen_arguments(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, enable_gqa,
                           seqused_k, block_table, spans_within_max=True):
    assert query.dim() == key.dim() == value.dim() == 3, "query, key, value: [tokens, heads, head_dim]"
    assert query.dtype in (torch.bfloat16, torch.float16), f"flash attention takes bf16/fp16, got {query.dtype}"
    assert key.dtype == value.dtype == query.dtype, "query, key and value in one dtype"
    assert query.device == key.device == value.device == cu_seq_q.device == cu_seq_k.device
    head_dim = query.size(-1)
    assert head_dim % 8 == 0 and head_dim <= 256 and key.size(-1) == value.size(-1) == head_dim
    assert key.shape == value.shape
    H, H_kv = query.size(1), key.size(1)
    assert (H == H_kv) or (enable_gqa and H % H_kv == 0), f"{H} query heads, {H_kv} kv heads, enable_gqa={enable_gqa}"
    assert seqused_k is None and block_table is None, "seqused_k / block_table are inference-only (no backward)"
    for cu, total, most, name in ((cu_seq_q, query.size(0), max_q, "q"), (cu_seq_k, key.size(0), max_k, "k")):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(), f"cu_seq_{name}: 1-D int32"
        assert isinstance(most, int) and most > 0, f"max_{name} must be a positive int, got {most!r}"
        spans = cu[1:] - cu[:-1]
        assert cu[0] == 0 and cu[-1] == total, f"cu_seq_{name} runs from {cu[0]} to {cu[-1]}, not 0 to {total}"
        assert bool((spans >= 0).all()), f"cu_seq_{name} decreases"
        assert not spans_within_max or int(spans.max()) <= most, f"a {name} span of {int(spans.max())} tokens is longer than max_{name} {most}"
    assert cu_seq_q.shape == cu_seq_k.shape and torch.equal(cu_seq_q, cu_seq_k), "self-attention: the same spans"
    assert isinstance(window_size, tuple) and len(window_size) == 2 and all(
        isinstance(w, int) and w >= -1 for w in window_size), f"window_size (left, right), got {window_size!r}"


def span_attention(q, k, v, left, right, scale):
    """One span's attention, in float64: q [L, H, D], k, v [L, H, D] (kv heads already repeated)."""
    L = q.size(0)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    i, j = torch.arange(L)[:, None], torch.arange(L)[None]
    allowed = torch.ones(L, L, dtype=torch.bool)
    if right >= 0:
        allowed &= j <= i + right
    if left >= 0:
        allowed &= j >= i - left
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v.double())


def strict_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
                       drop_past_max=False):
    """varlen_attn's contract checked, then each span's attention computed exactly (float64, cast back).
    drop_past_max: instead of refusing a span longer than max_q, leave its tokens past max_q unwritten (NaN), as
    the kernel would: a faulty fast path, for the self-check's tests."""
    check_varlen_arguments(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, enable_gqa,
                           seqused_k, block_table, spans_within_max=not drop_past_max)
    groups = query.size(1) // key.size(1)
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    bounds = cu_seq_q.tolist()
    parts = []
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        out = span_attention(query[start:end], k[start:end], v[start:end], *window_size, scale)
        if drop_past_max and end - start > max_q:
            out = torch.cat([out[:max_q], torch.full_like(out[max_q:], float("nan"))])
        parts.append(out)
    out = torch.cat(parts).to(query.dtype)
    assert return_aux is None, "the model never asks for the log-sum-exp"
    return out


def tail_dropping_varlen_attn(*args, **kwargs):
    return strict_varlen_attn(*args, drop_past_max=True, **kwargs)


def strict_varlen_attn_without_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                                   window_size=(-1, -1)):
    """torch 2.11's varlen_attn: no enable_gqa keyword, so key and value have as many heads as the query."""
    return strict_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale,
                              window_size=window_size)
