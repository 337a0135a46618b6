"""Your own tasks: a JSONL file graded by a rule (number, exact, choice), a Python task class, tasks watched with
--eval-task, and one line for every bad input."""
import json
import os
import random
import sys
from fractions import Fraction

import pytest

import grpo
from conftest import ROOT
from tasks import build, task_name
from tasks.jsonl import JSONLTask, answer_letter, grade, read_letter, read_number


@pytest.mark.parametrize("reply,answer,correct", [
    ("#### 1,000", "1000", True), ("3.50", "#### 3.5", True), ("-2", "2", False), ("so it is 12.", "12", True),
    ("first 3 then 4", "4", True), ("#### 4\nor 5", "4", True),  # the #### answer wins over the last number
    ("no number at all", "7", False), ("", "7", False), ("#### $18.00", "18", True), ("2 + 2 = 4", "#### 4", True),
    # rationals, compared exactly: a fraction is not its numerator
    ("#### 1/3", "#### 1/2", False), ("#### 3/4", "#### 3/8", False), ("#### 0.5", "#### 1/2", True),
    ("#### 6/16", "0.375", True), ("#### 3", "3/8", False), ("x = 1 / 2", "0.5", True), ("#### 1/0", "0", False),
    # a minus is a sign only where a number starts; the Unicode minus and full-width digits read as ASCII
    ("x = 10-5", "-5", False), ("x = 10-5", "5", True), ("10 - 5 = 5", "5", True), ("it is (-3)", "-3", True),
    ("#### \u22124", "-4", True), ("#### \uff14\uff12", "42", True), ("#### \uff0d7", "-7", True),
    # thousands separators only in groups of three; "%" ignored; a trailing full stop ends a sentence
    ("#### 12,345,678", "12345678", True), ("#### 1,00", "100", False), ("50%", "50", True), ("it is 8.", "8", True),
    # as a reader reads them: a superscript is no digit; vulgar fractions and mixed numbers are rationals; the en
    # and figure dashes are minus signs where a number starts; spaces between groups of three digits; exponents
    ("the area is 12 m\u00b2", "12", True), ("7 km\u00b2", "2", False), ("#### 3\u00bd", "7/2", True),
    ("#### 2\u2153", "21/3", False), ("\u00bd", "0.5", True), ("#### 1 1/2", "1.5", True), ("1 1/2", "1/2", False),
    ("#### \u20135", "-5", True), ("#### \u20125", "-5", True), ("it is \u20135", "5", False),
    ("#### 1 000 000", "1000000", True), ("#### 1\u202f000", "1000", True), ("#### 1.5e-3", "0.0015", True),
    ("#### 1e3", "1000", True),
])
def test_the_number_grader(reply, answer, correct):
    assert grade("number", reply, answer, [])[0] is correct


@pytest.mark.parametrize("reply,answer,correct", [
    ("  Paris ", "paris", True), ("PARIS", "Paris", True), ("Paris.", "Paris", False), ("", "Paris", False),
])
def test_the_exact_grader(reply, answer, correct):
    assert grade("exact", reply, answer, [])[0] is correct


CHOICES = ["red", "green", "blue"]


@pytest.mark.parametrize("reply,letter", [
    ("B", "B"), ("(B)", "B"), ("The answer is B.", "B"), ("A good guess: B", "B"), ("B.", "B"),
    ("I think it is (C)", "C"), ("D", None), ("no idea", None), ("", None),
    # a letter the reply commits to is its answer, also one past the choices (wrong), whatever else it names
    ("the answer is D, or A", "D"), ("The answer is D. Not A or B.", "D"), ("(D)", "D"),
    # after "answer", and before "is", "A" is the letter, not the article
    ("A is correct.", "A"), ("The answer is A because 3 < 9", "A"), ("A is the largest", "A"),
    ("Answer: A is right", "A"),
    # "A" / "I" used as a word never commits, nor does a lower-case letter but standing alone after "answer"
    ("answer: c", "C"), ("The answer is a tricky one; I pick (C).", "C"), ("A cat sat", None), ("I see", None),
    ("**C**", "C"), ("Answer: **B**", "B"), ("The answer is B because it is green", "B"), ("blue", "C"),
    ("(A) is wrong, so (B)", "B"), ("Green.", "B"),
])
def test_the_choice_grader_reads_the_letter_a_reply_commits_to(reply, letter):
    assert read_letter(reply, CHOICES) == letter
    assert grade("choice", reply, "B", CHOICES) == (letter == "B", letter is not None)


@pytest.mark.parametrize("reply,letter", [
    # a reply that commits, then explains: its first commitment wins over the letters of the explanation
    ("**Answer:** B. A is smaller.", "B"), ("B is correct because A is too small.", "B"),
    ("The answer is B. Answer A is wrong because 3 < 9.", "B"), ("Option B. Options A and C are smaller.", "B"),
    ("answer: b", "B"), ("I'd go with C. A and B are both smaller.", "C"),
    ("B\nA is 3 and C is 5, so both are smaller.", "B"), ("The correct option is C; B is close but smaller.", "C"),
    ("**B** is correct; (A) is too small.", "B"), ("ANSWER: C. B is 9 and A is 3.", "C"), ("It is B, not A.", "B"),
    # an opening letter is no commitment where the reply lists the choices or reasons from it
    ("A. 3\nB. 9\nC. 5\nThe largest is B", "B"), ("A is smaller than B, so B", "B"),
])
def test_a_choice_reply_is_read_by_its_first_commitment(reply, letter):
    assert read_letter(reply, CHOICES) == letter


FOUR = ["3", "9", "5", "7"]  # which is largest? B


@pytest.mark.parametrize("reply,letter", [
    # an opening letter and a stop (",", ":", ";", a bracketed value) commits, whatever the explanation names after
    ("B, since A is too small.", "B"), ("B. 9 is larger than A's 3.", "B"), ("B: 9. A: 3.", "B"), ("B; A is 3.", "B"),
    ("Option B (9). Option D is 7.", "B"),
    # in words: a dash after "answer", "I'd say", a lower-case letter before a word after "answer"
    ("Answer \u2014 B. A is less.", "B"), ("I'd say B. Option A is 3.", "B"), ("I would say D. C is 5.", "D"),
    ("answer is b because a is smaller", "B"), ("The answer \u2013 c, since a is 3", "C"),
    # a reply that is one lower-case letter is that choice
    ("b", "B"), ("a", "A"), ("(b)", "B"), ("d.", "D"), ("**c**", "C"),
    # and the other way: a commitment to alternatives commits to none; "I'd" is the pronoun, never the letter I
    ("The answer is B or C.", None), ("I'd go with B or C.", None), ("Answer: B/C", None),
    ("Answer: I'd say so.", None),
])
def test_a_choice_reply_reads_as_a_reader_reads_it(reply, letter):
    assert read_letter(reply, FOUR) == letter


@pytest.mark.parametrize("reply", [
    "A good guess is 5", "A or B, I cannot tell.", "Either B or C.", "B/C", "The answer is not A.",
    "Option A is wrong.", "The answer is a guess.", "I am not sure: a cat cannot be green.", "Not A, nor B.",
])
def test_a_reply_that_names_letters_without_choosing_one_commits_to_none(reply):
    assert read_letter(reply, CHOICES) is None and grade("choice", reply, "B", CHOICES) == (False, False)


def test_a_mixed_number_reads_whole_with_any_space_before_the_fraction():
    # plain, no-break (U+00A0), thin (U+2009) and narrow no-break (U+202F) spaces, one or two, before "½" or "1/2"
    for space in (" ", "\u00a0", "\u2009", "\u202f", "  ", "\t", " \t"):
        assert read_number(f"#### 1{space}\u00bd") == read_number(f"it is 1{space}1/2 cups") == Fraction(3, 2), space
    assert grade("number", "#### 2 \u00be", "2.75", []) == (True, False)
    # a whole part grouped in thousands is a whole part too, marked or not
    assert read_number("1,000 1/2") == read_number("#### 1,000 1/2") == read_number("1 000\t1/2") == Fraction(2001, 2)
    assert read_number("12,345 3/4") == Fraction(49383, 4) and read_number("-1,000 \u00bd") == Fraction(-2001, 2)
    # not a mixed number: a line between them, or an improper fraction (the whole part is a separate number)
    assert read_number("step 1\n\u00bd") == Fraction(1, 2) and read_number("3 4/2") == 2


def test_a_number_too_long_to_read_is_no_number_in_a_reply_and_one_line_in_a_file(tmp_path):
    digits = "9" * 5000  # past the 4,300 digits Python's int reads from text
    assert grade("number", f"#### {digits}", "7", [])[0] is False and read_number(f"so {digits}") is None
    assert read_number(f"{digits} 1/2") is None  # as the whole part of a mixed number too
    # an exponent past 4 digits would build an int of gigabytes ("1e999999999"): no number either
    assert read_number("#### 1e100000") is None and read_number("#### 1e9999") == 10 ** 9999
    path = write_jsonl(tmp_path / "big.jsonl", [f'{{"question": "q", "answer": {digits}}}'] * 2)
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "big", "--task", path))
    text = str(stop.value.code)
    assert text.startswith(f"error: {path} line 1: the answer '9999") and "at most 4,300 digits" in text
    assert "\n" not in text and len(text) < 400 and not os.path.exists(tmp_path / "runs" / "big")
    assert JSONLTask(path, "train", grader="exact", test_path=path).problems[0]["answer"] == digits  # read as text


def test_with_nine_choices_the_word_i_is_not_a_letter():
    nine = [str(n) for n in range(9)]
    assert read_letter("I pick E", nine) == "E" and read_letter("I think so", nine) is None
    assert read_letter("Answer: I", nine) == "I" and read_letter("(I)", nine) == "I"


@pytest.mark.parametrize("answer", ["1 000 000", "12 m\u00b2", "1.5e-3", "3\u00bd", "\u20135"])
def test_a_number_answer_reads_as_one_number(tmp_path, answer):
    task = JSONLTask(write_jsonl(tmp_path / "t.jsonl", [{"question": "q", "answer": answer}] * 2))
    assert read_number(task.problems[0]["answer"]) == read_number("#### " + answer) and read_number(answer) is not None


@pytest.mark.parametrize("row,message", [
    ({"question": "q", "answer": "between 3 and 5"}, r"holds several numbers \(3, 5\)"),
    ({"question": "q", "answer": "1 000 0"}, "holds several numbers"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "4"}], "question": "q"},
     "has both messages and question/answer"),
])
def test_an_answer_the_grader_would_read_ambiguously_is_refused(tmp_path, row, message):
    with pytest.raises(ValueError, match=message):
        JSONLTask(write_jsonl(tmp_path / "t.jsonl", [row] * 2))


def test_a_messages_line_with_choices_shows_them_to_the_model(tmp_path):
    row = {"messages": [{"role": "user", "content": "Which is largest?"}, {"role": "assistant", "content": "B"}],
           "choices": ["3", "9", "5"], "grader": "choice"}
    task = JSONLTask(write_jsonl(tmp_path / "t.jsonl", [row] * 2))
    assert task.problems[0]["messages"][0]["content"] == "Which is largest?\nA. 3\nB. 9\nC. 5"


def test_a_choice_answer_is_a_letter_or_a_choice_text():
    assert [answer_letter(a, CHOICES) for a in ("B", "(c)", "blue", "D", "purple", "AB")] == ["B", "C", "C", None, None,
                                                                                              None]
    assert read_number("#### -0.50") == read_number("-.5")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def largest_of_three(n, seed=0):
    """Multiple-choice problems: which of three numbers is largest."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        numbers = rng.sample(range(10), 3)
        rows.append({"question": "largest?", "choices": [str(x) for x in numbers],
                     "answer": "ABC"[numbers.index(max(numbers))]})
    return rows


def test_a_jsonl_file_loads_with_its_held_out_split_and_per_line_graders(tmp_path):
    rows = [{"question": f"{i} + 1 =", "answer": f"#### {i + 1}"} for i in range(20)]
    rows[3] = {"messages": [{"role": "user", "content": "capital of France?"}, {"role": "assistant",
                                                                                "content": "Paris"}], "grader": "exact"}
    path = write_jsonl(tmp_path / "sums.jsonl", rows + [""])  # a blank last line is fine
    train, test = JSONLTask(path, "train"), JSONLTask(path, "test")
    assert len(train) == 18 and len(test) == 2  # problems 0 and 10 held out
    assert test[1]["messages"][0]["content"] == "10 + 1 =" and train[1]["messages"][0]["content"] == "2 + 1 ="
    assert train.evaluate(train[1], "it is #### 3") and not train.evaluate(train[1], "Paris")
    assert train.reward_parts(train[1], "3") == {"correct": 1.0, "format": 0.0}  # no #### line: no format
    exact = train[2]  # line 4 names its own grader
    assert train.evaluate(exact, " paris") and train.reward_parts(exact, "paris") == {"correct": 1.0, "format": 1.0}
    choice = write_jsonl(tmp_path / "mc.jsonl", largest_of_three(5))
    task = JSONLTask(choice, "train", grader="choice", test_path=choice)
    assert len(task) == 5 and "\nA. " in task[0]["messages"][0]["content"]
    assert task_name(path) == "sums" and task_name("my.module:Arith") == "arith" and task_name("x/y.py:Z") == "z"


def base_flags(tmp_path, name, *extra):
    return ["--demo", "--algo", "grpo", "--runs-dir", str(tmp_path / "runs"), "--run-name", name, "--num-steps", "3",
            "--prompts-per-step", "8", "--num-samples", "4", "--eval-every", "3", "--eval-examples", "8",
            "--save-every", "3", "--no-plot", *extra]


TASK_FILE = '''
from tasks import Task
from tasks.sort import Sort


class Reverse(Task):
    """Reverse three digits: a task of the user's own, in their own file."""
    def __init__(self, split):
        self.sort = Sort(split, length=3)

    @classmethod
    def from_flags(cls, split, args):
        return cls(split)

    def __len__(self):
        return 64 if self.sort.split == "test" else 1000

    def example(self, index):
        digits = self.sort[index]["messages"][0]["content"]
        return {"messages": [{"role": "user", "content": digits}, {"role": "assistant", "content": digits[::-1]}]}

    def reward(self, conversation, reply_text):
        return float(reply_text.strip() == conversation["messages"][1]["content"])

    def evaluate(self, conversation, reply_text):
        return self.reward(conversation, reply_text) == 1.0

    def eval_metrics(self, conversation, reply_text):
        return {"exact": self.reward(conversation, reply_text)}

    @staticmethod
    def default_num_steps(args):
        return 100
'''
HUGE_TASK_FILE = TASK_FILE.replace("else 1000", "else 10 ** 6")  # a million examples; the plan reads 10,000 of them


def test_a_jsonl_task_and_a_python_task_train_and_a_watched_task_is_logged_and_compared(tmp_path, capsys):
    mc = write_jsonl(tmp_path / "largest.jsonl", largest_of_three(40))
    (tmp_path / "reverse.py").write_text(HUGE_TASK_FILE)
    grpo.main(base_flags(tmp_path, "mc", "--task", mc, "--grader", "choice", "--eval-task", "sort"))
    grpo.main(base_flags(tmp_path, "py", "--task", str(tmp_path / "reverse.py") + ":Reverse", "--eval-task", mc,
                         "--grader", "choice"))
    out = capsys.readouterr().out
    for run, watched, score in (("mc", "sort", "eval_sort_reward"), ("py", "largest", "eval_largest_correct")):
        config = json.load(open(tmp_path / "runs" / run / "config.json"))
        metrics = [json.loads(line) for line in open(tmp_path / "runs" / run / "metrics.jsonl")]
        evals = [m for m in metrics if "eval_reward" in m]
        assert [m["step"] for m in evals] == [0, 3] and all(score in m and f"eval_{watched}_examples" in m
                                                            for m in evals)
        assert [m["step"] for m in metrics if "reward" in m] == [1, 2, 3] and watched in config["scores"]
    py = json.load(open(tmp_path / "runs" / "py" / "config.json"))
    code = py["task_code"][str(tmp_path / "reverse.py") + ":Reverse"]
    assert code["file"] == str(tmp_path / "reverse.py") and len(code["sha256"]) == 64
    assert "eval_sort_reward" in out and "eval_largest_correct" in out  # the step log
    table = grpo.compare_runs([str(tmp_path / "runs" / "mc"), str(tmp_path / "runs" / "py")], str(tmp_path / "c.png"))
    assert table[0][-2:] == ["sort", "largest"] and table[1][-2] is not None and table[2][-1] is not None
    assert table[1][-1] is None and table[2][-2] is None  # each run watched one of the two
    assert [row[table[0].index("task")] for row in table[1:]] == ["largest", "reverse"]


def test_compare_plots_beside_the_runs_or_where_asked_and_says_when_tasks_differ(tmp_path, monkeypatch, capsys):
    mc = write_jsonl(tmp_path / "largest.jsonl", largest_of_three(40))
    grpo.main(base_flags(tmp_path, "mc", "--task", mc, "--grader", "choice", "--num-steps", "1", "--eval-every", "1"))
    grpo.main(base_flags(tmp_path, "sorting", "--num-steps", "1", "--eval-every", "1"))
    plots = []
    monkeypatch.setattr(grpo, "plot_runs", lambda names, runs, watched, episodes, own, path: plots.append(path))
    capsys.readouterr()
    runs = [str(tmp_path / "runs" / "mc"), str(tmp_path / "runs" / "sorting")]
    table = grpo.main(["--compare", *runs])
    grpo.main(["--compare", *runs, "--compare-out", str(tmp_path / "mine.png")])
    assert plots == [str(tmp_path / "runs" / "compare.png"), str(tmp_path / "mine.png")]  # not ./runs/compare.png
    assert [row[1] for row in table[1:]] == ["largest", "sort"]
    out = capsys.readouterr().out
    assert "largest eval_correct, sort eval_reward" in out and "trained on 2 tasks (largest, sort)" in out


def test_a_resumed_run_refuses_a_changed_task_file_or_task_code(tmp_path, run_killed_after_first_save):
    mc = write_jsonl(tmp_path / "largest.jsonl", largest_of_three(40))
    flags = base_flags(tmp_path, "mc", "--task", mc, "--grader", "choice", "--save-every", "1")
    run_killed_after_first_save(flags)
    write_jsonl(tmp_path / "largest.jsonl", largest_of_three(40, seed=1))
    with pytest.raises(SystemExit) as stop:
        grpo.main(flags + ["--resume"])
    assert str(stop.value.code).startswith("error: --resume: the run's train data (--task) changed")
    (tmp_path / "reverse.py").write_text(TASK_FILE)
    flags = base_flags(tmp_path, "py", "--task", str(tmp_path / "reverse.py") + ":Reverse", "--save-every", "1")
    run_killed_after_first_save(flags)
    (tmp_path / "reverse.py").write_text(TASK_FILE.replace("return 64", "return 65"))
    with pytest.raises(SystemExit) as stop:
        grpo.main(flags + ["--resume"])
    assert str(stop.value.code).startswith(f"error: --resume: the run's task code {tmp_path / 'reverse.py'}:Reverse "
                                           "changed")


BAD_FILES = [
    ("not-json", ['{"question": "1+1", "answer": "2"}', "{question: 1}"], "line 2 is not JSON"),
    ("missing-field", [{"question": "1+1"}], "line 1: the field 'answer' is missing or empty"),
    ("empty-field", [{"question": "", "answer": "2"}], "line 1: the field 'question' is missing or empty"),
    ("empty-file", [], "holds no problem"),
    ("no-number", [{"question": "1+1", "answer": "two"}], "line 1: the answer 'two' has no number"),
    ("bad-letter", [{"question": "?", "choices": ["a", "b"], "answer": "C", "grader": "choice"}],
     "line 1: the answer 'C' is not the letter of one of its 2 choices"),
    ("no-choices", [{"question": "?", "answer": "A", "grader": "choice"}], "is not the letter of one of its 0"),
    ("bad-grader", [{"question": "?", "answer": "1", "grader": "fuzzy"}], "grader 'fuzzy' is not one of"),
    ("bad-messages", [{"messages": [{"role": "assistant", "content": "hi"}]}], "line 1: messages must be"),
    ("not-an-object", ["[1, 2]"], "line 1 is not a JSON object"),
]


@pytest.mark.parametrize("name,rows,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_task_file_is_one_line_naming_the_file_and_line(name, rows, message, tmp_path, capsys):
    path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, name, "--task", path))
    text = str(stop.value.code)
    assert text.startswith(f"error: {path}") and message in text and "\n" not in text
    assert not os.path.exists(tmp_path / "runs" / name)  # a failed start leaves no folder behind
    assert "configuration:" not in capsys.readouterr().out  # the error is not buried under the configuration


def test_files_as_people_write_them(tmp_path):
    # numbers as JSON numbers, a byte-order mark (Windows editors), a system message (rendered as nanochat does:
    # folded into the first user message)
    rows = [{"question": "1/2 + 1/4 =", "answer": 0.75}, {"question": "2 + 2 =", "answer": 4},
            {"question": "big", "answer": 1e3}, {"question": "exact", "answer": 7, "grader": "exact"},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 4?"},
                          {"role": "assistant", "content": "#### 7"}]}]
    path = tmp_path / "bom.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines[2] = '{"question": "big", "answer": 1e3}'
    path.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\n" for line in lines).encode())
    task = JSONLTask(str(path), "train", test_path=str(path))
    assert [p["answer"] for p in task.problems] == ["0.75", "4", "1000", "7", "#### 7"]
    assert task.evaluate(task[0], "#### 3/4") and task.evaluate(task[2], "#### 1,000") and not task.evaluate(
        task[1], "#### 4.5")
    assert task.evaluate(task[3], " 7 ") and task.evaluate(task[4], "so #### 7")
    from model import Tokenizer
    tokenizer = Tokenizer.byte_level()
    system = tokenizer.render_for_completion(task[4])
    folded = tokenizer.render_for_completion({"messages": [{"role": "user", "content": "Be brief.\n\n3 + 4?"}]})
    assert system == folded


@pytest.mark.parametrize("line,message", [
    ("[" * 100_000 + "]" * 100_000, "line 2 nests brackets too deeply to read"),
    ('{"question": "?", "answer": true}', "line 2: the field 'answer' is missing or empty"),
    ('{"question": "?", "answer": NaN}', "line 2: the field 'answer' is missing or empty"),
    ('{"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": "?"}]}',
     "line 2: messages must be"),
], ids=["nested-100000-deep", "boolean-answer", "nan-answer", "system-and-user-only"])
def test_a_deeply_nested_or_odd_line_is_one_line_naming_the_file_and_line(line, message, tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": "1 + 1", "answer": 2}, line])
    with pytest.raises(ValueError) as error:
        JSONLTask(path, "train")
    assert str(error.value).startswith(f"{path} {message}") and "\n" not in str(error.value)


def test_a_watched_file_is_evaluated_whole(tmp_path, capsys):
    quiz = write_jsonl(tmp_path / "quiz.jsonl", [{"question": f"{i} + 1 =", "answer": i + 1} for i in range(25)])
    grpo.main(base_flags(tmp_path, "w", "--eval-task", quiz, "--num-steps", "1", "--eval-every", "1",
                         "--eval-examples", "100", "--final-eval-examples", "100"))
    evals = [m for m in map(json.loads, open(tmp_path / "runs" / "w" / "metrics.jsonl")) if "eval_reward" in m]
    assert all(m["eval_quiz_examples"] == 25 for m in evals)  # all of it, not every 10th problem (3)
    assert "watched: quiz, 25 problems (the whole file)" in capsys.readouterr().out


def test_a_task_file_that_is_not_utf8_or_not_there(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "1+1", "answer": "2"}\n{"question": "caf\xe9", "answer": "3"}\n')
    for argv, message in ((["--task", str(path)], f"error: {path} line 2 is not UTF-8 text"),
                          (["--task", str(tmp_path / "none.jsonl")], "error: cannot read the task file")):
        with pytest.raises(SystemExit) as stop:
            grpo.main(base_flags(tmp_path, "x", *argv))
        assert str(stop.value.code).startswith(message)


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_here:Task", "the module no_such_module_here of --task could not be imported (ModuleNotFoundError"),
    ("{dir}/missing.py:Task", "the file {dir}/missing.py does not exist: check the path in --task"),
    ("{dir}/broken.py:Task", "could not be imported (SyntaxError"),
    ("{dir}/plain.py:NotThere", "has no NotThere"),
    ("{dir}/plain.py:Plain", "is not a task: it lacks from_flags, reward"),
    ("sorting", "names no task"),
])
@pytest.mark.parametrize("flag", ["--task", "--eval-task"])
def test_a_python_task_that_cannot_be_used_is_one_line(spec, message, flag, tmp_path):
    (tmp_path / "broken.py").write_text("def (:\n")
    (tmp_path / "plain.py").write_text("class Plain:\n    pass\n")
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "x", flag, spec.format(dir=tmp_path)))
    text = str(stop.value.code)
    message = message.replace("--task", flag)  # the flag that named it, where a message names one
    assert text.startswith("error: ") and message.format(dir=tmp_path) in text and "\n" not in text


def max_of_three(n, seed=0):
    """Problems a tiny model learns from scratch: the largest of three digits, graded by number."""
    rng = random.Random(seed)
    return [{"question": " ".join(map(str, d)), "answer": str(max(d))}
            for d in ([rng.randrange(10) for _ in range(3)] for _ in range(n))]


def readme_own_task_commands():
    """The README's own-task commands, each as grpo.py's arguments (a command continued with a backslash joined)."""
    from test_docs import commands, grpo_argv
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    start = lines.index("## Your own task") + 1
    end = next(n for n in range(start, len(lines)) if lines[n].startswith("## ")) + 1
    return [grpo_argv(command) for number, command in commands(os.path.join(ROOT, "README.md"))
            if start < number < end and not command.startswith("python grpo.py --compare")]


def files_named(argv):
    """The files a command's task and grader flags name: a .jsonl file, or the file of path/to/file.py:name."""
    values = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word in ("--task", "--task-test", "--eval-task",
                                                                            "--grader")]
    return [v if v.endswith(".jsonl") else v.rpartition(":")[0] for v in values
            if v.endswith(".jsonl") or v.rpartition(":")[0].endswith(".py")]


def test_the_readmes_own_task_commands_run_as_written_on_the_files_that_ship(tmp_path, monkeypatch):
    # As the README says, from the repository's folder: its example task file and grader ship with the repository,
    # and every own-task command runs on them (shortened to 1 tiny step, its run folder under tmp_path): from
    # scratch on the CPU (--demo), with the grader function, and from a nanochat checkpoint (the newest chat one
    # under $NANOCHAT_BASE_DIR)
    from test_generations import FIXTURES
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # importing the grader writes no __pycache__ into docs/
    argvs = readme_own_task_commands()
    named = {path for argv in argvs for path in files_named(argv)}
    assert {"docs/examples/max3.jsonl", "docs/examples/max3_grader.py"} <= named
    assert all(os.path.isfile(os.path.join(ROOT, path)) for path in named), named
    scratch = [argv for argv in argvs if "--demo" in argv]
    checkpoint = [argv for argv in argvs if "--demo" not in argv]
    assert len(scratch) == 5 and len(checkpoint) == 1 and "--init" not in checkpoint[0]  # 3: episodes
    short = ["--num-steps", "1", "--prompts-per-step", "4", "--num-samples", "4", "--max-new-tokens", "6",
             "--eval-every", "2", "--eval-examples", "4", "--final-eval-examples", "4", "--save-every", "0",
             "--eval-max-new-tokens", "6", "--runs-dir", str(tmp_path / "runs"), "--no-plot"]
    for argv in scratch:  # in order: the grader function's run goes on from the first run (--init runs/...)
        grpo.main([str(tmp_path / word) if word.startswith("runs/") else word for word in argv] + short)
    assert sorted(os.listdir(tmp_path / "runs")) == ["demo-guessdigit-grpo-seed0", "demo-max3-grpo-seed0",
                                                     "max3-own-grader", "pick", "pick-retries"]
    for run in ("demo-max3-grpo-seed0", "max3-own-grader"):
        assert os.path.isfile(tmp_path / "runs" / run / "metrics.jsonl")
    config = json.load(open(tmp_path / "runs" / "max3-own-grader" / "config.json"))
    assert config["grader"] == "docs/examples/max3_grader.py:largest"
    assert grpo.resolve_config(["--demo"]).run_name == "demo-grpo-seed0"  # the demo's own run: another folder
    base = os.path.join(FIXTURES, "smear-backout", "base")
    if not os.path.isdir(base):
        pytest.skip("nanochat fixtures not found (../shared/fixtures/nanochat or $NANOGRPO_FIXTURES)")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base)
    grpo.main(checkpoint[0] + short + ["--pass-k", "0"])
    assert os.path.isfile(tmp_path / "runs" / "max3-reinforce-seed0" / "metrics.jsonl")


def test_the_example_grader_rewards_the_digit_alone(monkeypatch):
    # docs/examples' task and grader as a run loads them: the digit, with spaces or line breaks around it, is right;
    # padding of any other kind (the control characters str.strip() would remove, a full stop) is not
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    task = JSONLTask("docs/examples/max3.jsonl", "train", grader="docs/examples/max3_grader.py:largest")
    problem = next(task[i] for i in range(len(task)) if task[i]["answer"] == "9")
    for reply, correct in [("9", 1.0), (" 9\n", 1.0), ("9\x1f", 0.0), ("\x1c9", 0.0), ("9.", 0.0), ("8", 0.0),
                           ("", 0.0), ("99", 0.0)]:
        assert task.reward_parts(problem, reply)["correct"] == correct, reply
    assert len(task) == 900 and len(JSONLTask("docs/examples/max3.jsonl", "test")) == 100


@pytest.mark.slow  # a measurement, 8 s on 2 cores: outside the 2-minute suite (pytest --slow)
def test_a_jsonl_task_is_learned_from_scratch(tmp_path):
    # The shortened check of docs/tasks.md's measurement (held-out accuracy 0 -> 0.835-0.98 in 300 steps, 3 seeds):
    # the demo's tiny model learns to answer from the file alone. With 8x the demo's learning rate, 30 steps:
    # 0 -> 0.55, 0 -> 0.475, 0.125 -> 0.425 for seeds 0-2 (trajectories differ between processors, so a margin)
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(400))
    grpo.main(["--demo", "--task", path, "--runs-dir", str(tmp_path / "runs"), "--run-name", "max3", "--num-steps",
               "30", "--eval-every", "30", "--eval-examples", "40", "--final-eval-examples", "40", "--save-every", "0",
               "--log-samples", "0", "--init-lr-frac", "2.0", "--no-plot"])
    evals = [json.loads(line) for line in open(tmp_path / "runs" / "max3" / "metrics.jsonl")]
    evals = [m["eval_correct"] for m in evals if "eval_correct" in m]
    assert evals[0] < 0.2 and evals[-1] >= 0.3, evals


def test_a_flag_that_does_nothing_under_the_settings_gets_a_note(tmp_path, capsys):
    grpo.main(base_flags(tmp_path, "idle", "--algo", "reinforce", "--kl-placement", "reward", "--num-steps", "1",
                         "--eval-every", "0"))
    out = capsys.readouterr().out
    assert "note: --kl-placement does nothing here: the KL's weight is 0 (--kl-coef)" in out
    assert grpo.resolve_config(["--demo", "--algo", "grpo", "--kl-placement", "reward"]).notes == []
    assert out.index("note: --kl-placement") > out.index("memory plan")  # the last lines before the first step


@pytest.mark.parametrize("flags,idle", [
    (["--lr", "1e-4"], "--lr"), (["--optimizer", "adamw", "--matrix-lr", "0.01"], "--matrix-lr"),
    (["--optimizer", "adamw", "--init-lr-frac", "1"], "--init-lr-frac"), (["--lora-lr", "1e-3"], "--lora-lr"),
    (["--lora-rank", "4", "--init", "ckpt", "--optimizer", "adamw"], "--optimizer"),
    (["--lora-rank", "4", "--init", "ckpt", "--lr", "1e-3"], "--lr"),
    (["--rollout-correction-cap", "3"], "--rollout-correction-cap"), (["--max-sampling-rounds", "2"],
                                                                      "--max-sampling-rounds"),
    (["--calculator"], "--calculator"), (["--algo", "sapo", "--clip-eps", "0.1"], "--clip-eps"),
    (["--reward-combination", "normalize-then-sum", "--advantage", "rloo"], "--advantage"),
    (["--algo", "sapo", "--ppo-epochs", "1", "--sapo-tau-neg", "3"], "--sapo-tau-neg"),  # its gate at ratio 1
    # and none where the flag acts
    (["--optimizer", "adamw", "--lr", "1e-4"], None), (["--matrix-lr", "0.01"], None),
    (["--lora-rank", "4", "--init", "ckpt", "--lora-lr", "1e-3"], None), (["--algo", "dapo", "--max-sampling-rounds", "2"], None),
    (["--rollout-correction", "tis", "--rollout-correction-cap", "3"], None),
    (["--algo", "reinforce", "--advantage", "rloo"], None), (["--algo", "sapo", "--sapo-tau-neg", "3"], None),
])
def test_every_flag_that_does_nothing_under_the_settings_is_named(flags, idle):
    notes = grpo.resolve_config(["--demo", *flags]).notes
    assert [note.split()[0] for note in notes] == ([idle] if idle else []), notes


GRADER_FILE = """
def largest(question, reply, answer):
    return float(reply.strip() == answer), float(len(reply.split()) == 1)
"""


def test_a_function_grader_trains_a_jsonl_task_and_a_resume_refuses_it_changed(tmp_path, capsys,
                                                                                run_killed_after_first_save):
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(60))
    (tmp_path / "mygrader.py").write_text(GRADER_FILE)
    spec = f"{tmp_path / 'mygrader.py'}:largest"
    task = JSONLTask(path, "train", grader=spec)
    problem = task[0]
    assert task.reward_parts(problem, problem["answer"]) == {"correct": 1.0, "format": 1.0}
    assert task.evaluate(problem, problem["answer"]) and not task.evaluate(problem, "no")
    flags = base_flags(tmp_path, "own", "--task", path, "--grader", spec, "--save-every", "1",
                       "--reward-weights", "correct=1,format=0.5")
    run_killed_after_first_save(flags)
    config = json.load(open(tmp_path / "runs" / "own" / "config.json"))
    assert config["task_code"][spec]["sha256"] and config["grader"] == spec
    (tmp_path / "mygrader.py").write_text(GRADER_FILE.replace("== 1", "== 2"))
    with pytest.raises(SystemExit) as stop:
        grpo.main(flags + ["--resume"])
    assert str(stop.value.code).startswith(f"error: --resume: the run's task code {spec} changed")
    # a line of the file never names code; an unknown grader is one line
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "?", "answer": "1", "grader": spec}])
    with pytest.raises(ValueError, match="is not one of number, exact, choice"):
        JSONLTask(bad, "train")
    with pytest.raises(SystemExit):
        grpo.resolve_config(["--demo", "--task", path, "--grader", "fuzzy"])
    assert "is none of number, exact, choice" in capsys.readouterr().err


FAILING_GRADERS = """
def not_applicable(question, reply, answer):
    return None  # TRL's "not applicable"

def a_dict(question, reply, answer):
    return {"correct": 1.0}

def raises(question, reply, answer):
    raise KeyError("score")

def not_finite(question, reply, answer):
    return float("nan")

import sys

def exits(question, reply, answer):
    sys.exit(0)

def overflows(question, reply, answer):
    return 10 ** 400

def too_long_to_write(question, reply, answer):
    return 10 ** 5000, 1

class Stop(BaseException):
    pass

def stops(question, reply, answer):
    raise Stop("a BaseException of its own")
"""


@pytest.mark.parametrize("name,said", [
    ("not_applicable", "returned None"), ("a_dict", "returned {'correct': 1.0}"),
    ("raises", "raised KeyError: 'score' (graders.py line "), ("not_finite", "returned nan"),
    ("exits", "called sys.exit(0) (graders.py line "),
    ("overflows", "returned 100000000000"), ("too_long_to_write", "returned a value of type tuple"),
    ("stops", "raised Stop: a BaseException of its own"),
])
def test_a_grader_function_that_fails_stops_the_run_with_one_line(tmp_path, name, said):
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(20))
    (tmp_path / "graders.py").write_text(FAILING_GRADERS)
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, name, "--task", path, "--grader", f"{tmp_path / 'graders.py'}:{name}",
                             "--eval-every", "0", "--num-steps", "1"))
    message = str(stop.value.code)
    assert message.startswith(f"error: --grader ") and f":{name} on the reply " in message and said in message, message
    raised = name in ("raises", "exits", "stops")  # where: the file, line and function it raised in
    assert "\n" not in message and (f", in {name})" in message if raised else "return a finite number" in message)
    # a changed grader does not resume a run (its sha256 is an input), and the run stopped before its first step:
    # its folder goes, so that the same command runs again
    assert message.endswith("The run stopped before its first step, and its files are removed: fix the function, "
                            "then run the command again"), message
    assert not (tmp_path / "runs" / name).exists()


def test_a_grader_function_that_grades_no_line_because_each_names_its_own_is_refused_in_one_line(tmp_path):
    # every line of the file names a grader, which wins over --grader: the run would train on the lines' graders
    # while its configuration names the user's; refused before any work, naming the lines' graders
    rows = [dict(row, grader="exact" if i % 2 else "number") for i, row in enumerate(max_of_three(20))]
    path = write_jsonl(tmp_path / "max3.jsonl", rows)
    (tmp_path / "graders.py").write_text(FAILING_GRADERS)
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "own", "--task", path, "--grader", f"{tmp_path / 'graders.py'}:raises"))
    message = str(stop.value.code)
    assert message == (f"error: --grader {tmp_path / 'graders.py'}:raises grades no problem of {path}: every line "
                       "names its own grader (exact, number), which wins; drop those lines' \"grader\" to grade "
                       "them with yours, or drop --grader")
    rows[3].pop("grader")  # one line left to it: it trains
    write_jsonl(tmp_path / "max3.jsonl", rows)
    task = grpo.build(path, "train", grpo.resolve_config(["--demo", "--task", path, "--grader",
                                                          f"{tmp_path / 'graders.py'}:raises"]))
    assert task.graded_by_flag


NUMPY_GRADERS = """
import numpy as np

def a_float32(question, reply, answer):
    return np.float32(reply.strip() == answer)

def a_bool(question, reply, answer):
    return np.bool_(reply.strip() == answer)

def a_pair(question, reply, answer):
    return np.float64(reply.strip() == answer), np.int64(1)

def a_tensor(question, reply, answer):
    import torch
    return torch.tensor(float(reply.strip() == answer))
"""


@pytest.mark.parametrize("name", ["a_float32", "a_bool", "a_pair", "a_tensor"])
def test_a_grader_function_may_return_numpy_or_torch_scalars(tmp_path, name):
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(20))
    (tmp_path / "graders.py").write_text(NUMPY_GRADERS)
    task = JSONLTask(path, "train", grader=f"{tmp_path / 'graders.py'}:{name}")
    problem = task[0]
    right, wrong = task.reward_parts(problem, problem["answer"]), task.reward_parts(problem, "no")
    assert right["correct"] == 1.0 and wrong["correct"] == 0.0 and task.evaluate(problem, problem["answer"])
    assert all(type(v) is float for v in (*right.values(), *wrong.values()))


CREDIT_GRADERS = """
def credit(question, reply, answer):  # a number: partial credit for every reply, all of it for a right one
    return 0.5 + 0.5 * (reply.strip() == answer)

def near(question, reply, answer):  # partial credit and a verdict of its own
    right = reply.strip() == answer
    return {"reward": 0.5 + 0.5 * right, "correct": right}

def apart(question, reply, answer):  # a verdict apart from the reward: right at a reward under 1
    return {"reward": 0.25, "correct": reply.strip() == answer, "format": 1}

def misspelt(question, reply, answer):
    return {"reward": 1.0, "corect": True}

def half_right(question, reply, answer):
    return {"reward": 1.0, "correct": 0.5}
"""


@pytest.mark.parametrize("name,right,wrong", [("credit", 1.0, 0.5), ("near", 1.0, 0.5), ("apart", 0.25, 0.25)])
def test_a_grader_functions_partial_credit_is_a_reward_and_correct_counts_right_replies(tmp_path, name, right, wrong):
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(20))
    (tmp_path / "graders.py").write_text(CREDIT_GRADERS)
    task = JSONLTask(path, "train", grader=f"{tmp_path / 'graders.py'}:{name}")
    problem = task[0]
    for reply, reward, correct in ((problem["answer"], right, True), ("no", wrong, False)):
        assert task.reward(problem, reply) == reward and task.reward_parts(problem, reply)["correct"] == reward
        assert task.evaluate(problem, reply) is correct  # what pass@k counts
        assert task.eval_metrics(problem, reply) == {"correct": float(correct)}  # eval_correct: the same verdict
    assert task.reward_parts(problem, "no")["format"] == (1.0 if name == "apart" else 0.0)


@pytest.mark.parametrize("name,said", [("misspelt", "'corect': True"), ("half_right", "'correct': 0.5")])
def test_a_grader_functions_dict_names_reward_and_a_verdict_or_is_one_line(tmp_path, name, said):
    from tasks import GraderError
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(20))
    (tmp_path / "graders.py").write_text(CREDIT_GRADERS)
    task = JSONLTask(path, "train", grader=f"{tmp_path / 'graders.py'}:{name}")
    with pytest.raises(GraderError) as error:
        task.reward(task[0], "7")
    message = str(error.value)
    assert said in message and '{"reward": number, "correct": True or False' in message and "\n" not in message


def test_eval_correct_is_the_share_of_right_replies_and_eval_reward_the_mean_credit(tmp_path):
    # a grader that pays half for any reply: a random policy's eval_reward is at least 0.5, its eval_correct the
    # share of its greedy replies that are the answer (before: the mean credit, as eval_reward)
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(40))
    (tmp_path / "graders.py").write_text(CREDIT_GRADERS)
    grpo.main(base_flags(tmp_path, "credit", "--task", path, "--grader", f"{tmp_path / 'graders.py'}:credit",
                         "--num-steps", "1", "--eval-every", "1", "--save-every", "0", "--pass-k", "2"))
    final = [json.loads(line) for line in open(tmp_path / "runs" / "credit" / "metrics.jsonl")][-1]
    replies = [json.loads(line) for line in open(tmp_path / "runs" / "credit" / "evals" / "step_1.jsonl")]
    test = JSONLTask(path, "test")
    right = [r["reply"].strip() == test[r["index"]]["answer"] for r in replies]
    assert [r["correct"] for r in replies] == [float(x) for x in right]
    assert [r["reward"] for r in replies] == [0.5 + 0.5 * x for x in right]
    assert final["eval_correct"] == sum(right) / len(replies) and final["eval_examples"] == len(replies) == 4
    assert final["eval_reward"] == 0.5 + 0.5 * final["eval_correct"] and "eval_pass@2" in final


def test_a_python_task_without_eval_metrics_logs_the_share_of_correct_replies(tmp_path):
    from tasks import OwnTask, task_class
    (tmp_path / "own.py").write_text(TASK_FILE.replace(
        '    def eval_metrics(self, conversation, reply_text):\n        return {"exact": self.reward(conversation, '
        'reply_text)}\n', ""))
    spec = f"{tmp_path / 'own.py'}:Reverse"
    task = OwnTask(task_class(spec)("test"), spec, "test")
    problem = task[0]
    answer = problem["messages"][-1]["content"]
    assert task.eval_metrics(problem, answer) == {"correct": 1.0} and task.evaluate(problem, answer)
    assert task.eval_metrics(problem, "x") == {"correct": 0.0} and not task.evaluate(problem, "x")


def test_a_grader_that_exits_after_a_save_is_one_line_and_the_saved_step_stays(tmp_path):
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(20))
    checkpoints = tmp_path / "runs" / "late" / "chatrl_checkpoints"
    (tmp_path / "late.py").write_text(f"""import glob, sys
def grade(question, reply, answer):
    if glob.glob({str(checkpoints / "*" / "model_*.pt")!r}):
        sys.exit(0)  # from the step after the first save
    return float(reply.strip() == answer)
""")
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "late", "--task", path, "--grader", f"{tmp_path / 'late.py'}:grade",
                             "--eval-every", "0", "--num-steps", "3", "--save-every", "1"))
    message = str(stop.value.code)  # a message, not 0: the process exits with status 1
    assert message.startswith("error: --grader ") and "late.py:grade on the reply " in message and "\n" not in message
    assert "called sys.exit(0) (late.py line 4, in grade)" in message, message
    [checkpoint_dir] = checkpoints.iterdir()
    assert grpo.complete_steps(str(checkpoint_dir)) == [1]
    assert f"The run's newest checkpoint, step 1 in {checkpoint_dir}, is complete" in message


def test_a_grader_that_raises_a_base_exception_is_one_line_and_a_stop_signal_still_stops(tmp_path):
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(20))
    (tmp_path / "graders.py").write_text(FAILING_GRADERS + """
import os, signal, time

def interrupted(question, reply, answer):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the grader runs (--no-save-on-stop: a stop at once)
    time.sleep(5)
""")
    # the function's own BaseException is its error; a stop signal is the run's stop, with the stop's line
    for name, said in (("stops", f"error: --grader {tmp_path / 'graders.py'}:stops on the reply "),
                       ("interrupted", "error: stopped by SIGINT")):
        with pytest.raises(SystemExit) as stop:
            grpo.main(base_flags(tmp_path, name, "--task", path, "--grader", f"{tmp_path / 'graders.py'}:{name}",
                                 "--eval-every", "1", "--num-steps", "1", "--no-save-on-stop"))
        assert str(stop.value.code).startswith(said), stop.value.code


def test_a_grader_or_task_module_that_exits_on_import_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(20))
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    for flag, argv in (("--grader", ["--task", path, "--grader", f"{tmp_path / 'exits.py'}:grade"]),
                       ("--task", ["--task", f"{tmp_path / 'exits.py'}:Task"])):
        with pytest.raises(SystemExit) as stop:
            grpo.main(base_flags(tmp_path, "x", *argv))
        assert str(stop.value.code) == f"error: the module {tmp_path / 'exits.py'} of {flag} could not be imported " \
                                       "(SystemExit: 0)"


MISBEHAVING_TASKS = TASK_FILE + """
import sys

import numpy as np


class Exits(Reverse):
    def reward(self, conversation, reply_text):
        sys.exit(0)


class Overflows(Reverse):
    def reward(self, conversation, reply_text):
        return 10 ** 400


class Raises(Reverse):
    def reward(self, conversation, reply_text):
        raise KeyError("digits")


class NoVerdict(Reverse):
    def evaluate(self, conversation, reply_text):
        return None


class ExitsOnStart(Reverse):
    @classmethod
    def from_flags(cls, split, args):
        sys.exit(3)


class Numpy(Reverse):  # its reward a numpy float, so its verdict a numpy bool and its metric a numpy float: accepted
    def reward(self, conversation, reply_text):
        return np.float32(super().reward(conversation, reply_text))
"""


@pytest.mark.parametrize("name,said", [
    ("Exits", "reward_parts on the reply {reply} called sys.exit(0) (own.py line {line}, in reward): it must return"),
    ("Overflows", "reward_parts on the reply {reply} returned {{'reward': 1000000"),
    ("Raises", "reward_parts on the reply {reply} raised KeyError: 'digits' (own.py line {line}, in reward)"),
    ("NoVerdict", "evaluate on the reply {reply} returned None: return True for a correct reply, else False"),
    ("ExitsOnStart", "from_flags('train') called sys.exit(3) (own.py line {line}, in from_flags)"),
])
def test_a_python_task_that_misbehaves_is_one_line(tmp_path, name, said):
    (tmp_path / "own.py").write_text(MISBEHAVING_TASKS)
    spec = f"{tmp_path / 'own.py'}:{name}"
    line = 1 + MISBEHAVING_TASKS.split("\n").index(f"class {name}(Reverse):") + 2 + (name == "ExitsOnStart")
    evals = ["--eval-every", "1", "--eval-examples", "2", "--pass-k", "1"] if name == "NoVerdict" else [
        "--eval-every", "0"]  # the eval's pass@k asks for verdicts
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, name, "--task", spec, "--num-steps", "1", *evals))
    message = str(stop.value.code)
    head, _, rest = message.partition(" on the reply ")
    reply = rest.split(" ")[0] if rest else ""
    assert message.startswith(f"error: --task {spec}: ") and "\n" not in message, message
    assert said.format(reply=reply, line=line) in message, message


def test_a_python_task_may_grade_with_numpy_scalars(tmp_path):
    (tmp_path / "own.py").write_text(MISBEHAVING_TASKS)
    grpo.main(base_flags(tmp_path, "np", "--task", f"{tmp_path / 'own.py'}:Numpy", "--eval-every", "1",
                         "--num-steps", "1", "--eval-examples", "4", "--final-eval-examples", "4", "--pass-k", "2"))
    evals = [m for m in map(json.loads, open(tmp_path / "runs" / "np" / "metrics.jsonl")) if "eval_exact" in m]
    replies = [json.loads(line) for line in open(tmp_path / "runs" / "np" / "evals" / "step_1.jsonl")]
    assert len(evals) == 2 and all(type(r["exact"]) is float for r in replies) and len(replies) == 4


def test_a_missing_grader_file_names_the_flag(tmp_path):
    path = write_jsonl(tmp_path / "max3.jsonl", max_of_three(20))
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "x", "--task", path, "--grader", f"{tmp_path / 'nowhere.py'}:fn"))
    assert str(stop.value.code).endswith("nowhere.py does not exist: check the path in --grader"), stop.value.code


# A task's every other method the trainer calls, misbehaving: each "class" line below is a class of OTHER_METHODS
OTHER_METHODS = TASK_FILE + """
import os
import signal
import sys
import time

import numpy as np


class Stop(BaseException):
    pass


class LengthText(Reverse):
    def __len__(self):
        return "64"


class LengthPastAnIndex(Reverse):
    def __len__(self):
        return 10 ** 400


class NoTestExamples(Reverse):
    def __len__(self):
        return 0 if self.sort.split == "test" else 10 ** 6


class LengthExits(Reverse):
    def __len__(self):
        sys.exit(0)


class ExampleStops(Reverse):
    def example(self, index):
        raise Stop("a BaseException of its own")


class ExampleText(Reverse):
    def example(self, index):
        return {"messages": "3 1 2"}


class ExampleAnswerFirst(Reverse):
    def example(self, index):
        return {"messages": [{"role": "assistant", "content": "2 1 3"}, {"role": "user", "content": "3 1 2"}]}


class ExampleNumbers(Reverse):
    def example(self, index):
        return {"messages": [{"role": "user", "content": 312}, {"role": "assistant", "content": "213"}]}


class ItemRaises(Reverse):
    def __getitem__(self, index):
        raise IndexError(index)


class FingerprintBytes(Reverse):
    def fingerprint(self):
        return b"\\x00" * 32


class FingerprintExits(Reverse):
    def fingerprint(self):
        sys.exit("no data")


class PromptText(Reverse):
    def longest_prompt(self, tokenizer):
        return "10"


class PromptRaises(Reverse):
    def longest_prompt(self, tokenizer):
        raise OverflowError("too long")


class ExampleInterrupted(Reverse):
    def example(self, index):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the task's code runs: the run's stop, not its error
        time.sleep(5)


class StepsExit(Reverse):
    @staticmethod
    def default_num_steps(args):
        sys.exit(0)


class StepsStop(Reverse):
    @staticmethod
    def default_num_steps(args):
        raise Stop("no steps")


class StepsHalf(Reverse):
    @staticmethod
    def default_num_steps(args):
        return 2.5


class StepsPastAnIndex(Reverse):
    @staticmethod
    def default_num_steps(args):
        return 10 ** 400


class NumpyCounts(Reverse):  # numpy's ints: accepted as the ints they hold
    def __len__(self):
        return np.int64(super().__len__())

    def longest_prompt(self, tokenizer):
        return np.int32(9)

    @staticmethod
    def default_num_steps(args):
        return np.int64(7)
"""


@pytest.mark.parametrize("name,said", [
    ("LengthText", "__len__() of its train split returned '64': return the number of examples, an int from 1 to "),
    ("LengthPastAnIndex", "__len__() of its train split returned 100000"),
    ("NoTestExamples", "__len__() of its test split returned 0: return the number of examples"),
    ("LengthExits", "__len__() of its train split called sys.exit(0) (own.py line {line}, in __len__): it must "),
    ("ExampleStops", "example(0) of its train split raised Stop: a BaseException of its own (own.py line {line}, "
                     "in example)"),
    ("ExampleText", "example(0) of its train split returned {{'messages': '3 1 2'}}: not a dict with a non-empty "
                    "list of messages; return a conversation "),
    ("ExampleAnswerFirst", "example(0) of its train split returned {{'messages': [{{'role': 'assistant'"),
    ("ExampleNumbers", "message 0's content is not text; return a conversation"),
    ("ItemRaises", "__getitem__(0) of its train split raised IndexError: 0 (own.py line {line}, in __getitem__)"),
    ("FingerprintBytes", "fingerprint() of its train split returned b'\\x00\\x00"),
    ("FingerprintExits", "fingerprint() of its train split called sys.exit('no data') (own.py line {line}, "),
    ("PromptText", "longest_prompt(tokenizer) of its train split returned '10': return the longest prompt's length "
                   "in tokens, an int from 1 to "),
    ("PromptRaises", "longest_prompt(tokenizer) of its train split raised OverflowError: too long (own.py line "),
])
def test_every_other_method_of_a_python_task_that_misbehaves_is_one_line(tmp_path, name, said, capsys):
    # its length, examples, fingerprint and longest prompt: what raises anything (sys.exit, a BaseException of its
    # own) or returns the wrong kind is one line naming the method, its split and where it raised; nothing written
    (tmp_path / "own.py").write_text(OTHER_METHODS)
    spec = f"{tmp_path / 'own.py'}:{name}"
    line = 1 + OTHER_METHODS.split("\n").index(f"class {name}(Reverse):") + 2
    flag = "--eval-task" if name == "NoTestExamples" else "--task"  # a watched task: its test split, counted at start
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, name, flag, spec, "--num-steps", "1", "--eval-every", "0"))
    message, printed = str(stop.value.code), capsys.readouterr()
    assert message.startswith(f"error: --task {spec}: ") and "\n" not in message, message
    assert said.format(line=line) in message, message
    assert "Nothing of this run was written yet" in message and "Traceback" not in printed.out + printed.err
    assert not os.path.exists(tmp_path / "runs" / name / "metrics.jsonl")


@pytest.mark.parametrize("name,said", [
    ("StepsExit", "default_num_steps(args) called sys.exit(0) (own.py line {line}, in default_num_steps)"),
    ("StepsStop", "default_num_steps(args) raised Stop: no steps (own.py line {line}, in default_num_steps)"),
    ("StepsHalf", "default_num_steps(args) returned 2.5: return a number of steps (or None: one epoch), an int "),
    ("StepsPastAnIndex", "default_num_steps(args) returned 1000"),
])
def test_a_python_tasks_default_number_of_steps_that_misbehaves_is_one_line(tmp_path, name, said):
    # asked while the flags are read (no --num-steps, no --demo), before any work
    (tmp_path / "own.py").write_text(OTHER_METHODS)
    spec = f"{tmp_path / 'own.py'}:{name}"
    line = 1 + OTHER_METHODS.split("\n").index(f"class {name}(Reverse):") + 3
    with pytest.raises(SystemExit) as stop:
        grpo.resolve_config(["--init", "scratch", "--task", spec])
    message = str(stop.value.code)
    assert message.startswith(f"error: --task {spec}: ") and said.format(line=line) in message, message
    assert "\n" not in message


def test_a_python_task_may_count_with_numpy_ints_and_a_stop_signal_in_its_code_stops_the_run(tmp_path):
    (tmp_path / "own.py").write_text(OTHER_METHODS)
    spec = f"{tmp_path / 'own.py'}:NumpyCounts"
    assert grpo.resolve_config(["--init", "scratch", "--task", spec]).num_steps == 7
    train, test = (build(spec, split, None) for split in ("train", "test"))
    assert (len(train), len(test), test.longest_prompt(None)) == (1000, 64, 9)
    assert type(test.longest_prompt(None)) is int and test[3] == train.task.__class__("test").example(3)
    with pytest.raises(SystemExit) as stop:  # --no-save-on-stop: a stop at once, in the code of the task
        grpo.main(base_flags(tmp_path, "stop", "--task", f"{tmp_path / 'own.py'}:ExampleInterrupted",
                             "--num-steps", "1", "--no-save-on-stop"))
    assert str(stop.value.code).startswith("error: stopped by SIGINT"), stop.value.code


def test_a_task_whose_examples_fail_mid_run_keeps_the_saved_step(tmp_path):
    checkpoints = tmp_path / "runs" / "late" / "chatrl_checkpoints"
    (tmp_path / "late.py").write_text(TASK_FILE + f"""
import glob


class Late(Reverse):
    def example(self, index):
        if glob.glob({str(checkpoints / "*" / "model_*.pt")!r}):
            return {{"messages": [{{"role": "user"}}]}}  # from the step after the first save: no content
        return super().example(index)
""")
    spec = f"{tmp_path / 'late.py'}:Late"
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "late", "--task", spec, "--eval-every", "0", "--num-steps", "3",
                             "--save-every", "1"))
    message = str(stop.value.code)
    assert message.startswith(f"error: --task {spec}: example(") and "\n" not in message, message
    assert "of its train split returned {'messages': [{'role': 'user'}]}: message 0's content is not text" in message
    [checkpoint_dir] = checkpoints.iterdir()
    assert grpo.complete_steps(str(checkpoint_dir)) == [1]
    assert f"The run's newest checkpoint, step 1 in {checkpoint_dir}, is complete and unchanged" in message, message


@pytest.mark.parametrize("body,said", [
    ("class Bare:  # not a subclass of Task: the methods Task would give are its own to write\n"
     "    from_flags = reward = evaluate = eval_metrics = __len__ = __getitem__ = lambda *a: None",
     "is not a task: it lacks tool, respond, score, reward_terms, data_flags, epochs_end, reward_parts, fingerprint, "
     "default_num_steps, longest_prompt (subclass tasks.Task for its defaults"),
    ("class Bare(Reverse):\n    example = None", "is not a task: it lacks example (subclass tasks.Task"),
    ("class Bare(Reverse):\n    reward_terms = ()", "reward_terms is (): give a tuple of the reward terms' names"),
    ("class Bare(Reverse):\n    reward_terms = 'correct'", "reward_terms is 'correct': give a tuple"),
    ("class Bare(Reverse):\n    score = None", "score is None: give the name of the eval metric"),
    ("Bare = Reverse('train')", "is not a task but a Reverse: name a class"),
])
def test_a_python_task_class_without_what_the_trainer_reads_is_one_line(tmp_path, body, said):
    (tmp_path / "bare.py").write_text(TASK_FILE + "\n\n" + body + "\n")
    spec = f"{tmp_path / 'bare.py'}:Bare"
    with pytest.raises(SystemExit) as stop:
        grpo.main(base_flags(tmp_path, "bare", "--task", spec))
    assert str(stop.value.code).startswith(f"error: {spec}") and said in str(stop.value.code), stop.value.code
