"""
The update on the CPU, measured by what decides its speed on a GPU: operations and host syncs per micro-batch and
per optimizer step (counted with a TorchDispatchMode: every aten op, and those that make the host wait for the
device), FLOPs per real token against a batch of equally long rows (torch.utils.flop_counter), and seconds per
update.

    python tests/bench_update.py                    # grpo (2 epochs, KL), 8 x 16 replies, GSM8K-like lengths:
                                                    # padded rows (8 a pass) and packed (1,536 tokens a pass)
    python tests/bench_update.py --algo reinforce
    python tests/bench_update.py --d20              # FLOPs per real token at d20's shape, counted (nothing runs)

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
import model as model_module  # noqa: E402
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


def measure(args, model, ref_model, prompts, samples, rewards, size, pack):
    """-> (ops, syncs, micro-batches, loss, FLOPs, seconds) of one update: padded rows, size a pass
    (--device-batch-size), or with pack=True packed passes of size tokens (--tokens-per-pass)."""
    args.pack = pack
    args.device_batch_size, args.tokens_per_pass = (None, size) if pack else (size, None)
    batch = grpo.make_batch(prompts, samples, rewards, args)
    micro_batches = len(batch["micro_batches"])
    optimizers = model_module.make_optimizers(model, args)
    counter, flops = CountOps(), FlopCounterMode(display=False)
    with counter, flops:
        stats, _ = grpo.policy_update(model, optimizers, batch, args, nullcontext(), ref_model)
    start = time.time()
    grpo.policy_update(model, optimizers, batch, args, nullcontext(), ref_model)
    return counter.ops, counter.syncs, micro_batches, stats["loss"], \
        flops.get_total_flops(), time.time() - start


def count_optimizer_step(model, args):
    """Aten ops of one optimizer step (optimizer_step: the step and its measurement) and of Muon's step alone, per
    matrix: on a GPU each is a kernel launch from the host, and Muon's eager step waited on them (d20's update on an
    H200: docs/performance.md)."""
    optimizers = model_module.make_optimizers(model, args)
    stats, gen = grpo.update_stats(torch.device("cpu")), torch.Generator().manual_seed(0)

    def set_gradients():
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    set_gradients()
    grpo.optimizer_step(model, optimizers, stats, 0.0)  # the optimizers' state exists from here on
    set_gradients()
    whole, muon_alone = CountOps(), CountOps()
    with whole:
        grpo.optimizer_step(model, optimizers, stats, 0.0)
    muon = next(opt for opt in optimizers if isinstance(opt, model_module.Muon))
    matrices = sum(len(group["params"]) for group in muon.param_groups)
    set_gradients()
    with muon_alone:
        muon.step()
    print(f"  optimizer step (Muon + AdamW {model_module.optimizer_version(model, args)}): "
          f"{whole.ops} ops for {sum(1 for _ in model.parameters())} weights; Muon's step {muon_alone.ops / matrices:.1f} "
          f"ops a matrix ({matrices} matrices)")


def count_d20(args):
    """FLOPs per real token at nanochat's d20 shape (newest generation, 16 x 16 GSM8K-like replies, forward and
    backward of every pass, counted on the meta device: nothing runs), padded rows and packed passes, against
    padded rows of equal lengths. The packed count is of the exact fallback's attention (each row's padded block);
    on CUDA flash attention computes each row's own triangle, a little less."""
    enabled = torch.is_autocast_enabled  # the meta device has no autocast: say it is off there
    torch.is_autocast_enabled = lambda device=None: False if device == "meta" else enabled(device)
    with torch.device("meta"):
        model = GPT(GPTConfig(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280),
                    "smear-backout")
    args.prompts_per_step, args.num_samples, args.max_new_tokens = 16, 16, 256

    def flops_per_token(prompts, samples, pack, size):
        args.pack = pack
        args.device_batch_size, args.tokens_per_pass = (None, size) if pack else (size, None)
        batch = grpo.to_device(grpo.make_batch(prompts, samples, torch.rand(16, 16).round(), args), "meta")
        counter = FlopCounterMode(display=False)
        with counter:
            for mb in batch["micro_batches"]:
                logprobs, entropy = grpo.logprobs_of(model, mb, args, with_entropy=True)
                (logprobs.sum() + entropy.sum()).backward()
        return counter.get_total_flops() / real_tokens(prompts, samples, 16)

    equal = flops_per_token(*gsm8k_like_samples(16, 16, 256, 65536, equal=True), False, 8)
    prompts, samples = gsm8k_like_samples(16, 16, 256, 65536)
    print("d20 (newest generation), 16 x 16 GSM8K-like replies, FLOPs per real token / padded rows of equal length:")
    for pack, size in ((False, 8), (False, 16), (False, 32), (True, 8192), (True, 16384), (True, 32768)):
        print(f"  {'packed, --tokens-per-pass' if pack else 'padded rows, --device-batch-size'} {size}: "
              f"{flops_per_token(prompts, samples, pack, size) / equal:.3f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device-batch-size", type=int, default=8)
    parser.add_argument("--tokens-per-pass", type=int, default=1536, help="packed passes (about 8 rows of 190)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--d20", action="store_true", help="count FLOPs per real token at d20's shape instead")
    bench = parser.parse_args()
    torch.manual_seed(0)
    args = grpo.resolve_config(["--algo", bench.algo, "--init", "scratch", "--device", "cpu", "--prompts-per-step",
                                str(bench.prompts), "--num-samples", str(bench.samples), "--max-new-tokens",
                                str(bench.max_new_tokens), "--device-batch-size", str(bench.device_batch_size)])
    if bench.d20:
        return count_d20(args)
    config = GPTConfig(sequence_len=1024, vocab_size=bench.vocab, n_layer=bench.depth, n_head=2, n_kv_head=2,
                       n_embd=bench.width)
    model = GPT(config).init_weights(0)
    ref_model = GPT(config).init_weights(0).requires_grad_(False) if args.kl_coef else None
    rewards = torch.rand(bench.prompts, bench.samples).round()
    print(f"{bench.algo}: {bench.prompts} x {bench.samples} replies, up to {bench.max_new_tokens} new tokens; "
          f"model {bench.depth} layers x {bench.width}, vocab {bench.vocab}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    count_optimizer_step(model, args)
    per_token = {}
    layouts = (("padded rows", False, bench.device_batch_size, "--device-batch-size"),
               ("packed", True, bench.tokens_per_pass, "--tokens-per-pass"))
    for name, equal in (("GSM8K-like lengths", False), ("equal lengths", True)):
        prompts, samples = gsm8k_like_samples(bench.prompts, bench.samples, bench.max_new_tokens, bench.vocab,
                                              equal=equal)
        tokens = real_tokens(prompts, samples, bench.samples)
        print(f"  {name}: {tokens} real tokens")
        for layout, pack, size, flag in layouts:
            rows = [measure(args, model, ref_model, prompts, samples, rewards, n, pack) for n in (size, 2 * size)]
            (ops, syncs, mbs, _, flops, seconds), (ops2, syncs2, mbs2, _, _, _) = rows
            per_token[name, layout] = flops / tokens
            print(f"    {layout}, {flag} {size}: {mbs} micro-batch passes a epoch, {ops} ops, {len(syncs)} syncs "
                  f"({', '.join(sorted(set(syncs))) or 'none'}), {flops / 1e9:.1f} GFLOP = "
                  f"{flops / tokens / 1e6:.2f} MFLOP per real token, {seconds:.2f} s an update")
            print(f"      per micro-batch ({flag} {size} vs {2 * size}): "
                  f"{(ops - ops2) / (mbs - mbs2) / args.ppo_epochs:.0f} ops a pass and epoch, "
                  f"{(len(syncs) - len(syncs2)) / (mbs - mbs2):.2f} syncs per micro-batch (all its passes)")
    for layout, *_ in layouts:
        ratio = per_token["GSM8K-like lengths", layout] / per_token["equal lengths", "padded rows"]
        print(f"  FLOPs per real token, {layout} at GSM8K-like lengths / padded rows of equal lengths: {ratio:.3f}x")


if __name__ == "__main__":
    main()
