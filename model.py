"""
The nanochat GPT, its chat tokenizer, checkpoint I/O and a batched KV-cache sampler.

Everything the trainer needs about the policy lives in this file:
- GPT: the nanochat architecture (rotary, QK-norm, ReLU^2 MLP, untied head, logit softcap, GQA),
  able to load nanochat checkpoints as they are on disk;
- Tokenizer: a thin chat wrapper over tiktoken (nanochat's tokenizer.pkl, or a byte-level one);
- find_checkpoint / load_checkpoint / save_checkpoint: nanochat's on-disk layout, atomic writes;
- generate: many prompts x many samples in one batch, with a KV cache and the calculator tool.
"""
import ast
import glob
import json
import math
import operator
import os
import pickle
import re
import tempfile
from dataclasses import asdict, dataclass, fields

import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# -----------------------------------------------------------------------------
# Tokenizer

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

    @classmethod
    def from_file(cls, path):
        """nanochat's tokenizer.pkl is a pickled tiktoken.Encoding."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer at {path} (nanochat writes it to <base>/tokenizer/tokenizer.pkl)")
        with open(path, "rb") as f:
            return cls(pickle.load(f))

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
        messages = conversation["messages"]
        if messages[0]["role"] == "system":  # nanochat folds a system message into the first user turn
            messages = [dict(messages[1], content=messages[0]["content"] + "\n\n" + messages[1]["content"])] + messages[2:]
        ids, mask = [self.bos], [0]

        def add(tokens, m):
            ids.extend(tokens)
            mask.extend([m] * len(tokens))

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


# -----------------------------------------------------------------------------
# The GPT

@dataclass
class GPTConfig:
    # exactly nanochat's field names, so meta_*.json files load as they are
    sequence_len: int = 1024
    vocab_size: int = 65536
    n_layer: int = 4
    n_head: int = 2
    n_kv_head: int = 2
    n_embd: int = 256


def softcap_logits(logits):
    return 15 * torch.tanh(logits / 15)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))  # no learnable weight, as in nanochat


def rotary(x, positions):
    """x: [B, T, H, hd], positions: [B or 1, T]. Rotate the two halves of each head by position-dependent angles."""
    hd = x.size(-1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    angles = positions.float()[..., None] * inv_freq  # [B, T, hd/2]
    cos, sin = angles.cos()[:, :, None, :].to(x.dtype), angles.sin()[:, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


class KVCache:
    """Keys and values of every layer for a batch of left-padded rows: [n_layer, B, n_kv_head, max_len, hd].

    Row b holds pad[b] padding columns, then its prompt, then what it generated. All rows advance together,
    so one write position `pos` serves the whole batch."""

    def __init__(self, n_layer, pad, max_len):
        self.n_layer, self.pad, self.max_len = n_layer, pad, max_len
        self.k = self.v = None  # allocated on first write, in the dtype the model computes in
        self.pos = 0

    def update(self, layer, k, v):
        """Store k, v ([B, H, T, hd]) after the current position; return all keys and values so far."""
        if self.k is None:
            B, H, _, hd = k.shape
            self.k = k.new_zeros(self.n_layer, B, H, self.max_len, hd)
            self.v = torch.zeros_like(self.k)
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def select(self, rows):
        """Keep only these rows (repeat a row to share its prompt's cache among samples, drop finished rows)."""
        self.pad = self.pad[rows]
        self.k, self.v = self.k[:, rows], self.v[:, rows]


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, positions, attn_mask, cache, layer):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        q, k = norm(rotary(q, positions)), norm(rotary(k, positions))  # rotary first, then QK-norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, H_kv, S, hd] with S = everything cached so far
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)

    def forward(self, x, positions, attn_mask, cache, layer):
        x = x + self.attn(norm(x), positions, attn_mask, cache, layer)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config, padded_vocab_size=None):
        super().__init__()
        if config.n_embd % config.n_head or config.n_head % config.n_kv_head or (config.n_embd // config.n_head) % 2:
            raise ValueError(f"inconsistent model config {config}: n_head must divide n_embd into an even head_dim, "
                             "and n_kv_head must divide n_head")
        self.config = config
        # The embedding and head may have more rows than the vocabulary (nanochat pads them to a multiple of 64
        # for speed); the extra logits are dropped.
        V = padded_vocab_size or (config.vocab_size + 63) // 64 * 64
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
        ))
        self.lm_head = nn.Linear(config.n_embd, V, bias=False)

    @torch.no_grad()
    def init_weights(self, seed=0):
        """A fresh model (the `scratch` start): small random weights, zero output projections as in nanochat."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                p.zero_()
            elif "wte" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.001)
            else:
                fan_in = p.size(1)
                p.copy_(torch.randn(p.shape, generator=gen) * min(1.0, math.sqrt(p.size(0) / fan_in)) / math.sqrt(fan_in))
        return self

    def hidden(self, idx, cache=None):
        """idx: [B, T] token ids -> final normalised hidden states [B, T, C]."""
        B, T = idx.shape
        if cache is None:  # a plain causal forward from position 0
            positions = torch.arange(T, device=idx.device)[None]
            attn_mask = None
        else:  # continue left-padded rows from the cache's position
            query = cache.pos + torch.arange(T, device=idx.device)  # [T] column of each new token
            key = torch.arange(cache.pos + T, device=idx.device)  # [S]
            positions = (query[None] - cache.pad[:, None]).clamp(min=0)  # [B, T]: padding does not move positions
            real = key[None, None, :] >= cache.pad[:, None, None]  # [B, 1, S]
            # A padding query may see itself, so no softmax row is empty (an all -inf row would give NaN).
            attn_mask = (key[None, :] <= query[:, None])[None] & (real | (key[None, :] == query[:, None])[None])
            attn_mask = attn_mask[:, None]  # [B, 1, T, S]
        x = norm(self.transformer.wte(idx))
        for layer, block in enumerate(self.transformer.h):
            x = block(x, positions, attn_mask, cache, layer)
        if cache is not None:
            cache.pos += T
        return norm(x)

    def logits(self, x, softcap=True):
        """Hidden states [..., C] -> float32 logits [..., vocab_size], softcapped at 15."""
        logits = self.lm_head(x)[..., :self.config.vocab_size].float()
        return softcap_logits(logits) if softcap else logits

    def forward(self, idx, cache=None, softcap=True):
        return self.logits(self.hidden(idx, cache), softcap)

    def token_logprobs(self, idx, targets, temperature=1.0, chunk_size=16384):
        """log softmax(logits / temperature) at the targets: idx, targets [B, T] -> [B, T] float32.

        The full [B, T, V] logits are never materialised: the head runs over chunks of positions, and each
        chunk is recomputed in the backward pass rather than kept alive (with V = 65,536 a single [16, 512, V]
        float32 tensor is 2 GiB, and softcap + log_softmax would keep several)."""
        x = self.hidden(idx).flatten(0, 1)  # [B*T, C]
        flat_targets = targets.flatten()

        def chunk_logprobs(x_chunk, target_chunk):
            logits = self.logits(x_chunk) / temperature
            return logits.gather(1, target_chunk[:, None]).squeeze(1) - torch.logsumexp(logits, dim=1)

        out = []
        for i in range(0, x.size(0), chunk_size):
            args = (x[i:i + chunk_size], flat_targets[i:i + chunk_size])
            out.append(checkpoint(chunk_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled()
                       else chunk_logprobs(*args))
        return torch.cat(out).view_as(targets)


# -----------------------------------------------------------------------------
# Checkpoints, in nanochat's layout: <base>/<source>_checkpoints/<tag>/{model,meta}_<step:06d>.{pt,json}

def nanochat_base_dir():
    return os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")


def find_checkpoint(base_dir=None, source="chatsft", tag=None, step=None):
    """-> (checkpoint_dir, step). Defaults: the largest d<N> tag, then its largest step."""
    root = os.path.join(base_dir or nanochat_base_dir(), f"{source}_checkpoints")
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
    return os.path.join(root, tag), step


def checkpoint_steps(checkpoint_dir):
    return sorted(int(m.group(1)) for f in glob.glob(os.path.join(checkpoint_dir, "model_*.pt"))
                  if (m := re.fullmatch(r"model_(\d+)\.pt", os.path.basename(f))))


def load_checkpoint(checkpoint_dir, step=None, device="cpu"):
    """Load model_<step>.pt + meta_<step>.json (default: the largest step) -> (model in float32, meta dict)."""
    steps = checkpoint_steps(checkpoint_dir)
    if not steps:
        raise FileNotFoundError(f"no model_<step>.pt files in {os.path.abspath(checkpoint_dir)}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"no step {step} in {checkpoint_dir}; available steps: {steps}")
    with open(os.path.join(checkpoint_dir, f"meta_{step:06d}.json")) as f:
        meta = json.load(f)
    state = torch.load(os.path.join(checkpoint_dir, f"model_{step:06d}.pt"), map_location=device, weights_only=True)
    return model_from_state(meta["model_config"], state), meta


def model_from_state(model_config, state):
    """Build a GPT from a nanochat config dict and state dict, refusing anything this GPT does not implement."""
    known = {f.name for f in fields(GPTConfig)}
    extra_config = sorted(set(model_config) - known)
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}  # saved from a torch.compile'd model
    config = GPTConfig(**{k: v for k, v in model_config.items() if k in known})
    model = GPT(config, padded_vocab_size=state["transformer.wte.weight"].size(0) if "transformer.wte.weight" in state else None)
    expected = model.state_dict()
    extra_keys = sorted(set(state) - set(expected))
    if extra_config or extra_keys:
        raise ValueError("this checkpoint comes from a newer nanochat GPT that nanogrpo does not support yet: "
                         f"unsupported config fields {extra_config}, unsupported parameters {extra_keys[:8]}"
                         f"{' ...' if len(extra_keys) > 8 else ''}")
    missing = sorted(set(expected) - set(state))
    wrong = [f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or wrong:
        raise ValueError(f"checkpoint does not match its config {config}: missing {missing[:8]}, wrong shapes {wrong[:8]}")
    model.load_state_dict({k: v.float() for k, v in state.items()})  # bf16 on disk -> float32 master weights
    return model


def atomic_save(obj, path):
    """Write to a temporary file in the same folder, then rename: a crash never leaves a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp_")
    try:
        with os.fdopen(fd, "wb") as f:
            if path.endswith(".json"):
                f.write(json.dumps(obj, indent=2).encode())
            else:
                torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_checkpoint(checkpoint_dir, step, model, meta=None):
    """model_<step>.pt and meta_<step>.json, loadable here and by nanochat's own chat tools."""
    atomic_save(model.state_dict(), os.path.join(checkpoint_dir, f"model_{step:06d}.pt"))
    atomic_save(dict(meta or {}, step=step, model_config=asdict(model.config)),
                os.path.join(checkpoint_dir, f"meta_{step:06d}.json"))


# -----------------------------------------------------------------------------
# The calculator tool

CALCULATOR_MAX_CHARS = 100
_CALC_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CALC_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub, ast.UAdd)


def calculator(expr):
    """Evaluate + - * / arithmetic written by the model; None for anything else.

    The model's text is never eval'd: it is parsed with ast and only number literals and the four
    operations are walked. Without ** and with at most 100 characters, every result stays small,
    so the time is bounded too."""
    expr = re.sub(r"(?<=\d),(?=\d)", "", expr.strip())  # 1,000 -> 1000
    if not expr or len(expr) > CALCULATOR_MAX_CHARS or not re.fullmatch(r"[0-9.+\-*/() ]+", expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        if not all(isinstance(node, _CALC_NODES) for node in ast.walk(tree)):
            return None

        def value(node):
            if isinstance(node, ast.Expression):
                return value(node.body)
            if isinstance(node, ast.Constant):
                if not isinstance(node.value, (int, float)):
                    raise ValueError
                return node.value
            if isinstance(node, ast.UnaryOp):
                return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
            return _CALC_OPS[type(node.op)](value(node.left), value(node.right))

        result = value(tree)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError):
        return None
    if isinstance(result, float):
        if not math.isfinite(result):
            return None
        result = round(result, 6)
        if result.is_integer():
            result = int(result)
    return str(result)


# -----------------------------------------------------------------------------
# The sampler

def sample_tokens(raw_logits, temperature, top_k, uniform):
    """Raw (not yet softcapped) logits [N, V] and uniform noise [N] in [0, 1) -> token ids [N].
    temperature 0 is greedy.

    The softcap is monotonic, so greedy and the top-k set can be read off the raw logits and the
    softcap applied to the k survivors only: over a 65,536 vocabulary that, and sampling by inverse
    CDF rather than torch.multinomial, is most of the sampler's time on a CPU."""
    if temperature == 0:
        return raw_logits.argmax(dim=-1)
    if top_k:
        values, indices = torch.topk(raw_logits, min(top_k, raw_logits.size(-1)), dim=-1)  # [N, k]
    else:
        values, indices = raw_logits, None
    cdf = F.softmax(softcap_logits(values) / temperature, dim=-1).cumsum(dim=-1)
    choice = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:]).clamp(max=cdf.size(-1) - 1)  # [N, 1]
    return (choice if indices is None else indices.gather(1, choice)).squeeze(1)


@torch.no_grad()
def generate(model, tokenizer, prompts, num_samples=1, max_new_tokens=256, temperature=1.0, top_k=None, seed=0,
             use_calculator=True):
    """Sample `num_samples` replies for each prompt (lists of token ids, any lengths), all in one batch.
    `seed` is an int, or one int per prompt.

    Returns a dict of tensors with one row per sample, prompt-major (row p * num_samples + g):
      tokens [N, max_new_tokens]: the reply, padded with 0 after it ends;
      mask [N, max_new_tokens]: 1 where the policy sampled the token (the stop token included), 0 where the
        calculator forced it and on padding;
      lengths [N]: reply length including the stop token and forced tokens;
      truncated [N]: the reply hit max_new_tokens before a stop token.
    They come back on the CPU, where callers decode and grade them: one copy, not a device sync per row."""
    device = model.lm_head.weight.device
    P, G = len(prompts), num_samples
    N = P * G
    # All randomness is drawn up front from one generator per prompt, seeded `seed + p` (or seed[p]): a
    # prompt's samples do not depend on which other prompts share the batch, or on which rank runs it.
    seeds = seed if isinstance(seed, (list, tuple)) else [seed + p for p in range(P)]
    noise = torch.cat([torch.rand(G, max_new_tokens, generator=torch.Generator().manual_seed(s)) for s in seeds]).to(device)

    # Prefill every prompt once, left-padded so that all rows end at the same column.
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    idx = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    cache = KVCache(model.config.n_layer, pad, longest + max_new_tokens)
    logits = model(idx, cache, softcap=False)[:, -1]  # [P, V]
    # Then every sample gets its own copy of its prompt's cache, and draws its own first token.
    shared = torch.arange(P, device=device).repeat_interleave(G)
    cache.select(shared)
    sampled = sample_tokens(logits[shared], temperature, top_k, noise[:, 0])  # [N]

    tokens = torch.zeros(N, max_new_tokens, dtype=torch.long, device=device)
    mask = torch.zeros(N, max_new_tokens, dtype=torch.long, device=device)
    lengths = torch.full((N,), max_new_tokens, device=device)
    truncated = torch.ones(N, dtype=torch.bool, device=device)
    rows = torch.arange(N, device=device)  # which output row each row of the running batch is
    done = torch.zeros(N, dtype=torch.bool, device=device)
    forced = torch.zeros(N, 0, dtype=torch.long, device=device)  # queued calculator tokens per running row
    num_forced = torch.zeros(N, dtype=torch.long, device=device)
    stop_ids = torch.tensor([tokenizer.assistant_end, tokenizer.bos], device=device)

    # The per-step bookkeeping is tensor ops (no boolean indexing, which would sync with the device).
    for t in range(max_new_tokens):
        is_forced = num_forced > 0
        token = torch.where(is_forced, forced[:, 0] if forced.size(1) else sampled, sampled).masked_fill(done, 0)
        forced, num_forced = forced.roll(-1, dims=1), (num_forced - 1).clamp(min=0)
        tokens[rows, t] = token
        mask[rows, t] = (~is_forced & ~done).long()
        stopped = ~done & ~is_forced & torch.isin(token, stop_ids)
        lengths[rows] = torch.where(stopped, t + 1, lengths[rows])
        truncated[rows] &= ~stopped
        done |= stopped
        calls = ~done & ~is_forced & (token == tokenizer.python_end) & use_calculator
        # One host sync per step for the whole batch, not one per row.
        num_running, any_call = torch.stack([(~done).sum(), calls.any()]).tolist()
        if num_running == 0 or t == max_new_tokens - 1:
            break
        if any_call:  # the tool runs only for the rows that just closed a python block
            for i in calls.nonzero().flatten().tolist():
                reply = tokens[rows[i], :t].tolist()
                starts = [j for j, tok in enumerate(reply) if tok == tokenizer.python_start]
                result = calculator(tokenizer.decode(reply[starts[-1] + 1:])) if starts else None
                if result is not None:
                    queue = [tokenizer.output_start] + tokenizer.encode(result) + [tokenizer.output_end]
                    if len(queue) > forced.size(1):
                        forced = F.pad(forced, (0, len(queue) - forced.size(1)))
                    forced[i, :len(queue)] = torch.tensor(queue, device=device)
                    num_forced[i] = len(queue)
        if num_running <= 0.75 * done.numel():  # finished rows leave the batch rather than keep it busy
            keep = (~done).nonzero().flatten()
            cache.select(keep)
            rows, token, done, forced, num_forced = rows[keep], token[keep], done[keep], forced[keep], num_forced[keep]
        logits = model(token[:, None], cache, softcap=False)[:, -1]
        sampled = sample_tokens(logits, temperature, top_k, noise[rows, t + 1])
    return {k: v.cpu() for k, v in dict(tokens=tokens, mask=mask, lengths=lengths, truncated=truncated).items()}
