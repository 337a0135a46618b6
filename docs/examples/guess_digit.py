"""Guess the hidden digit: an environment of several turns (docs/tasks.md). The model says a digit; the user
answers "higher" or "lower" until it is found or 4 guesses are spent; reward (5 - k) / 4 for finding it at guess k.
A policy that ignores the answers gets at most 0.25 (it finds the digit at its k-th guess 1 time in 10 for each k);
binary search gets 0.525. LyingDigit, the same game with the answers swapped, is docs/demo.md's proof that a trained
policy reads them."""
import random

from tasks import Task

GUESSES = 4


def guesses(conversation, reply_text):
    """The assistant's guesses so far: each reply's first digit, or None for a reply without one (a lost guess)."""
    turns = conversation.get("episode", [{"role": "assistant", "content": reply_text}])
    return [next((int(c) for c in turn["content"] if c in "0123456789"), None)
            for turn in turns if turn["role"] == "assistant"]


class GuessDigit(Task):
    def __init__(self, split):
        self.split = split

    @classmethod
    def from_flags(cls, split, args):
        return cls(split)

    def __len__(self):
        return 200 if self.split == "test" else 10 ** 6

    def example(self, index):
        digit = random.Random(f"{self.split}-{index}").randrange(10)  # the hidden digit is the reference answer
        return {"messages": [{"role": "user", "content": "Guess my digit."},
                             {"role": "assistant", "content": str(digit)}]}

    def respond(self, conversation, episode):
        said, digit = guesses({"episode": episode}, ""), int(conversation["messages"][-1]["content"])
        if said[-1] == digit or len(said) >= GUESSES:
            return None  # found, or out of guesses: the episode ends
        return "a digit" if said[-1] is None else "higher" if said[-1] < digit else "lower"

    def reward(self, conversation, reply_text):
        said, digit = guesses(conversation, reply_text), int(conversation["messages"][-1]["content"])
        return next(((GUESSES + 1 - k) / GUESSES for k, g in enumerate(said[:GUESSES], 1) if g == digit), 0.0)

    def evaluate(self, conversation, reply_text):
        return self.reward(conversation, reply_text) > 0


class LyingDigit(GuessDigit):
    """The game that lies: "higher" and "lower" swapped, all else equal."""
    def respond(self, conversation, episode):
        said = super().respond(conversation, episode)
        return {"higher": "lower", "lower": "higher"}.get(said, said)
