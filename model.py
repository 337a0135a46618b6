"""
The nanochat GPT, its batched KV-cache sampler and chat tokenizer; below a banner, nanochat's files.

Read from the top:
- GPT: nanochat's architecture (rotary, QK-norm, ReLU^2 MLP, untied head, logit softcap, GQA) in every generation
  nanochat has written checkpoints of, its differences one table of constants (GENERATIONS);
- generate: many prompts x many samples in one batch, with a KV cache and an optional tool (GSM8K's calculator);
- Tokenizer: a thin chat wrapper over tiktoken (nanochat's tokenizer.pkl, or a byte-level one).
Below the banner: which generation a checkpoint is, nanochat's on-disk layout (find / load / save, atomic writes)
and the safe reader of tokenizer.pkl.
"""
import errno
import functools
import inspect
import json
import math
import os
import pickle
import re
import signal
import tempfile
import textwrap
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields, replace

import tiktoken
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

varlen_attn, VARLEN_GQA = None, False  # flash attention over packed rows (packed_attention), for CUDA runs only
CUDA_BUILD = torch.backends.cuda.is_built()  # read once: a call inside a compiled forward breaks its graph
if CUDA_BUILD:  # a CPU build skips the import, which loads torch's compiler (~2 s a start)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10: packed attention is exact everywhere
        pass
    keywords = inspect.signature(varlen_attn).parameters if varlen_attn else {}
    varlen_attn = varlen_attn if "window_size" in keywords else None  # 2.10's kernel has no sliding window
    VARLEN_GQA = "enable_gqa" in keywords  # before 2.12 it takes as many key/value heads as query heads

# -----------------------------------------------------------------------------
# The GPT, in every generation that nanochat has written checkpoints of

@dataclass
class GPTConfig:
    # exactly nanochat's field names, so meta_*.json files load as they are
    sequence_len: int = 1024
    vocab_size: int = 65536
    n_layer: int = 4
    n_head: int = 2
    n_kv_head: int = 2
    n_embd: int = 256
    window_pattern: str = "L"  # S/L per layer, tiled; only generations with windows read it (and write it)


@dataclass(frozen=True)
class Generation:
    """How one span of nanochat's history computes its forward pass. Everything not listed here (rotary on the
    two halves of each head, QK-norm, ReLU^2, untied head, weightless RMSNorm, no biases) is common to all."""
    written: str  # the dates between which nanochat's master wrote checkpoints like this
    padded_vocab: bool = True  # wte and lm_head rows rounded up to a multiple of 64 (for speed; extra logits dropped)
    softcap: float = 15.0  # logits = softcap * tanh(logits / softcap)
    rotary_base: float = 10000.0
    rotary_bf16: bool = True  # cos/sin tables rounded to bfloat16 even in a float32 forward (until 2026-03-04)
    short_window: Callable[[int], int] | None = None  # sequence_len -> keys an `S` layer sees back; None: full causal
    lambdas: bool = False  # before block i: x = resid_lambdas[i] * x + x0_lambdas[i] * x0
    value_embeds: bool = False  # every other layer, ending with the last: v += gate * value_embeds[i](idx)
    ve_gate_channels: int = 32  # the gate reads this many leading channels of the attention input...
    ve_gate_scale: float = 2.0  # ...and is scale * sigmoid(.), so 1 (or 1.5) at a zero gate
    qk_scale: float = 1.0  # q and k multiplied by this after the QK-norm
    smear_backout: bool = False  # smear the previous token into each embedding; subtract a mid-stack residual


_lambdas_windows = Generation("2026-01-11 .. 2026-01-18", short_window=lambda n: n // 2, lambdas=True)
_value_embeds = replace(_lambdas_windows, written="2026-01-18 .. 2026-03-02", value_embeds=True)
_ve12_qk115 = replace(_value_embeds, written="2026-03-09 .. 2026-03-14", rotary_bf16=False, rotary_base=100000.0,
                      short_window=lambda n: math.ceil(n / 3 / 128) * 128, ve_gate_channels=12, ve_gate_scale=3.0,
                      qk_scale=1.15)
GENERATIONS = {  # oldest first; the names are those of the test fixtures
    "classic": Generation("2025-10-13 .. 2025-12-23", padded_vocab=False),
    "padded-vocab": Generation("2025-12-23 .. 2026-01-11"),
    "lambdas-windows": _lambdas_windows,
    "value-embeds": _value_embeds,
    "softcap20": replace(_value_embeds, written="2026-03-02 .. 2026-03-09", softcap=20.0, rotary_bf16=False),
    "ve12-qk115": _ve12_qk115,
    "smear-backout": replace(_ve12_qk115, written="2026-03-14 .. today", qk_scale=1.2,
                             short_window=lambda n: math.ceil(n / 4 / 128) * 128, smear_backout=True),
}
MASKED_CUDA_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CHECKPOINT_LOGITS = 2 ** 24  # token_logprobs recomputes the head's logits in the backward from this size (64 MiB)
HEAD_CHUNK = 2 ** 27  # logits a chunk of token_logprobs' head, at most: a chunk's backward holds ~24 bytes an
# element with the entropies (bf16 and float32 logits, log-softmax, its exp, their gradients; measured), 3.2 GB here
SMEAR_GATE_CHANNELS = 24  # the smear gate reads this many leading channels of the token's embedding


def log_mass_outside(log_p, ids):
    """log_p [N, V] (log-probs), ids [N, k] -> [N]: the log of the probability of every token not in ids; 0 when ids
    hold the whole vocabulary (there is no such token, and no -inf to poison a gradient)."""
    if ids.size(1) >= log_p.size(1):
        return log_p.new_zeros(log_p.size(0))
    return log_p.scatter(1, ids, -math.inf).logsumexp(dim=1)


def softcap_logits(logits, cap):
    return cap * torch.tanh(logits / cap)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))  # no learnable weight, as in nanochat


def rotary_tables(length, head_dim, base, round_to_bf16):
    """-> cos, sin [length, head_dim / 2] for positions 0 .. length - 1, in float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    if round_to_bf16:  # as older nanochat: its tables were bf16 buffers, so their values carry bf16 rounding
        cos, sin = cos.bfloat16().float(), sin.bfloat16().float()
    return cos, sin


def rotary(x, cos, sin):
    """x: [B, T, H, hd]. Rotate the two halves of each head by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


class KVCache:
    """Keys and values of every layer for a batch of left-padded rows: one tensor per layer (not one tensor for all: a
    compiled step that writes into a view of a larger tensor copies all of it), [B, n_kv_head, max_len + 1, hd].

    Row b holds pad[b] padding columns, then its prompt, then what it generated, and writes from pos[b] (rows part
    where a forward takes more tokens of some: forced runs); the last column is spare (what a forward computes past
    a row's tokens); `length`: the columns rows have written (at most: a finished row stays put). `previous`: each
    row's last normalised token embedding [B, C], which the smear of the next token reads (smear only).

    Static (after make_static): a step's keys are all the columns, those not written yet masked out (flash
    attention on a GPU reads each row's written columns only, cached_attention, which wants a row's keys in one
    contiguous run: the tensors turn to [B, max_len + 1, n_kv_head, hd]), every write in place: a decode step has
    the same shapes, memory and kernel arguments every time, so it can be captured once as a CUDA graph."""

    def __init__(self, n_layer, pad, max_len):
        self.n_layer, self.pad, self.max_len = n_layer, pad, max_len
        self.k = self.v = self.previous = None  # allocated on first write, in the dtype the model computes in
        self.pos, self.length = torch.zeros_like(pad), 0
        self.static, self.flash, self.columns = False, False, None  # columns: a forward's, [B, T] (attention_masks)

    def make_static(self, n_head):
        """Static shapes from here on (n_head: the queries' heads, for the flash kernel's check)."""
        self.static = True
        for layer in range(self.n_layer if self.k is not None else 0):  # columns before heads: one copy a call,
            for cache in (self.k, self.v):  # a layer at a time (the plan counts one cache, not two)
                cache[layer] = cache[layer].transpose(1, 2).contiguous()
        self.flash = self.k is not None and flash_decode_takes(self.k[0], n_head)

    def update(self, layer, k, v):
        """Store k, v ([B, H, T, hd]) after the current position; return all keys and values so far as [B, H, S, hd]
        (static: all the columns, a view of the [B, max_len + 1, H, hd] tensors)."""
        if self.k is None:
            (B, H, _, hd), S = k.shape, self.max_len + 1
            shape = (B, S, H, hd) if self.static else (B, H, S, hd)
            self.k, self.v = ([new.new_zeros(shape) for _ in range(self.n_layer)] for new in (k, v))
        rows = torch.arange(k.size(0), device=k.device)[:, None]
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):  # each row from its own column: [B, T, H, hd]
            (cache if self.static else cache.transpose(1, 2))[rows, self.columns] = new.transpose(1, 2)
        end = min(self.length + k.size(2), self.max_len)  # dynamic: the columns running rows have written
        return tuple(c.transpose(1, 2) if self.static else c[:, :, :end] for c in (self.k[layer], self.v[layer]))

    def select(self, rows):
        """Keep only these rows (repeat a row to share its prompt's cache among samples, drop finished rows). A static
        cache shrinks in place: the rows move to the front of its memory, which it keeps (no second cache at once)."""
        self.pad, self.pos = self.pad[rows], self.pos[rows]
        if self.static:
            for cache in self.k + self.v:
                cache[:len(rows)] = cache[rows]
            self.k, self.v = [keys[:len(rows)] for keys in self.k], [values[:len(rows)] for values in self.v]
        else:
            self.k, self.v = [keys[rows] for keys in self.k], [values[rows] for values in self.v]
        self.previous = self.previous[rows] if self.previous is not None else None


class CausalSelfAttention(nn.Module):
    def __init__(self, config, generation, has_value_embed):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.qk_scale, self.ve_gate_scale = generation.qk_scale, generation.ve_gate_scale
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        # one gate per KV head, read off the first few channels of this layer's input
        self.ve_gate = nn.Linear(generation.ve_gate_channels, self.n_kv_head, bias=False) if has_value_embed else None

    def forward(self, x, value_embed, cos_sin, attn_mask, cache, layer, pack=None):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if value_embed is not None:  # a token-dependent bias on the values, gated per KV head
            gate = self.ve_gate_scale * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate.in_features]))  # [B, T, H_kv]
            v = v + (gate[..., None] * value_embed.view(B, T, self.n_kv_head, self.head_dim)).to(v.dtype)
        q, k = norm(rotary(q, *cos_sin)), norm(rotary(k, *cos_sin))  # rotary first, then QK-norm
        if self.qk_scale != 1.0:  # sharpens attention beyond SDPA's 1/sqrt(hd)
            q, k = q * self.qk_scale, k * self.qk_scale
        # CUDA's autocast runs rms_norm in float32, and SDPA casts its inputs to bf16 itself, every call: cast q and k
        # here, the same rounding, so that the KV cache holds what attention reads (half the bytes of float32, and no
        # cast of the whole cache in every decode step). A no-op without autocast and on the CPU.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if pack is not None:  # B = 1: rows packed one after another, each attending within itself only
            y = packed_attention(q[0], k[0], v[0], pack, attn_mask, self.window, self.n_kv_head != self.n_head)
            return self.c_proj(y.reshape(B, T, C))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, H_kv, S, hd] with S = everything cached so far
            if cache.static and cache.flash and T == 1:  # a GPU's decode step (flash_decode_takes)
                return self.c_proj(cached_attention(q, cache, layer, self.window).reshape(B, T, C))
        # On a GPU, SDPA's first choice for a masked call may be cuDNN attention, which builds a plan for every new
        # shape (~14 ms of CPU each); efficient attention takes any shape as it comes (math where it cannot, GQA).
        backends = sdpa_kernel(MASKED_CUDA_ATTENTION) if attn_mask is not None and q.is_cuda else nullcontext()
        with backends:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                               enable_gqa=self.n_kv_head != self.n_head)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def packed_attention(q, k, v, pack, mask, window, gqa):
    """Causal attention of rows packed into one sequence: q [T, H, hd], k, v [T, H_kv, hd] -> [T, H, hd], each row
    attending to its own earlier tokens only (and within `window` keys back). pack (GPT.hidden): each row's span,
    as cu_seqlens [S + 1] (the tail's padding in spans of at most L more) and as a padded block of flat indices
    rows [R, L].
    On CUDA in bf16/fp16 flash attention over the spans (varlen_attn); elsewhere, and exact: the rows gathered into
    the padded block, causal attention there (mask: the window's, [L, L], or None), and scattered back. Neither
    ever lets a token see another row."""
    L = pack["max_len"]
    reach = -1 if window is None or window >= L - 1 else window  # -1: the whole row back
    if flash_varlen(q):
        if gqa and not VARLEN_GQA:
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))  # [T, H, hd]
        grouped = {"enable_gqa": gqa} if VARLEN_GQA else {}
        return varlen_attn(q, k, v, pack["cu_seqlens"], pack["cu_seqlens"], L, L, window_size=(reach, 0), **grouped)
    q, k, v = (t[pack["rows"]].transpose(1, 2) for t in (q, k, v))  # [R, H, L, hd]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    return y.transpose(1, 2).flatten(0, 1)[pack["flat"]]  # [R * L, H, hd] -> [T, H, hd]


def cached_attention(q, cache, layer, window):
    """A decode step's attention on a GPU: q [B, H, 1, hd], the static cache's layer -> [B, H, hd].
    Flash attention over each row's written columns only (varlen_attn's seqused_k: from the row's first real column,
    its padding skipped, through this step's), where the masked path reads all S columns of every row: a step's
    attention costs what the replies so far hold, not the cache's full length."""
    k, v = cache.k[layer], cache.v[layer]  # [B, S, H_kv, hd]
    B, S = k.shape[:2]
    # spans from 0: an empty one first (no query; the first row's padding), then row b's from its first real column
    rows = torch.arange(B + 1, device=q.device)
    queries = torch.cat([rows[:1], rows]).int()  # [B + 2]
    keys = torch.cat([rows[:1], rows[:-1] * S + cache.pad, rows[-1:] * S]).int()  # [B + 2]
    written = torch.cat([rows[:1], cache.pos + 1 - cache.pad]).int()  # [B + 1]: through the column this step wrote
    reach = -1 if window is None or window >= S - 1 else window
    grouped = {"enable_gqa": k.size(2) != q.size(2)} if VARLEN_GQA else {}
    return varlen_attn(q.transpose(1, 2).flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), queries, keys, 1, S,
                       window_size=(reach, 0), seqused_k=written, **grouped)


DECODE_FLASH = {"failed": False}  # a kernel that refused the decode step's call once is not tried again


def flash_decode_takes(keys, n_head):
    """Whether a static cache's decode steps attend through cached_attention: flash attention takes queries of this
    dtype and head size (flash_varlen), with grouped heads if any, and the kernel takes the call, tried once a cache
    on its first row (a torch build or GPU whose flash kernel refuses seqused_k leaves the masked attention to do
    the work, after one note, instead of ending the run). keys: a layer's cache [B, S, H_kv, hd]."""
    q = keys.new_zeros(1, n_head, keys.size(-1))
    if DECODE_FLASH["failed"] or not flash_varlen(q) or not (VARLEN_GQA or n_head == keys.size(2)):
        return False
    spans = torch.tensor([0, 0, 1], dtype=torch.int32, device=keys.device)  # as cached_attention's: an empty first
    grouped = {"enable_gqa": n_head != keys.size(2)} if VARLEN_GQA else {}
    try:
        with torch.no_grad():
            varlen_attn(q, keys[0], keys[0], spans, spans * keys.size(1), 1, keys.size(1), window_size=(-1, 0),
                        seqused_k=spans[1:].clone(), **grouped)
        return True
    except RuntimeError as e:
        DECODE_FLASH["failed"] = True
        print(f"note: flash attention does not take the decode step's call here ({str(e).splitlines()[0][:200]}); "
              "the decode reads the whole cache, masked")
        return False


def flash_varlen(q):
    """Whether packed attention runs varlen_attn on these queries. (The CPU suite forces this branch with a strict
    stand-in of the kernel.)"""
    return flash_varlen_takes(q.is_cuda, q.dtype, q.size(-1))


def flash_varlen_takes(cuda, dtype, head_dim):
    """varlen_attn's flash kernels take CUDA bf16/fp16 with a head size that is a multiple of 8, up to 256 (also
    read by grpo.py's memory plan, which counts the exact path's padded block elsewhere). torch before 2.11 has
    none that takes a window: there every device is exact. (A CPU build plans a GPU as the newest torch runs it.)"""
    kernel = varlen_attn is not None or not CUDA_BUILD
    return cuda and kernel and dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 and head_dim <= 256


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, generation, has_value_embed):
        super().__init__()
        self.attn = CausalSelfAttention(config, generation, has_value_embed)
        self.mlp = MLP(config)

    def forward(self, x, value_embed, cos_sin, attn_mask, cache, layer, pack=None):
        x = x + self.attn(norm(x), value_embed, cos_sin, attn_mask, cache, layer, pack)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config, generation="padded-vocab", padded_vocab_size=None):
        """generation: a key of GENERATIONS. The default, nanochat's classic math with a padded vocabulary, is
        what models from scratch use: the simplest GPT that nanochat loads."""
        super().__init__()
        if config.n_embd % config.n_head or config.n_head % config.n_kv_head or (config.n_embd // config.n_head) % 2:
            raise ValueError(f"inconsistent model config {config}: n_head must divide n_embd into an even head_dim, "
                             "and n_kv_head must divide n_head")
        self.config, self.generation_name = config, generation
        gen = self.generation = GENERATIONS[generation]
        V = padded_vocab_size or ((config.vocab_size + 63) // 64 * 64 if gen.padded_vocab else config.vocab_size)
        L, kv_dim = config.n_layer, config.n_kv_head * (config.n_embd // config.n_head)
        # Per-layer attention reach: `L` layers see sequence_len keys back, `S` layers fewer; the last layer is L.
        if gen.short_window:
            if not config.window_pattern or set(config.window_pattern) - set("SL"):
                raise ValueError(f"window_pattern {config.window_pattern!r} must be a string of S and L")
            long_short = {"L": config.sequence_len, "S": gen.short_window(config.sequence_len)}
            self.windows = [long_short[config.window_pattern[i % len(config.window_pattern)]] for i in range(L - 1)]
            self.windows.append(config.sequence_len)
        else:
            self.windows = [None] * L  # full causal attention
        value_embed_layers = [i for i in range(L) if gen.value_embeds and i % 2 == (L - 1) % 2]
        # Parameters in nanochat's order, so that a saved state dict lists its keys as nanochat's does.
        if gen.lambdas:
            self.resid_lambdas = nn.Parameter(torch.ones(L))
            self.x0_lambdas = nn.Parameter(torch.zeros(L))
        if gen.smear_backout:
            self.smear_lambda = nn.Parameter(torch.zeros(1))
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, config.n_embd),
            h=nn.ModuleList([Block(config, gen, i in value_embed_layers) for i in range(L)]),
        ))
        for block, window in zip(self.transformer.h, self.windows):
            block.attn.window = window  # packed attention takes it from here (masks: attention_masks)
        self.lm_head = nn.Linear(config.n_embd, V, bias=False)
        if gen.smear_backout:
            self.smear_gate = nn.Linear(SMEAR_GATE_CHANNELS, 1, bias=False)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(V, kv_dim) for i in value_embed_layers})
        # Rotary tables for positions 0 .. 10 x sequence_len, computed once and eagerly, as nanochat does; not in the
        # state dict. A forward only looks rows up: cos/sin recomputed inside a compiled graph differ in their last
        # bits, which the classic tables' bf16 rounding turns into whole bf16 steps (other logits than nanochat's).
        cos, sin = rotary_tables(10 * config.sequence_len, config.n_embd // config.n_head, gen.rotary_base,
                                 gen.rotary_bf16)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        self.disk_dtypes = {}  # state-dict key -> dtype on disk, where not float32 (filled by the loader)
        self.lora, self.lora_scale, self.lora_enabled = None, 0.0, False  # adapters: see add_lora
        # token_logprobs' forward and the static decode step through torch.compile (compiled_hidden and
        # compiled_decode_step, below the banner)
        self.use_compile = False

    @torch.no_grad()
    def init_weights(self, seed=0):
        """A fresh model (the `scratch` start): small random weights, zero output projections as in nanochat;
        the per-layer scalars start where they change nothing (resid 1, x0 / smear / backout 0)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                p.zero_()
            elif name == "resid_lambdas":
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            elif "wte" in name or "value_embeds" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.001)
            else:
                fan_in = p.size(1)
                gain = min(1.0, math.sqrt(p.size(0) / fan_in))
                p.copy_(torch.randn(p.shape, generator=gen) * gain / math.sqrt(fan_in))
        return self

    def attention_masks(self, T, cache, device, counts=None):
        """-> positions [B or 1, T] and one boolean mask per layer ([B or 1, 1, T, S], True = may attend), or
        None for a layer where plain causal attention is exact (SDPA's fast path). counts [B]: the tokens of each
        row in the T columns (generate's forced runs), None: all T. Sets cache.columns, where rows write."""
        if cache is None:  # a plain causal forward from position 0
            query = key = torch.arange(T, device=device)
            positions, column, last = query[None], query[:, None], T - 1  # column: [T, 1] against the keys [S]
            allowed = key[None, :] <= column  # [T, S]
        else:  # continue left-padded rows from the cache's position(s)
            steps = torch.arange(T, device=device)  # a row's columns past its counts (or its budget): the spare one
            query = torch.where(steps < (T if counts is None else counts[:, None]), cache.pos[:, None] + steps,
                                cache.max_len).clamp(max=cache.max_len)  # [B, T] the column of each new token
            cache.columns = query
            S = cache.max_len + 1 if cache.static else min(cache.length + T, cache.max_len)
            key, column = torch.arange(S, device=device), query[..., None]  # [S], [B or 1, T, 1]
            # padding does not move positions; the spare column takes 0 (what is computed there is never read)
            positions = torch.where(query < cache.max_len, query - cache.pad[:, None], 0).clamp(min=0)  # [B, T]
            real = key[None, None, :] >= cache.pad[:, None, None]  # [B, 1, S]
            # A padding query may see itself, so no softmax row is empty (an all -inf row would give NaN).
            allowed = (key <= column) & (real | (key == column))  # [B, T, S]
            last = min(S, cache.max_len) - 1  # the last column a query reads, a Python int (no sync)
        if last >= self.rotary_cos.size(0):
            raise ValueError(f"{last + 1} positions do not fit this model's rotary tables ({self.rotary_cos.size(0)}"
                             " positions, 10 x sequence_len): use shorter prompts or replies")
        masks = {}
        for window in set(self.windows):
            if window is not None and window < last:  # query q sees keys q - window .. q: window + 1 of them
                masks[window] = (allowed & (key >= column - window)).unsqueeze(-3)  # a dim for heads
            else:  # no query reaches past its window here
                masks[window] = None if cache is None else allowed.unsqueeze(-3)
        return positions, [masks[window] for window in self.windows]

    def hidden(self, idx, cache=None, pack=None, counts=None):
        """idx: [B, T] token ids -> final normalised hidden states [B, T, C]. pack: idx is [1, T], rows packed one
        after another (and padding at the tail), described by pack_rows; each row is computed as if it were alone:
        its rotary positions from 0, its attention (and window) within itself, no smear from the row before.
        counts [B] (with a cache): row b's tokens are its first counts[b], the rest of its T computed and not kept."""
        B, T = idx.shape
        gen = self.generation
        if pack is None:
            positions, masks = self.attention_masks(T, cache, idx.device, counts)
        else:  # the masks are those of one row of the padded block packed_attention's fallback gathers
            positions, masks = pack["offsets"][None], self.attention_masks(pack["max_len"], None, idx.device)[1]
        # [B or 1, T, 1, head_dim / 2]
        cos_sin = (self.rotary_cos[positions][:, :, None], self.rotary_sin[positions][:, :, None])
        device_type = idx.device.type  # cast once to the dtype q and k will have, not twice in every layer
        autocast = torch.is_autocast_enabled(device_type)
        compute_dtype = torch.get_autocast_dtype(device_type) if autocast else torch.float32
        cos_sin = tuple(table.to(compute_dtype) for table in cos_sin)
        x = norm(self.transformer.wte(idx))
        if gen.smear_backout:
            # Smear: x[t] += smear_lambda * sigmoid(gate(x[t])) * x[t-1] from each row's position 1 on, so the first
            # real token of a left-padded row gets nothing. The cache carries each row's last x to the next call.
            before = cache.previous if cache is not None and cache.previous is not None else torch.zeros_like(x[:, 0])
            previous = torch.cat([before[:, None], x[:, :-1]], dim=1)  # [B, T, C]
            last = x[:, -1] if counts is None else x[torch.arange(B, device=x.device), counts - 1]
            if cache is not None and cache.static:
                cache.previous.copy_(last)  # in place: a captured step reads and writes the same memory
            elif cache is not None:
                cache.previous = last
            gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :SMEAR_GATE_CHANNELS]))  # [B, T, 1]
            x = x + gate * previous * (positions >= 1)[..., None]
        x0 = x
        kept = None
        for layer, block in enumerate(self.transformer.h):
            if gen.lambdas:
                x = self.resid_lambdas[layer] * x + self.x0_lambdas[layer] * x0
            value_embed = self.value_embeds[str(layer)](idx) if str(layer) in self.value_embeds else None
            x = block(x, value_embed, cos_sin, masks[layer], cache, layer, pack)
            if gen.smear_backout and layer == self.config.n_layer // 2:
                kept = x
        if kept is not None:  # backout: take part of the mid-stack residual back out before the head
            x = x - self.backout_lambda * kept
        if cache is not None:
            cache.pos.add_(T if counts is None else counts).clamp_(max=cache.max_len)  # in place (a run: one sync)
            cache.length = min(cache.length + T, cache.max_len) if counts is None or cache.static else int(
                cache.pos.max())
        return norm(x)

    def logits(self, x, softcap=True):
        """Hidden states [..., C] -> float32 logits [..., vocab_size], softcapped."""
        logits = self.lm_head(x)[..., :self.config.vocab_size]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32, or a float64 model's own
        return softcap_logits(logits, self.generation.softcap) if softcap else logits

    def forward(self, idx, cache=None, softcap=True):
        return self.logits(self.hidden(idx, cache), softcap)

    def token_logprobs(self, idx, targets, temperature=1.0, with_entropy=False, positions=None, pack=None,
                       chunk_size=None, entropy_grad=True, top_ids=None):
        """log softmax(logits / temperature) at the targets: idx, targets [B, T] -> [B, T] float32; with_entropy:
        also the entropy of that distribution at every position, -sum_v p_v log p_v -> ([B, T], [B, T]), with its
        gradient unless entropy_grad is False.
        positions [K] (flat indices into [B * T]): the head runs at these positions only, and the others are 0.
        The trainer passes those of the loss mask, computed on the host: a prompt's positions are never in the loss,
        the head is much of a forward pass's cost, and a boolean mask would make the host wait for the device.
        pack: idx and targets [1, T] hold packed rows (hidden, pack_rows).
        top_ids [B, T, k] (a teacher's top_logprobs): also the log-probs of these tokens, [B, T, k], and the log of
        the mass of all the others, [B, T] (None when the k tokens are the whole vocabulary), after the others.

        The full [B, T, V] logits are never materialised: the head runs over chunks of positions (chunk_size,
        default HEAD_CHUNK // V: 2,048 at V = 65,536), and each chunk is recomputed in the backward pass rather than
        kept alive (with V = 65,536 a single [16, 512, V] float32 tensor is 2 GiB, and softcap + log_softmax would
        keep several). Logits under CHECKPOINT_LOGITS elements (a tiny vocabulary) are kept: the same numbers."""
        x = self.hidden_at(idx, positions, pack)  # [K, C] (or [B*T, C])
        per_position = [targets.flatten()] + ([] if top_ids is None else [top_ids.flatten(0, 1)])
        if positions is not None:
            per_position = [t[positions] for t in per_position]  # [K], [K, k]

        head = compiled_head_logprobs() if self.use_compile else GPT.head_logprobs
        chunk_logprobs = functools.partial(head, self, temperature=temperature, with_entropy=with_entropy,
                                           entropy_grad=entropy_grad)
        out = []
        chunk_size = chunk_size or max(1, HEAD_CHUNK // self.lm_head.out_features)
        for i in range(0, max(x.size(0), 1), chunk_size):  # at least one chunk, empty when nothing is asked for
            args = (x[i:i + chunk_size], per_position[0][i:i + chunk_size])
            ids = {"top_ids": per_position[1][i:i + chunk_size]} if top_ids is not None else {}
            recompute = torch.is_grad_enabled() and args[0].size(0) * self.lm_head.out_features >= CHECKPOINT_LOGITS
            out.append(checkpoint(chunk_logprobs, *args, use_reentrant=False, **ids) if recompute else
                       chunk_logprobs(*args, **ids))
        results = self.at_every_position([torch.cat(parts) for parts in zip(*out)], targets, positions)
        if top_ids is not None and top_ids.size(-1) >= self.config.vocab_size:
            results[-1] = None  # no other tokens: no mass outside the k
        return tuple(results) if len(results) > 1 else results[0]

    def hidden_at(self, idx, positions, pack):
        """The final hidden states of idx [B, T] at these flat positions [K] (all: None) -> [K, C], compiled with
        use_compile."""
        forward = compiled_hidden(static=pack is not None) if self.use_compile else GPT.hidden
        x = forward(self, idx, pack=pack).flatten(0, 1)  # [B*T, C]
        return x if positions is None else x[positions]

    @staticmethod
    def at_every_position(results, targets, positions):
        """Per-position results [K, ...] (or [B*T, ...]) -> [B, T, ...], zeros where no position was asked for."""
        if positions is not None:
            results = [r.new_zeros((targets.numel(),) + r.shape[1:]).index_copy(0, positions, r) for r in results]
        return [r.view(targets.shape + r.shape[1:]) for r in results]

    @torch.no_grad()
    def top_logprobs(self, idx, k, temperature=1.0, positions=None, pack=None):
        """The k most likely tokens of log softmax(logits / temperature) at every position (a teacher's, for
        --distill-divergence forward): idx [B, T] -> (ids [B, T, k], their log-probs [B, T, k], the log of the mass
        of all the others [B, T], None when k covers the vocabulary), zeros where positions asks for none. The head
        runs over chunks of positions, as in token_logprobs."""
        x = self.hidden_at(idx, positions, pack)  # [K, C]
        k = min(k, self.config.vocab_size)
        out, chunk_size = [], max(1, HEAD_CHUNK // self.lm_head.out_features)
        for i in range(0, max(x.size(0), 1), chunk_size):
            logits = self.logits(x[i:i + chunk_size])
            log_p = (logits / temperature if temperature != 1.0 else logits).log_softmax(dim=1)  # [N, V]
            values, ids = log_p.topk(k, dim=1)  # [N, k]
            out.append((ids, values, log_mass_outside(log_p, ids)))
        ids, values, rest = self.at_every_position([torch.cat(parts) for parts in zip(*out)], idx, positions)
        return ids, values, rest if k < self.config.vocab_size else None

    def head_logprobs(self, x, targets, temperature, with_entropy, entropy_grad=True, top_ids=None):
        """token_logprobs' head on one chunk of positions: x [N, C], targets [N] -> (log-probs [N],), then the
        entropies [N] with_entropy, then with top_ids [N, k] their log-probs [N, k] and the log of the mass of all
        the other tokens [N] (0 when there are none). log_softmax is one fused kernel each way, where logsumexp and
        a gather of the logits took several and their backwards two [N, V] passes more; compiled (use_compile), the
        casts, softcap and temperature fuse into it too: eager, the head was a third of a d20 update on an H200."""
        logits = self.logits(x)  # [N, V]
        if temperature != 1.0:
            logits = logits / temperature
        log_p = logits.log_softmax(dim=1)
        out = (log_p.gather(1, targets[:, None]).squeeze(1),)
        if with_entropy:
            # entropy_grad False: entropies only to be logged, off the graph, so their [N, V] exp and product are
            # not kept for a backward pass (8 of the chunk's ~24 bytes a logit)
            p_log = log_p if entropy_grad else log_p.detach()
            out += (-(p_log.exp() * p_log).sum(dim=1),)
        if top_ids is not None:
            out += (log_p.gather(1, top_ids), log_mass_outside(log_p, top_ids))
        return out

    # LoRA (Hu et al. 2021): every matrix W [out, in] inside the blocks computes W x + (alpha / r) B A x, with
    # A [r, in] and B [out, r] the only weights that train. Each adapter is a forward hook on its nn.Linear, so the
    # blocks' code and the model's state-dict keys are nanochat's, with or without adapters.
    LORA_TARGETS = ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

    def lora_targets(self):
        """-> [(state-dict name of the matrix, its nn.Linear)] for every adapted matrix, in layer order."""
        return [(f"transformer.h.{layer}.{target}", block.get_submodule(target))
                for layer, block in enumerate(self.transformer.h) for target in self.LORA_TARGETS]

    def add_lora(self, rank, alpha, seed=0):
        """Freeze every weight and give each block matrix an adapter; B = 0, so the adapted model is exactly
        this one until the first update. The adapters are self.lora: "<matrix name, _ for .>_A" and "..._B"."""
        self.requires_grad_(False)
        self.lora, self.lora_scale, self.lora_enabled = nn.ParameterDict(), alpha / rank, True
        for name, linear in self.lora_targets():
            key = name.replace(".", "_")
            self.lora[key + "_A"] = nn.Parameter(linear.weight.new_empty(rank, linear.in_features))
            self.lora[key + "_B"] = nn.Parameter(linear.weight.new_empty(linear.out_features, rank))
            linear.register_forward_hook(self._lora_hook(*self.lora_pair(name)))
        self.reset_lora(seed)
        return self

    def lora_pair(self, name):
        """-> (A, B) of the matrix of this state-dict name (without ".weight")."""
        key = name.replace(".", "_")
        return self.lora[key + "_A"], self.lora[key + "_B"]

    def _lora_hook(self, A, B):
        def hook(linear, inputs, output):
            if self.lora_enabled:  # off: the base model itself (the reference of the KL term)
                return output + self.lora_scale * F.linear(F.linear(inputs[0], A), B)
        return hook

    @torch.no_grad()
    def reset_lora(self, seed):
        """A as nn.Linear initialises its weights (uniform, +-1/sqrt(in)), from this seed; B = 0."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.lora.items():
            if name.endswith("_A"):
                bound = 1 / math.sqrt(p.size(1))
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
            else:
                p.zero_()

    def lora_delta(self, name):
        """(alpha / r) B A [out, in]: what the adapter adds to the matrix of this state-dict name."""
        A, B = self.lora_pair(name)
        return self.lora_scale * (B @ A).detach()

    @torch.no_grad()
    def merge_lora(self, seed):
        """Fold the adapters into the base matrices and restart them (new A, B = 0): the model computes the same
        function (up to rounding), and the base, the reference of the KL term, has moved to it."""
        for name, linear in self.lora_targets():
            linear.weight += self.lora_delta(name)
        self.reset_lora(seed)

    @contextmanager
    def lora_disabled(self):
        """The base model, for as long as the with-block runs (a no-op without adapters)."""
        enabled, self.lora_enabled = self.lora_enabled, False
        try:
            yield self
        finally:
            self.lora_enabled = enabled

    def merged_state_dict(self):
        """nanochat's state dict of the model as it computes now: each adapted matrix with its adapter folded in,
        no adapter keys. Without adapters, state_dict() itself."""
        state = self.state_dict()
        if self.lora is None:
            return state
        state = {k: v for k, v in state.items() if not k.startswith("lora.")}
        for name, _ in self.lora_targets():
            state[name + ".weight"] = state[name + ".weight"] + self.lora_delta(name)
        return state


# -----------------------------------------------------------------------------
# The sampler

def sample_tokens(raw_logits, temperature, top_k, uniform, softcap):
    """Raw (not yet softcapped) logits [N, V] and uniform noise [N] in [0, 1) -> token ids [N], and the log-prob
    of each under the distribution it was drawn from (softcap, temperature, top-k renormalised) [N].
    temperature 0 is greedy (log-prob 0: the token was certain).

    The softcap is monotonic, so greedy and the top-k set can be read off the raw logits and the
    softcap applied to the k survivors only: over a 65,536 vocabulary that, and sampling by inverse
    CDF rather than torch.multinomial, is most of the sampler's time on a CPU."""
    if temperature == 0:
        return raw_logits.argmax(dim=-1), torch.zeros(raw_logits.size(0), device=raw_logits.device)
    if top_k:
        values, indices = torch.topk(raw_logits, min(top_k, raw_logits.size(-1)), dim=-1)  # [N, k]
    else:
        values, indices = raw_logits, None
    probs = F.softmax(softcap_logits(values, softcap) / temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    # The first token whose cdf exceeds the draw (right side), the draw held below the total: that token's cdf is
    # above the one before it, so its probability is > 0, also for a draw of exactly 0 before tokens of probability
    # 0 (the left side would take the first of them) and for a draw that rounds up to the total after them.
    draw = torch.minimum(uniform[:, None] * cdf[:, -1:], torch.nextafter(cdf[:, -1:], torch.zeros_like(cdf[:, -1:])))
    choice = torch.searchsorted(cdf, draw, right=True)  # [N, 1]
    logprob = torch.log(probs.gather(1, choice) / cdf[:, -1:]).squeeze(1)
    return (choice if indices is None else indices.gather(1, choice)).squeeze(1), logprob


@torch.no_grad()
def generate(model, tokenizer, prompts, num_samples=1, max_new_tokens=256, temperature=1.0, top_k=None, seed=0,
             tool=None, decode="auto", ends=None, respond=None, max_turn_tokens=None):
    """Sample `num_samples` replies for each prompt (lists of token ids, any lengths), all in one batch.
    `seed` is an int, or one int per prompt. `tool` (a task's, e.g. GSM8K's calculator) maps the text of a
    <|python_start|> .. <|python_end|> block to a string forced into the reply, or to None (nothing forced).
    `decode`: "dynamic": attention over the columns written so far, finished rows leave the batch (the CPU's default).
    "static": the same shapes every step (KVCache.make_static), finished rows staying, masked, until half the batch
    has finished: then it halves. "graph": static, each batch size's step a captured CUDA graph (CUDA's default:
    small kernels are bound by launches); compiled with model.use_compile. The same tokens either way, up to rounding.
    `ends` (the self-check's): [N] the step at which each row is made to end, its stop token forced (mask 0), or -1.
    `respond` (episodes of several turns): respond(row, tokens, mask), the row's output index and its tokens and
    mask so far (lists), called when a row samples <|assistant_end|> (rows in no set order), returns the next user
    message, forced into the row as <|user_start|> message <|user_end|> <|assistant_start|> (mask 0, log-prob 0, as
    render_conversation has it), or None: the row ends. A sampled <|bos|> ends a row, unasked. Forced tokens take
    columns of max_new_tokens and go through the model in runs (next_columns), rows then at columns of their own.
    `max_turn_tokens` (with respond): a turn that has sampled this many gets its <|assistant_end|> forced (mask 0),
    the environment asked as after a sampled one: turns, not the budget, end a babbling row.

    Returns a dict of tensors with one row per sample, prompt-major (row p * num_samples + g):
      tokens [N, max_new_tokens]: the reply, padded with 0 after it ends;
      mask [N, max_new_tokens]: 1 where the policy sampled the token (the stop token included), 0 where the
        tool or the environment (respond, max_turn_tokens) forced it and on padding;
      logprobs [N, max_new_tokens]: each sampled token's log-prob under the distribution it was drawn from
        (temperature, top-k renormalised, softcap), 0 for forced tokens and padding;
      lengths [N]: reply length including the stop token and forced tokens; truncated [N]: the reply (an episode:
      the whole of it) hit max_new_tokens before a stop token. On the CPU, where callers decode and grade them."""
    if decode not in ("auto", "dynamic", "static", "graph"):
        raise ValueError(f"decode={decode!r}: expected auto, dynamic, static or graph")
    device = model.lm_head.weight.device
    decode = decode if decode != "auto" else "graph" if device.type == "cuda" else "dynamic"
    P, G, N = len(prompts), num_samples, len(prompts) * num_samples
    # All randomness is drawn up front from one generator per prompt, seeded `seed + p` (or seed[p]): a
    # prompt's samples do not depend on which other prompts share the batch, or on which rank runs it.
    seeds = seed if isinstance(seed, (list, tuple)) else [seed + p for p in range(P)]
    noise = torch.cat([torch.rand(G, max_new_tokens, generator=torch.Generator().manual_seed(s)) for s in seeds])
    noise = F.pad(noise, (0, 1)).to(device)  # a spare column, as the outputs' (next_columns)
    cache, logits = prefill(model, prompts, G, max_new_tokens, static=decode != "dynamic")  # [N, V]: each row's own
    step = decoder(model, cache, temperature, top_k, graph=decode == "graph")  # (token, noise) -> sampled
    sampled, sampled_logprob = sample_tokens(logits, temperature, top_k, noise[:, 0], model.generation.softcap)

    tokens, mask = (torch.zeros(N, max_new_tokens + 1, dtype=torch.long, device=device) for _ in range(2))
    logprobs = torch.zeros(N, max_new_tokens + 1, device=device)
    lengths = torch.full((N,), max_new_tokens, device=device)
    truncated, done = torch.ones(N, dtype=torch.bool, device=device), torch.zeros(N, dtype=torch.bool, device=device)
    rows = torch.arange(N, device=device)  # which output row each row of the running batch is
    col = torch.zeros(N, dtype=torch.long, device=device)  # the column each row writes (rows part at forced runs)
    forced, num_forced = (torch.zeros(N, *width, dtype=torch.long, device=device) for width in ((0,), ()))
    turn_tokens = torch.zeros(N, dtype=torch.long, device=device)  # tokens sampled in each row's current turn
    cap = max_turn_tokens if respond is not None and max_turn_tokens else max_new_tokens + 1
    stop_ids = torch.tensor([tokenizer.assistant_end, tokenizer.bos], device=device)
    ends = torch.full((N,), -1, device=device) if ends is None else torch.as_tensor(ends, device=device).long()

    # The per-step bookkeeping is tensor ops (no boolean indexing, which would sync with the device).
    while True:
        ending = ends[rows] == col
        forced_end = ending
        if respond is not None:  # episodes only: a one-turn batch's step does no more work than before
            capped = (turn_tokens >= cap) & (num_forced == 0)  # the turn's end forced at --max-turn-tokens
            forced_end = ending | capped
        is_forced = (num_forced > 0) | forced_end
        token = torch.where(num_forced > 0, forced[:, 0] if forced.size(1) else sampled, sampled)
        token = torch.where(forced_end, tokenizer.assistant_end, token).masked_fill(done, 0)
        forced, num_forced = forced.roll(-1, dims=1), (num_forced - 1).clamp(min=0)
        tokens[rows, col] = token
        mask[rows, col] = (~is_forced & ~done).long()
        logprobs[rows, col] = torch.where(is_forced | done, 0.0, sampled_logprob.float())
        stopped = ~done & (ending | ~is_forced & torch.isin(token, stop_ids))
        if respond is not None:  # a turn's end: the row runs on until the environment has said whether it answers
            turn_ends = ~done & ~ending & (~is_forced | capped) & (token == tokenizer.assistant_end)
            stopped &= ~turn_ends
            turn_tokens = torch.where(turn_ends, 0, turn_tokens + (~is_forced).long())
        lengths[rows] = torch.where(stopped, col + 1, lengths[rows])
        truncated[rows] &= ~stopped
        done |= stopped | (col == max_new_tokens - 1)  # a row on its budget's last column ends there (cut)
        calls = ~done & ~is_forced & (token == tokenizer.python_end) & (tool is not None)
        ahead, width = forced_runs(forced, num_forced, done, ends[rows], col, max_new_tokens)
        num_running, any_call, width, *any_turn_end = torch.stack([(~done).sum(), calls.any(), width] + (
            [(turn_ends & ~done).any()] if respond is not None else [])).tolist()  # one host sync a step, not a row's
        if any(any_turn_end):  # the environment answers, or the episode ends here (one copy of those rows' tokens)
            forced, num_forced, num_running = answer_turns(respond, tokenizer, tokens, mask, rows, col, turn_ends,
                                                           forced, num_forced, (lengths, truncated, done), num_running)
        if num_running == 0:
            break
        if any_call:  # the tool runs only for the rows that just closed a python block
            forced, num_forced = call_tool(tool, tokenizer, tokens, rows, col, calls, forced, num_forced)
        if any_call or any(any_turn_end):  # the queues changed
            ahead, width = forced_runs(forced, num_forced, done, ends[rows], col, max_new_tokens, sync=True)
        keep = rows_to_keep(done, num_running, decode)
        if keep is not None:
            cache.select(keep)
            rows, token, done, forced, num_forced, turn_tokens, col, ahead = (
                x[keep] for x in (rows, token, done, forced, num_forced, turn_tokens, col, ahead))
            if decode != "dynamic":
                step = decoder(model, cache, temperature, top_k, graph=decode == "graph")
        sampled, sampled_logprob, forced, num_forced, col = next_columns(
            model, step, cache, temperature, top_k, token, noise, col, tokens, rows, forced, num_forced, done, ahead,
            width)
    return {k: v[:, :max_new_tokens].cpu().contiguous() if v.dim() == 2 else v.cpu() for k, v in dict(  # spare cut
        tokens=tokens, mask=mask, logprobs=logprobs, lengths=lengths, truncated=truncated).items()}


def prefill(model, prompts, num_samples, max_new_tokens, static):
    """Every prompt through the model once, left-padded so that all rows end at the same column -> (the KV cache,
    with each prompt's rows repeated for its samples; static: KVCache.make_static; the logits of each sample's first
    token [N, V], raw)."""
    device = model.lm_head.weight.device
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    idx = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    cache = KVCache(model.config.n_layer, pad, longest + max_new_tokens)
    logits = model.logits(model.hidden(idx, cache)[:, -1], softcap=False)  # [P, V]: the head at the last column only
    shared = torch.arange(len(prompts), device=device).repeat_interleave(num_samples)
    cache.select(shared)  # every sample its own copy of its prompt's cache, and its own first token
    if static:
        cache.make_static(model.config.n_head)
    return cache, logits[shared]


def call_tool(tool, tokenizer, tokens, rows, col, calls, forced, num_forced):
    """The rows that just closed a python block at their column col (calls [B]; tokens [N, max_new_tokens + 1], rows
    [B]: generate's): the tool's answer to each block, queued to be forced into the reply, as much of it as the row's
    columns left hold -> (forced [B, longest queue], num_forced [B])."""
    calling = calls.nonzero().flatten()
    for i, row, t in zip(*torch.stack([calling, rows[calling], col[calling]]).tolist()):
        reply, room = tokens[row, :t].tolist(), tokens.size(1) - t - 2  # the row's tokens so far
        starts = [j for j, tok in enumerate(reply) if tok == tokenizer.python_start]
        result = tool(tokenizer.decode(reply[starts[-1] + 1:])) if starts else None
        if result is not None:
            queue = forced_run(tokenizer, tokenizer.output_start, result, [tokenizer.output_end], room)
            if len(queue) > forced.size(1):
                forced = F.pad(forced, (0, len(queue) - forced.size(1)))
            forced[i, :len(queue)] = torch.tensor(queue, device=forced.device)
            num_forced[i] = len(queue)
    return forced, num_forced


def forced_run(tokenizer, start, text, end, room):
    """[start] + text's tokens + end, as much of it as the row's room (columns left) holds: the rest would never be
    written. The text is cut before it is encoded, to 2 x room x the longest token's bytes (a token covers at most
    that many characters), so a 1 MiB answer costs what a budget-sized one does and the tokens queued are its own
    (unless one word of it runs past the cut)."""
    text = text[:2 * room * tokenizer.longest_token + 16]
    return ([start] + tokenizer.encode(text) + end)[:room]


def answer_turns(respond, tokenizer, tokens, mask, rows, col, turn_ends, forced, num_forced, ends, num_running):
    """The running rows that just ended a turn at their column col (turn_ends [B]; a row on its budget's last column
    is done: no room for an answer): the environment's answer to each queued to be forced, as call_tool's are; a
    row whose episode ends here ends (ends: generate's lengths, truncated, done, written in place) -> (forced,
    num_forced, the rows still running)."""
    ended = []
    running = (turn_ends & ~ends[2]).nonzero().flatten()
    running, outputs, cols = torch.stack([running, rows[running], col[running]]).tolist()
    replies, masks = (x[outputs, :max(cols) + 1].tolist() for x in (tokens, mask))  # one copy each
    for i, row, t, reply, reply_mask in zip(running, outputs, cols, replies, masks):
        message = respond(row, reply[:t + 1], reply_mask[:t + 1])
        if message is None:
            ended.append(i)
            continue
        queue = forced_run(tokenizer, tokenizer.user_start, message, [tokenizer.user_end, tokenizer.assistant_start],
                           tokens.size(1) - t - 2)
        if len(queue) > forced.size(1):
            forced = F.pad(forced, (0, len(queue) - forced.size(1)))
        forced[i, :len(queue)] = torch.tensor(queue, device=forced.device)
        num_forced[i] = len(queue)
    if ended:
        lengths, truncated, done = ends
        ended = torch.tensor(ended, device=done.device)
        lengths[rows[ended]], truncated[rows[ended]], done[ended] = col[ended] + 1, False, True
    return forced, num_forced, num_running - len(ended)


def rows_to_keep(done, num_running, decode):
    """-> the rows of the running batch [B] that go on decoding, or None (all of them). Dynamic: finished rows
    leave once a quarter of the batch has finished. Static: the batch halves once half of it has finished (a few
    sizes, each with its own captured step), the running rows first, in their order, finished ones filling it up."""
    batch = done.numel()
    if decode == "dynamic":
        return (~done).nonzero().flatten() if num_running <= 0.75 * batch else None
    if num_running > batch // 2:
        return None
    while num_running <= batch // 2:
        batch //= 2
    return torch.sort(done.int(), stable=True).indices[:batch]


# A forced run's forward holds FORCED_RUN_CHUNK + 1 tokens a row of one layer's activations (on the CPU also their
# attention scores): at 32, about 1% of the KV cache the memory plan counts a row at d20 (its full length's)
FORCED_RUN_CHUNK = 32
RAGGED_RUN = 8  # a run not every row fills: an eager forward (not a captured step) for the others, worth it if wide


def forced_runs(forced, num_forced, done, ends, col, budget, sync=False):
    """-> (ahead [B], width): the forced tokens each row can take after this step's token in the same forward (its
    queue, not at or past its `ends` step nor on its budget's last column; none if finished), the next forward's columns
    (an int if sync): 1 + the most a row takes, up to FORCED_RUN_CHUNK + 1, where every running row fills them or,
    RAGGED_RUN or more, the rows' own tokens are at least half of what it computes for them; else 1."""
    if not forced.size(1):  # nothing was ever queued (a single turn without a tool): no work a step
        return torch.zeros_like(num_forced), 1 if sync else torch.ones_like(num_forced[:1]).squeeze(0)
    ahead, to_end = torch.minimum(num_forced, budget - 2 - col).clamp(min=0), ends - col
    ahead = torch.where(to_end > 0, torch.minimum(ahead, to_end - 1), ahead).masked_fill(done, 0)
    widths, running = torch.arange(1, FORCED_RUN_CHUNK + 2, device=ahead.device), (~done).sum()  # [W], 0-dim
    own = (torch.minimum(ahead[:, None] + 1, widths) * ~done[:, None]).sum(0)  # [W]
    ragged = (2 * own >= widths * running) & (widths >= RAGGED_RUN) & (widths <= ahead.max() + 1)
    width = widths.masked_fill(~((own == widths * running) | ragged), 1).max()
    return ahead, int(width) if sync else width


def next_columns(model, step, cache, temperature, top_k, token, noise, col, tokens, rows, forced, num_forced, done,
                 ahead, width):
    """generate's step after each row's column col -> (sampled, log-probs, forced, num_forced, the next columns):
    a forward of `width` columns takes each row's token and up to width - 1 of its queued forced tokens (ahead:
    forced_runs), written here (mask, log-probs 0), not a step each. A finished row's columns are the spare one."""
    spare = tokens.size(1) - 1
    cache.pos.sub_(done.long())  # a finished row stays: it writes over its last column, reads none it did not write
    if width < 2:
        sampled = step(token, noise[rows, (col + 1).clamp(max=spare)])
        return (*sampled, forced, num_forced, torch.where(done, spare, col + 1))
    taken, steps = ahead.clamp(max=width - 1), torch.arange(1, width, device=col.device)  # [B], [width - 1]
    run = torch.cat([token[:, None], forced[:, :width - 1]], dim=1)  # [B, width]
    tokens[rows[:, None], torch.where(steps <= taken[:, None], col[:, None] + steps, spare)] = run[:, 1:]
    sampled = decode_step(model, cache, temperature, top_k, run, noise[rows, (col + taken + 1).clamp(max=spare)],
                          taken + 1)  # eager: a shape of its own
    shifted = (torch.arange(forced.size(1), device=col.device) + taken[:, None]).clamp(max=forced.size(1) - 1)
    return (*sampled, forced.gather(1, shifted), num_forced - taken, torch.where(done, spare, col + taken + 1))


# -----------------------------------------------------------------------------
# Chat format: the tokenizer

SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # the assistant calls the calculator
    "<|output_start|>", "<|output_end|>",  # the calculator's answer, forced into the reply
]


class Tokenizer:
    """A tiktoken Encoding plus nanochat's chat format."""

    def __init__(self, enc):
        missing = [s for s in SPECIAL_TOKENS if s not in enc.special_tokens_set]
        if missing:
            raise ValueError(f"tokenizer lacks the chat special tokens {missing}; is this a nanochat tokenizer?")
        self.enc = enc
        self.vocab_size = enc.n_vocab
        self.bos, self.user_start, self.user_end, self.assistant_start, self.assistant_end, \
            self.python_start, self.python_end, self.output_start, self.output_end = \
            [enc.encode_single_token(s) for s in SPECIAL_TOKENS]
        self.longest_token = max(len(b) for b in enc.token_byte_values())  # in bytes

    @classmethod
    def from_file(cls, path):
        """nanochat's tokenizer.pkl, read without running anything it names (read_tokenizer_pkl, below)."""
        return cls(read_tokenizer_pkl(path))

    @classmethod
    def byte_level(cls):
        """256 byte tokens plus the chat special tokens: no file, no training, for models from scratch."""
        enc = tiktoken.Encoding(
            name="nanogrpo-bytes",
            pat_str=r"\S+|\s+",
            mergeable_ranks={bytes([i]): i for i in range(256)},
            special_tokens={s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)},
        )
        return cls(enc)

    def encode(self, text):
        # Special-token strings inside user or model text are plain text, never control tokens.
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(list(ids), errors="replace")

    def render_conversation(self, conversation):
        """Token ids and a mask for a whole conversation; mask 1 marks what the assistant produced."""
        ids, mask = [self.bos], [0]

        def add(tokens, m):
            ids.extend(tokens)
            mask.extend([m] * len(tokens))

        messages = conversation["messages"]
        if messages[0]["role"] == "system":  # as nanochat renders one: folded into the first user message
            first = dict(messages[1], content=messages[0]["content"] + "\n\n" + messages[1]["content"])
            messages = [first] + messages[2:]
        for message in messages:
            content = message["content"]
            if message["role"] == "user":
                add([self.user_start] + self.encode(content) + [self.user_end], 0)
                continue
            add([self.assistant_start], 0)
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part["type"] == "text":
                    add(self.encode(part["text"]), 1)
                elif part["type"] == "python":
                    add([self.python_start] + self.encode(part["text"]) + [self.python_end], 1)
                elif part["type"] == "python_output":  # the tool wrote it, so the policy is never trained on it
                    add([self.output_start] + self.encode(part["text"]) + [self.output_end], 0)
                else:
                    raise ValueError(f"unknown assistant part type {part['type']!r}")
            add([self.assistant_end], 1)
        return ids, mask

    def render_for_completion(self, conversation):
        """The prompt: the conversation up to and including <|assistant_start|>, without any assistant answer."""
        messages = conversation["messages"]
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        ids, _ = self.render_conversation({"messages": messages})
        return ids + [self.assistant_start]


# =============================================================================
# Below: the decode step as one CUDA graph, and nanochat's files (which generation a checkpoint is, checkpoint I/O
# in nanochat's layout, atomic writes, the safe reader of tokenizer.pkl). Nothing here is needed to follow the
# model or the sampler above.
# =============================================================================

# -----------------------------------------------------------------------------
# The forwards compiled, and the decode step eager or captured as a CUDA graph

# Inductor keeps a fused kernel's intermediates in float32 unless told to round them where the code casts: without
# that, the rotary tables of nanochat's older generations (rounded to bf16) and every bf16 value under autocast would
# be computed more precisely than nanochat does (measured on the CPU: gradients 3.5e-3 apart, 1e-6 with).
EXACT_CASTS = {"emulate_precision_casts": True}


@functools.cache
def compiled_hidden(static):
    """GPT.hidden through torch.compile, once per process (each model it sees gets its own guards). Packed rows
    come in one static shape (padded to the token budget), so their graph is built once; unpacked batches have
    their own longest reply each, so their shapes are dynamic (a compile per length would cost more than it saves)."""
    return torch.compile(GPT.hidden, dynamic=not static, options=EXACT_CASTS)


@functools.cache
def compiled_head_logprobs():
    """GPT.head_logprobs through torch.compile, once per process: dynamic, as a pass's last chunk of positions has
    its own length."""
    return torch.compile(GPT.head_logprobs, dynamic=True, options=EXACT_CASTS)


def pack_rows(widths, total, max_rows, max_len):
    """The layout of rows of these widths packed one after another from position 0 -> (pack, as GPT.hidden takes
    it, on the host; each row's flat positions [R, width], for the trainer). total >= sum(widths): the packed length,
    padding after the rows; max_rows, max_len: the shapes the row block and cu_seqlens are padded to (static shapes
    for a compiled forward). pack: offsets [total] (each token's position in its row; 0 in the padding),
    cu_seqlens [max_rows + ceil(total / max_len) + 1] int32 (the rows' spans, then the padding's, cut into spans of
    at most max_len: flash attention computes no position of a span past the max_len it is told, forward or
    backward, and leaves it uninitialised; then empty spans), rows [max_rows, max_len]
    (each row's flat positions, its padding pointing at its own last token, unused rows at position 0), flat [total]
    (each packed position's index into rows.flatten(); the padding's at an unused slot), max_len."""
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    used = starts[-1]
    offsets = torch.zeros(total, dtype=torch.long)
    rows = torch.zeros(max_rows, max_len, dtype=torch.long)
    flat = torch.full((total,), max_rows * max_len - 1, dtype=torch.long)  # padding: the block's last slot
    for r, (start, w) in enumerate(zip(starts, widths)):
        span = torch.arange(w)
        offsets[start:start + w] = span
        rows[r] = start + torch.arange(max_len).clamp(max=w - 1)
        flat[start:start + w] = r * max_len + span
    ends = starts + list(range(used + max_len, total, max_len)) + [total]  # the padding, in spans of <= max_len
    cu_seqlens = torch.tensor(ends + [total] * (max_rows + 1 + -(-total // max_len) - len(ends)), dtype=torch.int32)
    return dict(offsets=offsets, cu_seqlens=cu_seqlens, rows=rows, flat=flat, max_len=max_len), rows[:len(widths)]


def in_rows(values, mb):
    """A pass's per-position values [1, total, ...] (packed) or [R, width, ...] -> the rows' layout [R, width, ...]."""
    return values.flatten(0, 1)[mb["row_positions"]] if values is not None and "pack" in mb else values


def batch_rows(parts, micro_batches, like):
    """One tensor of each micro-batch, [R, width, ...] in the rows' layout -> the batch's [N, T, ...] (like: [N, T]),
    zeros past a row's pass; None stays None."""
    if parts[0] is None:
        return None
    out = parts[0].new_zeros(like.shape + parts[0].shape[2:])
    for part, mb in zip(parts, micro_batches):
        out[mb["rows"], :part.size(1)] = part
    return out


def first_fit_decreasing(rows, widths, budget):
    """rows -> passes of rows whose widths sum to at most budget: each row, longest first, into the first pass with
    room (first-fit decreasing: within 11/9 of the fewest passes). A row wider than the budget (refused at start,
    plan_memory) gets a pass of its own."""
    passes, room = [], []
    for r in sorted(rows, key=lambda r: -widths[r]):  # a stable sort: equal widths keep their order
        i = next((i for i, free in enumerate(room) if free >= widths[r]), len(passes))
        if i == len(passes):
            passes.append([])
            room.append(budget)
        passes[i].append(r)
        room[i] -= widths[r]
    return passes


def pack_micro_batch(mb, widths, budget, static):
    """A micro-batch's rows [R, width] as one packed sequence: -> its input_ids and target_ids as [1, total],
    the pack GPT.hidden takes, and row_positions [R, width] (each row token's flat position in the sequence). total:
    the rows' tokens, or with static (rows, tokens a row) the budget, the tail padded, and the pack's tensors padded
    to those sizes: one shape for every pass of the run, so that a compiled forward is built once."""
    real = sum(widths)
    total, max_rows, max_len = (real, len(widths), max(widths)) if static is None else (
        max(budget, real), max(static[0], len(widths)), max(static[1], max(widths)))
    pack, row_positions = pack_rows(widths, total, max_rows, max_len)
    width = mb["input_ids"].size(1)
    row_positions = row_positions[:, :width]
    keep = torch.arange(width)[None] < torch.tensor(widths)[:, None]  # [R, width]: each row's real tokens
    packed = {}
    for k in ("input_ids", "target_ids"):
        packed[k] = torch.zeros(1, total, dtype=mb[k].dtype)
        packed[k][0, row_positions[keep]] = mb[k][keep]
    return dict(packed, pack=pack, row_positions=row_positions)


def decode_step(model, cache, temperature, top_k, token, noise, counts=None):
    """token [N] (or a run of them [N, T], row n's first counts[n]) -> (sampled [N], log-probs [N]): through the
    model with the cache, the next token sampled after each row's last."""
    x = model.hidden(token.view(token.size(0), -1), cache, counts=counts)
    x = x[:, -1] if counts is None else x[torch.arange(x.size(0), device=x.device), counts - 1]
    return sample_tokens(model.logits(x, softcap=False), temperature, top_k, noise, model.generation.softcap)


@functools.cache
def compiled_decode_step():
    """decode_step through torch.compile, for a static cache: a layer's ~40 small kernels (norms, rotary, gates,
    masks) fused into a few, which matters most inside a CUDA graph, where a step costs what its kernels do. Dynamic
    shapes: one compile serves every batch size and cache length."""
    return torch.compile(decode_step, dynamic=True, options=EXACT_CASTS)


GRAPH_CAPTURE = {"failed": False}  # a capture that failed once is not tried again in this process


def decoder(model, cache, temperature, top_k, graph):
    """-> step(token [N], noise [N]) -> (sampled [N], log-probs [N]), compiled with model.use_compile and a static
    cache. graph (CUDA, static cache): the first call captures the step and every call replays it, so its kernels
    cost one launch; the outputs are the graph's own tensors, overwritten by the next call. If the capture (or the
    compile) fails, the steps run eagerly, uncompiled, with one note."""
    eager = functools.partial(decode_step, model, cache, temperature, top_k)
    forward = compiled_decode_step() if model.use_compile and cache.static else decode_step
    step = functools.partial(forward, model, cache, temperature, top_k)
    if not graph or cache.pad.device.type != "cuda":
        return step
    if GRAPH_CAPTURE["failed"]:
        return eager
    captured = {}

    def replay(token, noise):
        if not captured:
            captured.update(capture(step, cache, token, noise))
        if captured["graph"] is None:
            return eager(token, noise)
        captured["token"].copy_(token)
        captured["noise"].copy_(noise)
        captured["graph"].replay()
        return captured["outputs"]
    return replay


def capture(step, cache, token, noise):
    """-> dict(graph, its input tensors token and noise, its outputs); graph None if the capture failed."""
    static = dict(token=token.clone(), noise=noise.clone())
    # The warm-up step writes into the cache (the column that the first replay writes again) and moves pos and the
    # smear's previous embedding: those two are put back.
    pos, previous = cache.pos.clone(), cache.previous.clone() if cache.previous is not None else None
    device = token.device
    try:
        side = torch.cuda.Stream(device)  # warm up off the default stream, as capture requires
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step(static["token"], static["noise"])  # autocast's cached casts, kernel choices, workspaces
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step(static["token"], static["noise"])  # recorded, not run
    except RuntimeError as e:
        GRAPH_CAPTURE["failed"] = True
        print(f"note: the decode step could not be compiled or captured as a CUDA graph "
              f"({str(e).splitlines()[0][:200]}); sampling runs eagerly")
        graph = outputs = None
    cache.pos.copy_(pos)
    if previous is not None:
        cache.previous.copy_(previous)
    return dict(static, graph=graph, outputs=outputs)


# -----------------------------------------------------------------------------
# The fast paths' self-check: rows that exercise them, noise where a fresh model would hide a fault, the distances.
# (grpo.py runs the rows through the update's own pass and gives the verdict.)

def distinct_lengths(prompts):
    """The prompts, each a different length (a prompt as long as an earlier one loses its first tokens): rows of a
    batch then have different left padding, whose bookkeeping as the batch shrinks is wrong or right only where it
    differs (the demo's prompts are all alike)."""
    seen = set()
    for i, prompt in enumerate(prompts):
        while len(prompt) in seen and len(prompt) > 1:
            prompt = prompt[1:]
        prompts[i] = prompt
        seen.add(len(prompt))
    return prompts


def staggered_ends(rows, length):
    """The step at which each of the self-check's rows is made to end (generate's ends; -1: it runs on). At each of
    a few evenly spaced steps half of the rows still running end (rows 0, 2, 4, .. first, then 1, 5, 9, ..: the rows
    that move up are other prompts', whose padding differs), the last row never: each halving of the static decode
    and each row drop of the dynamic one happen, with rows left to sample after each."""
    halvings = max(1, (rows - 1).bit_length())  # down to one row
    spacing = max(1, length // (halvings + 1))
    ends = []
    for r in range(rows):
        wave = (r ^ (r + 1)).bit_length() - 1  # the trailing 1 bits of r: 0 for even rows, 1 for 1, 5, 9, ...
        end = spacing * (wave + 1) - 1
        ends.append(end if wave < halvings and end < length - 1 else -1)
    return ends


def self_check_replies(model, tokenizer, prompts, G, length, temperature, seed, decode):
    """-> (the prompts, each a distinct length; G replies each, sampled by this decode with rows made to end at
    staggered steps; those steps)."""
    prompts = distinct_lengths(prompts)
    ends = staggered_ends(len(prompts) * G, length)
    model.eval()
    return prompts, generate(model, tokenizer, prompts, G, length, temperature, None, seed=seed, decode=decode,
                             ends=ends), ends


@contextmanager
def noisy_projections(model, seed):
    """A model whose output projections are zero (a fresh one: nanochat's init) computes the same log-probs whatever
    the context, which hides attention faults and mixed-up rows: within the block they and the head (0.001 std)
    hold noise, as the other matrices start (1 / sqrt(fan-in)); restored after. -> how many were zero."""
    zero = [p for name, p in model.named_parameters() if name.endswith("c_proj.weight") and not p.any()]
    head = model.lm_head.weight.detach().clone() if zero else None
    noise = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for p in zero + ([model.lm_head.weight] if zero else []):
                p.copy_(torch.randn(p.shape, generator=noise) / math.sqrt(p.size(1)))
        yield len(zero)
    finally:
        with torch.no_grad():
            for p in zero:
                p.zero_()
            if zero:
                model.lm_head.weight.copy_(head)


@contextmanager
def float32_matrices(net, on=True):
    """A net stored with bf16 matrices (a frozen reference or teacher) computes in float32 within the block: its
    matrices upcast (exactly), rounded back to the same bits after."""
    matrices = [m for m in net.modules() if isinstance(m, nn.Linear) and m.weight.dtype != torch.float32] if on else []
    try:
        for m in matrices:
            m.float()
        yield
    finally:
        for m in matrices:
            m.to(torch.bfloat16)


def self_check_distances(results, keys):
    """{path: {key: tensor}} of the "fast", "plain" and "float32" paths (and the plain path's "sampler" log-probs) ->
    float64 [2 * len(keys) + 1]: for each key the fast and the plain path's distance from the float32 one (the
    gradient's relative norm, else the largest difference), then the sampler's; inf where not finite."""
    reference = results["float32"]

    def distance(name, key):
        value, ref = results[name][key], reference[key]
        if key == "grads":
            return (value - ref).norm() / ref.norm().clamp(min=1e-30)
        return (value - ref).abs().max() if ref.numel() else ref.new_zeros(())
    checks = torch.stack([distance(name, key) for key in keys for name in ("fast", "plain")] + [
        (results["plain"]["sampler"] - reference["logprobs"]).abs().max()]).double()
    return torch.where(checks.isfinite(), checks, math.inf)


# -----------------------------------------------------------------------------
# nanochat's optimizers (its setup_optimizer, beside the GPT as nanoGPT's configure_optimizers)

# nanochat's optimizer, as its RL script of each generation builds it (five versions in 2025-2026). Muon for the
# matrices inside the blocks: Nesterov momentum, then an orthogonalised update (U V^T of the momentum G = U S V^T,
# approximated by a few matrix polynomials), scaled by sqrt(max(1, rows / cols)). AdamW for embeddings, head,
# gains and gates. What changed from version to version, one row each:
#   orthogonalise: "quintic" = one polynomial 5 times (X / (|X|_F + 1e-7)); "polar" = Polar Express, 5 (X /
#                  (|X|_F * divisor + 1e-6))
#   normuon:       beta2 of NorMuon's factored second moment (per row or column of the update), None: off
#   muon_decay:    --weight-decay to Muon as cautious decay (where update and weight agree in sign), else to AdamW
#   equilibrate:   rows rescaled to the mean row norm before orthogonalising (MuonEq)
#   renormalise:   the orthogonalised update rescaled to Frobenius norm sqrt(min(rows, cols)) (Muon+)
#   adamw:         "torch" = torch's AdamW; "nanochat" = nanochat's own AdamW step (the same math, its rounding)
#   groups:        AdamW group -> (betas, weight decay); "flag": --weight-decay
#   value_embed_lr: the value embeddings' lr as a fraction of --embedding-lr
def adamw_row(lm_head, wte, value_embeds, resid, x0, smear=((0.8, 0.95), 0.0)):
    return dict(lm_head=lm_head, wte=wte, value_embeds=value_embeds, resid_lambdas=resid, x0_lambdas=x0, smear=smear)


V1_ADAMW = adamw_row(*[((0.8, 0.95), "flag")] * 2, *[((0.8, 0.95), 0.0)] * 3)  # groups it lacked: as they began
V2_ADAMW = adamw_row(*[((0.8, 0.95), 0.0)] * 5)
V3_ADAMW = dict(V2_ADAMW, x0_lambdas=((0.96, 0.95), 0.0))
V4_ADAMW = adamw_row(((0.8, 0.96), 0.01), ((0.8, 0.995), 0.001), ((0.8, 0.995), 0.01), ((0.8, 0.95), 0.05),
                     ((0.96, 0.95), 0.0))
OPTIMIZER_VERSIONS = {  # nanochat's commits: V1 Oct-Dec 2025, V2 Dec 2025-Jan 2026, V3 Jan-Mar, V4 Mar 9, V5 Mar 14 on
    "v1": dict(orthogonalise="quintic", divisor=None, normuon=None, muon_decay=False, equilibrate=False,
               renormalise=False, adamw="torch", groups=V1_ADAMW, value_embed_lr=1.0),
    "v2": dict(orthogonalise="polar", divisor=1.02, normuon=0.95, muon_decay=True, equilibrate=False,
               renormalise=False, adamw="torch", groups=V2_ADAMW, value_embed_lr=1.0),
    "v3": dict(orthogonalise="polar", divisor=1.02, normuon=0.95, muon_decay=True, equilibrate=False,
               renormalise=False, adamw="nanochat", groups=V3_ADAMW, value_embed_lr=1.0),
    "v4": dict(orthogonalise="polar", divisor=1.01, normuon=0.9, muon_decay=True, equilibrate=False,
               renormalise=False, adamw="nanochat", groups=V4_ADAMW, value_embed_lr=0.5),
    "v5": dict(orthogonalise="polar", divisor=1.01, normuon=0.9, muon_decay=True, equilibrate=True,
               renormalise=True, adamw="nanochat", groups=V4_ADAMW, value_embed_lr=0.5),
}
# the version nanochat's RL script used at each generation's commits
GENERATION_OPTIMIZER = {"classic": "v1", "padded-vocab": "v2", "lambdas-windows": "v2", "value-embeds": "v3",
                        "softcap20": "v3", "ve12-qk115": "v4", "smear-backout": "v5"}
QUINTIC = [(3.4445, -4.7750, 2.0315)] * 5
POLAR_EXPRESS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),  # Amsel et al. 2025, 5 steps
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def frobenius(X):
    """The Frobenius norm of each matrix of a stack X [N, rows, cols] -> [N, 1, 1], each as torch computes it for
    that matrix alone (foreach norm): a matrix's step does not depend on which others share its stack."""
    return torch.stack(torch._foreach_norm(list(X.unbind(0)))).view(-1, 1, 1)


def orthogonalise(G, version):
    """~ U V^T for each matrix G = U S V^T of a stack G [N, rows, cols]: polynomials X <- a X + (b A + c A^2) X,
    A = X X^T, that push every singular value of X towards 1. bf16 on CUDA, as nanochat runs it; float32
    elsewhere."""
    X = G.bfloat16() if G.is_cuda else G.float()
    if version["equilibrate"]:  # every row to the mean row norm
        X = X * (frobenius(X) / X.size(-2) ** 0.5) / X.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    if version["orthogonalise"] == "quintic":
        X, coefficients = X / (frobenius(X) + 1e-7), QUINTIC
    else:
        X, coefficients = X / (frobenius(X) * version["divisor"] + 1e-6), POLAR_EXPRESS
    transposed = X.size(-2) > X.size(-1)  # iterate on the smaller Gram matrix
    if transposed:
        X = X.mT
    for a, b, c in coefficients:  # each sum inside its product (baddbmm): 3 kernels a polynomial, not 8
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    X = (X.mT if transposed else X).to(G.dtype)
    if version["renormalise"]:
        X = X * min(X.shape[-2:]) ** 0.5 / frobenius(X).clamp(min=1e-6)
    return X


MUON_STACK_BYTES = 2 ** 27  # float32 bytes of one stack of same-shape matrices, at most (memory_plan counts 10)


class Muon(torch.optim.Optimizer):
    """nanochat's Muon of one version (OPTIMIZER_VERSIONS) for 2-D weights. The matrices of one shape step as one
    stack (as nanochat's own Muon steps them), of at most MUON_STACK_BYTES: one kernel for all of them where a loop
    launched ~50 for each, and on a GPU the host's launches were most of Muon's time (docs/performance.md)."""

    def __init__(self, params, lr, version, weight_decay=0.0, momentum=0.95):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))
        self.version = version

    @staticmethod
    def stacks(params):
        """-> the stacks these matrices step in: of one shape, at most MUON_STACK_BYTES each, in their order."""
        shapes = {}
        for p in params:
            shapes.setdefault(tuple(p.shape), []).append(p)
        stacks = []
        for (rows, cols), same in shapes.items():
            per_stack = max(1, MUON_STACK_BYTES // (rows * cols * 4))
            stacks += [same[i:i + per_stack] for i in range(0, len(same), per_stack)]
        return stacks

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:  # as torch's optimizers: no gradient, no step
            for stack in self.stacks([p for p in group["params"] if p.grad is not None]):
                self.step_stack(stack, group)

    def step_stack(self, params, group):
        version = OPTIMIZER_VERSIONS[self.version]
        rows, cols = params[0].shape
        dim = -1 if rows >= cols else -2  # NorMuon's moments: one per row (per column if wide)
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["momentum"] = torch.zeros_like(p)
                if version["normuon"] is not None:
                    state["second_moment"] = torch.zeros_like(p.sum(dim, keepdim=True))
        if params[0].is_meta:  # the memory plan steps the optimizers on meta tensors only to count their state: the
            return  # update's ops there compute nothing, through torch's Python meta kernels (0.1 s a run)
        momentum = torch.stack([state["momentum"] for state in states])  # [N, rows, cols], as each one below
        grads = torch.stack([p.grad for p in params])
        momentum.lerp_(grads, 1 - group["momentum"])
        update = orthogonalise(grads.lerp_(momentum, group["momentum"]), version)  # Nesterov
        if version["normuon"] is not None:  # NorMuon: equalise the update's rows (or columns), keep its norm
            second_moment = torch.stack([state["second_moment"] for state in states])
            second_moment.lerp_((update * update).mean(dim, True), 1 - version["normuon"])
            scaled = update * second_moment.clamp(min=1e-10).rsqrt()
            update = scaled * (frobenius(update) / frobenius(scaled).clamp(min=1e-10))
            torch._foreach_copy_([state["second_moment"] for state in states], list(second_moment.unbind(0)))
        lr = group["lr"] * max(1, rows / cols) ** 0.5
        weights = torch.stack(params)
        if group["weight_decay"]:  # cautious: decay only where the update pushes the same way
            weights.sub_(lr * group["weight_decay"] * weights * (update * weights >= 0))
        weights.add_(update, alpha=-lr)
        torch._foreach_copy_(params, list(weights.unbind(0)))
        torch._foreach_copy_([state["momentum"] for state in states], list(momentum.unbind(0)))


class NanochatAdamW(torch.optim.Optimizer):
    """nanochat's own AdamW step (from its optimizer version v3): decoupled decay, then Adam with bias correction."""

    def __init__(self, params, lr, betas, eps=1e-10, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                p.mul_(1 - lr * group["weight_decay"])
                m.lerp_(p.grad, 1 - beta1)
                v.lerp_(p.grad.square(), 1 - beta2)
                denominator = (v / (1 - beta2 ** t)).sqrt() + group["eps"]
                p.addcdiv_(m, denominator, value=-lr / (1 - beta1 ** t))


def optimizer_version(model, args):
    """--optimizer-version; else the one a checkpoint of this program was trained with, as its meta records; else
    the one of the checkpoint's generation; a model from scratch: nanochat's newest (the demo learns faster with it:
    docs/demo.md)."""
    if args.optimizer_version:
        return args.optimizer_version
    if getattr(model, "trained_optimizer", None) in OPTIMIZER_VERSIONS:
        return model.trained_optimizer
    return "v5" if args.init == "scratch" else GENERATION_OPTIMIZER[model.generation_name]


def make_optimizers(model, args):
    if args.lora_rank:  # only the adapters train
        optimizers = [torch.optim.AdamW(model.lora.parameters(), lr=args.lora_lr, weight_decay=args.weight_decay)]
    elif args.optimizer == "adamw":
        optimizers = [torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)]
    else:  # nanochat's: Muon for the matrices inside the blocks, AdamW for the rest, in nanochat's groups
        name = optimizer_version(model, args)
        version = OPTIMIZER_VERSIONS[name]
        scale = (model.config.n_embd / 768) ** -0.5  # AdamW lrs were tuned at width 768: scaled as 1/sqrt(width)
        homes = [("wte", [model.transformer.wte.weight], args.embedding_lr * scale),
                 ("lm_head", [model.lm_head.weight], args.unembedding_lr * scale)]
        if model.value_embeds:
            homes.append(("value_embeds", list(model.value_embeds.parameters()),
                          args.embedding_lr * scale * version["value_embed_lr"]))
        if model.generation.lambdas:  # gains: lrs not scaled by width
            homes += [("resid_lambdas", [model.resid_lambdas], 0.005), ("x0_lambdas", [model.x0_lambdas], 0.5)]
        if model.generation.smear_backout:
            homes.append(("smear", [model.smear_gate.weight, model.smear_lambda, model.backout_lambda], 0.2))
        adam_groups = []
        for home, params, lr in homes:
            betas, decay = version["groups"][home]
            adam_groups.append(dict(params=params, lr=lr, betas=betas,
                                    weight_decay=args.weight_decay if decay == "flag" else decay))
        adamw = NanochatAdamW if version["adamw"] == "nanochat" else torch.optim.AdamW
        optimizers = [adamw(adam_groups, lr=0.0, betas=(0.8, 0.95), eps=1e-10),
                      Muon(model.transformer.h.parameters(), lr=args.matrix_lr, version=name,
                           weight_decay=args.weight_decay if version["muon_decay"] else 0.0)]
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] *= args.init_lr_frac
    homed = [id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(homed) == sorted(trainable), "a trainable parameter with no optimizer, or two"
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


# -----------------------------------------------------------------------------
# Over ranks: the gradients' sum, a sharded optimizer's weights and state (identity in a single process)

def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """Reduce over all ranks, in place. NCCL reduces GPU tensors only: a CPU tensor goes through the GPU there."""
    if dist.is_initialized():
        if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
            tensor.copy_(all_reduce(tensor.cuda(), op))
        else:
            dist.all_reduce(tensor, op=op)
    return tensor


def buckets(tensors, bucket_bytes=64 * 2 ** 20):
    """tensors in runs of about bucket_bytes: one collective per run rather than one per tensor (a 20-layer model has
    over a hundred), each element reduced exactly as a per-tensor collective reduces it."""
    run, size = [], 0
    for t in tensors:
        run.append(t)
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield run
            run, size = [], 0
    if run:
        yield run


def reduce_gradients(params, owners=None, bucket_bytes=64 * 2 ** 20):
    """Sum the gradients over ranks: onto every rank, or with a sharded optimizer onto each weight's owner only
    (the other ranks then drop theirs)."""
    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    for owner in range(dist.get_world_size()) if owners else [None]:
        for grads in buckets([p.grad for p in params if owners is None or owners[id(p)] == owner], bucket_bytes):
            flat = torch.cat([g.flatten() for g in grads])
            if owner is None:
                dist.all_reduce(flat)
            else:
                dist.reduce(flat, dst=owner)
            if owner in (None, rank):
                for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(reduced.view_as(g))
    for p in params:
        if owners and owners[id(p)] != rank:
            p.grad = None


def broadcast_weights(params, owners, bucket_bytes=64 * 2 ** 20):
    """Every weight from the rank that stepped it (sharded optimizer) to all the others."""
    for owner in range(dist.get_world_size()):
        for weights in buckets([p.detach() for p in params if owners[id(p)] == owner], bucket_bytes):
            flat = torch.cat([w.flatten() for w in weights])
            dist.broadcast(flat, src=owner)
            for w, new in zip(weights, flat.split([w.numel() for w in weights])):
                w.copy_(new.view_as(w))


def shard_owners(params, world_size):
    """A sharded optimizer's plan: each trainable weight's owner rank. Whole tensors (Muon orthogonalises a matrix
    whole), the largest first, each to the rank that holds the fewest elements so far. -> {id(param): rank}"""
    load, owners = [0] * world_size, {}
    for p in sorted(params, key=lambda p: -p.numel()):  # a stable sort: equal sizes keep the model's order
        owner = load.index(min(load))
        owners[id(p)] = owner
        load[owner] += p.numel()
    return owners


def gathered_optimizer_states(optimizers, owners):
    """-> every optimizer's whole state_dict, for rank 0 to save. With a sharded optimizer each weight's state comes
    from its owner, tensor by tensor, to rank 0's CPU memory (never all of it on one GPU); the others get None."""
    states = [opt.state_dict() for opt in optimizers]
    if not owners:
        return states
    rank = dist.get_rank()
    wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    for opt, state in zip(optimizers, states):
        for index, p in enumerate(p for group in opt.param_groups for p in group["params"]):
            owner = owners[id(p)]
            if owner == 0 or rank not in (0, owner):
                continue
            if rank == owner:
                entry = state["state"].get(index, {})
                # first what the entry holds (names, and each tensor's shape and dtype), then its tensors
                dist.send_object_list([{k: ("tensor", v.shape, v.dtype) if torch.is_tensor(v) else v
                                        for k, v in entry.items()}], dst=0)
                for v in entry.values():
                    if torch.is_tensor(v):
                        dist.send(v.to(wire).contiguous(), dst=0)
            else:
                described = [None]
                dist.recv_object_list(described, src=owner)
                entry = {}
                for k, v in described[0].items():
                    if isinstance(v, tuple) and v[0] == "tensor":
                        received = torch.empty(v[1], dtype=v[2], device=wire)
                        dist.recv(received, src=owner)
                        v = received.cpu()
                    entry[k] = v
                if entry:
                    state["state"][index] = entry
    return states if rank == 0 else None


# -----------------------------------------------------------------------------
# Checkpoints, in nanochat's layout: <base>/<source>_checkpoints/<tag>/{model,meta}_<step:06d>.{pt,json}

def nanochat_base_dir():
    return os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")


def find_checkpoint(base_dir=None, tag=None):
    """-> the folder of nanochat's chat SFT checkpoints with this tag; by default the largest d<N>."""
    root = os.path.join(base_dir or nanochat_base_dir(), "chatsft_checkpoints")
    if tag is None:
        tags = [t for t in (os.listdir(root) if os.path.isdir(root) else []) if os.path.isdir(os.path.join(root, t))]
        depth_tags = [t for t in tags if re.fullmatch(r"d\d+", t)]
        if depth_tags:
            tag = max(depth_tags, key=lambda t: int(t[1:]))
        elif tags:  # nanochat's fallback: the most recently written folder
            tag = max(tags, key=lambda t: os.path.getmtime(os.path.join(root, t)))
        else:
            raise FileNotFoundError(f"no nanochat checkpoint found: {root} has no model folders "
                                    "(set NANOCHAT_BASE_DIR, or pass a checkpoint directory)")
    return os.path.join(root, tag)


def checkpoint_steps(checkpoint_dir):
    """The steps of the model_<step>.pt files in this folder (listed, not globbed: a name may hold [ ] * ?)."""
    names = os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    return sorted(int(m.group(1)) for name in names if (m := re.fullmatch(r"model_(\d+)\.pt", name)))


def checkpoint_folder(path):
    """A checkpoint folder as given, or a run folder of this program: its checkpoints' folder."""
    runs = os.path.join(path, "chatrl_checkpoints")
    if not checkpoint_steps(path) and os.path.isdir(runs) and len(os.listdir(runs)) == 1:
        return os.path.join(runs, os.listdir(runs)[0])
    return path


def loadable_steps(folder):
    """The steps of a checkpoint folder with both their model and meta files: those --init and --teacher can load."""
    return [s for s in checkpoint_steps(folder) if os.path.isfile(os.path.join(folder, f"meta_{s:06d}.json"))]


def tokenizer_path(checkpoint_dir):
    """<base>/<source>_checkpoints/<tag> -> <base>/tokenizer/tokenizer.pkl, else nanochat's default base."""
    base = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint_dir)))
    beside = os.path.join(base, "tokenizer", "tokenizer.pkl")
    return beside if os.path.isfile(beside) else os.path.join(nanochat_base_dir(), "tokenizer", "tokenizer.pkl")


def complete_steps(checkpoint_dir):
    """The steps whose model, meta and training state files were all written: the ones a run can resume from."""
    return [s for s in checkpoint_steps(checkpoint_dir) if all(
        os.path.isfile(os.path.join(checkpoint_dir, f"{kind}_{s:06d}.{ext}"))
        for kind, ext in (("meta", "json"), ("state", "pt")))]


def load_checkpoint(checkpoint_dir, step=None, generation=None, window_pattern=None, log=print, shapes_only=False):
    """Load model_<step>.pt + meta_<step>.json (default: the largest step) -> (model in float32, meta dict).
    generation / window_pattern override what the files say or what would be assumed (see model_from_state).
    shapes_only: the model on the meta device, its weights never read (for planning memory before loading).
    A missing step raises FileNotFoundError; a file of the step that is missing (its meta) or cannot be used,
    CheckpointFileError."""
    steps = checkpoint_steps(checkpoint_dir)
    if not steps:
        raise FileNotFoundError(f"no model_<step>.pt files in {os.path.abspath(checkpoint_dir)}")
    if step is None:
        step = steps[-1]
        has_meta = [os.path.isfile(os.path.join(checkpoint_dir, f"meta_{s:06d}.json")) for s in steps]
        if not has_meta[-1] and len(steps) > 1 and all(has_meta[:-1]):  # a writer of the model first (nanochat)
            log(f"note: step {step} of {checkpoint_dir} is not complete yet (no meta_{step:06d}.json): loading "
                f"step {steps[-2]}, the newest complete one")
            step = steps[-2]
    if step not in steps:
        raise FileNotFoundError(f"no step {step} in {checkpoint_dir}; available steps: {steps}")
    meta = read_meta(os.path.join(checkpoint_dir, f"meta_{step:06d}.json"))
    model_path = os.path.join(checkpoint_dir, f"model_{step:06d}.pt")
    state = load_tensors(model_path, mmap=shapes_only)  # mapped: names and shapes, no tensor read
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointFileError(model_path, f"{model_path} holds no state dict (names -> tensors): not a nanochat "
                                  "model file")
    # Our own checkpoints name their generation, which settles what the files alone cannot.
    try:
        with torch.device("meta") if shapes_only else nullcontext():
            model = model_from_state(meta["model_config"], state, generation or meta.get("nanogrpo_generation"),
                                     window_pattern, log, load=not shapes_only)
    except ValueError as e:  # another model's file, or a model nanogrpo cannot run
        raise CheckpointFileError(model_path, f"{model_path}: {e}") from None
    return model, meta


class CheckpointFileError(ValueError):
    """A file of a checkpoint that cannot be used: cut short, overwritten, another file's bytes, or a meta file
    missing beside its model file. The message names the file and what is wrong; .path lets the caller say how to
    go on (another step, another checkpoint)."""

    def __init__(self, path, message):
        super().__init__(message)
        self.path = path


def error_summary(error, width=160):
    """An exception as a few words for a one-line message: its first line that says something (torch's run to
    paragraphs, some open with a heading ending in ':'), to the end of its first sentence, shortened at a word."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = next((line for line in lines if not line.endswith(":")), lines[0] if lines else "no message")
    sentence = re.split(r"(?<=\.)\s", line, maxsplit=1)[0]
    return f"{type(error).__name__}: {textwrap.shorten(sentence, width, placeholder=' ...')}"


def read_meta(path):
    """meta_<step>.json, checked: a JSON object whose model_config has GPTConfig's fields with values of their types."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:  # beside its model file: a step that cannot be loaded, as a damaged one
        raise CheckpointFileError(path, f"{path} is missing: every model_<step>.pt needs its meta_<step>.json") \
            from None
    except ValueError as e:  # also a file that is not UTF-8
        raise CheckpointFileError(path, f"{path} is not valid JSON ({e}): the checkpoint's metadata is "
                                  "damaged") from None
    config = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise CheckpointFileError(path, f"{path} has no model_config object: it is not a nanochat checkpoint's "
                                  "metadata")
    types = {f.name: f.type for f in fields(GPTConfig)}
    wrong = [f"{k}={v!r}" for k, v in config.items() if k in types and not (
        isinstance(v, str) if types[k] is str else isinstance(v, int) and not isinstance(v, bool) and v >= 1)]
    if wrong:
        raise CheckpointFileError(path, f"{path}: model_config has values of the wrong type or range: "
                                  f"{', '.join(wrong)} (sizes are integers >= 1, window_pattern a string)")
    return meta


# What torch.load raises on a truncated, empty, overwritten or foreign file: each of these, for one cause or another
# (OSError: a file cut to tens of KB sends torch's zip reader to seek before the file's start, EINVAL).
DAMAGED_FILE_ERRORS = (EOFError, RuntimeError, KeyError, IndexError, ValueError, pickle.UnpicklingError, OSError)
# How the files torch.save writes begin: a zip archive, or a pickle (its format before torch 1.6). Any other file is
# refused before torch.load sees it: its fallback reader would take the bytes for a pickle of the old format.
TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")
ZIP_END = b"PK\x05\x06"  # the zip archive's last record (22 bytes, torch writes no comment): gone from a cut file


def load_tensors(path, device="cpu", mmap=False):
    """torch.load with weights_only, so nothing in the file can run code; a damaged file -> CheckpointFileError
    naming it and what is wrong. mmap: the tensors stay in the file, read when used."""
    damaged = f"{path} is damaged or not a checkpoint file"
    with open(path, "rb") as f:
        start = f.read(4)
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 22))
        end = f.read(4)
    if not start.startswith(TORCH_FILE_STARTS):
        raise CheckpointFileError(path, f"{damaged} (" + ("empty" if not size else "it does not begin as the files "
                                                           "torch.save writes: zeroed, or another kind of file") + ")")
    if start.startswith(TORCH_FILE_STARTS[0]) and end != ZIP_END:
        raise CheckpointFileError(path, f"{damaged} (cut short: {size:,} bytes, without the end of torch.save's zip "
                                  "archive)")
    try:
        with warnings.catch_warnings():  # torch's note on an unusual pickle protocol: the error below says it all
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            try:
                return torch.load(path, map_location=device, weights_only=True, mmap=mmap)
            except DAMAGED_FILE_ERRORS:
                if not mmap:
                    raise
                return torch.load(path, map_location=device, weights_only=True)  # e.g. torch's legacy format
    except DAMAGED_FILE_ERRORS as e:
        raise CheckpointFileError(path, f"{damaged} ({error_summary(e)})") from None


def detect_generation(model_config, state):
    """-> (generation name, what was assumed or None), from the checkpoint's keys, shapes and config fields."""
    if any(k.startswith(("bigram_embed.", "bigram_lambdas")) for k in state):
        raise ValueError("this is a nanochat 'engram' checkpoint (bigram embeddings, on nanochat's master for one "
                         "day, 2026-01-27/28), which nanogrpo does not support: run it with nanochat at one of "
                         "those commits, or start from a checkpoint of another generation")
    gate = next((v for k, v in state.items() if k.endswith("attn.ve_gate.weight")), None)
    if "smear_gate.weight" in state:
        return "smear-backout", None
    if gate is not None and gate.size(1) == GENERATIONS["ve12-qk115"].ve_gate_channels:
        return "ve12-qk115", None
    if gate is not None:  # value-embeds and softcap20 wrote identical files; the longer-lived one is assumed
        return "value-embeds", ("assumed nanochat generation value-embeds (written 2026-01-18 .. 03-02, softcap 15): "
                                "a checkpoint written 2026-03-02 .. 03-09 has the same files but softcap 20; for one, "
                                "pass --generation softcap20 (load_checkpoint(..., generation='softcap20'))")
    if "resid_lambdas" in state or "window_pattern" in model_config:
        return "lambdas-windows", None
    wte = state.get("transformer.wte.weight")
    return ("classic" if wte is not None and wte.size(0) == model_config.get("vocab_size") else "padded-vocab"), None


def model_from_state(model_config, state, generation=None, window_pattern=None, log=print, load=True):
    """Build a GPT from a nanochat config dict and state dict, refusing anything this GPT does not implement.
    Where the files leave a choice open, nanochat's own choice is made and one line says so (via `log`).
    load False: the checked model without the state's weights."""
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}  # saved from a torch.compile'd model
    detected, assumption = detect_generation(model_config, state)
    if generation is not None and generation not in GENERATIONS:
        raise ValueError(f"unknown nanochat generation {generation!r}; known: {', '.join(GENERATIONS)}")
    name = generation or detected
    gen = GENERATIONS[name]
    if assumption and generation is None:
        log(f"note: {assumption}")
    known = {f.name for f in fields(GPTConfig)}
    extra_config = sorted(set(model_config) - known)
    if extra_config:
        raise ValueError(f"this checkpoint's config has fields nanogrpo does not know: {extra_config} (a nanochat GPT "
                         "newer than the generations nanogrpo supports?)")
    config = GPTConfig(**model_config)
    if window_pattern:
        config.window_pattern = window_pattern
    elif gen.short_window and "window_pattern" not in model_config:
        log("note: the checkpoint's config has no window_pattern: assumed 'L' (full attention in every layer), as "
            "nanochat does; pass --window-pattern (load_checkpoint(..., window_pattern=...)) if its run used windows")
    if gen.lambdas and "resid_lambdas" not in state and "x0_lambdas" not in state:
        log("note: the checkpoint has no resid_lambdas / x0_lambdas: filled with 1 / 0 (no change), as nanochat does")
        state = dict(state, resid_lambdas=torch.ones(config.n_layer), x0_lambdas=torch.zeros(config.n_layer))
    wte = state.get("transformer.wte.weight")
    model = GPT(config, name, padded_vocab_size=wte.size(0) if wte is not None else None)
    expected = model.state_dict()
    extra_keys = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    wrong = [f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
             if k in state and state[k].shape != v.shape]
    if extra_keys or missing or wrong:
        raise ValueError(f"checkpoint does not match a nanochat {name} GPT of config {config}: unexpected parameters "
                         f"{extra_keys[:8]}, missing {missing[:8]}, wrong shapes {wrong[:8]}")
    if load:
        model.load_state_dict({k: v.float() for k, v in state.items()})  # bf16 on disk -> float32 master weights
    model.disk_dtypes = {k: v.dtype for k, v in state.items() if v.dtype != torch.float32}
    return model


class _KeepWriteError:
    """The file torch.save writes through: torch reports a failed write (disk full) as a RuntimeError that has lost
    the errno, so the OSError is kept here to be raised instead. A short write (the disk or a file-size limit
    reached mid-buffer) is followed by another, which raises the OSError that says why."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        view, written = memoryview(data).cast("B"), 0
        try:
            while written < len(view):
                n = self.f.write(view[written:])
                if not n:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += n
        except OSError as e:
            self.error = e
            raise
        return written

    def flush(self):
        try:
            self.f.flush()
        except OSError as e:
            self.error = e
            raise


# A stop signal (Ctrl-C, a scheduler's SIGTERM) that arrives inside writing() is held, and raised as
# KeyboardInterrupt(signal name) once the outermost write has ended: the file whole and renamed. Raised part-way
# through torch.save, it would unwind torch's zip writer, whose cleanup raises an error of its own in its place.
# grpo.py's stop_signals installs stop_signal as the handler.
WRITES = {"depth": 0, "held": None}


@contextmanager
def writing():
    WRITES["depth"] += 1
    try:
        yield
    finally:  # after an error too, which then stops the run: the held signal would only hide it
        WRITES["depth"] -= 1
        held = None if WRITES["depth"] else WRITES["held"]
        if held:
            WRITES["held"] = None
    if held:
        raise KeyboardInterrupt(held)


def stop_signal(signum, frame):
    """Signal handler: KeyboardInterrupt naming the signal, at once, or after the write under way."""
    name = signal.Signals(signum).name
    if WRITES["depth"]:
        WRITES["held"] = WRITES["held"] or name
    else:
        raise KeyboardInterrupt(name)


def atomic_save(obj, path):
    """bytes as they are, a .json path as JSON, anything else with torch.save. Written to a temporary file in
    the same folder, then renamed over the path: a crash never leaves a half-written file. A failed write (disk
    full, read-only) raises OSError with its errno and this path, and leaves nothing behind."""
    with writing():
        _atomic_save(obj, path)


def new_file_mode():
    """The mode open() gives a new file, 0o666 less the process's umask: a temporary file (mkstemp: 0600) renamed
    into place gets it, so that a run folder is as readable as the user's other files (a teammate, an eval service,
    nanochat's tools under another account)."""
    umask = os.umask(0o077)  # read by setting it: put back at once
    os.umask(umask)
    return 0o666 & ~umask


def _atomic_save(obj, path):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_")
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "wb") as f:
            if isinstance(obj, bytes):
                f.write(obj)
            elif path.endswith(".json"):
                f.write(json.dumps(obj, indent=2).encode())
            else:
                writer = _KeepWriteError(f)
                try:
                    torch.save(obj, writer)
                except RuntimeError:
                    if writer.error is None:
                        raise
                    raise writer.error from None
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: after a power cut the name holds old or new data
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror, path) from None
        raise


def save_checkpoint(checkpoint_dir, step, model, meta=None):
    """meta_<step>.json and model_<step>.pt in the generation and on-disk dtypes the model was loaded with (LoRA
    adapters merged), so that nanochat's code of that generation loads them. The embedding tables of a loaded
    nanochat checkpoint are bf16 on disk: those are rounded here, and master_weights() keeps what rounding loses.
    The meta first, the model last: a reader that takes the largest model_<step>.pt (this project's, nanochat's)
    while a run saves finds that step's meta there already."""
    model_config = asdict(model.config)
    if not model.generation.short_window:  # a field that nanochat's GPT of this generation does not have
        del model_config["window_pattern"]
    atomic_save(dict(meta or {}, step=step, model_config=model_config, nanogrpo_generation=model.generation_name),
                os.path.join(checkpoint_dir, f"meta_{step:06d}.json"))
    atomic_save({k: v.detach().to("cpu", model.disk_dtypes.get(k, v.dtype))
                 for k, v in model.merged_state_dict().items()}, os.path.join(checkpoint_dir, f"model_{step:06d}.pt"))


def master_weight_names(model):
    """What an exact resume needs besides the model file: the float32 values of the tensors save_checkpoint rounds,
    and with LoRA the adapters and the base matrices (the file holds their merged sum)."""
    names = set(model.disk_dtypes)
    if model.lora is not None:
        names |= {name + ".weight" for name, _ in model.lora_targets()} | {"lora." + k for k in model.lora.keys()}
    return names


def master_weights(model):
    names = master_weight_names(model)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in names}


# -----------------------------------------------------------------------------
# tokenizer.pkl: a pickled tiktoken.Encoding, read as data

class _EncodingState:
    """Stands in for tiktoken's Encoding while a tokenizer.pkl is read: it keeps the pickled state, runs nothing."""

    def __setstate__(self, state):
        self.state = state


class _TokenizerUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingState
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no tokenizer needs (refused: unpickling it "
                                     "could run code)")


def read_tokenizer_pkl(path):
    """-> tiktoken.Encoding. The only class the file may mention is tiktoken's Encoding, whose state (a name, a
    split pattern and two vocabularies) is checked and handed to tiktoken here, never through the pickle's own
    machinery."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer at {path} (nanochat writes it to <base>/tokenizer/tokenizer.pkl)")
    try:
        with open(path, "rb") as f:
            encoding = _TokenizerUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"{path} is not a nanochat tokenizer.pkl ({type(e).__name__}: {e}); copy it again from "
                         "<nanochat base>/tokenizer/") from None
    state = getattr(encoding, "state", None)
    if not (isinstance(state, dict) and set(state) == {"name", "pat_str", "mergeable_ranks", "special_tokens"}
            and isinstance(state["name"], str) and isinstance(state["pat_str"], str)
            and all(isinstance(k, bytes) and isinstance(v, int) for k, v in state["mergeable_ranks"].items())
            and all(isinstance(k, str) and isinstance(v, int) for k, v in state["special_tokens"].items())):
        raise ValueError(f"{path} does not hold a tiktoken encoding of nanochat's kind (name, pattern, vocabularies)")
    return tiktoken.Encoding(**state)
