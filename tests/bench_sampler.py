"""
Sampler throughput: generated tokens per second, three ways, same random model(s) and prompts.

    python tests/bench_sampler.py                 # nanochat d4 shape, vocab 65,536
    python tests/bench_sampler.py --max-new-tokens 128 --device cuda
    python tests/bench_sampler.py --generation classic smear-backout --repeats 5   # oldest vs newest nanochat GPT
    python tests/bench_sampler.py --decode static --compile   # the decode step of static shapes, compiled
    python tests/bench_sampler.py --real-lengths --max-new-tokens 256 --decode static   # replies end at GSM8K's lengths
    python tests/bench_sampler.py --attempts 3 --max-new-tokens 32   # episodes of 3 turns of 32 sampled tokens
    python tests/bench_sampler.py --calculator --max-new-tokens 64   # a tool's answer forced into every reply
    python tests/bench_sampler.py --attempts 3 --stagger 5 --max-new-tokens 32   # rows' turns end apart

1. batched: all prompts x samples in one generate() call (the way grpo.py samples);
2. one prompt per call: generate() once per prompt, its samples batched;
3. naive: no KV cache, a full forward over the whole sequence for every new token (one prompt's samples).
The random model never emits a stop token, so every row generates exactly --max-new-tokens tokens; with
--real-lengths each batched reply stops where a GSM8K answer would (tests/bench_shared.py), the other ways skipped.
With several generations (same shape), their timings interleave, so that a busy machine slows them alike.
--attempts K: batched episodes of K turns, each of --max-new-tokens sampled tokens (its end forced there,
--max-turn-tokens) and answered by a --attempts feedback message forced into the row, against single-turn replies
of as many sampled tokens: what the environment's forced tokens cost.
--calculator: each reply opens a python block at its own column and closes it 4 later, a tool's answer (6 tokens
with its marks) forced after it, as GSM8K's calculator, against replies without one.
"""
import argparse
import os
import sys
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_shared import describe, gsm8k_reply_lengths, placed_at, stopping_at, timed  # noqa: E402
from model import GENERATIONS, GPT, GPTConfig, Tokenizer, generate, sample_tokens  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--generation", nargs="+", default=["padded-vocab"], choices=list(GENERATIONS), help="nanochat GPT generation(s)")
parser.add_argument("--n-layer", type=int, default=4)
parser.add_argument("--n-embd", type=int, default=256)
parser.add_argument("--n-head", type=int, default=2)
parser.add_argument("--sequence-len", type=int, default=1024, help="sets the attention windows of generations with windows")
parser.add_argument("--vocab-size", type=int, default=65536)
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--samples", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--repeats", type=int, default=1, help="time each way this many times: median and range")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--decode", default="auto", choices=["auto", "dynamic", "static", "graph"], help="generate()'s decode")
parser.add_argument("--compile", action="store_true", help="the static decode step through torch.compile (grpo.py's --compile)")
parser.add_argument("--real-lengths", action="store_true", help="batched replies stop at GSM8K's answer lengths")
parser.add_argument("--gsm8k-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k"))
parser.add_argument("--bytes-per-token", type=float, default=3.0, help="tests/bench_shared.py")
parser.add_argument("--attempts", type=int, default=0, help="episodes of this many turns against single-turn replies")
parser.add_argument("--calculator", action="store_true", help="replies with a tool's answer forced, against plain ones")
parser.add_argument("--stagger", type=int, default=0, help="with --attempts: row r's turns sample 1 + (r x this) %% "
                    "--max-new-tokens tokens each, so rows force their answers at different columns")
args = parser.parse_args()

torch.manual_seed(0)
device = torch.device(args.device)
tokenizer = Tokenizer.byte_level()
config = GPTConfig(sequence_len=args.sequence_len, vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                   n_kv_head=args.n_head, n_embd=args.n_embd, window_pattern="SSSL")
models = {}
for generation in args.generation:
    model = models[generation] = GPT(config, generation).init_weights(0).to(device).eval()
    model.use_compile = args.compile
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02)  # spread-out logits, so that sampling does real work
        model.lm_head.weight[[tokenizer.assistant_end, tokenizer.bos]] = 0  # logit 0: never in the top 50, never stops
prompts = [torch.randint(0, 256, (int(n),)).tolist() for n in torch.randint(20, 80, (args.prompts,))]
autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
print(f"model: {args.n_layer} layers, n_embd {args.n_embd}, vocab {args.vocab_size}; device {device}, "
      f"{torch.get_num_threads()} threads; {args.prompts} prompts x {args.samples} samples x {args.max_new_tokens} tokens; "
      f"decode {args.decode}{', compiled' if args.compile else ''}")


def batched(model):
    with stopping_at(lengths, tokenizer.assistant_end) if args.real_lengths else nullcontext():
        out = generate(model, tokenizer, prompts, args.samples, args.max_new_tokens, temperature=1.0, top_k=50,
                       decode=args.decode)
    return int(out["lengths"].sum())


def one_prompt_per_call(model):
    return sum(int(generate(model, tokenizer, [p], args.samples, args.max_new_tokens, temperature=1.0, top_k=50,
                            decode=args.decode)["lengths"].sum()) for p in prompts)


@torch.no_grad()
def naive_one_prompt(model):
    idx = torch.tensor([prompts[0]] * args.samples, device=device)
    for _ in range(args.max_new_tokens):
        logits = model.logits(model.hidden(idx)[:, -1], softcap=False)
        token, _ = sample_tokens(logits, 1.0, 50, torch.rand(len(idx), device=device), model.generation.softcap)
        idx = torch.cat([idx, token[:, None]], dim=1)
    return args.samples * args.max_new_tokens


FEEDBACK = "Your answer is wrong. Try again (2 attempts left)."  # as --attempts 3 words it


def single_turn(model):
    out = generate(model, tokenizer, prompts, args.samples, args.attempts * args.max_new_tokens, temperature=1.0,
                   top_k=50, decode=args.decode)
    return int(out["lengths"].sum())


def episodes(model):
    def respond(row, tokens, mask):
        return FEEDBACK if tokens.count(tokenizer.assistant_end) < args.attempts else None
    forced = len(tokenizer.encode(FEEDBACK)) + 3  # <|user_start|> .. <|user_end|><|assistant_start|>
    total = args.attempts * (args.max_new_tokens + 1) + (args.attempts - 1) * forced
    if not args.stagger:
        out = generate(model, tokenizer, prompts, args.samples, total, temperature=1.0, top_k=50, decode=args.decode,
                       respond=respond, max_turn_tokens=args.max_new_tokens)
        assert int(out["lengths"].sum()) == len(out["lengths"]) * total  # every turn to its cap, every answer forced
        return int(out["mask"].sum())  # sampled tokens, as the single-turn way counts
    marks = torch.zeros(args.prompts * args.samples, total, dtype=torch.long)
    for r in range(len(marks)):  # each turn's end where the row's own turn length puts it
        turn = 1 + r * args.stagger % args.max_new_tokens
        for k in range(args.attempts):
            marks[r, k * (turn + forced) + turn - 1] = 1
    with placed_at(marks, (tokenizer.assistant_end,), 256):  # sampled ids folded into bytes: no other stop
        out = generate(model, tokenizer, prompts, args.samples, total, temperature=1.0, top_k=50, decode=args.decode,
                       respond=respond)
    return int(out["mask"].sum())


def with_tool(model):
    rows = torch.arange(args.prompts * args.samples)
    opens = torch.randint(1, args.max_new_tokens // 2, (len(rows),), generator=torch.Generator().manual_seed(0))
    marks = torch.zeros(len(rows), args.max_new_tokens, dtype=torch.long)
    marks[rows, opens], marks[rows, opens + 4] = 1, 2  # <|python_start|>, <|python_end|> at each row's own columns
    with placed_at(marks, (tokenizer.python_start, tokenizer.python_end), 256):  # sampled ids folded into bytes
        out = generate(model, tokenizer, prompts, args.samples, args.max_new_tokens, temperature=1.0, top_k=50,
                       decode=args.decode, tool=lambda code: "1234")
    return int(out["mask"].sum())  # sampled tokens


lengths = None
if args.real_lengths:
    lengths = gsm8k_reply_lengths(tokenizer, args.gsm8k_dir, args.bytes_per_token, args.prompts * args.samples,
                                  args.max_new_tokens)
    print(describe(lengths, args.bytes_per_token))
with autocast:
    for model in models.values():
        generate(model, tokenizer, prompts[:2], 2, 4, top_k=50, decode=args.decode)  # warm-up (and compile)
    ways = [("batched, one call", batched), ("one prompt per call", one_prompt_per_call),
            ("naive, no cache (1 prompt)", naive_one_prompt)][:1 if args.real_lengths else 3]
    if args.attempts:
        ways = [(f"single turn, {args.attempts} x", single_turn), (f"{args.attempts}-turn episodes", episodes)]
        print(f"an episode: {args.attempts} x {args.max_new_tokens} sampled tokens, {args.attempts - 1} forced user "
              f"turns of {len(tokenizer.encode(FEEDBACK)) + 3} tokens, {args.attempts} forced ends")
    if args.calculator:
        ways = [("batched, one call", batched), ("a calculator call a reply", with_tool)]
    for name, fn in ways:
        runs = {generation: [] for generation in models}
        for _ in range(args.repeats):
            for generation, model in models.items():
                runs[generation].append(timed(lambda: fn(model), device.type == "cuda"))
        for generation, timings in runs.items():
            rates = sorted(tokens / seconds for tokens, seconds in timings)
            spread = f" (range {rates[0]:.0f}-{rates[-1]:.0f} over {args.repeats} runs)" if args.repeats > 1 else ""
            print(f"{name:28s} {generation:14s} {timings[0][0]:7d} tokens, median {rates[len(rates) // 2]:8.0f} tokens/s{spread}")
