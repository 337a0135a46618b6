"""
How far a run on several processes drifts from the same run on one: the demo model (without its entropy bonus)
trained for --steps steps on one process and on --ranks gloo processes (same global batch), the weights compared
after every step.

    python tests/bench_ranks.py                                   # Muon, 2 minibatches, 10 steps, 2 ranks
    python tests/bench_ranks.py --optimizer adamw --minibatches 1

Sampling and rewards are pure functions of (seed, step, question) and the weights, so the two runs stay equal while
their weights are bit-identical; the gradient is summed in another order over ranks (float32), so the weights
differ in the last bits after the first update and the difference grows with each step. Prints, per step, the
largest absolute difference over all weights, the largest relative to the weight's size, and the difference of the
step's mean reward (a sum over ranks in another order: equal up to float rounding while the replies are the same). CPU only (gloo), a minute or two; not collected by pytest.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import load_checkpoint  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--ranks", type=int, default=2)
parser.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
parser.add_argument("--minibatches", type=int, default=2)
parser.add_argument("--port", type=int, default=29561)
args = parser.parse_args()

work = tempfile.mkdtemp(prefix="bench_ranks_")
flags = ["grpo.py", "--demo", "--entropy-coef", "0", "--runs-dir", work, "--num-steps", str(args.steps), "--save-every", "1",
         "--eval-every", "0", "--optimizer", args.optimizer, "--num-minibatches", str(args.minibatches)]
env = dict(os.environ, OMP_NUM_THREADS="1")
for name, launcher in (("one", [sys.executable]),
                       ("many", [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
                                 f"--master_port={args.port}"])):
    print(f"training on {'1 process' if name == 'one' else f'{args.ranks} processes'} ...", flush=True)
    subprocess.run(launcher + flags + ["--run-name", name], cwd=ROOT, env=env, check=True, capture_output=True)

rewards = {name: [m["reward"] for m in map(json.loads, open(os.path.join(work, name, "metrics.jsonl")))
                  if "reward" in m] for name in ("one", "many")}
print(f"{args.optimizer}, {args.minibatches} minibatch(es), 1 vs {args.ranks} processes")
print("step  max |dw|    max |dw|/max|w|  |reward difference|")
for step in range(1, args.steps + 1):
    a, b = (load_checkpoint(os.path.join(work, name, "chatrl_checkpoints", "d2"), step, log=lambda *_: None)[0]
            .state_dict() for name in ("one", "many"))
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    relative = max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)).item() for k in a)
    print(f"{step:4d}  {diff:.3e}  {relative:.3e}        {abs(rewards['one'][step - 1] - rewards['many'][step - 1]):.1e}")
