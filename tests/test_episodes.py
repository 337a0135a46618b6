"""Episodes of several turns: a task that answers the assistant (tasks/__init__.py, respond), the sampler forcing
its turns (model.generate's respond), their masking, grading and errors."""
import copy
import json

import pytest
import torch

import grpo
import tasks
import model as model_module
from model import generate
from test_generations import TOK, random_model, random_tokens, replies_that_end_at_different_steps
from test_own_tasks import TASK_FILE, base_flags


def rendered_user_turn(message):
    return [TOK.user_start] + TOK.encode(message) + [TOK.user_end, TOK.assistant_start]


def answering(turns_per_row):
    """respond: row r is answered 'again r.k' after its turns 1 .. turns_per_row[r] - 1, then its episode ends.
    -> (respond, the calls it got: (row, tokens, mask))."""
    calls = []

    def respond(row, tokens, mask):
        calls.append((row, tokens, mask))
        done = tokens.count(TOK.assistant_end)  # sampled, or forced at max_turn_tokens
        return f"again {row}.{done}" if done < turns_per_row[row] else None
    return respond, calls


@pytest.mark.parametrize("options", [dict(temperature=1.0, top_k=50, seed=3, max_turn_tokens=6),
                                     dict(temperature=0)])
def test_every_decode_mode_forces_the_same_user_turns_and_samples_the_same_tokens(options):
    # Rows end turns at different steps (sampled, or forced after 6 sampled tokens) and are answered 0 to 2 times,
    # the batch halving (static, graph: on the CPU the graph's step runs uncaptured, rebuilt at every halving as on a
    # GPU) as rows end: the dynamic decode's tokens, masks and lengths; log-probs up to the attention's rounding
    prompts = random_tokens(5, 40, 77)
    model = replies_that_end_at_different_steps(random_model("smear-backout"), prompts)
    turns = [1, 2, 3, 1, 3, 2, 1, 2, 3, 3, 1, 2]
    results = {}
    for decode in ("dynamic", "static", "graph"):
        respond, calls = answering(turns)
        results[decode] = generate(model, TOK, prompts, 4, 60, decode=decode, respond=respond, **options)
        results[decode]["calls"] = calls
    dynamic = results["dynamic"]
    for decode in ("static", "graph"):
        for key in ("tokens", "mask", "lengths", "truncated"):
            assert torch.equal(dynamic[key], results[decode][key]), (decode, key)
        torch.testing.assert_close(dynamic["logprobs"], results[decode]["logprobs"], rtol=0, atol=1e-4)
        assert sorted(c[:1] + (tuple(c[1]),) for c in dynamic["calls"]) == \
            sorted(c[:1] + (tuple(c[1]),) for c in results[decode]["calls"])
    # what was forced is the chat format's user turn, mask 0 and log-prob 0, right after an end of turn
    answered = capped = 0
    for row in range(12):
        n = dynamic["lengths"][row].item()
        tokens, mask = dynamic["tokens"][row, :n].tolist(), dynamic["mask"][row, :n].tolist()
        ends = [i for i in range(n) if tokens[i] == TOK.assistant_end]
        cap = options.get("max_turn_tokens")
        for start, end in zip([-1] + ends, ends):  # a turn: its sampled tokens (a capped one's end is forced)
            sampled = sum(mask[start + 1:end + 1])
            assert mask[end] == 1 and (cap is None or sampled <= cap) or mask[end] == 0 and sampled == cap
        capped += sum(mask[i] == 0 for i in ends)
        for k, i in enumerate(ends[:turns[row] - 1]):
            forced = rendered_user_turn(f"again {row}.{k + 1}")
            got = dynamic["tokens"][row, i + 1:i + 1 + len(forced)].tolist()
            assert got == forced[:len(got)]
            assert not any(mask[i + 1:i + 1 + len(forced)])
            assert not dynamic["logprobs"][row, i + 1:i + 1 + len(forced)].any()
            answered += len(got) == len(forced)
        if not dynamic["truncated"][row]:  # it ended at the end of the turn that the environment did not answer
            assert tokens[-1] == TOK.assistant_end or tokens[-1] == TOK.bos and mask[-1] == 1
            assert len(ends) == turns[row] or tokens[-1] == TOK.bos
    assert answered >= 6  # most episodes got their answers in
    assert (capped > 0) == ("max_turn_tokens" in options)


FLOAT64 = {}  # a test's sampling by a float64 copy of its model, the same for every decode mode: once a worker


def float64_sampling(test, sample):
    if test not in FLOAT64:
        FLOAT64[test] = sample()
    return FLOAT64[test]


@pytest.mark.parametrize("decode", ["dynamic", "static", "graph"])
@pytest.mark.xdist_group("float64_sampling")
def test_a_forced_run_that_every_running_row_has_goes_through_the_model_in_one_forward(decode, monkeypatch):
    # Every row closes a python block at column 4 (the tool's answer forced) and ends turns at columns 12-14 and 72-73,
    # each answered by the environment in 52-53 tokens (the second answer cut at the budget's end), a third of the
    # rows ending their episodes after each turn (finished rows with spent queues in the batch; the static batch
    # halving): once every running row is forcing, what they all have queued goes through the model in forwards of
    # FORCED_RUN_CHUNK tokens at most, not a decode step each (on the CPU the graph's step runs uncaptured). The same
    # tokens, masks and lengths as a step per token; log-probs within float32's rounding: 3x the per-token path's
    # distance from a float64 copy's
    from bench_shared import placed_at
    prompts, turns = random_tokens(5, 9, 7), [1, 2, 3] * 4
    model = random_model("smear-backout")
    marks = torch.zeros(12, 96, dtype=torch.long)
    marks[:, 1], marks[:, 4] = 1, 2  # python_start, python_end
    for row in range(12):  # assistant_end
        marks[row, 12 + row % 3] = marks[row, 72 + row % 2] = 3
    answer = answering(turns)[0]

    def respond(row, tokens, mask):  # answering's message, 52-53 tokens rendered
        message = answer(row, tokens, mask)
        return message and message + " and again" * 4
    forwards, decode_step, per_column = [], model_module.decode_step, model_module.next_columns
    monkeypatch.setattr(model_module, "decode_step", lambda net, cache, temperature, top_k, token, noise, *counts: (
        forwards.append(token.numel() // token.size(0)) or decode_step(net, cache, temperature, top_k, token, noise,
                                                                       *counts)))

    def sampled(net, mode, one_forward_a_run):
        forwards.clear()
        with monkeypatch.context() as patched, placed_at(marks, (TOK.python_start, TOK.python_end, TOK.assistant_end),
                                                         TOK.vocab_size):
            if not one_forward_a_run:  # ahead 0: no run is known to be every row's
                patched.setattr(model_module, "next_columns", lambda *args: per_column(*args[:-1], 1))
            out = generate(net, TOK, prompts, 4, 96, top_k=50, seed=3, decode=mode, tool=lambda code: str(len(code)),
                           respond=respond)
        return out, list(forwards)
    (runs, run_widths), (steps, step_widths) = sampled(model, decode, True), sampled(model, decode, False)
    # fewer forwards: the tool's answer and the environment's in runs
    assert set(step_widths) == {1}
    assert max(run_widths) == model_module.FORCED_RUN_CHUNK + 1 and len(run_widths) <= len(step_widths) - 60
    for key in ("tokens", "mask", "lengths", "truncated"):
        assert torch.equal(runs[key], steps[key]), key
    assert (runs["lengths"] < 96).sum() == 8 and (runs["tokens"] == TOK.output_end).sum(1).min() == 1
    exact = float64_sampling("one forward", lambda: sampled(copy.deepcopy(model).double(), "dynamic", False)[0])
    same = (exact["tokens"] == steps["tokens"]).all(1) & (exact["lengths"] == steps["lengths"])
    assert same.sum() >= 6
    rounding = (exact["logprobs"] - steps["logprobs"])[same].abs().max()
    assert 0 < (exact["logprobs"] - runs["logprobs"])[same].abs().max() <= 3 * rounding


@pytest.mark.parametrize("decode", ["dynamic", "static", "graph"])
@pytest.mark.xdist_group("float64_sampling")
def test_rows_that_force_at_different_columns_take_their_runs_while_the_others_sample(decode, monkeypatch):
    # Two pairs of rows end their first turns 25 columns apart, each answered in 40 tokens; one row closes a python
    # block alone (6 tokens forced: too few to pay for a forward of its own width). A pair's answer goes through the
    # model in runs while the other pair samples a token each in the same forward (rows then go on from different
    # columns), not a decode step a token. The same tokens, masks and lengths as a step per token; log-probs within
    # float32's rounding (3x the per-token path's distance from a float64 copy's)
    from bench_shared import placed_at
    prompts, model = random_tokens(5, 9), random_model("smear-backout")
    marks = torch.zeros(4, 100, dtype=torch.long)
    marks[:, 3], marks[:, 28], marks[:, 70], marks[1, 50], marks[1, 53] = 3, 3, 3, 1, 2
    marks[:2, 28] = marks[2:, 3] = 0  # rows 0-1 end their first turn at column 3, rows 2-3 at 28
    respond = lambda row, tokens, mask: "x" * 38 if tokens.count(TOK.assistant_end) < 2 else None  # noqa: E731
    forwards, decode_step, per_column = [], model_module.decode_step, model_module.next_columns
    monkeypatch.setattr(model_module, "decode_step", lambda net, cache, temperature, top_k, token, noise, *counts: (
        forwards.append(token.size(1) if token.dim() > 1 else 1) or decode_step(net, cache, temperature, top_k,
                                                                                token, noise, *counts)))

    def sampled(net, mode, runs):
        forwards.clear()
        with monkeypatch.context() as patched, placed_at(marks, (TOK.python_start, TOK.python_end, TOK.assistant_end),
                                                         TOK.vocab_size):
            if not runs:
                patched.setattr(model_module, "next_columns", lambda *args: per_column(*args[:-1], 1))
            out = generate(net, TOK, prompts, 2, 100, top_k=50, seed=3, decode=mode, tool=lambda code: "12345",
                           respond=respond)
        return out, list(forwards)
    (runs, run_widths), (steps, step_widths) = sampled(model, decode, True), sampled(model, decode, False)
    for key in ("tokens", "mask", "lengths", "truncated"):
        assert torch.equal(runs[key], steps[key]), key
    answered = (steps["mask"] == 0) & (steps["tokens"] == TOK.encode("x" * 38)[0])
    assert (answered.sum(1) > 0).all() and ((steps["tokens"] == TOK.output_end) & (steps["mask"] == 0))[1].any()
    # each pair's 40 tokens in 2 forwards (of 33 and 9 columns) where a step each took 40: each row reaches its
    # last column 38 forwards sooner, the pairs' savings in the same forwards as the other pair's steps
    assert set(step_widths) == {1} and len(run_widths) <= len(step_widths) - 38 + 1, (run_widths, len(step_widths))
    assert sorted(run_widths)[-4:] == [9, 9, 33, 33]
    exact = float64_sampling("columns", lambda: sampled(copy.deepcopy(model).double(), "dynamic", False)[0])
    same = (exact["tokens"] == steps["tokens"]).all(1) & (exact["lengths"] == steps["lengths"])
    assert same.sum() >= 3
    rounding = (exact["logprobs"] - steps["logprobs"])[same].abs().max()
    assert 0 < (exact["logprobs"] - runs["logprobs"])[same].abs().max() <= 3 * rounding


def test_a_run_beside_a_sampling_row_computes_no_position_past_the_rotary_tables():
    # a budget past the model's rotary tables (dynamic decode: refused only where a reply reaches them): row 0's
    # answer goes in a run beside row 1's step, whose columns past its token are the cache's spare one (was: the
    # spare column's rotary position, past the tables, an IndexError)
    from bench_shared import placed_at
    model, marks = random_model("classic", n_layer=1, sequence_len=16), torch.zeros(2, 200, dtype=torch.long)
    marks[0, 2] = marks[0, 50] = marks[1, 60] = 3
    respond = lambda row, tokens, mask: "x" * 30 if row == 0 and tokens.count(TOK.assistant_end) < 2 else None  # noqa
    with placed_at(marks, (TOK.python_start, TOK.python_end, TOK.assistant_end), TOK.vocab_size):
        out = generate(model, TOK, [[1, 2, 3, 4, 5]], 2, 200, seed=0, respond=respond, decode="dynamic")
    assert out["lengths"].tolist() == [51, 61] and out["tokens"].is_contiguous()
    # both rows answered 4 times, 4 columns apart: each takes its runs beside the other's steps, the columns the
    # cache reads those written (was: a bound raised by each run's width refused it at 184 of 160 positions)
    marks.zero_()
    marks[0, [2, 30, 58, 86, 114]] = marks[1, [6, 34, 62, 90, 118]] = 3
    respond = lambda row, tokens, mask: "x" * 20 if tokens.count(TOK.assistant_end) < 5 else None  # noqa: E731
    with placed_at(marks, (TOK.python_start, TOK.python_end, TOK.assistant_end), TOK.vocab_size):
        out = generate(model, TOK, [[1, 2, 3, 4, 5]], 2, 200, seed=0, respond=respond, decode="dynamic")
    assert out["lengths"].tolist() == [115, 119]


def test_a_stop_made_at_a_column_inside_a_forced_run_or_at_a_capped_turns_end_ends_the_row_there():
    # generate's `ends` (the self-check's stops) on a column that a forced run covers: the run stops short of it;
    # on the column where --max-turn-tokens forces a turn's end: the row ends, the environment is not asked
    from bench_shared import placed_at
    model, prompts, marks = random_model("padded-vocab", n_layer=2), random_tokens(6, 4), torch.zeros(2, 30).long()
    marks[:, 3] = 3  # both rows end their first turn at column 3, answered together (columns 4-17)
    respond = lambda row, tokens, mask: "hello there" if tokens.count(TOK.assistant_end) < 2 else None  # noqa: E731
    with placed_at(marks, (TOK.python_start, TOK.python_end, TOK.assistant_end), TOK.vocab_size):
        out = generate(model, TOK, prompts, 1, 30, seed=0, ends=torch.tensor([8.0, -1.0]), respond=respond)
    assert out["lengths"][0] == 9 and not out["truncated"][0] and out["tokens"][0, 8] == TOK.assistant_end
    capped = generate(model, TOK, prompts, 1, 30, seed=0, ends=[1, -1], max_turn_tokens=1, respond=respond)
    assert capped["lengths"][0] == 2 and capped["tokens"][0, 1] == TOK.assistant_end and capped["lengths"][1] > 2


@pytest.mark.cuda
def test_on_a_gpu_the_captured_and_static_decodes_force_turns_and_tool_outputs_as_the_dynamic_one():
    # Forced tokens inside the captured CUDA-graph decode and the halving static one (on the CPU the graph's step
    # runs uncaptured): every row's python block answered by a tool, then three turns, the first two answered
    # (tests/bench_gpu.py, as the GPU session's part 6d at d20). In float32 the dynamic decode's tokens, and log-probs
    # within its own rounding: 3x its distance from a float64 copy's (the other decode's own distance at most twice
    # it). In bf16 the graph replays the static step's kernels: bit for bit.
    import bench_gpu
    model = random_model("smear-backout").cuda()
    prompts = random_tokens(5, 40, 77)
    f32 = bench_gpu.decodes_compared(model, TOK, prompts, 4, 60, ("static", "graph"))
    assert f32["forced"] >= f32["rows"] * (3 + 2 * len(rendered_user_turn("again")))  # a tool's output, two turns
    for decode in ("static", "graph"):
        assert f32[decode]["equal"] == f32["rows"], (decode, f32)
        assert f32[decode]["apart"] <= 3 * f32["exact"], (decode, f32)
    bf16 = bench_gpu.decodes_compared(model, TOK, prompts, 4, 60, ("graph",), "static",
                                      torch.autocast("cuda", dtype=torch.bfloat16))
    assert bf16["forced"] > 0 and bf16["graph"] == dict(equal=bf16["rows"], apart=0.0), bf16


def test_rows_whose_task_does_not_answer_sample_what_they_sample_without_an_environment():
    prompts = random_tokens(5, 40, 77)
    model = replies_that_end_at_different_steps(random_model("smear-backout"), prompts)
    for decode in ("dynamic", "static"):
        alone = generate(model, TOK, prompts, 4, 40, seed=3, decode=decode)
        silent = generate(model, TOK, prompts, 4, 40, seed=3, decode=decode, respond=lambda row, tokens, mask: None)
        for key in alone:
            assert torch.equal(alone[key], silent[key]), key


def episode_batch(*flags):
    """An episode batch (user turns forced into rows, float64 model) through make_batch, with these flags ->
    (model, args, batch, logprobs, entropy with the gradient, the positions generate sampled [(row, position)],
    frozen log-probs: old, ref)."""
    prompts = random_tokens(5, 9)
    model = replies_that_end_at_different_steps(random_model("smear-backout"), prompts).double()
    respond, _ = answering([3] * 8)
    samples = generate(model, TOK, prompts, 4, 40, seed=3, respond=respond)
    args = grpo.resolve_config(["--demo", "--num-samples", "4", *flags])
    rewards = torch.arange(8, dtype=torch.float32).view(2, 4) % 3
    batch = grpo.make_batch(prompts, samples, rewards, args)
    logprobs, entropy = model.token_logprobs(batch["input_ids"], batch["target_ids"], with_entropy=True)
    sampled = []  # only positions where generate sampled (mask 1), found from its own outputs
    for row in range(8):
        offset = len(prompts[row // 4]) - 1  # the reply's first token is predicted at the prompt's last position
        sampled += [(row, offset + t) for t in range(samples["lengths"][row]) if samples["mask"][row, t]]
    assert len(sampled) < sum(samples["lengths"].tolist())  # forced tokens are there, left out here
    noise = torch.Generator().manual_seed(0)
    old, ref = (logprobs.detach() + 0.05 * torch.randn(logprobs.shape, generator=noise, dtype=torch.float64)
                for _ in range(2))
    return model, args, batch, logprobs, entropy, sampled, old, ref


def assert_no_gradient_where_not_sampled(loss, logprobs, entropy, sampled):
    """d loss / d log-prob and d loss / d entropy: exactly 0 wherever the sampler did not sample."""
    lp_grad, ent_grad = torch.autograd.grad(loss, [logprobs, entropy], retain_graph=True, allow_unused=True)
    forced = torch.ones_like(logprobs, dtype=torch.bool)
    for row, pos in sampled:
        forced[row, pos] = False
    assert not lp_grad[forced].any() and lp_grad[~forced].abs().sum() > 0
    assert ent_grad is None or not ent_grad[forced].any()


def test_the_environments_tokens_get_exactly_zero_gradient():
    # Every term on (policy, KL to a reference, entropy bonus), in float64, against a loss written here over the
    # sampled tokens alone: the same gradient up to float64 rounding, and exactly 0 at the forced positions
    model, args, batch, logprobs, entropy, sampled, old, ref = episode_batch(
        "--aggregation", "token", "--kl-coef", "0.1", "--kl-estimator", "k3", "--entropy-coef", "0.01", "--clip-eps",
        "0.2")
    frozen = dict(old=old, sampler=old, ref=ref, teacher=None, teacher_top=None)
    advantages = batch["advantages"].double()[:, None]
    mask = batch["loss_mask"].double()
    loss, _ = grpo.objective(logprobs, entropy, frozen, advantages, mask, mask.sum(), args)

    def hand_written(order):
        total = 0.0
        for row, pos in order:
            lp, a = logprobs[row, pos], advantages[row, 0]
            ratio = torch.exp(lp - old[row, pos])
            policy = -torch.minimum(ratio * a, ratio.clamp(1 - args.clip_eps, 1 + args.clip_eps_high) * a)
            kl = torch.exp(ref[row, pos] - lp) - (ref[row, pos] - lp) - 1
            total = total + policy + args.kl_coef * kl - args.entropy_coef * entropy[row, pos]
        return total / len(order)

    def grads(value):
        inputs = list(model.parameters()) + [logprobs, entropy]
        return torch.cat([g.flatten() for g in torch.autograd.grad(value, inputs, retain_graph=True)])
    got, want, permuted = grads(loss), grads(hand_written(sampled)), grads(hand_written(sampled[::-1]))
    rounding = (want - permuted).abs().max() + torch.finfo(torch.float64).eps * want.abs().max()
    assert (got - want).abs().max() <= 8 * rounding
    assert_no_gradient_where_not_sampled(loss, logprobs, entropy, sampled)


@pytest.mark.parametrize("divergence", ["sampled", "forward"])
def test_the_environments_tokens_get_no_gradient_from_either_teacher_form(divergence):
    # a teacher's term beside the policy's: as a per-token advantage (sampled) or its top-k forward KL, whose student
    # log-probs here are the sampled token's shifted (they carry the gradient of the log-probs)
    _, args, batch, logprobs, entropy, sampled, old, teacher = episode_batch("--aggregation", "token")
    args.distill_coef, args.distill_divergence = 1.0, divergence  # as --teacher with --distill-coef 1 sets them
    top = teacher.unsqueeze(-1) - torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)  # [B, T, 3]
    frozen = dict(old=old, sampler=old, ref=None, teacher=teacher if divergence == "sampled" else None,
                  teacher_top=(top, None) if divergence == "forward" else None)
    student_top = (logprobs.unsqueeze(-1) - torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64), None)
    mask = batch["loss_mask"].double()
    loss, parts = grpo.objective(logprobs, entropy, frozen, batch["advantages"].double()[:, None], mask, mask.sum(),
                                 args, student_top=student_top if divergence == "forward" else None)
    assert parts["teacher_kl"].abs().sum() > 0  # the teacher's term is there
    assert_no_gradient_where_not_sampled(loss, logprobs, entropy, sampled)


ENVIRONMENTS = TASK_FILE + '''

class Silent(Reverse):  # answers no turn: every episode is one turn
    def respond(self, conversation, episode):
        return None


class Raises(Reverse):
    def respond(self, conversation, episode):
        raise KeyError("state")


class NotText(Reverse):
    def respond(self, conversation, episode):
        return 3


class Exits(Reverse):
    def respond(self, conversation, episode):
        sys.exit(0)
'''


def read_run(tmp_path, name):
    run = tmp_path / "runs" / name
    timings = ("time", "tokens_per_s", "peak_mem")  # the machine's, not the run's
    metrics = [{k: v for k, v in json.loads(line).items() if not any(s in k for s in timings)}
               for line in open(run / "metrics.jsonl")]
    weights = torch.load(max((run / "chatrl_checkpoints").glob("*/model_*.pt")), weights_only=True)  # the last
    return metrics, weights


def test_a_task_that_answers_no_turn_is_todays_run_byte_for_byte(tmp_path, monkeypatch):
    # The episode machinery on (respond asked at every end of turn, --attempts 1, --max-turns): the same metrics
    # and weights as the plain task's run, to the bit
    (tmp_path / "own.py").write_text("import sys\n" + ENVIRONMENTS)
    asked, responder = [], tasks.episode_responder

    def counting(task, *rest):
        respond = responder(task, *rest)
        return respond and (lambda *a: asked.append(1) or respond(*a))
    monkeypatch.setattr(tasks, "episode_responder", counting)
    flags = ["--num-steps", "2", "--eval-every", "2", "--max-new-tokens", "12"]
    grpo.main(base_flags(tmp_path, "plain", "--task", f"{tmp_path / 'own.py'}:Reverse", *flags))
    grpo.main(base_flags(tmp_path, "silent", "--task", f"{tmp_path / 'own.py'}:Silent", "--attempts", "1",
                         "--max-turns", "3", *flags))
    assert asked  # rows ended their turns and the task was asked
    (plain, plain_weights), (silent, silent_weights) = read_run(tmp_path, "plain"), read_run(tmp_path, "silent")
    episodes = [{k: m.pop(k) for k in list(m) if k.startswith("episode_")} for m in silent]  # logged for episodes
    assert plain == silent
    assert all(e["episode_turns"] == 1 and e["episode_end_quit"] + e["episode_end_done"] + e["episode_end_budget"]
               == 1 for e in episodes if e)
    assert plain_weights.keys() == silent_weights.keys()
    assert all(torch.equal(plain_weights[k], silent_weights[k]) for k in plain_weights)


class Endless:
    """A task whose environment answers every turn: --max-turns and the token budget end its episodes."""
    def respond(self, conversation, episode):
        return "again"


def test_an_environment_that_never_ends_is_ended_by_max_turns_and_its_episodes_read_back_turn_by_turn():
    prompts = random_tokens(5, 9)
    model = replies_that_end_at_different_steps(random_model("smear-backout"), prompts)
    conversations = [{"messages": [{"role": "user", "content": "x"}]}] * 2
    respond = tasks.episode_responder(Endless(), TOK, conversations, 4, max_turns=3)
    samples = generate(model, TOK, prompts, 4, 80, seed=3, respond=respond)
    counts = []
    for row in range(8):
        conversation, reply = tasks.graded(Endless(), TOK, conversations[0], samples, row)
        turns = conversation["episode"]
        assistant = [turn for turn in turns if turn["role"] == "assistant"]
        counts.append(len(assistant))
        assert [turn["role"] for turn in turns] == ["assistant", "user"] * (len(assistant) - 1) + ["assistant"]
        assert all(turn["content"] == "again" for turn in turns if turn["role"] == "user") and reply == turns[-1][
            "content"]
        if not samples["truncated"][row]:  # ended: at the third turn's end, or by <|bos|>
            assert len(assistant) == 3 or assistant[-1]["ended"] == "quit"
        # each sampled end of turn but the last is followed by the forced user turn
        n = samples["lengths"][row].item()
        tokens, mask = samples["tokens"][row, :n].tolist(), samples["mask"][row, :n].tolist()
        ends = [i for i in range(n) if mask[i] and tokens[i] in (TOK.assistant_end, TOK.bos)]
        assert len(ends) == len(assistant) - (assistant[-1]["ended"] == "cut")
        for i in ends[:len(assistant) - 1]:
            assert tokens[i + 1:i + 1 + len(rendered_user_turn("again"))] == rendered_user_turn("again")
    assert max(counts) == 3 and min(counts) < 3


def test_a_turn_ending_on_the_last_column_is_cut_there_without_asking_the_environment():
    # --max-turn-tokens 6 of a 7-token budget: the capped turn's end takes the last column, where no answer fits
    respond, calls = answering([5] * 8)
    samples = generate(random_model("smear-backout"), TOK, random_tokens(5, 9), 4, 7, seed=3, respond=respond,
                       max_turn_tokens=6)
    assert all(len(tokens) < 7 for _, tokens, _ in calls)  # never asked where its answer could not be used
    capped = samples["tokens"][:, 6] == TOK.assistant_end
    assert capped.any() and samples["truncated"][capped].all()  # cut by the budget, as a row cut mid-turn is


class Scribbler:
    """An environment that writes on what it is given: its conversation (counting its calls there) and the turns."""
    def respond(self, conversation, episode):
        conversation["messages"].append({"role": "user", "content": "scribbled"})
        conversation["calls"] = conversation.get("calls", 0) + 1
        episode.clear()
        return f"call {conversation['calls']}"


def test_a_respond_or_grader_that_writes_on_its_conversation_reaches_no_other_row_nor_the_grading():
    prompts = random_tokens(5, 9)
    model = replies_that_end_at_different_steps(random_model("smear-backout"), prompts)
    conversations = [{"messages": [{"role": "user", "content": f"q{p}"}]} for p in range(2)]
    before = json.dumps(conversations)
    respond = tasks.episode_responder(Scribbler(), TOK, conversations, 4, max_turns=3)
    samples = generate(model, TOK, prompts, 4, 80, seed=3, respond=respond)
    assert json.dumps(conversations) == before  # the group's shared question, as it was
    users = []
    for row in range(8):
        conversation, _ = tasks.graded(Scribbler(), TOK, conversations[row // 4], samples, row)
        users += [turn["content"] for turn in conversation["episode"] if turn["role"] == "user"]
        assert conversation["messages"] == [{"role": "user", "content": f"q{row // 4}"}]  # no call's write
        conversation["messages"].append("a grader's write")  # reaches no later row's grading
    assert users and set(users) == {"call 1"}  # every call saw the row's conversation as the task gave it
    assert json.dumps(conversations) == before


@pytest.mark.parametrize("source", ["respond", "tool"])
def test_a_huge_answer_is_cut_to_the_rows_room_before_it_is_encoded(source, monkeypatch):
    # 1 MiB from the environment or a tool: encoded no further than twice what the row can still hold, queued no
    # further than it; the episode's tokens those of a budget-sized answer
    huge = "ab " * 350_000
    encoded, encode = [], TOK.encode
    monkeypatch.setattr(TOK, "encode", lambda text: encoded.append(len(text)) or encode(text))
    if source == "tool":
        written = [TOK.python_start] + TOK.encode("1+1")  # a block closed at step t: 20 columns left of 25
        tokens = torch.tensor([written + [TOK.python_end] + [0] * (25 - len(written))])  # and generate's spare one
        forced, num_forced = model_module.call_tool(lambda text: huge, TOK, tokens, torch.tensor([0]),
                                                    torch.tensor([len(written)]),
                                                    torch.tensor([True]), torch.zeros(1, 0, dtype=torch.long),
                                                    torch.zeros(1, dtype=torch.long))
        assert forced.size(1) == num_forced[0] == 20 and forced[0, 1:].tolist() == encode(huge[:19])
        assert max(encoded) <= 2 * 20 * TOK.longest_token + 16
        return
    prompts = random_tokens(5, 9)
    model = replies_that_end_at_different_steps(random_model("smear-backout"), prompts)
    conversations = [{"messages": [{"role": "user", "content": "x"}]}] * 2
    runs = {}
    for name, message in (("huge", huge), ("budget-sized", huge[:80])):
        class Answers(Endless):
            def respond(self, conversation, episode):
                return message
        encoded.clear()
        respond = tasks.episode_responder(Answers(), TOK, conversations, 4, max_turns=3)
        runs[name] = generate(model, TOK, prompts, 4, 80, seed=3, respond=respond)
        assert encoded and max(encoded) <= 2 * 80 * TOK.longest_token + 16
    assert (runs["huge"]["mask"] == 0).any()  # some row was answered
    for key in runs["huge"]:
        assert torch.equal(runs["huge"][key], runs["budget-sized"][key]), key


@pytest.mark.parametrize("name,said", [
    ("Raises", "raised KeyError: 'state' (own.py line {line}, in respond)"),
    ("NotText", "returned 3: return the next user message as text, or None to end the episode"),
    ("Exits", "called sys.exit(0) (own.py line {line}, in respond): it must return"),
])
def test_an_environment_that_misbehaves_is_one_line_naming_respond(tmp_path, name, said):
    source = "import sys\n" + ENVIRONMENTS
    (tmp_path / "own.py").write_text(source)
    spec = f"{tmp_path / 'own.py'}:{name}"
    line = 1 + source.split("\n").index(f"class {name}(Reverse):") + 2
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, name, "--task", spec, "--num-steps", "1", "--eval-every", "0",
                             "--max-new-tokens", "24"))
    message = str(stop.value.code)
    assert message.startswith(f"error: --task {spec}: respond after the reply ") and "\n" not in message, message
    assert said.format(line=line) in message, message


class Answer42:
    """A graded task of one turn: right when the reply is 42; reward 1 right, 0.5 for a number, else 0."""
    reward_terms = ("reward",)

    def evaluate(self, conversation, reply_text):
        return reply_text == "42"

    def reward_parts(self, conversation, reply_text):
        return {"reward": 1.0 if reply_text == "42" else 0.5 if reply_text.isdigit() else 0.0}

    def eval_metrics(self, conversation, reply_text):
        return {"correct": float(self.evaluate(conversation, reply_text))}


def episode(*replies):
    turns = []
    for reply in replies:
        turns += [dict(role="assistant", content=reply, ended="turn"), dict(role="user", content="...")]
    return turns[:-1]


def test_attempts_answer_a_wrong_reply_until_it_is_right_or_the_attempts_are_spent():
    from tasks import Attempts
    task, conversation = Attempts(Answer42(), 3), {"messages": [{"role": "user", "content": "6 x 7?"}]}
    assert task.respond(conversation, episode("41")) == "Your answer is wrong. Try again (2 attempts left)."
    assert task.respond(conversation, episode("41", "40")) == "Your answer is wrong. Try again (1 attempt left)."
    assert task.respond(conversation, episode("41", "40", "x")) is None  # spent
    assert task.respond(conversation, episode("42")) is None and task.respond(conversation, episode("1", "42")) is None
    # the reward is the last attempt's, undiscounted; correct@k: right within the first k attempts
    graded = dict(conversation, episode=episode("x", "42"))
    assert task.reward_parts(graded, "42") == {"reward": 1.0}
    assert task.eval_metrics(graded, "42") == {"correct": 1.0, "correct@1": 0.0, "correct@2": 1.0, "correct@3": 1.0}
    spent = dict(conversation, episode=episode("x", "7", "8"))
    assert task.reward_parts(spent, "8") == {"reward": 0.5}
    assert task.eval_metrics(spent, "8") == {"correct": 0.0, "correct@1": 0.0, "correct@2": 0.0, "correct@3": 0.0}


def test_the_example_environment_pays_for_reading_the_answers():
    import importlib.util
    spec = importlib.util.spec_from_file_location("guess_digit", "docs/examples/guess_digit.py")
    game = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(game)
    task = game.GuessDigit("test")

    def play(policy):  # policy(low, high, guesses so far) -> a guess; the mean reward over the test split
        total = 0.0
        for index in range(len(task)):
            conversation, turns, low, high = task[index], [], 0, 9
            while True:
                guess = policy(low, high, len(turns) // 2)
                turns.append(dict(role="assistant", content=f" {guess}\n", ended="turn"))
                answer = task.respond(conversation, turns)
                if answer is None:
                    break
                low, high = (guess + 1, high) if answer == "higher" else (low, guess - 1)
                turns.append(dict(role="user", content=answer))
            total += task.reward(dict(conversation, episode=turns), turns[-1]["content"])
        return total / len(task)
    blind, search = play(lambda low, high, k: k), play(lambda low, high, k: (low + high) // 2)
    assert blind < 0.3 < 0.45 < search  # about 0.25 and 0.525 on a uniform digit
    assert task.respond(task[0], [dict(role="assistant", content="seven", ended="turn")]) == "a digit"
    # the lying game (docs/demo.md's ablation): the same answers, "higher" and "lower" swapped
    lie, swapped = game.LyingDigit("test"), {"higher": "lower", "lower": "higher"}
    for index in range(10):
        for guess in "0123456789":
            turns = [dict(role="assistant", content=guess, ended="turn")]
            said = task.respond(task[index], turns)
            assert lie.respond(task[index], turns) == swapped.get(said, said)


def test_the_retries_example_is_found_in_three_attempts_by_a_policy_that_answers_otherwise_after_a_miss():
    import importlib.util
    spec = importlib.util.spec_from_file_location("pick_one", "docs/examples/pick_one.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    task = tasks.Attempts(example.PickOne("test"), 3)

    def correct_at(policy):  # policy(the three digits, the replies so far) -> a reply; the test split's correct@1..3
        totals = [0.0] * 3
        for index in range(len(task)):
            conversation, turns = task[index], []
            digits = conversation["messages"][0]["content"].split()
            assert len(set(digits)) == 3 and conversation["messages"][-1]["content"] in digits
            while True:
                turns.append(dict(role="assistant", content=policy(digits, [t["content"] for t in turns
                                                                             if t["role"] == "assistant"])))
                feedback = task.respond(conversation, turns)
                if feedback is None:
                    break
                turns.append(dict(role="user", content=feedback))
            metrics = task.eval_metrics(dict(conversation, episode=turns), turns[-1]["content"])
            totals = [total + metrics[f"correct@{k}"] for k, total in enumerate(totals, 1)]
        return [total / len(task) for total in totals]
    repeats = correct_at(lambda digits, said: digits[0])
    assert 0.2 < repeats[0] == repeats[2] < 0.45  # a third, however many attempts
    reads = correct_at(lambda digits, said: next(d for d in digits if d not in said))  # its misses
    counts = correct_at(lambda digits, said: digits[len(said)])  # the k-th digit at the k-th attempt
    assert reads[0] == repeats[0] and reads[2] == 1.0 and counts == reads
    # graded on the first character: the hidden digit 1, another of the three 0.2, else 0
    conversation = task[0]
    right, digits = conversation["messages"][-1]["content"], conversation["messages"][0]["content"].split()
    wrong = next(d for d in digits if d != right)
    assert [task.reward(conversation, reply) for reply in (right + "!?", wrong, " " + right, "")] == [1.0, 0.2, 0.0, 0.0]


def test_an_episode_run_trains_logs_its_turns_and_resumes_only_with_the_same_episode_flags(
        tmp_path, run_killed_after_first_save, capsys):
    flags = base_flags(tmp_path, "guess", "--task", "docs/examples/guess_digit.py:GuessDigit", "--max-turns", "4",
                       "--max-new-tokens", "24", "--num-steps", "2", "--save-every", "1", "--eval-every", "2",
                       "--log-samples", "2")
    run_killed_after_first_save(flags)
    with pytest.raises(SystemExit) as stop:
        grpo.main(flags + ["--max-turns", "3", "--resume"])
    assert str(stop.value.code).startswith("error: --resume with flags that differ from the run's (max_turns)")
    assert "attempts" not in grpo.flags_with("observes")  # refused the same way
    grpo.main(flags + ["--resume"])
    grpo.main([f if f != "guess" else "whole" for f in flags])  # the same run, never stopped: the same steps
    (resumed, resumed_weights), (whole, whole_weights) = read_run(tmp_path, "guess"), read_run(tmp_path, "whole")
    assert [m for m in resumed if "reward" in m] == [m for m in whole if "reward" in m]
    assert all(torch.equal(resumed_weights[k], whole_weights[k]) for k in whole_weights)
    metrics = [json.loads(line) for line in open(tmp_path / "runs" / "guess" / "metrics.jsonl")]
    steps = [m for m in metrics if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2] and all(1 <= m["episode_turns"] <= 4 for m in steps)
    assert all(abs(m["episode_end_done"] + m["episode_end_quit"] + m["episode_end_budget"] - 1) < 1e-9 for m in steps)
    samples = [json.loads(line) for line in open(tmp_path / "runs" / "guess" / "samples.jsonl")]
    assert all(s["episode"][-1]["role"] == "assistant" and s["reply"] == s["episode"][-1]["content"] for s in samples)
    assert "| turns " in capsys.readouterr().out
    table = grpo.compare_runs([str(tmp_path / "runs" / "guess")], str(tmp_path / "c.png"))  # --compare: turns too
    assert table[1][table[0].index("turns")] == steps[-1]["episode_turns"]


def test_attempts_need_the_turns_and_a_task_that_does_not_answer_itself(tmp_path):
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "a", "--attempts", "3", "--max-turns", "2"))
    assert stop.value.code == 2
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "b", "--task", "docs/examples/guess_digit.py:GuessDigit", "--attempts", "2"))
    assert "answers the assistant itself (respond): --attempts 2 would replace its answers" in str(stop.value.code)
    # watched (--eval-task), such a task plays its own episodes; a task that does not answer takes the attempts
    args = grpo.resolve_config(["--demo", "--attempts", "2", "--eval-task", "docs/examples/guess_digit.py:GuessDigit"])
    watched = tasks.build("docs/examples/guess_digit.py:GuessDigit", "test", args)
    assert not isinstance(watched, tasks.Attempts) and watched.respond is not None
    assert isinstance(tasks.build("sort", "test", args), tasks.Attempts)


def test_the_episode_flags_on_a_task_of_one_turn_get_an_idle_note():
    notes = grpo.resolve_config(["--demo", "--max-turns", "3", "--max-turn-tokens", "4"]).notes
    assert [note.split(" does nothing here: ")[0] for note in notes] == ["--max-turns", "--max-turn-tokens"]
    assert grpo.resolve_config(["--demo", "--max-turns", "3", "--attempts", "3"]).notes == []  # episodes there


def test_attempts_say_the_tokens_an_episode_needs_and_a_budget_too_small_for_them(tmp_path, capsys):
    grpo.main(base_flags(tmp_path, "short", "--attempts", "3", "--num-steps", "1", "--eval-every", "0",
                         "--eval-max-new-tokens", "400"))
    out = capsys.readouterr().out
    feedback = [3 + len(TOK.encode(f"Your answer is wrong. Try again ({left}."))
                for left in ("2 attempts left)", "1 attempt left)")]
    # a token and its end a reply, the forced feedback between, and a column after the last turn's end (a turn that
    # ends on the last column cannot ask the environment whether the episode goes on: it counts as cut)
    least = 2 * 3 + sum(feedback) + 1
    assert f"--attempts 3: an episode needs at least {least} tokens (2 a reply, {feedback[0]} for each" in out
    assert f"note: --max-new-tokens 8 holds 1 of the 3 attempts at most: raise it to at least {least}" in out
    assert "--eval-max-new-tokens 400 holds" not in out  # 400 hold them
    # with --max-turn-tokens, what three full turns take; an evaluation's budget is --eval-max-new-tokens alone
    grpo.main(["--demo", "--init", str(tmp_path / "runs" / "short"), "--eval-only", "--attempts", "3",
               "--max-turn-tokens", "4", "--eval-max-new-tokens", "400", "--final-eval-examples", "4"])
    out = capsys.readouterr().out
    assert f"{3 * 5 + sum(feedback) + 1} for 3 full turns of --max-turn-tokens 4" in out
    assert "note: --max-new-tokens" not in out


def test_a_budget_that_ends_right_after_the_users_turn_grades_an_empty_reply_never_the_users_message():
    # the forced run <|user_start|> message <|user_end|> <|assistant_start|> fills the last of --max-new-tokens: the
    # reply the task grades is the empty one the model had no room for ("cut"), not the feedback (whose "2 attempts"
    # the number grader would read as an answer of 2)
    first = TOK.encode("7") + [TOK.assistant_end]
    tokens = first + rendered_user_turn("Your answer is wrong. Try again (2 attempts left).")
    mask = [1] * len(first) + [0] * (len(tokens) - len(first))
    turns = tasks.episode_turns(TOK, tokens, mask)
    assert [t["role"] for t in turns] == ["assistant", "user", "assistant"]
    assert turns[-1] == {"role": "assistant", "content": "", "ended": "cut"}


def test_evaluating_an_episode_run_takes_its_episode_flags(tmp_path):
    # --eval-only and --ask read a run's settings: its episodes' too, else a 3-attempt run is evaluated on one
    flags = ["--demo", "--attempts", "2", "--max-turns", "3", "--max-turn-tokens", "4", "--max-new-tokens", "80",
             "--num-steps", "1", "--eval-every", "0", "--prompts-per-step", "2", "--num-samples", "2",
             "--runs-dir", str(tmp_path), "--run-name", "episodes", "--no-plot"]
    grpo.main(flags)
    for evaluation in (["--eval-only"], ["--ask", "31415"]):
        args = grpo.resolve_config(["--demo", "--init", str(tmp_path / "episodes"), *evaluation])
        assert (args.attempts, args.max_turns, args.max_turn_tokens) == (2, 3, 4)
        assert "episodes of --max-turns 3 --max-turn-tokens 4 --attempts 2" in grpo.evaluation_settings(args)
    # more retries than it trained with: by --resume as by --init (an evaluation plays its episodes as it is told)
    result = grpo.main(["--demo", "--resume", "--runs-dir", str(tmp_path), "--run-name", "episodes", "--eval-only",
                        "--attempts", "3", "--final-eval-examples", "8"])
    assert "eval_correct@3" in result


COUNTING_TASK = """
from tasks import Task


class Counting(Task):
    \"\"\"Answers each reply with its number, three replies at most; the reward: the replies the episode had.\"\"\"
    def __init__(self, split):
        self.split = split

    @classmethod
    def from_flags(cls, split, args):
        return cls(split)

    def __len__(self):
        return 4

    def example(self, index):
        return {"messages": [{"role": "user", "content": "Talk to me."}, {"role": "assistant", "content": "ok"}]}

    def respond(self, conversation, episode):
        replies = sum(turn["role"] == "assistant" for turn in episode)
        return f"after reply {replies}" if replies < 3 else None

    def reward(self, conversation, reply_text):
        return float(sum(turn["role"] == "assistant" for turn in conversation.get("episode", [{"role": "assistant"}])))

    def evaluate(self, conversation, reply_text):
        return False
"""


def test_ask_plays_an_episode_and_prints_each_turn_as_the_task_graded_it(tmp_path, capsys):
    (tmp_path / "counting.py").write_text(COUNTING_TASK)
    replies = grpo.main(["--demo", "--task", f"{tmp_path / 'counting.py'}:Counting", "--max-turn-tokens", "2",
                         "--eval-max-new-tokens", "64", "--ask", "Talk to me.", "--num-samples", "3"])
    out = capsys.readouterr().out
    for label, (text, reward) in zip(["greedy", "sample 1", "sample 2", "sample 3"], replies):
        said = [line[len(label) + 3:] for line in out.splitlines() if line.startswith(f"[{label}, ")]
        roles = [line.split("]")[0] for line in said]
        users = [line.removeprefix("user] ") for line in said if line.startswith("user] ")]
        # the turns in order, each user turn the task's answer to the replies before it; the reward the episode's
        assert roles[:-1] == ["assistant", "user"] * (len(roles) // 2) and roles[-1] == f"reward {reward:g}"
        assert users == [f"after reply {k}" for k in range(1, len(users) + 1)] and reward == len(users) + 1
        assert f"[{label}, reward {reward:g}] {text}\n" in out  # the reply graded is the last turn printed
    assert max(reward for _, reward in replies) == 3  # episodes ran to the task's end (a reply that quits ends sooner)
    # every problem of the task asks "Talk to me.": which one grades the replies is said
    assert "note: --ask: several of the task's problems have this question; graded as the first found" in out


def test_lengths_tokens_sampled_and_the_overlong_penalty_count_the_models_tokens_alone(tmp_path, monkeypatch):
    # the environment's turns are forced, not sampled: reply_len, tokens_sampled and DAPO's overlong penalty count
    # what the policy wrote; the whole episode's length is episode_len
    (tmp_path / "counting.py").write_text(COUNTING_TASK)
    played, penalised, play, penalty = [], [], grpo.play, grpo.overlong_penalty
    monkeypatch.setattr(grpo, "play", lambda *a, **k: played.append(play(*a, **k)) or played[-1])
    monkeypatch.setattr(grpo, "overlong_penalty", lambda lengths, *a: penalised.append(lengths) or penalty(lengths, *a))
    grpo.main(base_flags(tmp_path, "count", "--task", f"{tmp_path / 'counting.py'}:Counting", "--max-turn-tokens", "2",
                         "--max-new-tokens", "40", "--overlong-buffer", "20", "--num-steps", "1", "--eval-every", "0",
                         "--prompts-per-step", "4"))
    [samples], [lengths] = played, penalised
    sampled = samples["mask"].sum(dim=1)
    assert (sampled < samples["lengths"]).any() and torch.equal(lengths, sampled)
    [metrics] = [json.loads(line) for line in open(tmp_path / "runs" / "count" / "metrics.jsonl") if '"reward"' in line]
    assert metrics["reply_len"] == pytest.approx(sampled.double().mean().item())
    assert metrics["tokens_sampled"] == sampled.sum().item()
    assert metrics["episode_len"] == pytest.approx(samples["lengths"].double().mean().item())
    assert metrics["overlong_penalty"] == pytest.approx(penalty(sampled, 40, 20).double().mean().item())


def test_compare_plots_turns_and_correct_at_each_attempt(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    flags = ["--demo", "--num-steps", "2", "--eval-every", "1", "--eval-examples", "4", "--final-eval-examples", "4",
             "--prompts-per-step", "2", "--num-samples", "2", "--max-new-tokens", "40", "--eval-max-new-tokens", "40",
             "--runs-dir", str(tmp_path)]
    grpo.main(flags + ["--attempts", "2", "--max-turn-tokens", "8", "--run-name", "retries"])
    grpo.main(flags + ["--run-name", "single", "--max-new-tokens", "8", "--eval-max-new-tokens", "8"])
    grpo.main(["--compare", str(tmp_path / "retries"), str(tmp_path / "single")])
    panels = {ax.get_title(): ax for ax in figures[-1].axes if ax.get_visible()}
    assert len(panels) == 6
    metrics = [json.loads(line) for line in open(tmp_path / "retries" / "metrics.jsonl")]
    turns = [line for line in panels["turns an episode"].get_lines()]
    assert [list(line.get_ydata()) for line in turns] == [[m["episode_turns"] for m in metrics if "reward" in m]]
    correct = panels["eval correct@1 (solid) .. @2 (dashed, k up: higher)"].get_lines()
    assert [(line.get_linestyle(), list(line.get_ydata())) for line in correct] == [
        (style, [m[key] for m in metrics if key in m]) for style, key in (("-", "eval_correct@1"),
                                                                          ("--", "eval_correct@2"))]
