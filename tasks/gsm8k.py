"""
GSM8K (grade-school math word problems; the official release, MIT licence): 7,473 train and 1,319 test
problems, one JSON object per line with "question" and "answer" fields. Every answer ends in "#### <number>".

Where the data comes from, first match wins:
  1. an explicit directory holding {train,test}.jsonl (the --gsm8k-dir flag, or data_dir=...);
  2. the directory in $NANOGRPO_GSM8K_DIR;
  3. the cache, $NANOGRPO_CACHE_DIR/gsm8k (default ~/.cache/nanogrpo/gsm8k);
  4. a download of the official files into the cache.

Grading. The official rule (strict, the default): the answer is the first match of "#### (-?[0-9.,]+)" with
commas removed, compared *as a string* with the reference answer extracted the same way. Numbers stay
comparable with published GSM8K results. The lenient rule reads the first "####" marker too, but allows no
space or a "$" after it and a trailing period, and compares numerically, so "#### $18.00." == "18".

Tool. As in nanochat, the solutions' <<48/2=24>> annotations are calculator calls: the model writes
<|python_start|>48/2<|python_end|>, and the sampler forces the calculator's result into the reply.
"""
import ast
import decimal
import hashlib
import json
import math
import operator
import os
import random
import re
import sys
import tempfile
import urllib.request

from model import new_file_mode
from tasks import Task

SPLIT_ROWS = {"train": 7473, "test": 1319}
OFFICIAL_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"

# -----------------------------------------------------------------------------
# Grading

STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
# A trailing "." or "," is not part of the number. The "$" and the space after it are one optional group: as
# \s*\$?\s* the two runs of spaces could split a long run in every way, quadratic time on a reply that has one.
LENIENT_ANSWER = re.compile(r"####\s*(?:\$\s*)?(-?[0-9.,]*[0-9])")


def extract_answer(text):
    """The official extraction: first '#### <number>', commas removed; None when there is none."""
    match = STRICT_ANSWER.search(text)
    return match.group(1).strip().replace(",", "") if match else None


def extract_number_lenient(text):
    match = LENIENT_ANSWER.search(text)
    if not match:
        return None
    try:
        return decimal.Decimal(match.group(1).replace(",", ""))
    except decimal.InvalidOperation:  # "1.2.3"
        return None


def is_correct(reply, reference, lenient=False):
    """Grade a model reply against the reference answer text (both full texts with a '####' line)."""
    if lenient:
        got, want = extract_number_lenient(reply), extract_number_lenient(reference)
    else:
        got, want = extract_answer(reply), extract_answer(reference)
    return got is not None and got == want


# -----------------------------------------------------------------------------
# The calculator tool

CALCULATOR_MAX_CHARS = 100
_CALC_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CALC_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub,
               ast.UAdd)


def calculator(expr):
    """Evaluate + - * / arithmetic written by the model; None for anything else.

    The model's text is never eval'd: it is parsed with ast and only number literals and the four
    operations are walked. Without ** and with at most 100 characters, every result stays small,
    so the time is bounded too."""
    expr = re.sub(r"(?<=\d),(?=\d)", "", expr.strip())  # 1,000 -> 1000
    if not expr or len(expr) > CALCULATOR_MAX_CHARS or not re.fullmatch(r"[0-9.+\-*/() ]+", expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        if not all(isinstance(node, _CALC_NODES) for node in ast.walk(tree)):
            return None

        def value(node):
            if isinstance(node, ast.Expression):
                return value(node.body)
            if isinstance(node, ast.Constant):
                if not isinstance(node.value, (int, float)):
                    raise ValueError
                return node.value
            if isinstance(node, ast.UnaryOp):
                return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
            return _CALC_OPS[type(node.op)](value(node.left), value(node.right))

        result = value(tree)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError):
        return None
    if isinstance(result, float):
        if not math.isfinite(result):
            return None
        result = round(result, 6)
        if result.is_integer():
            result = int(result)
    return str(result)


# -----------------------------------------------------------------------------
# Data

def answer_to_parts(answer):
    """'48/2 = <<48/2=24>>24 clips.\\n#### 24' -> text, python '48/2', python_output '24', text parts."""
    parts = []
    for piece in re.split(r"(<<[^<>]*>>)", answer):
        expr, eq, result = piece[2:-2].rpartition("=")
        if piece.startswith("<<") and eq:
            parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def read_jsonl(path, expected_rows=None):
    rows = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():  # a blank line, e.g. at the end of a hand-edited file
                continue
            try:
                row = json.loads(line.decode("utf-8"))
                if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                        and isinstance(row.get("answer"), str)):
                    raise ValueError("no question/answer strings")
                if extract_answer(row["answer"]) is None:
                    raise ValueError("answer has no '#### <number>' line")
            except ValueError as e:  # also a line that is not UTF-8
                raise ValueError(f"{path} line {n} is not a GSM8K row ({e}); delete the file, or point "
                                 "--gsm8k-dir at a good copy of the official JSONL files") from None
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no GSM8K rows: point --gsm8k-dir at a good copy of the official JSONL files")
    if expected_rows is not None and len(rows) != expected_rows:
        raise ValueError(f"{path} has {len(rows)} rows, expected {expected_rows}: the file is incomplete")
    return rows


def cache_dir():
    cache = os.environ.get("NANOGRPO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanogrpo")
    return os.path.join(cache, "gsm8k")


def download(split, path, url):
    """Download into a temporary file beside `path`, check it, then rename: the cache never holds a bad file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{split}_", suffix=".part")
    print(f"downloading GSM8K {split} from {url}", file=sys.stderr, flush=True)
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=60) as response:
            total, done = int(response.headers.get("Content-Length") or 0), 0
            while chunk := response.read(1 << 16):
                f.write(chunk)
                done += len(chunk)
                if sys.stderr.isatty():
                    print(f"\r  {done / 1e6:.1f}{f' / {total / 1e6:.1f}' if total else ''} MB", end="", file=sys.stderr)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        read_jsonl(tmp, SPLIT_ROWS[split])
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise RuntimeError(f"could not download GSM8K {split} from {url} ({e}). Offline? Put the official "
                               f"{split}.jsonl in a directory and pass --gsm8k-dir DIR (or set "
                               "NANOGRPO_GSM8K_DIR); GSM8K is the default --task: --task names another") from None
        raise


def ends_with_answer_line(reply_text):
    """The reply's last non-empty line is `#### <number>` and nothing else."""
    lines = [line.strip() for line in reply_text.strip().splitlines() if line.strip()]
    return bool(lines) and re.fullmatch(r"#### -?\d[\d,]*(\.\d+)?", lines[-1]) is not None


def find_split(split, data_dir=None, url=OFFICIAL_URL):
    """The path of {split}.jsonl, downloading it into the cache if no local copy exists."""
    for where, directory in (("data_dir / --gsm8k-dir", data_dir),
                             ("$NANOGRPO_GSM8K_DIR", os.environ.get("NANOGRPO_GSM8K_DIR"))):
        if directory:
            path = os.path.join(directory, f"{split}.jsonl")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{where} is {directory}, but it has no {split}.jsonl")
            return path
    path = os.path.join(cache_dir(), f"{split}.jsonl")
    if os.path.isfile(path):
        return path
    # Every process that lacks the file downloads it (a few MB), torchrun's ranks too: each writes its own temporary
    # file and renames it into place, so they cannot clash, and none waits for another that may never come.
    download(split, path, url.format(split=split))
    return path


class GSM8K(Task):
    tool = staticmethod(calculator)
    score = "strict"
    data_flags = {"train": "--gsm8k-dir", "test": "--gsm8k-dir"}

    def __init__(self, split="train", data_dir=None, url=OFFICIAL_URL):
        if split not in SPLIT_ROWS:
            raise ValueError(f"GSM8K split must be one of {list(SPLIT_ROWS)}, got {split!r}")
        path = find_split(split, data_dir, url)
        self.rows = read_jsonl(path)
        with open(path, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        random.Random(42).shuffle(self.rows)  # a fixed order: --eval-examples N means the same N problems everywhere

    @classmethod
    def from_flags(cls, split, args):
        return cls(split, args.gsm8k_dir)

    @staticmethod
    def default_num_steps(args):
        return SPLIT_ROWS["train"] // args.prompts_per_step  # one epoch

    def __len__(self):
        return len(self.rows)

    def fingerprint(self):
        return self.sha256

    def example(self, index):
        row = self.rows[index]
        return {"messages": [{"role": "user", "content": row["question"]},
                             {"role": "assistant", "content": answer_to_parts(row["answer"])}]}

    def reference(self, conversation):
        return "".join(part["text"] for part in conversation["messages"][-1]["content"])

    def evaluate(self, conversation, reply_text):
        return is_correct(reply_text, self.reference(conversation))

    def reward(self, conversation, reply_text):
        return float(self.evaluate(conversation, reply_text))

    # "format": the reply ends with a well-formed answer line. Easy to game (any number will do), so it is off
    # unless --reward-weights gives it a weight, and then it should stay small next to "correct".
    reward_terms = ("correct", "format")

    def reward_parts(self, conversation, reply_text):
        return {"correct": self.reward(conversation, reply_text), "format": float(ends_with_answer_line(reply_text))}

    def eval_metrics(self, conversation, reply_text):
        reference = self.reference(conversation)
        return {"strict": float(is_correct(reply_text, reference)),
                "lenient": float(is_correct(reply_text, reference, lenient=True))}
