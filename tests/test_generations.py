"""Every nanochat GPT generation: against nanochat's own numbers (the fixtures in ../shared, skipped without them),
and the same properties on models made here (always run)."""
import copy
import json
import os
import pickle
from argparse import Namespace
from contextlib import nullcontext

import pytest
import torch

import grpo
import model as model_module
from model import (GENERATIONS, GPT, GPTConfig, KVCache, Tokenizer, generate, load_checkpoint, master_weights,
                   save_checkpoint)
from tasks.gsm8k import calculator
from tasks.sort import Sort

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.environ.get("NANOGRPO_FIXTURES", os.path.join(ROOT, "..", "shared", "fixtures", "nanochat"))
TOK = Tokenizer.byte_level()
WINDOWED = [name for name, gen in GENERATIONS.items() if gen.short_window]
EMBEDDINGS = ("transformer.wte.weight", "value_embeds.")


def random_model(generation, n_layer=4, sequence_len=64, window_pattern="SL", seed=0, scale=0.3):
    """A model of this generation with large random weights (peaked, input-dependent outputs), vocabulary
    padded as that generation pads it."""
    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=sequence_len, vocab_size=TOK.vocab_size, n_layer=n_layer, n_head=4, n_kv_head=2,
                       n_embd=64, window_pattern=window_pattern)
    model = GPT(config, generation)
    for p in model.parameters():
        p.data.normal_(0, scale)
    return model.eval()


def random_tokens(*lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def naive_greedy(model, prompt, max_new_tokens):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
    return ids[len(prompt):]


def one_step_of_training(model, optimizer):
    """One optimizer step of nanochat's scheme (or plain AdamW) on a fixed sequence -> names of params that moved."""
    args = Namespace(optimizer=optimizer, lr=1e-3, matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004,
                     init_lr_frac=1.0, weight_decay=0.0, lora_rank=0, optimizer_version=None, init="sft")
    optimizers = model_module.make_optimizers(model, args)
    before = {k: v.clone() for k, v in model.named_parameters()}
    ids = torch.tensor(random_tokens(150))
    model.train()
    (-model.token_logprobs(ids[:, :-1], ids[:, 1:]).mean()).backward()
    for opt in optimizers:
        opt.step()
    return optimizers, [k for k, v in model.named_parameters() if not torch.equal(v, before[k])], list(before)


# ---------------------------------------------------------------------------- models made here, every generation

@pytest.mark.parametrize("generation", GENERATIONS)
def test_cached_decoding_matches_full_forward(generation):
    # prompts longer than every window (S = 32 or 128, L = 64 here), left-padded to different lengths; after the
    # prefill the batch drops a row and reorders the rest, as the sampler does (the smear's last token moves along)
    model = random_model(generation)
    prompts = random_tokens(90, 131, 140)
    continuation = torch.tensor(random_tokens(8, 8, 8, seed=2))
    longest = max(map(len, prompts))
    cache = KVCache(model.config.n_layer, torch.tensor([longest - len(p) for p in prompts]), longest + 8)
    kept = [2, 0]
    with torch.no_grad():
        padded = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
        steps = [model(padded, cache)[kept, -1]]
        cache.select(torch.tensor(kept))
        steps += [model(continuation[kept, i:i + 1], cache)[:, -1] for i in range(8)]
        for row, b in enumerate(kept):
            full = model(torch.cat([torch.tensor(prompts[b]), continuation[b]])[None])[0, len(prompts[b]) - 1:]
            # the same tolerance as against nanochat: padding and batching change float32 summation order only
            torch.testing.assert_close(torch.stack([s[row] for s in steps]), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_batched_greedy_equals_one_at_a_time_and_no_cache(generation):
    model = random_model(generation)
    prompts = random_tokens(5, 70, 133)  # the first rows are left-padded: smear must not reach into padding
    batched = generate(model, TOK, prompts, num_samples=2, max_new_tokens=10, temperature=0)
    for i, p in enumerate(prompts):
        reference = naive_greedy(model, p, 10)
        single = generate(model, TOK, [p], num_samples=1, max_new_tokens=10, temperature=0)
        n = single["lengths"][0].item()
        assert single["tokens"][0, :n].tolist() == reference[:n]
        for row in (2 * i, 2 * i + 1):
            assert batched["tokens"][row, :n].tolist() == reference[:n]


def replies_that_end_at_different_steps(model, prompts):
    """The stop token made to win where the model's favourite token would: replies end at different steps."""
    with torch.no_grad():
        favourite = model(torch.tensor([sum(prompts, [])]))[0].argmax(dim=-1).mode().values
        model.lm_head.weight[TOK.assistant_end] = 1.02 * model.lm_head.weight[favourite]
    return model


@pytest.mark.parametrize("generation", GENERATIONS)
def test_static_decoding_samples_what_dynamic_decoding_samples(generation, monkeypatch):
    # Static shapes (every step attends over the whole cache, finished rows stay in the batch until half of it has
    # finished, then it halves) against the dynamic sampler, for sampled and greedy replies that end at different
    # times, some cut off, from prompts longer than the short windows. Tokens, masks and lengths are equal; the
    # log-probs differ by rounding only, as the attention sums over more (masked) columns.
    model = replies_that_end_at_different_steps(random_model(generation), random_tokens(5, 40, 77))
    prompts = random_tokens(5, 40, 77)
    sizes, step = [], model_module.decode_step
    monkeypatch.setattr(model_module, "decode_step", lambda model, cache, *a: sizes.append(cache.pad.numel()) or step(
        model, cache, *a))
    lengths = []
    for options in (dict(temperature=1.0, top_k=50, seed=3, tool=calculator), dict(temperature=0)):
        dynamic = generate(model, TOK, prompts, 4, 30, decode="dynamic", **options)
        sizes.clear()
        static = generate(model, TOK, prompts, 4, 30, decode="static", **options)
        for key in ("tokens", "mask", "lengths", "truncated"):
            assert torch.equal(dynamic[key], static[key]), key
        torch.testing.assert_close(dynamic["logprobs"], static["logprobs"], rtol=0, atol=1e-4)
        lengths += dynamic["lengths"].tolist()
        running = [int((dynamic["lengths"] > t + 1).sum()) for t in range(len(sizes))]  # rows left after token t
        halvings = [12 >> i for i in range(4)]  # 12 rows, then 6, 3, 1: a halving once half of the batch finished
        assert sizes == [next(s for s in reversed(halvings) if s >= n) for n in running], (sizes, running)
    assert len(set(lengths)) > 2  # rows finished at different steps (in 5 generations of 7, half of them: it halves)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_rows_made_to_end_at_chosen_steps_end_there_and_the_others_sample_as_they_would(decode):
    # generate's ends (the self-check's): a row's stop token forced at its step (not sampled: mask 0, log-prob 0),
    # the batch shrinking as it does when rows finish; the rows that go on sample what they sample without it, and
    # the ended rows' earlier tokens too (each row's noise is its own)
    prompts = random_tokens(5, 40, 77)
    model = random_model("smear-backout")
    ends = [1, -1, 3, 0, -1, 5, 1, 1, 2, -1, -1, 4]
    free = generate(model, TOK, prompts, 4, 12, seed=3, decode=decode)
    ended = generate(model, TOK, prompts, 4, 12, seed=3, decode=decode, ends=ends)
    assert (free["truncated"] & (free["lengths"] == 12)).all()  # without ends, no row stops on its own here
    for row, end in enumerate(ends):
        n = 12 if end < 0 else end + 1
        assert ended["lengths"][row] == n and ended["truncated"][row] == (end < 0)
        assert ended["tokens"][row, :n - (end >= 0)].tolist() == free["tokens"][row, :n - (end >= 0)].tolist()
        torch.testing.assert_close(ended["logprobs"][row, :n - (end >= 0)], free["logprobs"][row, :n - (end >= 0)],
                                   rtol=0, atol=1e-5)
        if end >= 0:
            assert ended["tokens"][row, end] == TOK.assistant_end and ended["mask"][row, end] == 0
            assert ended["logprobs"][row, end] == 0 and not ended["tokens"][row, n:].any()


@pytest.mark.parametrize("generation", ["classic", "value-embeds", "smear-backout"])
def test_a_decode_step_on_a_gpu_reads_each_rows_written_columns_only(generation, monkeypatch):
    # The CUDA branch of a static decode step (flash attention with seqused_k: each row's keys from its first real
    # column through this step's) on the CPU, through the kernel's strict stand-in: every call keeps the contract,
    # reads no padding and no column not yet written, as rows finish and the batch halves, and computes what the
    # masked attention over the whole cache does (both in bf16 against float64).
    from kernels import strict_varlen_attn
    prompts = random_tokens(5, 40, 77)
    model = replies_that_end_at_different_steps(random_model(generation), prompts)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=None, **kw):
        calls.append((cu_q.numel() - 1, max_k, seqused_k))
        return strict_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=seqused_k, **kw)
    monkeypatch.setattr(model_module, "varlen_attn", kernel)
    monkeypatch.setattr(model_module, "VARLEN_GQA", True)
    monkeypatch.setitem(model_module.DECODE_FLASH, "failed", False)
    monkeypatch.setattr(model_module, "flash_varlen", lambda q: q.dtype == torch.bfloat16)
    with bf16:
        for options in (dict(temperature=1.0, top_k=50, seed=3), dict(temperature=0)):
            generate(model, TOK, prompts, 4, 30, decode="static", **options)
    longest = max(map(len, prompts))
    probes = [i for i, call in enumerate(calls) if call[2].tolist() == [0, 1]]  # flash_decode_takes: once a call
    calls = [call for i, call in enumerate(calls) if i not in probes]
    # a row's span: its columns and the cache's spare one (KVCache)
    steps = [(rows - 1, used[1:]) for rows, width, used in calls[::model.config.n_layer] if width == longest + 31]
    assert len(probes) == 2 and len(calls) == model.config.n_layer * len(steps) and {rows for rows, _ in steps} > {12}
    # the first step of a call (the batch whole again): every row's whole prompt and its first reply token, but a
    # row that ended on it; each step one more
    first = [len(p) + 1 for p in prompts for _ in range(4)]
    starts = [i for i, (rows, _) in enumerate(steps) if i == 0 or rows > steps[i - 1][0]]
    assert len(starts) == 2 and all(u in (f, f - 1) for i in starts for u, f in zip(steps[i][1].tolist(), first))
    for i, (_, used) in enumerate(steps):  # a running row through this step's column; a finished one stays put
        t = i - max(start for start in starts if start <= i)
        assert all(any(len(p) <= u <= len(p) + 1 + t for p in prompts) for u in used.tolist()), (t, used)
        assert set((used - t).tolist()) & {len(p) + 1 for p in prompts}, (t, used)
    # the numbers: the same tokens forced through both paths in bf16, a row dropped half-way, each against float64
    continuation = torch.tensor(random_tokens(12, 12, 12, seed=2))
    exact = forced_decode_logits(copy.deepcopy(model).double(), prompts, continuation, nullcontext())
    errors = {}
    for flash in (False, True):
        monkeypatch.setattr(model_module, "flash_varlen", lambda q, on=flash: on and q.dtype == torch.bfloat16)
        errors[flash] = (forced_decode_logits(model, prompts, continuation, bf16) - exact).abs().max().item()
    assert errors[True] <= 2 * errors[False], errors


def test_a_flash_kernel_that_refuses_the_decode_steps_call_leaves_the_masked_attention_after_one_note(monkeypatch,
                                                                                                        capsys):
    # a torch build or GPU whose flash kernel refuses seqused_k: the decode reads the whole cache as before, the
    # same tokens, one note for the process; the run goes on
    def refusing(*args, seqused_k=None, **kwargs):
        if seqused_k is not None:
            raise RuntimeError("seqused_k is not supported by this build")
        return strict_varlen_attn(*args, **kwargs)
    from kernels import strict_varlen_attn
    prompts = random_tokens(5, 40, 77)
    model = replies_that_end_at_different_steps(random_model("smear-backout"), prompts)
    monkeypatch.setattr(model_module, "varlen_attn", refusing)
    monkeypatch.setattr(model_module, "VARLEN_GQA", True)
    monkeypatch.setitem(model_module.DECODE_FLASH, "failed", False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        masked = generate(model, TOK, prompts, 4, 30, seed=3, decode="static")  # (a CPU: no flash kernel)
        monkeypatch.setattr(model_module, "flash_varlen", lambda q: q.dtype == torch.bfloat16)
        refused = [generate(model, TOK, prompts, 4, 30, seed=3, decode="static") for _ in range(2)]
    for key in masked:
        assert all(torch.equal(masked[key], r[key]) for r in refused), key
    assert capsys.readouterr().out.count("note: flash attention does not take the decode step's call here") == 1


def forced_decode_logits(model, prompts, continuation, autocast):
    """Logits [rows, 1 + steps, V] of a prefill and of static decode steps on forced tokens; after half the steps the
    batch keeps rows 2 and 0, as a halving does."""
    longest, steps, device = max(map(len, prompts)), continuation.size(1), model.lm_head.weight.device
    cache = KVCache(model.config.n_layer, torch.tensor([longest - len(p) for p in prompts], device=device),
                    longest + steps)
    kept, continuation = torch.tensor([2, 0], device=device), continuation.to(device)
    with torch.no_grad(), autocast:
        logits = [model(torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device), cache)[kept, -1]]
        cache.make_static(model.config.n_head)
        for i in range(steps):
            if i == steps // 2:
                cache.select(kept)
            rows = kept if i >= steps // 2 else slice(None)
            logits.append(model(continuation[rows, i:i + 1], cache)[:, -1][kept if i < steps // 2 else slice(None)])
    return torch.stack(logits, dim=1).double().cpu()


@pytest.mark.cuda
@pytest.mark.parametrize("generation", ["classic", "smear-backout"])
def test_on_a_gpu_the_decode_steps_flash_attention_computes_what_the_masked_one_does(generation, monkeypatch):
    # the real kernel: flash attention over each row's written columns (cached_attention) against the masked
    # attention over the whole cache, both in bf16, each against float64, a row dropped half-way
    prompts = random_tokens(5, 40, 77)
    model = random_model(generation).cuda()
    continuation = torch.tensor(random_tokens(12, 12, 12, seed=2))
    exact = forced_decode_logits(copy.deepcopy(model).double(), prompts, continuation, nullcontext())
    bf16 = torch.autocast("cuda", dtype=torch.bfloat16)
    monkeypatch.setitem(model_module.DECODE_FLASH, "failed", False)
    flash = forced_decode_logits(model, prompts, continuation, bf16)
    assert not model_module.DECODE_FLASH["failed"], "this GPU's flash kernel refused the decode step's call"
    monkeypatch.setitem(model_module.DECODE_FLASH, "failed", True)  # the masked path
    masked = forced_decode_logits(model, prompts, continuation, bf16)
    assert (flash - exact).abs().max() <= 2 * (masked - exact).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["classic", "smear-backout"])
def test_a_compiled_decode_step_samples_what_the_eager_one_does(generation):
    # --compile with a static cache: decode_step through torch.compile (inductor, as on a GPU), for the oldest
    # generation (bf16-rounded rotary tables) and the newest (smear, backout, value embeddings, windows). Replies end
    # at different steps, with the calculator; a second call with other shapes reuses the compiled step.
    model = random_model(generation)
    prompts = random_tokens(5, 40, 77)
    with torch.no_grad():
        favourite = model(torch.tensor([sum(prompts, [])]))[0].argmax(dim=-1).mode().values
        model.lm_head.weight[TOK.assistant_end] = 1.02 * model.lm_head.weight[favourite]
    for batch in (prompts, prompts[1:]):
        results = {}
        for compiled in (False, True):
            model.use_compile = compiled
            results[compiled] = generate(model, TOK, batch, 4, 30, top_k=50, seed=3, tool=calculator, decode="static")
        for key in ("tokens", "mask", "lengths", "truncated"):
            assert torch.equal(results[False][key], results[True][key]), key
        torch.testing.assert_close(results[False]["logprobs"], results[True]["logprobs"], rtol=0, atol=1e-4)
    assert len(set(results[True]["lengths"].tolist())) > 2


@pytest.mark.cuda
@pytest.mark.parametrize("generation", ["classic", "smear-backout"])
def test_a_captured_decode_step_samples_what_the_eager_one_does(generation, monkeypatch, capsys):
    # the graph replays the static step's kernels: the same numbers, bit for bit, in float32 and under bf16; and a
    # capture that fails leaves the eager step to do the work, after one note
    model = random_model(generation).cuda()
    prompts = random_tokens(5, 40, 77)
    for autocast in (nullcontext(), torch.autocast("cuda", dtype=torch.bfloat16)):
        with autocast:
            static, graph = (generate(model, TOK, prompts, 4, 30, top_k=50, seed=3, decode=decode)
                             for decode in ("static", "graph"))
        for key in static:
            assert torch.equal(static[key], graph[key]), key
    # --compile: the compiled step is what is captured; in float32 it samples what the eager one does (as on the CPU)
    eager = generate(model, TOK, prompts, 4, 30, top_k=50, seed=3, decode="static")
    model.use_compile = True
    compiled = generate(model, TOK, prompts, 4, 30, top_k=50, seed=3, decode="graph")
    model.use_compile = False
    for key in ("tokens", "mask", "lengths", "truncated"):
        assert torch.equal(eager[key], compiled[key]), key
    torch.testing.assert_close(eager["logprobs"], compiled["logprobs"], rtol=0, atol=1e-4)
    monkeypatch.setitem(model_module.GRAPH_CAPTURE, "failed", False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: (_ for _ in ()).throw(RuntimeError("no capture here")))
    fallback = generate(model, TOK, prompts, 4, 30, top_k=50, seed=3, decode="graph")
    assert capsys.readouterr().out.count("note: the decode step could not be compiled or captured") == 1
    assert torch.equal(fallback["tokens"], generate(model, TOK, prompts, 4, 30, top_k=50, seed=3, decode="static")["tokens"])


@pytest.mark.parametrize("generation", WINDOWED)
def test_attention_reaches_exactly_its_window(generation):
    # two layers, S then L: the last position sees S + L tokens back (one more through the smear), and no further
    model = random_model(generation, n_layer=2, sequence_len=16, window_pattern="S")
    short = GENERATIONS[generation].short_window(16)
    reach = short + 16 + (1 if GENERATIONS[generation].smear_backout else 0)
    ids = torch.tensor(random_tokens(reach + 3))
    T = ids.size(1)
    with torch.no_grad():
        base = model(ids)[0, -1]
        for position, should_change in ((T - 1 - reach, True), (T - 2 - reach, False), (0, False)):
            changed = ids.clone()
            changed[0, position] = (changed[0, position] + 1) % 256
            difference = (model(changed)[0, -1] - base).abs().max().item()
            assert (difference > 1e-4) == should_change, (position, difference)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_save_load_round_trip_keeps_generation_dtypes_and_config(generation, tmp_path):
    model = random_model(generation)
    # as a nanochat checkpoint: embedding tables bf16 on disk, so the float32 weights hold bf16 values
    model.disk_dtypes = {k: torch.bfloat16 for k in model.state_dict() if k.startswith(EMBEDDINGS)}
    for k, p in model.named_parameters():
        if k in model.disk_dtypes:
            p.data = p.data.bfloat16().float()
    save_checkpoint(str(tmp_path / "d4"), 3, model)
    on_disk = torch.load(tmp_path / "d4" / "model_000003.pt", weights_only=True)
    assert list(on_disk) == list(model.state_dict())
    assert {k for k, v in on_disk.items() if v.dtype == torch.bfloat16} == set(model.disk_dtypes)
    meta = json.load(open(tmp_path / "d4" / "meta_000003.json"))
    assert ("window_pattern" in meta["model_config"]) == (generation in WINDOWED)
    loaded, _ = load_checkpoint(str(tmp_path / "d4"))
    assert loaded.generation_name == generation
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    # without our record of the generation, the files alone say it (value-embeds and softcap20 look the same)
    del meta["nanogrpo_generation"]
    (tmp_path / "d4" / "meta_000003.json").write_text(json.dumps(meta))
    notes = []
    detected = load_checkpoint(str(tmp_path / "d4"), log=notes.append)[0].generation_name
    assert detected == ("value-embeds" if generation == "softcap20" else generation)
    assert bool(notes) == (generation in ("value-embeds", "softcap20"))
    assert load_checkpoint(str(tmp_path / "d4"), generation=generation, log=notes.append)[0].generation_name == generation


def test_master_weights_keep_what_bf16_files_round_away(tmp_path):
    model = random_model("smear-backout")
    model.disk_dtypes = {k: torch.bfloat16 for k in model.state_dict() if k.startswith(EMBEDDINGS)}
    save_checkpoint(str(tmp_path / "d4"), 1, model)
    loaded, _ = load_checkpoint(str(tmp_path / "d4"))
    wte = "transformer.wte.weight"
    assert not torch.equal(loaded.state_dict()[wte], model.state_dict()[wte])  # rounded on disk
    loaded.load_state_dict(master_weights(model), strict=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


@pytest.mark.parametrize("generation", GENERATIONS)
def test_one_training_step_moves_every_parameter(generation):
    for optimizer in ("muon", "adamw"):
        model = random_model(generation)
        optimizers, moved, names = one_step_of_training(model, optimizer)
        assert moved == names, set(names) - set(moved)
    adamw, muon = model_module.make_optimizers(model, Namespace(
        optimizer="muon", matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004, init_lr_frac=0.5, weight_decay=0.0,
        lora_rank=0, optimizer_version=None, init="sft"))
    version = model_module.OPTIMIZER_VERSIONS[model_module.GENERATION_OPTIMIZER[generation]]  # nanochat's of this generation
    scale = (64 / 768) ** -0.5
    lrs = {id(p): (g["lr"], *g["betas"]) for g in adamw.param_groups for p in g["params"]}
    gen = GENERATIONS[generation]
    expected = [(model.lm_head.weight, 0.004 * scale * 0.5, "lm_head"), (model.transformer.wte.weight, 0.2 * scale * 0.5, "wte")]
    if gen.value_embeds:
        expected.append((model.value_embeds["3"].weight, 0.2 * scale * 0.5 * version["value_embed_lr"], "value_embeds"))
        assert any(p is model.transformer.h[3].attn.ve_gate.weight for p in muon.param_groups[0]["params"])
    if gen.lambdas:
        expected += [(model.resid_lambdas, 0.005 * 0.5, "resid_lambdas"), (model.x0_lambdas, 0.5 * 0.5, "x0_lambdas")]
    if gen.smear_backout:
        expected += [(p, 0.2 * 0.5, "smear") for p in (model.smear_lambda, model.backout_lambda, model.smear_gate.weight)]
    for p, lr, home in expected:
        assert lrs[id(p)] == pytest.approx((lr, *version["groups"][home][0])), home


def save_raw(path, state, model_config):
    os.makedirs(path, exist_ok=True)
    torch.save(state, os.path.join(path, "model_000001.pt"))
    with open(os.path.join(path, "meta_000001.json"), "w") as f:
        json.dump({"model_config": model_config}, f)


def test_files_nanogrpo_cannot_run_are_refused_by_name(tmp_path):
    model = random_model("value-embeds")
    config = dict(vars(model.config))
    save_raw(tmp_path / "engram", dict(model.state_dict(), **{"bigram_embed.embed.weight": torch.zeros(5, 64)}), config)
    with pytest.raises(ValueError, match="engram"):
        load_checkpoint(str(tmp_path / "engram"))
    save_raw(tmp_path / "future", dict(model.state_dict(), **{"future_gate.weight": torch.zeros(1, 8)}), config)
    with pytest.raises(ValueError, match="future_gate.weight"):
        load_checkpoint(str(tmp_path / "future"), log=lambda line: None)
    save_raw(tmp_path / "field", model.state_dict(), dict(config, mtp_depth=2))
    with pytest.raises(ValueError, match="mtp_depth"):
        load_checkpoint(str(tmp_path / "field"), log=lambda line: None)
    save_raw(tmp_path / "clean", model.state_dict(), config)
    with pytest.raises(ValueError, match="classic GPT.*ve_gate"):  # a generation the files cannot be
        load_checkpoint(str(tmp_path / "clean"), generation="classic")
    with pytest.raises(ValueError, match="unknown nanochat generation"):
        load_checkpoint(str(tmp_path / "clean"), generation="tomorrow")


def test_missing_window_pattern_and_lambdas_are_filled_as_nanochat_fills_them(tmp_path):
    model = random_model("lambdas-windows", window_pattern="L")
    with torch.no_grad():
        model.resid_lambdas.fill_(1.0)
        model.x0_lambdas.zero_()
    config = {k: v for k, v in vars(model.config).items() if k != "window_pattern"}
    save_raw(tmp_path / "d4", model.state_dict(), config)  # the lambdas say lambdas-windows; no window_pattern
    notes = []
    loaded, _ = load_checkpoint(str(tmp_path / "d4"), log=notes.append)
    assert loaded.config.window_pattern == "L" and len(notes) == 1 and "window_pattern" in notes[0]
    assert loaded.windows == [64] * 4
    assert load_checkpoint(str(tmp_path / "d4"), window_pattern="SSL", log=notes.append)[0].windows == [32, 32, 64, 64]
    without_lambdas = {k: v for k, v in model.state_dict().items() if not k.endswith("lambdas")}
    save_raw(tmp_path / "nolambdas", without_lambdas, dict(config, window_pattern="L"))
    notes.clear()
    loaded, _ = load_checkpoint(str(tmp_path / "nolambdas"), log=notes.append)
    assert len(notes) == 1 and "lambdas" in notes[0]
    ids = torch.tensor(random_tokens(80))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)


def nanochat_dir(tmp_path, generation):
    """A checkpoint of this generation in nanochat's layout (bf16 embeddings), with a byte-level tokenizer."""
    model = random_model(generation, scale=0.1)
    model.disk_dtypes = {k: torch.bfloat16 for k in model.state_dict() if k.startswith(EMBEDDINGS)}
    base = tmp_path / f"base-{generation}"
    save_checkpoint(str(base / "chatsft_checkpoints" / "d4"), 5, model)
    os.makedirs(base / "tokenizer")
    with open(base / "tokenizer" / "tokenizer.pkl", "wb") as f:
        pickle.dump(TOK.enc, f)
    return str(base / "chatsft_checkpoints" / "d4")


@pytest.mark.parametrize("generation", GENERATIONS)
def test_resume_is_exact_for_every_generation(generation, tmp_path, monkeypatch, run_killed_after_first_save):
    init = nanochat_dir(tmp_path, generation)
    # A random model never writes a sorted answer: a reward that differs between replies gives the update a signal.
    monkeypatch.setattr(Sort, "reward", lambda self, conversation, reply: sum(reply.encode()) % 7 / 6)
    flags = ["--demo", "--init", init, "--algo", "grpo", "--runs-dir", str(tmp_path), "--eval-every", "0",
             "--prompts-per-step", "4", "--num-samples", "2", "--num-steps", "2", "--save-every", "1", "--no-plot"]
    grpo.main(flags + ["--run-name", "straight"])
    run_killed_after_first_save(flags + ["--run-name", "resumed"])
    grpo.main(flags + ["--run-name", "resumed", "--resume"])
    files = {}
    for name in ("straight", "resumed"):
        out = os.path.join(tmp_path, name, "chatrl_checkpoints", "d4")
        files[name] = torch.load(os.path.join(out, "model_000002.pt"), weights_only=True)
        assert load_checkpoint(out)[0].generation_name == generation
    source = torch.load(os.path.join(init, "model_000005.pt"), weights_only=True)
    assert {k: v.dtype for k, v in files["straight"].items()} == {k: v.dtype for k, v in source.items()}
    assert all(not torch.equal(v, source[k]) for k, v in files["straight"].items() if v.dim() == 2), "a matrix did not train"
    for k, v in files["straight"].items():
        assert torch.equal(v, files["resumed"][k]), k


# ---------------------------------------------------------------------------- nanochat's own checkpoints and numbers

def fixture(name):
    folder = os.path.join(FIXTURES, name)
    if not os.path.isfile(os.path.join(folder, "reference.pt")):
        pytest.skip(f"nanochat fixture {name} not found under ../shared/fixtures/nanochat")
    return (os.path.join(folder, "base", "chatsft_checkpoints", "d4"), torch.load(os.path.join(folder, "reference.pt")),
            Tokenizer.from_file(os.path.join(folder, "base", "tokenizer", "tokenizer.pkl")))


def load_fixture(name, checkpoint_dir):
    # softcap20's files are value-embeds' files: only the override tells them apart
    notes = []
    model, meta = load_checkpoint(checkpoint_dir, generation="softcap20" if name == "softcap20" else None, log=notes.append)
    assert model.generation_name == name and bool(notes) == (name == "value-embeds")
    return model.eval(), meta


@pytest.mark.parametrize("name", GENERATIONS)
def test_fixture_matches_nanochat_logits_logprobs_and_greedy(name):
    checkpoint_dir, reference, tokenizer = fixture(name)
    model, _ = load_fixture(name, checkpoint_dir)
    with torch.no_grad():
        logits = model(torch.tensor([reference["prompt_logits"]]))[0]
        ids = torch.tensor([reference["prompt_logprob"] + reference["continuation"]])
        logprobs = model.token_logprobs(ids[:, :-1], ids[:, 1:])[0, len(reference["prompt_logprob"]) - 1:]
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-4)
    torch.testing.assert_close(logprobs, reference["logprobs"], rtol=0, atol=1e-4)
    for decode in ("dynamic", "static"):  # static: the shapes a CUDA graph replays, here run eagerly
        greedy = generate(model, tokenizer, [reference["prompt_greedy"]], 1, 40, temperature=0, decode=decode)
        assert greedy["tokens"][0].tolist() == reference["greedy_nocache"]
    # prompts of different lengths in one batch give what each gives alone
    prompts = [reference["prompt_greedy"], reference["prompt_logits"][:170], reference["prompt_logprob"]]
    batched = generate(model, tokenizer, prompts, 2, 20, temperature=0)
    for i, prompt in enumerate(prompts):
        single = generate(model, tokenizer, [prompt], 1, 20, temperature=0)["tokens"][0]
        assert batched["tokens"][2 * i].tolist() == batched["tokens"][2 * i + 1].tolist() == single.tolist()
    assert batched["tokens"][0].tolist() == reference["greedy_nocache"][:20]


@pytest.mark.parametrize("name", GENERATIONS)
def test_fixture_saves_back_in_its_own_format_and_trains(name, tmp_path):
    checkpoint_dir, _, _ = fixture(name)
    model, meta = load_fixture(name, checkpoint_dir)
    save_checkpoint(str(tmp_path / "d4"), 650, model, {k: v for k, v in meta.items() if k != "model_config"})
    original = torch.load(os.path.join(checkpoint_dir, "model_000650.pt"), weights_only=True)
    saved = torch.load(tmp_path / "d4" / "model_000650.pt", weights_only=True)
    assert list(saved) == list(original)
    for k, v in original.items():
        assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k
    saved_meta = json.load(open(tmp_path / "d4" / "meta_000650.json"))
    assert saved_meta["model_config"] == meta["model_config"]
    assert load_checkpoint(str(tmp_path / "d4"))[0].generation_name == name
    for optimizer in ("muon", "adamw"):
        model, _ = load_fixture(name, checkpoint_dir)
        _, moved, names = one_step_of_training(model, optimizer)
        assert moved == names, set(names) - set(moved)


def test_engram_fixture_is_refused_by_name():
    checkpoint_dir, _, _ = fixture("engram")
    with pytest.raises(ValueError, match="engram"):
        load_checkpoint(checkpoint_dir)


def packed_and_unpacked(model, rows, weights, device="cpu"):
    """Log-probs [R, width] and the gradient of sum(weights x log-probs) of these token rows, each right-padded in a
    batch, and packed into one sequence (with padding at its tail and in the pack's shapes, as a static pass has)."""
    from model import pack_rows
    widths = [len(row) - 1 for row in rows]
    width = max(widths)
    mask = torch.arange(width)[None] < torch.tensor(widths)[:, None]
    ids, targets = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :widths[r]], targets[r, :widths[r]] = torch.tensor(row[:-1]), torch.tensor(row[1:])
    pack, row_positions = pack_rows(widths, sum(widths) + 5, len(rows) + 2, width + 3)
    row_positions = row_positions[:, :width]
    packed_ids, packed_targets = torch.zeros(1, sum(widths) + 5, dtype=torch.long), torch.zeros(1, sum(widths) + 5,
                                                                                                dtype=torch.long)
    packed_ids[0, row_positions[mask]], packed_targets[0, row_positions[mask]] = ids[mask], targets[mask]
    pack = {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack.items()}
    ids, targets, packed_ids, packed_targets, row_positions, mask = (t.to(device) for t in (
        ids, targets, packed_ids, packed_targets, row_positions, mask))
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for logprobs in (lambda: model.token_logprobs(ids, targets),
                     lambda: model.token_logprobs(packed_ids, packed_targets, pack=pack).flatten()[row_positions]):
        out = logprobs() * mask
        results.append((out.detach(), torch.autograd.grad((out * weights).sum(), params)))
    return results


@pytest.mark.parametrize("name", GENERATIONS)
def test_packed_rows_give_the_unpacked_log_probs_and_gradients(name):
    # nanochat's own checkpoints: GQA (4 heads, 2 KV heads); rows longer than the short window (128 of 256) where a
    # generation has one, so it acts; smear and backout in the newest
    checkpoint_dir, _, _ = fixture(name)
    model, _ = load_fixture(name, checkpoint_dir)
    rows = random_tokens(201, 8, 151, 133, 41, seed=3)
    weights = torch.randn(len(rows), 200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = copy.deepcopy(model).double()
    (unpacked, unpacked_grads), (packed, packed_grads) = packed_and_unpacked(exact, rows, weights)
    assert (packed - unpacked).abs().max() <= 1e-10
    for a, b in zip(unpacked_grads, packed_grads):
        assert (a - b).abs().max() <= 1e-10 * max(1.0, a.abs().max().item())
    # float32: packed is as far from the float64 numbers as the unpacked path itself is
    (unpacked32, unpacked32_grads), (packed32, packed32_grads) = packed_and_unpacked(model, rows, weights.float())
    own = (unpacked32.double() - unpacked).abs().max()
    assert 0 < own < 1e-4 and (packed32.double() - unpacked).abs().max() <= 2 * own
    def error(grads):  # the float32 gradient's distance from the float64 one, over all weights
        return sum(((g.double() - exact_grad) ** 2).sum() for g, exact_grad in zip(grads, unpacked_grads)).sqrt()
    assert 0 < error(unpacked32_grads) and error(packed32_grads) <= 1.5 * error(unpacked32_grads)  # ratio ~1.0


@pytest.mark.cuda
@pytest.mark.parametrize("generation", ["classic", "lambdas-windows", "smear-backout"])
def test_on_cuda_flash_attention_over_packed_rows_gives_the_padded_rows_numbers(generation):
    # Under bf16 autocast packed rows go through varlen_attn: within bf16 rounding of the padded rows' SDPA, for
    # log-probs and gradients, with the windows acting (rows of up to 200 tokens, sequence_len 64)
    model = random_model(generation, sequence_len=64).cuda()
    rows = random_tokens(201, 9, 151, 133, 41, seed=3)
    weights = torch.randn(len(rows), 200, generator=torch.Generator().manual_seed(0)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (padded, padded_grads), (packed, packed_grads) = packed_and_unpacked(model, rows, weights, device="cuda")
    exact = copy.deepcopy(model).double()
    (reference, reference_grads), _ = packed_and_unpacked(exact, rows, weights.double(), device="cuda")
    own = (padded.double() - reference).abs().max()
    assert 0 < own and (packed.double() - reference).abs().max() <= 2 * own

    def error(grads):
        return sum(((g.double() - r) ** 2).sum() for g, r in zip(grads, reference_grads)).sqrt()
    assert error(packed_grads) <= 2 * error(padded_grads)


@pytest.mark.parametrize("generation", ["classic", "smear-backout"])
def test_grouped_query_attention_takes_torch_2_11s_flash_kernel_too(generation, monkeypatch):
    # torch 2.11's varlen_attn has no enable_gqa: key and value go in with as many heads as the query, and give the
    # numbers torch 2.12's grouped call does (both kernels the strict stand-in, the flash branch forced on the CPU)
    from kernels import strict_varlen_attn, strict_varlen_attn_without_gqa
    model = random_model(generation)
    assert model.config.n_kv_head < model.config.n_head
    rows = random_tokens(41, 9, 30, seed=3)
    weights = torch.randn(len(rows), 40, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(model_module, "flash_varlen", lambda q: q.dtype in (torch.bfloat16, torch.float16))
    results = {}
    for grouped, kernel in ((True, strict_varlen_attn), (False, strict_varlen_attn_without_gqa)):
        calls = []
        monkeypatch.setattr(model_module, "VARLEN_GQA", grouped)
        monkeypatch.setattr(model_module, "varlen_attn", lambda *a, k=kernel, **kw: calls.append(1) or k(*a, **kw))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[grouped] = packed_and_unpacked(model, rows, weights)[1]
        assert len(calls) == model.config.n_layer
    (packed, grads), (packed_without, grads_without) = results[True], results[False]
    assert torch.equal(packed, packed_without)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_without))


def trainer_batch(prompt_lengths, G, max_new_tokens, budget, static, seed=0):
    """A batch as the trainer plans it (make_batch: minibatches, passes packed first-fit into --tokens-per-pass, with
    static: one shape for every pass), of random prompts and replies -> (batch, args)."""
    args = grpo.resolve_config(["--demo", "--num-samples", str(G), "--prompts-per-step", str(len(prompt_lengths)),
                                "--max-new-tokens", str(max_new_tokens), "--tokens-per-pass", str(budget)])
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in prompt_lengths]
    N = len(prompts) * G
    lengths = torch.randint(5, max_new_tokens + 1, (N,), generator=gen)
    samples = dict(tokens=torch.randint(0, 256, (N, max_new_tokens), generator=gen), mask=torch.ones(N, max_new_tokens),
                   logprobs=torch.zeros(N, max_new_tokens), lengths=lengths, truncated=lengths == max_new_tokens)
    shape = (N, max(prompt_lengths) + max_new_tokens - 1) if static else None
    rewards = torch.randint(0, 2, (len(prompts), G), generator=gen).float()
    return grpo.make_batch(prompts, samples, rewards, args, shape), args


def packed_passes_through(model, batch, args, weights, autocast):
    """Each planned pass's log-probs in its rows' layout, and the gradient of sum(weights x log-probs) over them."""
    with autocast:
        logprobs = [grpo.logprobs_of(model, mb, args) * mb["loss_mask"] for mb in batch["micro_batches"]]
    params = [p for p in model.parameters() if p.requires_grad]
    objective = sum((lp.double() * weights[mb["rows"], :lp.size(1)]).sum() for lp, mb in zip(
        logprobs, batch["micro_batches"]))
    return [lp.detach().double() for lp in logprobs], torch.autograd.grad(objective, params)


@pytest.mark.parametrize("name, static", [(name, True) for name in GENERATIONS] + [
    ("smear-backout+lora", True), ("smear-backout", False)])
def test_the_trainers_packed_passes_keep_flash_attentions_contract(name, static, monkeypatch):
    # The CUDA branch of packed attention (varlen_attn) on the CPU, through a stand-in that refuses what the kernel
    # assumes away (tests/kernels.py): a span longer than max_q is one whose tail the kernel never computes. Every
    # pass the trainer plans for rows longer than the short window (128) must keep the contract, and give the
    # numbers of packed attention's exact fallback, both in bf16 against the float64 fallback.
    from kernels import strict_varlen_attn
    checkpoint_dir, _, _ = fixture(name.split("+")[0])
    model, _ = load_fixture(name.split("+")[0], checkpoint_dir)
    exact_model = copy.deepcopy(model).double()
    if name.endswith("+lora"):  # (each its own: an adapter's hook holds its own model's weights)
        for m in (model, exact_model):
            m.add_lora(4, 8.0, seed=0)
        exact_model.double()
    batch, args = trainer_batch([20, 30], 3, 150, 384, static)
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    exact, exact_grads = packed_passes_through(exact_model, batch, args, weights, nullcontext())
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    fallback, fallback_grads = packed_passes_through(model, batch, args, weights, bf16)
    calls = []
    monkeypatch.setattr(model_module, "flash_varlen", lambda q: q.dtype in (torch.bfloat16, torch.float16))
    monkeypatch.setattr(model_module, "varlen_attn", lambda *a, **k: calls.append(1) or strict_varlen_attn(*a, **k))
    flash, flash_grads = packed_passes_through(model, batch, args, weights, bf16)
    assert len(calls) == model.config.n_layer * len(batch["micro_batches"])  # every layer of every pass took it
    def error(values, reference):
        return max((v - r).abs().max().item() for v, r in zip(values, reference))
    def grad_error(grads):
        return sum(((g.double() - e) ** 2).sum() for g, e in zip(grads, exact_grads)).sqrt().item()
    assert 0 < error(fallback, exact) and error(flash, exact) <= 2 * error(fallback, exact)
    assert 0 < grad_error(fallback_grads) and grad_error(flash_grads) <= 2 * grad_error(fallback_grads)


def test_the_compiled_passes_on_a_gpu_are_one_graph_each(monkeypatch):
    # --compile (the CUDA default) compiles GPT.hidden and the head. A graph break (a Python branch on a tensor's
    # value, a call dynamo cannot trace) cuts a pass into pieces compiled apart: more launches, no fusion across the
    # cut. The GPU branch traced on the meta device: torch's own varlen_attn (a custom op with a fake kernel), the
    # newest generation (every feature, windows), a static packed pass as the trainer plans it.
    import inspect
    import torch._dynamo
    varlen_attn = pytest.importorskip("torch.nn.attention.varlen").varlen_attn
    keywords = inspect.signature(varlen_attn).parameters
    if "window_size" not in keywords:
        pytest.skip("this torch's varlen_attn takes no window: model.py does not call it")
    monkeypatch.setattr(model_module, "flash_varlen", lambda q: q.dtype in (torch.bfloat16, torch.float16))
    monkeypatch.setattr(model_module, "varlen_attn", varlen_attn)
    monkeypatch.setattr(model_module, "VARLEN_GQA", "enable_gqa" in keywords)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: False)  # the meta device has no autocast
    batch, args = trainer_batch([20, 30], 3, 150, 384, static=True)
    model = random_model("smear-backout", sequence_len=256).bfloat16().to("meta")
    first = batch["micro_batches"][0]
    pack = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in first["pack"].items()}
    states = torch.empty(300, model.config.n_embd, dtype=torch.bfloat16, device="meta")  # a chunk of positions
    try:
        explained = [torch._dynamo.explain(GPT.hidden)(model, first["input_ids"].to("meta"), pack=pack),
                     torch._dynamo.explain(GPT.head_logprobs)(model, states, states[:, 0].long(), 1.0, True)]
    finally:
        torch._dynamo.reset()
    assert pack["max_len"] > 128 and model.windows[0] == 128  # rows past the short window: its mask in the graph
    for graphs in explained:
        assert graphs.graph_count == 1 and graphs.graph_break_count == 0, [r.reason for r in graphs.break_reasons]


def test_a_compiled_decode_step_on_a_gpu_is_one_graph_through_torchs_own_kernel(monkeypatch):
    # The captured decode step of a GPU run (static cache, flash attention over each row's written columns) traced
    # on the meta device through torch's own varlen_attn: its fake kernel takes the call's arguments (seqused_k
    # without a graph for gradients, GQA, windows), and the step is one graph, every layer through cached_attention.
    import inspect
    import torch._dynamo
    varlen_attn = pytest.importorskip("torch.nn.attention.varlen").varlen_attn
    keywords = inspect.signature(varlen_attn).parameters
    if "seqused_k" not in keywords or "enable_gqa" not in keywords:
        pytest.skip("this torch's varlen_attn takes no seqused_k or no enable_gqa: the decode keeps the masked path")
    calls, cached = [], model_module.cached_attention
    monkeypatch.setattr(model_module, "cached_attention", lambda *a: calls.append(1) or cached(*a))
    monkeypatch.setattr(model_module, "flash_varlen", lambda q: q.dtype in (torch.bfloat16, torch.float16))
    monkeypatch.setattr(model_module, "varlen_attn", varlen_attn)
    monkeypatch.setattr(model_module, "VARLEN_GQA", True)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: False)  # the meta device has no autocast
    model = random_model("smear-backout", n_layer=2, sequence_len=256).bfloat16().to("meta")
    c, rows, columns = model.config, 6, 300
    cache = KVCache(c.n_layer, torch.zeros(rows, dtype=torch.long, device="meta"), columns)
    cache.k, cache.v = ([torch.empty(rows, columns, c.n_kv_head, c.n_embd // c.n_head, dtype=torch.bfloat16,
                                     device="meta") for _ in range(c.n_layer)] for _ in range(2))
    cache.previous = torch.empty(rows, c.n_embd, dtype=torch.bfloat16, device="meta")
    cache.pos, cache.static, cache.flash = torch.full((rows,), 200, device="meta"), True, True  # past the short window
    token, noise = torch.zeros(rows, dtype=torch.long, device="meta"), torch.rand(rows, device="meta")
    try:
        with torch.no_grad():  # as generate runs it
            graphs = torch._dynamo.explain(model_module.decode_step)(model, cache, 1.0, 50, token, noise)
    finally:
        torch._dynamo.reset()
    assert graphs.graph_count == 1 and graphs.graph_break_count == 0, [r.reason for r in graphs.break_reasons]
    assert len(calls) == c.n_layer and c.n_kv_head < c.n_head


def test_the_compiled_packed_pass_on_a_cpu_is_one_graph():
    # The CPU branch of packed attention (no flash kernel: a CPU build, or a float32 run) as --compile traces it:
    # which branch runs is decided from the queries' device, dtype and the torch build, a question that must not
    # cut the graph at every layer.
    import torch._dynamo
    batch, args = trainer_batch([20, 30], 3, 40, 384, static=True)
    model = random_model("smear-backout", n_layer=2, sequence_len=256)
    first = batch["micro_batches"][0]
    try:
        graphs = torch._dynamo.explain(GPT.hidden)(model, first["input_ids"], pack=first["pack"])
    finally:
        torch._dynamo.reset()
    assert graphs.graph_count == 1 and graphs.graph_break_count == 0, [r.reason for r in graphs.break_reasons]
