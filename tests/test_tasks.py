import functools
import http.server
import json
import os
import random
import re
import threading
import time

import pytest

from model import Tokenizer
from tasks.gsm8k import (GSM8K, LENIENT_ANSWER, answer_to_parts, calculator, ends_with_answer_line, extract_answer,
                         find_split, is_correct)
from tasks.sort import Sort

TOK = Tokenizer.byte_level()


def reply_of(conversation):
    """The reference solution as the model would produce it: its tokens, decoded."""
    ids, mask = TOK.render_conversation(conversation)
    start = ids.index(TOK.assistant_start) + 1
    return TOK.decode(ids[start:-1])


def test_real_splits_load_and_every_reference_grades_correct(gsm8k_dir):
    for split, rows in (("train", 7473), ("test", 1319)):
        task = GSM8K(split, data_dir=gsm8k_dir)
        assert len(task) == rows
        for conversation in task:
            reply = reply_of(conversation)
            assert "<|python_start|>" in reply or "<<" not in task.reference(conversation)
            assert task.evaluate(conversation, reply) and task.reward(conversation, reply) == 1.0
            wrong = reply[:reply.index("####")] + "#### " + str(int(extract_answer(reply)) + 1)
            assert not task.evaluate(conversation, wrong) and task.reward(conversation, wrong) == 0.0
            assert is_correct(reply, task.reference(conversation), lenient=True)


def test_order_is_a_seeded_shuffle(gsm8k_dir):
    a, b = GSM8K("test", data_dir=gsm8k_dir), GSM8K("test", data_dir=gsm8k_dir)
    assert [a[i] for i in range(5)] == [b[i] for i in range(5)]
    first_in_file = json.loads(open(os.path.join(gsm8k_dir, "test.jsonl")).readline())["question"]
    assert a[0]["messages"][0]["content"] != first_in_file
    with pytest.raises(IndexError):
        a[len(a)]


def test_calculator_annotations_become_tool_parts():
    parts = answer_to_parts("She sold 48/2 = <<48/2=24>>24 clips.\n#### 24")
    assert parts == [{"type": "text", "text": "She sold 48/2 = "}, {"type": "python", "text": "48/2"},
                     {"type": "python_output", "text": "24"}, {"type": "text", "text": "24 clips.\n#### 24"}]


# reply, reference answer, strict verdict, lenient verdict
TRICKY = [
    ("#### 72", "72", True, True),
    ("so the answer is\n#### 1,000", "1000", True, True),
    ("#### 1000", "1,000", True, True),
    ("#### -5", "-5", True, True),
    ("#### 5", "-5", False, False),
    ("#### 18.00", "18", False, True),
    ("#### 18.5", "18.5", True, True),
    ("#### 72.", "72", False, True),
    ("#### $72", "72", False, True),
    ("####72", "72", False, True),
    ("#### 72 dollars", "72", True, True),
    ("#### 71\n#### 72", "72", False, False),  # the first marker counts
    ("#### 72\n#### 71", "72", True, True),
    ("The answer is 72.", "72", False, False),  # no marker
    ("", "72", False, False),
    ("   #### 72   \n", "72", True, True),
    ("#### ", "72", False, False),
    ("#### .", "72", False, False),
    ("#### 1.2.3", "123", False, False),
    ("#### ７２", "72", False, False),  # unicode digits are not GSM8K digits
    ("\x00\xff\ud800 #### 72", "72", True, True),
    ("x" * 1_000_000 + "#### 72", "72", True, True),
    ("#### " + "9" * 100_000, "72", False, False),
]


@pytest.mark.parametrize("reply,answer,strict,lenient", TRICKY)
def test_tricky_replies(reply, answer, strict, lenient):
    reference = "Some working.\n#### " + answer
    assert is_correct(reply, reference) == strict
    assert is_correct(reply, reference, lenient=True) == lenient


def test_grading_is_fast():
    replies = [f"I think {i} + {i} = {2 * i}, so\n#### {2 * i}" for i in range(10_000)]
    start = time.perf_counter()
    assert sum(is_correct(r, "#### 10") for r in replies) == 1
    assert time.perf_counter() - start < 2.0  # 0.02 s measured: a bound for a machine 100x slower or busier


# ---------------------------------------------------------------------------- data sources and the download

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def served(tmp_path):
    """A local HTTP server over a folder: the download path, tested without the internet."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/{{split}}.jsonl"
    server.shutdown()


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NANOGRPO_GSM8K_DIR", raising=False)
    return tmp_path / "cache" / "gsm8k"


def test_download_into_an_empty_cache(gsm8k_dir, served, empty_cache):
    root, url = served
    (root / "test.jsonl").write_bytes(open(os.path.join(gsm8k_dir, "test.jsonl"), "rb").read())
    task = GSM8K("test", url=url)
    assert len(task) == 1319 and os.listdir(empty_cache) == ["test.jsonl"]
    (root / "test.jsonl").unlink()  # the second load reads the cache, not the server
    assert len(GSM8K("test", url=url)) == 1319


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_bad_download_leaves_no_cache_file(gsm8k_dir, served, empty_cache, damage):
    root, url = served
    lines = open(os.path.join(gsm8k_dir, "test.jsonl"), "rb").read().splitlines(keepends=True)
    if damage == "truncated":
        lines = lines[:700]
    else:
        lines[500] = lines[500][:40] + b"\n"
    (root / "test.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match="incomplete" if damage == "truncated" else "line 501"):
        find_split("test", url=url)
    assert os.listdir(empty_cache) == []


def test_offline_error_says_how_to_point_at_a_local_copy(empty_cache):
    with pytest.raises(RuntimeError, match="--gsm8k-dir"):
        find_split("test", url="http://127.0.0.1:9/{split}.jsonl")
    assert os.listdir(empty_cache) == []


def test_explicit_directory_and_environment_variable(tmp_path, monkeypatch, empty_cache):
    with pytest.raises(FileNotFoundError, match="no test.jsonl"):
        find_split("test", data_dir=str(tmp_path))
    monkeypatch.setenv("NANOGRPO_GSM8K_DIR", str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert find_split("test") == str(tmp_path / "test.jsonl")
    assert len(GSM8K("test")) == 1


# ---------------------------------------------------------------------------- sort

def test_sort_rewards():
    task = Sort("train", length=5)
    conversation = task[0]
    digits, target = conversation["messages"][0]["content"], conversation["messages"][1]["content"]
    assert len(digits) == 5 and target == "".join(sorted(digits))
    assert task.reward(conversation, target) == 1.0 and task.evaluate(conversation, target)
    wrong = "".join("x" for _ in target)
    assert task.reward(conversation, wrong) == 0.0 and not task.evaluate(conversation, wrong)
    assert task.reward(conversation, target[:3]) == 3 / 5
    assert task.reward(conversation, target + "99999") == 5 / 10  # padding a reply costs reward
    assert task.reward(conversation, "") == 0.0
    assert task.reward(conversation, "\x00\ufffd" * 1000) == 0.0


@pytest.mark.parametrize("pad", [" ", "\n", "\t", "\x1f\x1e\x1f", "\x1c", "\u00a0", "\u3000"])
def test_sort_accepts_the_digits_alone_and_padding_costs_reward(pad):
    # str.strip() drops these (the control characters \x1c-\x1f too): reinforce learned to pad its answers with
    # them and was scored exact. Padding is wrong, and costs reward as extra characters do.
    task = Sort("test")
    conversation = task[0]
    target = conversation["messages"][-1]["content"]
    assert pad.strip() == ""
    for reply in (target + pad, pad + target, pad + target + pad):
        assert not task.evaluate(conversation, reply) and task.eval_metrics(conversation, reply) == {"exact": 0.0}
        assert task.reward(conversation, reply) <= len(target) / len(reply) < 1.0
    assert task.reward(conversation, target + pad) == len(target) / (len(target) + len(pad))


def test_sort_is_seeded_and_test_split_is_fixed():
    assert [Sort(seed=1)[i] for i in range(10)] == [Sort(seed=1)[i] for i in range(10)]
    assert [Sort(seed=1)[i] for i in range(10)] != [Sort(seed=2)[i] for i in range(10)]
    test = Sort("test", num_test=64)
    assert len(test) == 64 and list(test) == list(Sort("test", num_test=64))
    assert test[0] != Sort("train")[0]
    assert len(Sort("train", length=3)[7]["messages"][0]["content"]) == 3


def test_lenient_grader_is_linear_with_the_same_verdicts():
    quadratic = re.compile(r"####\s*\$?\s*(-?[0-9.,]*[0-9])")  # the pattern before, same language
    rng = random.Random(0)
    pieces = ["#", "####", " ", "\n", "$", "-", "1", "8", ".", ",", "x"]
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        before, now = quadratic.search(text), LENIENT_ANSWER.search(text)
        assert (before and before.group(1)) == (now and now.group(1)), text
    start = time.time()
    assert not is_correct("#### " + "\n" * 32000 + "x", "#### 18", lenient=True)
    assert time.time() - start < 2.0  # 0.004 s measured; the quadratic pattern took about 27 s


def test_calculator_results_and_hostile_inputs():
    assert calculator("48/2") == "24"
    assert calculator("12/60") == "0.2"
    assert calculator("1,000 * 3 - (4 + 2)") == "2994"
    assert calculator("-5 + 2") == "-3"
    assert calculator("10/4") == "2.5"
    hostile = ["__import__('os')", "9**9**9", "9" * 10000, "((1+2)", "1/0", "", "2 ** 8", "a+1", "1e999", "1.2.3",
               "(" * 90 + "1" + ")" * 90, "()", "import os", "\x00", "１+１"]
    start = time.time()
    for expr in hostile:
        assert calculator(expr) is None, expr
    assert time.time() - start < 1.0


@pytest.mark.parametrize("reply,well_formed", [
    ("3 + 4 = 7\n#### 7", True), ("#### -1,200.50\n\n", True), ("#### 7 apples", False), ("#### 7\nso 7", False),
    ("The answer is 7", False), ("", False), ("####7", False)])
def test_the_format_term_reads_the_last_line(reply, well_formed):
    assert ends_with_answer_line(reply) is well_formed


def test_every_task_scores_its_first_term_as_its_reward(gsm8k_dir):
    for task, replies in ((Sort("train"), ["01234", "1", ""]), (GSM8K("test", gsm8k_dir), ["#### 3", "no", "#### 18"])):
        conversation = task[0]
        for reply in replies:
            parts = task.reward_parts(conversation, reply)
            assert list(parts) == list(task.reward_terms)
            assert parts[task.reward_terms[0]] == task.reward(conversation, reply)


def test_the_downloaded_gsm8k_cache_has_the_umasks_mode(tmp_path, monkeypatch, gsm8k_dir):
    import io
    import tasks.gsm8k as gsm8k

    class Response(io.BytesIO):  # the official file, as urlopen would serve it
        headers = {}
    data = open(os.path.join(gsm8k_dir, "test.jsonl"), "rb").read()
    monkeypatch.setattr(gsm8k.urllib.request, "urlopen", lambda url, timeout: Response(data))
    previous = os.umask(0o022)
    try:
        gsm8k.download("test", str(tmp_path / "test.jsonl"), "https://example.invalid/test.jsonl")
    finally:
        os.umask(previous)
    assert (tmp_path / "test.jsonl").read_bytes() == data and (tmp_path / "test.jsonl").stat().st_mode & 0o777 == 0o644


def test_sort_scores_the_exact_match_as_a_term_of_its_own():
    # --reward-weights exact=1: a reward only for a fully sorted reply, where RL from random weights gets no signal
    from tasks.sort import Sort
    task = Sort("train")
    problem = task[0]
    answer = problem["messages"][-1]["content"]
    assert task.reward_parts(problem, answer) == {"reward": 1.0, "exact": 1.0}
    assert task.reward_parts(problem, answer[:-1] + "x") == {"reward": 0.8, "exact": 0.0}


def test_the_longest_prompt_of_a_huge_task_reads_its_first_10000_examples_alone():
    # the memory plan's bound: a task of a million examples is not rendered whole at each run's start
    from tasks import Task
    read = []

    class Huge(Task):
        def __len__(self):
            return 10 ** 6

        def example(self, index):
            read.append(index)
            return {"messages": [{"role": "user", "content": "x" * (index % 7)}, {"role": "assistant", "content": ""}]}
    assert Huge().longest_prompt(TOK) == 4 + 6 and read == list(range(10_000))
