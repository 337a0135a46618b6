"""
The update on the CPU, measured by what decides its speed on a GPU: operations and host syncs per micro-batch
(counted with a TorchDispatchMode: every aten op, and those that make the host wait for the device), FLOPs per
real token against a batch of equally long rows (torch.utils.flop_counter), and seconds per update.

    python tests/bench_update.py                    # grpo (2 epochs, KL), 8 x 16 replies, GSM8K-like lengths
    python tests/bench_update.py --algo reinforce

The batch: prompts of 40-110 tokens, replies of a log-normal length (median 100 tokens, a long tail cut at
--max-new-tokens), as GSM8K's; random tokens on a small model (the counts per micro-batch and the FLOPs ratio do
not depend on its size; the seconds do). Run from any folder; not collected by pytest.
"""
import argparse
import os
import sys
import time
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

aten = torch.ops.aten
# ops whose result the host reads (a device-to-host copy and a wait): a scalar out of a tensor, or an output whose
# shape depends on the data
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
            aten.is_nonzero.default}


class CountOps(TorchDispatchMode):
    """Counts every aten op, and those that force a host sync: SYNC_OPS, indexing by a boolean mask, and copies
    from a GPU to the CPU."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        boolean_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] or []) if i is not None)
        to_host = func in (aten._to_copy.default, aten.copy_.default) and torch.is_tensor(args[0]) and (
            args[0].device.type != "cpu") and kwargs and str(kwargs.get("device", "")) == "cpu"
        if func in SYNC_OPS or boolean_index or to_host:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def gsm8k_like_samples(P, G, max_new_tokens, vocab, seed=0, equal=False):
    """-> (prompts, samples as generate returns them): P prompts of 40-110 tokens, G replies each of log-normal
    lengths (median 100), or with equal=True every prompt 75 tokens and every reply the same length."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = [75] * P if equal else torch.randint(40, 111, (P,), generator=gen).tolist()
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in prompt_lengths]
    lengths = (torch.exp(torch.randn(P * G, generator=gen) * 0.6) * 100).long().clamp(8, max_new_tokens)
    if equal:
        lengths = torch.full((P * G,), 100)
    columns = torch.arange(max_new_tokens)[None]
    mask = (columns < lengths[:, None]).long()
    samples = dict(tokens=torch.randint(1, vocab, (P * G, max_new_tokens), generator=gen) * mask, mask=mask,
                   logprobs=-torch.rand(P * G, max_new_tokens, generator=gen) * mask, lengths=lengths,
                   truncated=lengths == max_new_tokens)
    return prompts, samples


def real_tokens(prompts, samples, G):
    return sum(len(prompts[row // G]) + int(n) - 1 for row, n in enumerate(samples["lengths"]))


def measure(args, model, ref_model, prompts, samples, rewards, device_batch_size):
    """-> (ops, syncs, micro-batches, optimizer steps, FLOPs, seconds) of one update."""
    args.device_batch_size = device_batch_size
    batch = grpo.make_batch(prompts, samples, rewards, args)
    micro_batches = len(batch["micro_batches"]) if "micro_batches" in batch else -(-len(rewards.flatten()) // (
        device_batch_size * args.num_minibatches)) * args.num_minibatches
    optimizers = grpo.make_optimizers(model, args)
    counter, flops = CountOps(), FlopCounterMode(display=False)
    with counter, flops:
        stats, _ = grpo.policy_update(model, optimizers, batch, args, nullcontext(), ref_model)
    start = time.time()
    grpo.policy_update(model, optimizers, batch, args, nullcontext(), ref_model)
    return counter.ops, counter.syncs, micro_batches, stats["loss"], \
        flops.get_total_flops(), time.time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device-batch-size", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    bench = parser.parse_args()
    torch.manual_seed(0)
    args = grpo.resolve_config(["--algo", bench.algo, "--init", "scratch", "--device", "cpu", "--prompts-per-step",
                                str(bench.prompts), "--num-samples", str(bench.samples), "--max-new-tokens",
                                str(bench.max_new_tokens), "--device-batch-size", str(bench.device_batch_size)])
    config = GPTConfig(sequence_len=1024, vocab_size=bench.vocab, n_layer=bench.depth, n_head=2, n_kv_head=2,
                       n_embd=bench.width)
    model = GPT(config).init_weights(0)
    ref_model = GPT(config).init_weights(0).requires_grad_(False) if args.kl_coef else None
    rewards = torch.rand(bench.prompts, bench.samples).round()
    print(f"{bench.algo}: {bench.prompts} x {bench.samples} replies, up to {bench.max_new_tokens} new tokens; "
          f"model {bench.depth} layers x {bench.width}, vocab {bench.vocab}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    per_token = {}
    for name, equal in (("GSM8K-like lengths", False), ("equal lengths", True)):
        prompts, samples = gsm8k_like_samples(bench.prompts, bench.samples, bench.max_new_tokens, bench.vocab,
                                              equal=equal)
        tokens = real_tokens(prompts, samples, bench.samples)
        rows = [measure(args, model, ref_model, prompts, samples, rewards, size)
                for size in (bench.device_batch_size, 2 * bench.device_batch_size)]
        (ops, syncs, mbs, _, flops, seconds), (ops2, syncs2, mbs2, _, _, _) = rows
        per_token[name] = flops / tokens
        print(f"  {name}: {tokens} real tokens; --device-batch-size {bench.device_batch_size}: {mbs} micro-batch "
              f"passes a epoch, {ops} ops, {len(syncs)} syncs ({', '.join(sorted(set(syncs))) or 'none'}), "
              f"{flops / 1e9:.1f} GFLOP = {flops / tokens / 1e6:.2f} MFLOP per real token, {seconds:.2f} s")
        print(f"    per micro-batch (x{bench.device_batch_size} rows vs x{2 * bench.device_batch_size}): "
              f"{(ops - ops2) / (mbs - mbs2) / args.ppo_epochs:.0f} ops a pass and epoch, "
              f"{(len(syncs) - len(syncs2)) / (mbs - mbs2):.2f} syncs per micro-batch (all its passes)")
    ratio = per_token["GSM8K-like lengths"] / per_token["equal lengths"]
    print(f"  FLOPs per real token, GSM8K-like / equal lengths: {ratio:.3f}x")


if __name__ == "__main__":
    main()
