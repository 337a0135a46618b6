"""Strict stand-ins for the GPU-only kernels the model calls, for the CPU suite: each checks every argument against
what the kernel's documentation says it assumes, then computes exactly what the kernel is documented to compute.

varlen_attn (torch.nn.attention.varlen, flash attention over packed sequences): query [T_q, H, D], key and value
[T_k, H_kv, D] in bf16 or fp16 (D a multiple of 8, at most 256); cu_seq_q, cu_seq_k [N + 1] int32 on the same
device, from 0 to T, non-decreasing; max_q, max_k the longest query / key span (the kernel sizes its launch grid
from them: positions past them are never computed, forward or backward); window_size (left, right), -1 for
unbounded, (W, 0) causal within W keys back; enable_gqa when H_kv < H, H a multiple of H_kv. seqused_k [N] int32
(inference only, no backward): span i's keys are its first seqused_k[i] only, at most max_k of them, and its
queries are its last ones (causal from the bottom right: a query sees the keys up to its own position counted from
the end), as in a decode step over a KV cache."""
import math
from contextlib import contextmanager

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
    assert block_table is None, "the model keeps no paged cache"
    cached = seqused_k is not None
    if cached:  # a decode step over a KV cache
        assert not torch.is_grad_enabled() or not (query.requires_grad or key.requires_grad), "seqused_k: no backward"
        assert seqused_k.dtype == torch.int32 and seqused_k.shape == (cu_seq_k.numel() - 1,), "seqused_k: [N] int32"
        assert seqused_k.device == query.device
    for cu, total, most, name in ((cu_seq_q, query.size(0), max_q, "q"), (cu_seq_k, key.size(0), max_k, "k")):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(), f"cu_seq_{name}: 1-D int32"
        assert isinstance(most, int) and most > 0, f"max_{name} must be a positive int, got {most!r}"
        spans = cu[1:] - cu[:-1]
        assert cu[0] == 0 and cu[-1] == total, f"cu_seq_{name} runs from {cu[0]} to {cu[-1]}, not 0 to {total}"
        assert bool((spans >= 0).all()), f"cu_seq_{name} decreases"
        if cached and name == "k":  # what the kernel reads of a span: its first seqused_k keys
            assert bool((seqused_k >= 0).all() and (seqused_k <= spans).all()), "seqused_k past its span"
            spans = seqused_k
        assert not spans_within_max or int(spans.max()) <= most, f"a {name} span of {int(spans.max())} tokens is longer than max_{name} {most}"
    assert cu_seq_q.shape == cu_seq_k.shape, "as many query spans as key spans"
    if cached:
        used = seqused_k.tolist()
        assert all(q <= k for q, k in zip((cu_seq_q[1:] - cu_seq_q[:-1]).tolist(), used)), "more queries than keys"
    else:
        assert torch.equal(cu_seq_q, cu_seq_k), "self-attention: the same spans"
    assert isinstance(window_size, tuple) and len(window_size) == 2 and all(
        isinstance(w, int) and w >= -1 for w in window_size), f"window_size (left, right), got {window_size!r}"


def span_attention(q, k, v, left, right, scale):
    """One span's attention, in float64: q [L_q, H, D], k, v [L_k, H, D] (kv heads already repeated), query i at key
    position i + L_k - L_q."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    i, j = torch.arange(q.size(0))[:, None] + k.size(0) - q.size(0), torch.arange(k.size(0))[None]
    allowed = torch.ones(q.size(0), k.size(0), dtype=torch.bool)
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
    bounds, key_starts = cu_seq_q.tolist(), cu_seq_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else [b - a for a, b in zip(key_starts, key_starts[1:])]
    parts = []
    for start, end, key_start, n in zip(bounds, bounds[1:], key_starts, used):
        if end == start:
            continue
        keys = slice(key_start, key_start + n)
        out = span_attention(query[start:end], k[keys], v[keys], *window_size, scale)
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


@contextmanager
def flash_on_the_cpu(kernel=strict_varlen_attn):
    """model.py's GPU attention branches forced on the CPU, through kernel (a stand-in above): packed passes in bf16
    (flash_varlen) and the static decode step over each row's written columns (cached_attention), grouped heads on
    as torch 2.12's kernel takes them. All put back after."""
    import model
    saved = model.flash_varlen, model.VARLEN_GQA, model.varlen_attn, dict(model.DECODE_FLASH)
    model.flash_varlen = lambda q: q.dtype in (torch.bfloat16, torch.float16)
    model.VARLEN_GQA, model.varlen_attn = True, kernel
    model.DECODE_FLASH["failed"] = False
    try:
        yield
    finally:
        model.flash_varlen, model.VARLEN_GQA, model.varlen_attn, decode_flash = saved
        model.DECODE_FLASH.update(decode_flash)
