"""
nanochat's optimizer step, version by version, against the weights nanochat's own RL script left after two update
steps on each fixture checkpoint (`chat_rl_steps.pt`: its batches, optimizer groups and weights, float32 on a CPU).
Every shape, setting and batch is read from the fixture files.
"""
import glob
import os

import pytest
import torch

import grpo
from model import load_checkpoint
from test_generations import FIXTURES

STEPS = sorted(glob.glob(os.path.join(FIXTURES, "*", "chat_rl_steps.pt")))


def fixture_flags(fixture):
    args = fixture["chat_rl_args"]
    return ["--init", "x", "--optimizer", "muon", "--embedding-lr", str(args["embedding_lr"]), "--unembedding-lr",
            str(args["unembedding_lr"]), "--matrix-lr", str(args["matrix_lr"]), "--weight-decay",
            str(args["weight_decay"]), "--init-lr-frac", str(args["init_lr_frac"]), "--num-steps",
            str(fixture["num_steps"]), "--device-batch-size", str(fixture["B"])]


def nanochat_step(model, optimizers, step, fixture, args):
    """One step of nanochat's RL script: its loss over passes of B sequences, then one optimizer step."""
    grpo.set_learning_rates(optimizers, step["index"], args)
    model.train()
    for example in step["examples"]:
        passes = fixture["S"] // fixture["B"]
        for start in range(0, fixture["S"], fixture["B"]):
            inputs = example["inputs"][start:start + fixture["B"]]
            targets = example["targets"][start:start + fixture["B"]]
            valid = targets >= 0
            logp = model.token_logprobs(inputs, targets.clamp(min=0)) * valid
            loss = -(logp * example["advantages"][start:start + fixture["B"], None]).sum() / (
                valid.sum().clamp(min=1) * passes * fixture["E"])
            loss.backward()
    stats = grpo.update_stats(torch.device("cpu"))
    grpo.optimizer_step(model, optimizers, stats, 0.0)


def misses(name, ours, theirs, start, padded_rows):
    """Elements outside 1e-3 max|dW| + 4 ulp(|W|), and the update's relative Frobenius distance."""
    rows = padded_rows.get(name, [None])[0]
    ours, theirs, start = (t[:rows] if rows else t for t in (ours, theirs, start))
    update = theirs - start
    bound = 1e-3 * update.abs().max() + 4 * 2.0 ** -23 * theirs.abs()
    distance = ((ours - start) - update).norm() / update.norm().clamp(min=1e-30)
    return int(((ours - theirs).abs() > bound).sum()), float(distance)


def run_fixture(path, version=None):
    fixture = torch.load(path, weights_only=True)
    model, _ = load_checkpoint(os.path.join(os.path.dirname(path), fixture["checkpoint_dir"]),
                               fixture["checkpoint_step"], generation=fixture["generation"], log=lambda line: None)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    flags = fixture_flags(fixture) + (["--optimizer-version", version] if version else [])
    args = grpo.resolve_config(flags)
    optimizers = grpo.make_optimizers(model, args)
    results = []
    for index, (step, state) in enumerate(zip(fixture["steps"], fixture["states"])):
        nanochat_step(model, optimizers, dict(step, index=index), fixture, args)
        ours = model.state_dict()
        results.append({k: misses(k, ours[k], state[k].float(), start[k], fixture["padded_rows"]) for k in state})
    return results


@pytest.mark.skipif(not STEPS, reason="nanochat fixtures not found (../shared/fixtures/nanochat or $NANOGRPO_FIXTURES)")
@pytest.mark.parametrize("path", STEPS, ids=[os.path.basename(os.path.dirname(p)) for p in STEPS])
def test_the_optimizer_of_the_checkpoints_generation_takes_nanochats_steps(path):
    for results in run_fixture(path):
        assert sum(count for count, _ in results.values()) <= 10, {k: r for k, r in results.items() if r[0]}
        assert max(distance for _, distance in results.values()) <= 1e-3, max(results.items(), key=lambda r: r[1][1])


@pytest.mark.skipif(not STEPS, reason="nanochat fixtures not found (../shared/fixtures/nanochat or $NANOGRPO_FIXTURES)")
def test_another_versions_optimizer_misses_the_fixture():
    path = next(p for p in STEPS if os.path.basename(os.path.dirname(p)) == "smear-backout")
    for version in ("v1", "v4"):  # v4 is v5 without MuonEq and Muon+
        assert sum(count for count, _ in run_fixture(path, version)[0].values()) > 1000, version
