"""The one-call GPU session (tests/gpu_session.py), rehearsed on the CPU: every part at tiny shapes (--smoke), the
plan within 9 minutes, a session cut by its budget or killed keeping the rows it wrote, parts stopped at their
deadlines and a session ended by its watchdog (stand-in parts on a small time scale), --out inside the checkout,
the device copy's data."""
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import bench_vs_nanochat
import gpu_session
import session_watchdog
from conftest import ROOT

SHARED = os.path.join(ROOT, "..", "shared")


@pytest.fixture(autouse=True)
def in_this_process(monkeypatch):
    """main runs in the suite's process, which goes on after it: its watchdog is released when it returns (run as a
    script, the watchdog watches the process until it is gone)."""
    monkeypatch.setattr(gpu_session, "RELEASE_ON_RETURN", True, raising=False)  # (raising: run on main before it)


def rows_of(out):
    """-> (the session headers, the part rows) of DIR/results.jsonl; checks that DIR/results.md has the same rows."""
    lines = [json.loads(line) for line in open(out / "results.jsonl")]
    table = [line for line in open(out / "results.md") if line.startswith("| ") and not line.startswith(("| part",
                                                                                                          "| ---"))]
    parts = [line for line in lines if "part" in line]
    assert [line.split(" | ")[0][2:] for line in table] == [row["part"] for row in parts]
    return [line["session"] for line in lines if "session" in line], parts


def test_the_smoke_session_runs_every_part_on_the_cpu(tmp_path):
    gpu_session.main(["--smoke", "--out", str(tmp_path), "--shared", SHARED])
    (session,), rows = rows_of(tmp_path)
    assert {"device", "driver", "torch", "commit"} <= set(session) and session["torch"] == torch.__version__
    assert {row["part"] for row in rows} == set(gpu_session.WHAT)  # each part said what became of it
    have = dict(fixture=os.path.isdir(os.path.join(SHARED, gpu_session.CHECKPOINT)) and
                os.path.isfile(os.path.join(SHARED, gpu_session.GSM8K, "train.jsonl")),
                nanochat=os.path.isfile(os.path.join(SHARED, gpu_session.NANOCHAT, "nanochat", "gpt.py")))
    status = {row["part"]: row["status"] for row in rows}
    assert status.pop("6c") == "skipped"  # a compile: minutes on a CPU
    for part, needs in (("2", "fixture"), ("5a", "nanochat"), ("5b", "nanochat")):
        assert status.pop(part) == ("ok" if have[needs] else "skipped"), part
    assert set(status.values()) == {"ok"}, rows
    by_part = {row["part"]: row for row in rows}
    assert by_part["1"]["counts"]["skipped"] >= 1  # the CUDA tests found, and skipped without a GPU
    for part in ("5a", "5b") if have["nanochat"] else ():  # each side's attention and dtype, on the row and its ratio
        row = by_part[part]
        assert row["their_attention"].startswith("SDPA") and row["their_attention"].endswith(", float32"), row
        assert row["our_attention"] == "varlen stand-in (tests/kernels.py), bf16 autocast", row
        assert f"({row['their_attention']})" in row["summary"]
    if have["nanochat"]:
        assert by_part["5a"]["summary"].endswith("x, varlen stand-in against SDPA")
    episodes = by_part["6d"]["float32"]  # the forced tokens: the static decode samples what the dynamic one does
    assert episodes["forced"] > 0 and episodes["static"]["equal"] == episodes["rows"]
    assert episodes["static"]["apart"] <= 3 * episodes["exact"]
    assert by_part["6d"]["turns"] == 3 * episodes["rows"] and by_part["6d"]["episodes_s"] > 0
    if have["fixture"]:
        assert by_part["2"]["self_check"].startswith("self-check: packed passes vs the plain float32 path")
    assert 0 < by_part["3b"]["decode_share"] and by_part["3b"]["full_tokens_s"] > 0
    updates = [row for row in rows if row["part"] == "4"]
    assert [row["algo"] for row in updates] == ["grpo", "reinforce"]
    assert all(row["update_s"] > 0 for row in updates) and updates[0]["kernels"]  # the profile read back once
    assert "self-check: packed passes vs the plain float32 path" in by_part["6a"]["summary"]
    assert set(os.listdir(tmp_path)) <= {"results.jsonl", "results.md", "cuda_tests.log", "main_command.log"}


def test_the_plan_fits_nine_minutes_and_names_its_sources(capsys):
    gpu_session.main(["--plan"])
    out = capsys.readouterr().out
    planned = re.search(r"planned: (.*), ending at (\d+) s", out)
    assert int(planned[2]) <= 540
    for part, _, seconds, *_ in gpu_session.PLAN:  # each part's deadline shown: its estimate x the margin
        assert re.search(rf"\n  {part} +{seconds} s \(stopped past +{gpu_session.MARGIN * seconds:.0f} s\)", out), part
    assert "the watchdog ends the session at 560 s" in out
    assert planned[1].split(", ")[:7] == ["1", "2", "3a", "3b", "4", "5a", "5b"]  # the priority parts all planned
    timeline = gpu_session.timeline(540, smoke=False)
    assert max(end for *_, end, fits in timeline if fits) == int(planned[2])
    for part, _, seconds, _, source in gpu_session.PLAN:  # each GPU number from a dated measurement, or said to be
        assert seconds > 0 and re.search(r"\d{4}-\d\d-\d\d|estimate", source), part  # an estimate


def test_a_session_cut_by_its_budget_keeps_the_parts_it_finished_and_marks_the_rest(tmp_path, monkeypatch):
    # 3a's deadline is what is left of the budget: 3a expected to take 10 s, so that it ends well inside
    monkeypatch.setattr(gpu_session, "PLAN", [(p, w, g, {"3a": 10, "3b": 20, "4": 20}.get(p, c), src)
                                              for p, w, g, c, src in gpu_session.PLAN])
    first, later = gpu_session.expected("3a", True), min(gpu_session.expected(p, True) for p in ("3b", "4"))
    budget = first + 0.9 * (later - first)  # 3a fits from the start; 3b and 4 fit in no budget left after it
    gpu_session.main(["--smoke", "--out", str(tmp_path), "--parts", "3a,3b,4", "--budget-s", str(budget),
                      "--shared", SHARED])
    _, rows = rows_of(tmp_path)
    assert [(row["part"], row["status"]) for row in rows] == [("3a", "ok"), ("3b", "skipped"), ("4", "skipped")]
    assert rows[0]["parameters"] > 0 and all("of the budget left" in row["summary"] for row in rows[1:])


def test_the_budget_clock_counts_the_imports(tmp_path):
    # run as the device runs it: a process whose torch and benches are still to import (no ../shared: nanochat's
    # code, and the seconds of its import, left out)
    begin = time.monotonic()
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_session.py"), "--smoke", "--out", str(tmp_path),
                    "--parts", "6c", "--shared", str(tmp_path / "none")], check=True, capture_output=True)
    wall = time.monotonic() - begin
    (session,), (row,) = rows_of(tmp_path)
    assert 0 < session["startup_s"] <= row["clock_s"]
    # what the clock leaves out: the interpreter's own start and exit, a small share of a process that imports torch
    assert row["clock_s"] > wall / 2, (row["clock_s"], wall)


def test_without_a_gpu_and_without_smoke_it_says_so_and_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on a GPU machine too
    with pytest.raises(SystemExit) as stop:
        gpu_session.main(["--out", str(tmp_path), "--shared", SHARED])
    line = str(stop.value.code)
    assert line.startswith("error: ") and "\n" not in line and "--smoke" in line
    assert (tmp_path / "results.md").read_text() == line + "\n"  # the device call's $OUT says why it is empty


class Killed(BaseException):
    """The device tool's kill at its limit: nothing in the session handles it."""


def test_a_session_killed_mid_way_has_written_each_finished_part(tmp_path, monkeypatch):
    def killed(s):
        raise Killed
    monkeypatch.setitem(gpu_session.PARTS, "3b", killed)
    with pytest.raises(Killed):  # without ../shared too: nanochat's code absent, our model alone
        gpu_session.main(["--smoke", "--out", str(tmp_path), "--parts", "3a,3b,4", "--shared", str(tmp_path / "no")])
    _, rows = rows_of(tmp_path)
    assert [(row["part"], row["status"]) for row in rows] == [("3a", "ok")]
    assert "nanochat's code not found: ours alone" in rows[0]["summary"]


def test_prepare_lays_out_what_the_device_copy_needs(tmp_path, capsys):
    if not os.path.isdir(os.path.join(SHARED, gpu_session.CHECKPOINT)):
        pytest.skip("../shared not found")
    target = tmp_path / "carried"
    gpu_session.main(["--prepare", str(target)])
    assert os.path.isfile(target / gpu_session.CHECKPOINT / "model_000650.pt")
    assert os.path.isfile(target / gpu_session.GSM8K / "train.jsonl")
    assert os.path.isfile(target / gpu_session.NANOCHAT / "nanochat" / "gpt.py") and (target / "SOURCE").read_text()
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(target) for f in names)
    assert size < 16 * 2 ** 20  # the device tool's carry takes 64 MiB in all, the working tree included
    assert f"{size / 2 ** 20:.1f} MiB" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        gpu_session.main(["--prepare", str(tmp_path / "other"), "--shared", str(tmp_path / "nothing")])
    assert str(stop.value.code).startswith("error: ") and "\n" not in str(stop.value.code)


def test_the_engines_rows_and_our_replies_are_one_anothers_form(tmp_path):
    # 5a's rows: our sampled replies as nanochat's Engine returns them, and back
    bench = bench_vs_nanochat.configure(["--smoke", "--nanochat", str(tmp_path)])
    G, width, stop = bench.num_samples, bench.max_new_tokens, bench.tokenizer.assistant_end
    prompts = [[1, 2, 3], [4, 5]]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 5, width, width - 1, 2, width, 7, 3])[:len(prompts) * G]
    tokens = torch.randint(0, 256, (len(lengths), width), generator=gen)
    truncated = torch.tensor([n == width and r % 2 == 0 for r, n in enumerate(lengths.tolist())])
    mask = torch.ones_like(tokens)
    for r, n in enumerate(lengths.tolist()):
        tokens[r, n:], mask[r, n:] = 0, 0
        if not truncated[r]:
            tokens[r, n - 1] = stop
    mask[1, 1] = 0  # a forced token (a tool's output) keeps its mask
    samples = dict(tokens=tokens, mask=mask, lengths=lengths, truncated=truncated)
    rows = bench_vs_nanochat.engine_rows(bench, samples, prompts)
    assert all(stop not in seq and len(seq) == len(m) for seq, m in rows)
    back = bench_vs_nanochat.our_samples(bench, rows, prompts)
    for key in ("tokens", "mask", "lengths", "truncated"):
        assert torch.equal(back[key], samples[key]), key


# ---------------------------------------------------------------------------------------------------------------------
# Deadlines and the watchdog, with stand-in parts on a time scale of tenths of a second

def alive(pid):
    """Whether a process runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def scaled(monkeypatch, seconds):
    """The plan's --smoke seconds for some parts, each stopped at its own: tenths of a second, not minutes."""
    monkeypatch.setattr(gpu_session, "PLAN", [(p, w, g, seconds.get(p, c), src) for p, w, g, c, src in
                                              gpu_session.PLAN])
    monkeypatch.setattr(gpu_session, "SMOKE_MARGIN", 1.0, raising=False)  # (raising: run on 7103f36, which had none,
    monkeypatch.setattr(gpu_session, "TICK", 0.01, raising=False)  # it fails on what the session did)


def test_parts_past_their_deadlines_are_stopped_and_the_next_part_starts(tmp_path, monkeypatch):
    # As the GPU schedules them: part 1, a process whose child sleeps on, hangs: its group is killed at its deadline;
    # 3a (a compile's, timing nothing) runs beside it at once, past its own deadline in Python (as a compile or a loop
    # of kernels does): it is stopped there; 3b (timed) waits for part 1, until 1's deadline, and runs
    grandchild = tmp_path / "grandchild"
    settings = gpu_session.settings

    def on_the_gpus_schedule(*args):
        s = settings(*args)
        s.cuda = True  # (the stand-ins time nothing, and the bench stays on the CPU)
        return s

    def hanging_process(s):
        status, _ = gpu_session.run_logged(s, "1", ["sh", "-c", f"sleep 30 & echo $! > {grandchild}; sleep 30"],
                                           "cuda_tests.log")
        return dict(zip(("status", "summary"), gpu_session.outcome(s, "1", status, "cuda_tests.log")))

    def running_on(s):
        end = time.monotonic() + 10
        while time.monotonic() < end:
            time.sleep(0.01)
        return dict(summary="ran to its end")
    scaled(monkeypatch, {"1": 1.2, "3a": 0.4, "3b": 0.1})
    monkeypatch.setitem(gpu_session.PARTS, "1", hanging_process)
    monkeypatch.setitem(gpu_session.PARTS, "3a", running_on)
    monkeypatch.setitem(gpu_session.PARTS, "3b", lambda s: dict(summary="ran"))
    monkeypatch.setattr(gpu_session, "settings", on_the_gpus_schedule)
    begin = time.monotonic()
    gpu_session.main(["--smoke", "--out", str(tmp_path), "--parts", "1,3a,3b", "--shared", str(tmp_path / "no")])
    # (bounds with room for a loaded machine: unstopped, 3a would run 10 s and part 1 30 s; dynamo's import, which
    # set_stance makes, comes before part 1 starts: run alone, this test's process has it to do)
    assert time.monotonic() - begin < 8
    _, rows = rows_of(tmp_path)
    by_part = {row["part"]: row for row in rows}
    assert [row["part"] for row in rows] == ["3a", "1", "3b"]
    assert by_part["3a"]["status"] == "stopped" and 0.39 < by_part["3a"]["seconds"] < 1.2
    assert re.fullmatch(r"stopped at 0 s \(estimate 0 s\)", by_part["3a"]["summary"])
    assert by_part["3b"]["status"] == "ok" and by_part["3b"]["summary"] == "ran"
    assert by_part["1"]["clock_s"] <= by_part["3b"]["clock_s"] < by_part["1"]["clock_s"] + 1.5
    assert by_part["1"]["status"] == "stopped" and 1.19 < by_part["1"]["seconds"] < 4
    assert re.match(r"stopped at 1 s \(estimate 1 s\): what it wrote is in cuda_tests.log", by_part["1"]["summary"])
    pid = int(grandchild.read_text())
    for _ in range(100):  # killed with its group; reaped by whoever adopted it
        if not alive(pid):
            break
        time.sleep(0.01)
    assert not alive(pid)


def test_a_session_past_its_watchdog_is_ended_with_its_rows_and_the_running_part_named(tmp_path):
    # as the device runs it, in a process of its own: 3a hangs in a call that releases the interpreter (a kernel's
    # wait): stopped, it does not end, and is left behind; 3b runs; 4 hangs in a call that holds the interpreter's
    # lock, so that no thread of the session runs again: the watchdog, a process, ends the session
    script = textwrap.dedent(f"""
        import contextlib, ctypes, sys
        sys.path[:0] = [{os.path.join(ROOT, "tests")!r}]
        import gpu_session
        # nothing compiles here: dynamo's import (2 s) left out
        gpu_session.torch.compiler.set_stance = lambda stance: contextlib.nullcontext()
        gpu_session.PLAN = [(p, w, g, dict(zip(("3a", "3b", "4"), (0.3, 0.1, 0.3))).get(p, c), s)
                            for p, w, g, c, s in gpu_session.PLAN]
        gpu_session.SMOKE_MARGIN, gpu_session.STOP_GRACE, gpu_session.WATCHDOG_AFTER = 1.0, 0.3, 0.5
        gpu_session.PARTS.update({{"3a": lambda s: ctypes.CDLL(None).sleep(20), "3b": lambda s: dict(summary="ran"),
                                  "4": lambda s: ctypes.PyDLL(None).sleep(20)}})
        gpu_session.main(["--smoke", "--out", {str(tmp_path)!r}, "--parts", "3a,3b,4,5a", "--budget-s", "1.2",
                          "--shared", {str(tmp_path / "no")!r}])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=15)
    assert done.returncode == -9, done.stderr[-2000:]  # killed at 1.7 s of its clock, not at the calls' 20 s
    _, rows = rows_of(tmp_path)
    assert [(row["part"], row["status"]) for row in rows] == [("3a", "stopped"), ("3b", "ok"), ("4", "stopped"),
                                                              ("5a", "skipped")]
    assert re.fullmatch(r"stopped at 0 s \(estimate 0 s\): it did not stop when asked \(still running 0 s after its "
                        r"stop: a call that does not return, or code that caught the stop\) and was left behind",
                        rows[0]["summary"])
    assert re.fullmatch(r"stopped at 1 s \(estimate 0 s\): the watchdog ended the session at 2 s", rows[2]["summary"])
    assert rows[3]["summary"] == "not started: the watchdog ended the session at 2 s"
    # the budget's 1.2 s printed as such (one decimal below 10 s), not "1 s"
    line = "the watchdog ended the session at 2 s: the session ran past its 1.2 s budget; part 4 was running"
    assert open(tmp_path / "results.md").read().endswith(f"\n{line}\n") and f"[watchdog] {line}" in done.stdout
    assert json.loads(open(tmp_path / "results.jsonl").read().splitlines()[-1])["watchdog"]["running"] == ["4"]


def test_out_inside_the_checkout_exempts_the_sessions_own_files_alone(tmp_path, monkeypatch):
    # part 1 as on a GPU, where the CUDA tests run under the suite's check that no test writes into the repository,
    # while this session writes its rows (and pytest its log) into --out: a copy of the checkout whose CUDA tests
    # run on the CPU (torch made to say it has a GPU), --out inside it. The session's files are left out of the
    # check; a file a test writes into --out is not
    # (a ':' in its name: the list of the session's files passed as JSON, not split at os.pathsep; --out named by a
    # link outside the checkout: inside all the same, links followed)
    checkout = tmp_path / "checkout"
    out = checkout / "out:session"
    shutil.copytree(os.path.join(ROOT, "tasks"), checkout / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    os.makedirs(checkout / "tests")
    for name in ("grpo.py", "model.py", os.path.join("tests", "conftest.py")):
        shutil.copy(os.path.join(ROOT, name), checkout / name)
    (checkout / "tests" / "test_on_the_gpu.py").write_text(textwrap.dedent(f"""
        import pytest
        import torch

        pytestmark = pytest.mark.cuda
        torch.cuda.is_available = lambda: True  # the GPU's stand-in: the tests run, under the suite's checks


        def test_a_cuda_test():
            assert torch.ones(3).sum().item() == 3


        def test_a_cuda_test_that_writes_into_the_sessions_folder():
            open({str(out / "stray.txt")!r}, "w").write("a test's write")
    """))
    monkeypatch.setattr(gpu_session, "ROOT", str(checkout))
    monkeypatch.setattr(gpu_session, "TESTS", str(checkout / "tests"))
    os.makedirs(out)
    os.symlink(out, tmp_path / "link")
    gpu_session.main(["--smoke", "--out", str(tmp_path / "link"), "--parts", "1", "--shared", SHARED])
    (session,), (row,) = rows_of(out)
    assert session["out_in_checkout"], row
    # no error from the check for the session's own writes (results, pytest's log); the stray file's test fails it
    assert row["counts"] == {"passed": 2, "error": 1}, row
    assert row["failed"] == ["ERROR tests/test_on_the_gpu.py::test_a_cuda_test_that_writes_into_the_sessions_folder"]
    assert "the test wrote into the repository (write under tmp_path instead): ['out:session/stray.txt']" in \
        (out / "cuda_tests.log").read_text()


# ---------------------------------------------------------------------------------------------------------------------
# The watchdog's events, its start, the session's end, and what the session refuses (review of issue 81)

TESTS = os.path.join(ROOT, "tests")
WATCHDOG = os.path.join(TESTS, "session_watchdog.py")

# A stand-in for the session (the standard library alone: milliseconds): two process groups of its own (parts 1 and
# 2's), its watchdog, one row written, then every event in one write: 1 and 2 start with their groups, 3a starts and
# ends, 3b starts. Then it hangs (the watchdog ends it past its budget) or kills itself (no "bye")
STAND_IN = textwrap.dedent(f"""
    import json, os, signal, subprocess, sys, time
    out, how = sys.argv[1], sys.argv[2]
    start = time.monotonic()
    groups = [subprocess.Popen(["sleep", "30"], process_group=0, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL) for _ in range(2)]
    settings = dict(out=out, pid=os.getpid(), start=start, at=start + 1.5, budget_s=1.0, id="stand-in",
                    parts=[("1", "one"), ("2", "two"), ("3a", "three a"), ("3b", "three b"), ("4", "four")])
    watchdog = subprocess.Popen([sys.executable, "-I", "-S", {WATCHDOG!r}, json.dumps(settings)],
                                stdin=subprocess.PIPE)
    for name, text in (("results.md", "| 3a | three a | ok | ran | 0 s |\\n"),
                       ("results.jsonl", json.dumps(dict(part="3a", status="ok")) + "\\n")):
        open(os.path.join(out, name), "a").write("" if how == "headless" else text)
    print(json.dumps([group.pid for group in groups]), flush=True)
    time.sleep(0.3)  # the watchdog waiting for its first event
    events = [dict(header=True)] * (how != "headless") + [
              dict(start="1", estimate=1), dict(group=groups[0].pid), dict(start="2", estimate=1),
              dict(group=groups[1].pid), dict(start="3a", estimate=0), dict(end="3a"), dict(start="3b", estimate=0)]
    watchdog.stdin.write("".join(json.dumps(event) + "\\n" for event in events).encode())
    watchdog.stdin.flush()
    if how in ("killed", "headless"):
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
""")


def stand_in_session(tmp_path, how):
    """-> (the stand-in's exit status, its groups' pids, results.md's lines) once its watchdog has written."""
    done = subprocess.run([sys.executable, "-c", STAND_IN, str(tmp_path), how], capture_output=True, text=True,
                          timeout=15)
    groups = json.loads(done.stdout.splitlines()[0])
    for _ in range(300):  # the watchdog, adopted once the stand-in is killed, writes after it
        if "watchdog" in (open(tmp_path / "results.jsonl").read().splitlines() or [""])[-1]:
            break
        time.sleep(0.01)
    for _ in range(100):
        if not any(alive(pid) for pid in groups):
            break
        time.sleep(0.01)
    return done, groups, open(tmp_path / "results.md").read().splitlines()


def test_the_watchdog_acts_on_every_event_of_a_burst(tmp_path):
    # events written together: a buffered readline took them all from the pipe and handed one over, select saw no
    # more, and the watchdog named part 1 alone (1, 2 and 3b ran) and left parts 1 and 2's groups alive
    done, groups, lines = stand_in_session(tmp_path, "hangs")
    assert done.returncode == -9, done.stderr[-2000:]
    assert lines[0] == "| 3a | three a | ok | ran | 0 s |"
    assert [line.split(" | ")[:3] for line in lines[1:5]] == [["| 1", "one", "stopped"], ["| 2", "two", "stopped"],
                                                              ["| 3b", "three b", "stopped"],
                                                              ["| 4", "four", "skipped"]]
    assert lines[-1] == "the watchdog ended the session at 2 s: the session ran past its 1 s budget; part 1, 2, 3b " \
                        "were running"
    assert not any(alive(pid) for pid in groups)  # parts 1 and 2's groups killed
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert all(row.get("session_id", "stand-in") == "stand-in" for row in rows[1:-1]) and \
        rows[-1]["watchdog"]["running"] == ["1", "2", "3b"]


def test_a_session_killed_without_its_bye_is_said_to_have_died(tmp_path):
    # a SIGKILLed session: the watchdog wrote nothing (the pipe's end read as the session's own), and left its
    # parts' groups alive. Now: one line, the rows kept, the groups killed
    done, groups, lines = stand_in_session(tmp_path, "killed")
    assert done.returncode == -9, done.stderr[-2000:]
    assert len(lines) == 3, lines  # the row it wrote, and the watchdog's line after an empty one: no row added
    assert lines[0] == "| 3a | three a | ok | ran | 0 s |" and lines[1] == ""
    assert re.fullmatch(r"the session died at [01] s \(killed: it ended without its word of a normal end\); part 1, "
                        r"2, 3b were running; the rows above are all it wrote", lines[2]), lines
    assert not any(alive(pid) for pid in groups)
    assert json.loads(open(tmp_path / "results.jsonl").read().splitlines()[-1])["watchdog"]["ended"] == "died"


def ended_by_the_watchdog(script, timeout, within, hung):
    """Run the session's script: the watchdog must SIGKILL it within `within` seconds (`hung`: the failure else)."""
    begin = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(hung)
    assert done.returncode == -9 and time.monotonic() - begin < within, done.stderr[-2000:]


def test_the_watchdog_covers_a_hang_before_torchs_import_ends(tmp_path):
    # the session as the device runs it (its file run as __main__), torch's import hung (as CUDA's start may): the
    # watchdog, started before it, ends the session at the budget + WATCHDOG_AFTER (made 0.5 s here)
    script = textwrap.dedent(f"""
        import importlib.abc, sys, time
        class Hung(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch":
                    time.sleep(30)
        sys.meta_path.insert(0, Hung())
        path = {os.path.join(TESTS, "gpu_session.py")!r}
        source = open(path).read()
        assert "WATCHDOG_AFTER = 20.0" in source
        sys.argv = [path, "--smoke", "--out", {str(tmp_path)!r}, "--parts", "3a,3b", "--budget-s", "1"]
        exec(compile(source.replace("WATCHDOG_AFTER = 20.0", "WATCHDOG_AFTER = 0.5"), path, "exec"),
             dict(__name__="__main__", __file__=path))
    """)
    ended_by_the_watchdog(script, 10, 8, "no watchdog ended the session hung in torch's import")
    _, rows = rows_of(tmp_path)
    assert [(row["part"], row["status"]) for row in rows] == [("3a", "skipped"), ("3b", "skipped")]
    assert open(tmp_path / "results.md").read().endswith(
        "the session ran past its 1 s budget; no part had started (the session was starting: its imports, CUDA's "
        "start)\n")


@pytest.mark.parametrize("budget", ["inf", "nan", "0", "-5", "561", "580"])
def test_a_budget_the_device_cannot_hold_is_refused_in_one_line(tmp_path, capsys, budget):
    with pytest.raises(SystemExit) as stop:
        gpu_session.main(["--budget-s", budget, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: argument --budget-s: "), err
    assert "at most 560" in err and not os.path.exists(tmp_path / "out")  # before anything ran


def test_the_session_ends_the_processes_its_parts_started(tmp_path, monkeypatch):
    # an in-process part's children (one in the session's group, one in a group of its own, one its child left
    # behind) hold a pipe's writing end, as they would the session's output: its end kills them, so that a `| tee`
    # (here: the pipe read to its end) does not wait on them; and a normal end says its "bye": no word from the
    # watchdog
    read, write = os.pipe()
    orphan = tmp_path / "orphan"

    def spawning(s):
        subprocess.Popen(["sleep", "30"], stdout=write)
        subprocess.Popen(["sleep", "30"], stdout=write, process_group=0)
        subprocess.run(["sh", "-c", f"sleep 30 & echo $! > {orphan}"], stdout=write, check=True)
        return dict(summary="started three")
    monkeypatch.setitem(gpu_session.PARTS, "3a", spawning)
    try:
        gpu_session.main(["--smoke", "--out", str(tmp_path / "out"), "--parts", "3a", "--shared",
                          str(tmp_path / "no")])
        os.close(write)
        assert select.select([read], [], [], 5)[0] and os.read(read, 1) == b"", \
            "the pipe was held open past the session's end by the processes its part started"
    finally:
        os.close(read)
    _, rows = rows_of(tmp_path / "out")
    assert [(row["part"], row["status"]) for row in rows] == [("3a", "ok")]
    assert open(tmp_path / "out" / "results.md").read().endswith(" |\n")  # the row last: no line from the watchdog
    assert not alive(int(orphan.read_text()))


def test_out_at_the_checkouts_root_or_in_a_tracked_folder_is_refused(tmp_path, monkeypatch):
    checkout = tmp_path / "checkout"
    os.makedirs(checkout / "tasks")
    (checkout / "tasks" / "task.py").write_text("")
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run(["git", "add", "tasks"], cwd=checkout, check=True)
    monkeypatch.setattr(gpu_session, "ROOT", str(checkout))
    for out, why in ((checkout, "is the checkout's root"), (checkout / "tasks", "is a folder git tracks (1 files)")):
        with pytest.raises(SystemExit) as stop:
            gpu_session.main(["--smoke", "--parts", "6c", "--out", str(out), "--shared", str(tmp_path / "no")])
        assert str(stop.value.code).startswith(f"error: --out {out}: {why}: pass a folder of its own"), stop.value
        assert "\n" not in str(stop.value.code) and not os.path.exists(out / "results.md")


def test_out_holding_other_files_or_in_use_is_refused_and_rows_carry_their_sessions_id(tmp_path):
    other = tmp_path / "other"
    os.makedirs(other)
    (other / "notes.txt").write_text("mine")
    argv = ["--smoke", "--parts", "6c", "--shared", str(tmp_path / "no"), "--out"]
    with pytest.raises(SystemExit) as stop:
        gpu_session.main(argv + [str(other)])
    assert str(stop.value.code) == f"error: --out {other}: holds files that are not a session's (notes.txt): pass an " \
                                   "empty folder, a new one, or one a previous session wrote (its rows are kept, " \
                                   "ours appended)"
    assert os.listdir(other) == ["notes.txt"]
    out = tmp_path / "out"
    for _ in range(2):  # a previous session's files: appended to, each row with its session's id
        gpu_session.main(argv + [str(out)])
    lines = [json.loads(line) for line in open(out / "results.jsonl")]
    ids = [line["session"]["id"] for line in lines if "session" in line]
    assert len(set(ids)) == 2 and [line.get("session_id") for line in lines if "part" in line] == ids
    descriptor = os.open(out, os.O_RDONLY)  # a session writing there now
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as stop:
            gpu_session.main(argv + [str(out)])
    finally:
        os.close(descriptor)
    assert str(stop.value.code) == f"error: --out {out}: another session is writing there now: wait for it, or pass " \
                                   "another folder"


def test_out_that_is_a_file_or_cannot_be_written_is_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    for out, why in (("/etc/passwd", "is a file, not a folder"),
                     (str(tmp_path / "file" / "sub"), "cannot be made or written (Not a directory)"),
                     ("/sys/gpu-session", "cannot be made or written (Operation not permitted)")):
        with pytest.raises(SystemExit) as stop:
            gpu_session.main(["--smoke", "--parts", "6c", "--out", out])
        line = str(stop.value.code)
        assert line.startswith(f"error: --out {out}: {why}: pass a folder") and "\n" not in line, line


def test_the_plan_shows_the_parts_chosen_alone(capsys):
    gpu_session.main(["--plan", "--parts", "6a,6b,6d", "--budget-s", "120"])
    out = capsys.readouterr().out
    assert re.findall(r"\n  (\w+) +\d+ s \(stopped past +\d+ s\)", out) == ["6a", "6b", "6d"]
    assert "planned: 6a, 6b, 6d, ending at 105 s; if time is left: none" in out
    assert "the watchdog ends the session at 140 s" in out and "a timeout_s of 180 s or more" in out
    gpu_session.main(["--plan", "--budget-s", "560"])  # the largest budget: a timeout the device tool takes
    assert "the watchdog ends the session at 580 s" in (out := capsys.readouterr().out)
    assert "a timeout_s of 600 s or more" in out


def test_part_4s_rows_say_what_their_seconds_are(tmp_path, monkeypatch):
    step = dict(size=64, logprobs_s=0.1, update_s=0.2, compile_s=None, mfu=None, peak_gib=None, plan_gib=0.0,
                micro_batches=1, kernels=[], sample_s=0.3)
    monkeypatch.setattr(gpu_session, "models", lambda s: (None, None))
    monkeypatch.setattr(gpu_session.bench_gpu, "fitted_sizes", lambda *a: (None, 64))
    monkeypatch.setattr(gpu_session.bench_gpu, "training_step", lambda *a, **k: dict(step))
    gpu_session.main(["--smoke", "--out", str(tmp_path), "--parts", "4", "--shared", str(tmp_path / "no")])
    _, (grpo_row, reinforce_row) = rows_of(tmp_path)
    assert grpo_row["summary"].startswith("grpo (0 s, this row's seconds): 64 tokens a pass") and \
        grpo_row["algo"] == "grpo" and abs(grpo_row["algo_s"] - grpo_row["seconds"]) <= 0.05
    assert reinforce_row["summary"].startswith("reinforce (0 s; this row's seconds: the whole part, the pass size's "
                                               "fit and grpo's included): 64 tokens a pass")
    assert reinforce_row["algo"] == "reinforce" and reinforce_row["algo_s"] <= reinforce_row["seconds"] + 0.05


# ---------------------------------------------------------------------------------------------------------------------
# The second review of issue 81: the exit after the bye, the watchdog's start and snapshot, interrupts, torn rows

def session_script(tmp_path, body, argv):
    """-> a script running the session in a process of its own (main called as a script's caller does: its watchdog
    not released), the parts replaced by body's."""
    return textwrap.dedent(f"""
        import atexit, contextlib, ctypes, os, subprocess, sys, time
        sys.path[:0] = [{TESTS!r}]
        import gpu_session
        gpu_session.torch.compiler.set_stance = lambda stance: contextlib.nullcontext()  # no dynamo import (2 s)
    """) + textwrap.dedent(body) + f"\ngpu_session.main({argv!r})\n"


def test_the_watchdog_enforces_its_deadline_on_the_sessions_exit_after_its_bye(tmp_path):
    # the rows written and the bye said, the process's exit hangs (an atexit hook, a thread not a daemon): the
    # watchdog went with the bye and the call ran 40 s past it. Now it kills the session at its deadline
    script = session_script(tmp_path, """
        gpu_session.WATCHDOG_AFTER = 0.5
        def part(s):
            atexit.register(time.sleep, 40)
            return dict(summary="registered a hook that hangs")
        gpu_session.PARTS["3a"] = part
    """, ["--smoke", "--out", str(tmp_path), "--parts", "3a", "--budget-s", "1.5", "--shared", str(tmp_path / "no")])
    ended_by_the_watchdog(script, 25, 20, "the session's exit ran on past its watchdog's deadline")
    _, rows = rows_of(tmp_path)
    assert [(row["part"], row["status"]) for row in rows] == [("3a", "ok")]  # no row added after the bye
    assert re.search(r"\nthe watchdog ended the session at 2 s: its rows were complete \(its end at \d s\) but its "
                     r"process had not exited by its 1.5 s budget \+ 0 s", open(tmp_path / "results.md").read())
    assert "budget 1.5 s" in open(tmp_path / "results.md").read()  # one decimal below 10 s, not "2 s"


def test_a_process_started_just_before_the_session_is_killed_is_killed_too(tmp_path):
    # a part's grandchild in a session of its own that ignores SIGTERM, started 0.15 s before the session's kill:
    # the watchdog's snapshot of the session's processes, a second old, did not have it (5 of 5 survived); and the
    # part's temporary folder stayed in /tmp
    pid_file, temp_file = tmp_path / "grandchild", tmp_path / "temp"
    script = session_script(tmp_path, f"""
        def part(s):
            time.sleep(0.5)
            made = getattr(gpu_session, "temporary_folder", lambda s: __import__("tempfile").mkdtemp())(s)
            open({str(temp_file)!r}, "w").write(made)
            subprocess.Popen(["setsid", "sh", "-c", "echo $$ > {pid_file}; trap '' TERM HUP INT; sleep 43; :"])
            time.sleep(30)
        gpu_session.PARTS["3a"] = part
    """, ["--smoke", "--out", str(tmp_path / "out"), "--parts", "3a", "--shared", str(tmp_path / "no")])
    session = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(2000):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.005)
        time.sleep(0.15)
        session.kill()
    finally:
        session.kill()
        session.wait()
    pid = int(pid_file.read_text())
    for _ in range(300):
        if not alive(pid) and "died" in open(tmp_path / "out" / "results.md").read():
            break
        time.sleep(0.01)
    assert not alive(pid), "a process the session's part started survived its death"
    assert "the session died at" in open(tmp_path / "out" / "results.md").read()
    assert not os.path.exists(temp_file.read_text())  # the part's temporary folder removed


def reachable_by_ctrl_c():
    """A session started as from a terminal: SIGINT at its default. The suite run as a background job (`nohup ...
    &`) starts its processes with SIGINT ignored, and Python keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signalled_session(tmp_path, number):
    """A session, in a process group of its own, signalled as a whole (Ctrl-C at a terminal, `timeout`, kill --
    -PGID) while part 1 (a process group of its own) and 3a run. -> (its exit, stderr, part 1's pid, results.md)."""
    started, child = tmp_path / "started", tmp_path / "child"
    script = session_script(tmp_path, f"""
        def hanging(s):
            status, _ = gpu_session.run_logged(s, "1", ["sh", "-c", "echo $$ > {child}; exec sleep 41"],
                                               "cuda_tests.log")
            return dict(zip(("status", "summary"), gpu_session.outcome(s, "1", status, "cuda_tests.log")))
        def slow(s):
            open({str(started)!r}, "w").write("")
            time.sleep(30)
        gpu_session.PARTS.update({{"1": hanging, "3a": slow}})
    """, ["--smoke", "--out", str(tmp_path / "out"), "--parts", "1,3a", "--shared", str(tmp_path / "no")])
    session = subprocess.Popen([sys.executable, "-c", script], process_group=0, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, preexec_fn=reachable_by_ctrl_c)
    try:
        for _ in range(2000):
            if started.exists() and child.exists() and child.read_text().strip():
                break
            time.sleep(0.005)
        os.killpg(session.pid, number)
        _, err = session.communicate(timeout=10)
    finally:
        session.kill()
    pid = int(child.read_text())
    for _ in range(300):
        if not alive(pid):
            break
        time.sleep(0.01)
    return session.returncode, err, pid, open(tmp_path / "out" / "results.md").read()


def test_sigterm_to_the_sessions_group_is_said_and_ends_its_parts(tmp_path):
    # the watchdog, in the session's group, died with it, and part 1's group ran on with nothing said
    code, err, pid, md = signalled_session(tmp_path, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert not alive(pid), "part 1's process outlived the session"
    assert "\nthe session was interrupted (SIGTERM) at " in md
    assert "; part 1, 3a were running: its processes ended\n" in md
    assert md.count("| stopped | stopped at ") == 2 and md.endswith("its processes ended\n")


def test_ctrl_c_is_said_in_the_results_without_a_traceback(tmp_path):
    code, err, pid, md = signalled_session(tmp_path, signal.SIGINT)
    assert code == 128 + signal.SIGINT and "Traceback" not in err, err[-2000:]
    assert not alive(pid)
    assert "\nthe session was interrupted (SIGINT, Ctrl-C) at " in md and "part 1, 3a were running" in md


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_torchs_import_is_said_as_an_interrupt(tmp_path, number):
    # the session started (its watchdog running), torch still importing: the interrupt's line and exit status, no
    # traceback, no "died" line from the watchdog (was: a traceback, exit status 1 for SIGTERM)
    session = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "gpu_session.py"), "--smoke", "--out",
                                str(tmp_path), "--parts", "3a", "--shared", str(tmp_path / "no")],
                               stderr=subprocess.PIPE, text=True, preexec_fn=reachable_by_ctrl_c)
    def started():  # the watchdog running and SIGTERM's handler in place, the last of the start before the imports
        caught = re.search(r"SigCgt:\s*([0-9a-f]+)", open(f"/proc/{session.pid}/status").read())[1]
        return session_watchdog.descendants(session.pid) and int(caught, 16) >> (signal.SIGTERM - 1) & 1
    deadline = time.monotonic() + 30
    while not started() and time.monotonic() < deadline:
        time.sleep(0.01)
    session.send_signal(number)
    err = session.communicate(timeout=60)[1]
    md = (tmp_path / "results.md").read_text()
    assert session.returncode == 128 + number and "Traceback" not in err, err[-2000:]
    assert "the session was interrupted (SIG" in md and "no part had started" in md and "died" not in md, md


def test_a_stop_landing_while_a_row_is_written_leaves_both_files_whole(tmp_path, monkeypatch):
    # part 4 records its grpo row mid-part; its deadline lands while the row is written (a slow disk): the row was
    # in results.jsonl and not in results.md
    real = gpu_session.append

    def slow_append(path, text):
        real(path, text)
        end = time.monotonic() + 0.3
        while "grpo row" in text and time.monotonic() < end:  # in Python's time, where a stop lands
            pass

    def part4(s):
        time.sleep(0.1)
        gpu_session.record(s, "4", "ok", 0.1, "grpo row", algo="grpo")
        time.sleep(5)
        return dict(summary="reinforce row")
    scaled(monkeypatch, {"4": 0.25})
    monkeypatch.setattr(gpu_session, "append", slow_append)
    monkeypatch.setitem(gpu_session.PARTS, "4", part4)
    gpu_session.main(["--smoke", "--out", str(tmp_path), "--parts", "4", "--shared", str(tmp_path / "no")])
    _, rows = rows_of(tmp_path)  # (its check: the same rows in both files)
    assert [(row["part"], row["status"]) for row in rows] == [("4", "ok"), ("4", "stopped")]


def test_a_part_that_swallows_its_stop_is_named_and_the_next_row_says_it_ran_beside(tmp_path, monkeypatch):
    def stubborn(s):
        end = time.monotonic() + 2
        while time.monotonic() < end:
            try:
                time.sleep(0.01)
            except BaseException:  # a broad except, a retry loop
                pass
        return dict(summary="ran to its end")
    scaled(monkeypatch, {"3a": 0.2, "3b": 0.2})
    monkeypatch.setattr(gpu_session, "STOP_GRACE", 0.2)
    monkeypatch.setitem(gpu_session.PARTS, "3a", stubborn)
    monkeypatch.setitem(gpu_session.PARTS, "3b", lambda s: dict(summary="timed"))
    gpu_session.main(["--smoke", "--out", str(tmp_path), "--parts", "3a,3b", "--shared", str(tmp_path / "no")])
    _, (first, second) = rows_of(tmp_path)
    assert first["status"] == "stopped" and "it did not stop when asked" in first["summary"]
    assert second["summary"].startswith("timed (beside part 3a, stopped but not ended: it may still be running")
    time.sleep(2)  # (3a's thread ends before the next test)


@pytest.mark.parametrize("parts", ["", "6a,", ",", "6a,,6b"])
def test_parts_with_an_empty_entry_are_refused_in_one_line(tmp_path, capsys, parts):
    with pytest.raises(SystemExit) as stop:
        gpu_session.main(["--parts", parts, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "has an empty entry" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_out_holding_a_folder_named_as_a_session_file_is_refused_in_one_line(tmp_path):
    os.makedirs(tmp_path / "out" / "results.jsonl")
    with pytest.raises(SystemExit) as stop:
        gpu_session.main(["--smoke", "--parts", "6c", "--out", str(tmp_path / "out"), "--shared",
                          str(tmp_path / "no")])
    assert str(stop.value.code) == f"error: --out {tmp_path / 'out'}: holds results.jsonl that is not a file: pass " \
                                   "an empty folder, a new one, or one a previous session wrote"


def test_a_reused_out_keeps_each_sessions_process_logs(tmp_path, monkeypatch):
    def echoing(s):
        status, lines = gpu_session.run_logged(s, "1", ["echo", f"run {s.id}"], "cuda_tests.log")
        return dict(summary=" / ".join(lines))
    monkeypatch.setitem(gpu_session.PARTS, "1", echoing)
    for _ in range(2):
        gpu_session.main(["--smoke", "--out", str(tmp_path), "--parts", "1", "--shared", str(tmp_path / "no")])
    headers, rows = rows_of(tmp_path)
    log = (tmp_path / "cuda_tests.log").read_text()
    for session, row in zip(headers, rows):
        assert f"=== session {session['id']}, part 1: " in log and f"run {session['id']}" in log
        assert row["summary"] == f"run {session['id']}"  # its own lines alone


def test_a_session_killed_before_its_header_says_whose_line_it_is(tmp_path):
    done, groups, lines = stand_in_session(tmp_path, "headless")
    assert done.returncode == -9, done.stderr[-2000:]
    assert lines[1].startswith("## GPU session stand-in: no header (the session ended before writing it, ")
    assert lines[-1].endswith("; it wrote no header and no row"), lines
