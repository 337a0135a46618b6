"""On-policy distillation (--distill-coef, --teacher, --algo distill): the term against its definition, the teacher's
log-probs on the update's passes, and the checks around the teacher (its tokenizer, its folder, --resume)."""
import copy
import os
import pickle

import pytest
import torch

import grpo
import model as model_module
from model import GPT, GPTConfig, save_checkpoint
from test_generations import FIXTURES, random_model
from test_grpo import NO_AUTOCAST, TOK, GradRecorder, args_for, run_flags, sampled_batch


def distill_args(*flags):
    """--algo distill with the sampled term, unless the flags name another"""
    return args_for("--algo", "distill", "--teacher", "unused", "--distill-divergence", "sampled", *flags)


def other_model(seed=1):
    """A teacher of another shape than the test batches' policy (3 layers of 48, 4 heads), the same tokenizer."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(sequence_len=64, vocab_size=TOK.vocab_size, n_layer=3, n_head=4, n_kv_head=4, n_embd=48))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return grpo.frozen(model, False, False)


def test_a_teacher_equal_to_the_policy_teaches_nothing():
    # log pi_teacher - log pi_old = 0 at every token: the step is the one on a zero gradient (no teacher, no advantage)
    args = distill_args()
    model, batch = sampled_batch(args)
    recorder = GradRecorder(model)
    stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST, teacher=grpo.frozen(
        copy.deepcopy(model), False, False))
    assert stats["teacher_kl"] == 0 and all(not g.any() for g in recorder.grads[0])
    taught, untaught = copy.deepcopy(model), copy.deepcopy(model)
    grpo.policy_update(taught, model_module.make_optimizers(taught, args), batch, args, NO_AUTOCAST,
                       teacher=grpo.frozen(copy.deepcopy(model), False, False))
    stats, _ = grpo.policy_update(untaught, model_module.make_optimizers(untaught, args), batch, args, NO_AUTOCAST)
    assert stats["no_signal_updates"] == args.ppo_epochs and not batch["advantages"].any()  # --advantage none: 0
    for (name, a), b in zip(taught.state_dict().items(), untaught.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_distillation_gradient_is_the_per_token_reverse_kl_policy_gradient():
    # d/dtheta of E_{o ~ pi_theta} sum_t KL_t, one sample, discount 0: -(1/|tokens|) sum_t (log pi_T - log pi_theta)(o_t)
    # grad log pi_theta(o_t), the log-ratio held fixed; in float64, on the trainer's packed passes
    args = distill_args("--distill-coef", "0.7")
    model, batch = sampled_batch(args)
    model.double()
    teacher = other_model().double()
    recorder = GradRecorder(model)
    stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST, teacher=teacher)
    ids, targets, mask = batch["input_ids"], batch["target_ids"], batch["loss_mask"].double()
    logprobs = model.token_logprobs(ids, targets)
    with torch.no_grad():
        teacher_logprobs = teacher.token_logprobs(ids, targets)
    log_ratio = (teacher_logprobs - logprobs.detach()) * mask
    loss = -(0.7 * log_ratio * logprobs * mask).sum() / mask.sum()
    expected = torch.autograd.grad(loss, list(model.parameters()))
    assert max((g - e).abs().max().item() for g, e in zip(recorder.grads[0], expected)) < 1e-10
    assert abs(stats["teacher_kl"] - (-log_ratio.sum() / mask.sum()).item()) < 1e-10
    assert sum(e.abs().sum() for e in expected) > 1e-3  # a real gradient


def test_reward_and_teacher_teach_together_as_the_sum_of_their_gradients():
    # --distill-coef beside a task reward: the advantage is the reply's group advantage plus the teacher's per-token
    # term, so the gradient is the sum of the two runs' gradients
    base = ["--algo", "reinforce", "--aggregation", "token"]
    teacher = other_model().double()
    grads = []
    for flags, with_teacher in ((["--distill-coef", "0.5", "--teacher", "unused"], True), ([], False),
                                (["--advantage", "none", "--distill-coef", "0.5", "--teacher", "unused"], True)):
        args = args_for(*base, *flags)
        model, batch = sampled_batch(args)
        recorder = GradRecorder(model.double())
        grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST, teacher=teacher if with_teacher else None)
        grads.append(recorder.grads[0])
    both, reward, taught = grads
    assert max((b - r - t).abs().max().item() for b, r, t in zip(both, reward, taught)) < 1e-10


@pytest.mark.parametrize("generation", ["lambdas-windows", "smear-backout"])
def test_teacher_logprobs_packed_equal_padded(generation):
    # the teacher (another generation, depth and width, its windows acting) takes the student's packed passes
    teacher = grpo.frozen(random_model(generation, sequence_len=16).double(), False, False)
    logprobs = {}
    for pack in ("--pack", "--no-pack"):
        args = distill_args(pack)
        _, batch = sampled_batch(args)
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
        for mb, lp in zip(batch["micro_batches"], grpo.frozen_logprobs(teacher, batch["micro_batches"], args,
                                                                       NO_AUTOCAST)):
            out[mb["rows"], :lp.size(1)] = lp * mb["loss_mask"]
        logprobs[pack] = out
    assert logprobs["--pack"].abs().sum() > 0
    assert (logprobs["--pack"] - logprobs["--no-pack"]).abs().max() < 1e-10


def teacher_folder(root, seed=1, tokenizer=TOK):
    """A checkpoint folder as nanochat lays one out (<base>/chatsft_checkpoints/d3, <base>/tokenizer/tokenizer.pkl)
    holding other_model(seed)."""
    folder = root / "base" / "chatsft_checkpoints" / "d3"
    model = other_model(seed)
    save_checkpoint(str(folder), 5, model, {"model_config": vars(model.config)})
    (root / "base" / "tokenizer").mkdir(exist_ok=True)
    (root / "base" / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(tokenizer.enc))
    return folder


def distill_run(tmp_path, name, teacher, *extra):
    return run_flags(tmp_path, name, "--algo", "distill", "--teacher", str(teacher), *extra)


def test_a_distilled_run_logs_the_teacher_and_resumes_only_with_the_same_one(tmp_path, capsys,
                                                                           run_killed_after_first_save):
    teacher = teacher_folder(tmp_path)
    flags = distill_run(tmp_path, "taught", teacher, "--num-steps", "2", "--save-every", "1", "--eval-every", "1",
                        "--eval-examples", "8")
    run_killed_after_first_save(flags + ["--show-config"])  # the memory plan's parts: the teacher's among them
    out = capsys.readouterr().out
    assert f"teacher: {teacher}, step 5" in out and "teacher kl" in out and "teacher_eval_reward" in out
    plan_line = next(line for line in out.splitlines() if line.strip().startswith("teacher model"))  # counted
    assert plan_line.split()[-2] != "0.0"
    teacher_folder(tmp_path, seed=2)  # other weights in the same folder, at the same step
    with pytest.raises(SystemExit, match=r"^error: --resume: the run's teacher \(--teacher's checkpoint\) changed"):
        grpo.main(flags + ["--resume"])
    teacher_folder(tmp_path)  # the original back
    grpo.main(flags + ["--resume"])
    assert "resumed from step 1" in capsys.readouterr().out


def test_a_missing_teacher_or_one_with_another_tokenizer_ends_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as stop:
        grpo.main(distill_run(tmp_path, "none", tmp_path / "nowhere", "--num-steps", "1"))
    assert str(stop.value.code).startswith("error: --teacher: no model_<step>.pt") and "\n" not in stop.value.code
    assert not os.path.exists(tmp_path / "none" / "metrics.jsonl")
    present = teacher_folder(tmp_path / "present")
    with pytest.raises(SystemExit, match=r"^error: --teacher-step 7: .* holds steps \[5\]$"):
        grpo.main(distill_run(tmp_path, "step", present, "--teacher-step", "7", "--num-steps", "1"))
    other = copy.deepcopy(TOK.enc)
    other._mergeable_ranks = dict(other._mergeable_ranks)
    other._mergeable_ranks[b"ab"] = 999  # a merge the policy's tokenizer does not have
    teacher = teacher_folder(tmp_path, tokenizer=type("T", (), {"enc": other}))
    with pytest.raises(SystemExit) as stop:
        grpo.main(distill_run(tmp_path, "mismatch", teacher, "--num-steps", "1"))
    message = str(stop.value.code)
    assert message.startswith("error: --teacher's tokenizer (") and "tokenizer.pkl" in message
    assert "the byte-level one of --init scratch" in message and "\n" not in message


@pytest.mark.skipif(not os.path.isdir(FIXTURES), reason="nanochat fixtures not present")
def test_a_nanochat_teacher_with_its_own_tokenizer_is_refused_for_a_byte_level_student(tmp_path):
    teacher = os.path.join(FIXTURES, "classic", "base", "chatsft_checkpoints", "d4")
    with pytest.raises(SystemExit, match=r"^error: --teacher's tokenizer \(.*classic/base/tokenizer/tokenizer.pkl\)"):
        grpo.main(distill_run(tmp_path, "mismatch", teacher, "--num-steps", "1"))


@pytest.mark.parametrize("flags, message", [
    (["--algo", "distill"], "--algo distill needs a teacher"),
    (["--distill-coef", "0.5"], "--distill-coef 0.5 needs a teacher"),
    (["--algo", "grpo", "--teacher", "t"], "--teacher is read only with --distill-coef > 0"),
    (["--algo", "gspo", "--distill-coef", "1", "--teacher", "t"], "use --ratio-level token"),
    (["--algo", "distill", "--distill-coef", "0"], "nothing would teach the policy"),
    (["--algo", "distill", "--teacher", "t", "--distill-coef", "0"], "--teacher is read only with"),
    (["--algo", "distill", "--teacher", "t", "--distill-coef", "-1"], "--distill-coef must be >= 0"),
])
def test_distillation_flags_that_cannot_work_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo.resolve_config(["--demo", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_distill_preset():
    args = grpo.resolve_config(["--demo", "--algo", "distill", "--teacher", "t"])
    assert (args.advantage, args.aggregation, args.ppo_epochs, args.kl_coef, args.distill_coef, args.entropy_coef,
            args.distill_divergence) == ("none", "token", 2, 0.0, 1.0, 0.0, "forward")
    assert grpo.resolve_config(["--demo"]).distill_coef == 0.0
    beside = grpo.resolve_config(["--demo", "--distill-coef", "0.1", "--teacher", "t"])  # beside the reward
    assert beside.distill_divergence == "sampled"


def test_a_presets_reward_filters_stay_off_with_a_teacher():
    # dapo leaves equal groups and cut-off replies out of the loss, for the reward's sake; the teacher scores every
    # token of those too (82-84% of a random student's replies are cut off)
    args = grpo.resolve_config(["--demo", "--algo", "dapo", "--distill-coef", "0.1", "--teacher", "t"])
    assert not args.drop_equal_groups and not args.mask_truncated and args.dynamic_sampling
    assert any("--drop-equal-groups and --mask-truncated stay off with a teacher" in n for n in args.notes)
    kept = grpo.resolve_config(["--demo", "--algo", "dapo", "--distill-coef", "0.1", "--teacher", "t",
                                "--drop-equal-groups"])
    assert kept.drop_equal_groups and not kept.mask_truncated
    alone = grpo.resolve_config(["--demo", "--algo", "dapo"])
    assert alone.drop_equal_groups and alone.mask_truncated and alone.notes == []


def hand_written_forward_kl(model, teacher, batch, k):
    """KL(pi_teacher || pi_theta) at every loss position of the batch, written out from the full distributions in
    float64: the teacher's k likeliest tokens, and one bucket for the rest of each distribution's mass -> [N, T]."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    student = model.logits(model.hidden(ids)).log_softmax(-1)  # [N, T, V]
    with torch.no_grad():
        teacher_p = teacher.logits(teacher.hidden(ids)).log_softmax(-1)
    top, top_ids = teacher_p.topk(min(k, teacher_p.size(-1)), dim=-1)
    kl = (top.exp() * (top - student.gather(-1, top_ids))).sum(-1)
    if k < teacher_p.size(-1):
        outside = torch.ones_like(teacher_p, dtype=torch.bool).scatter(-1, top_ids, False)
        rest_t = torch.where(outside, teacher_p.exp(), 0).sum(-1)
        rest_s = torch.where(outside, student.exp(), 0).sum(-1)
        kl = kl + rest_t * (rest_t.log() - rest_s.log())
    return kl * mask


@pytest.mark.parametrize("k", [5, 1000])  # 1000 > the vocabulary: the whole distribution, the exact KL
def test_the_forward_kl_gradient_is_the_hand_written_one(k):
    args = distill_args("--distill-divergence", "forward", "--distill-top-k", str(k), "--distill-coef", "0.7")
    model, batch = sampled_batch(args)
    model.double()
    teacher = other_model().double()
    recorder = GradRecorder(model)
    stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST, teacher=teacher)
    kl = hand_written_forward_kl(model, teacher, batch, k)
    mask = batch["loss_mask"]
    expected = torch.autograd.grad(0.7 * kl.sum() / mask.sum(), list(model.parameters()))  # token aggregation
    assert max((g - e).abs().max().item() for g, e in zip(recorder.grads[0], expected)) < 1e-10
    assert abs(stats["teacher_kl"] - (kl.sum() / mask.sum()).item()) < 1e-10
    assert sum(e.abs().sum() for e in expected) > 1e-3 and stats["teacher_kl"] > 0.01
    if k > TOK.vocab_size:  # every token: the exact KL, sum_v p_T log(p_T / p_theta), no bucket
        ids = batch["input_ids"]
        with torch.no_grad():
            student = model.logits(model.hidden(ids)).log_softmax(-1)
            teacher_p = teacher.logits(teacher.hidden(ids)).log_softmax(-1)
        exact = (teacher_p.exp() * (teacher_p - student)).sum(-1) * mask
        torch.testing.assert_close(kl.detach(), exact, rtol=0, atol=1e-12)


def test_the_teachers_top_k_and_its_rest_hold_all_of_its_mass_packed_as_padded():
    teacher = grpo.frozen(random_model("smear-backout", sequence_len=16).double(), False, False)
    tops = {}
    for pack in ("--pack", "--no-pack"):
        args = distill_args("--distill-divergence", "forward", "--distill-top-k", "7", pack)
        _, batch = sampled_batch(args)
        out = torch.zeros(batch["input_ids"].shape + (8,), dtype=torch.float64)
        for mb in batch["micro_batches"]:
            top = grpo.teacher_top_logprobs(teacher, mb, args)
            values, rest = top["logprobs"]  # [R, width, 7], [R, width]
            mass = torch.cat([values.exp(), rest.exp()[..., None]], -1) * mb["loss_mask"][..., None]
            out[mb["rows"], :values.size(1)] = mass
        tops[pack] = out
        kept = batch["loss_mask"] > 0
        assert torch.allclose(out.sum(-1)[kept], torch.ones(int(kept.sum()), dtype=torch.float64), atol=1e-12)
    assert (tops["--pack"] - tops["--no-pack"]).abs().max() < 1e-12


def test_a_teacher_equal_to_the_policy_gives_no_forward_kl_and_no_gradient():
    args = distill_args("--distill-divergence", "forward", "--distill-top-k", "5")
    model, batch = sampled_batch(args)
    model.double()
    recorder = GradRecorder(model)
    stats, _ = grpo.policy_update(model, [recorder], batch, args, NO_AUTOCAST,
                                  teacher=grpo.frozen(copy.deepcopy(model), False, False))
    assert abs(stats["teacher_kl"]) < 1e-12 and max(g.abs().max().item() for g in recorder.grads[0]) < 1e-12


def test_the_memory_plan_counts_the_teachers_top_k():
    # ids (int64) and log-probs of k tokens, and the rest's log-mass, at every reply token of the rank's step
    teacher = other_model()
    plans = {}
    for divergence in ("forward", "sampled"):
        args = distill_args("--distill-divergence", divergence, "--distill-top-k", "16")
        model, _ = sampled_batch(args)
        plans[divergence] = grpo.memory_plan(model, args, 1, 9, "float32", teacher=teacher)
    key = "update: the teacher's top-k of the step's reply tokens"
    assert plans["forward"][key] == args.prompts_per_step * args.num_samples * args.max_new_tokens * (12 * 16 + 4)
    assert key not in plans["sampled"]
