"""The CPU demo's wall time under each thread setting, alone and beside CPU-bound processes (issue 57).

    python tests/bench_threads.py                      # 60 demo steps, each setting alone and beside 1 busy process
    python tests/bench_threads.py --steps 1000 --busy 0 1 --settings spin1000

Each run is `python grpo.py --demo` in its own run folder (no evals but the last's one problem); a busy process is a
Python loop that never sleeps, started before the run and killed after it. The numbers in docs/performance.md."""
import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> (environment, flags): the run's default (2 threads here, spins of 1,000 rounds), libgomp's own default spin
# (300,000 rounds: what torch does without grpo.py's setting), and one thread
SETTINGS = {"spin1000": ({}, []), "spin300000": ({"GOMP_SPINCOUNT": "300000"}, []),
            "1thread": ({}, ["--threads", "1"])}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="busy processes beside the run")
parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

print(f"{os.cpu_count()} CPUs; demo, {args.steps} steps, seed {args.seed}", flush=True)
print("| setting | busy processes | wall s | last step line |", flush=True)
print("| --- | --- | --- | --- |", flush=True)
for busy in args.busy:
    for setting in args.settings:
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            with tempfile.TemporaryDirectory() as runs:
                command = [sys.executable, os.path.join(ROOT, "grpo.py"), "--demo", "--num-steps", str(args.steps),
                           "--eval-every", "0", "--final-eval-examples", "1", "--seed", str(args.seed),
                           "--runs-dir", runs] + SETTINGS[setting][1]
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT",
                                                                        "OMP_WAIT_POLICY")}
                env.update(SETTINGS[setting][0])
                start = time.time()
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
                wall = time.time() - start
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        last = [line for line in out.splitlines() if line.startswith(f"step {args.steps}/")][-1]
        print(f"| {setting} | {busy} | {wall:.1f} | "
              f"{last.split(' | ')[1]} |", flush=True)
