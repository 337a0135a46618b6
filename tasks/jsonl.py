"""
A task from a JSONL file: one problem per line, graded by a rule the user picks (docs/tasks.md).

A line is {"question": str, "answer": str or number} (the fields of GSM8K's own files), or {"messages": [...]} in
nanochat's shape (an optional system message first, then user and assistant in turn; the last assistant message is
the answer), optionally with "choices": [str, ...] (a multiple-choice problem: listed under the question as "A. ...",
"B. ...") and "grader": "number" | "exact" | "choice", which wins over --grader. The file is read as data only:
JSON, never code; a UTF-8 byte-order mark is skipped.

Graders, each reading the reply's answer and comparing it with the line's answer (docs/tasks.md has the table):
- number: the number after the first "####" (what nanochat's SFT teaches a model to write), else the last number in
  the reply; compared exactly, as rationals: "1,000" = "1000", "3.50" = "3.5", "3/8" = "0.375" = "6/16", "-2" != "2".
  A minus is a sign only where a number starts (not right after a digit or letter: "10-5" reads 10 and 5); Unicode
  minus and full-width digits read as ASCII; thousands separators count only in groups of three; "$" before and
  "%" after a number are ignored ("50%" reads 50);
- exact: the reply, trimmed and case-folded, equals the answer trimmed and case-folded;
- choice: the letter the reply commits to equals the answer's letter (the answer is a letter, "(B)", or the text
  of one choice). A reply commits by "Answer: B" / "the answer is B", "(B)", "**B**", the text of one choice as the
  whole reply, or else its last capital letter standing alone; "A" and "I" followed by a word are words, not
  letters, and a lower-case letter never counts.
--grader path/to/file.py:fn (or module:fn) grades every line that names no grader with your function,
fn(question, reply, answer) -> a number or (correct, format); imported only when a run names it.
Train and test: --task-test names a test file; without it every 10th problem of the file (lines 1, 11, 21, ...
counting problems, not blank lines) is held out for the evals. A file only watched (--eval-task) is evaluated whole.
"""
import decimal
import json
import os
import re
import unicodedata
from fractions import Fraction

from tasks import Task, file_sha256, import_task_module
from tasks.gsm8k import calculator, ends_with_answer_line

GRADERS = ("number", "exact", "choice")
HELD_OUT_EVERY = 10
# A number: a sign only where it starts (not after a digit, letter or point), an optional "$", digits with commas
# only in proper groups of three, an optional decimal part, and an optional "/ denominator" (a rational).
UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
NUMBER = rf"((?<![\w.])-)?(?:\$\s?)?({UNSIGNED})(?:\s?/\s?({UNSIGNED}))?"
MARKED_NUMBER = re.compile(r"####\s*\$?\s*" + NUMBER)
ANY_NUMBER = re.compile(NUMBER)
# A capital letter that is a letter, not the word "A" or "I" ("A good guess", "I pick"), and not inside a word.
LETTER = r"(?!(?:A|I)\s+[a-z])\b([A-Z])\b"
# The ways a reply commits to a letter, most explicit first; the last match of a rule wins (the conclusion).
COMMITTED_LETTER = [re.compile(r"(?i:answer)\s*(?:is|:|=)?\s*:?\s*(?:\*\*)?\(?" + LETTER),
                    re.compile(r"\(" + LETTER + r"\)|\*\*\(?" + LETTER + r"\)?\*\*")]
STANDALONE_LETTER = re.compile(LETTER)


def plain(text):
    """Full-width digits and signs as ASCII (NFKC), the Unicode minus and fraction slash as "-" and "/"."""
    return unicodedata.normalize("NFKC", text).replace("\u2212", "-").replace("\u2044", "/")


def read_number(text):
    """'... #### 1,000' -> Fraction(1000); '3/8' -> Fraction(3, 8); else the last number in the text; None when
    there is none (or it divides by 0)."""
    text = plain(text)
    match = MARKED_NUMBER.search(text) or ([None] + list(ANY_NUMBER.finditer(text)))[-1]
    if match is None:
        return None
    sign, numerator, denominator = match.groups()
    value = Fraction(numerator.replace(",", ""))
    if denominator is not None:
        below = Fraction(denominator.replace(",", ""))
        if below == 0:
            return None
        value /= below
    return -value if sign else value


def read_letter(text, choices):
    """The letter a reply commits to, among the first len(choices) letters; None when it commits to none."""
    letters = [chr(ord("A") + i) for i in range(len(choices))]

    def last(found):
        found = [letter for letter in found if letter in letters]
        return found[-1] if found else None

    for pattern in COMMITTED_LETTER:
        letter = last(next(g for g in m.groups() if g) for m in pattern.finditer(text))
        if letter:
            return letter
    said = text.strip().rstrip(".").strip().casefold()
    named = [i for i, c in enumerate(choices) if c.strip().casefold() == said]
    if named:
        return letters[named[0]]
    return last(STANDALONE_LETTER.findall(text))


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


def grader_function(spec):
    """--grader path/to/file.py:fn or module:fn -> the function, imported when a run names it (never from a line of
    the file: the file is data)."""
    module, _, name = spec.rpartition(":")
    fn = getattr(import_task_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"--grader {spec}: {module} has no function {name}(question, reply, answer)")
    return fn


def own_grade(fn, conversation, reply):
    """fn(question, reply, answer) -> a number (the correct term; 1 or more counts as correct) or (correct, format)."""
    question = next(m["content"] for m in reversed(conversation["messages"][:-1]) if m["role"] == "user")
    result = fn(question, reply, conversation["answer"])
    correct, form = result if isinstance(result, (tuple, list)) else (result, 0.0)
    return float(correct), float(form)


def read_problems(path, grader):
    """path -> [conversation with its answer, choices and grader], every line checked: one ValueError naming the
    file, the line and what to do for the first bad one."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the task file {path} ({e.strerror}): check the path") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (as Windows editors save UTF-8) is not text
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line} is not UTF-8 text: save the file as UTF-8") from None
    problems = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            row = json.loads(line, parse_float=decimal.Decimal)  # an answer 0.1 stays the number written
        except ValueError as e:
            raise ValueError(f"{where} is not JSON ({e.msg}): one JSON object a line") from None
        except RecursionError:
            raise ValueError(f"{where} nests brackets too deeply to read: one flat JSON object a line") from None
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
    if grader not in GRADERS and (grader != default_grader or ":" not in grader):  # a line never names code
        raise ValueError(f"{where}: grader {grader!r} is not one of {', '.join(GRADERS)}")
    choices = row.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, str) and c.strip() for c in choices) or len(
            choices) > 26:
        raise ValueError(f"{where}: choices must be a list of up to 26 non-empty strings")
    if "messages" in row:
        messages = row["messages"]
        # nanochat folds a system message into the first user message when it renders a conversation (model.py)
        system = isinstance(messages, list) and messages and isinstance(messages[0], dict) and messages[0].get(
            "role") == "system"
        turns = messages[1:] if system else messages
        if not (isinstance(turns, list) and len(turns) >= 2 and len(turns) % 2 == 0 and all(
                isinstance(m, dict) and m.get("role") == ("user", "assistant")[i % 2] and isinstance(
                    m.get("content"), str) and m["content"].strip() for i, m in enumerate(turns))) or (
                system and not isinstance(messages[0].get("content"), str)):
            raise ValueError(f"{where}: messages must be {{\"role\", \"content\"}} objects with text: an optional "
                             "system message, then user and assistant in turn, the last the assistant's answer")
        answer = messages[-1]["content"]
    else:
        answer = row.get("answer")
        if isinstance(answer, (int, decimal.Decimal)) and not isinstance(answer, bool):
            answer = format(answer, "f") if isinstance(answer, decimal.Decimal) else str(answer)  # 1e3 -> "1000"
        for field, value in (("question", row.get("question")), ("answer", answer)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{where}: the field {field!r} is missing or empty (a line needs question and "
                                 "answer, text or a number, or messages)")
        question = row["question"] + "".join(f"\n{chr(ord('A') + i)}. {c}" for i, c in enumerate(choices))
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
        self.own_grader = None if grader in GRADERS else grader_function(grader)
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
        if spec != args.task:  # a file only watched (--eval-task) is a quiz: all of it is its test split
            return cls(spec, split, args.grader, spec, args.calculator)
        return cls(spec, split, args.grader, args.task_test, args.calculator)

    @staticmethod
    def name(spec):
        return re.sub(r"\W+", "_", os.path.splitext(os.path.basename(spec))[0]).strip("_").lower() or "task"

    def __len__(self):
        return len(self.problems)

    def fingerprint(self):
        return self.sha256

    def example(self, index):
        return self.problems[index]

    def graded(self, conversation, reply_text):
        """-> (correct, format) by the line's grader, or by --grader's function."""
        if conversation["grader"] in GRADERS:
            return grade(conversation["grader"], reply_text, conversation["answer"], conversation["choices"])
        return own_grade(self.own_grader, conversation, reply_text)

    def evaluate(self, conversation, reply_text):
        return self.graded(conversation, reply_text)[0] >= 1

    def reward(self, conversation, reply_text):
        return float(self.graded(conversation, reply_text)[0])

    def reward_parts(self, conversation, reply_text):
        correct, form = self.graded(conversation, reply_text)
        return {"correct": float(correct), "format": float(form)}

    def eval_metrics(self, conversation, reply_text):
        return {"correct": float(self.graded(conversation, reply_text)[0])}
