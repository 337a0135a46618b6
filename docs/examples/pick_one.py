"""Pick the right one of three digits, which the question does not say: docs/demo.md's miniature of retries
(--attempts 3). The question is three distinct digits; one of them, hidden, is right. A reply is graded by its first
character: the hidden digit earns 1, another of the three 0.2, anything else 0. A first attempt is right 1 time in 3
whatever the policy. After "Your answer is wrong", a policy that answers otherwise (another of the three; the k-th
digit at the k-th attempt will do, the feedback saying how many are left) finds it within three attempts; a policy
that repeats itself stays at 1 in 3."""
import random

from tasks import Task


class PickOne(Task):
    def __init__(self, split):
        self.split = split

    @classmethod
    def from_flags(cls, split, args):
        return cls(split)

    def __len__(self):
        return 300 if self.split == "test" else 10 ** 6

    def example(self, index):
        rng = random.Random(f"{self.split}-{index}")
        digits = rng.sample("0123456789", 3)  # the hidden digit is the reference answer
        return {"messages": [{"role": "user", "content": " ".join(digits)},
                             {"role": "assistant", "content": rng.choice(digits)}]}

    def reward(self, conversation, reply_text):
        said, digits = reply_text[:1], conversation["messages"][0]["content"].split()
        return 1.0 if said == conversation["messages"][-1]["content"] else 0.2 if said in digits else 0.0

    def evaluate(self, conversation, reply_text):
        return self.reward(conversation, reply_text) == 1.0
