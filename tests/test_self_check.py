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
