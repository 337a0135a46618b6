import json
import os

import pytest
import torch
import torch.nn.functional as F

import model as model_module
from model import (GENERATIONS, GPT, GPTConfig, KVCache, Tokenizer, find_checkpoint, generate, load_checkpoint,
                   load_tensors, save_checkpoint)
from tasks.gsm8k import calculator

TOK = Tokenizer.byte_level()


def tiny_model(n_head=4, n_kv_head=2, n_embd=64, n_layer=2, vocab_size=TOK.vocab_size, seed=0, scale=0.3):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(sequence_len=128, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                          n_kv_head=n_kv_head, n_embd=n_embd))
    for p in model.parameters():  # large random weights: peaked, input-dependent outputs
        p.data.normal_(0, scale)
    return model.eval()


def prompts_of(*texts):
    return [TOK.render_for_completion({"messages": [{"role": "user", "content": t}]}) for t in texts]


def test_cached_decoding_matches_full_forward():
    model = tiny_model()
    prompts = prompts_of("a", "what is 2+2?", "hello")
    continuation = torch.randint(0, 256, (3, 6))
    cache = KVCache(model.config.n_layer, torch.tensor([max(map(len, prompts)) - len(p) for p in prompts]), 64)
    longest = max(map(len, prompts))
    padded = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    steps = [model(padded, cache)[:, -1]] + [model(continuation[:, i:i + 1], cache)[:, -1] for i in range(6)]
    for b, p in enumerate(prompts):
        full = model(torch.cat([torch.tensor(p), continuation[b]])[None])[0, len(p) - 1:]
        torch.testing.assert_close(torch.stack([s[b] for s in steps]), full, rtol=0, atol=1e-5)


def naive_greedy(model, prompt, max_new_tokens):
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
        if ids[-1] in (TOK.assistant_end, TOK.bos):
            break
    return ids[len(prompt):]


def test_batched_greedy_equals_one_at_a_time_and_naive_loop():
    model = tiny_model()
    prompts = prompts_of("x", "sort 31415", "a much longer prompt than the others")
    batched = generate(model, TOK, prompts, num_samples=2, max_new_tokens=12, temperature=0)
    for i, p in enumerate(prompts):
        single = generate(model, TOK, [p], num_samples=1, max_new_tokens=12, temperature=0)
        reference = naive_greedy(model, p, 12)
        assert len(set(reference)) > 1  # the test is only meaningful if outputs are not degenerate
        for row in (2 * i, 2 * i + 1):
            n = batched["lengths"][row].item()
            assert batched["tokens"][row, :n].tolist() == reference
        assert single["tokens"][0, :single["lengths"][0]].tolist() == reference


def test_grouped_query_attention_equals_repeated_heads():
    gqa = tiny_model(n_head=4, n_kv_head=1)
    mha = GPT(GPTConfig(**dict(vars(gqa.config), n_kv_head=4)))
    state = gqa.state_dict()
    hd = 64 // 4
    for k in list(state):
        if k.endswith(("c_k.weight", "c_v.weight")):
            state[k] = state[k].view(1, hd, 64).repeat(4, 1, 1).view(64, 64)
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=0, atol=1e-5)


def test_token_logprobs_match_log_softmax_and_its_gradient():
    model = tiny_model(seed=1)
    idx, targets = torch.randint(0, 256, (3, 10)), torch.randint(0, 256, (3, 10))
    lp = model.token_logprobs(idx, targets, temperature=0.7, chunk_size=7)  # chunks that cut across rows
    ref = F.log_softmax(model(idx) / 0.7, dim=-1).gather(2, targets[..., None]).squeeze(2)
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
    g1 = torch.autograd.grad(lp.sum(), model.lm_head.weight)[0]
    g2 = torch.autograd.grad(ref.sum(), model.lm_head.weight)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


def test_token_logprobs_at_positions_computes_only_those_with_the_same_numbers_and_gradients():
    # The trainer passes the loss mask: what it gets at the masked positions, and their gradients, must be what the
    # whole [B, T] computation gives there; the other positions are 0 and send no gradient.
    model = tiny_model(seed=2)
    idx, targets = torch.randint(0, 256, (3, 10)), torch.randint(0, 256, (3, 10))
    where = torch.rand(3, 10) > 0.5
    where[1] = False  # a row with nothing asked for
    full = model.token_logprobs(idx, targets, temperature=0.7, with_entropy=True, chunk_size=4)
    some = model.token_logprobs(idx, targets, temperature=0.7, with_entropy=True,
                                positions=where.flatten().nonzero().squeeze(1), chunk_size=4)
    weights = torch.randn(3, 10)
    grads = []
    for logprobs, entropy in (full, some):
        loss = ((logprobs + 0.3 * entropy) * weights * where).sum()
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for a, b in zip(full, some):  # log-probs, entropies
        assert torch.equal(b[~where], torch.zeros((~where).sum()))
        torch.testing.assert_close(a[where], b[where], rtol=0, atol=1e-6)
    for a, b in zip(*grads):  # float32 sums over different numbers of rows: equal up to rounding, ~1e-7 of the norm
        assert (a - b).norm() <= 1e-5 * a.norm(), ((a - b).norm(), a.norm())
    # Nothing asked for at all (e.g. a micro-batch of dropped groups): zeros, and a backward that still runs.
    none = model.token_logprobs(idx, targets, positions=torch.zeros(0, dtype=torch.long))
    assert torch.equal(none, torch.zeros(3, 10))
    none.sum().backward()


# ---------------------------------------------------------------------------- checkpoints

def test_save_load_round_trip_is_exact(tmp_path):
    model = tiny_model()
    save_checkpoint(str(tmp_path / "d2"), 7, model, {"note": "x"})
    loaded, meta = load_checkpoint(str(tmp_path / "d2"))
    assert meta["step"] == 7 and meta["note"] == "x" and meta["model_config"]["n_kv_head"] == 2
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    assert not [f for f in os.listdir(tmp_path / "d2") if f.startswith(".tmp")]


def test_compiled_bf16_padded_checkpoint_loads_like_the_clean_one(tmp_path):
    clean = GPT(GPTConfig(sequence_len=64, vocab_size=300, n_layer=2, n_head=2, n_kv_head=1, n_embd=32),
                padded_vocab_size=300)
    for p in clean.parameters():
        p.data = p.data.normal_(0, 0.3).bfloat16().float()  # values a bf16 file holds exactly
    state = {}
    for k, v in clean.state_dict().items():
        if k in ("transformer.wte.weight", "lm_head.weight"):  # pad 300 rows to 320 with junk
            v = torch.cat([v, torch.randn(20, v.size(1))])
        state["_orig_mod." + k] = v.bfloat16()
    os.makedirs(tmp_path / "d2")
    torch.save(state, tmp_path / "d2" / "model_000005.pt")
    (tmp_path / "d2" / "meta_000005.json").write_text(json.dumps({"model_config": vars(clean.config)}))
    loaded, _ = load_checkpoint(str(tmp_path / "d2"))
    idx = torch.randint(0, 300, (2, 8))
    torch.testing.assert_close(loaded(idx), clean(idx), rtol=0, atol=0)
    assert loaded(idx).shape[-1] == 300


def test_missing_checkpoint_errors_name_where_they_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "chatsft_checkpoints")):
        find_checkpoint(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_checkpoint(str(tmp_path))


def test_find_checkpoint_defaults_to_the_deepest_tag(tmp_path):
    for tag in ("d4", "d12", "d8"):
        os.makedirs(tmp_path / "chatsft_checkpoints" / tag)
    assert find_checkpoint(str(tmp_path)) == str(tmp_path / "chatsft_checkpoints" / "d12")


# ---------------------------------------------------------------------------- tokenizer

def test_tokenizer_renders_the_chat_format_and_pickles(tmp_path):
    conversation = {"messages": [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": [{"type": "python", "text": "2+3"}, {"type": "python_output", "text": "5"},
                                          {"type": "text", "text": "#### 5"}]}]}
    ids, mask = TOK.render_conversation(conversation)
    t = TOK
    expected = [t.bos, t.user_start, *b"2+3?", t.user_end, t.assistant_start, t.python_start, *b"2+3",
                t.python_end, t.output_start, *b"5", t.output_end, *b"#### 5", t.assistant_end]
    assert ids == expected
    assert mask == [0] * 8 + [1] * 5 + [0] * 3 + [1] * 7
    assert TOK.render_for_completion(conversation) == expected[:8]
    import pickle
    (tmp_path / "tokenizer.pkl").write_bytes(pickle.dumps(TOK.enc))
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.pkl")).render_conversation(conversation) == (ids, mask)
    assert TOK.encode("<|bos|>") == list(b"<|bos|>")  # special tokens in text stay text


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_tokenizer_pkl_is_read_without_running_anything_it_names(tmp_path):
    import pickle
    marker = str(tmp_path / "ran")
    good = pickle.dumps(TOK.enc)
    cases = {
        "hostile.pkl": pickle.dumps(RunsCode(marker)),
        "other_object.pkl": pickle.dumps({"name": "x"}),
        "truncated.pkl": good[:len(good) // 2],
        "empty.pkl": b"",
        "not_a_pickle.pkl": b"tokenizer",
        # an Encoding pickled by name: tiktoken would fetch that encoding (a download); a data file may not ask for it
        "by_name.pkl": b"ctiktoken.core\nEncoding\n)\x81Vcl100k_base\nb.",
        "bad_vocab.pkl": good.replace(b"mergeable_ranks", b"mergeable_ranKs"),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=name):
            Tokenizer.from_file(str(tmp_path / name))
    assert not os.path.exists(marker)
    (tmp_path / "good.pkl").write_bytes(good)
    assert Tokenizer.from_file(str(tmp_path / "good.pkl")).encode("2+3=5") == TOK.encode("2+3=5")


# ---------------------------------------------------------------------------- sampler

class ScriptedModel(torch.nn.Module):
    """Stands in for the GPT: the next token is a fixed function of the last input token."""

    def __init__(self, transitions, vocab_size=TOK.vocab_size):
        super().__init__()
        self.config = GPTConfig(n_layer=1, vocab_size=vocab_size)
        self.generation = GENERATIONS["classic"]
        self.lm_head = torch.nn.Linear(1, 1)
        self.use_compile = False
        self.table = torch.arange(vocab_size)  # by default a token repeats itself
        for a, b in transitions.items():
            self.table[a] = b

    def hidden(self, idx, cache, counts=None):  # the "hidden state" is already the logits: the head is the identity
        if cache.k is None:  # a cache for generate to select rows of; nothing reads it
            cache.k = cache.v = [torch.zeros(idx.size(0), 1, 1, 1)]
        return F.one_hot(self.table[idx], self.config.vocab_size).float() * 100

    def logits(self, x, softcap=True):
        return x

    def forward(self, idx, cache, softcap=True):
        return self.logits(self.hidden(idx, cache))


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_calculator_forces_masked_output_and_stop_token_is_kept(decode):
    t = TOK
    chain = [t.assistant_start, t.python_start, ord("2"), ord("*"), ord("("), ord("3"), ord(")"), t.python_end]
    transitions = dict(zip(chain, chain[1:]))
    transitions[t.output_end] = ord("a")
    transitions[ord("a")] = t.assistant_end
    transitions[ord("z")] = ord("z")  # the second prompt never stops
    model = ScriptedModel(transitions)
    out = generate(model, t, [[t.bos, t.assistant_start], [t.bos, ord("q"), ord("z")]], num_samples=2,
                   max_new_tokens=14, temperature=1.0, top_k=5, tool=calculator, decode=decode)
    expected = chain[1:] + [t.output_start, ord("6"), t.output_end, ord("a"), t.assistant_end]
    for row in (0, 1):
        n = out["lengths"][row].item()
        assert out["tokens"][row, :n].tolist() == expected
        assert out["mask"][row].tolist() == [1] * 7 + [0] * 3 + [1, 1] + [0] * 2
        assert not out["truncated"][row]
    for row in (2, 3):
        assert out["tokens"][row].tolist() == [ord("z")] * 14 and out["truncated"][row]
        assert out["lengths"][row] == 14 and out["mask"][row].all()


def test_invalid_calculator_expression_forces_nothing():
    t = TOK
    chain = [t.assistant_start, t.python_start, ord("1"), ord("/"), ord("0"), t.python_end, t.assistant_end]
    out = generate(ScriptedModel(dict(zip(chain, chain[1:]))), t, [[t.assistant_start]], max_new_tokens=10, tool=calculator)
    assert out["tokens"][0, :out["lengths"][0]].tolist() == chain[1:] and out["mask"][0].sum() == 6


def test_group_samples_draw_their_own_first_token():
    model = tiny_model(vocab_size=4096, scale=0.02)  # a nearly flat distribution over 4,096 tokens
    out = generate(model, TOK, prompts_of("hi", "there"), num_samples=8, max_new_tokens=3, temperature=1.0)
    for group in out["tokens"][:, 0].view(2, 8):
        assert len(set(group.tolist())) > 4


def test_seed_makes_sampling_reproducible():
    model = tiny_model(scale=0.1)
    a = generate(model, TOK, prompts_of("hi", "yo!"), num_samples=4, max_new_tokens=8, seed=3)
    b = generate(model, TOK, prompts_of("hi", "yo!"), num_samples=4, max_new_tokens=8, seed=3)
    c = generate(model, TOK, prompts_of("hi", "yo!"), num_samples=4, max_new_tokens=8, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tokens"], c["tokens"])


def test_top_k_restricts_the_support():
    model = tiny_model(vocab_size=4096, scale=0.05)
    prompt = prompts_of("hi")
    logits = model(torch.tensor(prompt))[0, -1]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    out = generate(model, TOK, prompt, num_samples=64, max_new_tokens=1, temperature=1.0, top_k=3)
    assert set(out["tokens"][:, 0].tolist()) <= top3


@pytest.mark.parametrize("with_entropy", [False, True])
def test_head_recomputed_in_the_backward_or_kept_gives_the_same_gradients(with_entropy, monkeypatch):
    # Large logits are recomputed in the backward (checkpoint), small ones kept: the numbers must not depend on it.
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=32))
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    idx, targets = torch.randint(0, 300, (3, 20)), torch.randint(0, 300, (3, 20))
    results = []
    for threshold in (0, 2 ** 40):  # every chunk recomputed; none
        monkeypatch.setattr(model_module, "CHECKPOINT_LOGITS", threshold)
        model.zero_grad()
        out = model.token_logprobs(idx, targets, with_entropy=with_entropy, chunk_size=16)
        logprobs, entropy = out if with_entropy else (out, torch.zeros(()))
        (logprobs.square().mean() + entropy.mean()).backward()
        results.append([logprobs.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_entropies_only_logged_are_off_the_graph_and_leave_the_gradient_as_it_was():
    # The update logs the entropies at every step; without the entropy bonus they carry no gradient, so the head
    # keeps nothing for them (8 of its ~24 bytes a logit): the same entropies, the same log-prob gradient
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=32))
    idx, targets = torch.randint(0, 300, (3, 20)), torch.randint(0, 300, (3, 20))
    results = []
    for entropy_grad in (True, False):
        model.zero_grad()
        logprobs, entropy = model.token_logprobs(idx, targets, 0.7, with_entropy=True, chunk_size=16,
                                                 entropy_grad=entropy_grad)
        assert entropy.requires_grad == entropy_grad
        logprobs.square().mean().backward()
        results.append([logprobs.detach(), entropy.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_heads_chunks_hold_at_most_HEAD_CHUNK_logits_as_the_memory_plan_counts(monkeypatch):
    # A chunk's backward holds ~24 bytes a logit: chunks of HEAD_CHUNK // V positions by default (16,384 positions
    # at V = 65,536 held 16 GiB on a GPU), the same numbers as one chunk, and the plan counts one such chunk
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=300, n_layer=1, n_head=2, n_kv_head=2, n_embd=32))
    idx, targets = torch.randint(0, 300, (3, 20)), torch.randint(0, 300, (3, 20))
    whole = model.token_logprobs(idx, targets, chunk_size=60)
    monkeypatch.setattr(model_module, "HEAD_CHUNK", 7 * model.lm_head.out_features)
    chunks, logits = [], model.logits
    monkeypatch.setattr(model, "logits", lambda x: chunks.append(x.size(0)) or logits(x))
    torch.testing.assert_close(model.token_logprobs(idx, targets), whole, rtol=0, atol=1e-6)
    assert chunks == [7] * 8 + [4]
    import grpo
    monkeypatch.setattr(grpo, "HEAD_CHUNK", 7 * model.config.vocab_size)
    for compiled, per_unit in ((False, 76), (True, 48)):  # past one chunk the head adds nothing
        for entropy_coef in (0.0, 0.01):
            flags = grpo.SimpleNamespace(compile=compiled, entropy_coef=entropy_coef, distill_coef=0.0)
            assert grpo.pass_activations(model.config, 100, flags) - grpo.pass_activations(
                model.config, 50, flags) == 50 * model.config.n_layer * per_unit * model.config.n_embd
    # the head's chunk: 8 bytes a logit more when the entropies carry a gradient (their exp and product kept)
    with_graph, logged = (grpo.pass_activations(model.config, 50, grpo.SimpleNamespace(
        compile=False, entropy_coef=coef, distill_coef=0.0)) for coef in (0.01, 0.0))
    assert with_graph - logged == 7 * model.config.vocab_size * 8


def test_a_mapped_load_reads_torchs_legacy_format_and_names_a_damaged_file(tmp_path):
    # shapes-only loads and resumes map the file; a file in torch's pre-zip format cannot be mapped, and is read
    torch.save({"w": torch.arange(3.0)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert torch.equal(load_tensors(str(tmp_path / "legacy.pt"), mmap=True)["w"], torch.arange(3.0))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt is damaged or not a checkpoint file"):
        load_tensors(str(tmp_path / "bad.pt"), mmap=True)


def test_the_sampler_never_draws_a_token_of_probability_zero():
    from model import sample_tokens
    # tokens 0, 1 and 4 underflow to probability 0 at this temperature; draws at both ends of [0, 1)
    logits = torch.tensor([[-30.0, -30.0, 0.0, 0.5, -30.0]]).repeat(4, 1)
    uniform = torch.tensor([0.0, 1 - 2 ** -24, 0.5, 2 ** -24])
    tokens, logprobs = sample_tokens(logits, 0.1, 0, uniform, 15.0)
    assert tokens.tolist() == [2, 3, 3, 2] and torch.isfinite(logprobs).all()
    tokens, logprobs = sample_tokens(logits, 0.1, 4, uniform, 15.0)  # top-k keeps a token of probability 0
    assert tokens.tolist() == [3, 2, 3, 3] and torch.isfinite(logprobs).all()  # the k in descending order
