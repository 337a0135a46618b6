"""
The KL term's gradient next to the policy term's, over a demo run: at the chosen steps, the update's first gradient
(rho = 1) is taken twice on the step's batch, with and without the KL (the objective is linear in beta, so their
difference is the KL term's gradient), before the run's own update goes on unchanged. docs/algorithm.md quotes it
for the no-signal rule (a step whose advantages are all 0 takes the KL-free step).

    python tests/bench_kl_share.py --steps 1 50 100 300 --seed 0
"""
import argparse
import os
import sys
import tempfile
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, nargs="+", default=[1, 50, 100, 300])
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--algo", default="grpo")
cli = parser.parse_args()


class GradRecorder:
    """An 'optimizer' that keeps the gradients it is handed (optimizer_step hands them one weight at a time)."""

    def __init__(self, model):
        self.model, self.received = model, []
        self.param_groups = [dict(params=list(model.parameters()))]

    def step(self):
        self.received += [p.grad.clone() for p in self.model.parameters() if p.grad is not None]


def first_gradient(model, batch, args, autocast, ref_model, owners, kl_coef):
    recorder = GradRecorder(model)
    once = SimpleNamespace(**dict(vars(args), kl_coef=kl_coef, ppo_epochs=1))
    real_update(model, [recorder], dict(batch), once, autocast, ref_model if kl_coef else None, owners)
    return recorder.received[:sum(1 for p in model.parameters() if p.requires_grad)]


def norm(tensors):
    return torch.sqrt(sum(t.double().square().sum() for t in tensors)).item()


calls = []
real_update = grpo.policy_update


def measured_update(model, optimizers, batch, args, autocast, ref_model=None, owners=None):
    calls.append(1)
    if len(calls) in cli.steps and ref_model is not None:
        with_kl = first_gradient(model, batch, args, autocast, ref_model, owners, args.kl_coef)
        without = first_gradient(model, batch, args, autocast, ref_model, owners, 0.0)
        kl_part = [a - b for a, b in zip(with_kl, without)]
        equal = batch["equal_groups"].float().mean().item()
        print(f"MEASURED step {len(calls)}: |grad policy term| {norm(without):.4g}, |grad KL term| {norm(kl_part):.4g}"
              f" (beta {args.kl_coef}), ratio {norm(kl_part) / max(norm(without), 1e-30):.3g}, equal groups "
              f"{equal:.2f}", flush=True)
    return real_update(model, optimizers, batch, args, autocast, ref_model, owners)


grpo.policy_update = measured_update
with tempfile.TemporaryDirectory() as runs:
    grpo.main(["--demo", "--algo", cli.algo, "--seed", str(cli.seed), "--num-steps", str(max(cli.steps)),
               "--runs-dir", runs, "--run-name", "kl", "--save-every", "0", "--log-samples", "0",
               "--eval-every", str(max(cli.steps))])
