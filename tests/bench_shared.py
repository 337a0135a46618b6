"""What the benchmarks share (not collected by pytest): a timer that waits for the GPU, the GPUs' peaks, and rollouts
at real lengths: GSM8K's training answers as reply lengths, and the stop token forced there, in grpo.py's sampler and
in nanochat's Engine alike.

A GSM8K answer rendered as nanochat renders a chat reply (calculator blocks and their outputs included, the stop token
last) has a length in bytes (the byte-level tokenizer: one token a byte, one a special token); divided by
bytes_per_token it stands for a real tokenizer's count (nanochat's 65,536-token tokenizer: 1.9 bytes a token on math
text, 4.9 on English, in its own tokenizer report; no BPE tokenizer is on this machine to count GSM8K exactly)."""
import time
from contextlib import contextmanager

import torch

import model as model_module
from tasks.gsm8k import GSM8K

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, no sparsity (SXM parts)


def timed(fn, cuda):
    """-> (fn(), its seconds), the GPU's queued work finished before and after."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def gsm8k_reply_lengths(tokenizer, gsm8k_dir, bytes_per_token, n, max_new_tokens, seed=0):
    """n reply lengths in tokens, the stop token included, drawn (seeded) from GSM8K's training answers, at most
    max_new_tokens. Raises OSError / ValueError without the data."""
    task = GSM8K("train", data_dir=gsm8k_dir)
    counts = []
    for i in torch.randint(0, len(task), (n,), generator=torch.Generator().manual_seed(seed)).tolist():
        ids, mask = tokenizer.render_conversation(task[i])  # only the drawn answers rendered: seconds less
        counts.append(len(ids) - mask.index(1))  # from the reply's first token through its stop token
    return (torch.tensor(counts) / bytes_per_token).round().long().clamp(1, max_new_tokens)


def describe(lengths, bytes_per_token):
    return (f"GSM8K's answers at {bytes_per_token:g} bytes a token: replies of {int(lengths.min())}-"
            f"{int(lengths.max())} tokens, median {int(lengths.median())}, mean {lengths.float().mean():.0f}")


@contextmanager
def stopping_at(lengths, stop_token):
    """generate()'s replies end with the stop token at these lengths (prompt-major rows, as it returns them): each
    row's noise is marked (2, outside the sampler's [0, 1)) at its last position, and the sampler puts the stop token
    where it meets the mark. Per row, whatever the batch's order or size, captured or not."""
    rand, sample_tokens = torch.rand, model_module.sample_tokens
    rows_seen = [0]

    def marked_rand(*shape, generator=None, **kwargs):  # generate draws one [G, new tokens] block per prompt
        noise = rand(*shape, generator=generator, **kwargs)
        first = rows_seen[0]
        rows_seen[0] += shape[0]
        for g, length in enumerate(lengths[first:first + shape[0]].tolist()):
            noise[g, length - 1] = 2.0
        return noise

    def stop_where_marked(raw_logits, temperature, top_k, uniform, softcap):
        token, logprob = sample_tokens(raw_logits, temperature, top_k, uniform.clamp(max=0.5), softcap)
        return torch.where(uniform > 1, stop_token, token), logprob
    torch.rand, model_module.sample_tokens = marked_rand, stop_where_marked
    try:
        yield
    finally:
        torch.rand, model_module.sample_tokens = rand, sample_tokens


@contextmanager
def placed_at(marks, tokens, vocab):
    """generate() puts tokens[k - 1] where marks [N, new tokens] (prompt-major rows, as it returns them) holds k > 0,
    as if it had sampled it (mask 1: a python block's end calls the tool, an <|assistant_end|> ends a turn), and
    samples as it would elsewhere, an id past the tokenizer's `vocab` (a random model's head is wider: the tool and
    the environment decode the reply) folded into it, id % vocab; a column the tool or the environment forces stays
    theirs. As stopping_at: each
    row's noise marked (1 + k, outside the sampler's [0, 1)), per row, captured or not (the placed ids are
    constants of the step, no tensor copied into a graph)."""
    rand, sample_tokens = torch.rand, model_module.sample_tokens
    rows_seen = [0]

    def marked_rand(*shape, generator=None, **kwargs):  # generate draws one [G, new tokens] block per prompt
        noise = rand(*shape, generator=generator, **kwargs)
        block = marks[rows_seen[0]:rows_seen[0] + shape[0], :shape[1]]
        rows_seen[0] += shape[0]
        return torch.where(block > 0, 1.0 + block, noise)

    def place_where_marked(raw_logits, temperature, top_k, uniform, softcap):
        token, logprob = sample_tokens(raw_logits, temperature, top_k, torch.where(uniform > 1, 0.5, uniform), softcap)
        token = torch.where(token >= vocab, token % vocab, token)
        for k, placed in enumerate(tokens, 1):
            token = torch.where(uniform == 1 + k, placed, token)
        return token, logprob
    torch.rand, model_module.sample_tokens = marked_rand, place_where_marked
    try:
        yield
    finally:
        torch.rand, model_module.sample_tokens = rand, sample_tokens


@contextmanager
def engine_stopping_at(engine_module, stop_token):
    """nanochat's Engine: -> set(lengths), which makes the next generate call's rows end with the stop token at these
    lengths (its sampling function wrapped: it samples as before, then the stop token goes where a row ends)."""
    sample_next_token = engine_module.sample_next_token
    state = {"lengths": None, "step": 0}

    def forced(logits, rng, temperature=1.0, top_k=None):
        ids = sample_next_token(logits, rng, temperature, top_k)  # [B, 1]
        ends = state["lengths"].to(ids.device) == state["step"] + 1
        state["step"] += 1
        return torch.where(ends[:, None], stop_token, ids)

    def set_lengths(lengths):
        state.update(lengths=lengths, step=0)
    engine_module.sample_next_token = forced
    try:
        yield set_lengths
    finally:
        engine_module.sample_next_token = sample_next_token
