"""LoRA (--lora-rank): adapters on the block matrices, the base as the KL reference, merged saves, exact resume."""
import gc
import json
import os

import pytest
import torch

import grpo
import model as model_module
from model import GENERATIONS, load_checkpoint, save_checkpoint
from tasks.sort import Sort
from test_generations import nanochat_dir, random_model, random_tokens


def with_random_adapters(model, rank=4, seed=0):
    """Adapters whose B is not zero, as after some training: the adapted model differs from the base."""
    model.add_lora(rank, 2 * rank, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.lora.items():
            if name.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def lora_flags(init, tmp_path, *extra):
    return ["--demo", "--init", init, "--algo", "grpo", "--lora-rank", "4", "--lora-lr", "1e-2",
            "--runs-dir", str(tmp_path), "--eval-every", "0", "--prompts-per-step", "4", "--num-samples", "4",
            "--num-steps", "3", "--no-plot", *extra]


@pytest.fixture
def differing_rewards(monkeypatch):
    # A random model never writes a sorted answer: a reward that differs between replies gives the update a signal.
    monkeypatch.setattr(Sort, "reward", lambda self, conversation, reply: sum(reply.encode()) % 7 / 6)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_adapters_start_as_and_switch_off_to_the_loaded_model_exactly(generation):
    model = random_model(generation, scale=0.1)
    ids = torch.tensor(random_tokens(40, 40, seed=2))
    with torch.no_grad():
        loaded = model(ids)
        model.add_lora(4, 8, seed=0)
        torch.testing.assert_close(model(ids), loaded, rtol=0, atol=0)  # B = 0: exactly the loaded model
        with_random_adapters(model)
        adapted = model(ids)
        with model.lora_disabled():
            torch.testing.assert_close(model(ids), loaded, rtol=0, atol=0)
    assert (adapted - loaded).abs().max() > 1e-3  # the adapters do change the model when on
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(name.startswith("lora.") for name in trainable)
    assert len(trainable) == 2 * 6 * model.config.n_layer  # q, k, v, attention out, MLP in and out: A and B each


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_merged_save_loads_as_its_generation_and_computes_the_adapted_model(generation, tmp_path):
    model = random_model(generation, scale=0.1)
    model.disk_dtypes = {"transformer.wte.weight": torch.bfloat16}  # as nanochat's files; its values bf16 already
    model.transformer.wte.weight.data = model.transformer.wte.weight.data.bfloat16().float()
    save_checkpoint(str(tmp_path / "plain"), 1, model)
    with_random_adapters(model)
    save_checkpoint(str(tmp_path / "lora"), 1, model)
    plain = torch.load(tmp_path / "plain" / "model_000001.pt", weights_only=True)
    merged = torch.load(tmp_path / "lora" / "model_000001.pt", weights_only=True)
    assert {k: (v.shape, v.dtype) for k, v in merged.items()} == {k: (v.shape, v.dtype) for k, v in plain.items()}
    loaded, _ = load_checkpoint(str(tmp_path / "lora"))
    assert loaded.generation_name == generation and loaded.lora is None
    ids = torch.tensor(random_tokens(40, 40, seed=2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=1e-5)


def test_merging_keeps_the_function_restarts_the_adapters_and_moves_the_reference():
    model = with_random_adapters(random_model("smear-backout", scale=0.1))
    optimizers = model_module.make_optimizers(model, grpo.resolve_config(["--init", "x", "--lora-rank", "4"]))
    ids = torch.tensor(random_tokens(40, seed=2))
    (-model.token_logprobs(ids[:, :-1], ids[:, 1:]).mean()).backward()
    optimizers[0].step()
    assert optimizers[0].state
    with torch.no_grad():
        adapted = model(ids)
        args = grpo.resolve_config(["--init", "x", "--lora-rank", "4", "--kl-coef", "0.1", "--ref-reset-every", "2"])
        grpo.reset_reference(model, model, optimizers, 2, args)
        torch.testing.assert_close(model(ids), adapted, rtol=0, atol=1e-5)
        with model.lora_disabled():  # the reference is now the policy as it was
            torch.testing.assert_close(model(ids), adapted, rtol=0, atol=1e-5)
    assert all(not p.any() for name, p in model.lora.items() if name.endswith("_B"))
    assert all(p.abs().max() > 0 for name, p in model.lora.items() if name.endswith("_A"))
    assert not optimizers[0].state  # Adam's moments belonged to the old adapters


def live_tensor_bytes():
    """Bytes of all tensor storages alive in this process, each storage once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_lora_with_kl_holds_one_copy_of_the_base_and_its_kl_is_to_the_base(tmp_path, differing_rewards):
    init = nanochat_dir(tmp_path, "smear-backout")
    base_bytes = sum(t.nbytes for t in load_checkpoint(init)[0].state_dict().values())
    gc.collect()
    before = live_tensor_bytes()
    for lora_rank, copies in (("4", (0.9, 1.2)), ("0", (1.9, 2.5))):  # LoRA: the base; full GRPO: the base, a copy
        args = grpo.resolve_config(lora_flags(init, tmp_path, "--lora-rank", lora_rank, "--run-name", lora_rank))
        run = grpo.start_run(args, str(tmp_path / lora_rank), 0, writes=False)
        held = (live_tensor_bytes() - before) / base_bytes
        assert copies[0] < held < copies[1], (lora_rank, held)
        assert (run.ref_model is run.model) == (lora_rank == "4")
        del run
    grpo.main(lora_flags(init, tmp_path, "--run-name", "kl", "--ppo-epochs", "1"))
    kl = [json.loads(line)["kl"] for line in open(tmp_path / "kl" / "metrics.jsonl")]
    # Step 1 updates a policy equal to the base (B = 0): KL 0 exactly. After it the adapters differ from the base,
    # and the KL says so (measured against the adapted model itself it would stay 0).
    assert kl[0] == 0 < kl[1]


def test_lora_trains_only_the_block_matrices_and_saves_its_generation(tmp_path, differing_rewards):
    init = nanochat_dir(tmp_path, "smear-backout")
    grpo.main(lora_flags(init, tmp_path, "--run-name", "lora"))
    source = torch.load(os.path.join(init, "model_000005.pt"), weights_only=True)
    saved = torch.load(tmp_path / "lora" / "chatrl_checkpoints" / "d4" / "model_000003.pt", weights_only=True)
    assert {k: (v.shape, v.dtype) for k, v in saved.items()} == {k: (v.shape, v.dtype) for k, v in source.items()}
    adapted = {name + ".weight" for name, _ in load_checkpoint(init)[0].lora_targets()}
    for k, v in saved.items():
        assert torch.equal(v, source[k]) != (k in adapted), k  # every adapted matrix moved, nothing else did
    assert load_checkpoint(str(tmp_path / "lora" / "chatrl_checkpoints" / "d4"))[0].generation_name == "smear-backout"


# The oldest generation, the first with value embeddings (bf16 tables on disk beside the adapters) and the newest:
# what LoRA adds to a resume is generation-independent (adapters on the block matrices, which every generation
# has), and test_resume_is_exact_for_every_generation covers each generation's own state.
@pytest.mark.parametrize("generation", ["classic", "value-embeds", "smear-backout"])
def test_a_resumed_lora_run_equals_an_uninterrupted_one(generation, tmp_path, differing_rewards,
                                                        run_killed_after_first_save):
    init = nanochat_dir(tmp_path, generation)
    # the reference reset at step 2 merges the adapters after the kill: the resumed run must merge the same ones
    flags = lora_flags(init, tmp_path, "--save-every", "1", "--ref-reset-every", "2")
    grpo.main(flags + ["--run-name", "straight"])
    run_killed_after_first_save(flags + ["--run-name", "resumed"])
    grpo.main(flags + ["--run-name", "resumed", "--resume"])
    out = {name: tmp_path / name / "chatrl_checkpoints" / "d4" for name in ("straight", "resumed")}
    for step in (2, 3):
        files = [torch.load(out[name] / f"model_{step:06d}.pt", weights_only=True) for name in out]
        states = [torch.load(out[name] / f"state_{step:06d}.pt", weights_only=True) for name in out]
        for k, v in files[0].items():
            assert torch.equal(v, files[1][k]), (step, k)
        for k, v in states[0]["master_weights"].items():
            assert torch.equal(v, states[1]["master_weights"][k]), (step, k)
        assert any(k.startswith("lora.") for k in states[0]["master_weights"]) and states[0]["ref_model"] is None
    logs = [[json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in out]
    assert [m["loss"] for m in logs[0]] == [m["loss"] for m in logs[1]]


def test_a_lora_run_resumes_with_a_lower_lora_lr(tmp_path, run_killed_after_first_save, capsys):
    # the weight-norm warning and docs/reliability.md say to lower the step sizes and resume: --lora-lr is one
    init = nanochat_dir(tmp_path, "classic")
    flags = lora_flags(init, tmp_path, "--save-every", "1", "--run-name", "r")
    run_killed_after_first_save(flags)
    capsys.readouterr()
    grpo.main(flags + ["--resume", "--lora-lr", "1e-3"])
    assert "lora_lr 0.01 -> 0.001" in capsys.readouterr().out
    config = json.load(open(tmp_path / "r" / "config.json"))
    assert config["lora_lr"] == 1e-3 and config["resumed_with"] == [dict(step=1, lora_lr=[0.01, 0.001])]
