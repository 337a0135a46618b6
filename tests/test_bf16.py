"""Mixed precision (--dtype bfloat16) is CPU autocast here and CUDA autocast on a GPU: the same code, tested on the CPU."""
import copy
import json
import logging
import os
import re
import runpy
import sys

import pytest
import torch

import grpo
import model as model_module
from model import GENERATIONS, KVCache, generate, load_checkpoint
from test_generations import EMBEDDINGS, FIXTURES, TOK, nanochat_dir, random_model, random_tokens
from test_distill import teacher_folder
from test_grpo import GradRecorder, args_for, run_flags, sampled_batch

BF16 = torch.autocast("cpu", dtype=torch.bfloat16)
# bf16 keeps 8 bits of mantissa: log-probs of about -6 to -15 move by a few hundredths of a nat.
LOGPROB_MAX_ERROR, LOGPROB_MEAN_ERROR = 0.1, 0.02
BF16_LOGIT_NOISE = 0.25  # four bf16 steps at the softcap's scale


@pytest.mark.parametrize("algo", grpo.PRESETS)
def test_one_bf16_step_of_every_preset(algo, tmp_path):
    teacher = ["--teacher", str(teacher_folder(tmp_path))] if grpo.PRESETS[algo]["distill_coef"] else []
    model = grpo.main(run_flags(tmp_path, algo, "--algo", algo, "--dtype", "bfloat16", "--num-steps", "2", *teacher))
    metrics = [json.loads(line) for line in open(tmp_path / algo / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(v is None or v == v for m in metrics for v in m.values())  # no NaN anywhere
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay float32


def test_bf16_first_update_has_ratio_one_and_the_reinforce_gradient():
    reinforce = args_for("--algo", "reinforce")
    grpo_like = args_for("--algo", "grpo", "--ppo-epochs", "2", "--kl-coef", "0", "--advantage", "mean",
                         "--aggregation", "nanochat")
    model, batch = sampled_batch(reinforce)
    grads = {}
    for name, args in (("reinforce", reinforce), ("grpo", grpo_like)):
        recorder = GradRecorder(model)
        stats, _ = grpo.policy_update(model, [recorder], batch, args, BF16)
        assert stats["ratio_min"] == stats["ratio_max"] == 1.0 and not stats["clip_frac"]  # None with one update
        grads[name] = recorder.grads[0]  # the first update of the batch
    assert batch["advantages"].abs().sum() > 0
    for a, b in zip(grads["reinforce"], grads["grpo"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_bf16_logprobs_stay_near_float32(generation):
    model = random_model(generation, scale=0.1)
    ids = torch.tensor(random_tokens(150, 150, seed=3))
    with torch.no_grad():
        exact = model.token_logprobs(ids[:, :-1], ids[:, 1:])
        with BF16:
            mixed = model.token_logprobs(ids[:, :-1], ids[:, 1:])
    assert mixed.dtype == torch.float32
    assert (mixed - exact).abs().max() < LOGPROB_MAX_ERROR and (mixed - exact).abs().mean() < LOGPROB_MEAN_ERROR


@pytest.mark.parametrize("name", ["classic", "smear-backout"])
def test_bf16_logprobs_of_nanochat_fixtures_stay_near_nanochat_float32(name):
    folder = os.path.join(FIXTURES, name)
    if not os.path.isdir(folder):
        pytest.skip(f"nanochat fixture {name} not found")
    reference = torch.load(os.path.join(folder, "reference.pt"))
    model, _ = load_checkpoint(os.path.join(folder, "base", "chatsft_checkpoints", "d4"))
    ids = torch.tensor([reference["prompt_logprob"] + reference["continuation"]])
    with torch.no_grad(), BF16:
        mixed = model.token_logprobs(ids[:, :-1], ids[:, 1:])[0, len(reference["prompt_logprob"]) - 1:]
    assert (mixed - reference["logprobs"]).abs().max() < LOGPROB_MAX_ERROR


@pytest.mark.parametrize("generation", ["padded-vocab", "smear-backout"])
def test_bf16_sampler_greedy_equals_a_bf16_forward_without_cache(generation):
    # Cached and uncached bf16 forwards round differently, and bf16 logits of size 8-16 are spaced 0.0625 apart,
    # so near-ties may break either way: each greedy token must be within that noise of the uncached maximum, and
    # must be the uncached argmax wherever that leads by more than the noise. What this processor's rounding
    # decides is kept out: the model never stops (the stop and tool tokens' head rows are zero, logit 0, far below
    # the top of these spread-out logits), so every reply has its 24 tokens.
    model = random_model(generation, scale=0.5)
    with torch.no_grad():
        model.lm_head.weight[[TOK.assistant_end, TOK.bos, TOK.python_start, TOK.python_end]] = 0
    prompts = random_tokens(40, 75, 33, 60)
    with BF16:
        sampled = generate(model, TOK, prompts, 1, 24, temperature=0)
    assert sampled["lengths"].tolist() == [24] * 4 and sampled["truncated"].all()
    clear_leads = 0
    for row, prompt in enumerate(prompts):
        reply = sampled["tokens"][row]
        with torch.no_grad(), BF16:
            logits = model(torch.cat([torch.tensor(prompt), reply])[None])[0, len(prompt) - 1:-1]  # [T, V]
        chosen = logits.gather(1, reply[:, None]).squeeze(1)
        assert (logits.max(dim=1).values - chosen).max() < BF16_LOGIT_NOISE
        top2 = logits.topk(2, dim=1).values
        clear = top2[:, 0] - top2[:, 1] > BF16_LOGIT_NOISE
        assert torch.equal(logits.argmax(dim=1)[clear], reply[clear])
        clear_leads += clear.sum().item()
    assert clear_leads >= 48  # half the tokens, so the exact comparison has teeth (measured: 70 and 80 of 96)


def test_the_kv_cache_holds_bf16_when_the_qk_norm_returns_float32(monkeypatch):
    # CUDA's autocast runs rms_norm in float32 (its float32 op list; the CPU's runs it in bf16), so q and k leave the
    # QK-norm in float32 there: simulated here. Attention computes in bf16 either way; the cache must hold bf16 too,
    # or every decode step reads twice the bytes and SDPA casts the whole cache again.
    monkeypatch.setattr(model_module, "norm", lambda x: torch.nn.functional.rms_norm(x.float(), (x.size(-1),)))
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or sdpa(q, k, v, **kw))
    model = random_model("smear-backout")
    cache = KVCache(model.config.n_layer, torch.zeros(2, dtype=torch.long), 16)
    with torch.no_grad(), BF16:
        model.hidden(torch.tensor(random_tokens(8, 8)), cache)
    assert {t.dtype for t in cache.k + cache.v} == {torch.bfloat16}
    assert set(seen) == {(torch.bfloat16,) * 3} and len(seen) == model.config.n_layer


def test_bf16_run_saves_float32_master_weights_and_nanochat_dtypes(tmp_path):
    init = nanochat_dir(tmp_path, "smear-backout")
    grpo.main(["--demo", "--init", init, "--dtype", "bfloat16", "--runs-dir", str(tmp_path), "--run-name", "bf",
               "--eval-every", "0", "--prompts-per-step", "4", "--num-samples", "2", "--num-steps", "1", "--no-plot"])
    out = tmp_path / "bf" / "chatrl_checkpoints" / "d4"
    saved = torch.load(out / "model_000001.pt", weights_only=True)
    source = torch.load(os.path.join(init, "model_000005.pt"), weights_only=True)
    assert {k: v.dtype for k, v in saved.items()} == {k: v.dtype for k, v in source.items()}
    assert {v.dtype for k, v in saved.items() if k.startswith(EMBEDDINGS)} == {torch.bfloat16}
    state = torch.load(out / "state_000001.pt", weights_only=True)
    assert set(state["master_weights"]) == {k for k in saved if k.startswith(EMBEDDINGS)}
    assert {v.dtype for v in state["master_weights"].values()} == {torch.float32}


def test_gpu_bench_runs_its_code_on_a_tiny_shape(monkeypatch, capsys):
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_gpu.py")

    def run(*argv):  # in this process, as `python bench_gpu.py ...` runs it, without a second interpreter's start
        monkeypatch.setattr(sys, "argv", [bench, *argv])
        try:
            runpy.run_path(bench, run_name="__main__")
        except SystemExit as e:
            assert not e.code
        return capsys.readouterr().out

    smoke = run("--smoke")
    assert "decode step" in smoke and "step reinforce" in smoke and "step grpo" in smoke
    assert "nothing to measure" in run()  # the suite's CUDA is hidden (conftest): as on a machine without a GPU


@pytest.mark.parametrize("generation", ["classic", "smear-backout"])
def test_a_bf16_stored_reference_gives_the_float32_references_log_probs(generation, monkeypatch):
    model = random_model(generation)
    ids = torch.tensor(random_tokens(40, 40))
    float32_reference = copy.deepcopy(model)
    stored = copy.deepcopy(model)
    for module in stored.modules():  # what start_run does with --ref-dtype bfloat16
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    assert sum(p.numel() for p in stored.parameters() if p.dtype == torch.bfloat16) > 0.5 * sum(
        p.numel() for p in stored.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = float32_reference.token_logprobs(ids[:, :-1], ids[:, 1:])
        b = stored.token_logprobs(ids[:, :-1], ids[:, 1:])
    assert torch.equal(a, b)  # measured: identical (the matmuls' weights were cast to bf16 either way)


def test_a_bf16_reference_is_built_by_default_under_bf16_and_resumes_exactly(tmp_path, run_killed_after_first_save):
    flags = ["--demo", "--algo", "grpo", "--dtype", "bfloat16", "--runs-dir", str(tmp_path), "--eval-every", "0",
             "--prompts-per-step", "4", "--num-samples", "2", "--num-steps", "3", "--save-every", "1",
             "--ref-reset-every", "2", "--no-plot"]
    grpo.main(flags + ["--run-name", "straight"])
    run_killed_after_first_save(flags + ["--run-name", "resumed"])
    grpo.main(flags + ["--run-name", "resumed", "--resume"])
    states = [torch.load(tmp_path / name / "chatrl_checkpoints" / "d2" / "state_000003.pt", weights_only=True)
              for name in ("straight", "resumed")]
    reference = states[0]["ref_model"]
    assert reference["lm_head.weight"].dtype == torch.bfloat16 and reference["transformer.wte.weight"].dtype == \
        torch.float32
    for k in reference:  # the reference, reset from the policy at step 2, is the same after a resume
        assert torch.equal(reference[k], states[1]["ref_model"][k]), k
    with pytest.raises(SystemExit):
        grpo.main(flags + ["--run-name", "f32", "--dtype", "float32", "--ref-dtype", "bfloat16"])


def test_the_side_by_side_with_nanochat_runs_on_a_tiny_shape(monkeypatch, capsys):
    # tests/bench_vs_nanochat.py --smoke --part rollouts, in this process: nanochat's own GPT and Engine next to ours on
    # the same weights (skipped without nanochat's code in ../shared/peers). Its other parts step nanochat's optimizer,
    # whose compiled functions take 8 s to compile on a CPU: `--smoke` alone runs them.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    peer = os.environ.get("NANOCHAT_PEER", os.path.join(root, "..", "shared", "peers", "nanochat"))
    if not os.path.isfile(os.path.join(peer, "nanochat", "gpt.py")):
        pytest.skip("nanochat's code not found (../shared/peers/nanochat or $NANOCHAT_PEER)")
    bench = os.path.join(root, "tests", "bench_vs_nanochat.py")
    monkeypatch.setattr(sys, "argv", [bench, "--smoke", "--part", "rollouts"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script appends nanochat's folder: undone after
    before, root = set(sys.modules), logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # nanochat's import sets the root logger up: undone
    monkeypatch.setattr(root, "level", root.level)
    try:
        runpy.run_path(bench, run_name="__main__")
    finally:
        for name in set(sys.modules) - before:  # nanochat's modules and the stand-ins its tokenizer module imports
            if name.split(".")[0] in ("nanochat", "rustbpe", "tokenizers"):
                del sys.modules[name]
    out = capsys.readouterr().out
    apart = float(re.search(r"logits (\S+) apart", out).group(1))  # the same weights in both, float32 on the CPU
    assert apart < 1e-4, out
    assert "(a) rollouts: nanochat's Engine as chat_rl.py calls it" in out and "grpo.py's sampler" in out
