"""
GPU benchmark: rollouts and training steps of nanochat-shaped models, next to the hardware's limits.

    python tests/bench_gpu.py                          # d12 and d20 shapes, vocab 65,536, bf16, on CUDA
    python tests/bench_gpu.py --shapes d20 --peak-tflops 989
    python tests/bench_gpu.py --smoke                  # the same code on a tiny shape, any device (a quick check)
    python tests/bench_gpu.py --shapes d20 --part eager        # one part a command: rollouts, eager, compiled
    python tests/bench_gpu.py --shapes d20 --part compiled --profile
    python tests/bench_gpu.py --shapes d20 --part compiled --algos grpo --layouts packed --no-self-check  # the default

Each row is printed as soon as it is measured, so a run cut short by a time limit keeps what it measured.

For each shape (random weights, nanochat's newest GPT generation by default), first grpo.py's start-up self-check
(the fast paths' log-probs and gradient against the plain float32 path, eager and compiled), then:
(a) rollouts: --prompts x --samples replies of --new-tokens tokens, in one generate() call per decode mode
    (graph+compile: the decode step compiled and captured as a CUDA graph, grpo.py's default on CUDA; graph: the
    same, not compiled; static: the same shapes, eager; dynamic: finished rows leave, the CPU's default), and one
    call per prompt; the prefill's time; the decode step's time next to its memory-bandwidth bound (bytes of bf16
    weights + KV cache read per step / the bandwidth of a device-to-device copy measured here);
(b) one training step of `reinforce` and of `grpo`, eager and compiled (--compile), in padded rows (--no-pack) at
    --device-batch-size rows a pass and at the rows grpo.py's memory plan fits on this GPU, and packed (grpo.py's
    default) at the tokens a pass the plan fits (--tokens-per-pass; compiled: the static shape): its split (sample /
    old + reference log-probs / update), the update's model FLOP utilisation (6 x matmul parameters + attention per
    real token, padding and recomputation not counted), peak memory next to the plan's; the compile's seconds apart (an update run
    before the timed one); with --profile the 15 CUDA kernels that take most of the timed update's time.
The random model never stops, so every reply has exactly --new-tokens tokens; rewards are random. The rollouts are
measured a second time at real lengths (tests/bench_shared.py: each reply stops where a GSM8K training answer would,
--bytes-per-token bytes a token), the decode's time next to the bound of reading the weights once a step and each
running row's filled cache only.
Not collected by pytest; on a machine without CUDA it says so and exits 0 (unless --smoke).
"""
import argparse
import copy
import gc
import os
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
from bench_shared import PEAK_BF16_TFLOPS, describe, gsm8k_reply_lengths, stopping_at  # noqa: E402
from bench_shared import timed as timed_on  # noqa: E402
from model import GENERATIONS, GPT, GPTConfig, Tokenizer, generate  # noqa: E402
from tasks.sort import Sort  # noqa: E402

SHAPES = {  # nanochat's depth-d models: width 64 * d, heads of 128 channels
    "d12": dict(n_layer=12, n_embd=768, n_head=6, n_kv_head=6),
    "d20": dict(n_layer=20, n_embd=1280, n_head=10, n_kv_head=10),
    "tiny": dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=2),
}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--shapes", default="d12,d20", help="comma-separated: " + ", ".join(SHAPES))
parser.add_argument("--generation", default="smear-backout", choices=list(GENERATIONS))
parser.add_argument("--vocab-size", type=int, default=65536)
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--samples", type=int, default=16)
parser.add_argument("--prompt-len", type=int, default=128)
parser.add_argument("--new-tokens", type=int, default=256)
parser.add_argument("--device-batch-size", type=int, default=8, help="rows per forward/backward in the update (grpo.py's default)")
parser.add_argument("--tokens-per-pass", type=int, default=None, help="packed passes' tokens (default: the plan's fit)")
parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: known GPUs by name)")
parser.add_argument("--smoke", action="store_true", help="tiny shape and batch on any device: checks that the script runs")
parser.add_argument("--device", default="cuda")
parser.add_argument("--part", default="all", choices=["all", "rollouts", "eager", "compiled"],
                    help="rollouts, the eager steps or the compiled steps alone (each fits a 10-minute command)")
parser.add_argument("--algos", default="reinforce,grpo", help="the training steps' --algo, comma-separated")
parser.add_argument("--layouts", default="rows,packed", help="rows (padded, --no-pack), packed, or both")
parser.add_argument("--no-self-check", dest="self_check", action="store_false",
                    help="skip the fast paths' check before the timings (its compile: ~75 s on a fresh machine)")
parser.add_argument("--profile", action="store_true", help="the 15 CUDA kernels of each timed update (torch.profiler)")
parser.add_argument("--gsm8k-dir", default=os.path.join(ROOT, "..", "shared", "data", "gsm8k"),
                    help="GSM8K's train.jsonl, for the rollouts at real lengths (absent: those are skipped)")
parser.add_argument("--bytes-per-token", type=float, default=3.0,
                    help="GSM8K's reply bytes a token of the tokenizer the lengths stand for")
args = parser.parse_args()
sys.stdout.reconfigure(line_buffering=True)  # every row out as soon as it is printed
if args.smoke:
    args.shapes, args.vocab_size, args.prompts, args.samples, args.prompt_len, args.new_tokens = "tiny", 512, 2, 2, 16, 8
    args.device = args.device if torch.cuda.is_available() else "cpu"
elif not torch.cuda.is_available():
    print("bench_gpu.py measures a CUDA GPU, and this machine has none: nothing to measure "
          "(--smoke runs the same code on a tiny shape here)")
    sys.exit(0)

device = torch.device(args.device)
cuda = device.type == "cuda"
autocast = torch.autocast(device.type, dtype=torch.bfloat16)
tokenizer = Tokenizer.byte_level()  # only its stop and tool ids matter here, and the model never emits them
name = torch.cuda.get_device_name(device) if cuda else "cpu"
peak_tflops = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def timed(fn):
    return timed_on(fn, cuda)


def copy_bandwidth():
    """Bytes per second of a large device-to-device copy (read + write): what a decode step can hope for."""
    x = torch.empty((2 ** 28 if cuda else 2 ** 24) // 4, dtype=torch.float32, device=device)
    x.clone()
    _, seconds = timed(lambda: [x.clone() for _ in range(10)])
    return 2 * x.numel() * 4 * 10 / seconds


def random_model(shape):
    config = GPTConfig(sequence_len=2048, vocab_size=args.vocab_size, window_pattern="SSSL", **SHAPES[shape])
    model = GPT(config, args.generation).init_weights(0).to(device)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02)  # spread-out logits, so that sampling does real work
        stop_and_tools = [tokenizer.assistant_end, tokenizer.bos, tokenizer.python_start, tokenizer.python_end]
        model.lm_head.weight[stop_and_tools] = 0  # logit 0: never in the top 50, so never sampled
    return model


def fast_path_check(model):
    """grpo.py's start-up self-check on this shape, before any timing: the fast paths (packed passes with flash
    attention, compiled on CUDA; the captured decode) against the plain float32 path, on sort prompts. Prints its
    line, or the error line that would stop a run."""
    for compiled in ((False, True) if cuda else (False,)):
        check = grpo.resolve_config(["--task", "sort", "--algo", "grpo", "--device", device.type, "--max-new-tokens",
                                     "16", "--tokens-per-pass", "2048", "--compile" if compiled else "--no-compile"])
        task = Sort("train")
        static = (8, task.longest_prompt(tokenizer) + 15) if compiled else None  # as a run's: rows, longest row
        run = SimpleNamespace(model=model, tokenizer=tokenizer, train_task=task, autocast=autocast, device=device,
                              static_pack=static, teacher=None, log=lambda line: print("  " + line))
        try:
            grpo.self_check(check, run)
        except SystemExit as stop:
            print(f"  {stop.code}")
        except Exception as e:  # a crash in a fast path is a finding too: the timings go on
            print(f"  self-check {'compiled' if compiled else 'eager'} crashed: {type(e).__name__}: {e}")
        model.use_compile = False


def rollouts(model, prompts, decode="auto", new_tokens=None):
    with autocast:
        return generate(model, tokenizer, prompts, args.samples, new_tokens or args.new_tokens, temperature=1.0,
                        top_k=50, seed=0, decode=decode)


def decode_bound(model, rows, bandwidth):
    """Seconds per decode step if it only had to read the bf16 weights and the average KV cache once."""
    embedding_tables = model.transformer.wte.weight.numel() + sum(p.numel() for p in model.value_embeds.parameters())
    weight_bytes = 2 * (sum(p.numel() for p in model.parameters()) - embedding_tables)  # tables: a row per token
    c = model.config
    average_len = args.prompt_len + args.new_tokens / 2
    kv_bytes = 2 * 2 * c.n_layer * rows * c.n_kv_head * (c.n_embd // c.n_head) * average_len
    return (weight_bytes + kv_bytes) / bandwidth, weight_bytes, kv_bytes


def decode_bound_at(model, lengths, bandwidth):
    """Seconds of a call's decode steps at these reply lengths if each step read the bf16 weights once and only the
    running rows' filled KV cache (step t computes token t + 1 of the rows longer than t)."""
    weight_bytes = decode_bound(model, 0, bandwidth)[1]
    c = model.config
    kv_per_token = 2 * 2 * c.n_layer * c.n_kv_head * (c.n_embd // c.n_head)
    steps = range(1, int(lengths.max()))
    return sum(weight_bytes + kv_per_token * int((lengths > t).sum()) * (args.prompt_len + t) for t in steps) / bandwidth


def update_flops(model, batch, passes):
    """Model FLOPs of the update's real tokens (padding not counted: a padded pass's extra work is waste):
    forward + backward = 6 per matmul parameter per token, plus attention over the token's own row. The head counts
    only at the positions in the loss, the only ones where the update runs it."""
    c = model.config
    block_params = sum(p.numel() for p in model.transformer.h.parameters())
    widths = batch["widths"].tolist()
    flops = 0
    for mb in batch["micro_batches"]:
        for row in mb["rows"].tolist():  # QK^T and AV, forward and backward, over the whole row as nanochat counts
            flops += widths[row] * (6 * block_params + 12 * c.n_layer * c.n_embd * widths[row])
        flops += mb["positions"].numel() * 6 * model.lm_head.weight.numel()
    return passes * flops


def fitted_sizes(model, algo, compiled):
    """The rows a padded pass and the tokens a packed pass that grpo.py's memory plan fits on this device (its
    --device-batch-size and --tokens-per-pass defaults on a GPU)."""
    gc.collect()  # what the last steps held, freed before the free memory is read
    if cuda:
        torch.cuda.empty_cache()
    plan_args = grpo.resolve_config(["--algo", algo, "--prompts-per-step", str(args.prompts), "--num-samples",
                                     str(args.samples), "--max-new-tokens", str(args.new_tokens)])
    plan_args.compile = compiled
    free = torch.cuda.mem_get_info(device)[0] if cuda else 2 ** 30
    sizes = []
    for pack in (False, True):
        plan_args.device_batch_size = plan_args.tokens_per_pass = None
        plan_args.pack = pack
        grpo.fitted_plan(copy.deepcopy(model).to("meta"), plan_args, 1, args.prompt_len, "bfloat16", free, gpu=True)
        sizes.append(plan_args.tokens_per_pass if pack else plan_args.device_batch_size)
    return sizes


def training_step(model, prompts, algo, compiled, layout):
    """layout: ("rows", n): padded rows, n a pass (--no-pack); ("tokens", n): packed passes of n tokens."""
    kind, size = layout
    gc.collect()  # the last step's model and optimizer state, held in reference cycles, freed before this one's
    if cuda:
        torch.cuda.empty_cache()
    flags = ["--algo", algo, "--prompts-per-step", str(args.prompts), "--num-samples", str(args.samples),
             "--max-new-tokens", str(args.new_tokens)] + (
        ["--no-pack", "--device-batch-size", str(size)] if kind == "rows" else ["--tokens-per-pass", str(size)])
    step_args = grpo.resolve_config(flags)
    step_args.compile = compiled  # as a run's start sets it
    policy = copy.deepcopy(model)
    policy.use_compile = compiled  # as grpo.py's --compile, before the reference copy
    optimizers = grpo.make_optimizers(policy, step_args)
    ref_model = copy.deepcopy(policy).requires_grad_(False) if step_args.kl_coef > 0 else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if compiled:
        rollouts(policy, prompts[:2])  # the decode step compiles here, not in the timed sampling
    samples, time_sample = timed(lambda: rollouts(policy, prompts))
    rewards = torch.rand(args.prompts, args.samples, generator=torch.Generator().manual_seed(0))
    rows = args.prompts * args.samples // step_args.num_minibatches  # as grpo.py's start_run: one shape a run
    static = (rows, args.prompt_len + args.new_tokens - 1) if compiled and kind == "tokens" else None
    batch = grpo.to_device(grpo.make_batch(prompts, samples, rewards, step_args, static), device)
    update = lambda: grpo.policy_update(policy, optimizers, batch, step_args, autocast, ref_model)  # noqa: E731
    if compiled:
        _, compile_seconds = timed(update)
        print(f"  (compiling {algo}'s forwards and backward, and one update: {compile_seconds:.0f} s)")
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) \
        if args.profile and cuda \
        else grpo.nullcontext()
    with profiler:
        (stats, time_logprobs), seconds = timed(update)
    time_update = seconds - time_logprobs
    passes = step_args.ppo_epochs * step_args.num_minibatches
    mfu = update_flops(policy, batch, passes) / time_update / (peak_tflops * 1e12) if peak_tflops else None
    peak_memory = f"{torch.cuda.max_memory_allocated(device) / 2 ** 30:.1f} GiB" if cuda else "-"
    label = f"{algo} {'compiled' if compiled else 'eager'} {'x' if kind == 'rows' else 'packed '}{size}"
    print(f"  step {label:28s}: sample {time_sample:6.2f} s | old+ref log-probs {time_logprobs:6.2f} s | update "
          f"{time_update:6.2f} s ({passes} pass{'es' if passes > 1 else ''}, {len(batch['micro_batches'])} micro-batches) | "
          f"update MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'} | peak memory {peak_memory}")
    # what grpo.py's memory plan predicts for this step (its reference here a float32 copy); the measured peak also
    # holds the bench's own copy of the model, the weights row once more
    plan = grpo.memory_plan(copy.deepcopy(policy).to("meta"), argparse.Namespace(**dict(
        vars(step_args), ref_dtype="float32")), 1, args.prompt_len, "bfloat16")
    print(f"  memory plan of that step: peak {grpo.size(grpo.plan_peak(plan))} (stays "
          f"{grpo.size(grpo.phase_bytes(plan))}, sampling {grpo.size(grpo.phase_bytes(plan, 'sampling'))}, update "
          f"{grpo.size(grpo.phase_bytes(plan, 'update'))}, of which activations (estimate) "
          f"{grpo.size(next(v for k, v in plan.items() if 'activations' in k))}); + the bench's model "
          f"{grpo.size(plan['weights (float32)'])}")
    if args.profile and cuda:
        print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))


bandwidth = copy_bandwidth()
print(f"device: {name}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; dense bf16 peak "
      f"{'unknown (pass --peak-tflops)' if peak_tflops is None else f'{peak_tflops:.0f} TFLOP/s'}; torch {torch.__version__}")
print(f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, prompts of {args.prompt_len} "
      f"tokens, generation {args.generation}, vocab {args.vocab_size}, bf16 autocast")
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
for shape in args.shapes.split(","):
    model = random_model(shape).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"{shape}: {model.config.n_layer} layers, width {model.config.n_embd}, {params / 1e6:.0f}M parameters")
    if args.self_check:
        fast_path_check(model)
    if args.part in ("all", "eager", "compiled"):
        for compiled in ((False, True) if cuda else (False,)):  # compiling on a CPU takes minutes
            if args.part != "all" and compiled != (args.part == "compiled"):
                continue
            for algo in args.algos.split(","):
                rows, tokens = fitted_sizes(model, algo, compiled)
                print(f"  {algo}: the memory plan fits {rows} padded rows or {tokens} packed tokens a pass")
                layouts = [("rows", args.device_batch_size), ("rows", rows)] * ("rows" in args.layouts) + \
                    [("tokens", args.tokens_per_pass or tokens), ("tokens", tokens)] * ("packed" in args.layouts)
                for layout in dict.fromkeys(layouts):
                    try:
                        training_step(model, prompts, algo, compiled, layout)
                    except torch.OutOfMemoryError as e:  # a plan that fits more than the device holds: a finding
                        print(f"  step {algo} {layout}: out of memory: {str(e).splitlines()[0]}")
    if args.part not in ("all", "rollouts"):
        continue
    new_tokens = args.prompts * args.samples * args.new_tokens
    seconds = {}
    modes = [("graph+compile", "graph", True)] if cuda else []  # compiling on a CPU takes minutes
    for label, decode, compiled in modes + [("graph", "graph", False), ("static", "static", False),
                                            ("dynamic", "dynamic", False)]:
        model.use_compile = compiled
        _, warm_up = timed(lambda: rollouts(model, prompts[:2], decode))  # compile, kernels, allocator
        if compiled:
            print(f"  (compiling the decode step: {warm_up:.0f} s)")
        _, seconds[label] = timed(lambda: rollouts(model, prompts, decode))
    model.use_compile = cuda  # grpo.py's default
    _, per_prompt_seconds = timed(lambda: [rollouts(model, [p]) for p in prompts])
    # the decode step: a whole call minus a call that only prefills and draws the first token
    _, prefill_seconds = timed(lambda: rollouts(model, prompts, new_tokens=1))
    best = modes[0][0] if modes else "graph"
    step_seconds = (seconds[best] - prefill_seconds) / (args.new_tokens - 1)
    bound, weight_bytes, kv_bytes = decode_bound(model, args.prompts * args.samples, bandwidth)
    print("  rollouts, one call: " + "; ".join(f"{decode} {new_tokens / s:9.0f} tokens/s ({s:.2f} s)"
                                              for decode, s in seconds.items()))
    print(f"  rollouts, one prompt per call (grpo.py's default decode): {new_tokens / per_prompt_seconds:9.0f} tokens/s "
          f"({per_prompt_seconds:.2f} s); prefill of {args.prompts} prompts + first tokens: {prefill_seconds:.3f} s")
    print(f"  decode step, {best} ({args.prompts * args.samples} rows): {1e3 * step_seconds:.2f} ms; bandwidth bound "
          f"{1e3 * bound:.2f} ms (weights {weight_bytes / 1e9:.2f} GB + KV cache {kv_bytes / 1e9:.2f} GB a step) "
          f"= {bound / step_seconds:.0%} of the bound")
    try:
        lengths = gsm8k_reply_lengths(tokenizer, args.gsm8k_dir, args.bytes_per_token, args.prompts * args.samples,
                                      args.new_tokens)
    except (OSError, ValueError) as e:
        print(f"  no rollouts at real lengths: GSM8K's train split is not at {args.gsm8k_dir} ({e}); pass --gsm8k-dir")
        lengths = None
    if lengths is not None:
        print(f"  at real lengths ({describe(lengths, args.bytes_per_token)}; {int(lengths.sum())} tokens a call)")
        bound = decode_bound_at(model, lengths, bandwidth)
        for label, decode, compiled in modes + [("static", "static", False), ("dynamic", "dynamic", False)]:
            model.use_compile = compiled
            with stopping_at(lengths, tokenizer.assistant_end):
                samples, call_seconds = timed(lambda: rollouts(model, prompts, decode))
            assert torch.equal(samples["lengths"], lengths), "the replies did not stop where they were told to"
            decode_seconds = call_seconds - prefill_seconds
            print(f"  rollouts at real lengths, {label}: {int(lengths.sum()) / call_seconds:9.0f} tokens/s "
                  f"({call_seconds:.2f} s); its decode steps {decode_seconds:.2f} s, bound {bound:.2f} s "
                  f"(the weights once a step, the running rows' filled cache) = {bound / decode_seconds:.0%}")
        model.use_compile = cuda
    del model
    if cuda:
        torch.cuda.empty_cache()
