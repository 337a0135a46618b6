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
    before the timed one); with --profile the 15 CUDA kernels that take most of one more update's time.
The random model never stops, so every reply has exactly --new-tokens tokens; rewards are random. The rollouts are
measured a second time at real lengths (tests/bench_shared.py: each reply stops where a GSM8K training answer would,
--bytes-per-token bytes a token), the decode's time next to the bound of reading the weights once a step and each
running row's filled cache only.
Not collected by pytest; on a machine without CUDA it says so and exits 0 (unless --smoke). Its functions are also
tests/gpu_session.py's parts 3, 4 and 6.
"""
import argparse
import copy
import gc
import os
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import model as model_module  # noqa: E402
from bench_shared import PEAK_BF16_TFLOPS, describe, gsm8k_reply_lengths, placed_at, stopping_at  # noqa: E402
from bench_shared import timed  # noqa: E402
from model import GENERATIONS, GPT, GPTConfig, Tokenizer, generate  # noqa: E402
from tasks import Attempts, episode_responder  # noqa: E402
from tasks.gsm8k import calculator  # noqa: E402
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
def configure(argv=None):
    """-> the bench's settings: its flags (--smoke applied), and the device, autocast, tokenizer and dense bf16 peak
    it measures with (tests/gpu_session.py configures it with its own flags); None for CUDA on a machine without."""
    bench = parser.parse_args(argv)
    if bench.smoke:
        bench.shapes, bench.vocab_size, bench.prompts, bench.samples, bench.prompt_len, bench.new_tokens = \
            "tiny", 512, 2, 2, 16, 8
        bench.device = bench.device if torch.cuda.is_available() else "cpu"
    bench.device = torch.device(bench.device)
    bench.cuda = bench.device.type == "cuda"
    if bench.cuda and not torch.cuda.is_available():
        return None
    bench.autocast = torch.autocast(bench.device.type, dtype=torch.bfloat16)
    bench.tokenizer = Tokenizer.byte_level()  # only its stop and tool ids matter here, and the model never emits them
    bench.name = torch.cuda.get_device_name(bench.device) if bench.cuda else "cpu"
    bench.peak_tflops = bench.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in bench.name), None)
    return bench


def copy_bandwidth(bench):
    """Bytes per second of a large device-to-device copy (read + write): what a decode step can hope for."""
    x = torch.empty((2 ** 28 if bench.cuda else 2 ** 24) // 4, dtype=torch.float32, device=bench.device)
    x.clone()
    _, seconds = timed(lambda: [x.clone() for _ in range(10)], bench.cuda)
    return 2 * x.numel() * 4 * 10 / seconds


def random_model(bench, shape):
    config = GPTConfig(sequence_len=2048, vocab_size=bench.vocab_size, window_pattern="SSSL", **SHAPES[shape])
    model = GPT(config, bench.generation).init_weights(0).to(bench.device)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02)  # spread-out logits, so that sampling does real work
        t = bench.tokenizer
        model.lm_head.weight[[t.assistant_end, t.bos, t.python_start, t.python_end]] = 0  # never in the top 50
    return model


def fast_path_check(bench, model, compiled=None):
    """grpo.py's start-up self-check on this shape, before any timing: the fast paths (packed passes with flash
    attention, compiled on CUDA; the captured decode) against the plain float32 path, on sort prompts, eager and
    (on CUDA) compiled, or as compiled says (a tuple of False / True). Prints its lines, or the error line that
    would stop a run, and returns them."""
    lines = []

    def say(line):
        print("  " + line)
        lines.append(line)
    for compile_ in compiled or ((False, True) if bench.cuda else (False,)):
        check = grpo.resolve_config(["--task", "sort", "--algo", "grpo", "--device", bench.device.type,
                                     "--max-new-tokens", "16", "--tokens-per-pass", "2048",
                                     "--compile" if compile_ else "--no-compile"])
        task = Sort("train")
        static = (8, task.longest_prompt(bench.tokenizer) + 15) if compile_ else None  # as a run's: rows, longest row
        run = SimpleNamespace(model=model, tokenizer=bench.tokenizer, train_task=task, autocast=bench.autocast,
                              device=bench.device, static_pack=static, teacher=None, log=say)
        try:
            grpo.self_check(check, run)
        except SystemExit as stop:
            say(str(stop.code))
        except Exception as e:  # a crash in a fast path is a finding too: the timings go on
            say(f"self-check {'compiled' if compile_ else 'eager'} crashed: {type(e).__name__}: {e}")
        model.use_compile = False
    return lines


def rollouts(bench, model, prompts, decode="auto", new_tokens=None):
    with bench.autocast:
        return generate(model, bench.tokenizer, prompts, bench.samples, new_tokens or bench.new_tokens,
                        temperature=1.0, top_k=50, seed=0, decode=decode)


def decode_bound(bench, model, rows, bandwidth):
    """Seconds per decode step if it only had to read the bf16 weights and the average KV cache once."""
    embedding_tables = model.transformer.wte.weight.numel() + sum(p.numel() for p in model.value_embeds.parameters())
    weight_bytes = 2 * (sum(p.numel() for p in model.parameters()) - embedding_tables)  # tables: a row per token
    c = model.config
    average_len = bench.prompt_len + bench.new_tokens / 2
    kv_bytes = 2 * 2 * c.n_layer * rows * c.n_kv_head * (c.n_embd // c.n_head) * average_len
    return (weight_bytes + kv_bytes) / bandwidth, weight_bytes, kv_bytes


def decode_bound_at(bench, model, lengths, bandwidth):
    """Seconds of a call's decode steps at these reply lengths if each step read the bf16 weights once and only the
    running rows' filled KV cache (step t computes token t + 1 of the rows longer than t)."""
    weight_bytes = decode_bound(bench, model, 0, bandwidth)[1]
    c = model.config
    kv_per_token = 2 * 2 * c.n_layer * c.n_kv_head * (c.n_embd // c.n_head)
    steps = range(1, int(lengths.max()))
    return sum(weight_bytes + kv_per_token * int((lengths > t).sum()) * (bench.prompt_len + t)
               for t in steps) / bandwidth


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


def free_memory(bench):
    gc.collect()  # what the last steps held, in reference cycles, freed before the free memory is read
    if bench.cuda:
        torch.cuda.empty_cache()


def fitted_sizes(bench, model, algo, compiled):
    """The rows a padded pass and the tokens a packed pass that grpo.py's memory plan fits on this device (its
    --device-batch-size and --tokens-per-pass defaults on a GPU)."""
    free_memory(bench)
    plan_args = grpo.resolve_config(["--algo", algo, "--prompts-per-step", str(bench.prompts), "--num-samples",
                                     str(bench.samples), "--max-new-tokens", str(bench.new_tokens)])
    plan_args.compile = compiled
    free = torch.cuda.mem_get_info(bench.device)[0] if bench.cuda else 2 ** 30
    sizes = []
    for pack in (False, True):
        plan_args.device_batch_size = plan_args.tokens_per_pass = None
        plan_args.pack = pack
        grpo.fitted_plan(copy.deepcopy(model).to("meta"), plan_args, 1, bench.prompt_len, "bfloat16", free, gpu=True)
        sizes.append(plan_args.tokens_per_pass if pack else plan_args.device_batch_size)
    return sizes


def top_kernels(profiler, cuda, n=15):
    """-> [(name, milliseconds, share of the total)] of the n kernels (ops, on a CPU) that took most of the profiled
    time of their own."""
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = [e for e in profiler.key_averages() if own(e) > 0]
    total = sum(own(e) for e in events)
    return [(e.key, own(e) / 1e3, own(e) / total) for e in sorted(events, key=own, reverse=True)[:n]]


def training_step(bench, model, prompts, algo, compiled, layout, samples=None):
    """One step of algo from model's weights (copied; model stays as it is): sampling (unless samples, a
    generate() result of these prompts, is given), the old and reference log-probs, the update; its compile apart
    (an update run before the timed one); with --profile the kernels of one more update. layout: ("rows", n):
    padded rows, n a pass (--no-pack); ("tokens", n): packed passes of n tokens. Prints its row and returns it."""
    kind, size = layout
    free_memory(bench)  # the last step's model and optimizer state freed before this one's
    flags = ["--algo", algo, "--prompts-per-step", str(bench.prompts), "--num-samples", str(bench.samples),
             "--max-new-tokens", str(bench.new_tokens)] + (
        ["--no-pack", "--device-batch-size", str(size)] if kind == "rows" else ["--tokens-per-pass", str(size)])
    step_args = grpo.resolve_config(flags)
    step_args.compile = compiled  # as a run's start sets it
    policy = copy.deepcopy(model)
    policy.use_compile = compiled  # as grpo.py's --compile, before the reference copy
    optimizers = model_module.make_optimizers(policy, step_args)
    ref_model = copy.deepcopy(policy).requires_grad_(False) if step_args.kl_coef > 0 else None
    if bench.cuda:
        torch.cuda.reset_peak_memory_stats(bench.device)
    time_sample = None
    if samples is None:
        if compiled:
            rollouts(bench, policy, prompts[:2])  # the decode step compiles here, not in the timed sampling
        samples, time_sample = timed(lambda: rollouts(bench, policy, prompts), bench.cuda)
    rewards = torch.rand(bench.prompts, bench.samples, generator=torch.Generator().manual_seed(0))
    rows = bench.prompts * bench.samples // step_args.num_minibatches  # as grpo.py's start_run: one shape a run
    static = (rows, bench.prompt_len + bench.new_tokens - 1) if compiled and kind == "tokens" else None
    batch = grpo.to_device(grpo.make_batch(prompts, samples, rewards, step_args, static), bench.device)
    update = lambda: grpo.policy_update(policy, optimizers, batch, step_args, bench.autocast, ref_model)  # noqa: E731
    compile_seconds = timed(update, bench.cuda)[1] if compiled else None
    if compiled:
        print(f"  (compiling {algo}'s forwards and backward, and one update: {compile_seconds:.0f} s)")
    (stats, time_logprobs), seconds = timed(update, bench.cuda)
    time_update = seconds - time_logprobs
    passes = step_args.ppo_epochs * step_args.num_minibatches
    mfu = update_flops(policy, batch, passes) / time_update / (bench.peak_tflops * 1e12) if bench.peak_tflops else None
    peak = torch.cuda.max_memory_allocated(bench.device) / 2 ** 30 if bench.cuda else None
    label = f"{algo} {'compiled' if compiled else 'eager'} {'x' if kind == 'rows' else 'packed '}{size}"
    print(f"  step {label:28s}: sample {'-' if time_sample is None else f'{time_sample:6.2f} s'} | old+ref log-probs "
          f"{time_logprobs:6.2f} s | update {time_update:6.2f} s ({passes} pass{'es' if passes > 1 else ''}, "
          f"{len(batch['micro_batches'])} micro-batches) | update MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
          f"peak memory {'-' if peak is None else f'{peak:.1f} GiB'}")
    # what grpo.py's memory plan predicts for this step (its reference here a float32 copy); the measured peak also
    # holds the bench's own copy of the model, the weights row once more
    plan = grpo.memory_plan(copy.deepcopy(policy).to("meta"), argparse.Namespace(**dict(
        vars(step_args), ref_dtype="float32")), 1, bench.prompt_len, "bfloat16")
    print(f"  memory plan of that step: peak {grpo.size(grpo.plan_peak(plan))} (stays "
          f"{grpo.size(grpo.phase_bytes(plan))}, sampling {grpo.size(grpo.phase_bytes(plan, 'sampling'))}, update "
          f"{grpo.size(grpo.phase_bytes(plan, 'update'))}, of which activations (estimate) "
          f"{grpo.size(next(v for k, v in plan.items() if 'activations' in k))}); + the bench's model "
          f"{grpo.size(plan['weights (float32)'])}")
    kernels = None
    if bench.profile:  # one more update, so that the profiler's overhead stays out of the timing above
        activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * bench.cuda
        with torch.profiler.profile(activities=activities) as profiler:
            timed(update, bench.cuda)
        kernels = top_kernels(profiler, bench.cuda)
        print("\n".join(f"    {ms:9.1f} ms {share:6.1%}  {name[:90]}" for name, ms, share in kernels))
    return dict(algo=algo, compiled=compiled, layout=kind, size=size, sample_s=time_sample, logprobs_s=time_logprobs,
                update_s=time_update, compile_s=compile_seconds, passes=passes,
                micro_batches=len(batch["micro_batches"]), mfu=mfu, peak_gib=peak,
                plan_gib=(grpo.plan_peak(plan) + plan["weights (float32)"]) / 2 ** 30, kernels=kernels)


def rollout_modes(bench, model, prompts, modes):
    """-> ({label: (samples, seconds) of one generate() call of every prompt}, seconds of the compiling warm-up or
    None): each mode (label, decode, compiled) warmed first by a call of 2 prompts (its compile, kernels, allocator)."""
    calls, compile_seconds = {}, None
    for label, decode, compiled in modes:
        model.use_compile = compiled
        _, warm_up = timed(lambda: rollouts(bench, model, prompts[:2], decode), bench.cuda)
        if compiled:
            print(f"  (compiling the decode step: {warm_up:.0f} s)")
            compile_seconds = warm_up
        calls[label] = timed(lambda: rollouts(bench, model, prompts, decode), bench.cuda)
    model.use_compile = bench.cuda  # grpo.py's default
    return calls, compile_seconds


def decode_step(bench, model, prompts, call_seconds, label, bandwidth):
    """-> (prefill seconds, a decode step's seconds, its bandwidth bound): a call of call_seconds at full length
    less a call that only prefills and draws the first token, over the steps between."""
    _, prefill_seconds = timed(lambda: rollouts(bench, model, prompts, new_tokens=1), bench.cuda)
    step_seconds = (call_seconds - prefill_seconds) / (bench.new_tokens - 1)
    bound, weight_bytes, kv_bytes = decode_bound(bench, model, len(prompts) * bench.samples, bandwidth)
    print(f"  decode step, {label} ({len(prompts) * bench.samples} rows): {1e3 * step_seconds:.2f} ms; bandwidth "
          f"bound {1e3 * bound:.2f} ms (weights {weight_bytes / 1e9:.2f} GB + KV cache {kv_bytes / 1e9:.2f} GB a "
          f"step) = {bound / step_seconds:.0%} of the bound; prefill of {len(prompts)} prompts + first tokens: "
          f"{prefill_seconds:.3f} s")
    return prefill_seconds, step_seconds, bound


def real_length_lengths(bench, count):
    """GSM8K's reply lengths for count replies (tests/bench_shared.py), or None with a line saying why."""
    try:
        lengths = gsm8k_reply_lengths(bench.tokenizer, bench.gsm8k_dir, bench.bytes_per_token, count,
                                      bench.new_tokens)
    except (OSError, ValueError) as e:
        print(f"  no rollouts at real lengths: GSM8K's train split is not at {bench.gsm8k_dir} ({e}); pass --gsm8k-dir")
        return None
    print(f"  at real lengths ({describe(lengths, bench.bytes_per_token)}; {int(lengths.sum())} tokens a call)")
    return lengths


def real_length_rollouts(bench, model, prompts, lengths, bandwidth, prefill_seconds, modes):
    """-> {label: (samples, call seconds, decode seconds, bound seconds)}: one call of every prompt per mode, each
    reply stopping at its GSM8K length, after one untimed (the batch halves as replies end: each smaller batch's
    step is compiled and captured there); the decode against reading the weights once a step and the running rows'
    filled cache only."""
    bound, results = decode_bound_at(bench, model, lengths, bandwidth), {}
    for label, decode, compiled in modes:
        model.use_compile = compiled
        for _ in range(2):
            with stopping_at(lengths, bench.tokenizer.assistant_end):
                samples, call_seconds = timed(lambda: rollouts(bench, model, prompts, decode), bench.cuda)
        assert torch.equal(samples["lengths"], lengths), "the replies did not stop where they were told to"
        decode_seconds = call_seconds - prefill_seconds
        results[label] = (samples, call_seconds, decode_seconds, bound)
        print(f"  rollouts at real lengths, {label}: {int(lengths.sum()) / call_seconds:9.0f} tokens/s "
              f"({call_seconds:.2f} s); its decode steps {decode_seconds:.2f} s, bound {bound:.2f} s "
              f"(the weights once a step, the running rows' filled cache) = {bound / decode_seconds:.0%}")
    model.use_compile = bench.cuda
    return results


# -----------------------------------------------------------------------------
# Episodes and tools: the forced tokens of an environment's turn and a tool's output, in every decode mode

def answering_tool(code):
    """GSM8K's calculator where a python block is arithmetic; else the block's length (a random model's blocks are
    not): every block is answered, so that a tool's output is forced in every row that closes one."""
    result = calculator(code)
    return result if result is not None else str(len(code))


def again(tokenizer, turns):
    """respond: each row is answered "again" until it has ended `turns` turns."""
    return lambda row, tokens, mask: "again" if tokens.count(tokenizer.assistant_end) < turns else None


def placed_tokens(tokenizer):
    return tokenizer.python_start, tokenizer.python_end, tokenizer.assistant_end  # marks 1, 2, 3 of placed_at


def tool_and_turn_marks(rows, new_tokens, seed=0):
    """-> marks for placed_at: in each row a python block opened in its first columns and closed 2-4 later (the tool
    answers it: 3-4 forced columns), then three ends of turn 12-16 columns apart (past again's 8 forced columns), each
    row at its own columns, so that rows end their episodes at different steps. new_tokens: at least 58."""
    gaps = torch.randint(0, 10, (rows, 5), generator=torch.Generator().manual_seed(seed))
    columns = torch.stack([1 + gaps[:, 0] % 4, 3 + gaps[:, 1] % 3, 12 + gaps[:, 2] % 5, 12 + gaps[:, 3] % 5,
                           12 + gaps[:, 4] % 5], 1).cumsum(1)  # [rows, 5]: open, close, three ends of turn
    assert int(columns.max()) < new_tokens, "too few columns for a python block and three turns"
    marks = torch.zeros(rows, new_tokens, dtype=torch.long)
    marks.scatter_(1, columns, torch.tensor([1, 2, 3, 3, 3]).expand(rows, 5))
    return marks


def decodes_compared(model, tokenizer, prompts, samples, new_tokens, decodes, reference="dynamic", autocast=None):
    """The episode and tool paths of each decode against the reference decode's, eager: every row opens and closes
    a python block (answering_tool answers it) and ends three turns (the first two answered, tool_and_turn_marks).
    -> dict: rows (all of them), forced (the reference's forced columns), and for each decode: equal (rows whose
    tokens, masks, lengths and truncation are the reference's), apart (their log-probs' largest distance from its,
    None where no row is equal); with no autocast also exact: the reference's own largest distance from a float64
    copy's dynamic decode (its rounding)."""
    marks = tool_and_turn_marks(len(prompts) * samples, new_tokens)

    def call(m, decode):
        with placed_at(marks, placed_tokens(tokenizer), tokenizer.vocab_size), autocast or nullcontext():
            return generate(m, tokenizer, prompts, samples, new_tokens, top_k=50, seed=3, tool=answering_tool,
                            decode=decode, respond=again(tokenizer, 3))
    compiled, model.use_compile = model.use_compile, False  # eager: a compiled step of this dtype would compile anew
    try:
        dynamic = call(model, reference)
        results = {decode: call(model, decode) for decode in decodes}
    finally:
        model.use_compile = compiled
    written = torch.arange(new_tokens)[None] < dynamic["lengths"][:, None]
    out = dict(rows=len(marks), forced=int((written & (dynamic["mask"] == 0)).sum()))
    keys = ("tokens", "mask", "lengths", "truncated")
    for decode, result in results.items():
        equal = torch.stack([(result[k] == dynamic[k]).reshape(len(marks), -1).all(1) for k in keys]).all(0)
        apart = (result["logprobs"] - dynamic["logprobs"])[equal].abs().max().item() if equal.any() else None
        out[decode] = dict(equal=int(equal.sum()), apart=apart)
    if autocast is None:
        exact = call(copy.deepcopy(model).double(), "dynamic")
        same = torch.stack([(exact[k] == dynamic[k]).reshape(len(marks), -1).all(1) for k in keys]).all(0)
        out["exact"] = (exact["logprobs"] - dynamic["logprobs"])[same].abs().max().item() if same.any() else None
    return out


def attempts_marks(rows, new_tokens, message, seed=0):
    """-> (marks for placed_at: three ends of turn a row, the environment's message of `message` columns forced
    after each of the first two; the row's length, its last end + 1)."""
    room = new_tokens - 2 * message - 3  # the three turns' sampled columns
    assert room >= 30, f"{new_tokens} columns do not hold three turns and two messages of {message}"
    draws = torch.rand(rows, 3, generator=torch.Generator().manual_seed(seed))
    turns = (10 + draws * (room // 3 - 10)).long()  # [rows, 3]: each turn's sampled columns, 10 or more
    ends = (turns + torch.tensor([0, message, message])).cumsum(1) + torch.arange(3)  # their ends' columns
    marks = torch.zeros(rows, new_tokens, dtype=torch.long)
    marks.scatter_(1, ends, 3)
    return marks, ends[:, -1] + 1


class NeverRight:
    """A task no reply gets right (a random model's): Attempts answers each of its first two turns."""
    def evaluate(self, conversation, reply):
        return False


def episode_rollouts(bench, model, prompts, decode, new_tokens, warm=True):
    """A batch of 3-attempt episodes (grpo.py's --attempts 3 on a task never answered right: "Your answer is wrong.
    Try again (K attempts left)." forced after the first two turns) against a single-turn batch whose replies end
    where the episodes do (the same columns a row). Each call twice, the second timed (warm), or once. -> dict:
    tokens (a call's columns), single_s, episodes_s, turns (ends of turn in the episodes), forced (their messages'
    columns)."""
    rows, tok = len(prompts) * bench.samples, bench.tokenizer
    message = len(tok.encode("Your answer is wrong. Try again (2 attempts left).")) + 3  # user start, end, assistant
    marks, lengths = attempts_marks(rows, new_tokens, message)
    respond = episode_responder(Attempts(NeverRight(), 3), tok, [{}] * len(prompts), bench.samples, max_turns=3)
    single = marks * (torch.arange(new_tokens)[None] == (lengths - 1)[:, None])  # the last end alone
    out = {}
    for label, placed, answer in (("single", single, None), ("episodes", marks, respond)):
        for _ in range(1 + warm):  # the first: each batch size's step captured (and compiled), the allocator warmed
            with placed_at(placed, placed_tokens(tok), tok.vocab_size), bench.autocast:
                samples, seconds = timed(lambda: generate(model, tok, prompts, bench.samples, new_tokens,
                                                          temperature=1.0, top_k=50, seed=0, decode=decode,
                                                          respond=answer), bench.cuda)
        assert torch.equal(samples["lengths"], lengths), f"{label}: the rows did not end where they were told to"
        out[f"{label}_s"] = seconds
        if answer is not None:
            out["turns"] = int((samples["tokens"] == tok.assistant_end).sum())
            out["forced"] = int(((samples["mask"] == 0) & (torch.arange(new_tokens)[None] < lengths[:, None])).sum())
    out["tokens"] = int(lengths.sum())
    return out


def steps(bench, model, prompts):
    """--part eager / compiled / all: the training steps of each algo, compiled and eager, in each layout."""
    for compiled in ((False, True) if bench.cuda else (False,)):  # compiling on a CPU takes minutes
        if bench.part != "all" and compiled != (bench.part == "compiled"):
            continue
        for algo in bench.algos.split(","):
            rows, tokens = fitted_sizes(bench, model, algo, compiled)
            print(f"  {algo}: the memory plan fits {rows} padded rows or {tokens} packed tokens a pass")
            layouts = [("rows", bench.device_batch_size), ("rows", rows)] * ("rows" in bench.layouts) + \
                [("tokens", bench.tokens_per_pass or tokens), ("tokens", tokens)] * ("packed" in bench.layouts)
            for layout in dict.fromkeys(layouts):
                try:
                    training_step(bench, model, prompts, algo, compiled, layout)
                except torch.OutOfMemoryError as e:  # a plan that fits more than the device holds: a finding
                    print(f"  step {algo} {layout}: out of memory: {str(e).splitlines()[0]}")


def all_rollouts(bench, model, prompts, bandwidth):
    """--part rollouts / all: every decode mode at full length, one prompt per call, the decode step against its
    bound; then at GSM8K's real lengths."""
    modes = [("graph+compile", "graph", True)] if bench.cuda else []  # compiling on a CPU takes minutes
    calls, _ = rollout_modes(bench, model, prompts, modes + [("graph", "graph", False), ("static", "static", False),
                                                             ("dynamic", "dynamic", False)])
    seconds = {label: call_seconds for label, (_, call_seconds) in calls.items()}
    new_tokens = len(prompts) * bench.samples * bench.new_tokens
    _, per_prompt_seconds = timed(lambda: [rollouts(bench, model, [p]) for p in prompts], bench.cuda)
    print("  rollouts, one call: " + "; ".join(f"{decode} {new_tokens / s:9.0f} tokens/s ({s:.2f} s)"
                                              for decode, s in seconds.items()))
    print(f"  rollouts, one prompt per call (grpo.py's default decode): {new_tokens / per_prompt_seconds:9.0f} "
          f"tokens/s ({per_prompt_seconds:.2f} s)")
    best = (modes or [("graph",)])[0][0]
    prefill_seconds = decode_step(bench, model, prompts, seconds[best], best, bandwidth)[0]
    lengths = real_length_lengths(bench, len(prompts) * bench.samples)
    if lengths is not None:
        real_length_rollouts(bench, model, prompts, lengths, bandwidth, prefill_seconds,
                             modes + [("static", "static", False), ("dynamic", "dynamic", False)])


def main(argv=None):
    sys.stdout.reconfigure(line_buffering=True)  # every row out as soon as it is printed
    bench = configure(argv)
    if bench is None:
        print("bench_gpu.py measures a CUDA GPU, and this machine has none: nothing to measure "
              "(--smoke runs the same code on a tiny shape here)")
        return
    bandwidth = copy_bandwidth(bench)
    print(f"device: {bench.name}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; dense bf16 peak "
          f"{'unknown (pass --peak-tflops)' if bench.peak_tflops is None else f'{bench.peak_tflops:.0f} TFLOP/s'}; "
          f"torch {torch.__version__}")
    print(f"{bench.prompts} prompts x {bench.samples} samples x {bench.new_tokens} new tokens, prompts of "
          f"{bench.prompt_len} tokens, generation {bench.generation}, vocab {bench.vocab_size}, bf16 autocast")
    prompts = random_prompts(bench)
    for shape in bench.shapes.split(","):
        model = random_model(bench, shape).eval()
        params = sum(p.numel() for p in model.parameters())
        print(f"{shape}: {model.config.n_layer} layers, width {model.config.n_embd}, {params / 1e6:.0f}M parameters")
        if bench.self_check:
            fast_path_check(bench, model)
        if bench.part in ("all", "eager", "compiled"):
            steps(bench, model, prompts)
        if bench.part in ("all", "rollouts"):
            all_rollouts(bench, model, prompts, bandwidth)
        del model
        free_memory(bench)


def random_prompts(bench):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (bench.prompt_len,), generator=gen).tolist() for _ in range(bench.prompts)]


if __name__ == "__main__":
    main()
