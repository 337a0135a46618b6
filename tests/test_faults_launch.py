"""
Faults from schedulers, torchrun and long runs: odd folder names, signals, a killed launcher, a stuck rank, inputs
that changed between stop and resume, devices that do not exist, runs killed before their first checkpoint, copies of
a run in --compare, and evaluating someone's checkpoint more than once.
"""
import glob
import hashlib
import io
import json
import os
import pickle
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time

import pytest
import tiktoken
import torch

import grpo
import model as model_module
from conftest import ROOT, Killed, assert_same_steps, free_port
from model import SPECIAL_TOKENS
from test_faults import GOOD_ROW, final_weights, flags, snapshot
from test_distill import distill_run, teacher_folder
from test_grpo import in_this_process
from tasks.sort import Sort


def wait_for(condition, seconds, what):
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


def train_lines(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return [m for m in map(json.loads, open(path)) if "reward" in m] if os.path.isfile(path) else []


def test_a_run_named_with_glob_characters_resumes(tmp_path, run_killed_after_first_save):
    runs = tmp_path / "r[u]ns*"
    argv = flags(tmp_path, "--runs-dir", str(runs), "--num-steps", "2", "--save-every", "1", name="b[1]")
    grpo.main(flags(tmp_path, "--runs-dir", str(runs), "--num-steps", "2", "--save-every", "1", name="straight"))
    run_killed_after_first_save(argv)
    grpo.main(argv + ["--resume"])
    for (k, a), b in zip(final_weights(runs / "straight", 2).items(), final_weights(runs / "b[1]", 2).values()):
        assert torch.equal(a, b), k
    # a start checkpoint in such a folder loads too
    result = grpo.main(flags(tmp_path, "--init", str(runs / "b[1]" / "chatrl_checkpoints" / "d2"), "--eval-only",
                             "--final-eval-examples", "4", name="eval"))
    assert result["eval_examples"] == 4


def test_an_interrupt_in_a_glob_named_run_names_its_checkpoint(tmp_path, monkeypatch):
    save = grpo.save_training_state

    def save_then_ctrl_c(run_dir, tag, step, *a):
        save(run_dir, tag, step, *a)
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "save_training_state", save_then_ctrl_c)
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(flags(tmp_path, name="x[0]"))
    assert exit_info.value.code.startswith("error: interrupted. The run's newest checkpoint, step 1 in ")


def script(tmp_path, name, *extra):
    return [sys.executable, os.path.join(ROOT, "grpo.py"), *flags(tmp_path, "--num-steps", "100000", *extra, name=name)]


class SignalHalfWay:
    """A file being written whose first write sends this process a signal half-way through its bytes: Python runs
    the handler right there, between the two halves, as when a scheduler's SIGTERM lands mid-write."""

    def __init__(self, f, sig):
        self.f, self.sig = f, sig

    def write(self, data):
        if self.sig is None:
            return self.f.write(data)
        half = len(data) // 2
        written = self.f.write(data[:half])
        os.kill(os.getpid(), self.sig)
        self.sig = None
        return written + self.f.write(data[half:])

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


def signal_in_write(monkeypatch, file_name, nth, sig):
    """The nth write of a file called file_name (atomic_save's temporary file, or an append) is a SignalHalfWay."""
    count = {"writes": 0}

    def hit(path):
        count["writes"] += os.path.basename(path) == file_name
        return os.path.basename(path) == file_name and count["writes"] == nth

    atomic_save, fdopen = model_module._atomic_save, os.fdopen

    def atomic_save_hooked(obj, path):
        if not hit(path):
            return atomic_save(obj, path)
        with monkeypatch.context() as patched:  # atomic_save writes through the file os.fdopen gives it
            patched.setattr(os, "fdopen", lambda *a, **k: SignalHalfWay(fdopen(*a, **k), sig))
            return atomic_save(obj, path)

    def open_hooked(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        return SignalHalfWay(f, sig) if "a" in mode and hit(path) else f

    monkeypatch.setattr(model_module, "_atomic_save", atomic_save_hooked)
    monkeypatch.setattr(grpo, "open", open_hooked, raising=False)


# each file of the run folder, at a write after the first checkpoint where there is one (metrics.jsonl: its empty
# start, the step-0 eval, step 1, step 2; samples.jsonl: its start, step 1, step 2)
WRITES = [("state_000002.pt", 1, signal.SIGTERM), ("model_000002.pt", 1, signal.SIGINT),
          ("meta_000002.json", 1, signal.SIGHUP), ("config.json", 1, signal.SIGTERM),
          ("tokenizer.pkl", 1, signal.SIGINT), ("metrics.jsonl", 4, signal.SIGHUP),
          ("samples.jsonl", 3, signal.SIGTERM), ("step_2.jsonl", 1, signal.SIGINT),
          ("curves.png", 1, signal.SIGHUP)]


# evals of 4 and 6 problems: a resumed eval that takes the other count (or other problems) reads other replies
STRAIGHT = ["--num-steps", "3", "--eval-every", "2", "--eval-examples", "4", "--final-eval-examples", "6"]


@pytest.fixture(scope="module")
def straight_folder(tmp_path_factory):
    """A run of 3 steps with evals at steps 0, 2 and 3, never stopped."""
    root = tmp_path_factory.mktemp("straight")
    grpo.main(flags(root, *STRAIGHT, name="straight"))
    return root / "runs" / "straight"


@pytest.fixture(scope="module")
def straight_run(straight_folder):
    return final_weights(straight_folder, 3)


@pytest.mark.parametrize("file_name,nth,sig", WRITES, ids=[w[0] for w in WRITES])
@pytest.mark.xdist_group("straight_run")  # pytest -n: the module's fixture made once, on one worker
def test_a_signal_during_a_write_stops_after_it_with_the_one_line_message(tmp_path, monkeypatch, straight_run,
                                                                         file_name, nth, sig):
    if file_name == "curves.png":
        pytest.importorskip("matplotlib")
    argv = flags(tmp_path, *STRAIGHT, name="signalled")
    argv += ["--plot"] if file_name == "curves.png" else []  # the plot written where its write is the one signalled
    with monkeypatch.context() as patched:
        signal_in_write(patched, file_name, nth, sig)
        with pytest.raises(SystemExit) as exit_info:
            grpo.main(argv)
    message = exit_info.value.code  # a string: the process exits with status 1 and this line on stderr
    assert isinstance(message, str) and "\n" not in message and message.startswith(f"error: stopped by {sig.name}")
    assert not glob.glob(str(tmp_path / "runs" / "**" / ".tmp_*"), recursive=True)  # nothing half-written
    named = re.search(r"newest checkpoint, step (\d+) in (\S+), is complete", message)
    if named is None:  # stopped before its first step: as the message says, the same command again
        assert message.endswith("Nothing of this run was written yet: run the command again")
        grpo.main(argv)
    else:
        step, checkpoint_dir = int(named[1]), named[2]
        assert os.path.isfile(os.path.join(checkpoint_dir, f"model_{step:06d}.pt"))
        if file_name.endswith(("000002.pt", "000002.json")):  # the step being saved is completed, then named
            assert step == 2
        grpo.main(argv + ["--resume"])
    for k, v in final_weights(tmp_path / "runs" / "signalled", 3).items():
        assert torch.equal(v, straight_run[k]), k


def signals_in_update(monkeypatch, at_update, count=1, sig=signal.SIGINT):
    """Send this process `count` signals during the `at_update`-th policy update (as Ctrl-C pressed mid-step)."""
    update, calls = grpo.policy_update, []

    def signalled_update(*a, **k):
        calls.append(1)
        if len(calls) == at_update:
            for _ in range(count):
                os.kill(os.getpid(), sig)
        return update(*a, **k)
    monkeypatch.setattr(grpo, "policy_update", signalled_update)


@pytest.mark.parametrize("save_every", ["2", "0"], ids=["scheduled-saves", "before-any-save"])
@pytest.mark.xdist_group("straight_run")
def test_ctrl_c_saves_the_step_under_way_and_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch, straight_run,
                                                                                  save_every):
    argv = flags(tmp_path, *STRAIGHT, "--save-every", save_every, name="stopped")
    with monkeypatch.context() as patched:
        signals_in_update(patched, at_update=2)
        with pytest.raises(SystemExit) as stop:
            grpo.main(argv)
    assert re.match(r"error: stopped by SIGINT at the end of step 2\. The run's newest checkpoint, step 2 in \S+, is "
                    r"complete and unchanged: go on from it with --resume$", stop.value.code), stop.value.code
    grpo.main(argv + ["--resume"])
    for k, v in final_weights(tmp_path / "runs" / "stopped", 3).items():
        assert torch.equal(v, straight_run[k]), k


def test_a_second_signal_or_no_save_on_stop_stops_at_once_and_a_repeat_is_the_same_stop(tmp_path, monkeypatch):
    # a person's second Ctrl-C to a process of its own, however soon after the first, stops it at once; under
    # torchrun the same signal twice at once, as the launcher's forward delivers it, is one stop
    for name, count, launched, extra in (("twice", 2, False, []), ("no-save", 1, False, ["--no-save-on-stop"]),
                                         ("repeated", 2, True, [])):
        with monkeypatch.context() as patched:
            signals_in_update(patched, at_update=2, count=count)
            if launched:
                patched.setenv("TORCHELASTIC_RUN_ID", "test")
            with pytest.raises(SystemExit) as stop:
                grpo.main(flags(tmp_path, "--num-steps", "3", "--save-every", "0", *extra, name=name))
        expected = ("error: stopped by SIGINT at the end of step 2. The run's newest checkpoint, step 2 " if
                    name == "repeated" else "error: stopped by SIGINT. No checkpoint of this run was saved")
        assert stop.value.code.startswith(expected), (name, stop.value.code)


def test_a_stop_during_a_slow_eval_abandons_it_and_saves_the_step_within_seconds(tmp_path, monkeypatch):
    # A GPU run's eval takes minutes; torchrun and SLURM kill 30 s after their signal. The test task's grading
    # sleeps: the step-0 eval runs whole and is measured; SIGTERM at the first problem of the step-2 eval abandons
    # that eval at its next batch, and the step is saved.
    grade, graded, signalled = Sort.reward, [], []
    problems = 5 * grpo.EVAL_BATCH  # five batches an eval

    def slow_grade(self, conversation, reply):
        if self.split == "test":
            time.sleep(0.01)
            graded.append(time.monotonic())
            if len(graded) == problems + 1:
                signalled.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGTERM)
        return grade(self, conversation, reply)
    monkeypatch.setattr(Sort, "reward", slow_grade)
    with pytest.raises(SystemExit) as stop:
        grpo.main(flags(tmp_path, "--eval-every", "2", "--eval-examples", str(problems), "--save-every", "0",
                        name="slow"))
    stopped = time.monotonic() - signalled[0]
    whole_eval = graded[problems - 1] - graded[0]  # the step-0 eval's, from its first grade to its last
    assert re.match(r"error: stopped by SIGTERM at the end of step 2\. The run's newest checkpoint, step 2 in \S+, "
                    r"is complete", stop.value.code), stop.value.code
    assert stopped < whole_eval / 2, (stopped, whole_eval)
    assert len(graded) == problems + grpo.EVAL_BATCH  # the batch under way finished, no other began
    assert [m["step"] for m in map(json.loads, open(tmp_path / "runs" / "slow" / "metrics.jsonl"))] == [0, 1, 2]


@pytest.mark.parametrize("at_update", [2, 3], ids=["eval-step", "last-step"])
@pytest.mark.xdist_group("straight_run")
def test_a_stop_skips_a_due_eval_saves_the_step_and_resume_runs_that_eval(tmp_path, monkeypatch, capsys,
                                                                          straight_folder, at_update):
    # a stop signal in the update of a step whose end is an eval (step 2), or the final eval (step 3): the step is
    # saved first and the eval skipped, with one line; --resume runs the skipped eval, then goes on as the run that
    # never stopped
    argv = flags(tmp_path, *STRAIGHT, "--save-every", "0", name="skipped")
    with monkeypatch.context() as patched:
        signals_in_update(patched, at_update=at_update, sig=signal.SIGTERM)
        with pytest.raises(SystemExit) as stop:
            grpo.main(argv)
    assert stop.value.code.startswith(f"error: stopped by SIGTERM at the end of step {at_update}. The run's newest "
                                      f"checkpoint, step {at_update} in "), stop.value.code
    out = capsys.readouterr().out
    assert f"step {at_update}: eval skipped (SIGTERM): the step is saved first; --resume runs it" in out
    assert f"step {at_update} eval:" not in out
    grpo.main(argv + ["--resume"])
    timings = {"time_sample", "time_logprobs", "time_update", "tokens_per_s", "peak_mem_mb", "wall_time"}
    logs = [[{k: v for k, v in m.items() if k not in timings} for m in map(json.loads, open(run / "metrics.jsonl"))]
            for run in (straight_folder, tmp_path / "runs" / "skipped")]
    assert logs[0] == logs[1] and [m["step"] for m in logs[1]] == [0, 1, 2, 2, 3, 3]
    straight = final_weights(straight_folder, 3)
    for k, v in final_weights(tmp_path / "runs" / "skipped", 3).items():
        assert torch.equal(v, straight[k]), k
    evals = [sorted(os.listdir(run / "evals")) for run in (straight_folder, tmp_path / "runs" / "skipped")]
    assert evals[0] == evals[1] == ["step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]
    for name in evals[0]:  # the same problems, the same replies
        assert (straight_folder / "evals" / name).read_text() == (tmp_path / "runs" / "skipped" / "evals" / name).read_text()


def test_a_lost_rank_after_a_stop_signal_is_the_stop_not_a_fault_to_look_for(tmp_path, monkeypatch):
    # Under torchrun a terminal's Ctrl-C reaches every rank; a second one ends each rank at once, and a rank that
    # is inside a collective then (no Python handler runs there) finds the other gone: that is the stop, nothing to
    # look for. Here rank 0 of 2, its first SIGINT noted mid-step, then rank 1 gone as gloo reports it.
    update, calls = grpo.policy_update, []

    def signalled_then_peer_gone(*a, **k):
        calls.append(1)
        if len(calls) < 2:
            return update(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)
        monkeypatch.setattr(grpo.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(grpo.dist, "get_world_size", lambda: 2)
        raise grpo.dist.DistBackendError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                                         "peer [127.0.0.1]:29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(grpo, "policy_update", signalled_then_peer_gone)
    with pytest.raises(SystemExit) as stop:
        grpo.main(flags(tmp_path, "--num-steps", "3", name="lost"))
    message = stop.value.code
    assert message.startswith("error: stopped by SIGINT; rank 1 ended at once, on a second signal, before this rank "
                              "reached the step's end. The run's newest checkpoint, step 1 in "), message
    assert "look for the cause" not in message and "\n" not in message


def test_workers_stop_when_their_torchrun_launcher_is_killed(tmp_path):
    # a stand-in launcher: starts one worker as torchrun does (TORCHELASTIC_RUN_ID set), prints its pid, waits
    launcher = ("import subprocess, sys; p = subprocess.Popen(sys.argv[2:], stderr=open(sys.argv[1], 'w')); "
                "print(p.pid, flush=True); p.wait()")
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test")
    parent = subprocess.Popen([sys.executable, "-c", launcher, str(tmp_path / "worker.txt"),
                               *script(tmp_path, "orphan")], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    worker = int(parent.stdout.readline())
    try:
        wait_for(lambda: len(train_lines(tmp_path / "runs" / "orphan")) >= 2, 120, "two steps")
        parent.kill()  # SIGKILL, as an OOM killer or a scheduler does
        parent.wait()

        def gone():
            try:
                os.kill(worker, 0)
                return open(f"/proc/{worker}/stat").read().split()[2] == "Z"
            except (ProcessLookupError, FileNotFoundError):
                return True
        wait_for(gone, 60, "the orphaned worker to stop")
    finally:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
    err = open(tmp_path / "worker.txt").read().strip()
    assert "Traceback" not in err and "error: the torchrun launcher (pid" in err.splitlines()[-1], err


def test_a_stuck_rank_ends_the_job_after_the_timeout_naming_it(tmp_path):
    # two ranks as a launcher starts them (its environment, no launcher: what a launcher does then is its own)
    argv = flags(tmp_path, "--num-steps", "100000", "--dist-timeout", "3", name="stuck")
    log = tmp_path / "rank0.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=free_port())
    ranks = [subprocess.Popen([sys.executable, "grpo.py", *argv], cwd=ROOT, stdout=open(out, "w"),
                              stderr=subprocess.STDOUT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r, out in enumerate([log, os.devnull])]
    message = "error: rank 0 of 2: lost rank 1, which did not answer within --dist-timeout 3 s"
    try:
        wait_for(lambda: len(train_lines(tmp_path / "runs" / "stuck")) >= 2, 120, "two steps")
        os.kill(ranks[1].pid, signal.SIGSTOP)  # a hung data read, say
        wait_for(lambda: message in log.read_text(), 90, "rank 0's one-line stop")
    finally:
        for rank in ranks:
            rank.kill()


def test_a_one_line_error_is_one_write_so_that_ranks_sharing_a_log_keep_their_lines_whole(tmp_path, monkeypatch):
    # Python's own exit writes a message and its newline apart: two ranks stopping together in one log (torchrun's
    # output) glued rank 1's line and rank 0's into one (seen in the two-node test). The path: a byte that is not
    # UTF-8, escaped as Python's stderr escapes it (encoded as is, it made a traceback)
    class Writes(io.BytesIO):
        def write(self, data):
            written.append(bytes(data))
            return len(data)
    written, folder = [], str(tmp_path / "n\udcffne")
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(Writes(), encoding="utf-8", errors="backslashreplace",
                                                        write_through=True))  # as Python sets up stderr
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--demo", "--init", folder, "--runs-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(os.path.join(ROOT, "grpo.py"), run_name="__main__")  # as `python grpo.py` runs it
    assert stop.value.code == 1 and written == [f"error: --init: no model_<step>.pt files in {folder}: name a "
                                                "nanochat checkpoint folder (e.g. <base>/chatsft_checkpoints/d20) or a "
                                                "run folder of grpo.py, or use --init sft\n".encode(
                                                    errors="backslashreplace")], written


# ---------------------------------------------------------------------------- inputs that changed under a run

def gsm8k_folder(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_resume_refuses_changed_gsm8k_files(tmp_path, run_killed_after_first_save, capsys):
    data = gsm8k_folder(tmp_path / "gsm8k", [GOOD_ROW] * 4)
    argv = flags(tmp_path, "--task", "gsm8k", "--gsm8k-dir", str(data), "--max-new-tokens", "4", "--prompts-per-step",
                 "4", name="g")
    run_killed_after_first_save(argv)
    config = json.load(open(tmp_path / "runs" / "g" / "config.json"))
    assert config["inputs"]["train"] == hashlib.sha256((data / "train.jsonl").read_bytes()).hexdigest()
    other = dict(GOOD_ROW, question="What is 2 + 0?")
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [GOOD_ROW, other, GOOD_ROW, GOOD_ROW]))
    before = snapshot(tmp_path / "runs")
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv + ["--resume"])
    message = exit_info.value.code
    assert message.startswith("error: --resume: the run's train data (--gsm8k-dir) changed since it started")
    assert "--init " in message and snapshot(tmp_path / "runs") == before


def test_more_questions_a_step_than_the_task_has_is_refused(tmp_path):
    data = gsm8k_folder(tmp_path / "gsm8k", [GOOD_ROW] * 4)
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(flags(tmp_path, "--task", "gsm8k", "--gsm8k-dir", str(data), "--prompts-per-step", "8", name="g"))
    assert exit_info.value.code.startswith("error: --prompts-per-step 8 is more than the 4 questions")


def test_resume_refuses_a_changed_start_tokenizer(tmp_path, run_killed_after_first_save):
    grpo.main(flags(tmp_path, "--num-steps", "1", name="start"))
    start = tmp_path / "runs" / "start"
    argv = flags(tmp_path, "--init", str(start / "chatrl_checkpoints" / "d2"), name="from-start")
    run_killed_after_first_save(argv)
    enc = pickle.loads((start / "tokenizer" / "tokenizer.pkl").read_bytes())
    changed = tiktoken.Encoding(name="other", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                                special_tokens={s: 300 + i for i, s in enumerate(SPECIAL_TOKENS)})
    assert pickle.dumps(changed) != pickle.dumps(enc)
    (start / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(changed))
    copy_before = (tmp_path / "runs" / "from-start" / "tokenizer" / "tokenizer.pkl").read_bytes()
    with pytest.raises(SystemExit, match=r"the run's tokenizer \(tokenizer.pkl of the start checkpoint\) changed"):
        grpo.main(argv + ["--resume"])
    assert (tmp_path / "runs" / "from-start" / "tokenizer" / "tokenizer.pkl").read_bytes() == copy_before


# ---------------------------------------------------------------------------- devices, dead ends, copies, evals

@pytest.mark.parametrize("device,message", [("tpu", "runs on cpu, cuda or cuda:<index>"),
                                            ("mps", "runs on cpu, cuda or cuda:<index>"),
                                            ("meta", "runs on cpu, cuda or cuda:<index>"),
                                            ("cuda:x", "runs on cpu, cuda or cuda:<index>"),
                                            ("cuda:99", "CUDA")])
def test_devices_other_than_cpu_and_cuda_are_refused_before_any_work(tmp_path, device, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(flags(tmp_path, "--device", device, name="dev"))
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "runs")


def test_a_gpu_named_by_its_index_is_the_one_a_single_process_takes(monkeypatch, capsys, tmp_path):
    # a machine of two GPUs, stood in for: one process and --device cuda:1 runs on GPU 1 (not LOCAL_RANK's 0); under
    # torchrun each rank takes GPU LOCAL_RANK, so an index is refused there in one line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: None)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for device, local_rank, expected in (("cuda:1", "0", "cuda:1"), ("cuda", "0", "cuda:0"), ("cuda", "1", "cuda:1")):
        monkeypatch.setenv("LOCAL_RANK", local_rank)  # (torchrun's; a plain process has none: GPU 0)
        args = grpo.resolve_config(flags(tmp_path, "--device", device, "--dtype", "float32"))  # (no bf16 check)
        assert str(grpo.start_process(args, 0)[1]) == expected and str(chosen[-1]) == expected
    monkeypatch.setenv("WORLD_SIZE", "2")  # two nodes of one process each: an index says which GPU on each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert grpo.resolve_config(flags(tmp_path, "--device", "cuda:1")).device == "cuda:1"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes on this machine: each its own GPU
    for device, message in (("cuda:1", "--device cuda:1 names one GPU, and each of the 2 processes on this machine"),
                            ("cuda:01", "runs on cpu, cuda or cuda:<index>")):
        with pytest.raises(SystemExit) as exit_info:
            grpo.resolve_config(flags(tmp_path, "--device", device))
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it_over(tmp_path, monkeypatch, capsys):
    argv = flags(tmp_path, *STRAIGHT, "--save-every", "0", name="early")
    grpo.main(flags(tmp_path, *STRAIGHT, "--save-every", "0", name="straight"))
    update, calls = grpo.policy_update, []

    def update_then_die(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise Killed
        return update(*a, **k)

    with monkeypatch.context() as patched:
        patched.setattr(grpo, "policy_update", update_then_die)
        with pytest.raises(Killed):
            grpo.main(argv)
    assert len(train_lines(tmp_path / "runs" / "early")) == 1
    capsys.readouterr()
    grpo.main(argv + ["--resume"])
    assert "starting it over from step 0" in capsys.readouterr().out
    strip = {"time_sample", "time_logprobs", "time_update", "tokens_per_s", "peak_mem_mb", "wall_time"}
    logs = [[{k: v for k, v in m.items() if k not in strip} for m in map(json.loads, open(tmp_path / "runs" / n /
                                                                                          "metrics.jsonl"))]
            for n in ("straight", "early")]
    assert logs[0] == logs[1] and [m["step"] for m in logs[1]] == [0, 1, 2, 2, 3, 3]
    for name in ("step_0.jsonl", "step_2.jsonl", "step_3.jsonl"):  # the same problems, the same replies
        assert (tmp_path / "runs" / "straight" / "evals" / name).read_text() == (tmp_path / "runs" / "early" / "evals" /
                                                                                  name).read_text()


def test_compare_keeps_copies_of_one_seed_apart(tmp_path, capsys):
    grpo.main(flags(tmp_path, "--num-steps", "2", name="demo-grpo-seed0"))
    shutil.copytree(tmp_path / "runs", tmp_path / "copy")
    capsys.readouterr()
    table = grpo.main(["--compare", str(tmp_path / "runs" / "demo-grpo-seed0"), str(tmp_path / "copy" / "demo-grpo-seed0"),
                       "--runs-dir", str(tmp_path), "--no-plot"])
    assert [row[table[0].index("seeds")] for row in table[1:]] == [1, 1]
    assert "same configuration with the same seed" in capsys.readouterr().out


def test_evaluating_a_checkpoint_twice_touches_no_run(tmp_path):
    grpo.main(flags(tmp_path, "--num-steps", "1", name="trained"))
    before = snapshot(tmp_path / "runs")
    checkpoint = str(tmp_path / "runs" / "trained" / "chatrl_checkpoints" / "d2")
    for _ in range(2):  # the same name as the training run, twice
        result = grpo.main(flags(tmp_path, "--init", checkpoint, "--eval-only", "--final-eval-examples", "4",
                                 name="trained"))
        assert result["eval_examples"] == 4
    assert snapshot(tmp_path / "runs") == before


def test_evaluating_and_asking_a_stopped_distillation_write_nothing_of_its_run(tmp_path, monkeypatch):
    # A stopped run of --algo distill (its teacher's sha256 in config.json): --resume --eval-only writes its own
    # result only, and --ask nothing, resumed or not; so a later --resume still refuses a changed teacher.
    teacher = teacher_folder(tmp_path)
    argv = distill_run(tmp_path, "taught", teacher, "--num-steps", "3", "--save-every", "1", "--eval-every", "1",
                       "--eval-examples", "4")
    with monkeypatch.context() as patched:
        signals_in_update(patched, at_update=2)
        with pytest.raises(SystemExit, match="^error: stopped by SIGINT at the end of step 2"):
            grpo.main(argv)
    run = tmp_path / "taught"
    before = snapshot(run)
    result = grpo.main(argv + ["--resume", "--eval-only", "--final-eval-examples", "6"])
    untaught = argv[:argv.index("--teacher")] + argv[argv.index("--teacher") + 2:]  # the teacher is not read
    assert grpo.main(untaught + ["--resume", "--eval-only", "--final-eval-examples", "6"]) == result
    own = {"eval_only.jsonl": [{"step": 2, **result}] * 2, os.path.join("evals", "eval_only_step_2.jsonl"): 6}
    assert [json.loads(line) for line in open(run / "eval_only.jsonl")] == own["eval_only.jsonl"]
    assert len(open(run / "evals" / "eval_only_step_2.jsonl").readlines()) == 6 and result["eval_examples"] == 6
    evaluated = snapshot(run)
    assert {k: v for k, v in evaluated.items() if k not in own} == before
    for extra in (["--resume"], ["--init", str(run / "chatrl_checkpoints" / "d2")]):  # the run's name, too
        assert len(grpo.main(argv + extra + ["--ask", "3 1 2"])) == 5
    assert snapshot(run) == evaluated
    teacher_folder(tmp_path, seed=2)  # other weights in the same folder, at the same step
    with pytest.raises(SystemExit, match=r"^error: --resume: the run's teacher \(--teacher's checkpoint\) changed"):
        grpo.main(argv + ["--resume"])
    assert snapshot(run) == evaluated


def test_evaluating_a_checkpoint_names_its_step(tmp_path, capsys):
    grpo.main(flags(tmp_path, "--num-steps", "2", name="trained"))  # checkpoints of steps 1 and 2
    checkpoint = str(tmp_path / "runs" / "trained" / "chatrl_checkpoints" / "d2")
    capsys.readouterr()
    grpo.main(flags(tmp_path, "--init", checkpoint, "--init-step", "1", "--eval-only", "--final-eval-examples", "4",
                    name="e"))
    out = capsys.readouterr().out
    assert f"--eval-only, the policy of {checkpoint}, step 1: eval_examples 4, " in out and " eval: " not in out


def test_evaluating_or_asking_with_a_distillations_flags_needs_no_teacher(tmp_path):
    grpo.main(flags(tmp_path, "--num-steps", "1", name="trained"))
    checkpoint = str(tmp_path / "runs" / "trained" / "chatrl_checkpoints" / "d2")
    result = grpo.main(flags(tmp_path, "--algo", "distill", "--init", checkpoint, "--eval-only",
                             "--final-eval-examples", "4", name="e"))
    assert result["eval_examples"] == 4
    replies = grpo.main(flags(tmp_path, "--algo", "distill", "--init", checkpoint, "--ask", "3 1 2", name="e"))
    assert len(replies) == 5
    assert not os.path.exists(tmp_path / "runs" / "e")


def test_an_absurd_step_size_is_warned_about_and_the_update_ratio_logged(tmp_path, capsys):
    grpo.main(flags(tmp_path, "--num-steps", "2", "--save-every", "0", name="sane"))
    sane = train_lines(tmp_path / "runs" / "sane")
    assert "changed the weights' norm" not in capsys.readouterr().out
    assert all(0 < m["update_ratio"] < 0.5 and m["weight_norm_factor"] < grpo.WEIGHT_NORM_WARNING
               and m["grad_norm"] > 0 for m in sane)  # grad_norm is logged with --grad-clip 0 too
    grpo.main(flags(tmp_path, "--optimizer", "adamw", "--lr", "1e9", "--num-steps", "1", "--save-every", "0",
                    name="absurd"))
    out = capsys.readouterr().out
    assert "warning: step 1: one update changed the weights' norm by a factor" in out and "--lr" in out
    (absurd,) = train_lines(tmp_path / "runs" / "absurd")
    assert absurd["weight_norm_factor"] > 1e6 and absurd["update_ratio"] > 1e6


def test_grad_clip_scales_the_gradients_as_torchs_clip_grad_norm_and_logs_the_norm_before():
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        (model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))) * 10).square().sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(models[0].parameters(), max_norm=0.5)
    torch.optim.SGD(models[0].parameters(), lr=1.0).step()
    stats = grpo.update_stats(torch.device("cpu"))
    grpo.optimizer_step(models[1], [torch.optim.SGD(models[1].parameters(), lr=1.0)], stats, grad_clip=0.5)
    assert norm > 5 and stats["grad_norm"].item() == pytest.approx(norm.item(), rel=1e-6)
    for theirs, ours in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_the_update_ratio_is_the_relative_change_of_the_weights(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizers = [torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)]
    model(torch.randn(5, 4)).square().sum().backward()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    stats = grpo.update_stats(torch.device("cpu"))
    grpo.optimizer_step(model, optimizers, stats, grad_clip=0.0)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert stats["update_ratio"].item() == pytest.approx(((after - before).norm() / before.norm()).item(), rel=1e-6)
    assert stats["weight_norm_factor"].item() == pytest.approx(max(after.norm() / before.norm(),
                                                                   before.norm() / after.norm()).item(), rel=1e-6)


# ---------------------------------------------------------------------------- stops under torchrun

# A stand-in for torchrun's handling of a worker that fails (torch 2.13, LocalElasticAgent._stop_workers): SIGTERM
# to the others, SIGKILL to those still there 30 s later (not its --shutdown-timeout: that is for signals to it);
# here after argv[1] seconds. Workers get torchrun's environment; it prints their pids.
FAILING_WORKER_LAUNCHER = """
import os, signal, subprocess, sys, time
kill_after, command = float(sys.argv[1]), sys.argv[2:]
workers = [subprocess.Popen(command, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                              LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="test")) for r in range(2)]
print(*(w.pid for w in workers), flush=True)
while not any(w.poll() for w in workers) and not all(w.poll() == 0 for w in workers):
    time.sleep(0.05)
for w in workers:
    if w.poll() is None:
        w.send_signal(signal.SIGTERM)
deadline = time.time() + kill_after
while time.time() < deadline and any(w.poll() is None for w in workers):
    time.sleep(0.05)
for w in workers:
    if w.poll() is None:
        w.kill()
"""


def worker_pid(launcher):
    """The pid of a torchrun launcher's one worker, once it has started."""
    def child():
        pids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        return int(pids[0]) if pids else None
    wait_for(child, 60, "the worker")
    return child()


def stop_lines(log, run_dir):
    """rank 0's and rank 1's one-line stops, from a job's mixed output -> (the step they say the run stopped at,
    that step's checkpoint being the newest complete one; rank 1's line)"""
    lines = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
    rank0 = [line for line in lines if "(rank 1:" not in line]
    stopped = re.match(r"error: stopped by .* at the end of step (\d+)\. The run's newest checkpoint, step \1 in "
                       r"\S+, is complete", rank0[0] if len(rank0) == 1 else "")
    assert stopped, log.read_text()
    step = int(stopped[1])
    assert grpo.complete_steps(str(run_dir / "chatrl_checkpoints" / "d2"))[-1] == step
    return step, [line for line in lines if "(rank 1:" in line]


def test_a_two_node_job_takes_one_process_steps_and_a_schedulers_stop_saves_and_resumes_exactly(tmp_path):
    # 1. Two torchrun launchers, as on two machines, meeting at a c10d rendezvous (here on this machine): global
    # ranks from the rendezvous, local rank 0 on each, one shared run folder that global rank 0 writes. First a run
    # that goes to its end, the steps of one process (up to float rounding; one process runs it meanwhile here).
    # Then a scheduler (or `kill -TERM -- -PGID`) signals every process of the job: each worker gets the signal
    # itself and again from its torchrun, which forwards it. That is one stop: the step under way is finished and
    # saved, and each process ends with its one line. (SIGHUP and SIGINT take the same handler: the in-process
    # tests send them.)
    runs, same = tmp_path / "runs", ["--num-steps", "8", "--algo", "grpo", "--optimizer", "adamw", "--lr", "1e-3",
                                     "--entropy-coef", "0", "--device-batch-size", "4"]
    straight = flags(tmp_path, *same, name="straight")
    argv = flags(tmp_path, *same, "--save-every", "0", name="signalled")
    listing = tmp_path / "job.json"
    listing.write_text(json.dumps([straight, {"flags": argv, "update_seconds": 0.8}]))
    env, logs, port = dict(os.environ, OMP_NUM_THREADS="1"), [tmp_path / f"node{n}.txt" for n in range(2)], free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nodes",
                               os.path.join("tests", "rank_runs.py"), str(listing)], cwd=ROOT, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT, env=env) for log in logs]
    try:
        in_this_process(flags(tmp_path, *same, name="single"))  # meanwhile, the same run in this process
        workers = [worker_pid(node) for node in nodes]
        wait_for(lambda: len(train_lines(runs / "signalled")) >= 1, 120, "a step")
        for pid in (nodes[0].pid, workers[0], nodes[1].pid, workers[1]):  # the next step is under way (its update
            os.kill(pid, signal.SIGTERM)  # starts 0.8 s late)
            time.sleep(0.2)
        for node in nodes:
            node.wait(timeout=60)
    finally:
        for node in nodes:
            node.kill()
    job = "\n".join(log.read_text() for log in logs)
    assert job.count("optimizer state sharded over the 2 ranks") == 2  # rank 0's log, once a run
    a, b = (final_weights(runs / name, 8) for name in ("single", "straight"))
    start = model_module.GPT(model_module.GPTConfig(**json.load(open(
        runs / "single" / "chatrl_checkpoints" / "d2" / "meta_000008.json"))["model_config"])).init_weights(0)
    assert_same_steps(a, b, start.state_dict())
    rewards = [[m["reward"] for m in train_lines(runs / name)] for name in ("single", "straight")]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 8
    (tmp_path / "job.txt").write_text(job)
    step, rank1 = stop_lines(tmp_path / "job.txt", runs / "signalled")
    assert rank1 == [f"error: stopped by SIGTERM at the end of step {step} (rank 1: rank 0's line names the "
                     "checkpoint to go on from)"], job
    # 2. Resumed, and stopped again by a signal to rank 1 alone while rank 0's checkpoint write takes longer than
    # the launcher waits for the others once one has ended (torchrun: SIGKILL 30 s after the first worker failed;
    # here 0.3 s, and the write 1.5 s): every rank stays until the write is done.
    listing.write_text(json.dumps([{"flags": argv + ["--resume"], "update_seconds": 0.3, "save_seconds": 1.5}]))
    log = tmp_path / "resumed.txt"
    job = subprocess.Popen([sys.executable, "-c", FAILING_WORKER_LAUNCHER, "0.3", sys.executable,
                            os.path.join("tests", "rank_runs.py"), str(listing)], cwd=ROOT, text=True,
                           env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()), stdout=subprocess.PIPE,
                           stderr=open(log, "w"))
    try:
        pids = [int(pid) for pid in job.stdout.readline().split()]
        wait_for(lambda: len(train_lines(runs / "signalled")) > step, 120, "a resumed step")
        os.kill(pids[1], signal.SIGINT)
        job.wait(timeout=60)
    finally:
        job.kill()
    resumed, rank1 = stop_lines(log, runs / "signalled")
    assert step < resumed < 8 and rank1 == [f"error: stopped by SIGINT at the end of step {resumed} (rank 1: rank "
                                            "0's line names the checkpoint to go on from)"], log.read_text()
    # the steps resumed are those of the run never stopped, bit for bit
    for (k, a), b in zip(final_weights(runs / "straight", resumed).items(),
                         final_weights(runs / "signalled", resumed).values()):
        assert torch.equal(a, b), k
