"""
Errors name the real cause first: a wrong input says so whatever the run folder holds; a run stopped by a user's
grader before its first step leaves nothing in the retry's way; a longer --resume says how to train further; a flag
that does nothing under the other flags gets a note.
"""
import json

import pytest

import grpo
from test_faults import flags, snapshot


@pytest.mark.parametrize("extra,name,missing", [
    (["--init", "{w}/typo"], "demo-grpo-seed0", "typo"),
    (["--algo", "distill", "--teacher", "{w}/typo"], "demo-distill-seed0", "typo"),
    (["--task", "{w}/problems.jsonl", "--task-test", "{w}/typo.jsonl"], "demo-problems-grpo-seed0", "typo.jsonl"),
])
def test_a_wrong_input_is_named_before_the_run_folder_that_exists(tmp_path, extra, name, missing):
    (tmp_path / "problems.jsonl").write_text("".join(json.dumps({"question": f"{i} + 1", "answer": str(i + 1)}) + "\n"
                                                     for i in range(20)))
    run = tmp_path / "runs" / name  # an earlier run under the default name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_reward": 0.5}) + "\n")
    (run / ".lock").touch()  # (every run folder holds its lock file)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as stop:
        grpo.main(["--demo", "--runs-dir", str(tmp_path / "runs"), *[e.format(w=tmp_path) for e in extra]])
    message = stop.value.code
    assert isinstance(message, str) and message.startswith("error: ") and missing in message, message
    assert snapshot(tmp_path) == before


FAILING_GRADER = "def grade(question, reply, answer):\n    return 1 / 0\n"


def test_a_grader_that_fails_before_the_first_step_leaves_nothing_in_the_retrys_way(tmp_path):
    (tmp_path / "problems.jsonl").write_text("".join(json.dumps({"question": f"{i} + 1", "answer": str(i + 1)}) + "\n"
                                                     for i in range(20)))
    (tmp_path / "grader.py").write_text(FAILING_GRADER)
    argv = flags(tmp_path, "--task", str(tmp_path / "problems.jsonl"), "--grader", f"{tmp_path / 'grader.py'}:grade",
                 "--num-steps", "1", name="graded")
    for _ in range(2):  # the same command again meets the same error, not the folder the first one left
        with pytest.raises(SystemExit) as stop:
            grpo.main(argv)
        assert stop.value.code.startswith("error: --grader ") and "raised ZeroDivisionError" in stop.value.code
        assert stop.value.code.endswith("The run stopped before its first step, and its files are removed: fix the "
                                        "function, then run the command again")
        assert not (tmp_path / "runs" / "graded").exists()


def test_a_longer_resume_says_how_to_train_further(tmp_path):
    argv = flags(tmp_path, "--num-steps", "1", name="short")
    grpo.main(argv)
    before = snapshot(tmp_path / "runs")
    with pytest.raises(SystemExit) as stop:
        grpo.main(argv + ["--resume", "--num-steps", "3"])
    checkpoint = tmp_path / "runs" / "short" / "chatrl_checkpoints" / "d2"
    assert stop.value.code == (
        "error: --resume --num-steps 3: the run's schedule is 1 steps (its learning rate schedule ends there), and a "
        "resumed run keeps it; to train further, start a new run from its newest checkpoint (a fresh optimizer state "
        f"and schedule): --init {checkpoint} --run-name <another> --num-steps <the steps to add>")
    assert snapshot(tmp_path / "runs") == before


@pytest.mark.parametrize("given,idle", [
    (["--algo", "reinforce", "--clip-eps", "0.1"], "--clip-eps"), (["--algo", "grpo", "--clip-eps", "0.1"], None),
    (["--algo", "rloo", "--clip-eps-high", "0.3"], "--clip-eps-high"),
    (["--algo", "reinforce", "--clip-ratio-c", "3"], "--clip-ratio-c"),
    (["--algo", "reinforce", "--ppo-epochs", "2", "--clip-eps", "0.1"], None),
    (["--kl-placement", "reward", "--kl-estimator", "k2"], "--kl-estimator"), (["--kl-estimator", "k2"], None),
    (["--lr-schedule", "constant", "--min-lr-frac", "0.1"], "--min-lr-frac"), (["--min-lr-frac", "0.1"], None),
    (["--init-step", "3"], "--init-step"), (["--model-tag", "d20"], "--model-tag"),
    (["--gsm8k-dir", "data"], "--gsm8k-dir"), (["--sort-length", "4"], None),
    (["--ask", "123", "--max-new-tokens", "9"], "--max-new-tokens"), (["--max-new-tokens", "9"], None),
    (["--eval-only", "--num-samples", "4"], "--num-samples"), (["--ask", "123", "--num-samples", "4"], None),
    (["--ask", "123", "--pass-k", "2"], "--pass-k"), (["--ask", "123", "--final-eval-examples", "9"],
                                                      "--final-eval-examples"),
    (["--eval-every", "0", "--eval-examples", "9"], "--eval-examples"), (["--eval-examples", "9"], None),
    (["--ref-offload"], "--ref-offload"), (["--threads", "1"], None),
    (["--shard-optimizer"], "--shard-optimizer"), (["--dist-timeout", "60"], "--dist-timeout"),
    (["--compare-out", "x.png"], "--compare-out"),
])
def test_a_flag_that_does_nothing_here_gets_its_note(given, idle):
    notes = grpo.resolve_config(["--demo", *given]).notes  # (a CPU run of one process)
    assert [note.split()[0] for note in notes] == ([idle] if idle else []), notes
