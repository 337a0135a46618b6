import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import grpo
import tasks
import model as model_module
from model import GPT, GPTConfig, Tokenizer, generate, load_checkpoint
from tasks.gsm8k import calculator
from tasks.sort import Sort
from conftest import GSM8K_DIR, SAME_STEP_SHARE, assert_same_steps, assert_same_sum, free_port
from rank_runs import copy_without_step, rehearsal
from test_generations import FIXTURES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = Tokenizer.byte_level()
NO_AUTOCAST = grpo.nullcontext()


def args_for(*flags):
    # the demo's flags without its entropy bonus: these tests compare the bare objective with hand-written losses
    return grpo.resolve_config(["--demo", "--entropy-coef", "0", *flags])


class GradRecorder:
    """An 'optimizer' that records the gradients it is asked to apply, and leaves the weights alone. grads[i]: the
    gradients of every parameter at the i-th optimizer step (optimizer_step hands them over one weight per call)."""

    def __init__(self, model):
        self.model, self.received = model, []
        self.param_groups = [dict(params=list(model.parameters()))]

    def step(self):
        self.received += [p.grad.clone() for p in self.model.parameters() if p.grad is not None]

    @property
    def grads(self):
        n = len(self.param_groups[0]["params"])
        return [self.received[i:i + n] for i in range(0, len(self.received), n)]


def batch_inputs(args, seed=0):
    """-> (prompts, samples, rewards) of 4 sort questions, from a small random model (seeded)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(sequence_len=64, vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    task = Sort("train")
    conversations = [task[i] for i in range(4)]
    prompts = [TOK.render_for_completion(c) for c in conversations]
    samples = generate(model, TOK, prompts, args.num_samples, 6, temperature=1.0, seed=seed)
    rewards = torch.tensor([[0.0, 1.0, 0.5, 0.5, 1.0, 0.0, 0.2, 0.9]] * 4)[:, :args.num_samples]
    rewards[3] = 0.7  # an all-equal group
    return model, prompts, samples, rewards


def sampled_batch(args, seed=0):
    model, *inputs = batch_inputs(args, seed)
    return model, grpo.make_batch(*inputs, args)


def replan(batch, args):
    """The micro-batches planned again, after a test changed the batch's masks."""
    batch["micro_batches"], batch["minibatch_totals"], batch["row_minibatch"] = grpo.plan_micro_batches(batch, args)


def gradients(model, batch, args):
    recorder = GradRecorder(model)
    stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST)
    return recorder.grads, stats


# ---------------------------------------------------------------------------- the ladder of equivalences

def test_grpo_path_with_one_epoch_no_kl_mean_advantage_is_reinforce():
    # passes of 3 replies: a group of 8 is taken as 3 + 3 + 2, each pass divided by its own tokens (nanochat's loss)
    reinforce = args_for("--algo", "reinforce", "--pass-size", "3")
    grpo_like = args_for("--algo", "grpo", "--ppo-epochs", "1", "--kl-coef", "0", "--advantage", "mean",
                         "--aggregation", "nanochat", "--pass-size", "3")
    model, batch = sampled_batch(reinforce)
    (g_reinforce,), _ = gradients(model, batch, reinforce)
    (g_grpo,), stats = gradients(model, batch, grpo_like)
    # and both equal nanochat's RL loss written out by hand: per pass of replies of one question,
    # -sum(A * log pi) / (the pass's reply tokens x the question's passes x the step's questions)
    logprobs = model.token_logprobs(batch["input_ids"], batch["target_ids"])
    mask, advantages, G = batch["loss_mask"], batch["advantages"][:, None], reinforce.num_samples
    questions, by_hand = mask.size(0) // G, 0.0
    for q in range(questions):
        passes = [range(q * G + start, q * G + min(start + 3, G)) for start in range(0, G, 3)]
        for rows in passes:
            rows = list(rows)
            by_hand = by_hand - (advantages[rows] * logprobs[rows] * mask[rows]).sum() / (
                mask[rows].sum().clamp(min=1) * len(passes) * questions)
    g_hand = torch.autograd.grad(by_hand, list(model.parameters()))
    assert mask.sum() > 0 and batch["advantages"].abs().sum() > 0
    assert len({mask[rows].sum().item() / len(rows) for rows in ([0, 1, 2], [3, 4, 5], [6, 7])}) > 1
    for a, b, c in zip(g_reinforce, g_grpo, g_hand):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
    assert stats["ratio_min"] == stats["ratio_max"] == 1.0 and stats["clip_frac"] is None  # one update: no reuse
    # the passes are the objective's, not the micro-batches': another --device-batch-size, the same gradient
    (g_micro,), _ = gradients(model, batch, args_for("--algo", "reinforce", "--pass-size", "3",
                                                      "--device-batch-size", "5"))
    for a, b in zip(g_reinforce, g_micro):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # the token mean over the whole batch (DAPO's) is another objective: other gradients
    (g_token,), _ = gradients(model, batch, args_for("--algo", "reinforce", "--aggregation", "token"))
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(g_reinforce, g_token))


def test_ratio_is_exactly_one_on_the_first_update_of_every_schedule():
    for flags in (["--algo", "grpo"], ["--algo", "grpo", "--num-minibatches", "3", "--device-batch-size", "5"],
                  ["--algo", "dapo", "--ppo-epochs", "4"]):
        args = args_for(*flags)
        model, batch = sampled_batch(args)
        grads, stats = gradients(model, batch, args)  # the recorder never moves the weights
        assert len(grads) == args.ppo_epochs * args.num_minibatches
        assert stats["ratio_min"] == stats["ratio_max"] == 1.0 and stats["clip_frac"] == 0.0
    # with a real optimizer the later passes see real ratios
    args = args_for("--algo", "grpo", "--ppo-epochs", "3", "--lr", "0.05")
    model, batch = sampled_batch(args)
    stats, _ = grpo.policy_update(model, model_module.make_optimizers(model, args), batch, args, NO_AUTOCAST)
    assert stats["ratio_max"] > 1.0 and stats["ratio_min"] < 1.0 and stats["clip_frac"] > 0


def test_clip_frac_counts_the_passes_that_reuse_the_batch(monkeypatch):
    # With two epochs the first pass has rho = 1 exactly; clip_frac is the second pass's share, not half of it.
    original, clipped_per_pass = grpo.clipped_policy_loss, []

    def recording(log_ratio, *a):
        loss, clipped = original(log_ratio, *a)
        clipped_per_pass.append((clipped.detach(), log_ratio.detach()))
        return loss, clipped

    monkeypatch.setattr(grpo, "clipped_policy_loss", recording)
    args = args_for("--algo", "grpo", "--kl-coef", "0", "--lr", "0.05", "--clip-eps", "0.01")
    model, batch = sampled_batch(args)
    stats, _ = grpo.policy_update(model, model_module.make_optimizers(model, args), batch, args, NO_AUTOCAST)
    mask = batch["micro_batches"][0]["loss_mask"]  # the one micro-batch: rows longest first, cut to the longest
    assert len(batch["micro_batches"]) == 1 and len(clipped_per_pass) == 2 and not clipped_per_pass[0][0].any()
    clipped, log_ratio = clipped_per_pass[1]
    low, high = [((clipped * side * mask).sum() / mask.sum()).item() for side in (log_ratio < 0, log_ratio > 0)]
    assert low > 0 and high > 0  # both sides clip here: the split is tested, not just one side
    assert stats["clip_frac_low"] == pytest.approx(low) and stats["clip_frac_high"] == pytest.approx(high)
    assert stats["clip_frac"] == pytest.approx(((clipped * mask).sum() / mask.sum()).item())


def test_old_logprobs_forward_only_for_minibatches_reached_after_an_optimizer_step(monkeypatch):
    # A pass before the batch's first optimizer step is pi_old itself: its log-probs are kept, not recomputed.
    calls = []
    original = GPT.token_logprobs

    def counting(self, *a, **k):
        calls.append(torch.is_grad_enabled())
        return original(self, *a, **k)

    monkeypatch.setattr(GPT, "token_logprobs", counting)
    for flags, no_grad_calls in ((["--algo", "reinforce"], 0), (["--algo", "grpo", "--kl-coef", "0", "--ppo-epochs", "1"], 0),
                                 (["--algo", "grpo", "--kl-coef", "0"], 0), (["--num-minibatches", "2"], 1),
                                 (["--num-minibatches", "4"], 3)):  # one per micro-batch after the first step
        args = args_for(*flags, "--device-batch-size", "64")
        model, batch = sampled_batch(args)
        calls.clear()
        gradients(model, batch, args)
        assert calls.count(False) == no_grad_calls, flags


def test_pi_old_is_the_policy_before_the_update_in_every_pass(monkeypatch):
    # Minibatch 1's pi_old comes from its own first pass, minibatch 2's from a forward before the update: both must
    # equal the policy's log-probs before any step, in every epoch, bit for bit.
    args = args_for("--algo", "grpo", "--kl-coef", "0", "--num-minibatches", "2", "--tokens-per-pass", "48")
    model, batch = sampled_batch(args)
    before = grpo.frozen_logprobs(model, batch["micro_batches"], args, NO_AUTOCAST)
    received, objective = [], grpo.objective
    monkeypatch.setattr(grpo, "objective", lambda logprobs, entropy, frozen, *a: received.append(
        frozen["old"].clone()) or objective(logprobs, entropy, frozen, *a))
    stats, _ = grpo.policy_update(model, model_module.make_optimizers(model, args), batch, args, NO_AUTOCAST)
    order = sorted(range(len(before)), key=lambda i: batch["micro_batches"][i]["minibatch"])  # minibatch by minibatch
    expected = [before[i] for _ in range(args.ppo_epochs) for i in order]
    assert len(received) == len(expected) > 4
    for old, want in zip(received, expected):
        torch.testing.assert_close(old, want, rtol=0, atol=0)
    assert stats["clip_frac"] > 0  # the weights did move between the passes


@pytest.mark.parametrize("flags", [["--algo", "grpo"], ["--algo", "reinforce"], ["--algo", "grpo",
                                   "--num-minibatches", "2", "--kl-placement", "reward"]])
def test_the_update_waits_for_the_device_a_fixed_few_times_per_optimizer_step_never_per_micro_batch(flags):
    # ops that make the host wait for a GPU (a scalar read, a data-dependent shape, a boolean mask), counted on the
    # CPU: the same count with 4 times as many micro-batches
    from bench_update import CountOps
    counts = []
    for size in (["--no-pack", "--device-batch-size", "4"], ["--no-pack", "--device-batch-size", "16"],
                 ["--tokens-per-pass", "30"], ["--tokens-per-pass", "120"]):
        args = args_for(*flags, *size)
        model, batch = sampled_batch(args)
        counter = CountOps()
        with counter:
            stats, _ = grpo.policy_update(model, [GradRecorder(model)], batch, args, NO_AUTOCAST,
                                          GPT(model.config) if args.kl_coef else None)
        counts.append((len(batch["micro_batches"]), len(counter.syncs)))
    (many, syncs_many), (few, syncs_few), (many_packed, syncs_many_packed), (few_packed, syncs_few_packed) = counts
    assert many == 4 * few and syncs_many == syncs_few
    assert many_packed >= 3 * few_packed and syncs_many_packed == syncs_few_packed == syncs_few
    steps = args.ppo_epochs * args.num_minibatches
    assert syncs_few <= 2 * steps + 20, counter.syncs  # a finiteness check per step, the statistics at the end


def test_an_empty_minibatch_takes_no_optimizer_step():
    # Momentum from an earlier step would move the weights on a zero gradient: an all-masked minibatch must not step.
    args = args_for("--algo", "grpo", "--drop-equal-groups", "--num-minibatches", "2", "--lr", "0.05")
    model, batch = sampled_batch(args)
    optimizers = model_module.make_optimizers(model, args)
    grpo.policy_update(model, optimizers, batch, args, NO_AUTOCAST)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch["loss_mask"].zero_()  # every group dropped
    replan(batch, args)
    stats, _ = grpo.policy_update(model, optimizers, batch, args, NO_AUTOCAST)
    assert stats["empty_updates"] == args.ppo_epochs * args.num_minibatches and stats["skipped_updates"] == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_infinite_terms_at_masked_positions_change_nothing(monkeypatch):
    # k3 at a masked position where the reference is far more likely (low temperature, a prompt token) is inf:
    # it must not turn the loss into NaN, nor change the gradient.
    args = args_for("--algo", "grpo", "--ppo-epochs", "1")
    model, batch = sampled_batch(args)
    masked = batch["loss_mask"] == 0
    assert masked.any()
    ref_model = GPT(model.config)
    grads = []
    for poison in (False, True):
        def ref_logprobs(net, micro_batches, args, autocast, poison=poison):
            refs = [grpo.logprobs_of(model, mb, args).detach() - 0.1 for mb in micro_batches]
            return [ref.masked_fill(mb["loss_mask"] == 0, 1e4) if poison else ref
                    for ref, mb in zip(refs, micro_batches)]

        monkeypatch.setattr(grpo, "frozen_logprobs", ref_logprobs)
        recorder = GradRecorder(model)
        stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST, ref_model)
        assert math.isfinite(stats["loss"]) and math.isfinite(stats["kl"]) and stats["skipped_updates"] == 0
        grads.append(recorder.grads[0])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_tasks_tool_reaches_the_sampler_in_training_and_eval(monkeypatch):
    # The sampler is task-agnostic: GSM8K's calculator works only if grpo.py hands each task's tool over.
    class SortWithCalculator(Sort):
        tool = staticmethod(calculator)

    tools, real_generate = [], tasks.generate

    def recording(*a, **k):
        tools.append(k.get("tool"))
        return real_generate(*a, **k)

    monkeypatch.setattr(tasks, "generate", recording)  # a task's replies are played there (tasks.play)
    args = args_for("--pass-k", "2")
    model, _ = sampled_batch(args)
    grpo.sample_groups(model, TOK, SortWithCalculator("train"), [0, 1], [5, 6], args, NO_AUTOCAST)
    result, _ = grpo.evaluate(model, TOK, SortWithCalculator("test"), 3, args, 0, 1, NO_AUTOCAST)
    assert tools == [calculator] * 3 and result["eval_examples"] == 3 and "eval_exact" in result
    tools.clear()
    grpo.sample_groups(model, TOK, Sort("train"), [0, 1], [5, 6], args, NO_AUTOCAST)
    assert tools == [None]


def fake_groups(model, tokenizer, task, indices, seeds, args, autocast):
    """sample_groups without a model: question i's group has differing rewards iff i % 3 == 0; its tokens are i."""
    rewards = torch.tensor([[float(i % 3 == 0), 0.0] for i in indices])
    tokens = torch.tensor(indices).repeat_interleave(2)[:, None]
    samples = {"tokens": tokens, "lengths": torch.ones(len(tokens)), "mask": torch.ones_like(tokens)}
    return dict(prompts=[[i] for i in indices], samples=samples,
                rewards=rewards, task_rewards=rewards, terms=rewards[..., None], penalty=torch.zeros_like(rewards),
                reward_parts=torch.stack([rewards, torch.zeros_like(rewards)], -1))


def test_dynamic_sampling_fills_the_step_with_differing_groups(monkeypatch):
    monkeypatch.setattr(grpo, "sample_groups", fake_groups)
    args = args_for("--algo", "dapo", "--num-samples", "2", "--max-sampling-rounds", "8")
    task = list(range(1000))
    first = fake_groups(None, None, task, [0, 1, 2, 4], None, args, None)  # one group of four differs
    groups, rounds = grpo.dynamic_sampling(first, None, None, task, 5, 0, args, None)
    ids = [p[0] for p in groups["prompts"]]
    assert len(ids) == 4 and ids[0] == 0 and all(i % 3 == 0 for i in ids) and 1 < rounds < 8
    assert groups["samples"]["tokens"].flatten().tolist() == [i for i in ids for _ in range(2)]  # rows follow groups
    assert (groups["rewards"][:, 0] != groups["rewards"][:, 1]).all()
    # the policy's own rewards, for the log: every group of every round, the left-out ones too
    assert groups["drawn"]["task_rewards"].shape == (4 * rounds, 2) and groups["drawn"]["rewards"][:4].equal(
        first["rewards"])
    again, _ = grpo.dynamic_sampling(first, None, None, task, 5, 0, args, None)
    other_rank, _ = grpo.dynamic_sampling(first, None, None, task, 5, 1, args, None)
    assert again["prompts"] == groups["prompts"] and other_rank["prompts"] != groups["prompts"]
    # never enough: the rounds stop at the bound and equal groups fill the step up, differing ones first
    args.max_sampling_rounds = 3
    groups, rounds = grpo.dynamic_sampling(first, None, None, [1, 2, 4, 5, 7], 5, 0, args, None)
    assert rounds == 3 and [p[0] for p in groups["prompts"]][0] == 0 and len(groups["prompts"]) == 4


def test_dynamic_sampling_run_resumes_exactly(tmp_path, monkeypatch, run_killed_after_first_save):
    monkeypatch.setattr(Sort, "reward", lambda self, conversation, reply: float(sum(reply.encode()) % 5 == 0))
    flags = ["--algo", "dapo", "--num-steps", "2", "--save-every", "1"]
    sampled, sample_groups = [], grpo.sample_groups  # every reply's tokens, of every round

    def recorded(*a, **k):
        groups = sample_groups(*a, **k)
        sampled.append(groups["samples"]["lengths"].sum().item())
        return groups
    with monkeypatch.context() as patched:
        patched.setattr(grpo, "sample_groups", recorded)
        grpo.main(run_flags(tmp_path, "straight", *flags))
    run_killed_after_first_save(run_flags(tmp_path, "resumed", *flags))
    grpo.main(run_flags(tmp_path, "resumed", *flags, "--resume"))
    for (k, a), b in zip(final_state(tmp_path, "straight", 2).items(), final_state(tmp_path, "resumed", 2).values()):
        assert torch.equal(a, b), k
    metrics = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl")]
    assert all(m["sampling_rounds"] > 1 and m["questions_drawn"] == 8 * m["sampling_rounds"] for m in metrics)
    # logged: the policy's own reward and equal groups over every group drawn, and those of the groups kept
    assert all(m["equal_group_frac_kept"] < m["equal_group_frac"] for m in metrics)
    assert metrics[-1]["equal_group_frac_kept"] < 0.5 and metrics[0]["reward_kept"] != metrics[0]["reward"]
    # tokens_per_s: every token sampled, over the time of every round (not only the kept replies' tokens)
    steps = [m for m in metrics if "tokens_per_s" in m]
    assert sum(m["tokens_per_s"] * m["time_sample"] for m in steps) == pytest.approx(sum(sampled), rel=1e-9)
    assert sum(m["tokens_sampled"] for m in steps) == sum(sampled)
    assert all(m["reply_len"] * 8 * 4 < m["tokens_sampled"] for m in steps)  # reply_len: the kept replies'


# ---------------------------------------------------------------------------- the terms, by hand

def test_clipping_zeroes_exactly_the_gradients_it_should():
    old = torch.zeros(1, 6)
    #                        rho:  1.5   0.5   1.5   0.5   1.1   0.9
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.1, 0.9]])).requires_grad_()
    advantages = torch.tensor([[2.0, -2.0, -2.0, 2.0, 2.0, -2.0]]).T.reshape(1, 6)
    loss, clipped = grpo.clipped_policy_loss(logprobs - old, advantages, 0.2, 0.3)
    loss.sum().backward()
    ratio = logprobs.detach().exp()
    # clipped: rho > 1.3 with A > 0, rho < 0.8 with A < 0
    assert clipped.tolist() == [[True, True, False, False, False, False]]
    assert logprobs.grad[0, :2].tolist() == [0.0, 0.0]
    # elsewhere the unclipped gradient: d(-rho * A)/d(log pi) = -rho * A
    torch.testing.assert_close(logprobs.grad[0, 2:], (-ratio * advantages)[0, 2:])
    torch.testing.assert_close(loss[0, :2], torch.tensor([-1.3 * 2.0, -0.8 * -2.0]))


def test_sequence_ratio_gradient_equals_a_direct_gspo_loss():
    torch.manual_seed(0)
    logprobs = (-torch.rand(3, 5) * 3).requires_grad_()
    old = logprobs.detach() + torch.randn(3, 5) * 0.01
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1]], dtype=torch.float)
    advantages = torch.tensor([[1.5], [-0.7], [0.4]])
    eps_low, eps_high = 3e-4, 4e-4
    log_ratio = grpo.sequence_log_ratio(logprobs - old, mask)
    policy, clipped = grpo.clipped_policy_loss(log_ratio, advantages, eps_low, eps_high)
    ours = grpo.aggregate(policy.expand_as(mask), mask, "sequence", denominator=3)
    # GSPO written out: s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|), loss = -mean_i min(s_i A_i, clip(s_i) A_i)
    direct = 0
    for i in range(3):
        keep = mask[i].bool()
        s = torch.exp((logprobs[i][keep] - old[i][keep]).sum() / keep.sum())
        direct = direct - torch.minimum(s * advantages[i, 0], s.clamp(1 - eps_low, 1 + eps_high) * advantages[i, 0]) / 3
    torch.testing.assert_close(ours, direct)
    g_ours, = torch.autograd.grad(ours, logprobs)
    g_direct, = torch.autograd.grad(direct, logprobs)
    torch.testing.assert_close(g_ours, g_direct)
    assert clipped.any() and not clipped.all()  # the test covers both branches
    assert (g_ours[mask == 0] == 0).all() and (g_ours[~clipped.squeeze(1)][mask[~clipped.squeeze(1)] > 0] != 0).all()


def test_sequence_ratio_equals_token_ratio_when_replies_have_one_token():
    # a real optimizer and two epochs, so that the second pass sees ratios != 1 and clipping
    flags = ["--algo", "grpo", "--kl-coef", "0", "--lr", "0.05", "--clip-eps", "0.01"]
    results = []
    for level in ("token", "sequence"):
        args = args_for(*flags, "--ratio-level", level)
        model, batch = sampled_batch(args)
        first = batch["loss_mask"].argmax(dim=1)
        batch["loss_mask"].zero_()[torch.arange(len(first)), first] = 1.0  # one policy token per reply
        replan(batch, args)
        stats, _ = grpo.policy_update(model, model_module.make_optimizers(model, args), batch, args, NO_AUTOCAST)
        results.append((stats, model.state_dict()))
    (token_stats, token_state), (sequence_stats, sequence_state) = results
    assert token_stats["clip_frac"] > 0 and token_stats["clip_frac"] == sequence_stats["clip_frac"]
    for k, v in token_state.items():
        torch.testing.assert_close(v, sequence_state[k], rtol=0, atol=1e-6)


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    # max 20 tokens, buffer 4: free up to 16, then -1/4 per token, -1 at 20 and beyond
    assert grpo.overlong_penalty(lengths, 20, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -2.0, -0.1])
    d = logprobs - ref  # log pi - log pi_ref
    torch.testing.assert_close(grpo.kl_penalty(logprobs, ref, "k1"), d)
    torch.testing.assert_close(grpo.kl_penalty(logprobs, ref, "k2"), 0.5 * d ** 2)
    torch.testing.assert_close(grpo.kl_penalty(logprobs, ref, "k3"), torch.exp(-d) + d - 1)
    assert grpo.kl_penalty(logprobs, ref, "k3")[1] == 0
    wide = torch.linspace(-10, 10, 101)
    assert (grpo.kl_penalty(wide, torch.zeros(101), "k3") >= 0).all()
    assert (grpo.kl_penalty(wide, wide, "k3") == 0).all()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_gradient_pulls_the_policy_towards_the_reference(estimator):
    ref = torch.tensor([-1.0, -1.0, -3.0])
    logprobs = torch.tensor([-2.0, -0.5, -3.0], requires_grad=True)
    grpo.kl_penalty(logprobs, ref, estimator).sum().backward()
    stepped = logprobs.detach() - 0.1 * logprobs.grad  # a descent step
    assert ((stepped - ref).abs() <= (logprobs.detach() - ref).abs()).all()
    assert ((stepped - ref).abs() < (logprobs.detach() - ref).abs())[:2].all()


@pytest.mark.parametrize("estimator,placement,kl", [("k1", "loss", "reverse"), ("k2", "loss", "reverse"),
                                                    ("k3", "loss", "forward"), ("k1", "reward", "reverse")])
def test_the_kl_terms_expected_gradient_is_that_of_the_kl_the_docs_name(estimator, placement, kl):
    # One position, six tokens: the expectation over o ~ pi_theta of the gradient a sampled o gives (the tokens
    # held fixed, as in training), summed exactly, against the gradient of KL(pi || pi_ref) (reverse) or
    # KL(pi_ref || pi) (forward). In the reward the penalty is the reply's advantage (no baseline), at rho = 1.
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(6, dtype=torch.float64, generator=gen).requires_grad_()
    ref = torch.log_softmax(torch.randn(6, dtype=torch.float64, generator=gen), 0)
    expected = torch.zeros(6, dtype=torch.float64)
    for o in range(6):
        logprob = torch.log_softmax(z, 0)[o].view(1, 1)  # [B, T] = [1, 1]
        if placement == "loss":
            term = grpo.kl_penalty(logprob, ref[o].view(1, 1), estimator)
        else:
            penalty = grpo.kl_reward_penalty(logprob, ref[o].view(1, 1), torch.ones(1, 1), kl_coef=1.0)  # [1]
            term, _ = grpo.clipped_policy_loss(logprob - logprob.detach(), -penalty[:, None], 0.2, 0.2)
        expected += torch.softmax(z, 0)[o].detach() * torch.autograd.grad(term.sum(), z)[0]
    logp = torch.log_softmax(z, 0)
    exact = (logp.exp() * (logp - ref)).sum() if kl == "reverse" else (ref.exp() * (ref - logp)).sum()
    torch.testing.assert_close(expected, torch.autograd.grad(exact, z)[0], rtol=0, atol=1e-6)


def test_kl_in_the_reward_shapes_the_advantages_and_leaves_the_loss():
    args = args_for("--algo", "grpo", "--kl-placement", "reward", "--kl-coef", "0.5", "--ppo-epochs", "1")
    model, batch = sampled_batch(args)
    ref_model = copy.deepcopy(model)
    for p in ref_model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    with torch.no_grad():
        old, ref = (net.token_logprobs(batch["input_ids"], batch["target_ids"]) for net in (model, ref_model))
    penalty = 0.5 * ((old - ref) * batch["loss_mask"]).sum(dim=1)
    want = grpo.group_advantages(batch["rewards"] - penalty.view_as(batch["rewards"]), "zscore").flatten()
    assert not torch.allclose(want, batch["advantages"], atol=1e-3)  # the KL does move them
    stats, _ = grpo.policy_update(model, [GradRecorder(model)], batch, args, NO_AUTOCAST, ref_model)
    torch.testing.assert_close(batch["advantages"], want, rtol=0, atol=1e-5)
    assert stats["kl"] > 0 and stats["loss"] == pytest.approx(stats["loss_policy"], abs=1e-9)


def test_kl_in_the_reward_counts_every_sampled_token_of_replies_the_loss_leaves_out():
    # --mask-truncated leaves cut-off replies out of the loss, but they still count in their group's mean and std:
    # their KL must be theirs, not 0
    args = args_for("--algo", "grpo", "--kl-placement", "reward", "--kl-coef", "0.5", "--ppo-epochs", "1",
                    "--mask-truncated", "--drop-equal-groups")
    model, batch = sampled_batch(args)
    assert (batch["loss_mask"].sum(dim=1) == 0).any() and (batch["loss_mask"].sum(dim=1) > 0).any()
    ref_model = copy.deepcopy(model)
    for p in ref_model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    with torch.no_grad():
        old, ref = (net.token_logprobs(batch["input_ids"], batch["target_ids"]) for net in (model, ref_model))
    _, unfiltered = sampled_batch(args_for("--algo", "grpo"))  # the same replies, every sampled token in the loss
    sampled = unfiltered["loss_mask"]
    assert (sampled.sum(dim=1) > 0).all()  # every reply sampled tokens
    penalty = 0.5 * ((old - ref) * sampled).sum(dim=1)
    want = grpo.group_advantages(batch["rewards"] - penalty.view_as(batch["rewards"]), "zscore").flatten()
    grpo.policy_update(model, [GradRecorder(model)], batch, args, NO_AUTOCAST, ref_model)
    torch.testing.assert_close(batch["advantages"], want, rtol=0, atol=1e-5)


def no_signal_batch(args):
    """A sampled batch whose every group got one reward: every advantage is 0."""
    model, batch = sampled_batch(args)
    batch["rewards"] = torch.full_like(batch["rewards"], 0.5)
    batch["advantages"] = grpo.group_advantages(batch["rewards"], args.advantage).flatten()
    return model, batch


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_a_step_without_policy_signal_is_the_kl_free_step(optimizer):
    # Every advantage 0, a reference a little off the policy: the KL's gradient alone is tiny, and Muon and Adam
    # normalise a step's scale, so it used to move the weights by a full step away from the reference. The step
    # must be the one a KL-free run takes (a zero gradient), two steps in a row (momentum), with 2 minibatches.
    flags = ["--algo", "grpo", "--optimizer", optimizer, "--num-minibatches", "2"]
    results = []
    for kl in ("0.04", "0"):
        args = args_for(*flags, "--kl-coef", kl)
        model, batch = no_signal_batch(args)
        ref_model = copy.deepcopy(model).requires_grad_(False) if kl != "0" else None
        if ref_model is not None:
            for p in ref_model.parameters():
                p.data.add_(1e-4 * torch.randn_like(p))
        optimizers = model_module.make_optimizers(model, args)
        for _ in range(2):
            stats, _ = grpo.policy_update(model, optimizers, batch, args, NO_AUTOCAST, ref_model)
        results.append((model.state_dict(), stats))
    (with_kl, stats_kl), (without_kl, stats_free) = results
    for k, v in with_kl.items():
        assert torch.equal(v, without_kl[k]), k
    assert stats_kl["kl"] > 0 and stats_kl["no_signal_updates"] == stats_free["no_signal_updates"] == 4


def test_a_step_with_policy_signal_or_an_entropy_bonus_has_the_kl_in_its_gradient():
    args = args_for("--algo", "grpo", "--kl-coef", "0.04", "--ppo-epochs", "1")
    model, batch = sampled_batch(args)
    ref_model = copy.deepcopy(model).requires_grad_(False)
    for p in ref_model.parameters():
        p.data.add_(1e-2 * torch.randn_like(p))
    recorder = GradRecorder(model)
    stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST, ref_model)
    (without_ref,), _ = gradients(model, batch, args)
    assert stats["no_signal_updates"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(recorder.grads[0], without_ref))
    # no advantage, but an entropy bonus: a signal, the KL stays in the gradient
    args = args_for("--algo", "grpo", "--kl-coef", "0.04", "--ppo-epochs", "1", "--entropy-coef", "0.01")
    model, batch = no_signal_batch(args)
    recorder = GradRecorder(model)
    stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST, ref_model)
    assert stats["no_signal_updates"] == 0 and any(g.abs().sum() > 0 for g in recorder.grads[0])


def test_advantages_by_hand_and_all_equal_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 3.0]])
    mean = grpo.group_advantages(rewards, "mean")
    torch.testing.assert_close(mean, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.75, -0.75, -0.75, 2.25]]))
    z = grpo.group_advantages(rewards, "zscore")
    std = math.sqrt(1 / 3)  # unbiased std of 1, 0, 0, 1
    torch.testing.assert_close(z[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    assert (z[1] == 0).all() and torch.isfinite(z).all()
    torch.testing.assert_close(z[2], mean[2] / (1.5 + 1e-4))


def test_rloo_and_batch_advantages_against_their_definitions(monkeypatch):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [0.7] * 6, [0.0, 0.2, 0.9, 0.4, 0.4, 1.0]])
    rloo = grpo.group_advantages(rewards, "rloo")
    for p in range(3):
        for i in range(6):  # r_i minus the mean of the other five
            others = torch.cat([rewards[p, :i], rewards[p, i + 1:]])
            assert rloo[p, i].item() == pytest.approx((rewards[p, i] - others.mean()).item(), abs=1e-6)
    batch = grpo.group_advantages(rewards, "batch")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    torch.testing.assert_close(batch[[0, 2]], centered[[0, 2]] / (rewards.flatten().std() + 1e-4))
    for kind in ("mean", "zscore", "rloo", "batch"):  # 0.7 * 6 / 6 is not 0.7 in float32: zeros all the same
        assert (grpo.group_advantages(rewards, kind)[1] == 0).all(), kind
    # across ranks, the std is the whole step's: two ranks holding halves give one rank's advantages
    halves = [rewards[:2], rewards[2:]]

    def sum_of_both_ranks(tensor, op=None):
        both = [torch.stack([torch.tensor(h.numel(), dtype=torch.float64), h.double().sum(),
                             h.double().square().sum()]) for h in halves]
        tensor.copy_(both[0] + both[1])
        return tensor

    monkeypatch.setattr(grpo, "all_reduce", sum_of_both_ranks)
    torch.testing.assert_close(torch.cat([grpo.group_advantages(h, "batch") for h in halves]), batch)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    log_ratio = torch.log(torch.tensor([[0.5, 1.0, 1.1, 2.0, 10.0, 100.0]]))
    for advantage in (-2.0, 1.5):
        A = torch.tensor([[advantage]])
        plain, plain_clipped = grpo.clipped_policy_loss(log_ratio, A, 0.2, 0.2)
        dual, dual_clipped = grpo.clipped_policy_loss(log_ratio, A, 0.2, 0.2, clip_c=3.0)
        if advantage > 0:  # nothing changes for positive advantages
            assert torch.equal(dual, plain) and torch.equal(dual_clipped, plain_clipped)
            continue
        # verl's definition: with A < 0, min(the PPO loss, -C * A)
        torch.testing.assert_close(dual, torch.minimum(plain, torch.tensor(-3.0 * advantage)))
        assert dual[0, -2:].tolist() == [6.0, 6.0] and plain[0, -1].item() == pytest.approx(200.0)
        assert dual_clipped[0].tolist() == [True, False, False, False, True, True]  # 0.5: the low-side PPO clip
    # and no gradient flows through a dual-clipped token
    log_ratio = log_ratio.clone().requires_grad_()
    grpo.clipped_policy_loss(log_ratio, torch.tensor([[-2.0]]), 0.2, 0.2, clip_c=3.0)[0].sum().backward()
    assert log_ratio.grad[0, -2:].tolist() == [0.0, 0.0] and log_ratio.grad[0, 2].item() != 0


def test_aggregations_by_hand_including_an_all_masked_reply():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # nanochat: one question, 3 replies in passes of 2: rows 0-1 (3 tokens), row 2 (none: counts as 1 token, as there)
    expected = {"token": (1 + 2 + 4) / 3, "sequence": ((1 + 2) / 2 + 4 / 1) / 2, "constant": (1 + 2 + 4) / (3 * 5),
                "nanochat": ((1 + 2 + 4) / 3 + 0 / 1) / 2}
    lengths = grpo.pass_normalisers(mask, G=3, pass_size=2)
    assert lengths.tolist() == pytest.approx([2.0, 2.0, 2 / 3])  # a pass's tokens x 2 passes / 3 replies
    for kind, value in expected.items():
        denominator = grpo.loss_denominator(mask, kind, max_new_tokens=5).float()
        rows = lambda s: grpo.micro_batch_denominator(denominator, {"pass_normalisers": lengths[s]}, kind)
        assert grpo.aggregate(per_token, mask, kind, rows(slice(0, 3))).item() == pytest.approx(value)
        # shares of micro-batches add up to the whole, whatever the split
        parts = sum(grpo.aggregate(per_token[s], mask[s], kind, rows(s)) for s in (slice(0, 1), slice(1, 3)))
        assert parts.item() == pytest.approx(value)


def test_drop_equal_groups_and_mask_truncated_shape_the_loss_mask():
    args = args_for("--algo", "dapo")
    _, plain = sampled_batch(args_for())
    _, dapo = sampled_batch(args)
    G = args.num_samples
    assert plain["loss_mask"][3 * G:].sum() > 0 and dapo["loss_mask"][3 * G:].sum() == 0  # group 3 is all-equal
    assert (dapo["loss_mask"] <= plain["loss_mask"]).all()


def test_presets_and_explicit_overrides():
    grpo_args = args_for("--algo", "grpo")
    assert (grpo_args.advantage, grpo_args.aggregation, grpo_args.ppo_epochs, grpo_args.clip_eps,
            grpo_args.clip_eps_high, grpo_args.kl_coef, grpo_args.kl_estimator) == ("zscore", "sequence", 2, 0.2, 0.2, 0.04, "k3")
    overridden = args_for("--algo", "grpo", "--kl-coef", "0", "--no-drop-equal-groups", "--lr", "0.1")
    assert overridden.kl_coef == 0 and overridden.ppo_epochs == 2 and overridden.lr == 0.1
    dapo = args_for("--algo", "dapo")
    assert (dapo.clip_eps_high, dapo.drop_equal_groups, dapo.mask_truncated, dapo.aggregation, dapo.dynamic_sampling) == \
        (0.28, True, True, "token", True)
    assert args_for("--algo", "dr_grpo").aggregation == "constant"
    gspo = args_for("--algo", "gspo")
    assert (gspo.ratio_level, gspo.clip_eps, gspo.clip_eps_high, gspo.num_minibatches, gspo.ppo_epochs, gspo.kl_coef) == \
        ("sequence", 3e-4, 4e-4, 4, 1, 0.0)
    assert (dapo.overlong_buffer, args_for("--algo", "dapo", "--overlong-buffer", "0").overlong_buffer) == (8 // 5, 0)
    assert args_for("--algo", "grpo").overlong_buffer == 0
    assert grpo.resolve_config([]).task == "gsm8k"  # --demo defaults do not leak into later parses


@pytest.mark.parametrize("flags,message", [
    (["--num-samples", "1"], "groups of at least 2"),
    (["--algo", "grpo", "--pass-size", "4"], "--aggregation sequence has none"),
    (["--clip-eps", "0"], "clip-eps"),
    (["--kl-coef", "-0.1"], "kl-coef"),
    (["--ref-reset-every", "5", "--kl-coef", "0"], "--kl-coef > 0"),
    (["--temperature", "0"], "temperature"),
    (["--sapo-tau-pos", "inf"], "error: --sapo-tau-pos must be finite"),  # past its > 0 check, named by the next
    (["--lr", "nan", "--sapo-tau-neg", "inf"], "error: --sapo-tau-neg, --lr must be finite"),  # in --help's order
    (["--rollout-correction-cap", "inf"], "error: --rollout-correction-cap must be finite"),  # every float flag
    (["--clip-ratio-c", "inf"], "error: --clip-ratio-c must be finite"),
    (["--distill-coef", "inf"], "error: --distill-coef must be finite"),  # a teacher's weight of inf: a NaN loss
    (["--num-minibatches", "1000"], "num-minibatches"),
    (["--overlong-buffer", "100"], "overlong-buffer"),
    (["--top-k", "1"], "--top-k 1"),
    (["--eval-examples", "0"], "measures nothing"),
    (["--final-eval-examples", "0"], "measures nothing"),
    (["--init-lr-frac", "-1"], "learning rates"),
    (["--lr", "0"], "learning rates"),
    (["--grad-clip", "-1"], "--grad-clip"),
    (["--n-head", "0"], "--n-head 0"),
    (["--n-embd", "30", "--n-head", "4"], "--n-embd 30"),
    (["--depth", "-1"], "--depth -1"),
    (["--n-embd", "12", "--n-head", "4"], "even head size"),
    (["--run-name", "../../x"], "plain folder name"),
    (["--run-name", "/tmp/x"], "plain folder name"),
    (["--run-name", ".."], "plain folder name"),
    (["--algo", "gspo", "--aggregation", "token"], "--ratio-level sequence with --aggregation token"),
    (["--algo", "gspo", "--aggregation", "constant"], "--ratio-level sequence with --aggregation constant"),
    (["--algo", "reinforce", "--ratio-level", "sequence"], "--ratio-level sequence with --aggregation nanochat"),
])
def test_bad_flags_exit_2_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo.resolve_config(["--demo", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cuda_requested_without_cuda_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo.resolve_config(["--demo", "--device", "cuda"])
    assert exit_info.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_prompts_not_divisible_by_ranks(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as exit_info:
        grpo.resolve_config(["--demo", "--prompts-per-step", "32"])
    assert exit_info.value.code == 2 and "not divisible" in capsys.readouterr().err


# ---------------------------------------------------------------------------- whole runs

def run_flags(tmp_path, name, *extra):
    return ["--demo", "--algo", "reinforce", "--runs-dir", str(tmp_path), "--run-name", name, "--eval-every", "0", "--prompts-per-step", "8",
            "--num-samples", "4", "--no-plot", *extra]


def final_state(tmp_path, name, step):
    model, _ = load_checkpoint(str(tmp_path / name / "chatrl_checkpoints" / "d2"), step)
    return model.state_dict()


@pytest.mark.parametrize("version", ["v1", "v5"])  # v5: NorMuon's second moments and nanochat's AdamW state too
def test_resume_equals_an_uninterrupted_run(tmp_path, run_killed_after_first_save, version):
    flags = ["--num-steps", "4", "--save-every", "2", "--algo", "grpo", "--optimizer", "muon", "--weight-decay", "0.1",
             "--optimizer-version", version]
    grpo.main(run_flags(tmp_path, "straight", *flags))
    run_killed_after_first_save(run_flags(tmp_path, "resumed", *flags))
    half_written = tmp_path / "resumed" / "chatrl_checkpoints" / "d2" / ".tmp_killed"  # what a kill mid-save leaves
    half_written.write_bytes(b"half a checkpoint")
    grpo.main(run_flags(tmp_path, "resumed", *flags, "--resume"))
    assert not half_written.exists()
    for (k, a), b in zip(final_state(tmp_path, "straight", 4).items(), final_state(tmp_path, "resumed", 4).values()):
        assert torch.equal(a, b), k
    metrics = [[json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("straight", "resumed")]
    assert [m["step"] for m in metrics[1]] == [1, 2, 3, 4]
    for a, b in zip(*metrics):
        assert a["reward"] == b["reward"] and a["loss"] == b["loss"]


@pytest.mark.parametrize("version", [None, 1, 3])
def test_a_run_of_another_version_is_refused_on_resume_in_one_line(tmp_path, run_killed_after_first_save, version,
                                                                   capsys):
    # a run folder written by another version of the program (None: before config.json recorded one) resumes with
    # neither its old semantics nor today's: one line naming both versions and the way on
    flags = run_flags(tmp_path, "old", "--num-steps", "2", "--save-every", "1", "--algo", "grpo")
    run_killed_after_first_save(flags)
    config_path = tmp_path / "old" / "config.json"
    config = json.load(open(config_path))
    assert config["version"] == grpo.VERSION
    config.pop("version") if version is None else config.update(version=version)
    config_path.write_text(json.dumps(config))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        grpo.main(flags + ["--resume"])
    message = str(stop.value.code)
    assert message.startswith(f"error: --resume: the run was written by grpo.py version {version or 1}, this is "
                              f"version {grpo.VERSION}") and "\n" not in message
    assert message.endswith(f"--init {tmp_path / 'old' / 'chatrl_checkpoints' / 'd2'}")  # the run's checkpoints
    assert "configuration:" not in capsys.readouterr().out  # refused before any work


def test_config_json_holds_the_sizes_the_memory_plan_fitted(tmp_path, run_killed_after_first_save, monkeypatch,
                                                            capsys):
    # On a GPU the plan fits --device-batch-size and --sample-batch-size; mocked here on the CPU
    fitted_plan = grpo.fitted_plan

    def fitting(rows, replies):
        def fit(model, args, *a):
            args.device_batch_size, args.sample_batch_size = rows, replies
            return fitted_plan(model, args, *a)
        return fit
    flags = run_flags(tmp_path, "fitted", "--num-steps", "2", "--save-every", "1")
    monkeypatch.setattr(grpo, "fitted_plan", fitting(5, 16))
    run_killed_after_first_save(flags)
    config = json.load(open(tmp_path / "fitted" / "config.json"))
    assert (config["device_batch_size"], config["sample_batch_size"]) == (5, 16)
    monkeypatch.setattr(grpo, "fitted_plan", fitting(3, 8))  # another GPU fits other sizes
    capsys.readouterr()
    grpo.main(flags + ["--resume"])
    out = capsys.readouterr().out
    assert "device_batch_size 5 -> 3" in out and "sample_batch_size 16 -> 8" in out
    config = json.load(open(tmp_path / "fitted" / "config.json"))
    assert config["resumed_with"] == [{"step": 1, "device_batch_size": [5, 3], "sample_batch_size": [16, 8]}]
    assert (config["device_batch_size"], config["sample_batch_size"]) == (3, 8)


def test_a_run_stopped_out_of_memory_resumes_with_the_smaller_chunks_its_stop_line_names(tmp_path, capsys,
                                                                                          run_killed_after_first_save):
    flags = run_flags(tmp_path, "oom", "--num-steps", "2", "--save-every", "1", "--algo", "grpo")
    run_killed_after_first_save(flags)
    capsys.readouterr()
    grpo.main(flags + ["--resume", "--device-batch-size", "3", "--sample-batch-size", "8"])
    out = capsys.readouterr().out
    # packed passes by tokens, the demo's default: no rows a pass until asked for
    assert "resumed from step 1" in out and "device_batch_size None -> 3" in out and "sample_batch_size None -> 8" in out
    resumed_with = json.load(open(tmp_path / "oom" / "config.json"))["resumed_with"]
    assert resumed_with == [{"step": 1, "device_batch_size": [None, 3], "sample_batch_size": [None, 8]}]


def test_resume_refuses_other_flags_and_a_missing_run(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no checkpoint"):
        grpo.main(run_flags(tmp_path, "nothing", "--resume"))
    assert not os.path.exists(tmp_path / "nothing")  # a resume of a run that never was creates nothing
    grpo.main(run_flags(tmp_path, "r", "--num-steps", "1"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(run_flags(tmp_path, "r", "--num-steps", "1"))
    assert exit_info.value.code == 2 and "already holds a run" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"differ from the run.s \(aggregation, algo, pass_size, ppo_epochs\): pass "
                       r"the original flags: --aggregation nanochat --algo reinforce --pass-size 8 --ppo-epochs 1$"):
        grpo.main(run_flags(tmp_path, "r", "--num-steps", "1", "--algo", "dr_grpo", "--resume"))
    # evaluation flags may change: they never move the weights. The evaluation's result is its own, beside the run's
    result = grpo.main(run_flags(tmp_path, "r", "--num-steps", "1", "--resume", "--eval-only", "--final-eval-examples", "5"))
    assert result["eval_examples"] == 5
    metrics = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert [(m["step"], "reward" in m, m.get("eval_examples")) for m in metrics] == [(1, True, None)]
    assert [json.loads(line) for line in open(tmp_path / "r" / "eval_only.jsonl")] == [{"step": 1, **result}]
    assert json.load(open(tmp_path / "r" / "config.json"))["final_eval_examples"] == -1


def test_non_finite_loss_skips_then_stops_keeping_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    original, calls = grpo.clipped_policy_loss, []

    def poisoned(*a):
        calls.append(1)
        loss, clipped = original(*a)
        return (loss * float("nan") if len(calls) > 2 else loss), clipped

    monkeypatch.setattr(grpo, "clipped_policy_loss", poisoned)
    with pytest.raises(SystemExit, match="non-finite"):
        grpo.main(run_flags(tmp_path, "nan", "--num-steps", "10", "--save-every", "1", "--device-batch-size", "64"))
    checkpoints = sorted(os.listdir(tmp_path / "nan" / "chatrl_checkpoints" / "d2"))
    assert checkpoints == ["meta_000001.json", "meta_000002.json", "model_000001.pt", "model_000002.pt",
                           "state_000001.pt", "state_000002.pt"]
    assert "warning: step 3: non-finite loss" in capsys.readouterr().out
    metrics = [json.loads(line) for line in open(tmp_path / "nan" / "metrics.jsonl")]
    assert [m["skipped_updates"] for m in metrics] == [0, 0, 1, 1, 1]


SMEAR_BACKOUT = os.path.join(FIXTURES, "smear-backout", "base", "chatsft_checkpoints", "d4")


def launch_ranks(runs, logs, port, world_size=2):
    """Runs (flag lists), one after the other, on ranks as torchrun starts them (its environment variables), without
    torchrun's own interpreter, and all in one launch (tests/rank_runs.py): test_faults_launch.py runs jobs through
    torchrun itself. -> a function that waits for the ranks and fails with their output if one failed."""
    listing = logs[0].parent / f"{logs[0].stem}-runs.json"
    listing.write_text(json.dumps(runs))
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    ranks = [subprocess.Popen([sys.executable, os.path.join("tests", "rank_runs.py"), str(listing)], cwd=ROOT,
                              stdout=open(logs[r], "w"), stderr=subprocess.STDOUT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world_size)]

    def wait():
        try:
            for rank, log in zip(ranks, logs):
                try:
                    assert rank.wait(timeout=300) == 0, log.read_text()
                except subprocess.TimeoutExpired:  # what each rank got to (was the port taken by another run?)
                    raise AssertionError("\n".join(log.read_text()[-2000:] for log in logs)) from None
        finally:  # a rank that failed leaves the other waiting for it
            for rank in ranks:
                rank.kill()
    return wait


def in_this_process(flags):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: one thread, the same float32 summation order as a rank's
    try:
        return grpo.main(flags)  # in this process: a second interpreter would only add its start-up time
    finally:
        torch.set_num_threads(threads)


# The rank tests' settings: 3 steps on 2 ranks (the optimizer sharded, as by default), against one process. Evals on 7
# problems: the ranks split them unevenly, and their sums must still give the single-process numbers. Two
# minibatches: each rank's share of a minibatch must be its share of the single process's minibatch.
RANK_SETTINGS = {
    "muon-v1": ["--entropy-coef", "0", "--optimizer-version", "v1"],
    "adamw-2-minibatches": ["--entropy-coef", "0", "--optimizer", "adamw", "--num-minibatches", "2"],
    "muon-v5": ["--entropy-coef", "0", "--optimizer-version", "v5"],
    # the random fixture model never sorts: all rewards equal, the entropy bonus is what moves the adapters
    "lora": ["--init", SMEAR_BACKOUT, "--lora-rank", "4", "--lora-lr", "1e-2", "--entropy-coef", "0.01"],
    # the teacher's top-k on each rank's passes: its forward KL summed over ranks as in one process (the teacher:
    # the resume runs' single-process run, finished before the launch)
    "distill-forward": ["--optimizer", "adamw", "--algo", "distill", "--teacher", "{resume-single}",
                        "--distill-divergence", "forward", "--distill-top-k", "8"],
    # episodes of several turns (the task answers: user turns forced into rows), their evals on each rank's problems;
    # the random model's rewards are all 0 here, the entropy bonus (over sampled tokens only) moves the weights
    "episodes": ["--optimizer", "adamw", "--task", os.path.join(ROOT, "docs", "examples", "guess_digit.py:GuessDigit"),
                 "--max-new-tokens", "24", "--entropy-coef", "0.01"],
}


def rank_test_flags(root, setting, name, *more):
    return run_flags(root, name, "--num-steps", "3", "--save-every", "1", "--algo", "grpo", "--device-batch-size", "4",
                     "--lr", "1e-3", "--eval-every", "3", "--eval-examples", "7", "--final-eval-examples", "7",
                     "--pass-k", "2", *(flag.replace("{resume-single}", str(root / "resume-single"))
                                        for flag in RANK_SETTINGS[setting]), *more)


def resume_test_flags(root, name, *more):
    return run_flags(root, name, "--num-steps", "4", "--save-every", "2", "--algo", "grpo", "--optimizer", "adamw",
                     "--lr", "1e-3", "--entropy-coef", "0", "--device-batch-size", "4", *more)


# The main command rehearsed: grpo.py from nanochat fixture checkpoints (random weights, their output projections
# not zero: log-probs that depend on the context) on GSM8K, with what a GPU run takes by default wherever a CPU can:
# the default algorithm and --num-samples (or full GRPO), the start-up self-check, --compile's static packed passes
# and static decode (rank_runs.rehearsal: the compiler and a trained model's rewards stood in for), the evals; one
# process and 2 ranks. Smaller: questions a step, reply and eval lengths, the shortest problems (short_gsm8k). Not
# taken: bf16 (a CPU emulates its matmuls: 3x the time; test_bf16.py and the self-check tests run it).
REHEARSALS = {"reinforce-smear-backout": ("smear-backout", []), "grpo-classic": ("classic", ["--algo", "grpo"])}
HAS_REHEARSALS = os.path.isdir(FIXTURES) and os.path.isfile(os.path.join(GSM8K_DIR, "train.jsonl"))


def short_gsm8k(folder, train=32, test=8):
    """Real GSM8K problems, the shortest questions of each split: static passes are shaped by the longest prompt
    of the task (995 tokens in the byte-level fixtures), and a CPU's exact attention pays for that shape in full."""
    folder.mkdir(exist_ok=True)
    for split, count in (("train", train), ("test", test)):
        lines = open(os.path.join(GSM8K_DIR, f"{split}.jsonl")).readlines()
        (folder / f"{split}.jsonl").write_text("".join(sorted(lines, key=lambda l: len(json.loads(l)["question"]))[
            :count]))
    return folder


def rehearsal_flags(root, name, ranks):
    generation, extra = REHEARSALS[name]
    return ["--init", os.path.join(FIXTURES, generation, "base", "chatsft_checkpoints", "d4"), "--task", "gsm8k",
            "--gsm8k-dir", str(root / "gsm8k"), "--device", "cpu", "--runs-dir", str(root),
            "--run-name", f"{name}-{ranks}",
            "--self-check", "--compile", "--decode", "static", "--prompts-per-step", "2",
            "--max-new-tokens", "16", "--num-steps", "2", "--save-every", "1", "--eval-every", "2",
            "--eval-examples", "2", "--final-eval-examples", "2", "--eval-max-new-tokens", "16", "--pass-k", "2",
            "--no-plot", *extra]


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    """Every 2-rank run the rank tests compare, in one launch, and meanwhile the same runs in this process: for
    each setting <setting>-ddp and <setting>-single; muon-v5-whole (2 ranks, not sharded); resume-ddp and
    resume-single, then their copies without step 4 resumed on 2 ranks (ddp-on-2, single-on-2: the resume test);
    the rehearsals, <name>-2 and <name>-1 (this process's output in rehearsals.txt).
    -> the folder of their run folders."""
    root = tmp_path_factory.mktemp("ranks")
    in_this_process(resume_test_flags(root, "resume-single"))  # before the launch, which resumes a copy of it
    copy_without_step(root / "resume-single", root / "single-on-2", 4)
    settings = [s for s in RANK_SETTINGS if s != "lora" or os.path.isdir(SMEAR_BACKOUT)]
    ddp = [rank_test_flags(root, s, f"{s}-ddp") for s in settings]
    ddp += [rank_test_flags(root, "muon-v5", "muon-v5-whole", "--no-shard-optimizer"),
            resume_test_flags(root, "resume-ddp", "--self-check"),  # the start-up check's all-reduce on 2 ranks
            {"copy": [str(root / "resume-ddp"), str(root / "ddp-on-2"), 4]},
            resume_test_flags(root, "ddp-on-2", "--resume"), resume_test_flags(root, "single-on-2", "--resume")]
    if HAS_REHEARSALS:
        short_gsm8k(root / "gsm8k")
        ddp += [{"flags": rehearsal_flags(root, name, 2), "rehearsal": True} for name in REHEARSALS]
    wait = launch_ranks(ddp, [root / f"rank{r}.txt" for r in range(2)], free_port())
    for flags in [rank_test_flags(root, s, f"{s}-single") for s in settings]:
        in_this_process(flags)
    with open(root / "rehearsals.txt", "w") as out, contextlib.redirect_stdout(out), rehearsal():
        for name in REHEARSALS if HAS_REHEARSALS else []:
            in_this_process(rehearsal_flags(root, name, 1))
    wait()
    return root


@pytest.mark.xdist_group("rank_runs")
@pytest.mark.parametrize("name", list(REHEARSALS))
def test_the_main_command_rehearsed_on_one_process_and_two_ranks(rank_runs, name):
    if not HAS_REHEARSALS:
        pytest.skip("nanochat fixtures or GSM8K not found (../shared)")
    runs = {ranks: rank_runs / f"{name}-{ranks}" for ranks in (1, 2)}
    config = json.load(open(runs[2] / "config.json"))
    assert (config["world_size"], config["num_samples"], config["compile"], config["decode"]) == (2, 16, True, "static")
    # each run's start-up check passed on the run's own fast path (the packed, static, compiled one), 2 replies a
    # question whatever --num-samples
    for log in (rank_runs / "rehearsals.txt", rank_runs / "rank0.txt"):
        assert log.read_text().count("self-check: packed passes, compiled vs the plain float32 path") >= (
            list(REHEARSALS).index(name) + 1)
    logs = [[json.loads(line) for line in open(runs[ranks] / "metrics.jsonl")] for ranks in (1, 2)]
    steps = [[m for m in log if "reward" in m] for log in logs]
    assert [len(s) for s in steps] == [2, 2] and [m["eval_examples"] for m in logs[1] if "eval_reward" in m] == [2, 2]
    assert [m["reward"] for m in steps[0]] == [m["reward"] for m in steps[1]]  # the same replies, the same scores
    assert 0 < steps[0][0]["reward"] < 1 and steps[0][0]["equal_group_frac"] < 1  # an update with something to learn
    assert abs(steps[0][0]["loss"] - steps[1][0]["loss"]) <= SAME_STEP_SHARE * abs(steps[0][0]["loss"])
    tag = "d4"
    start = load_checkpoint(os.path.join(FIXTURES, REHEARSALS[name][0], "base", "chatsft_checkpoints", tag))[0]
    one, two = (load_checkpoint(str(runs[ranks] / "chatrl_checkpoints" / tag), 1)[0].state_dict() for ranks in (1, 2))
    assert any(not torch.equal(v, start.state_dict()[k]) for k, v in one.items())  # the step moved the weights
    assert_same_steps(one, two, start.state_dict())  # ranks sum in another order: the same step up to rounding
    # written back in the start checkpoint's format and generation: nanochat loads it
    start_dir = os.path.join(FIXTURES, REHEARSALS[name][0], "base", "chatsft_checkpoints", tag)
    original = torch.load(os.path.join(start_dir, "model_000650.pt"), weights_only=True)
    saved = torch.load(runs[2] / "chatrl_checkpoints" / tag / "model_000002.pt", weights_only=True)
    assert {k: (v.shape, v.dtype) for k, v in saved.items()} == {k: (v.shape, v.dtype) for k, v in original.items()}
    meta = json.load(open(runs[2] / "chatrl_checkpoints" / tag / "meta_000002.json"))
    assert meta["model_config"] == json.load(open(os.path.join(start_dir, "meta_000650.json")))["model_config"]
    assert load_checkpoint(str(runs[2] / "chatrl_checkpoints" / tag))[0].generation_name == REHEARSALS[name][0]


@pytest.mark.xdist_group("rank_runs")  # pytest -n: one worker runs the fixture's launch, once
@pytest.mark.parametrize("setting", list(RANK_SETTINGS))
def test_ddp_steps_equal_single_process_steps(rank_runs, setting):
    # The ranks sum the gradient in another order than one process, so the weights differ in their last bits after
    # the first step; AdamW's steps on embedding rows that barely get a gradient (~ lr * sign(g) with eps 1e-10) and
    # Muon's orthogonalisation then amplify that: with Muon the weights are compared after step 1 here, and after
    # step 3 against 2 ranks that do not shard, which sum in the same order (tests/bench_ranks.py measures the drift).
    if setting == "lora" and not os.path.isdir(SMEAR_BACKOUT):
        pytest.skip("nanochat fixtures not found (../shared/fixtures/nanochat or $NANOGRPO_FIXTURES)")
    tag = "d4" if setting == "lora" else "d2"

    def weights(name, step):
        return load_checkpoint(str(rank_runs / name / "chatrl_checkpoints" / tag), step)[0].state_dict()

    single, ddp = f"{setting}-single", f"{setting}-ddp"
    start = (load_checkpoint(SMEAR_BACKOUT)[0] if setting == "lora" else GPT(GPTConfig(**json.load(open(
        rank_runs / single / "chatrl_checkpoints" / tag / "meta_000003.json"))["model_config"])).init_weights(0))
    config = json.load(open(rank_runs / ddp / "config.json"))
    assert config["world_size"] == 2 and config["optimizer_version"] == (
        setting[-2:] if setting.startswith("muon") else config["optimizer_version"])
    compared = 1 if setting.startswith("muon") else 3
    a, b = weights(single, compared), weights(ddp, compared)
    assert_same_steps(a, b, start.state_dict())
    assert any(not torch.equal(v, start.state_dict()[k]) for k, v in weights(ddp, 3).items())  # steps were taken
    if setting == "muon-v5":  # sharded or not, 2 ranks add the same two gradients: the same weights, bit for bit
        whole = weights("muon-v5-whole", 3)
        for k, v in weights(ddp, 3).items():
            assert torch.equal(v, whole[k]), k
    logs = [[json.loads(line) for line in open(rank_runs / n / "metrics.jsonl")] for n in (single, ddp)]
    train = [[m for m in log if "reward" in m] for log in logs]
    assert train[0][0]["reward"] == train[1][0]["reward"]
    assert abs(train[0][0]["loss"] - train[1][0]["loss"]) <= SAME_STEP_SHARE * abs(train[0][0]["loss"])
    if setting == "episodes":  # the same episodes: their turns and how they ended, counted over the ranks
        assert [[m[k] for m in log for k in m if k.startswith("episode_")] for log in train] == [
            [m[k] for m in train[0] for k in m if k.startswith("episode_")]] * 2 and train[0][0]["episode_turns"] > 1
    if setting == "distill-forward":  # the teacher's term, as one process takes it: a mean of per-token KLs (>= 0)
        assert train[0][0]["teacher_kl"] > 0
        assert_same_sum(train[0][0]["teacher_kl"], train[1][0]["teacher_kl"], train[0][0]["tokens_sampled"])
    # each rank holds about half of the optimizer state
    state = [train[0][-1]["optimizer_state_mb"], train[1][-1]["optimizer_state_mb"]]
    assert 0.4 * state[0] < state[1] <= 0.6 * state[0]
    evals = [[m for m in log if "eval_reward" in m] for log in logs]
    assert [m["step"] for m in evals[1]] == [0, 3] and all(m["eval_examples"] == 7 for m in evals[1])
    assert evals[0][0] == pytest.approx(evals[1][0])


@pytest.mark.xdist_group("rank_runs")
def test_a_sharded_run_resumes_on_as_many_or_another_number_of_ranks(rank_runs, tmp_path, capsys):
    # the training state holds the whole optimizer state, gathered from its owners: any number of ranks resumes
    # from it, each keeping its own share. 2 -> 2 is exact; 2 -> 1 and 1 -> 2 go on within the rank tests' tolerance.
    # The runs on 2 ranks were resumed in rank_runs' launch, from copies without their step-4 checkpoint.
    straight = {name: final_state(rank_runs, f"resume-{name}", 4) for name in ("single", "ddp")}
    start = GPT(GPTConfig(**json.load(open(rank_runs / "resume-single" / "chatrl_checkpoints" / "d2" / (
        "meta_000004.json")))["model_config"])).init_weights(0).state_dict()  # the demo's initial weights
    resumes = {"ddp-on-2": ("ddp", rank_runs), "ddp-on-1": ("ddp", tmp_path), "single-on-2": ("single", rank_runs)}
    copy_without_step(rank_runs / "resume-ddp", tmp_path / "ddp-on-1", 4)
    capsys.readouterr()
    in_this_process(resume_test_flags(tmp_path, "ddp-on-1", "--resume"))
    logs = {"ddp-on-1": capsys.readouterr().out}
    checked = [(rank_runs / f"rank{r}.txt").read_text().count("self-check: packed passes vs the plain float32 path")
               for r in range(2)]
    assert checked == [1, 0]  # the resume-ddp run's start-up check: every rank takes part, rank 0 prints it
    rank0, on_2 = (rank_runs / "rank0.txt").read_text(), ["ddp-on-2", "single-on-2"]
    assert "resumed from step 2" in logs["ddp-on-1"] and rank0.count("resumed from step 2") == len(on_2)
    logs.update(zip(on_2, rank0.split("resumed from step 2")))  # each run's log, up to its resume line
    for name, (source, folder) in resumes.items():
        log = logs[name]
        assert ("world_size 2 -> 1" in log) == (name == "ddp-on-1") and ("world_size 1 -> 2" in log) == (
            name == "single-on-2")
        resumed = final_state(folder, name, 4)
        if name == "ddp-on-2":
            assert all(torch.equal(resumed[k], v) for k, v in straight[source].items())
        else:
            assert_same_steps(resumed, straight[source], start)


def test_gradients_are_reduced_in_few_buckets_and_exactly(monkeypatch):
    model, batch = sampled_batch(args_for())
    (-model.token_logprobs(batch["input_ids"], batch["target_ids"]).mean()).backward()
    params = list(model.parameters())
    single = [p.grad.clone() for p in params]
    sizes = []

    def two_equal_ranks(tensor, op=None):  # a sum over two ranks that hold the same gradient
        sizes.append(tensor.numel())
        return tensor.mul_(2)

    monkeypatch.setattr(grpo.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(grpo.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(grpo.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(grpo.dist, "all_reduce", two_equal_ranks)
    model_module.reduce_gradients(params, bucket_bytes=4 * 3000)  # 3,000 floats a bucket: several buckets
    assert 1 < len(sizes) < len(params) and sum(sizes) == sum(p.numel() for p in params)
    for p, g in zip(params, single):
        assert torch.equal(p.grad, 2 * g)
    sizes.clear()
    model_module.reduce_gradients(params)
    assert len(sizes) == 1  # the default bucket holds this whole model
    # sharded: each weight's gradient is summed onto its owner only; rank 0 keeps its own and drops the rest
    for p, g in zip(params, single):
        p.grad = g.clone()
    destinations = []
    monkeypatch.setattr(grpo.dist, "reduce", lambda tensor, dst: destinations.append(dst) or tensor.mul_(2))
    owners = model_module.shard_owners(params, 2)
    model_module.reduce_gradients(params, owners)
    assert destinations == [0, 1]  # one bucket per owner
    for p, g in zip(params, single):
        assert torch.equal(p.grad, 2 * g) if owners[id(p)] == 0 else p.grad is None
    load = [sum(p.numel() for p in params if owners[id(p)] == r) for r in (0, 1)]
    assert max(load) <= 0.6 * sum(load) and 0 < min(load)


@pytest.mark.slow  # a measurement, 11 s on 2 cores: outside the 2-minute suite (pytest --slow)
def test_demo_learns_from_random_weights(tmp_path, capsys):
    # the demo's settings, shortened: a larger learning rate so that 40 steps show a clear rise (held-out reward
    # 0.15-0.21 at step 40 for seeds 0-3, from 0.00: trajectories differ between processors, so a margin)
    grpo.main(["--demo", "--runs-dir", str(tmp_path), "--run-name", "learn", "--num-steps", "40", "--eval-every", "40",
               "--init-lr-frac", "2.0"])
    out = capsys.readouterr().out
    evals = [m for m in map(json.loads, open(tmp_path / "learn" / "metrics.jsonl")) if "eval_reward" in m]
    assert [m["step"] for m in evals] == [0, 40]
    assert evals[1]["eval_reward"] > evals[0]["eval_reward"] + 0.1, evals
    assert any(line.split()[:6] == ["learn", "sort", "grpo", "zscore", "1", "40"] for line in out.splitlines())  # the end-of-run summary
    assert os.path.isfile(tmp_path / "learn" / "curves.png") or "no plot: matplotlib is not installed" in out


def test_one_gsm8k_step_end_to_end(tmp_path, gsm8k_dir):
    grpo.main(["--task", "gsm8k", "--gsm8k-dir", gsm8k_dir, "--init", "scratch", "--depth", "1", "--n-embd", "32",
               "--n-head", "1", "--device", "cpu", "--runs-dir", str(tmp_path), "--run-name", "g", "--num-steps", "1",
               "--prompts-per-step", "2", "--num-samples", "2", "--max-new-tokens", "8", "--eval-every", "1",
               "--eval-examples", "3", "--final-eval-examples", "3", "--eval-max-new-tokens", "16", "--pass-k", "2",
               "--algo", "grpo", "--no-plot"])
    metrics = [json.loads(line) for line in open(tmp_path / "g" / "metrics.jsonl")]
    final = metrics[-1]
    assert final["step"] == 1 and final["eval_examples"] == 3
    assert {"eval_strict", "eval_lenient", "eval_pass@1", "eval_pass@2"} <= set(final)
    assert metrics[1]["kl"] is not None and os.path.isfile(tmp_path / "g" / "tokenizer" / "tokenizer.pkl")


def test_eval_only_and_compare(tmp_path, capsys, monkeypatch):
    evals = ["--eval-every", "1", "--eval-examples", "8", "--final-eval-examples", "8"]
    grpo.main(run_flags(tmp_path, "a", "--num-steps", "2", *evals))
    grpo.main(run_flags(tmp_path, "b", "--num-steps", "2", *evals, "--algo", "grpo"))
    result = grpo.main(["--demo", "--init", str(tmp_path / "a" / "chatrl_checkpoints" / "d2"), "--eval-only",
                        "--final-eval-examples", "16", "--runs-dir", str(tmp_path), "--run-name", "e"])
    assert result["eval_examples"] == 16
    capsys.readouterr()
    table = grpo.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b"), "--runs-dir", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert [row[:6] for row in table[1:]] == [["a", "sort", "reinforce", "mean", 1, 2], ["b", "sort", "grpo", "zscore",
                                                                                       1, 2]]
    assert "reinforce" in out and "grpo" in out
    # the task's own eval metric (sort's exact match) has its column; a KL-free run's plot has no KL panel
    exact = table[0].index("exact")
    assert all(isinstance(row[exact], float) for row in table[1:]) and "exact: the task's own eval metrics" in out
    axes = pytest.importorskip("matplotlib.axes")
    titles = []
    monkeypatch.setattr(axes.Axes, "set_title", lambda ax, title, *a, **k: titles.append(title))
    grpo.main(["--compare", str(tmp_path / "a"), "--runs-dir", str(tmp_path)])
    assert "eval score" in titles and not [t for t in titles if t.startswith("KL")]
    with pytest.raises(SystemExit, match="not a finished run"):
        grpo.main(["--compare", str(tmp_path / "missing")])


def test_a_run_without_a_training_step_has_no_recent_reward_in_the_compare_table():
    row = grpo.run_summary({"task": "sort", "scores": {"": "exact"}}, [{"step": 0, "eval_exact": 0.5}])
    assert row[:3] == [0, None, None]  # "-" in the table, as every column without a value


def readme_ladder():
    """The README's "one flag per rung" table -> each rung's flags, cumulative: rung 0 alone, then each added."""
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    table = text[text.index("| rung | flag |"):].split("\n\n")[0]
    rows = [line.split("|")[2].strip().strip("`").split() for line in table.splitlines()[2:]]
    return [sum(rows[:i + 1], []) for i in range(len(rows))]


def test_under_the_demo_each_rung_of_the_ladder_moves_the_entropy_bonus_only_with_a_note():
    # the demo's entropy bonus follows the advantages' scale: the rung that z-scores them raises it, and says so
    ladder = readme_ladder()
    rungs = [grpo.resolve_config(["--demo", *flags]) for flags in ladder]
    assert ladder[0] == ["--algo", "reinforce"] and len(rungs) == 5 and rungs[0].notes == []
    own = rungs[0].entropy_coef  # --algo reinforce's
    for i, rung in enumerate(rungs):
        moved = [n for n in rung.notes if "entropy bonus" in n]
        if rung.entropy_coef == own:
            assert moved == [], rung.notes
            continue
        by = ladder[next(j for j in range(i + 1) if rungs[j].entropy_coef == rung.entropy_coef)][-2:]  # that rung
        [note] = moved
        assert note.startswith(f"{' '.join(by)} also sets the demo's entropy bonus to {rung.entropy_coef:g}, not "
                               f"--algo reinforce's {own:g}") and note.endswith(f"--entropy-coef {own:g} keeps it")
    full = grpo.resolve_config(["--demo", "--algo", "grpo"])  # the last rung is --algo grpo, bonus included
    for key in [*grpo.PRESETS["grpo"], "entropy_coef"]:
        assert getattr(rungs[-1], key) == getattr(full, key), key
    assert full.notes == [] and grpo.resolve_config(["--demo", "--algo", "reinforce", "--advantage", "zscore",
                                                     "--entropy-coef", "0.01"]).notes == []


@pytest.mark.parametrize("flags,preset", [
    (["--distill-divergence", "forward"], "grpo"),  # no teacher term: its note says it does nothing
    (["--algo", "reinforce", "--kl-estimator", "k2"], "reinforce"),  # no KL term
    (["--algo", "reinforce", "--clip-eps", "0.3"], "reinforce"),  # one optimizer step a batch: the ratio is 1
    (["--algo", "sapo", "--clip-eps", "0.3"], "sapo"),  # SAPO's gate has no clip
    (["--algo", "grpo", "--kl-estimator", "k2"], "custom"), (["--algo", "grpo", "--clip-eps", "0.3"], "custom"),
    (["--algo", "reinforce", "--reward-combination", "normalize-then-sum", "--advantage", "zscore"], "reinforce"),
])
def test_a_flag_that_did_nothing_leaves_the_runs_preset(flags, preset):
    # the preset column of --compare and of the end-of-run summary: a flag idle in the run changed nothing in it
    config = grpo.resolve_config(["--demo", *flags])
    assert bool(config.notes) == (preset != "custom"), config.notes
    assert grpo.preset_of(json.loads(json.dumps(vars(config)))) == preset  # as config.json holds it


def test_a_config_without_the_algorithm_flags_or_with_others_values_is_labelled_custom(tmp_path, capsys):
    # a config.json of an older version (flags it did not have) or edited by hand: the idle conditions read what it
    # holds, and --compare shows it, never a traceback
    grpo.main(run_flags(tmp_path, "edited", "--num-steps", "1", "--eval-every", "0"))
    config = json.load(open(tmp_path / "edited" / "config.json"))
    without = {k: v for k, v in config.items() if k not in ("ppo_epochs", "num_minibatches")}
    for edited in (without, dict(config, ppo_epochs="2", policy_loss=[1])):
        (tmp_path / "edited" / "config.json").write_text(json.dumps(edited))
        table = grpo.main(["--compare", str(tmp_path / "edited"), "--no-plot"])
        assert table[1][2] == "custom", table
    # what --compare cannot read a run from: one line naming the folder
    for damaged in ({"task": "sort", "algo": "grpo"}, dict(config, scores="reward"), "[" * 100_000):
        (tmp_path / "edited" / "config.json").write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
        with pytest.raises(SystemExit) as stop:
            grpo.main(["--compare", str(tmp_path / "edited"), "--no-plot"])
        assert str(stop.value.code).startswith(f"error: {tmp_path / 'edited'} is not a finished run directory (")


def test_compare_labels_runs_by_their_settings_and_shows_the_flags_that_differ(tmp_path, capsys):
    ladder = readme_ladder()
    grpo.main(run_flags(tmp_path, "rung4", "--num-steps", "1", *ladder[4][2:]))  # --algo reinforce + four flags
    grpo.main(run_flags(tmp_path, "full", "--num-steps", "1", "--algo", "grpo"))
    grpo.main(run_flags(tmp_path, "rung1", "--num-steps", "1", *ladder[1][2:]))
    capsys.readouterr()
    table = grpo.main(["--compare", *(str(tmp_path / name) for name in ("rung4", "full", "rung1")), "--no-plot"])
    out = capsys.readouterr().out
    assert [row[2] for row in table[1:]] == ["grpo", "grpo", "custom"] and table[0][2] == "preset"
    listed = out[out.index("flags that differ between the rows"):].splitlines()[1:4]
    assert [line.split() for line in listed] == [  # pass_size: nanochat's aggregation's, unset under the others
        ["rung4", "--algo", "reinforce", "--aggregation", "sequence", "--ppo-epochs", "2", "--kl-coef", "0.04"],
        ["full", "--algo", "grpo", "--aggregation", "sequence", "--ppo-epochs", "2", "--kl-coef", "0.04"],
        ["rung1", "--algo", "reinforce", "--aggregation", "nanochat", "--pass-size", "8", "--ppo-epochs", "1",
         "--kl-coef", "0.0"]]
    capsys.readouterr()
    grpo.main(["--compare", str(tmp_path / "full"), "--no-plot"])  # one run: nothing differs
    assert "flags that differ" not in capsys.readouterr().out


def test_compare_groups_seeds_and_keeps_same_named_runs_apart(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs in several folders: the plot goes to the current one
    for seed in ("0", "1"):
        grpo.main(run_flags(tmp_path, f"cfg-seed{seed}", "--num-steps", "2", "--seed", seed, "--eval-every", "1",
                            "--eval-examples", "8", "--final-eval-examples", "8"))
    other = tmp_path / "other"
    grpo.main(run_flags(other, "cfg-seed0", "--num-steps", "2", "--algo", "grpo"))  # same folder name, another config
    grpo.main(run_flags(tmp_path, "solo", "--num-steps", "2", "--algo", "grpo", "--seed", "1"))  # other/cfg-seed0's config
    capsys.readouterr()
    table = grpo.main(["--compare", str(tmp_path / "cfg-seed0"), str(tmp_path / "cfg-seed1"), str(other / "cfg-seed0"),
                       "--runs-dir", str(tmp_path)])
    rows = {row[0]: row for row in table[1:]}
    seeds = table[0].index("seeds")
    assert set(rows) == {"cfg", "cfg-seed0"} and rows["cfg"][seeds] == 2 and rows["cfg-seed0"][seeds] == 1
    header = table[0]
    rewards = [json.loads(line)["reward"] for name in ("cfg-seed0", "cfg-seed1")
               for line in open(tmp_path / name / "metrics.jsonl") if '"reward"' in line]
    mean, std = rows["cfg"][header.index("reward(last10)")]
    assert mean == pytest.approx((sum(rewards[:2]) / 2 + sum(rewards[2:]) / 2) / 2)
    assert std == pytest.approx(abs(sum(rewards[:2]) - sum(rewards[2:])) / 2 / 2 ** 0.5)
    out = capsys.readouterr().out
    assert "±" in out and "kl, teacher kl, reply len: the last step's; clip frac, tok/s: the mean over the steps" in out
    steps = [m for m in map(json.loads, open(other / "cfg-seed0" / "metrics.jsonl")) if "reward" in m]
    assert rows["cfg-seed0"][header.index("kl")] == steps[-1]["kl"] and rows["cfg-seed0"][header.index(
        "clip frac")] == pytest.approx(sum(m["clip_frac"] for m in steps) / len(steps)), steps  # as the legend says
    # runs that share a folder name but not a configuration keep their parent folder in the name
    table = grpo.main(["--compare", str(tmp_path / "cfg-seed0"), str(other / "cfg-seed0"), "--runs-dir", str(tmp_path),
                       "--no-plot"])
    assert sorted(row[0] for row in table[1:]) == sorted([os.path.join(tmp_path.name, "cfg-seed0"), "other/cfg-seed0"])
    # and a seed of a configuration under another folder name joins it
    table = grpo.main(["--compare", str(other / "cfg-seed0"), str(tmp_path / "solo"), "--runs-dir", str(tmp_path),
                       "--no-plot"])
    assert [row[table[0].index("seeds")] for row in table[1:]] == [2]


def test_under_gdpo_the_idle_advantage_neither_splits_runs_nor_picks_the_entropy_bonus(tmp_path, capsys):
    # normalize-then-sum z-scores each term whatever --advantage says: runs that differ in it alone are one
    # configuration, labelled gdpo, with the z-scored advantages' entropy bonus
    gdpo = ["--reward-combination", "normalize-then-sum", "--num-steps", "1"]
    entropy_coef = grpo.resolve_config(["--demo", *gdpo, "--advantage", "mean"]).entropy_coef
    assert entropy_coef == grpo.DEMO_ENTROPY_COEF["zscore"]
    for seed, advantage in (("0", "mean"), ("1", "rloo")):
        grpo.main(run_flags(tmp_path, f"g-seed{seed}", *gdpo, "--algo", "grpo", "--seed", seed, "--advantage",
                            advantage))
    table = grpo.main(["--compare", str(tmp_path / "g-seed0"), str(tmp_path / "g-seed1"), "--no-plot"])
    assert len(table) == 2 and table[1][table[0].index("advantage")] == "gdpo" and table[1][
        table[0].index("seeds")] == 2


def test_compares_plot_goes_beside_the_runs_or_here_and_a_failed_write_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path / "..")
    for folder in ("a", "b"):
        grpo.main(run_flags(tmp_path / folder, "run", "--num-steps", "1"))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    capsys.readouterr()
    grpo.main(["--compare", str(tmp_path / "a" / "run")])  # one folder: beside the run
    grpo.main(["--compare", str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")])  # two: here, not their parent
    grpo.main(["--compare", str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")])  # again: it says so
    assert capsys.readouterr().out.count("plot: ") == 3
    assert (tmp_path / "a" / "compare.png").is_file() and (here / "compare.png").is_file()
    assert not (tmp_path / "compare.png").exists()
    # --no-plot: the runs drew no curves.png, and --compare the table alone
    assert not (tmp_path / "a" / "run" / "curves.png").exists()
    table = grpo.main(["--compare", str(tmp_path / "a" / "run"), "--no-plot", "--compare-out", str(here / "no.png")])
    assert table[1][0] == "run" and "plot" not in capsys.readouterr().out and not (here / "no.png").exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as stop:
        grpo.main(["--compare", str(tmp_path / "a" / "run"), "--compare-out", str(tmp_path / "a-file" / "c.png")])
    assert stop.value.code.startswith(f"error: cannot write the plot {tmp_path / 'a-file' / 'c.png'} (")
    assert stop.value.code.endswith("): pass --compare-out with a file in a writable folder")


def test_missing_nanochat_checkpoint_explains_the_demo(tmp_path, monkeypatch, gsm8k_dir):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match=r"(?s)chatsft_checkpoints.*--demo"):
        grpo.main(["--gsm8k-dir", gsm8k_dir, "--runs-dir", str(tmp_path), "--device", "cpu"])


# ---------------------------------------------------------------------------- the sampler's own log-probs

def sampled_with_top_k(top_k, temperature=0.8):
    args = args_for("--algo", "reinforce", "--temperature", str(temperature), "--top-k", str(top_k))
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=64, vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32),
                "smear-backout")
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    prompts = [TOK.render_for_completion(Sort("train")[i]) for i in range(3)]
    samples = generate(model, TOK, prompts, args.num_samples, 6, temperature, top_k or None, seed=1)
    rewards = torch.rand(3, args.num_samples)
    return args, model, prompts, samples, grpo.make_batch(prompts, samples, rewards, args)


def test_the_sampler_returns_the_log_prob_of_the_distribution_it_drew_from():
    for top_k in (0, 5):
        args, model, prompts, samples, _ = sampled_with_top_k(top_k)
        checked = 0
        for row in range(samples["tokens"].size(0)):
            prompt = prompts[row // args.num_samples]
            reply = samples["tokens"][row, :samples["lengths"][row]].tolist()
            raw = model(torch.tensor([prompt + reply]), softcap=False)[0, len(prompt) - 1:-1].float()  # no cache
            for t, token in enumerate(reply):
                values = raw[t].topk(top_k) if top_k else (raw[t], None)
                log_p = torch.log_softmax(model.generation.softcap * torch.tanh(values[0] / model.generation.softcap)
                                          / args.temperature, dim=-1)
                expected = log_p[token] if not top_k else log_p[(values[1] == token).nonzero().item()]
                assert samples["logprobs"][row, t].item() == pytest.approx(expected.item(), abs=1e-5)
                checked += 1
        assert checked > 20


def test_sampler_gap_and_rollout_correction():
    # full softmax in float32: the sampler's distribution is the trained one, so the gap is ~0 and tis does nothing
    args, model, _, _, batch = sampled_with_top_k(0)
    (plain,), stats = gradients(model, batch, args)
    assert stats["sampler_gap"] < 1e-5
    (corrected,), _ = gradients(model, batch, args_for(*["--algo", "reinforce", "--temperature", "0.8", "--top-k", "0",
                                                         "--rollout-correction", "tis"]))
    for a, b in zip(plain, corrected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # top-k 5: the sampler's log-probs are renormalised over 5 tokens, the trained ones over all
    args, model, _, _, batch = sampled_with_top_k(5)
    mask = batch["loss_mask"]
    logprobs = model.token_logprobs(batch["input_ids"], batch["target_ids"], args.temperature)
    gap = (logprobs.detach() - batch["sampler_logprobs"]) * mask  # log pi_old - log pi_sampler; pi_old = pi_theta
    _, stats = gradients(model, batch, args)
    assert stats["sampler_gap"] == pytest.approx((gap.abs().sum() / mask.sum()).item(), rel=1e-5) and (gap < 0).any()
    for kind, weights in (("tis", torch.exp(gap).clamp(max=1.5)),
                          ("mask", ((torch.exp(gap) >= 1 / 1.5) & (torch.exp(gap) <= 1.5)).float())):
        flags = ["--algo", "reinforce", "--temperature", "0.8", "--top-k", "5", "--rollout-correction", kind,
                 "--rollout-correction-cap", "1.5"]
        (corrected,), _ = gradients(model, batch, args_for(*flags))
        by_hand = -(weights * batch["advantages"][:, None] * logprobs * mask).sum() / mask.sum()
        for a, b in zip(corrected, torch.autograd.grad(by_hand, list(model.parameters()), retain_graph=True)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert 0 < (weights * mask).sum() < mask.sum()  # the correction did act on some tokens


def test_gspo_gets_one_rollout_weight_per_reply():
    # a reply's loss is one term (its ratio the mean log-ratio): the correction weighs or drops the reply whole,
    # by its mean gap, as its ratio is built; a token's own gap never weighs the reply's other tokens
    args, model, _, _, batch = sampled_with_top_k(5)
    mask = batch["loss_mask"]
    logprobs = model.token_logprobs(batch["input_ids"], batch["target_ids"], args.temperature)
    gap = ((logprobs.detach() - batch["sampler_logprobs"]) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [N]
    replies = (mask.sum(dim=1) > 0).sum()
    for kind, weights in (("tis", torch.exp(gap).clamp(max=2.6)),
                          ("mask", ((torch.exp(gap) >= 1 / 2.6) & (torch.exp(gap) <= 2.6)).float())):
        flags = ["--algo", "gspo", "--num-minibatches", "1", "--temperature", "0.8", "--top-k", "5",
                 "--rollout-correction", kind, "--rollout-correction-cap", "2.6"]
        (corrected,), _ = gradients(model, batch, args_for(*flags))
        reply_means = (logprobs * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        by_hand = -(weights * batch["advantages"] * reply_means).sum() / replies
        for a, b in zip(corrected, torch.autograd.grad(by_hand, list(model.parameters()), retain_graph=True)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert kind == "tis" or 0 < weights.sum() < replies  # some replies dropped whole, others kept


def test_reward_weights_combine_the_task_terms(tmp_path, gsm8k_dir):
    class TwoTerms(Sort):
        reward_terms = ("reward", "short")

        def reward_parts(self, conversation, reply_text):
            return {"reward": self.reward(conversation, reply_text), "short": float(len(reply_text) < 4)}

    args = args_for("--algo", "reinforce")
    args.reward_weights = {"reward": 1.0, "short": 0.25}  # what --reward-weights reward=1,short=0.25 parses to
    model, _ = sampled_batch(args)
    groups = grpo.sample_groups(model, TOK, TwoTerms("train"), [0, 1], [5, 6], args, NO_AUTOCAST)
    correct, short = groups["terms"][..., 0], groups["terms"][..., 1]
    assert 0 < short.sum() < short.numel()  # both values of the second term occur
    torch.testing.assert_close(groups["task_rewards"], correct + 0.25 * short)
    # by default only the first term counts, bit for bit what reward() gives
    default = grpo.sample_groups(model, TOK, TwoTerms("train"), [0, 1], [5, 6], args_for("--algo", "reinforce"),
                                 NO_AUTOCAST)
    assert torch.equal(default["task_rewards"], correct)
    # GSM8K's terms are logged every step, and a name the task does not have is refused
    grpo.main(["--task", "gsm8k", "--gsm8k-dir", gsm8k_dir, "--init", "scratch", "--depth", "1", "--n-embd", "32",
               "--n-head", "1", "--device", "cpu", "--runs-dir", str(tmp_path), "--run-name", "w", "--num-steps", "1",
               "--prompts-per-step", "2", "--num-samples", "2", "--max-new-tokens", "8", "--eval-every", "0",
               "--reward-weights", "correct=1,format=0.1", "--no-plot"])
    (step,) = [m for m in map(json.loads, open(tmp_path / "w" / "metrics.jsonl")) if "reward" in m]
    assert step["reward"] == pytest.approx(step["reward/correct"] + 0.1 * step["reward/format"])
    with pytest.raises(SystemExit):
        args_for("--reward-weights", "correct=1")  # the sort task has no "correct" term


@pytest.mark.slow
def test_a_compiled_update_gives_the_eager_loss_and_gradients():
    # --compile: token_logprobs runs GPT.hidden through torch.compile (inductor, as on a GPU). Full GRPO with its KL
    # reference and two epochs, so both the no-grad forwards (pi_ref) and the forward + backward are compiled.
    args = args_for("--algo", "grpo", "--device-batch-size", "5")  # micro-batches of two sizes: dynamic shapes
    model, batch = sampled_batch(args)
    ref_model = copy.deepcopy(model).requires_grad_(False)
    results = {}
    for compiled in (False, True):
        for net in (model, ref_model):
            net.use_compile = compiled
        recorder = GradRecorder(model)
        stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST, ref_model)
        results[compiled] = stats, recorder.grads
    for key in ("loss", "loss_policy", "loss_kl", "entropy"):  # measured: equal, or 5e-9 apart (entropy)
        assert results[True][0][key] == pytest.approx(results[False][0][key], rel=1e-6, abs=1e-9), key
    for eager, compiled in zip(results[False][1], results[True][1]):  # every optimizer step's gradients
        for a, b in zip(eager, compiled):  # measured: 1e-6 apart in norm, 7e-8 at most
            assert (b - a).norm() <= 1e-5 * a.norm()


def test_sampling_in_chunks_of_whole_groups_gives_the_same_replies():
    args = args_for("--algo", "reinforce")
    model, _ = sampled_batch(args)
    G, questions, seeds = args.num_samples, [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]
    whole = grpo.sample_groups(model, TOK, Sort("train"), questions, seeds, args, NO_AUTOCAST)
    assert len({tuple(row) for row in whole["samples"]["tokens"].tolist()}) > G  # replies differ
    for rows in (1, G, 2 * G + 1, 3 * G):  # one question a call (also below one group), two, three then two
        chunked = grpo.sample_groups(model, TOK, Sort("train"), questions, seeds,
                                     args_for("--algo", "reinforce", "--sample-batch-size", str(rows)), NO_AUTOCAST)
        for k, v in whole["samples"].items():  # the log-probs up to rounding: other batch shapes
            assert torch.equal(chunked["samples"][k], v) if k != "logprobs" else torch.allclose(
                chunked["samples"][k], v, rtol=1e-5, atol=1e-6), (rows, k)
        assert torch.equal(chunked["rewards"], whole["rewards"])


@pytest.mark.parametrize("prompts_per_step", [64, 128])
def test_a_steps_questions_are_distinct_across_epoch_boundaries(prompts_per_step):
    # GSM8K's train split has 7,473 questions; a step that straddles two epochs used to take some twice, with the
    # same noise (seed, step, question): the same group twice. Over 10 epochs, on 1, 2 and 4 ranks.
    n, epochs = 7473, 10
    args = SimpleNamespace(prompts_per_step=prompts_per_step, seed=3)
    steps = -(-n * epochs // prompts_per_step)
    by_step = [grpo.prompt_indices(step, 0, 1, args, n) for step in range(steps)]
    for step, questions in enumerate(by_step):
        assert len(set(questions)) == prompts_per_step, step
    stream = [q for questions in by_step for q in questions]
    for epoch in range(epochs):  # every epoch still takes every question once
        assert sorted(stream[epoch * n:(epoch + 1) * n]) == list(range(n)), epoch
    assert stream[:n] == list(range(n))  # the first epoch: the task's own order
    for world_size in (2, 4):  # the ranks' shares make up the one process's step, whatever their number
        for step in (0, 116, steps - 1):
            assert sum((grpo.prompt_indices(step, r, world_size, args, n) for r in range(world_size)), []) == \
                by_step[step]


def test_a_step_holds_its_questions_once_also_when_a_task_has_few_more_than_a_step():
    args = SimpleNamespace(prompts_per_step=48, seed=0)
    n = 70  # fewer than two steps' questions: an epoch's start and end can meet in one step
    stream = []
    for step in range(40):
        questions = grpo.prompt_indices(step, 0, 1, args, n)
        assert len(set(questions)) == 48, step
        stream += questions
    for epoch in range(len(stream) // n):
        assert sorted(stream[epoch * n:(epoch + 1) * n]) == list(range(n)), epoch


@pytest.mark.parametrize("flags", [
    ["--algo", "reinforce"],  # nanochat's aggregation
    ["--algo", "grpo", "--num-minibatches", "2"],  # sequence, k3 in the loss, 2 epochs x 2 minibatches
    ["--algo", "grpo", "--kl-placement", "reward", "--mask-truncated", "--num-minibatches", "2"],
    ["--algo", "dapo", "--kl-coef", "0.04", "--kl-estimator", "k1", "--entropy-coef", "0.01"],  # token, filters
    ["--algo", "dr_grpo", "--kl-coef", "0.04", "--kl-estimator", "k2"],  # constant
    ["--algo", "gspo", "--rollout-correction", "tis"],  # one ratio a reply, 4 minibatches
    ["--algo", "grpo", "--lora-rank", "4"],  # the reference: the model with its adapters off
])
def test_a_packed_update_takes_the_unpacked_steps(flags):
    # float64 weights, AdamW steps: packed passes (several a minibatch) and padded rows give the same trajectory
    results = []
    for layout in (["--no-pack", "--device-batch-size", "5"], ["--tokens-per-pass", "40"]):
        lora = "--lora-rank" in flags
        args = args_for(*[f for f in flags if f not in ("--lora-rank", "4")], *layout, "--optimizer", "adamw",
                        "--lr", "0.02")
        model, batch = sampled_batch(args)
        assert len(batch["micro_batches"]) >= 2 * args.num_minibatches
        model.double()
        if lora:
            args.lora_rank, args.lora_alpha = 4, 8.0
            model.add_lora(4, 8.0, seed=0)
            for p in model.lora.parameters():
                p.data.normal_(0, 0.1)  # adapters that already differ from the base
            ref_model = model
        elif args.kl_coef:
            ref_model = copy.deepcopy(model).requires_grad_(False)
            for p in ref_model.parameters():
                p.data.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        else:
            ref_model = None
        stats, _ = grpo.policy_update(model, model_module.make_optimizers(model, args), batch, args, NO_AUTOCAST, ref_model)
        results.append((stats, {k: v.clone() for k, v in model.state_dict().items()}, batch["advantages"]))
    (stats, weights, advantages), (packed_stats, packed_weights, packed_advantages) = results
    assert (packed_advantages - advantages).abs().max() <= 1e-6  # float32 rewards, float64 KL
    for k in ("loss", "loss_policy", "loss_kl", "kl", "entropy", "clip_frac"):
        if stats[k] is not None:
            assert packed_stats[k] == pytest.approx(stats[k], rel=1e-9, abs=1e-12), k
    for k, v in weights.items():
        assert (packed_weights[k] - v).abs().max() <= 1e-10, k


def test_the_compiled_update_builds_its_graphs_once_for_packed_passes_of_any_length(monkeypatch):
    # Static packed passes: every pass has the budget's tokens and the pack's fixed shapes, so the compiled forward
    # meets one shape, and the compiled head's graph is dynamic; batches of other reply lengths add no graph. (Counted with dynamo's own counter as backend.)
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    import model as model_module
    counter, compile_ = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, options=None: compile_(fn, dynamic=dynamic,
                                                                                          backend=counter))
    model_module.compiled_hidden.cache_clear()
    model_module.compiled_head_logprobs.cache_clear()
    torch._dynamo.reset()
    try:
        args = args_for("--algo", "grpo", "--num-minibatches", "2", "--tokens-per-pass", "40")
        graphs, widths = [], set()
        static = (4 * args.num_samples // args.num_minibatches, 24)  # a minibatch's rows; prompt and reply, at most
        for seed in range(3):  # other samples, other widths
            model, *inputs = batch_inputs(args, seed)
            model.use_compile = True
            batch = grpo.make_batch(*inputs, args, static)
            assert batch["widths"].max() <= 24
            widths.add(tuple(batch["widths"].tolist()))
            grpo.policy_update(model, [GradRecorder(model)], batch, args, NO_AUTOCAST, copy.deepcopy(model))
            graphs.append(counter.frame_count)
        assert len(widths) == 3 and graphs[0] > 0 and graphs[0] == graphs[1] == graphs[2], graphs
    finally:
        model_module.compiled_hidden.cache_clear()
        model_module.compiled_head_logprobs.cache_clear()
        torch._dynamo.reset()


def test_a_pass_shorter_than_the_longest_row_is_refused_at_start(tmp_path):
    with pytest.raises(SystemExit) as stop:
        grpo.main(run_flags(tmp_path, "short", "--tokens-per-pass", "12"))
    message = str(stop.value.code)
    assert message.startswith("error: --tokens-per-pass 12 is less than the longest row") and "\n" not in message
    assert "--max-new-tokens" in message and not (tmp_path / "short" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------- CISPO, SAPO, terms normalised

def test_cispo_with_one_epoch_on_policy_is_reinforce_with_the_same_aggregation_and_advantages():
    (cispo,), stats = gradients(*sampled_batch(args := args_for("--algo", "cispo", "--ppo-epochs", "1")), args)
    reinforce_args = args_for("--algo", "reinforce", "--aggregation", "token", "--advantage", "zscore")
    (reinforce,), _ = gradients(*sampled_batch(reinforce_args), reinforce_args)
    assert args.policy_loss == "cispo" and args.aggregation == "token" and args.kl_coef == 0
    for a, b in zip(cispo, reinforce):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in cispo)


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    log_ratio = torch.log(torch.tensor([[0.5, 1.0, 1.5, 3.0]]))  # pi_theta / pi_old
    advantages = torch.tensor([[2.0]])
    loss, clipped = grpo.cispo_policy_loss(logprobs, log_ratio, advantages, eps_low=1.0, eps_high=0.28)
    loss.sum().backward()
    weight = torch.tensor([[0.5, 1.0, 1.28, 1.28]])  # no lower bound (eps_low 1), the upper one 1.28
    torch.testing.assert_close(logprobs.grad, -weight * 2.0)  # every token keeps a gradient, the far ones too
    assert clipped.tolist() == [[False, False, True, True]]
    # PPO's clip gives the tokens past the band in the advantage's direction no gradient at all
    ratio_grad = torch.zeros(1, 4, requires_grad=True)
    ppo, _ = grpo.clipped_policy_loss(log_ratio + ratio_grad, advantages, 0.2, 0.28)
    ppo.sum().backward()
    assert ratio_grad.grad[0, 2:].tolist() == [0.0, 0.0]


def test_sapos_gate_has_the_gradient_of_its_formula_and_is_the_policy_gradient_at_ratio_one():
    log_ratio = torch.log(torch.tensor([[0.6, 1.0, 1.3, 2.0], [0.6, 1.0, 1.3, 2.0]])).requires_grad_(True)
    advantages = torch.tensor([[1.5], [-0.7]])  # one reply of each sign: tau_pos, tau_neg
    loss, clipped = grpo.sapo_policy_loss(log_ratio, advantages, tau_pos=1.0, tau_neg=1.05)
    loss.sum().backward()
    ratio, tau = log_ratio.detach().exp(), torch.tensor([[1.0], [1.05]])
    gate = torch.sigmoid(tau * (ratio - 1))
    torch.testing.assert_close(loss, -(4 / tau) * gate * advantages)
    # d/d(log rho) of -(4 / tau) sigmoid(tau (rho - 1)) A = -4 sigmoid' rho A
    torch.testing.assert_close(log_ratio.grad, -4 * gate * (1 - gate) * ratio * advantages)
    torch.testing.assert_close(log_ratio.grad[:, 1:2], -advantages)  # rho = 1: -A, the unclipped policy gradient
    assert not clipped.any()


@pytest.mark.parametrize("temperatures", [[], ["--sapo-tau-pos", "3", "--sapo-tau-neg", "0.2"]])
def test_sapo_with_one_epoch_on_policy_is_reinforce_with_the_same_aggregation_and_advantages(temperatures):
    # at any temperature: at ratio 1 the gate's slope is the policy gradient's (the idle note on --sapo-tau-*)
    (sapo,), _ = gradients(*sampled_batch(args := args_for("--algo", "sapo", "--ppo-epochs", "1", *temperatures)), args)
    reinforce_args = args_for("--algo", "reinforce", "--aggregation", "sequence", "--advantage", "zscore")
    (reinforce,), _ = gradients(*sampled_batch(reinforce_args), reinforce_args)
    assert args.aggregation == "sequence"  # the paper's per-reply mean
    for a, b in zip(sapo, reinforce):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("advantage", ["zscore", "mean", "rloo"])
def test_reward_terms_normalised_each_in_its_group_then_summed(advantage):
    # GDPO z-scores each term in its group whatever --advantage says. Group 1: "correct" spread 0 or 1, "format"
    # spread 0.01; group 2: a term in {0, 10} next to one in {0, 0.01} (weight 1 each; the penalty term all 0)
    parts = torch.tensor([[[1.0, 0.00, 0.0], [0.0, 0.01, 0.0], [1.0, 0.01, 0.0], [0.0, 0.00, 0.0]],
                          [[10., 0.01, 0.0], [10., 0.00, 0.0], [0.0, 0.01, 0.0], [0.0, 0.00, 0.0]]])  # [P, G, K+1]
    args = args_for("--advantage", advantage, "--reward-combination", "normalize-then-sum")
    got = grpo.term_advantages(parts, [1.0, 1.0, 1.0])
    z = lambda x: (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-4)  # noqa: E731
    summed = z(parts[..., 0]) + z(parts[..., 1])
    torch.testing.assert_close(got, summed / (summed.std() + 1e-4))
    # summed first, the small term is drowned: replies that differ in it alone nearly tie; normalised first, not
    plain = grpo.group_advantages(parts[..., 0] + parts[..., 1], advantage)
    assert abs(plain[0, 0] - plain[0, 2]) < 0.02 and abs(got[0, 0] - got[0, 2]) > 0.5
    assert abs(plain[1, 0] - plain[1, 1]) < 0.02 * abs(plain[1, 0]) and abs(got[1, 0] - got[1, 1]) > 0.5
    assert abs(got[1, 1]) < 0.02 and abs(got[1, 2]) < 0.02  # GDPO: [1.32, 0, 0, -1.32] but for the eps in the std
    # and through make_batch, from sample_groups' parts
    model, prompts, samples, rewards = batch_inputs(args)
    batch = grpo.make_batch(prompts, samples, rewards, args, reward_parts=torch.stack([rewards, 0 * rewards], -1))
    torch.testing.assert_close(batch["advantages"], grpo.term_advantages(
        torch.stack([rewards, 0 * rewards], -1), [1.0, 1.0]).flatten())


def test_under_gdpo_an_equal_sum_of_unequal_terms_is_no_equal_group():
    # correct (weight 1), format (weight 0.5) and the overlong penalty, all summing to 0.5 in a group of 2: GDPO's
    # per-term advantages are not 0 there, so --drop-equal-groups and dynamic sampling keep it
    args = args_for("--reward-combination", "normalize-then-sum", "--num-samples", "2")
    parts = torch.tensor([[[1.0, 0.0, -0.5], [0.0, 1.0, 0.0]],  # correct, format, penalty
                          [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]])  # [P, G, terms + 1]; group 2 truly equal
    rewards = parts[..., 0] + 0.5 * parts[..., 1] + parts[..., 2]
    assert rewards[0, 0] == rewards[0, 1]
    groups = {"rewards": rewards, "reward_parts": parts}
    assert grpo.signal_less_groups(groups, args).tolist() == [False, True]
    assert grpo.term_advantages(parts, [1.0, 0.5, 1.0])[0].abs().min() > 0.1
    sums = args_for("--num-samples", "2")  # summed first: both equal
    assert grpo.signal_less_groups(groups, sums).tolist() == [True, True]
    # through the batch: --drop-equal-groups keeps the first group's tokens in the loss
    args.drop_equal_groups = True
    _, prompts, samples, _ = batch_inputs(args)
    batch = grpo.make_batch(prompts[:2], {k: v[:4] for k, v in samples.items()}, rewards, args, reward_parts=parts)
    assert batch["equal_groups"].tolist() == [False, True]
    assert batch["loss_mask"][:2].sum() > 0 and batch["loss_mask"][2:].sum() == 0


def test_a_flag_idle_for_two_reasons_gets_one_note():
    # its idle conditions are declared with it: the first that holds is said, once
    args = grpo.resolve_config(["--demo", "--kl-coef", "0", "--kl-placement", "reward", "--kl-estimator", "k2"])
    assert [n for n in args.notes if n.startswith("--kl-estimator")] == [
        "--kl-estimator does nothing here: the KL's weight is 0 (--kl-coef)"]
