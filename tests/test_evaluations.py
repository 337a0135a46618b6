"""
--ask and --eval-only read the run they are pointed at: its task and sampling settings from its config.json, unless
a flag says otherwise; --ask prints its answer and the lines it rests on; every eval shows its progress in a log.
"""
import json
import os
import shutil

import pytest

import grpo
from tasks.sort import Sort
from test_faults import flags, snapshot

# settings that differ from the demo's own, so that a tool that ignores the run is caught
RUN = ["--sort-length", "4", "--seed", "3", "--top-k", "5", "--temperature", "0.9", "--eval-max-new-tokens", "6",
       "--pass-k", "2", "--num-samples", "3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One step of a demo run with RUN's settings -> (its folder, its checkpoints' folder)."""
    w = tmp_path_factory.mktemp("trained")
    grpo.main(flags(w, "--num-steps", "1", *RUN, name="sorted4"))
    run = w / "runs" / "sorted4"
    return run, run / "chatrl_checkpoints" / "d2"


@pytest.fixture(autouse=True)
def no_gsm8k(tmp_path, monkeypatch):
    """GSM8K, the flags' default task, is nowhere: a tool that falls back to it stops at once, never downloads."""
    (tmp_path / "no-gsm8k").mkdir()
    monkeypatch.setenv("NANOGRPO_GSM8K_DIR", str(tmp_path / "no-gsm8k"))


def test_an_evaluation_reads_the_task_and_sampling_of_the_run_it_is_pointed_at(trained, tmp_path):
    run, checkpoint = trained
    for init in (run, checkpoint):
        args = grpo.resolve_config(["--init", str(init), "--eval-only"])
        assert (args.task, args.sort_length, args.seed, args.top_k, args.temperature, args.eval_max_new_tokens,
                args.pass_k, args.num_samples) == ("sort", 4, 3, 5, 0.9, 6, 2, 3)
        assert args.algo == "reinforce" and args.depth == 4  # what made the weights is the checkpoint's, not read
        assert args.run_settings == (os.path.join(str(run), "config.json"), {})
    # a flag given wins, and is named
    args = grpo.resolve_config(["--init", str(checkpoint), "--ask", "1234", "--top-k", "7"])
    assert args.top_k == 7 and args.temperature == 0.9 and args.run_settings[1] == {"top_k": (5, 7)}
    # a checkpoint without its run folder: the flags' defaults
    shutil.copytree(checkpoint, tmp_path / "elsewhere" / "d2")
    args = grpo.resolve_config(["--init", str(tmp_path / "elsewhere" / "d2"), "--eval-only"])
    assert (args.task, args.top_k, args.eval_max_new_tokens, args.run_settings) == ("gsm8k", 50, 512, None)


def test_ask_answers_in_the_runs_settings_with_a_few_lines(trained, capsys):
    run, checkpoint = trained
    problem = Sort("test", length=4, seed=3)[0]  # the run's test problems: its length and seed
    before = snapshot(run)
    capsys.readouterr()
    replies = grpo.main(["--init", str(run), "--ask", problem["messages"][0]["content"], "--temperature", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    assert len(replies) == 1 + 3 and all(reward is not None for _, reward in replies)  # graded: one of its problems
    assert lines[0] == (f"--ask, the policy of {checkpoint}, step 1: graded as the task's problem (its answer: "
                        f"{problem['messages'][-1]['content']})")
    assert lines[1].startswith("--ask: task sort, greedy and 3 sampled replies (--temperature 0.5 --top-k 5) up to 6 "
                               "tokens") and lines[1].endswith("; --temperature 0.5 given here, the run's 0.9")
    assert len(lines) == 2 + len(replies) and lines[2].startswith("[greedy, reward ")  # no configuration
    assert snapshot(run) == before


def test_ask_from_random_weights_says_so_on_its_first_line(tmp_path, capsys):
    capsys.readouterr()
    grpo.main(["--demo", "--ask", "31415", "--runs-dir", str(tmp_path / "runs"), "--eval-max-new-tokens", "4",
               "--max-new-tokens", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("--ask, random weights (--init scratch: an untrained model; --init <run folder> "
                               "evaluates a trained one)")
    assert "note: --max-new-tokens does nothing here: an evaluation's replies are --eval-max-new-tokens long" in lines
    assert not os.path.exists(tmp_path / "runs")


def test_eval_only_of_a_resumed_run_needs_none_of_its_flags_and_takes_eval_examples(trained, tmp_path, monkeypatch,
                                                                                    capsys):
    run, _ = trained
    shutil.copytree(run, tmp_path / "runs" / "sorted4")
    capsys.readouterr()
    result = grpo.main(["--eval-only", "--resume", "--runs-dir", str(tmp_path / "runs"), "--run-name", "sorted4",
                        "--eval-examples", "70"])
    out = capsys.readouterr().out
    assert result["eval_examples"] == 70 and "eval_pass@2" in result  # the run's --pass-k
    assert "--eval-only: 32/70 problems (" in out and "s left)" in out  # after the first batch
    assert [json.loads(line)["step"] for line in open(tmp_path / "runs" / "sorted4" / "eval_only.jsonl")] == [1]
    # both counts given: the final eval's counts, and a note says so
    args = grpo.resolve_config(["--init", str(run), "--eval-only", "--eval-examples", "5", "--final-eval-examples",
                                "9"])
    assert args.final_eval_examples == 9 and any(n.startswith("--eval-examples does nothing here") for n in args.notes)


def test_a_periodic_eval_shows_its_progress_in_a_log(tmp_path, monkeypatch, capsys):
    # a line after the first batch (32 problems), then one every PROGRESS_SECONDS: here every batch but the last,
    # whose line is the result's
    monkeypatch.setattr(grpo, "PROGRESS_SECONDS", 0, raising=False)
    capsys.readouterr()
    grpo.main(flags(tmp_path, "--num-steps", "1", "--eval-every", "1", "--eval-examples", "40", "--final-eval-examples",
                    "100", name="watched"))
    out = capsys.readouterr().out
    assert "step 0 eval: 32/40 problems (" in out and "40/40" not in out
    assert all(f"step 1 eval: {n}/100 problems (" in out for n in (32, 64, 96)) and "100/100" not in out
