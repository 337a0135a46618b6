"""The start-up self-check (grpo.self_check): the run's fast paths against the plain one, on the device, before the
first step. On the CPU the flash-attention branch is forced, through the kernel's strict stand-in (tests/kernels.py),
healthy or faulty."""
import os

import pytest
import torch

import grpo
import model as model_module
from kernels import strict_varlen_attn

FLAGS = ["--demo", "--num-steps", "1", "--eval-every", "0", "--final-eval-examples", "1", "--dtype", "bfloat16",
         "--prompts-per-step", "4", "--num-samples", "4", "--self-check"]  # a small first batch: bf16 is slow on a CPU


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
            "--final-eval-examples", "1", "--pass-k", "0", "--self-check", *extra]


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
    # demo's fresh model and on a fixture checkpoint with GSM8K's settings
    flash_on_the_cpu(kernel)
    argv = FLAGS + ["--runs-dir", str(tmp_path)] if start == "demo" else fixture_flags(
        tmp_path, request.getfixturevalue("gsm8k_dir"), "smear-backout", "--dtype", "bfloat16")
    if not fault:
        grpo.main(argv + ["--decode", "static"])
        assert "the sampler's decode (--decode static)" in capsys.readouterr().out
        return
    with pytest.raises(SystemExit) as stop:
        grpo.main(argv + ["--decode", "static"])
    message = str(stop.value.code)
    assert message.startswith("error: self-check: the sampler's decode (--decode static)") and "--decode dynamic" in \
        message and "\n" not in message
