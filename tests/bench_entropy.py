"""
The cost of the exact entropy: the training forward + backward of the log-probs (what policy_update runs per
micro-batch) with and without the entropy of the full distribution, interleaved, median of --repeats.

    python tests/bench_entropy.py                      # nanochat d4 shape, vocab 65,536, 8 rows x 256 tokens, CPU
    python tests/bench_entropy.py --device cuda --n-layer 20 --n-embd 1280 --n-head 10 --rows 16 --tokens 512

The entropy needs the softmax over the vocabulary at every position, which the chunked head computes anyway for
the log-sum-exp; the extra work is one exp, product and sum over [chunk, V], forward and in the recomputed
backward. "entropy logged" is what every update does (--entropy-coef 0: the entropy is computed, no gradient
flows through it); "entropy bonus" also back-propagates through it. Not collected by pytest.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GENERATIONS, GPT, GPTConfig  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--generation", default="smear-backout", choices=list(GENERATIONS))
parser.add_argument("--n-layer", type=int, default=4)
parser.add_argument("--n-embd", type=int, default=256)
parser.add_argument("--n-head", type=int, default=2)
parser.add_argument("--vocab-size", type=int, default=65536)
parser.add_argument("--rows", type=int, default=8)
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()

device = torch.device(args.device)
config = GPTConfig(sequence_len=args.tokens, vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                   n_kv_head=args.n_head, n_embd=args.n_embd, window_pattern="L")
model = GPT(config, args.generation).init_weights(0).to(device)
with torch.no_grad():
    model.lm_head.weight.normal_(0, 0.02)
idx = torch.randint(0, args.vocab_size, (args.rows, args.tokens), device=device)
targets = torch.randint(0, args.vocab_size, (args.rows, args.tokens), device=device)
autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


VARIANTS = {"log-probs only": (False, False), "+ entropy logged": (True, False), "+ entropy bonus": (True, True)}


def step(with_entropy, in_loss):
    start = time.perf_counter()
    with autocast:
        out = model.token_logprobs(idx, targets, with_entropy=with_entropy)
    logprobs, entropy = out if with_entropy else (out, None)
    (logprobs.mean() + (entropy.mean() if in_loss else 0)).backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


for variant in VARIANTS.values():
    step(*variant)  # warm-up
times = {name: [] for name in VARIANTS}
for _ in range(args.repeats):
    for name, variant in VARIANTS.items():
        times[name].append(step(*variant))
print(f"{args.generation}, {args.n_layer} layers x {args.n_embd}, vocab {args.vocab_size}, {args.rows} x {args.tokens} "
      f"tokens, {device}, forward + backward, median of {args.repeats}:")
base = statistics.median(times["log-probs only"])
for name in VARIANTS:
    median = statistics.median(times[name])
    print(f"  {name:18s} {median * 1e3:7.0f} ms  ({(median / base - 1) * 100:+.0f}%)")
