"""
Tasks: where prompts come from and how replies are scored.

A task is a sequence of conversations in nanochat's shape,
    {"messages": [{"role": "user", "content": str}, {"role": "assistant", "content": str | [parts]}]}
with parts {"type": "text" | "python" | "python_output", "text": str}. The trainer asks a task for nothing else:
- reward(conversation, reply_text) -> float, the RL signal;
- reward_terms, reward_parts(conversation, reply_text) -> {name: float}: the reply scored by several named terms
  (--reward-weights combines them); the first term alone is the default reward, so it must equal reward();
- evaluate(conversation, reply_text) -> bool, a correct reply (pass@k counts these);
- eval_metrics(conversation, reply_text) -> {name: float}, logged as eval_<name> next to eval_reward (Task's
  default: {"correct": evaluate's verdict}, the share of correct greedy replies; a task's own metric of that share
  is evaluate's too: sort's "exact", GSM8K's "strict", a JSONL file's "correct");
- score: the eval metric that ranks runs in --compare (eval_<score>);
- tool: None, or a function that the sampler runs on the text between <|python_start|> and <|python_end|>,
  its string result forced into the reply;
- respond: None (one assistant turn, the default), or a method respond(conversation, episode) -> the next user
  message (text), or None to end the episode: called after each assistant turn that ends in <|assistant_end|>, with
  episode the turns so far, [{"role": "assistant" | "user", "content": str}, ...], ending with the assistant's
  (episode_turns, below: the turns come from the token ids and the sampler's mask, never from decoded text).
  An episode's task is graded once, at its end: reward, reward_parts, evaluate and eval_metrics get the
  conversation with "episode" (all its turns; each assistant turn's "ended": "turn" (it sampled
  <|assistant_end|>), "capped" (--max-turn-tokens), "quit" (<|bos|>) or "cut" (the token budget)) and the last
  assistant turn as reply_text;
- from_flags(split, args) and default_num_steps(args): how grpo.py's flags build the task (None, Task's default:
  one epoch of the train split);
- fingerprint(): the sha256 of the data files read, or None where the data is a function of the flags alone
  (a resumed run refuses data that changed under it);
- longest_prompt(tokenizer): the longest prompt in tokens, for the memory plan.
Subclassing Task gives sensible defaults for all but __len__, example(index), reward and evaluate (a class that
does not subclass it gives them all).

--task and --eval-task name a task (task_class): gsm8k, sort, a file ending in .jsonl (tasks/jsonl.py), or your own
class as module:Class or path/to/file.py:Class, imported when a run names it and never otherwise, and called through
OwnTask: what any of its methods raises, a sys.exit too, or returns of the wrong kind (a reward that is no finite
number, an example that is no conversation of this shape, a length that is no int) is one error line (GraderError).
"""
import copy
import decimal
import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
import traceback

from model import generate


class Task:
    """What the tasks share: no tool, runs ranked by eval_reward, one reward term, the share of correct replies as
    the eval metric, and indexing that ends at the last example (len and example(index) are the task's own)."""
    tool = None
    respond = None  # one assistant turn; a method respond(conversation, episode) makes episodes of several
    score = "reward"
    reward_terms = ("reward",)
    data_flags = {"train": "--task", "test": "--task-test"}  # the flags that name its data (a resume's messages)
    epochs_end = True  # its train split is read in epochs (prompt_indices)

    def reward_parts(self, conversation, reply_text):
        return {"reward": self.reward(conversation, reply_text)}

    def eval_metrics(self, conversation, reply_text):
        return {"correct": float(self.evaluate(conversation, reply_text))}

    def fingerprint(self):
        return None

    @staticmethod
    def default_num_steps(args):
        return None  # one epoch of the train split, counted once it is read

    def longest_prompt(self, tokenizer):
        """Of the first 10,000 examples (all of GSM8K's train split): a bound for the memory plan, not a limit."""
        return max(len(tokenizer.render_for_completion(self[i])) for i in range(min(len(self), 10_000)))

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} of a task with {len(self)} examples")
        return self.example(index)


BUILTIN = ("gsm8k", "sort")
PART_TYPES = ("text", "python", "python_output")  # an assistant message's parts, as model.py renders them
TASK_METHODS = ("from_flags", "reward", "evaluate", "eval_metrics", "__len__", "__getitem__")
TASK_DEFAULTS = tuple(name for name in vars(Task) if not name.startswith("_"))  # what a subclass of Task inherits


def task_class(spec, flag="--task"):
    """--task or --eval-task -> the task's class. A ValueError says what is wrong with a spec that names none."""
    from tasks.gsm8k import GSM8K
    from tasks.jsonl import JSONLTask
    from tasks.sort import Sort
    if spec in BUILTIN:
        return {"gsm8k": GSM8K, "sort": Sort}[spec]
    if spec.endswith(".jsonl"):
        return JSONLTask
    module, colon, name = spec.rpartition(":")
    if not (colon and module and name.isidentifier()):
        raise ValueError(f"{flag} {spec!r} names no task: use gsm8k, sort, a file ending in .jsonl, or your class as "
                         "module:Class or path/to/file.py:Class")
    cls = getattr(import_task_module(module, flag), name, None)
    if cls is None:
        raise ValueError(f"the task module {module} has no {name}: check the class name in {flag} {spec}")
    if not isinstance(cls, type):
        raise ValueError(f"{spec} is not a task but a {type(cls).__name__}: name a class (tasks/__init__.py and "
                         "docs/tasks.md give the interface)")
    own = issubclass(cls, Task)  # Task's defaults fill the rest; a class of its own gives them all
    missing = [m for m in TASK_METHODS + (("example",) if own and cls.__getitem__ is Task.__getitem__ else ())
               if not callable(getattr(cls, m, None))] + [m for m in TASK_DEFAULTS if not own and not hasattr(cls, m)]
    if missing:
        raise ValueError(f"{spec} is not a task: it lacks {', '.join(missing)} (subclass tasks.Task for its "
                         "defaults; the interface is in tasks/__init__.py and docs/tasks.md)")
    terms = cls.reward_terms
    if not (isinstance(terms, (tuple, list)) and terms and all(isinstance(t, str) for t in terms)):
        raise ValueError(f"{spec}: reward_terms is {shown(terms)}: give a tuple of the reward terms' names, the "
                         "first reward()'s")
    if not isinstance(cls.score, str):
        raise ValueError(f"{spec}: score is {shown(cls.score)}: give the name of the eval metric that ranks runs")
    return cls


class GraderError(Exception):
    """A user's code (a --grader function, a task class of --task) failed: raised, exited, or returned what is no
    reward. The run stops with this one line, naming the function, the reply and what to return instead."""


def user_call(where, fn, *args, passes=()):
    """fn(*args), the user's code: whatever it raises, a sys.exit too, is one GraderError naming `where` (the
    exceptions in passes go through as they are). A KeyboardInterrupt is not the code's own: it is Ctrl-C or a stop
    signal (grpo.py's stop_signals raises it wherever the run is), and it stops the run as it does everywhere."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, *passes):
        raise
    except BaseException as e:
        frames = traceback.extract_tb(e.__traceback__)[1:]  # below this function's own frame
        at = f" ({os.path.basename(frames[-1].filename)} line {frames[-1].lineno}, in {frames[-1].name})" if frames \
            else ""
        if isinstance(e, SystemExit):  # it would end a run with no error line and no checkpoint
            raise GraderError(f"{where} called sys.exit({shown(e.code)}){at}: it must return, never end the "
                              "process") from None
        said = f": {shown(e, str, 200)}" if str(e) else ""  # MemoryError() says nothing
        raise GraderError(f"{where} raised {type(e).__name__}{said}{at}") from None


def conversation_problem(conversation):
    """-> None for a conversation of nanochat's shape (the module's docstring): an optional system message, then user
    and assistant in turn from the user's, each with text (an assistant's may be a list of parts); else what is
    wrong with it, in a few words."""
    messages = conversation.get("messages") if isinstance(conversation, dict) else None
    if not isinstance(messages, list) or not messages:
        return "not a dict with a non-empty list of messages"
    system = isinstance(messages[0], dict) and messages[0].get("role") == "system"
    if len(messages) == system:
        return "no user message"
    for i, message in enumerate(messages):
        role = "system" if system and i == 0 else ("user", "assistant")[(i - system) % 2]
        if not isinstance(message, dict) or message.get("role") != role:
            return f"message {i} is not the {role}'s (an optional system message, then user and assistant in turn)"
        content = message.get("content")
        parts = content if role == "assistant" and isinstance(content, list) else [{"type": "text", "text": content}]
        if not all(isinstance(p, dict) and p.get("type") in PART_TYPES and isinstance(p.get("text"), str)
                   for p in parts):
            return f"message {i}'s content is not text" + (" or a list of parts" if role == "assistant" else "")
    return None


def finite_number(value):
    """A reward or metric from the user's code -> a float where it is a finite real number (an int, bool, float,
    Fraction or Decimal, or one of these in a 0-d array: numpy's scalars, a 0-d torch tensor), else None (also for
    10**400, past any float)."""
    try:
        if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):  # np.float32(1.0), np.bool_
            value = value.item()
        if not isinstance(value, (numbers.Real, decimal.Decimal)):
            return None
        value = float(value)
    except Exception:  # an int past a float's range, Decimal("sNaN"), an item() that fails: no number
        return None
    return value if math.isfinite(value) else None


def shown(value, text=repr, limit=80):
    """text(value) cut to limit characters for an error line; the type's name where it cannot be written (an int
    past Python's 4,300 digits, the user's own __repr__ raising)."""
    try:
        written = text(value)
    except Exception:
        return f"a value of type {type(value).__name__}"
    return written if len(written) <= limit else written[:limit] + "..."


class OwnTask:
    """A task class of the user's own, as the trainer calls it: each method the trainer calls runs through
    user_call, and what it returns is checked (examples of nanochat's shape, counts that are ints, a fingerprint
    that is text, rewards and metrics that are finite numbers, numpy's scalars too), else a GraderError naming the
    method. Its attributes (reward_terms, score) are the task's own."""

    def __init__(self, task, spec, split):
        self.task, self.spec, self.split, self.metric_names = task, spec, split, None

    def __getattr__(self, name):
        return getattr(self.task, name)

    def where(self, call):
        return f"--task {self.spec}: {call} of its {self.split} split"

    def __len__(self):
        where = self.where("__len__()")
        return self.count(where, user_call(where, self.task.__len__), "the number of examples")

    def __getitem__(self, index):
        method = "example" if type(self.task).__getitem__ is Task.__getitem__ else "__getitem__"
        where = self.where(f"{method}({index})")
        conversation = user_call(where, self.task.__getitem__, index)
        wrong = conversation_problem(conversation)
        if wrong:
            raise GraderError(f"{where} returned {shown(conversation)}: {wrong}; return a conversation "
                              "{\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]} (docs/tasks.md)")
        return conversation

    def fingerprint(self):
        where = self.where("fingerprint()")
        digest = user_call(where, self.task.fingerprint)
        if digest is not None and not isinstance(digest, str):
            raise GraderError(f"{where} returned {shown(digest)}: return the sha256 of the data it reads as text, "
                              "or None")
        return digest

    def longest_prompt(self, tokenizer):
        if type(self.task).longest_prompt is Task.longest_prompt:  # Task's: over the examples as checked here
            return Task.longest_prompt(self, tokenizer)
        where = self.where("longest_prompt(tokenizer)")
        return self.count(where, user_call(where, self.task.longest_prompt, tokenizer),
                          "the longest prompt's length in tokens")

    @staticmethod
    def count(where, value, what):
        """A length, a number of steps or of tokens from the user's code -> an int from 1 to sys.maxsize (what
        len() takes; numpy's ints too), else a GraderError saying what to return."""
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 1 <= value <= sys.maxsize:
            return int(value)
        raise GraderError(f"{where} returned {shown(value)}: return {what}, an int from 1 to {sys.maxsize:,}")

    def graded(self, method, conversation, reply_text):
        """-> (where, what the task's method returned)."""
        where = f"--task {self.spec}: {method} on the reply {reply_text[:60]!r}"
        return where, user_call(where, getattr(self.task, method), conversation, reply_text)

    @staticmethod
    def numbers(where, result, names, what):
        """A {name: value} result -> {name: float} for these names, or a GraderError saying what to return."""
        values = {name: finite_number(result.get(name)) for name in names} if isinstance(result, dict) else None
        if values is None or None in values.values():
            raise GraderError(f"{where} returned {shown(result)}: return {what}")
        return values

    def reward(self, conversation, reply_text):
        where, result = self.graded("reward", conversation, reply_text)
        return self.numbers(where, {"reward": result}, ["reward"], "a finite number")["reward"]

    def reward_parts(self, conversation, reply_text):
        where, result = self.graded("reward_parts", conversation, reply_text)
        terms = self.task.reward_terms
        return self.numbers(where, result, terms, f"{{name: a finite number}} for each of {', '.join(terms)}")

    def evaluate(self, conversation, reply_text):
        where, result = self.graded("evaluate", conversation, reply_text)
        if finite_number(result) not in (0.0, 1.0):
            raise GraderError(f"{where} returned {shown(result)}: return True for a correct reply, else False")
        return bool(result)

    def eval_metrics(self, conversation, reply_text):
        """The same names for every reply, the first reply's (the eval sums each name over the replies)."""
        where, result = self.graded("eval_metrics", conversation, reply_text)
        if self.metric_names is None and isinstance(result, dict):
            self.metric_names = list(result)
        return self.numbers(where, result, self.metric_names or [], "{name: a finite number}, the same names for "
                                                                    "every reply")

    @property
    def respond(self):
        respond = self.task.respond
        if respond is None:
            return None

        def checked(conversation, episode):
            where = f"--task {self.spec}: respond after the reply {episode[-1]['content'][:60]!r}"
            result = user_call(where, respond, conversation, episode)
            if result is not None and not isinstance(result, str):
                raise GraderError(f"{where} returned {shown(result)}: return the next user message as text, or None "
                                  "to end the episode")
            return result
        return checked

    @property
    def tool(self):
        tool = self.task.tool
        if tool is None:
            return None

        def checked(text):
            where = f"--task {self.spec}: its tool on {text[:60]!r}"
            result = user_call(where, tool, text)
            if result is not None and not isinstance(result, str):
                raise GraderError(f"{where} returned {shown(result)}: return the text to insert, or None")
            return result
        return checked


def import_task_module(module, flag="--task"):
    """module (importable from the working directory) or path/to/file.py: imported, its errors one ValueError."""
    try:
        if module.endswith(".py"):
            if not os.path.isfile(module):
                raise ValueError(f"the file {module} does not exist: check the path in {flag}")
            spec = importlib.util.spec_from_file_location(f"nanogrpo_task_{task_name(module)}", module)
            loaded = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded)
            return loaded
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        return importlib.import_module(module)
    except (ValueError, KeyboardInterrupt):
        raise
    except BaseException as e:  # the user's code: whatever it raises on import (a sys.exit too), one line
        raise ValueError(f"the module {module} of {flag} could not be imported ({type(e).__name__}: {e})") from None


def task_name(spec):
    """The short name of a task in metric names: gsm8k, a file's stem, a class's name (lower case)."""
    stem = spec.rpartition(":")[2] if ":" in spec and not spec.endswith(".jsonl") else os.path.basename(spec)
    stem = stem[:-len(".jsonl")] if stem.endswith(".jsonl") else stem[:-3] if stem.endswith(".py") else stem
    return "".join(c if c.isalnum() else "_" for c in stem).strip("_").lower() or "task"


def build(spec, split, args):
    """The task a spec names, this split of it, from the run's flags; a class of the user's own as an OwnTask
    (its OSError or ValueError is its own word on its data, one line as the built-in tasks' are)."""
    cls = task_class(spec)
    if spec.endswith(".jsonl"):
        task = cls.from_flags(split, args, spec)
    elif spec in BUILTIN:
        task = cls.from_flags(split, args)
    else:
        task = OwnTask(user_call(f"--task {spec}: from_flags({split!r})", cls.from_flags, split, args,
                                 passes=(OSError, ValueError)), spec, split)
    if getattr(args, "attempts", 1) == 1 or task.respond is not None and spec != args.task:
        return task  # a watched task that answers itself plays its own episodes
    if task.respond is not None:
        raise ValueError(f"--task {spec} answers the assistant itself (respond): --attempts {args.attempts} would "
                         "replace its answers; leave --attempts out")
    return Attempts(task, args.attempts)


def default_num_steps(spec, args):
    """--num-steps where the flags give none: the task class's default_num_steps(args) (None: one epoch of the train
    split, counted once it is read), a class of the user's own called as OwnTask calls its methods."""
    cls = task_class(spec)
    if spec in BUILTIN or spec.endswith(".jsonl"):
        return cls.default_num_steps(args)
    where = f"--task {spec}: default_num_steps(args)"
    steps = user_call(where, cls.default_num_steps, args)
    return None if steps is None else OwnTask.count(where, steps, "a number of steps (or None: one epoch)")

class Attempts:
    """--attempts N: any graded task as an episode of up to N attempts (Chung, Du, Fu 2025, "Learning from Failures
    in Multi-Attempt Reinforcement Learning"): a reply that evaluate finds wrong is answered
        Your answer is wrong. Try again (2 attempts left).
    (the attempts still open, the next one included; "1 attempt left" before the last) until one is right or the N
    are spent. Its reward is the task's reward of the last attempt, undiscounted, as in the paper (right at any
    attempt earns a right reply's reward; the paper's rewards are +1 right, -0.5 wrong but well formed, -1 else: here
    the task's own). Its eval metrics are the task's, of the last attempt, and correct@1 .. correct@N: right within
    the first k attempts."""

    def __init__(self, task, attempts):
        self.task, self.attempts = task, attempts

    def __getattr__(self, name):
        return getattr(self.task, name)

    def __len__(self):
        return len(self.task)

    def __getitem__(self, index):
        return self.task[index]

    def respond(self, conversation, episode):
        replies = [turn["content"] for turn in episode if turn["role"] == "assistant"]
        left = self.attempts - len(replies)
        if left <= 0 or self.task.evaluate(conversation, replies[-1]):
            return None
        return self.feedback(left)

    @staticmethod
    def feedback(left):
        return f"Your answer is wrong. Try again ({left} attempt{'s' if left > 1 else ''} left)."

    def eval_metrics(self, conversation, reply_text):
        turns = conversation.get("episode", [{"role": "assistant", "content": reply_text}])
        right = [self.task.evaluate(conversation, turn["content"]) for turn in turns if turn["role"] == "assistant"]
        return dict(self.task.eval_metrics(conversation, reply_text),
                    **{f"correct@{k}": float(any(right[:k])) for k in range(1, self.attempts + 1)})


# Episodes: an episode's turns read back from what generate wrote (its token ids and the sampler's mask)

def reply_text(tokenizer, samples, row):
    """A sampled reply as text for the grader, without its stop token."""
    length = samples["lengths"][row].item() - (0 if samples["truncated"][row] else 1)
    return tokenizer.decode(samples["tokens"][row, :length].tolist())


def episode_turns(tokenizer, tokens, mask):
    """A row's tokens and sampler mask (lists, up to its length) -> its turns, [{"role", "content"}, ...]. The
    boundaries come from the ids and the mask, never from decoded text (the model may sample <|user_start|> inside
    its own turn): an assistant turn ends at <|assistant_end|>, sampled ("ended": "turn") or forced at
    --max-turn-tokens ("capped": no forced run holds it, a user's message and a tool's output being plain tokens), or
    at a sampled <|bos|> ("quit"); then the forced run <|user_start|> message <|user_end|> <|assistant_start|> is
    the user's turn (a run the token budget cut is left out: the model never read it whole); a last turn with no end
    was cut ("cut")."""
    turns, start, i = [], 0, 0
    while i < len(tokens):
        if tokens[i] == tokenizer.assistant_end or mask[i] and tokens[i] == tokenizer.bos:
            ended = "quit" if tokens[i] == tokenizer.bos else "turn" if mask[i] else "capped"
            turns.append(dict(role="assistant", content=tokenizer.decode(tokens[start:i]), ended=ended))
            try:  # the user's message holds no special token: the first forced <|assistant_start|> closes it
                start = next(j for j in range(i + 1, len(tokens)) if tokens[j] == tokenizer.assistant_start
                             and not mask[j]) + 1
            except StopIteration:
                return turns
            turns.append(dict(role="user", content=tokenizer.decode(tokens[i + 2:start - 2])))
            i = start
            continue
        i += 1
    # the budget may end right after the user's turn: the reply graded is then the empty one the model had no room
    # for, never the user's message
    if start < len(tokens) or turns and turns[-1]["role"] == "user":
        turns.append(dict(role="assistant", content=tokenizer.decode(tokens[start:]), ended="cut"))
    return turns


def episode_responder(task, tokenizer, conversations, G, max_turns):
    """-> generate's respond (row, tokens, mask) -> the task's next user message or None, for these conversations
    (G rows each), at most max_turns assistant turns an episode; None for a task of one turn."""
    if task.respond is None:
        return None

    def respond(row, tokens, mask):
        turns = episode_turns(tokenizer, tokens, mask)
        if sum(turn["role"] == "assistant" for turn in turns) >= max_turns:
            return None
        return task.respond(copy.deepcopy(conversations[row // G]), turns)  # its own: a write reaches no other row
    return respond


def episode_ends(tokenizer, samples):
    """The step's episodes, summed: episode_turns (assistant turns), and how each ended: episode_end_done (the
    task ended it, or --max-turns did), episode_end_quit (the model sampled <|bos|>), episode_end_budget (cut at
    --max-new-tokens, in a turn of either side)."""
    sums = dict(episode_turns=0, episode_end_done=0, episode_end_quit=0, episode_end_budget=0)
    tokens, mask = samples["tokens"].tolist(), samples["mask"].tolist()
    for row, (length, cut) in enumerate(zip(samples["lengths"].tolist(), samples["truncated"].tolist())):
        turns = [turn for turn in episode_turns(tokenizer, tokens[row][:length], mask[row][:length])
                 if turn["role"] == "assistant"]
        sums["episode_turns"] += len(turns)
        ended = "budget" if cut else "quit" if turns[-1]["ended"] == "quit" else "done"
        sums[f"episode_end_{ended}"] += 1
    return sums


def episode_of(conversation):
    """{"episode": its turns} for a graded episode (the samples and eval files show it turn by turn), {} for a
    one-turn reply."""
    return {"episode": conversation["episode"]} if "episode" in conversation else {}


def graded(task, tokenizer, conversation, samples, row):
    """-> (conversation, reply_text) as the task grades a sampled row: a one-turn task the reply as it is; an
    episode's task the conversation with "episode" (its turns) and the last assistant turn. The conversation is the
    row's own copy: a grader that writes on it reaches no other row, and no later step."""
    conversation = copy.deepcopy(conversation)
    if task.respond is None:
        return conversation, reply_text(tokenizer, samples, row)
    length = samples["lengths"][row].item()
    turns = episode_turns(tokenizer, samples["tokens"][row, :length].tolist(), samples["mask"][row, :length].tolist())
    return dict(conversation, episode=turns), turns[-1]["content"]


def play(task, model, tokenizer, prompts, conversations, G, max_new_tokens, args, **sampling):
    """generate with the task's tool, and for an episode's task its respond answering each conversation's G rows
    (conversations None: no environment, as for an --ask question that is none of the task's problems)."""
    respond = None if conversations is None else episode_responder(task, tokenizer, conversations, G, args.max_turns)
    return generate(model, tokenizer, prompts, G, max_new_tokens, tool=task.tool, respond=respond,
                    max_turn_tokens=args.max_turn_tokens, **sampling)


def code_fingerprint(spec):
    """A Python task's code as config.json records it -> {module, file, sha256}; None for the others."""
    if spec in BUILTIN or spec.endswith(".jsonl"):
        return None
    module = spec.rpartition(":")[0]
    path = module if module.endswith(".py") else getattr(sys.modules.get(module), "__file__", None)
    digest = file_sha256([path]) if path and os.path.isfile(path) else None
    return {"module": module, "file": os.path.abspath(path) if path else None, "sha256": digest}


def file_sha256(paths):
    """The sha256 of these files' bytes, one after another."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()
