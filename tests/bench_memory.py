"""
Memory and time of one full-GRPO step (KL on, 2 update epochs) for a nanochat-shaped model, three ways: full
fine-tuning with a float32 reference copy, with a bfloat16 reference copy, and LoRA (the reference is the base
model with its adapters off). Each measurement is a fresh process (peak memory is per process), the three
interleaved, --repeats rounds; the table gives the median.

    python tests/bench_memory.py                                # d8 shape, newest and classic generation, CPU
    python tests/bench_memory.py --device cuda --depth 20       # on a GPU: peak allocated instead of peak RSS
    python tests/bench_memory.py --plan                         # the memory plan of d20-d32 on 1 and 8 GPUs
    python tests/bench_memory.py --modes --new-tokens 256       # plan vs peak of each way to form the update's passes
    python tests/bench_memory.py --modes --allocated            # on the CPU also torch's allocated peak (slow)
    python tests/bench_memory.py --muon                         # Muon's step, in stacks of its matrices

--plan prints, in seconds and without running anything, the plan a run prints at its start (grpo.memory_plan) for
nanochat's newest generation at depths 20, 24, 26 and 32, for `reinforce`, `grpo` with KL (bf16 reference) and
`grpo` with LoRA r=16, on 1 and on 8 GPUs of --gpu-gib free memory each (sharded optimizer state on 8), with the
default sampling chunk a GPU run picks (as many replies as fit).

The model is nanochat's shape for --depth (width 64 x depth, head size 128, vocabulary 65,536, every generation's
extra tables) with random weights, saved as a nanochat checkpoint that grpo.py starts from; the step is grpo.py's
own (sampling, old / reference log-probs, two epochs of updates) on the sort task under bf16 autocast, with random
rewards (the random model never sorts: with equal rewards no update would run). On the CPU
"peak" is the peak resident set of the process during the step (Linux: reset just before it), which includes the
Python process itself (the "idle" row); on a GPU it is torch's peak allocated memory. Not collected by pytest.
"""
import argparse
import itertools
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import tiktoken
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import model as model_module  # noqa: E402
from model import GPT, GPTConfig, Tokenizer, save_checkpoint  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--depth", type=int, default=8)
parser.add_argument("--generations", nargs="+", default=["smear-backout", "classic"])
parser.add_argument("--lora-rank", type=int, default=16)
parser.add_argument("--prompts", type=int, default=2)
parser.add_argument("--samples", type=int, default=8)
parser.add_argument("--new-tokens", type=int, default=16)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--child", nargs=2, metavar=("INIT", "SETTING"), help=argparse.SUPPRESS)
parser.add_argument("--plan", action="store_true", help="print the memory plans of d20-d32 (no run)")
parser.add_argument("--gpu-gib", type=float, default=79.0, help="--plan: free memory of one GPU (an H100 80GB: ~79)")
parser.add_argument("--prompt-tokens", type=int, default=256, help="--plan: the longest prompt, tokens")
parser.add_argument("--allocated", action="store_true", help="on the CPU also torch's allocated peak, from the "
                    "profiler's allocation events (minutes a step)")
parser.add_argument("--modes", action="store_true", help="the update's passes formed each way: padded rows, packed "
                    "by a token budget, packed whole rows; the plan's peak next to the measured one")
parser.add_argument("--head", action="store_true", help="the peak of the head's chunk in bytes a logit: log-probs, "
                    "entropies logged or with their gradient, and a teacher's top-k gathered (the plan counts 16, "
                    "24 and 4 more)")
parser.add_argument("--muon", action="store_true", help="the peak of Muon's step in stacks of its matrices (the "
                    "memory plan counts 10)")
args = parser.parse_args()

SETTINGS = {"full, float32 reference": ["--ref-dtype", "float32"],
            "full, bf16 reference": ["--ref-dtype", "bfloat16"],
            f"LoRA r={args.lora_rank}": ["--lora-rank", str(args.lora_rank)]}
ROWS = args.prompts * args.samples
MODES = {f"padded rows, {ROWS // 2} a pass": ["--no-pack", "--device-batch-size", str(ROWS // 2)],
         f"packed, {ROWS // 2} rows a pass": ["--pack", "--device-batch-size", str(ROWS // 2)],
         f"packed, {ROWS // 2 * (args.new_tokens + 8)} tokens a pass": [
             "--pack", "--tokens-per-pass", str(ROWS // 2 * (args.new_tokens + 8))]}
if args.modes:
    SETTINGS = MODES


def checkpoint(folder, generation):
    """A random nanochat checkpoint of this depth and generation, with a byte-level tokenizer beside it."""
    width = 64 * args.depth
    config = GPTConfig(sequence_len=2048, vocab_size=65536, n_layer=args.depth, n_head=width // 128,
                       n_kv_head=width // 128, n_embd=width, window_pattern="SSSL")
    model = GPT(config, generation).init_weights(0)
    with torch.no_grad():  # output projections are zero from scratch: random, so that every matrix does something
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0, 0.02)
    model.disk_dtypes = {k: torch.bfloat16 for k in model.state_dict() if k.startswith(("transformer.wte.",
                                                                                         "value_embeds."))}
    checkpoint_dir = os.path.join(folder, generation, "chatsft_checkpoints", f"d{args.depth}")
    save_checkpoint(checkpoint_dir, 1, model)
    os.makedirs(os.path.join(folder, generation, "tokenizer"))
    with open(os.path.join(folder, generation, "tokenizer", "tokenizer.pkl"), "wb") as f:
        pickle.dump(tokenizer_of_nanochat_size(), f)
    return checkpoint_dir, sum(p.numel() for p in model.parameters())


def tokenizer_of_nanochat_size():
    """65,536 ids like nanochat's: the 256 bytes, 4-byte tokens no merge can form (prompts encode byte by byte,
    any sampled id decodes), then the chat special tokens."""
    byte_level = Tokenizer.byte_level().enc
    specials = sorted(byte_level._special_tokens, key=byte_level._special_tokens.get)
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"\xfe" + i.to_bytes(3, "big"): i for i in range(256, 65536 - len(specials))})
    return tiktoken.Encoding(name="bench-65536", pat_str=byte_level._pat_str, mergeable_ranks=ranks,
                             special_tokens={s: 65536 - len(specials) + i for i, s in enumerate(specials)})


def resident_mb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def child(init, setting):
    """One process, one step: -> JSON line with the memory before and at the peak of the step, and its seconds."""
    flags = ["--init", init, "--task", "sort", "--algo", "grpo", "--dtype", "bfloat16", "--device", args.device,
             "--prompts-per-step", str(args.prompts), "--num-samples", str(args.samples), "--max-new-tokens",
             str(args.new_tokens), "--num-steps", "1", "--eval-every", "0", "--log-samples", "0", "--runs-dir",
             tempfile.mkdtemp(), *(SETTINGS[setting] if args.modes else ["--device-batch-size", str(ROWS),
                                                                         *SETTINGS[setting]])]
    run_args = grpo.resolve_config(flags)
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            run = grpo.start_run(run_args, os.path.join(run_args.runs_dir, "run"), 0, writes=False)
            grpo.save_training_state = lambda *a, **k: None  # the step only, not its checkpoint
            sample_groups = grpo.sample_groups

            def random_rewards(*a, **k):  # a random model never sorts: equal rewards, no update would run
                groups = sample_groups(*a, **k)
                groups["rewards"] = torch.rand(groups["rewards"].shape, generator=torch.Generator().manual_seed(0))
                return groups
            grpo.sample_groups = random_rewards
            cuda = run.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated() / 2 ** 20
                torch.cuda.reset_peak_memory_stats()
            else:
                before = resident_mb("VmRSS")
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak resident set (VmHWM) to the current one
            # --allocated: on the CPU also torch's own count, as a GPU's: every allocation and free the profiler
            # records (slow: minutes a step)
            counting = args.allocated and not cuda
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                              profile_memory=True) if counting else nullcontext()
            start = time.perf_counter()
            with profiler:
                grpo.train(run_args, run)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else resident_mb("VmHWM")
            allocated = peak - before if cuda else cpu_allocated_peak(profiler) / 2 ** 20 if counting else float("nan")
            longest = run.train_task.longest_prompt(run.tokenizer)
            plan = grpo.memory_plan(run.model, run_args, 1, longest, "bfloat16")
        finally:
            sys.stdout = stdout
    # the optimizer state is first allocated by the step's optimizer step: it grows inside the measured step too
    print(json.dumps(dict(before_mb=before, peak_mb=peak, allocated_mb=allocated, seconds=seconds, planned_step_mb=(max(
        grpo.phase_bytes(plan, "sampling"), grpo.phase_bytes(plan, "update")) + plan["optimizer state per rank"])
        / 2 ** 20)))


def main():
    print(f"one full-GRPO step (KL on, 2 epochs), {args.prompts} prompts x {args.samples} replies x "
          f"{args.new_tokens} new tokens, bf16 autocast, on {args.device}; median of {args.repeats} interleaved")
    idle = float("nan")
    if args.device == "cpu":
        idle = float(subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); import grpo; "
                                     "print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"],
                                    capture_output=True, text=True, check=True).stdout) / 1024
        print(f"idle process (python, torch and grpo.py imported): {idle:.0f} MB resident")
    with tempfile.TemporaryDirectory() as folder:
        for generation in args.generations:
            init, params = checkpoint(folder, generation)
            print(f"\n{generation} d{args.depth}: {params / 1e6:.0f}M parameters, {params * 4 / 2 ** 20:.0f} MB "
                  "in float32")
            results = {setting: [] for setting in SETTINGS}
            for _ in range(args.repeats):
                for setting in SETTINGS:
                    out = subprocess.run([sys.executable, __file__, "--device", args.device, "--depth", str(args.depth),
                                          "--lora-rank", str(args.lora_rank), "--prompts", str(args.prompts),
                                          "--samples", str(args.samples), "--new-tokens", str(args.new_tokens),
                                          *(["--modes"] if args.modes else []),
                                          *(["--allocated"] if args.allocated else []), "--child", init, setting],
                                         capture_output=True, text=True)
                    if out.returncode:
                        sys.exit(f"{setting}: {out.stderr.strip().splitlines()[-1]}")
                    results[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print("| setting | held before the step (MB) | peak during the step (MB) | step's growth (MB) | torch's "
                  "allocated peak in the step (MB) | the plan's larger phase + optimizer state (MB) | step (s) |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for setting, runs in results.items():
                median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                print(f"| {setting} | {median['before_mb']:.0f} | {median['peak_mb']:.0f} | "
                      f"{median['peak_mb'] - median['before_mb']:.0f} | {median['allocated_mb']:.0f} | "
                      f"{median['planned_step_mb']:.0f} | "
                      f"{median['seconds']:.1f} |")


def cpu_allocated_peak(profiler):
    """Bytes torch allocated on the CPU at the peak of a block profiled with profile_memory=True, above its start:
    every allocation and free the profiler recorded, in order."""
    events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    return max(itertools.accumulate(n for _, n in events))


def head_chunk(k=64):
    """token_logprobs' head, forward and backward, over one chunk (HEAD_CHUNK logits: 2,048 positions at vocabulary
    65,536; one layer of width 128 below it): torch's allocated peak above its start on the CPU, in bytes a logit."""
    V = 65536
    model = GPT(GPTConfig(sequence_len=2048, vocab_size=V, n_layer=1, n_head=1, n_kv_head=1, n_embd=128)).init_weights(0)
    n = grpo.HEAD_CHUNK // V
    idx, targets, top_ids = torch.randint(V, (1, n)), torch.randint(V, (1, n)), torch.randint(V, (1, n, k))
    print(f"the head's chunk ({n} positions x {V} logits), torch's allocated peak above its start, bytes a logit:")
    for name, flags in (("log-probs", {}), ("+ entropies, logged", dict(with_entropy=True, entropy_grad=False)),
                        ("+ entropies, with their gradient", dict(with_entropy=True)),
                        (f"+ entropies logged, a teacher's top-{k} gathered",
                         dict(with_entropy=True, entropy_grad=False, top_ids=top_ids))):
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with profiler:
            out = model.token_logprobs(idx, targets, **flags)
            out = out if isinstance(out, tuple) else (out,)
            sum(t.sum() for t in out if t is not None and t.requires_grad).backward()
        print(f"  {name}: {cpu_allocated_peak(profiler) / (n * V):.2f}")


def muon_step():
    """Muon's step beside the gradients, in float32 copies of one of its stacks (model_module.MUON_STACK_BYTES): 8 matrices
    of one shape in stacks of 4, one optimizer_step (the measurement's copy included) after one that made the state."""
    print("Muon's step (grpo.optimizer_step), torch's allocated peak above its start on the CPU, in stacks:")
    for version in ("v1", "v5"):
        for shape in ((512, 512), (1024, 256), (256, 1024)):
            model_module.MUON_STACK_BYTES = 4 * shape[0] * shape[1] * 4
            params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(shape)) for _ in range(8)])
            optimizer, stats = model_module.Muon(params, lr=0.02, version=version, weight_decay=0.1), grpo.update_stats("cpu")
            for counted in (False, True):
                for p in params:
                    p.grad = torch.randn(shape)
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
                with profiler if counted else nullcontext():
                    grpo.optimizer_step(params, [optimizer], stats, 0.0)
            print(f"  {version}, {shape[0]} x {shape[1]}: {cpu_allocated_peak(profiler) / model_module.MUON_STACK_BYTES:.2f}")


def plans():
    """The memory plan of nanochat's newest generation at d20-d32 for three settings on 1 and 8 GPUs."""
    settings = {"reinforce": ["--algo", "reinforce"], "grpo, KL": ["--algo", "grpo"],
                "grpo, KL, LoRA r=16": ["--algo", "grpo", "--lora-rank", "16"]}
    free = args.gpu_gib * 2 ** 30
    print(f"memory plan per GPU: nanochat's newest generation, bf16, --prompts-per-step 16 --num-samples 16 "
          f"--max-new-tokens 256, prompts up to {args.prompt_tokens} tokens, {args.gpu_gib:g} GiB free a GPU; "
          "GiB per GPU; sampling: the default chunk a GPU run picks (replies a generate call)")
    print("| model | params | setting | GPUs | weights | optimizer state per rank | reference | sampling (replies) "
          "| bf16 weight copies | update: gradients + activations (tokens a pass) | peak | fits |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for depth in (20, 24, 26, 32):
        width = 64 * depth
        config = GPTConfig(sequence_len=2048, vocab_size=65536, n_layer=depth, n_head=width // 128,
                           n_kv_head=width // 128, n_embd=width, window_pattern="SSSL")
        for name, flags in settings.items():
            for gpus in (1, 8):
                with torch.device("meta"):
                    model = GPT(config, "smear-backout")
                run_args = grpo.resolve_config(["--init", "x", "--dtype", "bfloat16", *flags,
                                                "--shard-optimizer" if gpus > 1 else "--no-shard-optimizer"])
                run_args.tokens_per_pass = None  # fitted, as on a GPU (the CPU's default is 4,096)
                run_args.compile = True  # a GPU run's default
                if run_args.lora_rank:
                    model.add_lora(run_args.lora_rank, run_args.lora_alpha, 0)
                plan, smallest = grpo.fitted_plan(model, run_args, gpus, args.prompt_tokens, "bfloat16", free, True)
                rows = grpo.sample_batch_rows(run_args, gpus)
                gib = {k.split(":")[0] if ":" in k else k: v / 2 ** 30 for k, v in plan.items()}
                update = grpo.phase_bytes(plan, "update") / 2 ** 30
                fits = "yes" if grpo.plan_peak(smallest) <= free else "no"
                print(f"| d{depth} | {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B | {name} | {gpus} | "
                      f"{gib['weights (float32)']:.1f} | {gib['optimizer state per rank']:.1f} | "
                      f"{gib['reference model']:.1f} | {grpo.phase_bytes(plan, 'sampling') / 2 ** 30:.1f} ({rows}) | "
                      f"{gib['bf16 copies of the weights (autocast)']:.1f} | {update:.1f} ({run_args.tokens_per_pass:,}) | "
                      f"{grpo.plan_peak(plan) / 2 ** 30:.1f} | {fits} |")


if args.plan:
    plans()
elif args.head:
    head_chunk()
elif args.muon:
    muon_step()
elif args.child:
    child(*args.child)
else:
    main()
