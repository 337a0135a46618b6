"""
The memory plan (grpo.memory_plan) against what torch allocates, and its one-line stop; the reference model kept
in CPU memory. The plan counts from a model on the meta device; these tests build the same model for real.
"""
import itertools
import os

import pytest
import torch

import grpo
import model as model_module
from test_generations import FIXTURES
from test_grpo import NO_AUTOCAST, args_for, sampled_batch

SMEAR_BACKOUT = os.path.join(FIXTURES, "smear-backout", "base", "chatsft_checkpoints", "d4")


def quiet(*a, **k):
    pass


@pytest.mark.parametrize("flags", [["--optimizer-version", "v1"], ["--optimizer-version", "v5"],
                                   ["--optimizer", "adamw"], ["--lora-rank", "4", "--init", SMEAR_BACKOUT],
                                   ["--optimizer-version", "v3", "--init", SMEAR_BACKOUT]],
                         ids=["muon-v1", "muon-v5", "adamw", "lora", "muon-v3-smear-backout"])
def test_the_plans_weights_gradients_and_optimizer_state_are_what_torch_allocates(flags, monkeypatch):
    if SMEAR_BACKOUT in flags and not os.path.isdir(SMEAR_BACKOUT):
        pytest.skip("nanochat fixtures not found (../shared/fixtures/nanochat or $NANOGRPO_FIXTURES)")
    args = args_for("--algo", "grpo", *flags)
    shape, _, _ = grpo.load_policy(args, quiet, shapes_only=True)
    model, _, _ = grpo.load_policy(args, quiet)
    assert next(shape.parameters()).device.type == "meta"
    if args.lora_rank:
        shape.add_lora(args.lora_rank, args.lora_alpha, args.seed)
        model.add_lora(args.lora_rank, args.lora_alpha, args.seed)
    # the real thing: one update of the real model (no reference passed: the plan's reference is tested below)
    optimizers = model_module.make_optimizers(model, args)
    gradient_bytes, step = [], grpo.optimizer_step

    def counting(model, *a):
        gradient_bytes.append(sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                  if p.grad is not None))
        return step(model, *a)

    monkeypatch.setattr(grpo, "optimizer_step", counting)
    grpo.policy_update(model, optimizers, sampled_batch(args)[1], args, NO_AUTOCAST)
    plan = grpo.memory_plan(shape, args, 1, longest_prompt=9, dtype="float32")
    assert plan["weights (float32)"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan["update: gradients (float32)"] == gradient_bytes[0]
    assert plan["optimizer state per rank"] == grpo.optimizer_state_bytes(optimizers)
    for world_size in (2, 3):  # sharded: each rank's share, weight by weight as the real state lies
        owners = model_module.shard_owners([p for p in model.parameters() if p.requires_grad], world_size)
        per_rank = [0] * world_size
        for opt in optimizers:
            for p, entry in opt.state.items():
                per_rank[owners[id(p)]] += grpo.state_bytes(entry)
        shape_owners = model_module.shard_owners([p for p in shape.parameters() if p.requires_grad], world_size)
        assert grpo.planned_optimizer_state(shape, args, shape_owners, world_size) == per_rank
        sharded = grpo.memory_plan(shape, grpo.resolve_config(["--demo", "--algo", "grpo", "--shard-optimizer",
                                                               *flags]), world_size, 9, "float32")
        assert sharded["optimizer state per rank"] == max(per_rank)
    assert max(per_rank) <= 0.45 * sum(per_rank)  # three ranks: about a third each


def test_the_plans_reference_and_kv_cache_bytes():
    args = args_for("--algo", "grpo", "--ref-dtype", "bfloat16", "--dtype", "bfloat16")
    shape, _, _ = grpo.load_policy(args, quiet, shapes_only=True)
    plan = grpo.memory_plan(shape, args, 1, longest_prompt=9, dtype="bfloat16")
    linear = sum(m.weight.numel() for m in shape.modules() if isinstance(m, torch.nn.Linear))
    total = sum(p.numel() for p in shape.parameters())
    assert plan["reference model"] == 2 * linear + 4 * (total - linear)
    offloaded = grpo.memory_plan(shape, args_for("--algo", "grpo", "--ref-offload"), 1, 9, "bfloat16")
    assert offloaded["reference model"] == 0
    c, G = shape.config, args.num_samples
    rows = grpo.sample_batch_rows(args_for("--algo", "grpo", "--sample-batch-size", str(2 * G + 1)), 1)
    assert rows == 2 * G  # whole groups
    chunk = grpo.memory_plan(shape, args_for("--algo", "grpo", "--sample-batch-size", str(2 * G)), 1, 9, "bfloat16")
    # keys and values of a row's prompt and reply columns, and of the cache's spare one (model.KVCache)
    per_row = 2 * c.n_layer * c.n_kv_head * (c.n_embd // c.n_head) * (9 + args.max_new_tokens + 1) * 2
    assert chunk[f"sampling: KV cache and logits of {rows} replies"] == rows * (per_row + c.vocab_size * 4) + 2 * per_row


def test_on_a_gpu_the_update_takes_as_many_rows_a_pass_as_the_plan_fits():
    # a d12 of the newest generation on the meta device; the GPU's free memory as given
    chosen = []
    for free_gib in (2.5, 4, 6, 1000):
        args = args_for("--algo", "grpo", "--init", "scratch", "--depth", "12", "--n-embd", "768", "--n-head", "6",
                        "--prompts-per-step", "16", "--num-samples", "16", "--max-new-tokens", "256", "--no-pack")
        args.device_batch_size = args.sample_batch_size = None  # not given, as on a GPU
        shape, _, _ = grpo.load_policy(args, quiet, shapes_only=True)
        free = free_gib * 2 ** 30
        plan, _ = grpo.fitted_plan(shape, args, 1, 100, "bfloat16", free, gpu=True)
        rows = args.device_batch_size

        def update_peak(n):  # what stays and the update's phase, at n rows a pass
            at = grpo.memory_plan(shape, grpo.SimpleNamespace(**dict(vars(args), device_batch_size=n)), 1, 100,
                                  "bfloat16", plan["optimizer state per rank"])
            return grpo.phase_bytes(at) + grpo.phase_bytes(at, "update")

        assert grpo.phase_bytes(plan, "update") == update_peak(rows) - grpo.phase_bytes(plan)
        assert rows == 256 or update_peak(rows + 1) > 0.9 * free  # as many as fit, or the rank's whole step
        assert rows == 1 or update_peak(rows) <= 0.9 * free
        chosen.append(rows)
    assert chosen[0] < chosen[1] < chosen[2] < chosen[3] == 256, chosen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_on_a_gpu_a_packed_pass_takes_as_many_tokens_as_the_plan_fits(compiled):
    chosen = []
    for free_gib in (2.5, 4, 6, 1000):
        args = args_for("--algo", "grpo", "--init", "scratch", "--depth", "12", "--n-embd", "768", "--n-head", "6",
                        "--prompts-per-step", "16", "--num-samples", "16", "--max-new-tokens", "256")
        args.device_batch_size = args.sample_batch_size = args.tokens_per_pass = None  # not given, as on a GPU
        args.compile = compiled  # a compiled pass keeps fewer bytes a token (pass_activations): more tokens fit
        shape, _, _ = grpo.load_policy(args, quiet, shapes_only=True)
        free = free_gib * 2 ** 30
        plan, _ = grpo.fitted_plan(shape, args, 1, 100, "bfloat16", free, gpu=True)
        tokens = args.tokens_per_pass

        def update_peak(n):  # what stays and the update's phase, at n tokens a pass
            at = grpo.memory_plan(shape, grpo.SimpleNamespace(**dict(vars(args), tokens_per_pass=n)), 1, 100,
                                  "bfloat16", plan["optimizer state per rank"])
            return grpo.phase_bytes(at) + grpo.phase_bytes(at, "update")

        longest_row, step_tokens = 100 + 256 - 1, 256 * (100 + 256 - 1)
        assert grpo.phase_bytes(plan, "update") == update_peak(tokens) - grpo.phase_bytes(plan)
        assert tokens % 128 == 0 or tokens == longest_row
        assert tokens >= step_tokens - 128 or update_peak(tokens + 128) > 0.9 * free  # as many as fit, or the step
        assert tokens == longest_row or update_peak(tokens) <= 0.9 * free
        chosen.append(tokens)
    assert chosen[0] < chosen[1] < chosen[2] < chosen[3], chosen
    if compiled:  # at 4 and 6 GiB (2.5 fits the longest row, 1000 the whole step either way): more than eager
        eager = args_for("--algo", "grpo", "--init", "scratch", "--depth", "12", "--n-embd", "768", "--n-head", "6",
                         "--prompts-per-step", "16", "--num-samples", "16", "--max-new-tokens", "256")
        eager.device_batch_size = eager.sample_batch_size = eager.tokens_per_pass = None
        eager.compile = False
        grpo.fitted_plan(shape, eager, 1, 100, "bfloat16", 6 * 2 ** 30, gpu=True)
        assert chosen[2] > eager.tokens_per_pass, (chosen, eager.tokens_per_pass)


def test_a_plan_that_cannot_fit_stops_before_the_checkpoint_is_read(tmp_path, monkeypatch):
    if not os.path.isdir(SMEAR_BACKOUT):
        pytest.skip("nanochat fixtures not found (../shared/fixtures/nanochat or $NANOGRPO_FIXTURES)")
    monkeypatch.setattr(grpo, "free_memory", lambda device: 100_000)  # 100 kB
    reads, load = [], grpo.load_checkpoint
    monkeypatch.setattr(grpo, "load_checkpoint", lambda *a, **k: reads.append(k["shapes_only"]) or load(*a, **k))
    with pytest.raises(SystemExit) as stop:
        grpo.main(["--demo", "--init", SMEAR_BACKOUT, "--runs-dir", str(tmp_path), "--run-name", "tiny",
                   "--num-steps", "1"])
    message = str(stop.value.code)
    assert message.startswith("error: the memory plan needs ") and "\n" not in message
    assert "more GPUs" in message and "--lora-rank 16" in message and "--ref-offload" in message
    assert reads == [True]  # the weights were never read
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()


def test_an_offloaded_reference_needs_a_reference_copy():
    with pytest.raises(SystemExit):
        args_for("--algo", "reinforce", "--ref-offload")  # no KL: no reference
    with pytest.raises(SystemExit):
        args_for("--algo", "grpo", "--lora-rank", "4", "--init", "x", "--ref-offload")  # the reference is the model
    assert args_for("--algo", "grpo", "--ref-offload").ref_offload


@pytest.mark.cuda
def test_an_offloaded_reference_gives_the_same_log_probs_and_returns_to_the_cpu():
    model, batch = sampled_batch(args_for())
    device = torch.device("cuda")
    batch = grpo.to_device(batch, device)
    reference = model.to(device)
    expected = reference.token_logprobs(batch["input_ids"], batch["target_ids"])
    for p in reference.parameters():
        p.data = p.data.cpu().pin_memory()
    before = [p.data for p in reference.parameters()]
    with grpo.on_device(reference, device):
        assert all(p.is_cuda for p in reference.parameters())
        assert torch.equal(reference.token_logprobs(batch["input_ids"], batch["target_ids"]), expected)
    # (p.data is a new view at each read: the same storage is what says the CPU copies came back)
    assert all(p.data.data_ptr() == cpu.data_ptr() and p.data.is_pinned() for p, cpu in zip(reference.parameters(), before))


def test_packed_passes_of_rows_are_planned_by_rows_and_never_asked_for_a_token_budget():
    # --pack --device-batch-size D: passes of D whole rows; --tokens-per-pass does not form them, so it is neither
    # checked against the longest row nor what the plan counts, and the out-of-memory line names the rows
    from tasks import build
    args = grpo.resolve_config(["--demo", "--device-batch-size", "4", "--max-new-tokens", "5000", "--show-config"])
    lines = []
    longest_prompt = grpo.plan_memory(args, 1, torch.device("cpu"), "float32", build("sort", "train", args),
                                      lines.append)
    assert "update: activations of 4 packed rows" in lines[0] and "--device-batch-size 4" in lines[0]
    assert "--tokens-per-pass" not in lines[0]
    model, _, _ = grpo.load_policy(args, None, shapes_only=True)
    plan = grpo.memory_plan(model, args, 1, longest_prompt, "float32")
    rows = next(v for k, v in plan.items() if k.startswith("update: activations"))
    assert rows == grpo.pass_activations(model.config, 4 * (longest_prompt + 5000 - 1), args)
    def update_oom():
        grpo.policy_update(None, None, None, None, None)
    try:
        update_oom()
    except Exception as e:  # (the traceback's innermost step function names the phase)
        problem, remedy = grpo.out_of_memory(args, 1, e.__traceback__)
    assert "--device-batch-size 4 packed rows" in problem and "--tokens-per-pass" not in problem + remedy


@pytest.mark.parametrize("mode", [["--tokens-per-pass", "512"], ["--device-batch-size", "8"]], ids=["tokens", "rows"])
def test_the_plan_bounds_the_exact_attentions_padded_block(tmp_path, monkeypatch, mode):
    # Off flash attention (the CPU, float32) a packed pass's rows are gathered into [rows, longest row] blocks:
    # the plan counts them, at least what the update gathers
    import model as model_module
    plans, blocks = [], []
    fitted, attention = grpo.fitted_plan, model_module.packed_attention
    monkeypatch.setattr(grpo, "fitted_plan", lambda *a, **k: plans.append(fitted(*a, **k)) or plans[-1])

    def recorded(q, k, v, pack, *a):
        blocks.append(pack["rows"].numel() * q.size(-1) * (2 * q.size(1) + 2 * k.size(1)) * q.element_size())
        return attention(q, k, v, pack, *a)
    monkeypatch.setattr(model_module, "packed_attention", recorded)
    grpo.main(["--demo", "--num-steps", "1", "--eval-every", "0", "--runs-dir", str(tmp_path), "--no-plot", "--pack",
               "--prompts-per-step", "8", "--num-samples", "4", *mode])
    (plan, _), = plans
    layers = 2  # the demo's
    assert blocks and layers * max(blocks) <= plan["update: exact attention's padded rows (bound)"]


@pytest.mark.parametrize("distill", [False, True], ids=["grpo", "distill-forward"])
def test_the_plans_head_chunk_holds_what_torch_allocates_for_it(distill, monkeypatch):
    # One chunk of token_logprobs' head, forward and backward, as an update's pass takes it (the forward KL's
    # teacher top-k gathered too): torch's allocated peak above its start, against pass_activations' head term. The
    # logits dominate (CHECKPOINT_LOGITS of them, the least the head recomputes in the backward, as a GPU run's
    # chunks), so the peak per logit is the head's own.
    V, k = 16384, 16
    n = model_module.CHECKPOINT_LOGITS // V
    monkeypatch.setattr(grpo, "HEAD_CHUNK", n * V)
    monkeypatch.setattr(model_module, "HEAD_CHUNK", n * V)
    model = grpo.GPT(grpo.GPTConfig(sequence_len=n, vocab_size=V, n_layer=1, n_head=1, n_kv_head=1,
                                    n_embd=64)).init_weights(0)
    idx, targets = torch.randint(V, (1, n)), torch.randint(V, (1, n))
    top = dict(top_ids=torch.randint(V, (1, n, k))) if distill else {}
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with profiler:
        out = model.token_logprobs(idx, targets, with_entropy=True, entropy_grad=False, **top)
        sum(t.sum() for t in out if t is not None and t.requires_grad).backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    peak = max(itertools.accumulate(n for _, n in events))
    flags = ["--algo", "distill", "--teacher", "unused"] if distill else ["--algo", "grpo"]
    planned = grpo.pass_activations(model.config, n, args_for(*flags)) - n * model.config.n_layer * 76 * 64
    assert 0.95 * planned <= peak <= 1.05 * planned, (peak / (n * V), planned / (n * V))
