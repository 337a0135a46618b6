"""
grpo.py next to nanochat's own code, on the same device and the same random weights:

    python tests/bench_vs_nanochat.py                # d20, nanochat's newest GPT, vocab 65,536, bf16, on CUDA
    python tests/bench_vs_nanochat.py --part rollouts   # one part a command: rollouts, update, pretrain
    python tests/bench_vs_nanochat.py --smoke        # a tiny shape on any device: checks that the script runs

The weights are made by nanochat (its GPT on the meta device, to_empty, init_weights, seed 0; the head and the output
projections then drawn with std 0.02, so that sampling does real work and attention matters, the stop and tool
tokens' rows of the head zeroed so that neither model ever samples them), then read into grpo.py's model
(model.model_from_state); the two models' logits on one prompt are printed next to each other first.
(a) rollouts: nanochat's Engine as chat_rl.py calls it (one question at a time, --device-batch-size replies a
    generate_batch call, --num-samples a question) against grpo.py's sampler as a GPU run calls it (every question's
    replies in one call, the decode step compiled and captured), --prompts questions, at real lengths
    (tests/bench_shared.py: the stop token forced at the same length in both);
(b) the RL update on those rows: chat_rl.py's loop (passes of --device-batch-size padded rows of one question, its
    loss, one MuonAdamW step, its model eager as chat_rl.py leaves it) against grpo.py's `--algo reinforce` update
    (packed passes at the memory plan's fit, compiled as a GPU run is);
(c) base_train's step: the torch.compile'd model on --pretrain-rows full rows of --seq-len tokens, loss, backward,
    MuonAdamW: tokens/s and MFU, the ceiling of this model's training speed on this device.
nanochat is imported unmodified from ../shared/peers/nanochat (or $NANOCHAT_PEER, or --nanochat); without it the
script says so in one line and exits 0. Its attention is Flash Attention 3 where its `kernels` hub fetches it; on a
machine without network its PyTorch SDPA fallback, which the first line says. Not collected by pytest; the functions
are also tests/gpu_session.py's parts 3b and 5.
"""
import argparse
import copy
import dataclasses
import os
import sys
import types
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import model as model_module  # noqa: E402
from bench_shared import PEAK_BF16_TFLOPS, describe, engine_stopping_at, gsm8k_reply_lengths, stopping_at  # noqa: E402
from bench_shared import timed  # noqa: E402
from model import Tokenizer, generate, model_from_state  # noqa: E402

SHAPES = {"d20": dict(n_layer=20, n_embd=1280, n_head=10, n_kv_head=10),
          "d12": dict(n_layer=12, n_embd=768, n_head=6, n_kv_head=6),
          "tiny": dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=2)}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--shape", default="d20", choices=list(SHAPES))
parser.add_argument("--vocab-size", type=int, default=65536)
parser.add_argument("--seq-len", type=int, default=2048, help="the model's sequence_len, and base_train's rows")
parser.add_argument("--prompts", type=int, default=16, help="questions a step (chat_rl.py's --examples-per-step)")
parser.add_argument("--num-samples", type=int, default=16, help="replies a question (chat_rl.py's default)")
parser.add_argument("--device-batch-size", type=int, default=8, help="chat_rl.py's rows a call and a pass")
parser.add_argument("--prompt-len", type=int, default=128)
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--pretrain-rows", type=int, default=32, help="base_train's --device-batch-size")
parser.add_argument("--gsm8k-dir", default=os.path.join(ROOT, "..", "shared", "data", "gsm8k"))
parser.add_argument("--bytes-per-token", type=float, default=3.0, help="tests/bench_shared.py")
parser.add_argument("--part", default="all", choices=["all", "rollouts", "update", "pretrain"])
parser.add_argument("--peak-tflops", type=float, default=None)
parser.add_argument("--smoke", action="store_true")
parser.add_argument("--device", default="cuda")
parser.add_argument("--nanochat", default=os.environ.get("NANOCHAT_PEER", os.path.join(ROOT, "..", "shared", "peers",
                                                                                "nanochat")),
                    help="a checkout of nanochat's code (default: $NANOCHAT_PEER, else ../shared/peers/nanochat)")
def configure(argv=None):
    """-> the bench's settings: its flags (--smoke applied), the device, autocast, tokenizers and dense bf16 peak it
    measures with, and nanochat's modules (None where its code is not at --nanochat); None for CUDA on a machine
    without."""
    bench = parser.parse_args(argv)
    if bench.smoke:
        bench.shape, bench.vocab_size, bench.seq_len, bench.prompts, bench.num_samples = "tiny", 512, 64, 2, 4
        bench.device_batch_size, bench.prompt_len, bench.max_new_tokens, bench.pretrain_rows = 2, 16, 48, 2
        bench.device = bench.device if torch.cuda.is_available() else "cpu"
    bench.device = torch.device(bench.device)
    bench.cuda = bench.device.type == "cuda"
    if bench.cuda and not torch.cuda.is_available():
        return None
    bench.autocast = torch.autocast(bench.device.type, dtype=torch.bfloat16)
    bench.name = torch.cuda.get_device_name(bench.device) if bench.cuda else "cpu"
    bench.peak_tflops = bench.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in bench.name), None)
    bench.tokenizer = Tokenizer.byte_level()  # nanochat's special tokens at its ids; the models never emit the rest
    bench.nc = import_nanochat(bench.nanochat)
    bench.their_tokenizer = bench.nc.RustBPETokenizer(bench.tokenizer.enc, "<|bos|>") if bench.nc else None
    return bench


def import_nanochat(peer):
    """nanochat's modules that the benches drive, imported offline, or None where its code is not at peer: its
    tokenizer module imports the trainer's packages (only its tiktoken wrapper is used here), and its folder goes
    last on the path, so that this project's `model` and `tasks` stay ours."""
    if not os.path.isfile(os.path.join(peer, "nanochat", "gpt.py")):
        return None
    for name in ("rustbpe", "tokenizers"):
        sys.modules.setdefault(name, types.ModuleType(name))
    if peer not in sys.path:
        sys.path.append(peer)
    import nanochat.engine as engine
    from nanochat import flash_attention
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import RustBPETokenizer
    return SimpleNamespace(engine=engine, flash_attention=flash_attention, GPT=GPT, GPTConfig=GPTConfig,
                           RustBPETokenizer=RustBPETokenizer)


def the_same_random_weights(bench):
    """-> (nanochat's GPT, grpo.py's GPT) holding the same weights, on the device, and their logits' largest
    difference on one prompt."""
    nc, tokenizer = bench.nc, bench.tokenizer
    config = nc.GPTConfig(sequence_len=bench.seq_len, vocab_size=bench.vocab_size, window_pattern="SSSL",
                          **SHAPES[bench.shape])
    torch.manual_seed(0)
    with torch.device("meta"):
        theirs = nc.GPT(config)
    theirs.to_empty(device=bench.device)
    theirs.init_weights()
    with torch.no_grad():  # output projections filled too: nanochat's zeros make every position ignore the others
        for name, p in theirs.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0, 0.02)
        theirs.lm_head.weight.normal_(0, 0.02)
        theirs.lm_head.weight[[tokenizer.assistant_end, tokenizer.bos, tokenizer.python_start]] = 0
    state = {k: v.detach().cpu() for k, v in theirs.state_dict().items()}
    ours = model_from_state(dataclasses.asdict(config), state, log=lambda line: None).to(bench.device)
    ids = torch.randint(0, 256, (1, bench.prompt_len), generator=torch.Generator().manual_seed(2)).to(bench.device)
    with torch.no_grad():  # the same model: the same logits (nanochat computes in bf16 on a GPU, ours in float32 here)
        difference = (theirs(ids).float() - ours(ids)[..., :bench.vocab_size]).abs().max().item()
    print(f"the same weights in both: logits {difference:.1e} apart at most (rounding: float32 on the CPU, nanochat's "
          f"bf16 on a GPU)")
    return theirs, ours, difference


def their_rollouts(bench, engine, prompts, lengths, set_lengths):
    """chat_rl.py's sampling loop for these questions: one generate_batch call per --device-batch-size replies."""
    calls = bench.num_samples // bench.device_batch_size
    rows = []
    for p, prompt in enumerate(prompts):
        for call in range(calls):
            first = p * bench.num_samples + call * bench.device_batch_size
            set_lengths(lengths[first:first + bench.device_batch_size])
            sequences, masks = engine.generate_batch(prompt, num_samples=bench.device_batch_size,
                                                     max_tokens=bench.max_new_tokens, temperature=1.0, top_k=50,
                                                     seed=hash((0, p, call)) & 0x7FFFFFFF)
            rows += list(zip(sequences, masks))
    return rows


def their_update(bench, model, optimizer, prompts, rows, rewards):
    """chat_rl.py's update for a step of these rows (sequences and masks as its sampling returns them): per question,
    passes of --device-batch-size padded rows, -logp weighted by reward - the question's mean, backward; then one
    optimizer step."""
    model.train()
    G, rows_a_pass, stop = bench.num_samples, bench.device_batch_size, bench.tokenizer.assistant_end
    for p in range(len(prompts)):
        group = rows[p * G:(p + 1) * G]
        longest = max(len(seq) for seq, _ in group)
        ids = torch.tensor([seq + [stop] * (longest - len(seq)) for seq, _ in group], device=bench.device)
        mask = torch.tensor([m + [0] * (longest - len(m)) for _, m in group], device=bench.device)
        inputs, targets = ids[:, :-1], ids[:, 1:].clone()
        targets[mask[:, 1:] == 0] = -1
        group_rewards = rewards[p].to(bench.device)
        advantages = group_rewards - group_rewards.mean()
        passes = G // rows_a_pass
        for i in range(passes):
            b = slice(i * rows_a_pass, (i + 1) * rows_a_pass)
            logp = -model(inputs[b], targets[b], loss_reduction="none").view_as(inputs[b])
            valid = (targets[b] >= 0).sum().clamp(min=1)
            loss = -(logp * advantages[b].unsqueeze(-1)).sum() / (valid * passes * len(prompts))
            loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


def our_samples(bench, rows, prompts):
    """The Engine's rows as grpo.py's sampler returns replies (tokens after the prompt, the stop token included)."""
    N, width, G = len(rows), bench.max_new_tokens, bench.num_samples
    tokens, mask = torch.zeros(N, width, dtype=torch.long), torch.zeros(N, width, dtype=torch.long)
    lengths, truncated = torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.bool)
    for r, (seq, m) in enumerate(rows):
        reply, reply_mask = seq[len(prompts[r // G]):], m[len(prompts[r // G]):]
        stopped = len(reply) < width
        reply, reply_mask = reply + [bench.tokenizer.assistant_end] * stopped, reply_mask + [1] * stopped
        tokens[r, :len(reply)], mask[r, :len(reply)] = torch.tensor(reply), torch.tensor(reply_mask)
        lengths[r], truncated[r] = len(reply), not stopped
    return dict(tokens=tokens, mask=mask, logprobs=torch.zeros(N, width), lengths=lengths, truncated=truncated)


def engine_rows(bench, samples, prompts):
    """grpo.py's sampled replies as the Engine's rows (our_samples' inverse): the prompt and the reply in one
    sequence, the stop token left out, a mask of 0 over the prompt."""
    rows = []
    for r, (n, cut) in enumerate(zip(samples["lengths"].tolist(), samples["truncated"].tolist())):
        reply = n if cut else n - 1
        prompt = prompts[r // bench.num_samples]
        rows.append((prompt + samples["tokens"][r, :reply].tolist(), [0] * len(prompt) +
                     samples["mask"][r, :reply].tolist()))
    return rows


def real_lengths(bench):
    N = bench.prompts * bench.num_samples
    try:
        lengths = gsm8k_reply_lengths(bench.tokenizer, bench.gsm8k_dir, bench.bytes_per_token, N, bench.max_new_tokens)
        print(f"real lengths: {describe(lengths, bench.bytes_per_token)}")
    except (OSError, ValueError) as e:
        lengths = torch.full((N,), bench.max_new_tokens)
        print(f"every reply {bench.max_new_tokens} tokens: GSM8K's train split is not at {bench.gsm8k_dir} ({e})")
    return lengths


def engine_rollouts(bench, theirs, prompts, lengths):
    """-> (the rows, seconds) of nanochat's Engine as chat_rl.py calls it, for these questions at these lengths,
    warmed first by one question."""
    engine = bench.nc.engine.Engine(theirs, bench.their_tokenizer)
    theirs.eval()
    with engine_stopping_at(bench.nc.engine, bench.tokenizer.assistant_end) as set_lengths:
        their_rollouts(bench, engine, prompts[:1], lengths, set_lengths)  # kernels and allocator warmed
        rows, seconds = timed(lambda: their_rollouts(bench, engine, prompts, lengths, set_lengths), bench.cuda)
    assert our_samples(bench, rows, prompts)["lengths"].tolist() == lengths[:len(rows)].tolist(), "lengths differ"
    return rows, seconds


def rollouts_side_by_side(bench, theirs, ours, prompts, lengths):
    """(a): -> the Engine's rows; each side's seconds for all the questions at these lengths."""
    rows, their_seconds = engine_rollouts(bench, theirs, prompts, lengths)
    ours.use_compile = bench.cuda  # grpo.py's GPU default: compiled, captured
    sample = lambda some: generate(ours, bench.tokenizer, some, bench.num_samples, bench.max_new_tokens,  # noqa: E731
                                   1.0, 50, seed=0)
    with stopping_at(lengths, bench.tokenizer.assistant_end), bench.autocast:
        sample(prompts[:2])
    with stopping_at(lengths, bench.tokenizer.assistant_end), bench.autocast:
        samples, our_seconds = timed(lambda: sample(prompts), bench.cuda)
    assert samples["lengths"].tolist() == lengths.tolist(), "lengths differ"
    tokens = int(lengths.sum())
    print(f"(a) rollouts: nanochat's Engine as chat_rl.py calls it {tokens / their_seconds:9.0f} tokens/s "
          f"({their_seconds:.2f} s); grpo.py's sampler {tokens / our_seconds:9.0f} tokens/s ({our_seconds:.2f} s): "
          f"{their_seconds / our_seconds:.1f}x")
    return rows


def update_side_by_side(bench, theirs, ours, prompts, rows, tokens_per_pass=None):
    """(b): chat_rl.py's loop and grpo.py's `reinforce` update (packed, at the plan's fit unless tokens_per_pass;
    compiled on a GPU), each warmed by a first update, on the same rows. -> (their seconds, ours, real tokens)."""
    rewards = torch.rand(len(prompts), bench.num_samples, generator=torch.Generator().manual_seed(1))
    optimizer = theirs.setup_optimizer()
    their_update(bench, theirs, optimizer, prompts[:1], rows[:bench.num_samples], rewards)  # state made, warmed
    _, their_seconds = timed(lambda: their_update(bench, theirs, optimizer, prompts, rows, rewards), bench.cuda)
    del optimizer  # its state freed: our update's passes are fitted to what the GPU holds without it
    if bench.cuda:
        torch.cuda.empty_cache()
    step_args = grpo.resolve_config(["--algo", "reinforce", "--prompts-per-step", str(len(prompts)),
                                     "--num-samples", str(bench.num_samples), "--max-new-tokens",
                                     str(bench.max_new_tokens), "--device", bench.device.type])
    step_args.compile = bench.cuda
    if tokens_per_pass is None:
        free = torch.cuda.mem_get_info(bench.device)[0] if bench.cuda else 2 ** 32
        grpo.fitted_plan(copy.deepcopy(ours).to("meta"), step_args, 1, bench.prompt_len, "bfloat16", free,
                         gpu=bench.cuda)
    else:
        step_args.tokens_per_pass = tokens_per_pass
    step_args.tokens_per_pass = step_args.tokens_per_pass or len(rows) * (bench.prompt_len + bench.max_new_tokens)
    optimizers = model_module.make_optimizers(ours, step_args)
    static = (len(rows), bench.prompt_len + bench.max_new_tokens - 1) if bench.cuda else None
    batch = grpo.to_device(grpo.make_batch(prompts, our_samples(bench, rows, prompts), rewards, step_args, static),
                           bench.device)
    ours.train()
    grpo.policy_update(ours, optimizers, batch, step_args, bench.autocast)  # compiled, state made
    _, our_seconds = timed(lambda: grpo.policy_update(ours, optimizers, batch, step_args, bench.autocast), bench.cuda)
    real = sum(len(seq) for seq, _ in rows)
    print(f"(b) the RL update of those {len(rows)} rows ({real} tokens, prompts included): chat_rl.py's loop "
          f"{real / their_seconds:9.0f} tokens/s ({their_seconds:.2f} s, passes of {bench.device_batch_size} rows); "
          f"grpo.py's reinforce {real / our_seconds:9.0f} tokens/s ({our_seconds:.2f} s, packed passes of "
          f"{step_args.tokens_per_pass} tokens: {len(batch['micro_batches'])}): {their_seconds / our_seconds:.1f}x")
    return their_seconds, our_seconds, real


def pretrain_step(bench, theirs):
    """(c): base_train's step, nanochat's model torch.compile'd on a GPU: -> (tokens/s, MFU or None, seconds of the
    first step, its compile)."""
    theirs.train()
    optimizer = theirs.setup_optimizer()
    compiled = torch.compile(theirs, dynamic=False) if bench.cuda else theirs
    x = torch.randint(0, bench.vocab_size, (bench.pretrain_rows, bench.seq_len), device=bench.device)
    y = torch.roll(x, -1, dims=1)

    def step():
        compiled(x, y).backward()
        optimizer.step()
        theirs.zero_grad(set_to_none=True)
    _, first_seconds = timed(step, bench.cuda)  # compiled
    _, seconds = timed(lambda: [step() for _ in range(3)], bench.cuda)
    tokens_per_second = 3 * x.numel() / seconds
    mfu = tokens_per_second * theirs.estimate_flops() / (bench.peak_tflops * 1e12) if bench.peak_tflops else None
    print(f"(c) base_train's step ({bench.pretrain_rows} rows of {bench.seq_len} tokens"
          f"{', compiled' if bench.cuda else ', eager: no compile off a GPU'}): "
          f"{tokens_per_second:9.0f} tokens/s, MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'}")
    return tokens_per_second, mfu, first_seconds


def main(argv=None):
    sys.stdout.reconfigure(line_buffering=True)
    bench = configure(argv)
    if bench is None:
        print("bench_vs_nanochat.py measures a CUDA GPU, and this machine has none (--smoke runs it on a tiny shape)")
        return
    if bench.nc is None:
        print(f"no side-by-side: nanochat's code is not at {bench.nanochat} (pass --nanochat or set NANOCHAT_PEER to "
              "a checkout of it)")
        return
    attention = "Flash Attention 3" if bench.nc.flash_attention.HAS_FA3 else "PyTorch SDPA (no Flash Attention 3: " \
        "it is fetched from the network, which this machine has none of)"
    print(f"device: {bench.name}; torch {torch.__version__}; nanochat's attention: {attention}")
    theirs, ours, _ = the_same_random_weights(bench)
    print(f"{bench.shape}: {sum(p.numel() for p in ours.parameters()) / 1e6:.0f}M parameters, nanochat's newest GPT; "
          f"{bench.prompts} questions x {bench.num_samples} replies of up to {bench.max_new_tokens} tokens, prompts "
          f"of {bench.prompt_len}")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (bench.prompt_len,), generator=gen).tolist() for _ in range(bench.prompts)]
    lengths = real_lengths(bench)
    if bench.part in ("all", "rollouts", "update"):
        rows = rollouts_side_by_side(bench, theirs, ours, prompts, lengths)
    if bench.part in ("all", "update"):
        update_side_by_side(bench, theirs, ours, prompts, rows)
    if bench.part in ("all", "pretrain"):
        pretrain_step(bench, theirs)


if __name__ == "__main__":
    main()
