"""
Stop signals at random moments: --runs demo runs that save every step, each sent SIGTERM a random 2-6 s after it
started (while it samples, updates or writes a checkpoint), then resumed with --resume and stopped again once it
has logged a step more. Every stop must end with the one-line stop message (no traceback) naming a checkpoint
that the resume then goes on from.

    python tests/bench_signals.py --runs 60
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--runs", type=int, default=60)
parser.add_argument("--seed", type=int, default=0, help="seeds the moments the signals are sent")
args = parser.parse_args()
moments = random.Random(args.seed)
work = tempfile.mkdtemp(prefix="bench_signals_")


def logged_steps(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    lines = open(path).read().splitlines() if os.path.isfile(path) else []
    return [json.loads(line)["step"] for line in lines if '"reward"' in line]


def stopped(argv, run_dir, wait_until):
    """Start grpo.py, SIGTERM it once wait_until() holds, -> its last stderr line (the run must end with exit 1)."""
    with open(os.path.join(work, "stderr.txt"), "w") as err:
        process = subprocess.Popen([sys.executable, "grpo.py", *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        while not wait_until() and process.poll() is None:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
    text = open(os.path.join(work, "stderr.txt")).read()
    last = text.strip().splitlines()[-1] if text.strip() else ""
    ok = code == 1 and "Traceback" not in text and last.startswith("error: stopped by SIGTERM")
    return ok, last


failures = []
for i in range(args.runs):
    run_dir = os.path.join(work, f"r{i}")
    argv = ["--demo", "--num-steps", "100000", "--save-every", "1", "--eval-every", "0", "--runs-dir", work,
            "--run-name", f"r{i}"]
    delay = moments.uniform(2, 6)
    start = time.time()
    ok, last = stopped(argv, run_dir, lambda: time.time() - start > delay)
    if ok:  # go on as the message says, and stop again once a step after the named checkpoint is logged
        named = re.search(r"step (\d+) in ", last)
        step = int(named[1]) if named else 0
        again = argv + ["--resume"] if last.endswith("--resume") else argv  # else: "run the command again"
        ok, last = stopped(again, run_dir, lambda: step + 1 in logged_steps(run_dir)[step:])
        ok = ok and step + 1 in logged_steps(run_dir)
    print(f"run {i}: signal after {delay:.1f} s: {'ok' if ok else 'FAILED'}: {last[:150]}", flush=True)
    if not ok:
        failures.append(i)
print(f"{args.runs - len(failures)} of {args.runs} runs stopped with the one-line message and resumed"
      + (f"; failed: {failures}" if failures else ""))
sys.exit(1 if failures else 0)
