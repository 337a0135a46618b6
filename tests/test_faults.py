"""
Bad input and faults, as a table: each case damages a copy of a real run (or passes a bad flag) and asserts the
exit code, that the message is one line naming the problem, and that no file saved before was changed. After it,
the faults that need more than one call: disk full mid-run, non-finite weights, a lock held by another process,
and a handful of cases end to end through `python grpo.py`.
"""
import errno
import fcntl
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import warnings
from types import SimpleNamespace

import pytest
import torch

import grpo
import tasks
import model as model_module
import model
from conftest import ROOT, Killed

CK = os.path.join("runs", "base", "chatrl_checkpoints", "d2")  # the checkpoints of the damaged run, steps 1 and 2
GOOD_ROW = {"question": "What is 1 + 1?", "answer": "1 + 1 = <<1+1=2>>2\n#### 2"}


def flags(w, *extra, name="base"):
    return ["--demo", "--algo", "grpo", "--runs-dir", str(w / "runs"), "--run-name", name, "--eval-every", "0",
            "--prompts-per-step", "8", "--num-samples", "4", "--num-steps", "4", "--save-every", "1", "--no-plot", *extra]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """runs/base: a grpo run killed after its step-2 checkpoint (checkpoints 1 and 2 complete, 2 steps logged);
    gsm8k/: a small well-formed GSM8K folder."""
    root = tmp_path_factory.mktemp("pristine")
    save = grpo.save_training_state

    def save_then_die(run_dir, tag, step, *a):
        save(run_dir, tag, step, *a)
        if step == 2:
            raise Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo, "save_training_state", save_then_die)
        with pytest.raises(Killed):
            grpo.main(flags(root))
    (root / "gsm8k").mkdir()
    for split in ("train", "test"):
        (root / "gsm8k" / f"{split}.jsonl").write_text((json.dumps(GOOD_ROW) + "\n") * 4)
    return root


def snapshot(folder):
    return {os.path.relpath(os.path.join(d, f), folder): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(folder) for f in files}


# ---------------------------------------------------------------------------- how cases damage things

def write(w, rel, data):
    path = w / rel
    if data is None:
        path.unlink()
    else:
        path.write_bytes(data(path.read_bytes()) if callable(data) else data)


def resume_with(rel, data, *extra):
    """Damage one file of the run, then --resume it."""
    def setup(w, mp):
        write(w, rel, data)
        return flags(w, "--resume", *extra)
    return setup


def init_with(rel, data, *extra):
    """Damage one file of the run's checkpoint, then start a new run from it with --init."""
    def setup(w, mp):
        mp.setenv("NANOCHAT_BASE_DIR", str(w / "no-nanochat"))  # no fallback tokenizer elsewhere
        if rel:
            write(w, rel, data)
        return flags(w, "--init", str(w / CK), *extra, name="fresh")
    return setup


def gsm8k_with(split_data, *extra):
    def setup(w, mp):
        mp.delenv("NANOGRPO_GSM8K_DIR", raising=False)
        for split, data in split_data.items():
            write(w, os.path.join("gsm8k", f"{split}.jsonl"), data)
        return flags(w, "--task", "gsm8k", "--gsm8k-dir", str(w / "gsm8k"), *extra, name="fresh")
    return setup


def bad_flags(*extra):
    return lambda w, mp: flags(w, *extra, name="fresh")


def meta_edit(edit):
    def change(data):
        meta = json.loads(data)
        edit(meta)
        return json.dumps(meta).encode()
    return change


def other_model_state(data):
    state = torch.load(io.BytesIO(data), weights_only=True)
    state["transformer.wte.weight"] = state["transformer.wte.weight"][:, :32]
    return save_bytes(state)


def save_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def hostile_tokenizer(w, mp):
    mp.setenv("NANOCHAT_BASE_DIR", str(w / "no-nanochat"))
    write(w, "runs/base/tokenizer/tokenizer.pkl", pickle.dumps(RunsCode(str(w / "ran"))))
    return flags(w, "--init", str(w / CK), name="fresh")


def world_size(n, *extra):
    def setup(w, mp):
        mp.setenv("WORLD_SIZE", str(n))
        return flags(w, *extra, name="fresh")
    return setup


HELD_LOCKS = []  # open files whose flock stands for another process's


def locked(w, mp):
    lock = open(w / "runs" / "base" / ".lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second open file conflicts as another process would
    HELD_LOCKS.append(lock)  # closed, so unlocked, when the case ends
    return flags(w, "--resume")


def read_only(w, mp):
    """The runs folder on a read-only file system (simulated: root may write anywhere, so chmod cannot show it)."""
    runs, real_makedirs, real_open, real_mkstemp = str(w / "runs"), os.makedirs, open, tempfile.mkstemp

    def refuse(path):
        if os.path.abspath(str(path)).startswith(runs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def makedirs(path, *a, **k):
        if not os.path.isdir(path):
            refuse(path)
        return real_makedirs(path, *a, **k)

    def open_(path, mode="r", *a, **k):
        if set(mode) & set("wax+"):
            refuse(path)
        return real_open(path, mode, *a, **k)

    def mkstemp(*a, dir=None, **k):
        refuse(dir)
        return real_mkstemp(*a, dir=dir, **k)

    mp.setattr(os, "makedirs", makedirs)
    mp.setattr(grpo, "open", open_, raising=False)
    mp.setattr(tempfile, "mkstemp", mkstemp)
    return flags(w, "--resume")


def disk_full(w, mp):
    """Every file written in the run goes to /dev/full, which refuses writes with ENOSPC as a full disk does."""
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*a, **k):
        fd, path = real_mkstemp(*a, **k)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), path

    mp.setattr(tempfile, "mkstemp", mkstemp)
    return flags(w, "--resume")


def fresh_in_file(w, mp):
    return flags(w, "--runs-dir", str(w / "runs" / "base" / "config.json" / "runs"), name="fresh")


def model_file_as_state(w, mp):
    shutil.copy(w / CK / "model_000002.pt", w / CK / "state_000002.pt")
    return flags(w, "--resume")


def torn_last_line(data):
    return data + b'{"step": 3, "rew'


# (id, setup(w, monkeypatch) -> argv, exit code, what the message must say). Exit code 0: the fault is handled by
# carrying on correctly, and the text is what the output must say about it.
CASES = [
    # -- flags: parser.error, exit 2, before any work
    ("group-of-one", bad_flags("--num-samples", "1"), 2, "groups of at least 2"),
    ("clip-zero", bad_flags("--clip-eps", "0"), 2, "--clip-eps"),
    ("kl-negative", bad_flags("--kl-coef", "-0.1"), 2, "--kl-coef must be >= 0"),
    ("entropy-negative", bad_flags("--entropy-coef", "-0.1"), 2, "--entropy-coef must be >= 0"),
    ("warmup-too-long", bad_flags("--warmup-steps", "9", "--num-steps", "9"), 2, "--warmup-steps 9 leaves no step"),
    ("min-lr-frac-above-one", bad_flags("--min-lr-frac", "1.5"), 2, "--min-lr-frac must be between 0 and 1"),
    ("keep-states-negative", bad_flags("--keep-states", "-1"), 2, "--keep-states: must be >= 0"),
    ("ref-reset-without-kl", bad_flags("--ref-reset-every", "5", "--kl-coef", "0"), 2, "--kl-coef > 0"),
    ("temperature-zero", bad_flags("--temperature", "0"), 2, "greedy"),
    ("temperature-near-zero", bad_flags("--temperature", "0.01"), 2, "greedy"),
    ("temperature-nan", bad_flags("--temperature", "nan"), 2, "finite"),
    ("top-k-1", bad_flags("--top-k", "1"), 2, "--top-k 1"),
    ("top-k-negative", bad_flags("--top-k", "-3"), 2, "--top-k must be >= 0"),
    ("minibatches-too-many", bad_flags("--num-minibatches", "1000"), 2, "--num-minibatches"),
    ("overlong-buffer-too-long", bad_flags("--overlong-buffer", "100"), 2, "--overlong-buffer"),
    ("eval-zero-problems", bad_flags("--eval-examples", "0"), 2, "measures nothing"),
    ("final-eval-zero-problems", bad_flags("--final-eval-examples", "0"), 2, "measures nothing"),
    ("lr-frac-negative", bad_flags("--init-lr-frac", "-1"), 2, "learning rates"),
    ("lr-zero", bad_flags("--optimizer", "adamw", "--lr", "0"), 2, "learning rates"),
    ("lr-nan", bad_flags("--lr", "nan"), 2, "finite"),
    ("matrix-lr-inf", bad_flags("--matrix-lr", "inf"), 2, "finite"),
    ("grad-clip-negative", bad_flags("--grad-clip", "-1"), 2, "--grad-clip"),
    ("weight-decay-negative", bad_flags("--weight-decay", "-0.1"), 2, "--weight-decay"),
    ("heads-zero", bad_flags("--n-head", "0"), 2, "--n-head 0"),
    ("width-not-multiple-of-heads", bad_flags("--n-embd", "30", "--n-head", "4"), 2, "--n-embd 30"),
    ("depth-negative", bad_flags("--depth", "-1"), 2, "--depth -1"),
    ("odd-head-size", bad_flags("--n-embd", "12", "--n-head", "4"), 2, "even head size"),
    ("run-name-escapes", bad_flags("--run-name", "../../x"), 2, "plain folder name"),
    ("run-name-absolute", bad_flags("--run-name", "/tmp/x"), 2, "plain folder name"),
    ("run-name-dotdot", bad_flags("--run-name", ".."), 2, "plain folder name"),
    ("prompts-zero", bad_flags("--prompts-per-step", "0"), 2, "--prompts-per-step"),
    ("max-new-tokens-zero", bad_flags("--max-new-tokens", "0"), 2, "--max-new-tokens"),
    ("steps-zero", bad_flags("--num-steps", "0"), 2, "--num-steps"),
    ("device-batch-zero", bad_flags("--device-batch-size", "0"), 2, "--device-batch-size"),
    ("sort-length-zero", bad_flags("--sort-length", "0"), 2, "--sort-length"),
    ("max-bad-steps-zero", bad_flags("--max-bad-steps", "0"), 2, "--max-bad-steps"),
    ("init-step-negative", bad_flags("--init-step", "-1"), 2, "--init-step"),
    ("epochs-zero", bad_flags("--ppo-epochs", "0"), 2, "--ppo-epochs"),
    ("sampling-rounds-zero", bad_flags("--max-sampling-rounds", "0"), 2, "--max-sampling-rounds"),
    ("eval-every-negative", bad_flags("--eval-every", "-1"), 2, "--eval-every"),
    ("window-pattern-letters", bad_flags("--init", "x", "--window-pattern", "SXL"), 2, "--window-pattern 'SXL'"),
    ("generation-on-scratch", bad_flags("--init", "scratch", "--generation", "classic"), 2, "--init scratch"),
    ("lora-on-scratch", bad_flags("--init", "scratch", "--lora-rank", "8"), 2, "nothing to adapt"),
    ("lora-with-ref-dtype", bad_flags("--init", "x", "--lora-rank", "8", "--ref-dtype", "float32"), 2, "there is no copy"),
    ("lora-alpha-zero", bad_flags("--init", "x", "--lora-rank", "8", "--lora-alpha", "0"), 2, "--lora-alpha must be > 0"),
    ("lora-lr-zero", bad_flags("--init", "x", "--lora-rank", "8", "--lora-lr", "0"), 2, "--lora-lr) must be > 0"),
    ("lora-rank-negative", bad_flags("--lora-rank", "-1"), 2, "--lora-rank: must be >= 0"),
    ("algo-unknown", bad_flags("--algo", "ppo"), 2, "--algo: invalid choice"),
    ("lr-not-a-number", bad_flags("--lr", "fast"), 2, "--lr: invalid float"),
    ("prompts-not-divisible-by-ranks", world_size(3, "--prompts-per-step", "32"), 2, "not divisible by the 3 ranks"),
    # -- the run directory
    ("run-exists-without-resume", lambda w, mp: flags(w), 2, "already holds a run"),
    ("resume-without-checkpoint", lambda w, mp: flags(w, "--resume", name="fresh"), 1, "no checkpoint with training state"),
    ("resume-other-algorithm", lambda w, mp: flags(w, "--resume", "--algo", "dr_grpo"), 1, "differ from the run's (advantage"),
    ("run-locked-by-another-process", locked, 1, "another grpo.py process is running in"),
    ("runs-dir-inside-a-file", fresh_in_file, 1, "cannot write in the run directory"),
    ("runs-dir-read-only", read_only, 1, "Read-only file system"),
    ("disk-full-on-resume", disk_full, 1, "No space left on device. The run's newest checkpoint, step 2"),
    # -- damaged files of the run, found by --resume
    ("model-truncated", resume_with(f"{CK}/model_000002.pt", lambda d: d[:len(d) // 2]), 1, "model_000002.pt is damaged"),
    ("model-empty", resume_with(f"{CK}/model_000002.pt", b""), 1, "model_000002.pt is damaged"),
    ("model-text", resume_with(f"{CK}/model_000002.pt", b"not a checkpoint\n" * 10), 1, "model_000002.pt is damaged"),
    ("model-holds-a-list", resume_with(f"{CK}/model_000002.pt", save_bytes([1, 2])), 1, "holds no state dict"),
    ("model-other-shapes", resume_with(f"{CK}/model_000002.pt", other_model_state), 1, "wrong shapes"),
    ("meta-not-json", resume_with(f"{CK}/meta_000002.json", b"{\"step\": 2,"), 1, "meta_000002.json is not valid JSON"),
    ("meta-empty", resume_with(f"{CK}/meta_000002.json", b""), 1, "meta_000002.json is not valid JSON"),
    ("meta-not-utf8", resume_with(f"{CK}/meta_000002.json", b"\xff\xfe{}"), 1, "meta_000002.json is not valid JSON"),
    ("meta-a-list", resume_with(f"{CK}/meta_000002.json", b"[1, 2]"), 1, "meta_000002.json has no model_config"),
    ("meta-without-config", resume_with(f"{CK}/meta_000002.json", meta_edit(lambda m: m.pop("model_config"))), 1,
     "meta_000002.json has no model_config"),
    ("meta-size-a-string", resume_with(f"{CK}/meta_000002.json", meta_edit(lambda m: m["model_config"].update(n_layer="2"))),
     1, "n_layer='2'"),
    ("meta-size-zero", resume_with(f"{CK}/meta_000002.json", meta_edit(lambda m: m["model_config"].update(n_embd=0))),
     1, "n_embd=0"),
    ("meta-size-a-bool", resume_with(f"{CK}/meta_000002.json", meta_edit(lambda m: m["model_config"].update(n_head=True))),
     1, "n_head=True"),
    ("meta-unknown-field", resume_with(f"{CK}/meta_000002.json", meta_edit(lambda m: m["model_config"].update(n_experts=8))),
     1, "fields nanogrpo does not know: ['n_experts']"),
    ("state-truncated", resume_with(f"{CK}/state_000002.pt", lambda d: d[:100]), 1, "state_000002.pt is damaged"),
    ("state-empty", resume_with(f"{CK}/state_000002.pt", b""), 1, "state_000002.pt is damaged"),
    ("state-is-a-model-file", model_file_as_state, 1, "state_000002.pt is not this run's training state (KeyError"),
    ("state-of-another-run", resume_with(f"{CK}/state_000002.pt", save_bytes({"step": 2, "master_weights": {}})),
     1, "state_000002.pt is not this run's training state (KeyError"),
    ("config-missing", resume_with("runs/base/config.json", None), 1, "cannot read the run's flags"),
    ("config-not-json", resume_with("runs/base/config.json", b"{"), 1, "cannot read the run's flags"),
    ("config-a-list", resume_with("runs/base/config.json", b"[]"), 1, "not a JSON object"),
    ("metrics-line-damaged", resume_with("runs/base/metrics.jsonl", lambda d: b"{oops\n" + d), 1, "metrics.jsonl line 1 is damaged"),
    # -- faults handled by carrying on (exit 0): what the output says
    ("meta-of-last-step-missing", resume_with(f"{CK}/meta_000002.json", None), 0, "resumed from step 1"),
    ("state-of-last-step-missing", resume_with(f"{CK}/state_000002.pt", None), 0, "resumed from step 1"),
    ("metrics-last-line-torn", resume_with("runs/base/metrics.jsonl", torn_last_line), 0, "the last line is incomplete"),
    ("metrics-missing", resume_with("runs/base/metrics.jsonl", None), 0, "resumed from step 2"),
    ("half-written-save-left", resume_with(f"{CK}/.tmp_x1y2", b"half a checkpoint"), 0, "resumed from step 2"),
    ("resume-with-a-lower-lr", lambda w, mp: flags(w, "--resume", "--matrix-lr", "0.01"), 0, "matrix_lr 0.02 -> 0.01"),
    # -- the start checkpoint (--init) and its tokenizer
    ("init-missing", lambda w, mp: flags(w, "--init", str(w / "nowhere"), name="fresh"), 1, "no model_<step>.pt files"),
    ("init-step-missing", init_with(None, None, "--init-step", "7"), 1, "no step 7"),
    ("init-model-truncated", init_with(f"{CK}/model_000002.pt", lambda d: d[:1000]), 1, "model_000002.pt is damaged"),
    # (the newest step's alone would be a step still being written: skipped with a note, test_checkpoint_readers)
    ("init-meta-missing", init_with(f"{CK}/meta_000001.json", None, "--init-step", "1"), 1,
     "meta_000001.json is missing"),
    ("tokenizer-missing", init_with("runs/base/tokenizer/tokenizer.pkl", None), 1, "no tokenizer at"),
    ("tokenizer-empty", init_with("runs/base/tokenizer/tokenizer.pkl", b""), 1, "is not a nanochat tokenizer.pkl"),
    ("tokenizer-text", init_with("runs/base/tokenizer/tokenizer.pkl", b"tokens"), 1, "is not a nanochat tokenizer.pkl"),
    ("tokenizer-truncated", init_with("runs/base/tokenizer/tokenizer.pkl", lambda d: d[:len(d) // 2]), 1,
     "is not a nanochat tokenizer.pkl"),
    ("tokenizer-another-object", init_with("runs/base/tokenizer/tokenizer.pkl", pickle.dumps({"name": "x"})), 1,
     "does not hold a tiktoken encoding"),
    ("tokenizer-hostile", hostile_tokenizer, 1, "which no tokenizer needs (refused"),
    # -- data
    ("gsm8k-train-missing", gsm8k_with({"train": None}), 1, "has no train.jsonl"),
    ("gsm8k-train-empty", gsm8k_with({"train": b""}), 1, "train.jsonl holds no GSM8K rows"),
    ("gsm8k-train-blank-lines", gsm8k_with({"train": b"\n\n  \n"}), 1, "train.jsonl holds no GSM8K rows"),
    ("gsm8k-test-empty", gsm8k_with({"test": b""}), 1, "test.jsonl holds no GSM8K rows"),
    ("gsm8k-row-not-json", gsm8k_with({"train": lambda d: d + b"{\"question\": \n"}), 1, "train.jsonl line 5 is not a GSM8K row"),
    ("gsm8k-row-a-list", gsm8k_with({"train": b"[1, 2]\n"}), 1, "train.jsonl line 1 is not a GSM8K row"),
    ("gsm8k-row-without-answer", gsm8k_with({"train": b'{"question": "q"}\n'}), 1, "no question/answer strings"),
    ("gsm8k-answer-without-marker", gsm8k_with({"train": b'{"question": "q", "answer": "2"}\n'}), 1, "no '#### <number>' line"),
    ("gsm8k-not-utf8", gsm8k_with({"train": b"\xff\xfe\x00{"}), 1, "train.jsonl line 1 is not a GSM8K row"),
    ("gsm8k-dir-is-a-file", lambda w, mp: flags(w, "--task", "gsm8k", "--gsm8k-dir", str(w / "gsm8k" / "train.jsonl"),
                                                name="fresh"), 1, "has no train.jsonl"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.xdist_group("pristine")  # pytest -n: the module's fixture made once, on one worker
def test_bad_input_and_faults(case, pristine, tmp_path, monkeypatch, capsys):
    _, setup, code, text = case
    w = tmp_path / "w"
    shutil.copytree(pristine, w)
    with monkeypatch.context() as mp:
        argv = setup(w, mp)
        before = snapshot(w)
        capsys.readouterr()
        try:
            if code == 0:
                grpo.main(argv)
                assert text in capsys.readouterr().out
                return
            with pytest.raises(SystemExit) as exit_info:
                grpo.main(argv)
        finally:
            while HELD_LOCKS:
                HELD_LOCKS.pop().close()
    if code == 2:  # argparse: the usage line, then the error
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("usage:") and text in lines[1], lines
    else:
        message = exit_info.value.code
        assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
        if case[0].startswith(("tokenizer-", "init-")):  # named by its flag, as --teacher's are
            assert message.startswith("error: --init"), message
        assert text in message, message
    after = snapshot(w)
    assert {k: v for k, v in after.items() if k in before} == before, "a file saved before was changed"
    assert all(os.path.basename(k) == ".lock" for k in set(after) - set(before)), set(after) - set(before)
    assert not os.path.exists(w / "ran")  # the hostile tokenizer ran nothing


# ---------------------------------------------------------------------------- damaged checkpoints, every way in

# The files of a step and what damages them: cut to nothing, to 20 KB (where torch's zip reader seeks before the
# file's start: OSError EINVAL), by its last byte; zeroed; holding another file's bytes (a readable file of the
# wrong kind). The kinds each entry reads: a start checkpoint or a teacher is a model and its meta, a run's step also
# its training state.
STEP_FILES = {"model": "model_000002.pt", "meta": "meta_000002.json", "state": "state_000002.pt"}
IN_ITS_PLACE = {"model": "state", "meta": "model", "state": "model"}
DAMAGE = {
    "empty": lambda data, other: b"",
    "cut-to-20KB": lambda data, other: data[:min(len(data) // 2, 20_000)],
    "cut-by-a-byte": lambda data, other: data[:-1],
    "zeroed": lambda data, other: bytes(len(data)),
    "another-files-bytes": lambda data, other: other,
}
# entry -> (its flags, given the damaged checkpoint's folder; the run it names; what the line must say to do)
ENTRIES = {
    "init": (lambda ck: ["--init", ck], "fresh", ("--init-step 1", "another checkpoint with --init")),
    "teacher": (lambda ck: ["--algo", "distill", "--teacher", ck], "fresh", ("--teacher-step 1", "another --teacher")),
    "eval-only": (lambda ck: ["--eval-only", "--init", ck], "fresh", ("--init-step 1", "with --init")),
    "ask": (lambda ck: ["--ask", "Sort: 3 1 2", "--init", ck], "fresh", ("--init-step 1", "with --init")),
    "resume": (lambda ck: ["--resume"], "base", ("resume from step 1", "with --init")),
    "resume-eval-only": (lambda ck: ["--resume", "--eval-only"], "base", ("resume from step 1", "with --init")),
    "resume-ask": (lambda ck: ["--resume", "--ask", "Sort: 3 1 2"], "base", ("resume from step 1", "with --init")),
}
DAMAGED_CASES = [(entry, kind, damage) for entry in ENTRIES for kind in STEP_FILES for damage in DAMAGE
                 if kind != "state" or entry.startswith("resume")]


@pytest.mark.parametrize("entry,kind,damage", DAMAGED_CASES, ids=["-".join(case) for case in DAMAGED_CASES])
@pytest.mark.xdist_group("pristine")
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_way_on(entry, kind, damage, pristine, tmp_path,
                                                                        monkeypatch, capsys):
    # Step 2 of the run damaged: whichever way a command reads it, one line names the file, says what is wrong in a
    # few words of its own (not torch's paragraphs), and how to go on: step 1 of the same folder, or another
    # checkpoint. Nothing saved changes.
    w = tmp_path / "w"
    shutil.copytree(pristine, w)
    path = w / CK / STEP_FILES[kind]
    path.write_bytes(DAMAGE[damage](path.read_bytes(), (w / CK / STEP_FILES[IN_ITS_PLACE[kind]]).read_bytes()))
    extra, name, advice = ENTRIES[entry]
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(w / "no-nanochat"))
    before = snapshot(w)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        grpo.main(flags(w, *extra(str(w / CK)), "--num-steps", "4", name=name))
    message, printed = exit_info.value.code, capsys.readouterr()
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    assert str(path) in message and all(text in message for text in advice), message
    assert not any(torch_words in message for torch_words in ("weights_only", "miniz", "Errno")), message
    assert "Traceback" not in printed.out + printed.err and not warned, [str(w.message) for w in warned]
    after = snapshot(w)
    assert {k: v for k, v in after.items() if k in before} == before, "a file saved before was changed"
    assert all(os.path.basename(k) == ".lock" for k in set(after) - set(before)), set(after) - set(before)


@pytest.mark.xdist_group("pristine")
def test_a_damaged_only_step_says_to_go_on_from_another_checkpoint(pristine, tmp_path, monkeypatch):
    # With no other step to fall back on, the line says so and names the way on that is left.
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "no-nanochat"))
    w = tmp_path / "w"
    shutil.copytree(pristine, w)
    for name in ("model_000001.pt", "meta_000001.json", "state_000001.pt"):
        (w / CK / name).unlink()
    (w / CK / "model_000002.pt").write_bytes(b"")
    for extra, name, says in ((["--init", str(w / CK)], "fresh", "no other step in"),
                              (["--resume"], "base", "no other step of the run has its training state")):
        with pytest.raises(SystemExit) as exit_info:
            grpo.main(flags(w, *extra, "--num-steps", "4", name=name))
        message = exit_info.value.code
        assert "model_000002.pt is damaged" in message and says in message and message.endswith("with --init"), message


# A step's meta file gone, its model file there: (entry, the steps whose meta is gone, the flags naming the step,
# what the line must say to do). The newest step's alone, named by default, is a save under way (nanochat writes the
# model first): skipped with a note (test_checkpoint_readers); --resume goes on from the newest complete step.
MISSING_META = [
    ("init", [2], ["--init-step", "2"], "the steps with model and meta files: 1"),
    ("eval-only", [2], ["--init-step", "2"], "the steps with model and meta files: 1"),
    ("ask", [2], ["--init-step", "2"], "the steps with model and meta files: 1"),
    ("teacher", [2], ["--teacher-step", "2"], "the steps with model and meta files: 1"),
    ("init", [1], ["--init-step", "1"], "start from step 2 instead (--init-step 2;"),
    ("init", [1, 2], [], f"no other step in {{ck}} has its model and meta files: copy that file again"),
]


@pytest.mark.parametrize("entry,gone,named,says", MISSING_META,
                         ids=[f"{case[0]}-{'-'.join(map(str, case[1]))}" for case in MISSING_META])
@pytest.mark.xdist_group("pristine")
def test_a_missing_meta_file_is_one_line_naming_the_steps_there(entry, gone, named, says, pristine, tmp_path,
                                                                 monkeypatch):
    w = tmp_path / "w"
    shutil.copytree(pristine, w)
    for step in gone:
        (w / CK / f"meta_{step:06d}.json").unlink()
    extra, name, advice = ENTRIES[entry]
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(w / "no-nanochat"))
    before = snapshot(w)
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(flags(w, *extra(str(w / CK)), *named, "--num-steps", "4", name=name))
    message = exit_info.value.code
    flag = "--teacher" if entry == "teacher" else "--init"
    missing = w / CK / f"meta_{gone[-1]:06d}.json"
    assert isinstance(message, str) and "\n" not in message, message
    assert message.startswith(f"error: {flag}: {missing} is missing: every model_<step>.pt needs its meta_<step>.json"
                              ), message
    assert says.format(ck=w / CK) in message and message.endswith(advice[1]), message
    assert snapshot(w) == before


@pytest.mark.xdist_group("pristine")
def test_a_checkpoint_file_cut_anywhere_is_named_as_damaged(pristine, tmp_path):
    # Every length a cut can leave, at a stride that lands in each of torch's failure bands (a few bytes: not a zip;
    # 4-69 KB: OSError EINVAL from its reader; beyond: no central directory), mapped (shapes only, resumes) or not.
    for kind in ("model", "state"):
        data = (pristine / CK / STEP_FILES[kind]).read_bytes()
        wrong = []
        for size in [*range(0, 64), *range(64, len(data), 4093), len(data) - 1]:
            path = tmp_path / f"{kind}_{size}.pt"
            path.write_bytes(data[:size])
            for mmap in (True, False):
                try:
                    model.load_tensors(str(path), mmap=mmap)
                    wrong.append((size, mmap, "read"))
                except Exception as e:
                    line = str(e)
                    if not (getattr(e, "path", None) == str(path) and line.startswith(f"{path} is damaged")
                            and "\n" not in line and "weights_only" not in line):
                        wrong.append((size, mmap, f"{type(e).__name__}: {line[:100]}"))
            path.unlink()
        assert not wrong, (kind, len(wrong), wrong[:3], wrong[-3:])


# ---------------------------------------------------------------------------- faults in a running run

def final_weights(run_dir, step):
    return grpo.load_checkpoint(os.path.join(run_dir, "chatrl_checkpoints", "d2"), step, log=lambda line: None)[0].state_dict()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_mid_run_keeps_the_last_checkpoint_and_resume_is_exact(tmp_path, monkeypatch):
    straight, broken = flags(tmp_path, "--save-every", "2", name="straight"), flags(tmp_path, "--save-every", "2", name="full")
    grpo.main(straight)
    real_mkstemp, calls = tempfile.mkstemp, []

    def mkstemp(*a, dir=None, **k):  # the disk fills up after the step-2 checkpoint (its 3 files) was written
        fd, path = real_mkstemp(*a, dir=dir, **k)
        if dir.endswith(os.path.join("full", "chatrl_checkpoints", "d2")):
            calls.append(path)
            if len(calls) > 3:
                os.close(fd)
                return os.open("/dev/full", os.O_WRONLY), path
        return fd, path

    with monkeypatch.context() as mp:
        mp.setattr(tempfile, "mkstemp", mkstemp)
        with pytest.raises(SystemExit) as exit_info:
            grpo.main(broken)
    message = exit_info.value.code
    assert message.startswith("error: cannot write ") and "state_000004.pt: No space left on device" in message, message
    assert "step 2 in" in message and "--resume" in message
    checkpoint_dir = tmp_path / "runs" / "full" / "chatrl_checkpoints" / "d2"
    assert sorted(os.listdir(checkpoint_dir)) == ["meta_000002.json", "model_000002.pt", "state_000002.pt"]  # no .tmp_
    grpo.main(broken + ["--resume"])  # the advice works, and the checkpoint it names was intact: the same weights
    for (k, a), b in zip(final_weights(tmp_path / "runs" / "straight", 4).items(), final_weights(tmp_path / "runs" / "full", 4).values()):
        assert torch.equal(a, b), k


def test_non_finite_weights_stop_before_saving_and_the_advice_works(tmp_path, monkeypatch):
    argv = flags(tmp_path, name="nan")
    real_step, calls = model_module.Muon.step, []

    def overflowing_step(self):  # an update from a finite loss that overflows, on the first update of step 3
        real_step(self)
        if self.param_groups[0]["params"][0].is_meta:  # the memory plan's dry step on the model's shapes
            return
        calls.append(1)
        per_update = len(self.stacks([p for group in self.param_groups for p in group["params"]]))  # once a stack
        if len(calls) == 4 * per_update + 1:  # grpo: 2 optimizer steps per training step
            self.param_groups[0]["params"][0].data[0, 0] = float("inf")

    with monkeypatch.context() as mp:
        mp.setattr(model_module.Muon, "step", overflowing_step)
        with pytest.raises(SystemExit) as exit_info:
            grpo.main(argv)
    message = exit_info.value.code
    assert "step 3: the update made weights non-finite" in message and "stopped without saving" in message, message
    checkpoint_dir = str(tmp_path / "runs" / "nan" / "chatrl_checkpoints" / "d2")
    assert f"step 2 in {checkpoint_dir}" in message and "--resume" in message and "learning rate" in message
    assert grpo.checkpoint_steps(checkpoint_dir) == [1, 2]
    assert all(torch.isfinite(v).all() for v in final_weights(tmp_path / "runs" / "nan", 2).values())
    grpo.main(argv + ["--resume", "--matrix-lr", "0.01"])  # what the message says to do
    assert grpo.checkpoint_steps(checkpoint_dir) == [1, 2, 3, 4]
    assert all(torch.isfinite(v).all() for v in final_weights(tmp_path / "runs" / "nan", 4).values())
    config = json.load(open(tmp_path / "runs" / "nan" / "config.json"))
    assert config["matrix_lr"] == 0.01 and config["resumed_with"] == [{"step": 2, "matrix_lr": [0.02, 0.01]}]


def test_a_lock_held_by_another_process_blocks_and_a_dead_ones_does_not(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "locked"
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)",
                               str(run_dir / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match="another grpo.py process is running in"):
            grpo.main(flags(tmp_path, "--num-steps", "1", name="locked"))
    finally:
        holder.kill()  # kill -9: it cannot release anything itself
        holder.wait()
    grpo.main(flags(tmp_path, "--num-steps", "1", name="locked"))
    assert os.path.isfile(run_dir / "chatrl_checkpoints" / "d2" / "model_000001.pt")


def test_a_file_system_without_locks_trains_with_a_warning(tmp_path, monkeypatch, capsys):
    def no_locks(*a):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    grpo.main(flags(tmp_path, "--num-steps", "1", name="nfs"))
    assert "warning: cannot lock" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "runs" / "nfs" / "chatrl_checkpoints" / "d2" / "model_000001.pt")


def test_interrupt_names_the_checkpoint_to_resume_from(tmp_path, monkeypatch):
    save = grpo.save_training_state

    def save_then_ctrl_c(run_dir, tag, step, *a):
        save(run_dir, tag, step, *a)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "save_training_state", save_then_ctrl_c)
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(flags(tmp_path, name="ctrl-c"))
    assert exit_info.value.code.startswith("error: interrupted. The run's newest checkpoint, step 2 in ")

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "load_policy", ctrl_c)  # before the run wrote anything
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(flags(tmp_path, name="early"))
    assert exit_info.value.code == "error: interrupted. Nothing of this run was written yet: run the command again"


def test_a_resumed_runs_wall_time_counts_every_segment(tmp_path, run_killed_after_first_save):
    argv = flags(tmp_path, "--save-every", "2", name="segments")
    run_killed_after_first_save(argv)
    first = [json.loads(line) for line in open(tmp_path / "runs" / "segments" / "metrics.jsonl")]
    grpo.main(argv + ["--resume"])
    metrics = [json.loads(line) for line in open(tmp_path / "runs" / "segments" / "metrics.jsonl")]
    assert [m["wall_time"] for m in metrics[:2]] == [m["wall_time"] for m in first[:2]]
    assert metrics[2]["wall_time"] > metrics[1]["wall_time"]


# ---------------------------------------------------------------------------- end to end: the messages a user sees

def start_script(*argv, limit_file_bytes=None):
    def limit():  # a file system that is full beyond this many bytes per file: writes fail with EFBIG
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "grpo.py"), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=limit if limit_file_bytes else None)


def finished(process):
    _, stderr = process.communicate(timeout=300)
    return SimpleNamespace(returncode=process.returncode, stderr=stderr)


@pytest.mark.xdist_group("pristine")
def test_end_to_end_messages(pristine, tmp_path):
    # A run as a user starts it, in its own interpreter: a checkpoint too large for the disk. The first save fails;
    # the process exits with status 1 and one line that says nothing was saved. (test_bad_input_and_faults checks
    # every other message in this process: the line is sys.exit's, the same in both.)
    full = tmp_path / "full"
    shutil.copytree(pristine, full)
    result = finished(start_script(*flags(full, "--num-steps", "1", "--n-embd", "128", name="big"),
                                   limit_file_bytes=500_000))
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr  # the line alone, no traceback
    last = result.stderr.strip()
    assert last.startswith("error: cannot write ") and "File too large" in last
    assert "No checkpoint of this run was saved" in last
    # the advice that works (test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it_over runs it)
    assert last.endswith("start it over from step 0 with the same command and --resume")
    assert not [f for _, _, files in os.walk(full / "runs" / "big") for f in files if f.startswith(".tmp_")]


def test_a_bad_flag_leaves_the_defaults_of_later_parses_alone(capsys):
    with pytest.raises(SystemExit):
        grpo.resolve_config(["--demo", "--lr", "fast"])  # exits inside the parse, with the demo's defaults set
    assert grpo.resolve_config([]).task == "gsm8k"


@pytest.mark.parametrize("phase,flag", [("sampling", "--sample-batch-size"), ("log-probs", "--device-batch-size"),
                                        ("update", "--device-batch-size"), ("eval", "--eval-max-new-tokens")])
def test_out_of_gpu_memory_is_one_line_naming_the_phase_and_the_flag(phase, flag, tmp_path, monkeypatch):
    # torch.OutOfMemoryError raised where a GPU would raise it in each phase, in step 2, after step 1 was saved
    armed = []
    save, generate, token_logprobs = grpo.save_training_state, tasks.generate, grpo.GPT.token_logprobs

    def save_then_arm(*a, **k):
        save(*a, **k)
        armed.append(True)

    def out_of_memory_in(this_phase, call):
        def call_or_raise(*a, **k):
            if armed and phase == this_phase(*a, **k):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return call(*a, **k)
        return call_or_raise

    monkeypatch.setattr(grpo, "save_training_state", save_then_arm)
    monkeypatch.setattr(tasks, "generate", out_of_memory_in(  # greedy: the eval's; sampled: the step's
        lambda *a, temperature=1.0, **k: "eval" if temperature == 0 else "sampling", generate))
    monkeypatch.setattr(grpo.GPT, "token_logprobs", out_of_memory_in(  # no gradient: pi_ref's or pi_old's
        lambda *a, **k: "update" if torch.is_grad_enabled() else "log-probs", token_logprobs))
    argv = flags(tmp_path, "--eval-every", "2", "--eval-examples", "4", "--final-eval-examples", "4")
    with pytest.raises(SystemExit) as stop:
        grpo.main(argv)
    message = str(stop.value.code)
    assert message == message.strip() and "\n" not in message
    assert message.startswith(f"error: out of GPU memory {dict(sampling='while sampling', eval='in the eval').get(phase, '')}")
    assert flag in message and "step 1 in " in message and message.endswith("go on from it with --resume")
    assert {"log-probs": "old and reference log-probs", "update": "in the update"}.get(phase, "") in message


def test_a_short_write_while_saving_is_the_disks_error_not_a_traceback(tmp_path, monkeypatch):
    # A file-size limit or a full disk can cut torch.save's last write short: nothing fails after it, and torch's
    # end-of-file check stops with "unexpected pos", a RuntimeError without the errno (seen once in this suite, a
    # traceback instead of the one-line message), unless the rest is written and its OSError kept.
    import model
    real_fdopen = os.fdopen
    model.atomic_save({"w": torch.zeros(1000)}, str(tmp_path / "whole.pt"))
    size = os.path.getsize(tmp_path / "whole.pt")
    os.remove(tmp_path / "whole.pt")

    class FillsUp:  # room for all but the last 10 bytes
        def __init__(self, f):
            self.f, self.room = f, size - 10

        def write(self, data):
            if self.room == 0:
                raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
            n = min(len(data), self.room)
            self.room -= n
            return self.f.write(bytes(data)[:n])

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(model.os, "fdopen", lambda fd, mode: FillsUp(real_fdopen(fd, mode)))
    with pytest.raises(OSError) as error:
        model.atomic_save({"w": torch.zeros(1000)}, str(tmp_path / "model.pt"))
    assert error.value.errno == errno.EFBIG and error.value.filename == str(tmp_path / "model.pt")
    assert os.listdir(tmp_path) == []


def test_a_damaged_first_step_points_at_the_nearest_later_one():
    error = model_module.CheckpointFileError("/ckpt/d2/model_000005.pt", "/ckpt/d2/model_000005.pt is cut short")
    with pytest.raises(SystemExit) as stop:
        grpo.unusable_checkpoint("--init", error, [5, 7, 9])
    assert "start from step 7 instead (--init-step 7;" in str(stop.value.code)
