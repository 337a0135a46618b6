"""
Tasks: where prompts come from and how replies are scored.

A task is a sequence of conversations in nanochat's shape,
    {"messages": [{"role": "user", "content": str}, {"role": "assistant", "content": str | [parts]}]}
with parts {"type": "text" | "python" | "python_output", "text": str}. The trainer asks a task for nothing else:
- reward(conversation, reply_text) -> float, the RL signal;
- reward_terms, reward_parts(conversation, reply_text) -> {name: float}: the reply scored by several named terms
  (--reward-weights combines them); the first term alone is the default reward, so it must equal reward();
- evaluate(conversation, reply_text) -> bool, a correct reply (pass@k counts these);
- eval_metrics(conversation, reply_text) -> {name: float}, logged as eval_<name> next to eval_reward;
- score: the eval metric that ranks runs in --compare (eval_<score>);
- tool: None, or a function that the sampler runs on the text between <|python_start|> and <|python_end|>,
  its string result forced into the reply;
- from_flags(split, args) and default_num_steps(args): how grpo.py's flags build the task (None, Task's default:
  one epoch of the train split);
- fingerprint(): the sha256 of the data files read, or None where the data is a function of the flags alone
  (a resumed run refuses data that changed under it);
- longest_prompt(tokenizer): the longest prompt in tokens, for the memory plan.
Subclassing Task gives sensible defaults for all but __len__, example(index), reward, evaluate and eval_metrics.

--task and --eval-task name a task (task_class): gsm8k, sort, a file ending in .jsonl (tasks/jsonl.py), or your own
class as module:Class or path/to/file.py:Class, imported when a run names it and never otherwise.
"""
import hashlib
import importlib
import importlib.util
import os
import sys


class Task:
    """What the tasks share: no tool, runs ranked by eval_reward, one reward term, and indexing that ends at the
    last example (len and example(index) are the task's own)."""
    tool = None
    score = "reward"
    reward_terms = ("reward",)
    data_flags = {"train": "--task", "test": "--task-test"}  # the flags that name its data (a resume's messages)
    epochs_end = True  # its train split is read in epochs (prompt_indices)

    def reward_parts(self, conversation, reply_text):
        return {"reward": self.reward(conversation, reply_text)}

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


TASK_METHODS = ("from_flags", "reward", "evaluate", "eval_metrics", "__len__", "__getitem__")


def task_class(spec):
    """--task or --eval-task -> the task's class. A ValueError says what is wrong with a spec that names none."""
    from tasks.gsm8k import GSM8K
    from tasks.jsonl import JSONLTask
    from tasks.sort import Sort
    builtin = {"gsm8k": GSM8K, "sort": Sort}
    if spec in builtin:
        return builtin[spec]
    if spec.endswith(".jsonl"):
        return JSONLTask
    module, colon, name = spec.rpartition(":")
    if not (colon and module and name.isidentifier()):
        raise ValueError(f"--task {spec!r} names no task: use gsm8k, sort, a file ending in .jsonl, or your class as "
                         "module:Class or path/to/file.py:Class")
    cls = getattr(import_task_module(module), name, None)
    if cls is None:
        raise ValueError(f"the task module {module} has no {name}: check the class name in --task {spec}")
    missing = [m for m in TASK_METHODS if not callable(getattr(cls, m, None))] if isinstance(cls, type) else ["class"]
    if missing:
        raise ValueError(f"{spec} is not a task: it lacks {', '.join(missing)} (subclass tasks.Task; the interface "
                         "is in tasks/__init__.py and docs/tasks.md)")
    return cls


class GraderError(Exception):
    """A user's grading code failed on a reply (raised, or returned what is no reward): the run stops with this
    one line, naming the function, the reply and what to return instead."""


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
    except ValueError:
        raise
    except Exception as e:  # the user's code: whatever it raises on import, one line
        raise ValueError(f"the module {module} of {flag} could not be imported ({type(e).__name__}: {e})") from None


def task_name(spec):
    """The short name of a task in metric names: gsm8k, a file's stem, a class's name (lower case)."""
    stem = spec.rpartition(":")[2] if ":" in spec and not spec.endswith(".jsonl") else os.path.basename(spec)
    stem = stem[:-len(".jsonl")] if stem.endswith(".jsonl") else stem[:-3] if stem.endswith(".py") else stem
    return "".join(c if c.isalnum() else "_" for c in stem).strip("_").lower() or "task"


def build(spec, split, args):
    """The task a spec names, this split of it, from the run's flags."""
    cls = task_class(spec)
    return cls.from_flags(split, args, spec) if spec.endswith(".jsonl") else cls.from_flags(split, args)


def code_fingerprint(spec):
    """A Python task's code as config.json records it -> {module, file, sha256}; None for the others."""
    if spec in ("gsm8k", "sort") or spec.endswith(".jsonl"):
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
