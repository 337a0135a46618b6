"""
nanochat's optimizer step, version by version, against the weights nanochat's own RL script left after two update
steps on each fixture checkpoint (`chat_rl_steps.pt`: its batches, optimizer groups and weights, float32 on a CPU).
Every shape, setting and batch is read from the fixture files.
"""
import glob
import os
from contextlib import nullcontext

import pytest
import torch

import grpo
import model as model_module
from model import load_checkpoint
from test_generations import FIXTURES

STEPS = sorted(glob.glob(os.path.join(FIXTURES, "*", "chat_rl_steps.pt")))


def fixture_flags(fixture):
    """The fixture's chat_rl settings as the project's own flags, with --algo reinforce (nanochat's RL step)."""
    args = fixture["chat_rl_args"]
    return ["--algo", "reinforce", "--init", "x", "--optimizer", "muon", "--embedding-lr", str(args["embedding_lr"]),
            "--unembedding-lr", str(args["unembedding_lr"]), "--matrix-lr", str(args["matrix_lr"]), "--weight-decay",
            str(args["weight_decay"]), "--init-lr-frac", str(args["init_lr_frac"]), "--num-steps",
            str(fixture["num_steps"]), "--device-batch-size", str(args["device_batch_size"]), "--pass-size",
            str(args["device_batch_size"]), "--prompts-per-step",
            str(args["examples_per_step"]), "--num-samples", str(args["num_samples"])]


def fixture_batch(step, args):
    """The fixture's examples as the sampler would have handed them over: per question a prompt and G replies
    (every reply token sampled), and the rewards; then the project's own make_batch."""
    prompts, replies, rewards = [], [], []
    for example in step["examples"]:
        P = example["prompt_len"]
        prompts.append(example["inputs"][0, :P].tolist())
        for row, length in enumerate(example["completion_lens"]):  # the reply is the targets after the prompt
            replies.append(example["targets"][row, P - 1:P - 1 + length].tolist())
        rewards.append(example["rewards"])
    width = max(len(r) for r in replies)
    samples = dict(tokens=torch.tensor([r + [0] * (width - len(r)) for r in replies]),
                   mask=torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in replies]),
                   logprobs=torch.zeros(len(replies), width), lengths=torch.tensor([len(r) for r in replies]),
                   truncated=torch.zeros(len(replies), dtype=torch.bool))
    batch = grpo.make_batch(prompts, samples, torch.stack(rewards), args)
    expected = torch.cat([example["advantages"] for example in step["examples"]])
    torch.testing.assert_close(batch["advantages"], expected, rtol=0, atol=1e-7)  # r - mean(r), as nanochat's
    return batch


def learning_rates(model, optimizers):
    """{parameter name: its group's lr} of the project's optimizers"""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: group["lr"] for opt in optimizers for group in opt.param_groups for p in group["params"]}


def misses(name, ours, theirs, start, padded_rows):
    """Elements outside 1e-3 max|dW| + 4 ulp(|W|), and the update's relative Frobenius distance."""
    rows = padded_rows.get(name, [None])[0]
    ours, theirs, start = (t[:rows] if rows else t for t in (ours, theirs, start))
    update = theirs - start
    bound = 1e-3 * update.abs().max() + 4 * 2.0 ** -23 * theirs.abs()
    distance = ((ours - start) - update).norm() / update.norm().clamp(min=1e-30)
    return int(((ours - theirs).abs() > bound).sum()), float(distance)


def run_fixture(path, version=None):
    """Drive the fixture's steps through a run's own step: learning rates, make_batch, policy_update (loss,
    gradients, optimizer). -> per stored state {name: (elements beyond the bound, relative distance)}"""
    fixture = torch.load(path, weights_only=True)
    model, _ = load_checkpoint(os.path.join(os.path.dirname(path), fixture["checkpoint_dir"]),
                               fixture["checkpoint_step"], generation=fixture["generation"], log=lambda line: None)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    flags = fixture_flags(fixture) + (["--optimizer-version", version] if version else [])
    args = grpo.resolve_config(flags)
    optimizers = model_module.make_optimizers(model, args)
    results = []
    for index, step in enumerate(fixture["steps"]):
        grpo.set_learning_rates(optimizers, index, args)
        if version is None:  # nanochat's groups and learning rates, parameter by parameter
            theirs = {name: lr for group, lr in zip(fixture["param_groups"], step["group_lrs"])
                      for name in group["params"]}
            assert learning_rates(model, optimizers) == pytest.approx(theirs, rel=1e-6)
        grpo.policy_update(model, optimizers, fixture_batch(step, args), args, nullcontext())
        if index + 1 in fixture["state_steps"]:
            state, ours = fixture["states"][fixture["state_steps"].index(index + 1)], model.state_dict()
            results.append({k: misses(k, ours[k], state[k].float(), start[k], fixture["padded_rows"])
                            for k in state})
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


@pytest.mark.parametrize("version", list(model_module.OPTIMIZER_VERSIONS))
def test_muon_steps_a_matrix_alike_in_any_stack(version, monkeypatch):
    # Muon steps its same-shape matrices as one stack: a matrix's step must not depend on the others stacked with it
    # (a sharded rank stacks other matrices than one process does, and a stack holds at most MUON_STACK_BYTES).
    # Two steps, momentum and NorMuon's moments included, bitwise.
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 16), (16, 32), (32, 16), (32, 16), (8, 8)]
    start = [torch.randn(shape, generator=gen) for shape in shapes]
    steps = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(2)]

    def weights_after(stacks):  # stacks: lists of indices whose gradients are set for one opt.step()
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = model_module.Muon(params, lr=0.02, version=version, weight_decay=0.1)
        for grads in steps:
            for stack in stacks:
                for i in stack:
                    params[i].grad = grads[i].clone()
                opt.step()
                for i in stack:
                    params[i].grad = None
        return [p.detach() for p in params]

    alone = weights_after([[i] for i in range(len(shapes))])
    monkeypatch.setattr(model_module, "MUON_STACK_BYTES", 2 * 32 * 16 * 4)  # the three 32 x 16 in stacks of two and one
    for stacks in ([list(range(len(shapes)))], [[0, 3], [1, 2, 4]]):
        for ours, theirs in zip(weights_after(stacks), alone):
            assert torch.equal(ours, theirs)
