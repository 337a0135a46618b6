"""
Seeing what the policy does and running long: the replies on disk (samples.jsonl, evals/step_N.jsonl), the exact
entropy and its bonus, the learning-rate schedules, the eval length limit, the training states kept on disk, and the
prompt rendering against nanochat's own.
"""
import json
import math
import os

import pytest
import torch

import grpo
import model as model_module
from conftest import Killed
from model import GPT, GPTConfig, Tokenizer
from tasks import build
from test_faults import flags
from test_generations import FIXTURES
from test_grpo import NO_AUTOCAST, args_for, sampled_batch


def lines(path):
    return [json.loads(line) for line in open(path)]


def test_samples_and_eval_replies_are_written_and_a_resume_logs_each_step_once(tmp_path, run_killed_after_first_save):
    argv = flags(tmp_path, "--num-steps", "3", "--save-every", "2", "--eval-every", "2", "--eval-examples", "5",
                 "--final-eval-examples", "6", "--log-samples", "3")
    grpo.main(argv[:argv.index("--run-name") + 1] + ["straight"] + argv[argv.index("--run-name") + 2:])
    straight = tmp_path / "runs" / "straight"
    samples = lines(straight / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    for s in samples:
        assert set(s) == set(grpo.SAMPLE_COLUMNS) and len(s["question"]) == 5 and isinstance(s["reply"], str)
    # a group's best and worst reply side by side, the best first; a group whose rewards are all equal, once
    pairs = 0
    for step in (1, 2, 3):
        rows = [s for s in samples if s["step"] == step]
        if rows[0]["index"] == rows[1]["index"]:
            pairs += 1
            assert rows[0]["reward"] > rows[1]["reward"] and rows[0]["advantage"] >= rows[1]["advantage"]
        else:  # no group of the step had differing rewards
            assert len({s["index"] for s in rows}) == len(rows)
    assert pairs >= 1
    # each reward is the task's grade of the reply beside it, not another reply's of its group (float32, as scored)
    args = grpo.resolve_config(argv)
    task = build(args.task, "train", args)
    assert [s["reward"] for s in samples] == [torch.tensor(task.reward(task[s["index"]], s["reply"])).item()
                                              for s in samples]
    assert sorted(os.listdir(straight / "evals")) == ["step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]
    metrics = lines(straight / "metrics.jsonl")
    for step, n in ((0, 5), (2, 5), (3, 6)):
        replies = lines(straight / "evals" / f"step_{step}.jsonl")
        assert [r["index"] for r in replies] == list(range(n))
        (logged,) = [m for m in metrics if m["step"] == step and "eval_reward" in m]
        assert sum(r["reward"] for r in replies) / n == pytest.approx(logged["eval_reward"])
        assert sum(r["exact"] for r in replies) / n == pytest.approx(logged["eval_exact"])

    run_killed_after_first_save(argv)  # killed right after the step-2 checkpoint: step 3 and its eval are redone
    resumed = tmp_path / "runs" / "base"
    grpo.main(argv + ["--resume"])
    assert (resumed / "samples.jsonl").read_text() == (straight / "samples.jsonl").read_text()
    for name in os.listdir(straight / "evals"):
        assert (resumed / "evals" / name).read_text() == (straight / "evals" / name).read_text()


def test_the_exact_entropy_equals_a_direct_computation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=50, n_layer=2, n_head=2, n_kv_head=1, n_embd=32))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    idx, targets = torch.randint(0, 50, (3, 11)), torch.randint(0, 50, (3, 11))
    logprobs, entropy = model.token_logprobs(idx, targets, temperature=0.7, with_entropy=True, chunk_size=7)
    log_p = torch.log_softmax(model(idx).float() / 0.7, dim=-1)  # [B, T, V], fine at this size
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1), rtol=0, atol=1e-5)
    assert torch.equal(logprobs, model.token_logprobs(idx, targets, temperature=0.7, chunk_size=7))
    # and the update logs its mean over the policy tokens
    args = args_for("--algo", "reinforce", "--temperature", "0.7")
    model, batch = sampled_batch(args)
    mask = batch["loss_mask"]
    with torch.no_grad():
        _, direct = model.token_logprobs(batch["input_ids"], batch["target_ids"], 0.7, with_entropy=True)
    stats, _ = grpo.policy_update(model, [torch.optim.SGD(model.parameters(), lr=0.0)], batch, args, NO_AUTOCAST)
    assert stats["entropy"] == pytest.approx(((direct * mask).sum() / mask.sum()).item(), abs=1e-5)


def entropy_after_updates(coef, steps=5):
    args = args_for("--algo", "reinforce", "--entropy-coef", str(coef), "--optimizer", "adamw", "--lr", "3e-3")
    model, batch = sampled_batch(args)
    batch["advantages"].zero_()  # no policy signal: only the entropy term can move the weights
    optimizers = model_module.make_optimizers(model, args)
    return [grpo.policy_update(model, optimizers, batch, args, NO_AUTOCAST)[0]["entropy"] for _ in range(steps)]


def test_the_entropy_bonus_raises_the_entropy_through_its_gradient():
    with_bonus, without = entropy_after_updates(0.1), entropy_after_updates(0.0)
    assert with_bonus[-1] > with_bonus[0] + 0.01  # not detached: its gradient moved the weights up the entropy
    assert without[0] == without[-1] == with_bonus[0]  # zero advantages and no bonus: no gradient at all


@pytest.mark.parametrize("schedule,expected", [
    ("linear", lambda p: 1 - p), ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))), ("constant", lambda p: 1)])
def test_the_learning_rate_schedules_follow_their_formula(schedule, expected):
    args = args_for("--num-steps", "12", "--lr-schedule", schedule, "--warmup-steps", "2", "--min-lr-frac", "0.1")
    model = GPT(GPTConfig(sequence_len=16, vocab_size=20, n_layer=1, n_head=1, n_kv_head=1, n_embd=8))
    optimizers = model_module.make_optimizers(model, args)
    initial = [g["initial_lr"] for opt in optimizers for g in opt.param_groups]
    for step, multiplier in [(0, 0.5), (1, 1.0)] + [(s, 0.1 + 0.9 * expected((s - 2) / 10)) for s in (2, 5, 7, 11)]:
        assert grpo.set_learning_rates(optimizers, step, args) == pytest.approx(multiplier, abs=1e-12)
        assert [g["lr"] for opt in optimizers for g in opt.param_groups] == pytest.approx(
            [lr * multiplier for lr in initial], abs=0)
    # the defaults are nanochat's linear decay to zero, bit for bit
    default = args_for("--num-steps", "12")
    assert [grpo.lr_multiplier(s, default) for s in range(12)] == [1.0 - s / 12 for s in range(12)]


def test_a_resumed_run_follows_the_schedule(tmp_path, run_killed_after_first_save):
    argv = flags(tmp_path, "--lr-schedule", "cosine", "--warmup-steps", "1", "--min-lr-frac", "0.2",
                 "--save-every", "2")
    grpo.main(argv[:argv.index("--run-name") + 1] + ["straight"] + argv[argv.index("--run-name") + 2:])
    run_killed_after_first_save(argv)
    grpo.main(argv + ["--resume"])
    runs = [[m for m in lines(tmp_path / "runs" / name / "metrics.jsonl") if "reward" in m]
            for name in ("straight", "base")]
    assert [m["lr_multiplier"] for m in runs[1]] == [m["lr_multiplier"] for m in runs[0]]
    assert [m["lr_multiplier"] for m in runs[0]] == [1.0, 1.0, 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 3)),
                                                     0.2 + 0.8 * 0.5 * (1 + math.cos(2 * math.pi / 3))]
    assert [m["loss"] for m in runs[1]] == [m["loss"] for m in runs[0]]


def checkpoint_files(run_dir):
    return sorted(os.listdir(run_dir / "chatrl_checkpoints" / "d2"))


def test_only_the_newest_states_are_kept_and_every_model(tmp_path):
    grpo.main(flags(tmp_path, "--num-steps", "5", "--keep-states", "2"))
    files = checkpoint_files(tmp_path / "runs" / "base")
    assert [f for f in files if f.startswith("state_")] == ["state_000004.pt", "state_000005.pt"]
    assert [f for f in files if f.startswith("model_")] == [f"model_{s:06d}.pt" for s in range(1, 6)]
    grpo.main(flags(tmp_path, "--num-steps", "3", "--keep-states", "0", name="all"))
    assert len([f for f in checkpoint_files(tmp_path / "runs" / "all") if f.startswith("state_")]) == 3


def test_a_kill_while_saving_leaves_the_newest_complete_state(tmp_path, monkeypatch, capsys):
    save = grpo.save_checkpoint

    def killed_writing_model_4(checkpoint_dir, step, *a):
        if step == 4:
            raise Killed  # state_000004.pt is written, its model is not: step 4 is not complete
        save(checkpoint_dir, step, *a)

    monkeypatch.setattr(grpo, "save_checkpoint", killed_writing_model_4)
    argv = flags(tmp_path, "--num-steps", "5", "--keep-states", "1")
    with pytest.raises(Killed):
        grpo.main(argv)
    assert grpo.complete_steps(str(tmp_path / "runs" / "base" / "chatrl_checkpoints" / "d2")) == [3]
    assert [f for f in checkpoint_files(tmp_path / "runs" / "base") if f.startswith("state_")] == [
        "state_000003.pt", "state_000004.pt"]  # the incomplete step-4 state deleted nothing
    monkeypatch.undo()
    grpo.main(argv + ["--resume"])
    assert "resumed from step 3" in capsys.readouterr().out
    assert [f for f in checkpoint_files(tmp_path / "runs" / "base") if f.startswith("state_")] == ["state_000005.pt"]


def test_eval_replies_are_not_cut_at_the_training_limit(tmp_path):
    grpo.main(flags(tmp_path, "--num-steps", "1", "--max-new-tokens", "3", "--eval-max-new-tokens", "7",
                    "--eval-every", "1", "--eval-examples", "8", "--final-eval-examples", "8"))
    replies = lines(tmp_path / "runs" / "base" / "evals" / "step_0.jsonl")
    assert max(r["length"] for r in replies) == 7  # a random model rarely stops: its replies run to the eval limit
    train = lines(tmp_path / "runs" / "base" / "samples.jsonl")
    assert max(s["length"] for s in train) <= 3


@pytest.mark.parametrize("generation", ["classic", "smear-backout"])
def test_prompts_render_as_nanochat_renders_them(generation):
    """nanochat rendered these GSM8K-style prompts itself (the fixtures' chat prompts): the same ids from the text."""
    folder = os.path.join(FIXTURES, generation)
    if not os.path.isdir(folder):
        pytest.skip("nanochat fixtures not found at ../shared/fixtures/nanochat")
    tokenizer = Tokenizer.from_file(os.path.join(folder, "base", "tokenizer", "tokenizer.pkl"))
    reference = torch.load(os.path.join(folder, "reference.pt"), weights_only=True)
    for key in ("prompt_logits", "prompt_greedy", "prompt_logprob"):
        ids = reference[key]
        text = tokenizer.decode(ids[2:-2])  # between <|bos|> <|user_start|> and <|user_end|> <|assistant_start|>
        assert tokenizer.render_for_completion({"messages": [{"role": "user", "content": text}]}) == ids, key


def test_twenty_steps_without_signal_warn_once_and_an_equal_groups_reply_is_logged_once(tmp_path, capsys):
    # every reward 0: every group's replies equal, no update has anything to learn from
    grpo.main(["--demo", "--reward-weights", "reward=0", "--num-steps", "24", "--prompts-per-step", "4",
               "--num-samples", "4", "--max-new-tokens", "4", "--eval-every", "0", "--save-every", "0",
               "--log-samples", "4", "--runs-dir", str(tmp_path), "--run-name", "flat", "--no-plot"])
    warnings = [line for line in capsys.readouterr().out.splitlines() if "no update had anything to learn" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: steps 1-20: in every group all replies got the "
                                                         "same reward (equal groups 1.00, mean reward 0.000)")
    rows = [json.loads(line) for line in open(tmp_path / "flat" / "samples.jsonl")]
    assert len(rows) == 24 * 4 and len({(r["step"], r["index"]) for r in rows}) == len(rows)  # 4 groups, one each


def test_ask_prints_a_checkpoints_replies_graded_when_the_question_is_the_tasks(tmp_path, capsys):
    grpo.main(["--demo", "--num-steps", "2", "--eval-every", "0", "--runs-dir", str(tmp_path), "--run-name", "a",
               "--no-plot", "--prompts-per-step", "8", "--num-samples", "4"])
    checkpoint = str(tmp_path / "a" / "chatrl_checkpoints" / "d2")
    from tasks.sort import Sort
    question = Sort("test")[0]["messages"][0]["content"]
    capsys.readouterr()
    replies = grpo.main(["--demo", "--init", checkpoint, "--ask", question, "--num-samples", "3",
                         "--runs-dir", str(tmp_path), "--run-name", "asked"])
    out = capsys.readouterr().out
    assert len(replies) == 4 and all(reward is not None for _, reward in replies)
    assert "graded as the task's problem" in out and "[greedy, reward " in out and "[sample 3, reward " in out
    assert "several of the task's problems" not in out  # one problem asks it
    assert not os.path.exists(tmp_path / "asked")  # asking writes nothing
    replies = grpo.main(["--demo", "--init", checkpoint, "--ask", "hello?", "--num-samples", "2",
                         "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert [reward for _, reward in replies] == [None] * 3 and "no grade" in out
    assert f"--ask, the policy of {checkpoint}, step 2: " in out  # not "step 0": the checkpoint's own step
    # a question is not a training step: one sampled reply, and a task smaller than a step's questions, will do
    problems = tmp_path / "three.jsonl"
    problems.write_text("".join(json.dumps({"question": f"{n} + 1?", "answer": str(n + 1)}) + "\n" for n in range(3)))
    replies = grpo.main(["--demo", "--init", checkpoint, "--ask", "1 + 1?", "--num-samples", "1", "--task",
                         str(problems), "--runs-dir", str(tmp_path)])
    assert len(replies) == 2


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_run_folders_files_have_the_umasks_mode(tmp_path, umask):
    # as nanochat's own saves and any file a user creates: readable by a teammate, an eval service, nanochat's
    # chat tools under another account, as far as the user's umask allows (a temporary file is created 0600)
    previous = os.umask(umask)
    try:
        grpo.main(flags(tmp_path, "--num-steps", "1", "--eval-every", "1", "--eval-examples", "2", "--final-eval-examples",
                        "2"))
    finally:
        os.umask(previous)
    modes = {str(path.relative_to(tmp_path)): path.stat().st_mode & 0o777
             for path in (tmp_path / "runs").rglob("*") if path.is_file()}
    assert len(modes) >= 8 and modes == {path: 0o666 & ~umask for path in modes}, modes


def test_a_run_of_this_program_starts_another_with_its_optimizer_version(tmp_path, capsys):
    # a demo run (from scratch: nanochat's newest optimizer, v5) as the start of another: --init takes its run
    # folder, as --teacher does, and its recorded optimizer version, not the one of its GPT generation (v2)
    grpo.main(flags(tmp_path, "--num-steps", "1", name="first"))
    capsys.readouterr()
    grpo.main(flags(tmp_path, "--num-steps", "1", "--init", str(tmp_path / "runs" / "first"), name="second"))
    assert "version v5 (the start checkpoint's, as its meta records)" in capsys.readouterr().out
    assert json.load(open(tmp_path / "runs" / "second" / "config.json"))["optimizer_version"] == "v5"


def test_an_evaluation_builds_no_optimizer_reference_or_teacher_and_plans_no_training_step(tmp_path, monkeypatch,
                                                                                            capsys):
    # --eval-only and --ask read the policy and sample: a step's memory plan (which could refuse an eval that fits),
    # the optimizers and the KL's reference are not theirs
    run = ["--demo", "--algo", "grpo", "--eval-every", "2", "--eval-examples", "8", "--final-eval-examples", "8",
           "--pass-k", "0", "--runs-dir", str(tmp_path), "--run-name", "a", "--prompts-per-step", "8", "--num-samples", "4"]
    grpo.main(run + ["--num-steps", "2", "--no-plot"])
    final = lines(tmp_path / "a" / "metrics.jsonl")[-1]
    replies = lines(tmp_path / "a" / "evals" / "step_2.jsonl")
    capsys.readouterr()

    def not_for_an_evaluation(*args, **kwargs):
        raise AssertionError("built for an evaluation")
    for name in ("make_optimizers", "plan_memory", "frozen"):
        monkeypatch.setattr(grpo, name, not_for_an_evaluation)
    resumed = grpo.main(run + ["--num-steps", "2", "--resume", "--eval-only"])  # the weights alone, of the last step
    assert resumed["eval_reward"] == final["eval_reward"] and resumed["eval_examples"] == 8
    assert lines(tmp_path / "a" / "evals" / "step_2.jsonl") == replies
    checkpoint = str(tmp_path / "a" / "chatrl_checkpoints" / "d2")
    grpo.main(["--demo", "--algo", "grpo", "--init", checkpoint, "--eval-only", "--final-eval-examples", "4",
               "--runs-dir", str(tmp_path), "--run-name", "e"])
    grpo.main(["--demo", "--algo", "grpo", "--init", checkpoint, "--ask", "3 1 2", "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "memory plan" not in out and "optimizer:" not in out


def test_a_runs_first_screen_is_the_flags_given_and_the_plans_peak_then_step_1(tmp_path, capsys):
    # every setting stays in config.json; --show-config prints them, and each part of the memory plan
    flags = ["--demo", "--num-steps", "1", "--eval-every", "0", "--runs-dir", str(tmp_path), "--no-plot",
             "--prompts-per-step", "8", "--num-samples", "4"]
    grpo.main(flags + ["--run-name", "short"])
    before_step = capsys.readouterr().out.split("step 1/1")[0].splitlines()
    assert len(before_step) <= 5, before_step  # threads, settings, the plan's peak, the optimizer
    assert any(line.startswith("settings: --demo --num-steps 1 --eval-every 0 --runs-dir") for line in before_step)
    assert any(line.startswith("memory plan per rank: peak ") for line in before_step)
    assert json.load(open(tmp_path / "short" / "config.json"))["sapo_tau_neg"] == 1.05  # every setting kept
    grpo.main(flags + ["--run-name", "full", "--show-config"])
    out = capsys.readouterr().out
    assert "configuration:\n" in out and "  sapo_tau_neg = 1.05\n" in out and "\n  peak  " in out
