"""The start-up self-check (grpo.self_check): the run's fast paths against the plain one, on the device, before the
first step. On the CPU the flash-attention branch is forced, through the kernel's strict stand-in (tests/kernels.py),
healthy or faulty."""
import os

import pytest
import torch

import grpo
import model as model_module
from kernels import strict_varlen_attn

# a small first batch: bf16 is slow on a CPU
FLAGS = ["--demo", "--num-steps", "1", "--eval-every", "0", "--final-eval-examples", "1", "--dtype", "bfloat16",
         "--prompts-per-step", "4", "--num-samples", "4", "--self-check", "--no-plot"]
FLOAT32 = ["float32" if flag == "bfloat16" else flag for flag in FLAGS]  # where the faults are large ones


def kernel_computing_half_of_each_span(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
    """A fast path gone wrong: the kernel told half the longest span leaves the rest of each longer span unwritten."""
    return strict_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max(1, max_q // 2), max_k, drop_past_max=True, **kwargs)


@pytest.fixture
def flash_on_the_cpu(monkeypatch):
    monkeypatch.setattr(model_module, "flash_varlen", lambda q: q.dtype in (torch.bfloat16, torch.float16))
    monkeypatch.setitem(model_module.DECODE_FLASH, "failed", False)
    monkeypatch.setattr(model_module, "VARLEN_GQA", True)  # torch 2.12's kernel on, grouped heads and all

    def use(kernel):
        monkeypatch.setattr(model_module, "varlen_attn", kernel)
    return use


def test_a_healthy_fast_path_passes_and_prints_its_differences(tmp_path, capsys, flash_on_the_cpu):
    flash_on_the_cpu(strict_varlen_attn)
    grpo.main(FLAGS + ["--runs-dir", str(tmp_path)])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("self-check:"))
    assert "packed passes vs the plain float32 path: log-probs" in line and "gradient" in line and "decode" in line


def test_a_faulty_fast_path_stops_the_run_at_start_with_one_line_and_writes_nothing(tmp_path, flash_on_the_cpu):
    flash_on_the_cpu(kernel_computing_half_of_each_span)
    with pytest.raises(SystemExit) as stop:
        grpo.main(FLAGS + ["--runs-dir", str(tmp_path)])
    message = str(stop.value.code)
    assert message.startswith("error: self-check: packed passes") and "--no-pack" in message
    assert "\n" not in message
    assert all(set(os.listdir(run_dir)) <= {".lock"} for run_dir in tmp_path.iterdir())  # nothing but the lock


def fixture_flags(tmp_path, gsm8k_dir, generation, *extra):
    from test_generations import FIXTURES
    checkpoint = os.path.join(FIXTURES, generation, "base", "chatsft_checkpoints", "d4")
    if not os.path.isdir(checkpoint):
        pytest.skip("nanochat fixtures not found (../shared/fixtures/nanochat or $NANOGRPO_FIXTURES)")
    return ["--init", checkpoint, "--task", "gsm8k", "--gsm8k-dir", gsm8k_dir, "--device", "cpu", "--runs-dir",
            str(tmp_path), "--num-steps", "1", "--prompts-per-step", "1", "--max-new-tokens", "8", "--eval-every", "0",
            "--final-eval-examples", "1", "--pass-k", "0", "--self-check", "--no-plot", *extra]


@pytest.mark.parametrize("algo", ["reinforce", "grpo"])
def test_the_check_takes_its_own_replies_a_question_whatever_the_runs(tmp_path, capsys, gsm8k_dir, algo):
    # A checkpoint whose log-probs depend on the context (the run's 4 replies a question, the check's 2: a prompt
    # mix-up would show; nanochat's aggregation, whose passes are shaped by the replies a question). The default 16:
    # the rehearsal tests (test_grpo.py).
    grpo.main(fixture_flags(tmp_path, gsm8k_dir, "value-embeds", "--algo", algo, "--num-samples", "4"))
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("self-check:"))
    assert "; 8 rows;" in line and "zero output projections" not in line


def neighbours_output(q, k, v, pack, mask, window, gqa, attention=model_module.packed_attention):
    """Packed attention gone wrong in one place: position 5 of the packed sequence gets position 4's output."""
    y = attention(q, k, v, pack, mask, window, gqa).clone()
    y[5] = y[4]
    return y


@pytest.mark.parametrize("start", ["demo", "fixture"])
def test_an_attention_fault_stops_the_run_at_its_self_check(tmp_path, monkeypatch, gsm8k_dir, start):
    # A fresh model (the demo's) attends to nothing (nanochat's init zeroes the output projections) and its head is
    # tiny: the check fills both with noise, so that a fault shows there too.
    monkeypatch.setattr(model_module, "packed_attention", neighbours_output)
    argv = (FLAGS + ["--runs-dir", str(tmp_path)] if start == "demo" else
            fixture_flags(tmp_path, gsm8k_dir, "smear-backout"))
    with pytest.raises(SystemExit) as stop:
        grpo.main(argv)
    message = str(stop.value.code)
    assert message.startswith("error: self-check: packed passes: log-probs differ") and "--no-pack" in message


def kernel_missing_each_rows_newest_key(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=None, **kwargs):
    """A decode step gone wrong: each row's keys read one short (the column the step wrote left out; not in the
    one-key call that checks the kernel takes seqused_k at all)."""
    if seqused_k is not None:
        seqused_k = seqused_k - (seqused_k > 1).int()
    return strict_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=seqused_k, **kwargs)


@pytest.mark.parametrize("kernel, fault, start", [(strict_varlen_attn, None, "demo"),
                                                  (kernel_missing_each_rows_newest_key, True, "demo"),
                                                  (strict_varlen_attn, None, "fixture"),
                                                  (kernel_missing_each_rows_newest_key, True, "fixture")])
def test_the_self_check_covers_a_gpus_decode_step_over_each_rows_written_columns(tmp_path, capsys, flash_on_the_cpu,
                                                                                kernel, fault, start, request):
    # --decode static on the CPU with the flash branch forced: each decode step's attention is varlen_attn over the
    # rows' written columns (seqused_k), as a GPU run's captured step; the check's sampler log-probs cover it, on the
    # demo's fresh model and on a fixture checkpoint with GSM8K's settings. The fixture's replies at the check's full
    # length (16 tokens; GSM8K's runs sample longer): at 8, a trained d4's bf16 rounding on an Intel Xeon (max 0.047)
    # hid this fault (0.091), which shows at 16 (0.25 against the bound 0.17)
    flash_on_the_cpu(kernel)
    argv = FLAGS + ["--runs-dir", str(tmp_path)] if start == "demo" else fixture_flags(
        tmp_path, request.getfixturevalue("gsm8k_dir"), "smear-backout", "--dtype", "bfloat16", "--max-new-tokens", "16")
    if not fault:
        grpo.main(argv + ["--decode", "static"])
        assert "the sampler's decode (--decode static)" in capsys.readouterr().out
        return
    with pytest.raises(SystemExit) as stop:
        grpo.main(argv + ["--decode", "static"])
    message = str(stop.value.code)
    assert message.startswith("error: self-check: the sampler's decode (--decode static)") and "--decode dynamic" in \
        message and "\n" not in message


# The check's rows end at staggered steps (model.staggered_ends), so that the decode's batch shrinks as a run's does:
# the static decode halves (each smaller batch its own step, captured on a GPU), the dynamic one drops rows.

def decode_batches_of_the_check(monkeypatch):
    """-> the batch sizes of the decode steps that the self-check runs (filled in as it runs)."""
    sizes, step, check = [], model_module.decode_step, grpo.self_check
    monkeypatch.setattr(model_module, "decode_step", lambda model, cache, *a: sizes.append(cache.pad.numel()) or step(
        model, cache, *a))
    checked = []

    def recorded(args, run):
        sizes.clear()
        check(args, run)
        checked.extend(sizes)
    monkeypatch.setattr(grpo, "self_check", recorded)
    return checked


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_the_checks_rows_end_at_staggered_steps_so_every_smaller_batch_decodes(tmp_path, capsys, monkeypatch,
                                                                              decode):
    sizes = decode_batches_of_the_check(monkeypatch)
    grpo.main(FLOAT32 + ["--decode", decode, "--runs-dir", str(tmp_path)])
    assert sorted(set(sizes), reverse=True) == [8, 4, 2, 1] and sizes == sorted(sizes, reverse=True)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("self-check:"))
    assert f"(--decode {decode}) log-probs" in line and "rows made to end at steps 1, 3, 5" in line


def halving_that_leaves_the_padding_behind(cache, rows, select=model_module.KVCache.select):
    """The static decode's halving gone wrong: the rows move up in the cache, their padding counts stay where they
    were (each row then attends to another row's padding, or into its own prompt)."""
    pad = cache.pad
    select(cache, rows)
    if cache.static:
        cache.pad = pad[:len(rows)]


def drop_that_leaves_the_smear_behind(cache, rows, select=model_module.KVCache.select):
    """A row drop gone wrong: each row's last embedding (the smear's previous token) stays where it was."""
    previous = cache.previous
    select(cache, rows)
    if previous is not None and len(rows) < previous.size(0):
        cache.previous = previous[:len(rows)]


def drop_that_leaves_the_padding_behind(cache, rows, select=model_module.KVCache.select):
    """The dynamic decode's row drop gone wrong: the kept rows' padding counts stay where they were."""
    pad = cache.pad
    select(cache, rows)
    if not cache.static and len(rows) < pad.numel():
        cache.pad = pad[:len(rows)]


@pytest.mark.parametrize("fault, decode, start", [
    (halving_that_leaves_the_padding_behind, "static", "demo"),
    (halving_that_leaves_the_padding_behind, "static", "fixture"),
    (drop_that_leaves_the_smear_behind, "dynamic", "fixture"),
    (drop_that_leaves_the_padding_behind, "dynamic", "demo")])  # the demo's classic GPT has no smear
def test_a_shrinking_batch_that_loses_its_rows_state_stops_the_run_at_its_check(tmp_path, monkeypatch, gsm8k_dir,
                                                                               fault, decode, start):
    # each fault moves logits only once rows have finished and the batch shrinks (before, no row of a fixture or
    # of the demo ended within the check's replies: the check passed); the demo's prompts are all one length, and
    # the check gives them different ones, so that padding differs between rows
    monkeypatch.setattr(model_module.KVCache, "select", fault)
    argv = (FLAGS + ["--runs-dir", str(tmp_path)] if start == "demo" else
            fixture_flags(tmp_path, gsm8k_dir, "smear-backout", "--dtype", "bfloat16"))
    with pytest.raises(SystemExit) as stop:
        grpo.main(argv + ["--decode", decode])
    message = str(stop.value.code)
    assert message.startswith(f"error: self-check: the sampler's decode (--decode {decode}): its log-probs differ")
    assert ("run with --decode dynamic" in message) == (decode == "static") and "\n" not in message


# With a teacher, the check compares the teacher's own forward and the student's top-k gather (the forward KL's own
# head, compiled) with their plain paths. --compile on the CPU with the compiler stood in for by the functions it
# compiles (as the rehearsals, tests/rank_runs.py), so that a fault can be put in a compiled function only.

@pytest.fixture
def compiled_by_stand_ins(monkeypatch):
    """-> use(hidden, head): the compiled forward and head stood in for by these functions."""
    def use(hidden=model_module.GPT.hidden, head=model_module.GPT.head_logprobs):
        monkeypatch.setattr(model_module, "compiled_hidden", lambda static: hidden)
        monkeypatch.setattr(model_module, "compiled_head_logprobs", lambda: head)
        monkeypatch.setattr(model_module, "compiled_decode_step", lambda: model_module.decode_step)
    return use


def head_gathering_the_wrong_tokens(self, x, targets, temperature, with_entropy, entropy_grad=True, top_ids=None):
    """The student's top-k gather gone wrong: each of the teacher's tokens given its neighbour's log-prob."""
    out = model_module.GPT.head_logprobs(self, x, targets, temperature, with_entropy, entropy_grad, top_ids)
    return out if top_ids is None else out[:-2] + (out[-2].roll(1, dims=1), out[-1])


def teachers_forward_a_position_late(self, idx, cache=None, pack=None):
    """The teacher's compiled forward gone wrong (a frozen model's: the teacher is the one the check runs compiled):
    each position given the hidden state of the one before."""
    x = model_module.GPT.hidden(self, idx, cache, pack)
    return x if any(p.requires_grad for p in self.parameters()) else x.roll(1, dims=1)


def distill_flags(tmp_path, gsm8k_dir, start, *extra):
    if start == "demo":
        from test_distill import teacher_folder
        return FLOAT32 + ["--runs-dir", str(tmp_path), "--teacher", str(teacher_folder(tmp_path)), *extra]
    from test_generations import FIXTURES
    teacher = os.path.join(FIXTURES, "value-embeds", "base", "chatsft_checkpoints", "d4")  # the same tokenizer
    return fixture_flags(tmp_path, gsm8k_dir, "smear-backout", "--teacher", teacher, *extra)


@pytest.mark.parametrize("fault, divergence, start", [
    ("gather", "forward", "demo"), ("gather", "forward", "fixture"), ("teacher", "forward", "demo"),
    ("teacher", "forward", "fixture"), ("teacher", "sampled", "demo")])
def test_a_wrong_top_k_gather_or_teacher_forward_stops_the_run_at_its_check(tmp_path, gsm8k_dir,
                                                                            compiled_by_stand_ins, fault, divergence,
                                                                            start):
    compiled_by_stand_ins(**({"head": head_gathering_the_wrong_tokens} if fault == "gather" else
                             {"hidden": teachers_forward_a_position_late}))
    algo = ["--algo", "distill"] if divergence == "forward" else ["--distill-coef", "0.5"]
    # the fixture's fast path unpacked: packed, a compiled pass takes the task's longest prompt (995 tokens) as its
    # static shape, which a CPU's exact attention pays for in full (seconds)
    layout = ["--no-pack"] if start == "fixture" else []
    with pytest.raises(SystemExit) as stop:
        grpo.main(distill_flags(tmp_path, gsm8k_dir, start, *algo, "--compile", *layout))
    message = str(stop.value.code)
    path = "padded rows, compiled" if layout else "packed passes, compiled"
    assert message.startswith("error: self-check: " + (
        f"{path}: the forward KL at the teacher's top-k (the student's gather) differ" if fault == "gather" else
        f"the teacher's forward ({path}): its log-probs differ"))
    assert ("--no-compile" if layout else "--no-pack and --no-compile") in message and "\n" not in message


@pytest.mark.parametrize("divergence", ["forward", "sampled"])
def test_with_a_teacher_the_check_passes_on_healthy_paths_and_leaves_the_weights_as_they_were(
        tmp_path, capsys, monkeypatch, compiled_by_stand_ins, divergence):
    # bf16: the teacher is stored with bf16 matrices, which its float32 path upcasts for the while and rounds back;
    # the run's weights after a step are byte for byte those of the run without the check, the teacher's untouched
    compiled_by_stand_ins()
    check, teachers = grpo.self_check, []

    def checked(args, run):
        before = {k: v.clone() for k, v in run.teacher.state_dict().items()}
        check(args, run)
        teachers.append(all(torch.equal(v, before[k]) and v.dtype == before[k].dtype
                            for k, v in run.teacher.state_dict().items()))
    monkeypatch.setattr(grpo, "self_check", checked)
    algo = ["--algo", "distill"] if divergence == "forward" else ["--distill-coef", "0.5"]
    weights = {}
    for self_check in ("--self-check", "--no-self-check"):
        flags = distill_flags(tmp_path, None, "demo", *algo, "--compile", "--dtype", "bfloat16", "--save-every", "1",
                              "--run-name", self_check[2:])
        grpo.main([flag for flag in flags if flag != "--self-check"] + [self_check])
        folder = tmp_path / self_check[2:] / "chatrl_checkpoints" / "d2"
        weights[self_check] = (folder / "model_000001.pt").read_bytes()
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("self-check:"))
    assert "the teacher's forward" in line and ("the forward KL" in line) == (divergence == "forward")
    assert teachers == [True] and weights["--self-check"] == weights["--no-self-check"]
