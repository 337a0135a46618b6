"""
A task from a JSONL file: one problem per line, graded by a rule the user picks (docs/tasks.md).

A line is {"question": str, "answer": str} (the fields of GSM8K's own files), or {"messages": [...]} in nanochat's
shape (the last assistant message is the answer), optionally with "choices": [str, ...] (a multiple-choice problem:
listed under the question as "A. ...", "B. ...") and "grader": "number" | "exact" | "choice", which wins over
--grader. The file is read as data only: JSON, never code.

Graders, each reading the reply's answer and comparing it with the line's answer:
- number: the number after the first "####" (what nanochat's SFT teaches a model to write), else the last number in
  the reply; compared as numbers: "1,000" = "1000", "3.50" = "3.5", "-2" != "2";
- exact: the reply, trimmed and case-folded, equals the answer trimmed and case-folded;
- choice: the letter the reply commits to ("B", "(B)", "The answer is B.") equals the answer's letter (the answer
  is a letter, "(B)", or the text of one choice).
Train and test: --task-test names a test file; without it every 10th problem of the file (lines 1, 11, 21, ...
counting problems, not blank lines) is held out for the evals.
"""
import decimal
import json
import os
import re

from tasks import Task, file_sha256
from tasks.gsm8k import calculator, ends_with_answer_line

GRADERS = ("number", "exact", "choice")
HELD_OUT_EVERY = 10
NUMBER = r"-?(?:\d[\d,]*)?\.?\d+"
MARKED_NUMBER = re.compile(r"####\s*\$?\s*(" + NUMBER + ")")
ANY_NUMBER = re.compile(NUMBER)
# The explicit ways a reply commits to a letter, most explicit first; else its last standalone capital letter.
COMMITTED_LETTER = [re.compile(r"answer\s*(?:is|:)?\s*:?\s*\(?([A-Z])\b\)?", re.IGNORECASE),
                    re.compile(r"\(([A-Z])\)"), re.compile(r"^\s*([A-Z])\s*[.):]?\s*$")]
STANDALONE_LETTER = re.compile(r"\b([A-Z])\b")


def read_number(text):
    """'... #### 1,000' -> Decimal('1000'); else the last number in the text; None when there is none."""
    match = MARKED_NUMBER.search(text)
    found = match.group(1) if match else (ANY_NUMBER.findall(text) or [None])[-1]
    if found is None:
        return None
    try:
        return decimal.Decimal(found.replace(",", ""))
    except decimal.InvalidOperation:
        return None


def read_letter(text, choices):
    """The letter a reply commits to, among the first len(choices) letters; None when it commits to none."""
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    for pattern in COMMITTED_LETTER:
        match = pattern.search(text)
        if match and match.group(1).upper() in letters:
            return match.group(1).upper()
    standalone = [letter for letter in STANDALONE_LETTER.findall(text) if letter in letters]
    return standalone[-1] if standalone else None


def answer_letter(answer, choices):
    """The reference answer of a multiple-choice line as a letter: "B", "(B)", "b", or one choice's own text."""
    text = answer.strip()
    if text in choices:
        return chr(ord("A") + choices.index(text))
    match = re.fullmatch(r"\(?([A-Za-z])\)?\.?", text)
    letter = match.group(1).upper() if match else None
    return letter if letter is not None and ord(letter) - ord("A") < len(choices) else None


def grade(grader, reply, answer, choices):
    """-> (correct, format): the reply's answer equals the reference; the reply's answer could be read in the shape
    the grader expects (number: a last line "#### <number>", as GSM8K's format term; choice: a committed letter;
    exact: one non-empty line)."""
    if grader == "number":
        got = read_number(reply)
        return got is not None and got == read_number(answer), ends_with_answer_line(reply)
    if grader == "choice":
        got = read_letter(reply, choices)
        return got is not None and got == answer_letter(answer, choices), got is not None
    return reply.strip().casefold() == answer.strip().casefold(), len(reply.strip().splitlines()) == 1


def read_problems(path, grader):
    """path -> [conversation with its answer, choices and grader], every line checked: one ValueError naming the
    file, the line and what to do for the first bad one."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the task file {path} ({e.strerror}): check the path") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line} is not UTF-8 text: save the file as UTF-8") from None
    problems = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where} is not JSON ({e.msg}): one JSON object a line") from None
        problems.append(problem(row, where, grader))
    if not problems:
        raise ValueError(f"{path} holds no problem: one JSON object a line, with question and answer")
    return problems


def problem(row, where, default_grader):
    """One line's JSON object -> the conversation (nanochat's "messages") with its "answer", "choices" and "grader",
    or a ValueError naming what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"{where} is not a JSON object: write {{\"question\": ..., \"answer\": ...}}")
    grader = row.get("grader", default_grader)
    if grader not in GRADERS:
        raise ValueError(f"{where}: grader {grader!r} is not one of {', '.join(GRADERS)}")
    choices = row.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, str) and c.strip() for c in choices) or len(
            choices) > 26:
        raise ValueError(f"{where}: choices must be a list of up to 26 non-empty strings")
    if "messages" in row:
        messages = row["messages"]
        if not (isinstance(messages, list) and len(messages) >= 2 and len(messages) % 2 == 0 and all(
                isinstance(m, dict) and m.get("role") == ("user", "assistant")[i % 2] and isinstance(
                    m.get("content"), str) and m["content"].strip() for i, m in enumerate(messages))):
            raise ValueError(f"{where}: messages must be {{\"role\", \"content\"}} objects with non-empty text, "
                             "user and assistant in turn, the last the assistant's answer")
        answer = messages[-1]["content"]
    else:
        for field in ("question", "answer"):
            if not isinstance(row.get(field), str) or not row[field].strip():
                raise ValueError(f"{where}: the field {field!r} is missing or empty (a line needs question and "
                                 "answer, or messages)")
        question = row["question"] + "".join(f"\n{chr(ord('A') + i)}. {c}" for i, c in enumerate(choices))
        answer = row["answer"]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if grader == "choice" and answer_letter(answer, choices) is None:
        raise ValueError(f"{where}: the answer {answer!r} is not the letter of one of its {len(choices)} choices "
                         "(the choice grader needs choices and an answer such as \"B\")")
    if grader == "number" and read_number(answer) is None:
        raise ValueError(f"{where}: the answer {answer!r} has no number for the number grader (write e.g. "
                         "\"#### 42\", or pick another --grader)")
    return {"messages": messages, "answer": answer, "choices": choices, "grader": grader}


class JSONLTask(Task):
    reward_terms = ("correct", "format")  # format: off unless --reward-weights gives it a weight (as GSM8K's)
    score = "correct"

    def __init__(self, path, split="train", grader="number", test_path=None, tool=False):
        if split not in ("train", "test"):
            raise ValueError(f"a task's split is train or test, got {split!r}")
        self.paths = [path] + ([test_path] if test_path else [])
        problems = read_problems(path if split == "train" or not test_path else test_path, grader)
        if not test_path:
            if len(problems) < 2:
                raise ValueError(f"{path} holds one problem: the evals hold out every {HELD_OUT_EVERY}th, so it "
                                 "needs at least two (or a test file: --task-test)")
            held_out = [i % HELD_OUT_EVERY == 0 for i in range(len(problems))]
            problems = [p for p, out in zip(problems, held_out) if out == (split == "test")]
        self.problems = problems
        self.tool = calculator if tool else None
        self.sha256 = file_sha256(self.paths)

    @classmethod
    def from_flags(cls, split, args, spec=None):
        spec = spec or args.task
        return cls(spec, split, args.grader, args.task_test if spec == args.task else None, args.calculator)

    @staticmethod
    def name(spec):
        return re.sub(r"\W+", "_", os.path.splitext(os.path.basename(spec))[0]).strip("_").lower() or "task"

    def __len__(self):
        return len(self.problems)

    def fingerprint(self):
        return self.sha256

    def example(self, index):
        return self.problems[index]

    def evaluate(self, conversation, reply_text):
        return grade(conversation["grader"], reply_text, conversation["answer"], conversation["choices"])[0]

    def reward(self, conversation, reply_text):
        return float(self.evaluate(conversation, reply_text))

    def reward_parts(self, conversation, reply_text):
        correct, form = grade(conversation["grader"], reply_text, conversation["answer"], conversation["choices"])
        return {"correct": float(correct), "format": float(form)}

    def eval_metrics(self, conversation, reply_text):
        return {"correct": float(self.evaluate(conversation, reply_text))}
