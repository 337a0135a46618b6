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
  A minus is a sign only where a number starts (not right after a digit or letter: "10-5" reads 10 and 5); the
  Unicode minus and the en and figure dashes are minus signs; full-width digits read as ASCII, superscripts as no
  digit ("12 m²" reads 12); thousands separators (commas, spaces) count only in groups of three; exponents count
  ("1.5e-3"); "1 1/2", "1 ½" (any whitespace but a line break before the fraction) and "1½" read 3/2, "1,000 1/2"
  2001/2; "$" before and "%" after a number
  are ignored ("50%" reads 50); a number past 4,300 digits or with an exponent past 4 digits is none. An answer
  must read as one number;
- exact: the reply, trimmed and case-folded, equals the answer trimmed and case-folded;
- choice: the letter the reply commits to equals the answer's letter (the answer is a letter, "(B)", or the text
  of one choice). A reply commits by its first statement ("Answer: B", "**Answer:** b", "Answer - B", "the correct
  option is B", "B is correct", "I pick B", "I'd say B"; not "the answer is B or C") or an opening letter and a stop
  ("B. A is smaller.", "B, since A ...", "B: 9. A: 3.", "Option B (9)."), whatever letters its explanation names
  after it (also to a letter past the choices: wrong); else by its last "(B)" or "**B**"; else by the text of one
  choice as the whole reply; else by a lone letter as the whole reply ("b", "(b)", "d."); else by its last capital
  letter standing alone that it neither denies ("not A", "A is wrong") nor offers as one of alternatives ("B or
  C"). "A" and "I" followed by a word are words, not letters (but "the answer is A because", "A is right"); a
  lower-case letter counts after "answer" standing alone ("answer: b") or before a word where it is no article
  ("answer is b because").
--grader path/to/file.py:fn (or module:fn) grades every line that names no grader with your function,
fn(question, reply, answer) -> a finite number (the reward; correct when 1 or more), a pair (reward, format), or a
dict {"reward": ..., "correct": True/False, "format": ...} (correct and format optional) where partial credit needs
a verdict of its own (numpy's scalars, a 0-d tensor too); imported only when a run names it.
Train and test: --task-test names a test file; without it every 10th problem of the file (lines 1, 11, 21, ...
counting problems, not blank lines) is held out for the evals. A file only watched (--eval-task) is evaluated whole.
"""
import decimal
import json
import os
import re
import unicodedata
from fractions import Fraction

from tasks import (GraderError, Task, conversation_problem, file_sha256, finite_number, import_task_module,
                   shown, user_call)
from tasks.gsm8k import calculator, ends_with_answer_line

GRADERS = ("number", "exact", "choice")
HELD_OUT_EVERY = 10
# A number: a sign only where it starts (not after a digit, letter or point), an optional "$", digits with commas or
# spaces only in proper groups of three, an optional decimal part and exponent, and an optional "/ denominator" (a
# rational), before which a whole number ("1", "1,000", "1 000") and any whitespace but a line break make a mixed
# number ("1 1/2", "1,000\t1/2"; plain() turns the no-break and thin spaces into plain ones, and "1 ½" into
# "1  1/2").
SPACES = " \u00a0\u2009\u202f"  # a space, a no-break, thin or narrow no-break space
GROUP = f"[,{SPACES}]"  # what may stand between groups of three digits
WHOLE = rf"\d{{1,3}}(?:,\d{{3}})+|\d{{1,3}}(?:[{SPACES}]\d{{3}})+|\d+"
UNSIGNED = rf"(?:(?:\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d{{1,3}}(?:[{SPACES}]\d{{3}})+(?![\d/])|\d+)(?:\.\d+)?|\.\d+)" \
           r"(?:[eE][-+]?\d+(?!\w))?"
IN_LINE_SPACE = r"[^\S\n\r\v\f\x1c-\x1e\x85\u2028\u2029]"  # whitespace that str.splitlines() does not break at
NUMBER = rf"((?<![\w.])-)?(?:\$\s?)?(?:({WHOLE}){IN_LINE_SPACE}+(?=\d+\s?/\s?\d))?({UNSIGNED})(?:\s?/\s?({UNSIGNED}))?"
MARKED_NUMBER = re.compile(r"####\s*\$?\s*" + NUMBER)
ANY_NUMBER = re.compile(NUMBER)
# A capital letter that is a letter, not the word "A" or "I" ("A good guess", "I pick", "I'd"; but "A is right" is
# the letter), and not inside a word.
LETTER = r"(?!(?:A|I)\s+(?!(?:is|was)\b)[a-z]|I['\u2019])\b([A-Z])\b"
BOLD = r"(?:\*\*)?"
# After "answer" or "I pick", "A" is the letter whatever follows ("The answer is A because ..."), "I" before a word is
# the pronoun, and a lower-case letter counts where it stands alone ("answer: b", not "the answer is a guess"), or
# before a word where it cannot be the article or the pronoun ("answer is b because ...").
ANSWERED = rf"\(?(?:(?!I\s+[a-z]|I['\u2019])\b([A-Z])\b|\b([a-z])(?=\)?{BOLD}[ \t]*(?:$|[\n.,;:!?]))" \
           r"|\b([b-hj-z])(?=[ \t]+[a-z]))"
# The ways a reply commits to a letter in so many words; the first commitment wins over the letters of the
# explanation that follows ("**Answer:** B. A is smaller.", "B is correct because A is too small.").
COMMITMENTS = [
    re.compile(rf"\b(?i:answer|option|choice){BOLD}\s*(?i:is|:|=|would be|should be|must be|[-\u2013\u2014])"
               rf"\s*:?\s*{BOLD}\s*(?:(?i:option|choice)\s+)?{ANSWERED}"),  # "the answer is B", "answer: b"
    re.compile(rf"{BOLD}\(?{LETTER}\)?{BOLD}\s+is\s+(?:the\s+)?(?:(?:correct|right|best)(?![\w-])|answer\b)"),
    re.compile(rf"\bI(?:'d|'ll| would| will)?\s+(?:pick|choose|select|go with)\s+(?:(?:option|choice)\s+)?{BOLD}"
               rf"{ANSWERED}"),
    re.compile(rf"\bI(?:'d| would)\s+say\s+{BOLD}\(?{LETTER}")]  # "I'd say B", not "I'd say a word"
# A reply that opens with a letter and a stop commits to it ("B. A is smaller.", "B, since A ...", "B: 9. A: 3.",
# "Option B (9). ...", "**B**\nbecause ..."); not a letter before a word ("A is smaller than B"), nor one of letters
# ("A, B and C are ...", "A: B"), nor where the reply lists the choices: its lines do ("A. 3\nB. 9"), or it opens
# with the first choice and its value ("A. 3 is less than 9, so B": a list, or the first choice quoted, starts at A).
STOP = r"[ \t]*(?:$|\n|[.!;](?!\S)|(?:[:\u2013\u2014-](?!\S)|,)(?!\s*\(?[A-Z]\b))"
OPENING = re.compile(rf"\s*{BOLD}(?:(?i:option|choice|answer)\s+)?{BOLD}\(?{LETTER}\)?{BOLD}"
                     rf"(?=(?:[ \t]*\((?![ \t]*[A-Z]\))[^()\n]{{0,40}}\))?{STOP})")
FIRST_CHOICE_QUOTED = re.compile(r"A\)?(?:\*\*)?[ \t]*[.:;,)\u2013\u2014-]?[ \t]*\(?[-$]?\d")
LISTED = re.compile(r"^[ \t]*\(?([A-Z])[.)]", re.M)
LONE_LETTER = re.compile(r"\s*(?:\*\*)?\(?([a-z])\)?(?:\*\*)?\.?\s*")  # "b", "(b)", "d.": the whole reply
MARKED_LETTER = re.compile(r"\(" + LETTER + r"\)|\*\*\(?" + LETTER + r"\)?\*\*")  # "(B)", "**B**": the last one
STANDALONE_LETTER = re.compile(LETTER)
# A letter named but not chosen: denied ("not A", "A is wrong") or one of alternatives ("B or C", "B/C").
NOT_CHOSEN_BEFORE = re.compile(rf"(?:\b(?i:not|nor|or)\s+|/\s*){BOLD}\(?$")
NOT_CHOSEN_AFTER = re.compile(rf"\)?{BOLD}\s*(?:/|or\b|(?:is|was)(?:n't|\s+not\b|\s+(?:wrong|incorrect|false)\b))")
MAX_DIGITS = 4300  # Python's own limit on an int read from text (sys.get_int_max_str_digits)
DASHES = str.maketrans({"\u2212": "-", "\u2012": "-", "\u2013": "-", "\u2044": "/"})  # minus, figure, en dash


def plain(text):
    """Text as the number grader reads it: full-width digits and signs as ASCII (NFKC); a superscript or subscript
    is no digit ("12 m²" is 12 m, not 12 m2); a vulgar fraction is its own number ("3½" is 3 1/2); the Unicode
    minus, the figure and en dashes (what word processors write for a minus) as "-", the fraction slash as "/"."""
    def char(c):
        decomposition = unicodedata.decomposition(c)
        if decomposition.startswith(("<super>", "<sub>")):
            return " "
        return f" {c} " if decomposition.startswith("<fraction>") else c
    return unicodedata.normalize("NFKC", "".join(map(char, text))).translate(DASHES)


def read_number(text):
    """'... #### 1,000' -> Fraction(1000); '3/8' -> Fraction(3, 8); '1 1/2' -> Fraction(3, 2); else the last
    number in the text; None when there is none (or it divides by 0)."""
    text = plain(text)
    match = MARKED_NUMBER.search(text) or ([None] + list(ANY_NUMBER.finditer(text)))[-1]
    return None if match is None else number_of(match)


def number_of(match):
    """A NUMBER match -> its Fraction (None for x/0, or a part too long to read). A whole part counts before a
    proper fraction only."""
    sign, whole, numerator, denominator = match.groups()
    value = rational(numerator)
    if denominator is not None:
        below = rational(denominator)
        if value is None or below is None or below == 0:
            return None
        value /= below
        if whole is not None and value < 1:
            whole = rational(whole)
            value = None if whole is None else value + whole
    return None if value is None else -value if sign else value


def rational(text):
    """An UNSIGNED match -> its exact Fraction; None past MAX_DIGITS digits or an exponent of more than 4 digits,
    where Python refuses the int (a ValueError) or would build one of gigabytes (a reply's "1e999999999")."""
    text = re.sub(GROUP, "", text)
    digits, _, exponent = text.lower().partition("e")
    return None if len(digits) > MAX_DIGITS or len(exponent.lstrip("+-")) > 4 else Fraction(text)


def read_letter(text, choices):
    """The letter a reply commits to, among the first len(choices) letters; None when it commits to none. In turn:
    its first commitment in words (not to alternatives) or an opening letter; the last letter in brackets or bold;
    the text of one choice as the whole reply; one letter as the whole reply ("b"); the last capital letter
    standing alone that is not denied or one of alternatives. A letter
    committed to in words or marked is the answer also when it is past the choices (wrong)."""
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    said = []
    for m in (m for rule in COMMITMENTS for m in rule.finditer(text)):
        letter = next(i for i in range(1, len(m.groups()) + 1) if m.group(i))
        if not NOT_CHOSEN_AFTER.match(text, m.end(letter)):  # "the answer is B or C" commits to neither
            said.append((m.start(), m.group(letter).upper()))
    opening = OPENING.match(text)
    if opening and opening.group(1) in letters and len(set(LISTED.findall(text))) < 2 and not \
            FIRST_CHOICE_QUOTED.match(text, opening.start(1)):
        said.append((0, opening.group(1)))
    if said:
        return min(said)[1]
    marked = [next(g for g in m.groups() if g) for m in MARKED_LETTER.finditer(text)]
    if marked:
        return marked[-1]
    whole = text.strip().rstrip(".").strip().casefold()
    named = [i for i, c in enumerate(choices) if c.strip().casefold() == whole]
    if named:
        return letters[named[0]]
    lone = LONE_LETTER.fullmatch(text)
    if lone and lone.group(1).upper() in letters:
        return lone.group(1).upper()
    chosen = [m.group(1) for m in STANDALONE_LETTER.finditer(text) if m.group(1) in letters and not (
        NOT_CHOSEN_BEFORE.search(text, max(0, m.start() - 16), m.start()) or NOT_CHOSEN_AFTER.match(text, m.end()))]
    return chosen[-1] if chosen else None


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
    fn = getattr(import_task_module(module, "--grader"), name, None)
    if not callable(fn):
        raise ValueError(f"--grader {spec}: {module} has no function {name}(question, reply, answer)")
    return fn


OWN_GRADE_FORMS = ("a finite number (the reward: 1 for a correct reply, 0 for one it cannot grade), a pair "
                   "(reward, format), or {\"reward\": number, \"correct\": True or False, \"format\": number} "
                   "(correct and format optional)")


def own_grade(spec, fn, conversation, reply):
    """fn(question, reply, answer) -> (reward, correct, format); spec: --grader's value, which names it. fn returns
    the reward (a number), the pair (reward, format), or a dict {"reward", "correct", "format"}; numpy's scalars
    too. Unless the dict says, a reply is correct when its reward is 1 or more: partial credit (0.8 for a near miss)
    is a reward, never a correct reply. Anything else, or an exception or a sys.exit, is a GraderError: every reply
    needs a finite reward (there is no "not applicable": a group's advantages compare all of its replies)."""
    question = next(m["content"] for m in reversed(conversation["messages"][:-1]) if m["role"] == "user")
    where = f"--grader {spec} on the reply {reply[:60]!r} to {question[:60]!r}"
    result = user_call(where, fn, question, reply, conversation["answer"])
    if isinstance(result, (tuple, list)):
        fields = dict(zip(("reward", "format"), result)) if len(result) == 2 else {}
    elif isinstance(result, dict):
        fields = result if set(result) <= {"reward", "correct", "format"} else {}  # a misspelt name is no verdict
    else:
        fields = {"reward": result}
    reward, form = finite_number(fields.get("reward")), finite_number(fields.get("format", 0.0))
    correct = finite_number(fields.get("correct", reward is not None and reward >= 1))
    if reward is None or form is None or correct not in (0.0, 1.0):
        raise GraderError(f"{where} returned {shown(result)}: return {OWN_GRADE_FORMS}")
    return reward, correct == 1.0, form


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
            # an answer 0.1 stays the number written; an integer past the digits Python's int reads, a Decimal
            # (the number grader refuses it below, the others compare its text)
            row = json.loads(line, parse_float=decimal.Decimal, parse_int=lambda digits: int(digits) if len(
                digits) <= MAX_DIGITS else decimal.Decimal(digits))
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
    if "messages" in row and ("question" in row or "answer" in row):
        raise ValueError(f"{where} has both messages and question/answer: give one of them (messages: the last "
                         "assistant message is the answer)")
    listing = "".join(f"\n{chr(ord('A') + i)}. {c}" for i, c in enumerate(choices))  # what the model sees
    if "messages" in row:
        messages = row["messages"]
        # a task's conversation (nanochat folds a system message into the first user message when it renders one),
        # the assistant's answer last, each turn's text not empty
        if conversation_problem(row) or messages[-1]["role"] != "assistant" or not all(
                isinstance(m["content"], str) and (m["content"].strip() or m["role"] == "system") for m in messages):
            raise ValueError(f"{where}: messages must be {{\"role\", \"content\"}} objects with text: an optional "
                             "system message, then user and assistant in turn, the last the assistant's answer")
        answer = messages[-1]["content"]
        if listing:  # the choices under the question they belong to, as a question line shows them
            asked = next(i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user")
            messages = [dict(m, content=m["content"] + listing) if i == asked else m for i, m in enumerate(messages)]
    else:
        answer = row.get("answer")
        if isinstance(answer, (int, decimal.Decimal)) and not isinstance(answer, bool):
            answer = format(answer, "f") if isinstance(answer, decimal.Decimal) else str(answer)  # 1e3 -> "1000"
        for field, value in (("question", row.get("question")), ("answer", answer)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{where}: the field {field!r} is missing or empty (a line needs question and "
                                 "answer, text or a number, or messages)")
        question = row["question"] + listing
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    said = shown(answer)  # an answer of 5,000 digits is not written out whole
    if grader == "choice" and answer_letter(answer, choices) is None:
        raise ValueError(f"{where}: the answer {said} is not the letter of one of its {len(choices)} choices "
                         "(the choice grader needs choices and an answer such as \"B\")")
    if grader == "number" and read_number(answer) is None:
        raise ValueError(f"{where}: the answer {said} has no number for the number grader (write e.g. \"#### 42\", "
                         f"a number of at most {MAX_DIGITS:,} digits, or pick another --grader)")
    numbers = [shown(m.group(0).strip(), str, 20) for m in ANY_NUMBER.finditer(plain(answer))]
    if grader == "number" and not MARKED_NUMBER.search(plain(answer)) and len(numbers) > 1:
        raise ValueError(f"{where}: the answer {said} holds several numbers ({', '.join(numbers[:4])}): the "
                         "number grader would compare replies with the last; write the answer as one number, or "
                         "mark it: \"... #### 42\"")
    return {"messages": messages, "answer": answer, "choices": choices, "grader": grader}


class JSONLTask(Task):
    reward_terms = ("correct", "format")  # format: off unless --reward-weights gives it a weight (as GSM8K's)
    score = "correct"

    def __init__(self, path, split="train", grader="number", test_path=None, tool=False):
        if split not in ("train", "test"):
            raise ValueError(f"a task's split is train or test, got {split!r}")
        self.own_grader = None if grader in GRADERS else (grader, grader_function(grader))  # (--grader's spec, fn)
        self.paths = [path] + ([test_path] if test_path else [])
        problems = read_problems(path if split == "train" or not test_path else test_path, grader)
        self.own_graders = sorted({p["grader"] for p in problems} - {grader})  # what the lines name instead
        self.graded_by_flag = any(p["grader"] == grader for p in problems)
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
        task = cls(spec, split, args.grader, args.task_test, args.calculator)
        if task.own_grader and split == "train" and not task.graded_by_flag:  # a silent run at reward 0 otherwise
            raise ValueError(f"--grader {args.grader} grades no problem of {spec}: every line names its own grader "
                             f"({', '.join(task.own_graders)}), which wins; drop those lines' \"grader\" to grade "
                             "them with yours, or drop --grader")
        return task

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
        """-> (reward, correct, format) by the line's grader (reward 1 for a correct reply, else 0), or by --grader's
        function (its reward may be partial credit, correct its own verdict)."""
        if conversation["grader"] in GRADERS:
            correct, form = grade(conversation["grader"], reply_text, conversation["answer"], conversation["choices"])
            return float(correct), correct, float(form)
        return own_grade(*self.own_grader, conversation, reply_text)

    def evaluate(self, conversation, reply_text):
        return self.graded(conversation, reply_text)[1]

    def reward(self, conversation, reply_text):
        return self.graded(conversation, reply_text)[0]

    def reward_parts(self, conversation, reply_text):
        # the term "correct" is the grader's reward (partial credit too): --reward-weights names it as GSM8K's
        reward, _, form = self.graded(conversation, reply_text)
        return {"correct": reward, "format": form}

    def eval_metrics(self, conversation, reply_text):
        # the share of correct replies, as pass@k counts them; the mean reward (credit) is eval_reward
        return {"correct": float(self.evaluate(conversation, reply_text))}
