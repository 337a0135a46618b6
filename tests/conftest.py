import json
import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GSM8K_DIR = os.path.join(ROOT, "..", "shared", "data", "gsm8k")


@pytest.fixture
def gsm8k_dir():
    if not os.path.isfile(os.path.join(GSM8K_DIR, "test.jsonl")):
        pytest.skip("real GSM8K not found at ../shared/data/gsm8k")
    return GSM8K_DIR


class Killed(BaseException):
    """A kill -9 in a test: nothing in grpo.py handles it, as nothing can handle the signal."""


@pytest.fixture
def run_killed_after_first_save(monkeypatch):
    """grpo.main(argv), stopped right after its first checkpoint is written, as a kill at that moment would."""
    import grpo
    save = grpo.save_training_state

    def save_then_crash(*a, **k):
        save(*a, **k)
        raise Killed

    def run(argv):
        with monkeypatch.context() as patched:
            patched.setattr(grpo, "save_training_state", save_then_crash)
            with pytest.raises(Killed):
                grpo.main(argv)
    return run


@pytest.fixture(autouse=True)
def runs_on_the_cpu(request, monkeypatch):
    """The suite's runs are CPU runs (float32, no compile, gloo ranks, CPU timings), on a GPU machine too, where
    grpo.py would default to CUDA; a test marked `cuda` gets the GPU, and is skipped without one."""
    import torch
    if request.node.get_closest_marker("cuda"):
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        return
    # Not CUDA_VISIBLE_DEVICES: torch counts the devices once, so an empty value would hide the GPU from the CUDA
    # tests after this one. The runs a test starts as processes are demo runs, which pin the CPU (--demo).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def repository_files():
    """path -> (mtime, size) of each file in the repository, but in Python's caches (__pycache__), hidden folders
    (.git, .pytest_cache, pytest-benchmark's .benchmarks), virtual environments (pyvenv.cfg) and the GPU session's own
    files ($NANOGRPO_SESSION_FILES: tests/gpu_session.py runs the CUDA tests while it writes its rows, and pytest its
    log, into its --out, which may be inside the repository; any other file a test writes there is seen): what a
    test may not change."""
    found = {}
    listed = os.environ.get("NANOGRPO_SESSION_FILES", "")  # a JSON list (a path may hold os.pathsep)
    session_files = {os.path.realpath(path) for path in
                     (json.loads(listed) if listed.startswith("[") else listed.split(os.pathsep)) if path}

    def left_out(path):
        return os.path.basename(path).startswith(".") or os.path.basename(path) == "__pycache__" or \
            os.path.isfile(os.path.join(path, "pyvenv.cfg"))
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not left_out(os.path.join(folder, name))]
        for name in files:
            path = os.path.join(folder, name)
            if session_files and os.path.realpath(path) in session_files:
                continue
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # removed between the listing and now
                continue
            found[os.path.relpath(path, ROOT)] = (stat.st_mtime_ns, stat.st_size)
    return found


SEEN = {}  # the repository's files as the last test left them: each test's "before" is the previous one's "after"


@pytest.fixture(autouse=True)
def writes_nothing_into_the_repository():
    """Every test writes under its tmp_path: a file it adds, changes or removes in the repository fails it. A look
    at the files themselves, not `git status` (which hides ignored paths such as runs/, and needs git) nor a change
    of directory (the runs the tests start as processes run in the repository, and absolute paths ignore it). One
    walk of the repository a test (about 1 ms). Under pytest -n the test running beside the culprit on the other
    worker may fail with it; the culprit always does (a module fixture's write: the module's next test)."""
    before = SEEN.get("files") or repository_files()
    yield
    SEEN["files"] = after = repository_files()
    changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    assert not changed, f"the test wrote into the repository (write under tmp_path instead): {changed}"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (torch.compile on the CPU, learning measured)")


def free_port():
    """A TCP port no process listens on now: each rank launch its own, so that runs in parallel never meet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def pytest_configure(config):
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):  # a process that runs tests
        # (pytest -n's coordinator runs none: it does without torch's 3 s import, before its workers start)
        # grpo before torch: it bounds how long OpenMP's waiting threads spin (OPENMP_SPIN) before torch loads
        # libgomp, so the suite's time, like a run's, hangs less on what else the machine runs. The processes the
        # tests start inherit it.
        import grpo  # noqa: F401
        import torch
        if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N processes share the cores, one thread each, as
            os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks do; the runs the tests start as processes too
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if config.pluginmanager.has_plugin("hypothesispytest"):  # where installed: the suite has no property tests,
        config.pluginmanager.unregister(name="hypothesispytest")  # and its plugin imports hypothesis at the end (1-2 s)
    config.addinivalue_line("markers", "slow: the compiler, and learning measured, past the suite's 2 minutes: --slow")
    config.addinivalue_line("markers", "xdist_group(name): with pytest -n, these tests run on one worker")
    config.addinivalue_line("markers", "cuda: runs on a CUDA GPU; skipped without one")


# The tests that take 5-25 s each (whole runs in other processes, learning from scratch under --slow): run first, so
# that under pytest -n the two workers do not end with one of them alone on a long test.
LONG_FIRST = ("rank_runs", "test_faults_launch.py", "learned_from_scratch", "learns_from_random_weights",
              "pristine")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--slow"):
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="slow: run with --slow"))
    items.sort(key=lambda item: not any(key in item.nodeid or key in item.fixturenames for key in LONG_FIRST))


# Equal up to rounding: two computations that differ only in the order of their float32 sums (ranks, passes,
# packing). No absolute tolerance tuned on one processor: the bounds scale with what is summed.
UNIT_ROUNDOFF = 2.0 ** -24  # float32's unit roundoff u: one rounding moves a value by at most u x itself


def assert_same_sum(a, b, terms):
    """a and b: one sum (or mean) of `terms` non-negative float32 values, added in two orders. A float32 sum of n
    such terms is within (n - 1) u of its exact value, relatively (Higham, Accuracy and Stability of Numerical
    Algorithms, 2002, eq. 4.4), so the two are within twice that of each other."""
    assert abs(a - b) <= 2 * (terms - 1) * UNIT_ROUNDOFF * max(abs(a), abs(b)), (a, b, terms)


# How far two runs' weights (and losses) may part, as a share of how far a step moved them (of the loss's size). A
# step is learning-rate sized (1e-3 in the rank tests, 0.2 x a scale for nanochat's embeddings) and its rounding
# scales with it, so no absolute tolerance holds for both. The last bits that another summation order changes in a
# gradient are amplified where AdamW divides a near-zero gradient element by its own size, by Muon's
# orthogonalisation, and by a second step on the same batch: measured on 2026-11-27 (AMD EPYC, torch 2.13.0), up to
# 6e-4 of the step (grpo on the classic fixture, 2 ranks; 5e-5 for reinforce on smear-backout, whose 1.9e-6 an
# absolute 1e-6 refused on an Intel CPU). A hundredth leaves room for other processors and stays far below a real
# difference (a missed or doubled micro-batch, another row's gradient, a loss off by a factor: order 1).
SAME_STEP_SHARE = 1e-2


def assert_same_steps(a, b, start):
    """State dicts a and b, each the weights after the same steps from `start` (a state dict), taken in another
    summation order: each tensor's largest difference is at most SAME_STEP_SHARE of how far the tensor moved."""
    for k, v in a.items():
        moved = (v - start[k]).abs().max().item()
        assert (v - b[k]).abs().max().item() <= SAME_STEP_SHARE * moved, (k, (v - b[k]).abs().max().item(), moved)
