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
nanochat is imported unmodified from ../shared/peers/nanochat (or $NANOCHAT_PEER); without it the script says so in
one line and exits 0. Its attention is Flash Attention 3 where its `kernels` hub fetches it; on a machine without
network its PyTorch SDPA fallback, which the first line says. Not collected by pytest.
"""
import argparse
import copy
import dataclasses
import os
import sys
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
from bench_shared import PEAK_BF16_TFLOPS, describe, engine_stopping_at, gsm8k_reply_lengths, stopping_at  # noqa: E402
from bench_shared import timed as timed_on  # noqa: E402
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
args = parser.parse_args()
sys.stdout.reconfigure(line_buffering=True)
if args.smoke:
    args.shape, args.vocab_size, args.seq_len, args.prompts, args.num_samples = "tiny", 512, 64, 2, 4
    args.device_batch_size, args.prompt_len, args.max_new_tokens, args.pretrain_rows = 2, 16, 48, 2
    args.device = args.device if torch.cuda.is_available() else "cpu"
elif not torch.cuda.is_available():
    print("bench_vs_nanochat.py measures a CUDA GPU, and this machine has none (--smoke runs it on a tiny shape)")
    sys.exit(0)
PEER = os.environ.get("NANOCHAT_PEER", os.path.join(ROOT, "..", "shared", "peers", "nanochat"))
if not os.path.isfile(os.path.join(PEER, "nanochat", "gpt.py")):
    print(f"no side-by-side: nanochat's code is not at {PEER} (set NANOCHAT_PEER to a checkout of it)")
    sys.exit(0)

# nanochat, imported offline: its tokenizer module imports the trainer's packages (only its tiktoken wrapper is used
# here), and its folder goes last on the path, so that this project's `model` and `tasks` stay ours
for name in ("rustbpe", "tokenizers"):
    sys.modules.setdefault(name, types.ModuleType(name))
sys.path.append(PEER)
import nanochat.engine as nanochat_engine  # noqa: E402
from nanochat import flash_attention  # noqa: E402
from nanochat.gpt import GPT as NanochatGPT, GPTConfig as NanochatConfig  # noqa: E402
from nanochat.tokenizer import RustBPETokenizer  # noqa: E402

device = torch.device(args.device)
cuda = device.type == "cuda"
autocast = torch.autocast(device.type, dtype=torch.bfloat16)
name = torch.cuda.get_device_name(device) if cuda else "cpu"
peak_tflops = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
tokenizer = Tokenizer.byte_level()  # nanochat's special tokens at nanochat's ids; the models never emit the rest
their_tokenizer = RustBPETokenizer(tokenizer.enc, "<|bos|>")


def timed(fn):
    return timed_on(fn, cuda)


def the_same_random_weights():
    """-> (nanochat's GPT, grpo.py's GPT) holding the same weights, on the device."""
    config = NanochatConfig(sequence_len=args.seq_len, vocab_size=args.vocab_size, window_pattern="SSSL",
                            **SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device("meta"):
        theirs = NanochatGPT(config)
    theirs.to_empty(device=device)
    theirs.init_weights()
    with torch.no_grad():  # output projections filled too: nanochat's zeros make every position ignore the others
        for name, p in theirs.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0, 0.02)
        theirs.lm_head.weight.normal_(0, 0.02)
        theirs.lm_head.weight[[tokenizer.assistant_end, tokenizer.bos, tokenizer.python_start]] = 0
    state = {k: v.detach().cpu() for k, v in theirs.state_dict().items()}
    ours = model_from_state(dataclasses.asdict(config), state, log=lambda line: None).to(device)
    ids = torch.randint(0, 256, (1, args.prompt_len), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():  # the same model: the same logits (nanochat computes in bf16 on a GPU, ours in float32 here)
        difference = (theirs(ids).float() - ours(ids)[..., :args.vocab_size]).abs().max().item()
    print(f"the same weights in both: logits {difference:.1e} apart at most (rounding: float32 on the CPU, nanochat's "
          f"bf16 on a GPU)")
    return theirs, ours


def their_rollouts(engine, prompts, lengths, set_lengths):
    """chat_rl.py's sampling loop for these questions: one generate_batch call per --device-batch-size replies."""
    calls = args.num_samples // args.device_batch_size
    rows = []
    for p, prompt in enumerate(prompts):
        for call in range(calls):
            first = p * args.num_samples + call * args.device_batch_size
            set_lengths(lengths[first:first + args.device_batch_size])
            sequences, masks = engine.generate_batch(prompt, num_samples=args.device_batch_size,
                                                     max_tokens=args.max_new_tokens, temperature=1.0, top_k=50,
                                                     seed=hash((0, p, call)) & 0x7FFFFFFF)
            rows += list(zip(sequences, masks))
    return rows


def their_update(model, optimizer, prompts, rows, rewards):
    """chat_rl.py's update for a step of these rows (sequences and masks as its sampling returns them): per question,
    passes of --device-batch-size padded rows, -logp weighted by reward - the question's mean, backward; then one
    optimizer step."""
    model.train()
    for p in range(len(prompts)):
        group = rows[p * args.num_samples:(p + 1) * args.num_samples]
        longest = max(len(seq) for seq, _ in group)
        ids = torch.tensor([seq + [tokenizer.assistant_end] * (longest - len(seq)) for seq, _ in group], device=device)
        mask = torch.tensor([m + [0] * (longest - len(m)) for _, m in group], device=device)
        inputs, targets = ids[:, :-1], ids[:, 1:].clone()
        targets[mask[:, 1:] == 0] = -1
        group_rewards = rewards[p].to(device)
        advantages = group_rewards - group_rewards.mean()
        passes = args.num_samples // args.device_batch_size
        for i in range(passes):
            b = slice(i * args.device_batch_size, (i + 1) * args.device_batch_size)
            logp = -model(inputs[b], targets[b], loss_reduction="none").view_as(inputs[b])
            valid = (targets[b] >= 0).sum().clamp(min=1)
            loss = -(logp * advantages[b].unsqueeze(-1)).sum() / (valid * passes * len(prompts))
            loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


def our_samples(rows, prompts):
    """The Engine's rows as grpo.py's sampler returns replies (tokens after the prompt, the stop token included)."""
    N, width = len(rows), args.max_new_tokens
    tokens, mask = torch.zeros(N, width, dtype=torch.long), torch.zeros(N, width, dtype=torch.long)
    lengths, truncated = torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.bool)
    for r, (seq, m) in enumerate(rows):
        reply, reply_mask = seq[len(prompts[r // args.num_samples]):], m[len(prompts[r // args.num_samples]):]
        stopped = len(reply) < width
        reply, reply_mask = reply + [tokenizer.assistant_end] * stopped, reply_mask + [1] * stopped
        tokens[r, :len(reply)], mask[r, :len(reply)] = torch.tensor(reply), torch.tensor(reply_mask)
        lengths[r], truncated[r] = len(reply), not stopped
    return dict(tokens=tokens, mask=mask, logprobs=torch.zeros(N, width), lengths=lengths, truncated=truncated)


def main():
    attention = "Flash Attention 3" if flash_attention.HAS_FA3 else "PyTorch SDPA (no Flash Attention 3: it is fetched " \
        "from the network, which this machine has none of)"
    print(f"device: {name}; torch {torch.__version__}; nanochat's attention: {attention}")
    theirs, ours = the_same_random_weights()
    print(f"{args.shape}: {sum(p.numel() for p in ours.parameters()) / 1e6:.0f}M parameters, nanochat's newest GPT; "
          f"{args.prompts} questions x {args.num_samples} replies of up to {args.max_new_tokens} tokens, prompts of "
          f"{args.prompt_len}")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    N = args.prompts * args.num_samples
    try:
        lengths = gsm8k_reply_lengths(tokenizer, args.gsm8k_dir, args.bytes_per_token, N, args.max_new_tokens)
        print(f"real lengths: {describe(lengths, args.bytes_per_token)}")
    except (OSError, ValueError) as e:
        lengths = torch.full((N,), args.max_new_tokens)
        print(f"every reply {args.max_new_tokens} tokens: GSM8K's train split is not at {args.gsm8k_dir} ({e})")
    rows = None
    if args.part in ("all", "rollouts", "update"):
        engine = nanochat_engine.Engine(theirs, their_tokenizer)
        theirs.eval()
        with engine_stopping_at(nanochat_engine, tokenizer.assistant_end) as set_lengths:
            their_rollouts(engine, prompts[:1], lengths, set_lengths)  # kernels and allocator warmed
            rows, their_seconds = timed(lambda: their_rollouts(engine, prompts, lengths, set_lengths))
        ours.use_compile = cuda  # grpo.py's GPU default: compiled, captured
        with stopping_at(lengths, tokenizer.assistant_end), autocast:
            generate(ours, tokenizer, prompts[:2], args.num_samples, args.max_new_tokens, 1.0, 50, seed=0)
        with stopping_at(lengths, tokenizer.assistant_end), autocast:
            samples, our_seconds = timed(lambda: generate(ours, tokenizer, prompts, args.num_samples,
                                                          args.max_new_tokens, 1.0, 50, seed=0))
        assert samples["lengths"].tolist() == our_samples(rows, prompts)["lengths"].tolist(), "lengths differ"
        tokens = int(lengths.sum())
        print(f"(a) rollouts: nanochat's Engine as chat_rl.py calls it {tokens / their_seconds:9.0f} tokens/s "
              f"({their_seconds:.2f} s); grpo.py's sampler {tokens / our_seconds:9.0f} tokens/s ({our_seconds:.2f} s): "
              f"{their_seconds / our_seconds:.1f}x")
    if args.part in ("all", "update"):
        rewards = torch.rand(args.prompts, args.num_samples, generator=torch.Generator().manual_seed(1))
        optimizer = theirs.setup_optimizer()
        their_update(theirs, optimizer, prompts[:1], rows[:args.num_samples], rewards)  # state made, warmed
        _, their_seconds = timed(lambda: their_update(theirs, optimizer, prompts, rows, rewards))
        step_args = grpo.resolve_config(["--algo", "reinforce", "--prompts-per-step", str(args.prompts),
                                         "--num-samples", str(args.num_samples), "--max-new-tokens",
                                         str(args.max_new_tokens), "--device", device.type])
        step_args.compile = cuda
        free = torch.cuda.mem_get_info(device)[0] if cuda else 2 ** 32
        grpo.fitted_plan(copy.deepcopy(ours).to("meta"), step_args, 1, args.prompt_len, "bfloat16", free, gpu=cuda)
        step_args.tokens_per_pass = step_args.tokens_per_pass or args.prompts * args.num_samples * (
            args.prompt_len + args.max_new_tokens)
        optimizers = grpo.make_optimizers(ours, step_args)
        static = (N, args.prompt_len + args.max_new_tokens - 1) if cuda else None
        batch = grpo.to_device(grpo.make_batch(prompts, our_samples(rows, prompts), rewards, step_args, static), device)
        ours.train()
        grpo.policy_update(ours, optimizers, batch, step_args, autocast)  # compiled, state made
        _, our_seconds = timed(lambda: grpo.policy_update(ours, optimizers, batch, step_args, autocast))
        real = sum(len(seq) for seq, _ in rows)
        print(f"(b) the RL update of those {N} rows ({real} tokens, prompts included): chat_rl.py's loop {real / their_seconds:9.0f} "
              f"tokens/s ({their_seconds:.2f} s, passes of {args.device_batch_size} rows); grpo.py's reinforce "
              f"{real / our_seconds:9.0f} tokens/s ({our_seconds:.2f} s, packed passes of {step_args.tokens_per_pass} "
              f"tokens: {len(batch['micro_batches'])}): {their_seconds / our_seconds:.1f}x")
    if args.part in ("all", "pretrain"):
        theirs.train()
        optimizer = theirs.setup_optimizer()
        compiled = torch.compile(theirs, dynamic=False) if cuda else theirs
        x = torch.randint(0, args.vocab_size, (args.pretrain_rows, args.seq_len), device=device, generator=None)
        y = torch.roll(x, -1, dims=1)

        def step():
            compiled(x, y).backward()
            optimizer.step()
            theirs.zero_grad(set_to_none=True)
        step()  # compiled
        _, seconds = timed(lambda: [step() for _ in range(3)])
        tokens_per_second = 3 * x.numel() / seconds
        mfu = tokens_per_second * theirs.estimate_flops() / (peak_tflops * 1e12) if peak_tflops else None
        print(f"(c) base_train's step ({args.pretrain_rows} rows of {args.seq_len} tokens"
              f"{', compiled' if cuda else ', eager: no compile off a GPU'}): "
              f"{tokens_per_second:9.0f} tokens/s, MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'}")


main()
