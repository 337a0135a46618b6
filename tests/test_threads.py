"""CPU threads: a fixed count a run (grpo.thread_policy), waiting threads that spin briefly (grpo.OPENMP_SPIN)."""
import os
import runpy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_openmp_spins_briefly_before_torch_loads_unless_the_user_says_otherwise(monkeypatch):
    # before torch loads libgomp: only a new interpreter shows that, one
    show = ("import os, grpo; print(os.environ.get('GOMP_SPINCOUNT'), "
            "__import__('torch').__config__.parallel_info().count('OpenMP') > 0)")
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", show], cwd=ROOT, env=base, stdout=subprocess.PIPE, text=True).stdout
    assert out.split() == [grpo.OPENMP_SPIN, "True"]
    # a user's own setting wins: grpo.py's top lines run again here, under the user's variables
    for users, expected in ((dict(GOMP_SPINCOUNT="5"), "5"), (dict(OMP_WAIT_POLICY="active"), None)):
        with monkeypatch.context() as patched:
            for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
                patched.delenv(name, raising=False)
            for name, value in users.items():
                patched.setenv(name, value)
            runpy.run_path(os.path.join(ROOT, "grpo.py"))
            assert os.environ.get("GOMP_SPINCOUNT") == expected, users


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
