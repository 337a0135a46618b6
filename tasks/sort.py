"""
Sort: the user gives a few random digits ("31415"), the assistant must reply with them in sorted order
("11345"). A toy task that a tiny GPT learns from random weights, with RL alone, on a laptop CPU.

The reward is dense, the fraction of positions that hold the right digit, so that even a random policy gets some
signal; evaluate() is the exact match. Both read the reply as it is, digits only: padding of any kind (a space, a
newline, the control characters \\x1c-\\x1f that str.strip() drops) is wrong and costs reward as a wrong digit does
(an extra position), so that no policy learns to pad its answers. A second reward term, "exact" (1 only for a fully
sorted reply), makes the task one where RL from random weights gets no signal: --reward-weights exact=1. The train
split is unlimited (problem i is a pure function of the seed and i); the test split is a fixed held-out set drawn
from a separate stream, per seed.
"""
import random

from tasks import Task


class Sort(Task):
    epochs_end = False  # problems drawn from a seed without end: a step never straddles two epochs
    def __init__(self, split="train", length=5, seed=0, num_test=256):
        if split not in ("train", "test"):
            raise ValueError(f"sort split must be train or test, got {split!r}")
        self.split, self.length, self.seed, self.num_test = split, length, seed, num_test

    @classmethod
    def from_flags(cls, split, args):
        return cls(split, args.sort_length, args.seed)

    @staticmethod
    def default_num_steps(args):
        return 300

    def __len__(self):
        return self.num_test if self.split == "test" else 10 ** 12

    def longest_prompt(self, tokenizer):
        return len(tokenizer.render_for_completion(self[0]))  # every prompt: --sort-length digits, rendered alike

    def example(self, index):
        rng = random.Random(f"sort-{self.split}-{self.seed}-{self.length}-{index}")
        digits = "".join(rng.choice("0123456789") for _ in range(self.length))
        return {"messages": [{"role": "user", "content": digits},
                             {"role": "assistant", "content": "".join(sorted(digits))}]}

    def reward(self, conversation, reply_text):
        target = conversation["messages"][-1]["content"]
        # Extra characters cost as much as missing ones: the denominator is the longer of the two. Not stripped:
        # the answer is the digits alone, and a reply padded with what strip() drops would otherwise score 1.
        return sum(a == b for a, b in zip(reply_text, target)) / max(len(target), len(reply_text))

    reward_terms = ("reward", "exact")

    def reward_parts(self, conversation, reply_text):
        return {"reward": self.reward(conversation, reply_text), "exact": float(self.evaluate(conversation,
                                                                                              reply_text))}

    def evaluate(self, conversation, reply_text):
        return reply_text == conversation["messages"][-1]["content"]

    def eval_metrics(self, conversation, reply_text):
        return {"exact": float(self.evaluate(conversation, reply_text))}
