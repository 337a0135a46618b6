"""The one-call GPU session (tests/gpu_session.py), rehearsed on the CPU: every part at tiny shapes (--smoke), the
plan within 9 minutes, a session cut by its budget or killed keeping the rows it wrote, the device copy's data."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import bench_vs_nanochat
import gpu_session
from conftest import ROOT

SHARED = os.path.join(ROOT, "..", "shared")


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
    planned = re.search(r"planned: (.*), ending at (\d+) s", capsys.readouterr().out)
    assert int(planned[2]) <= 540
    assert planned[1].split(", ")[:7] == ["1", "2", "3a", "3b", "4", "5a", "5b"]  # the priority parts all planned
    timeline = gpu_session.timeline(540, smoke=False)
    assert max(end for *_, end, fits in timeline if fits) == int(planned[2])
    for part, _, seconds, _, source in gpu_session.PLAN:  # each GPU number from a dated measurement, or said to be
        assert seconds > 0 and re.search(r"\d{4}-\d\d-\d\d|estimate", source), part  # an estimate


def test_a_session_cut_by_its_budget_keeps_the_parts_it_finished_and_marks_the_rest(tmp_path):
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
