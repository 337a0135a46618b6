"""CPU threads: a fixed count a run (grpo.thread_policy), waiting threads that spin briefly (grpo.OPENMP_SPIN)."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_openmp_spins_briefly_before_torch_loads_unless_the_user_says_otherwise():
    show = ("import os, grpo; print(os.environ.get('GOMP_SPINCOUNT'), "
            "__import__('torch').__config__.parallel_info().count('OpenMP') > 0)")
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    cases = {"default": base, "own": dict(base, GOMP_SPINCOUNT="5"), "policy": dict(base, OMP_WAIT_POLICY="active")}
    runs = {name: subprocess.Popen([sys.executable, "-c", show], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
            for name, env in cases.items()}
    out = {name: run.communicate()[0].split() for name, run in runs.items()}
    assert out["default"] == [grpo.OPENMP_SPIN, "True"]
    assert out["own"][0] == "5" and out["policy"][0] == "None"


@pytest.mark.parametrize("case, expected, count", [
    (dict(threads=1), "threads: 1 (--threads;", 1),
    (dict(env="3"), "(OMP_NUM_THREADS;", 2),
    (dict(world_size=2), "threads: 1 (one per rank", 1),
    (dict(device="cuda"), "on the host", 2),
    (dict(), "threads: 2 (torch's default, one per core; GOMP_SPINCOUNT=", 2),
])
def test_the_policy_says_what_sets_the_count(case, expected, count, monkeypatch):
    if "env" in case:
        monkeypatch.setenv("OMP_NUM_THREADS", case["env"])
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        line = grpo.thread_policy(SimpleNamespace(threads=case.get("threads")),
                                  torch.device(case.get("device", "cpu")), case.get("world_size", 1))
        assert expected in line and torch.get_num_threads() == count
    finally:
        torch.set_num_threads(threads)
