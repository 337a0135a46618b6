"""
Tasks: where prompts come from and how replies are scored.

A task is a sequence of conversations in nanochat's shape,
    {"messages": [{"role": "user", "content": str}, {"role": "assistant", "content": str | [parts]}]}
with parts {"type": "text" | "python" | "python_output", "text": str}, plus two scores of a sampled reply:
reward(conversation, reply_text) -> float, the RL signal, and evaluate(conversation, reply_text) -> bool.
Slicing (start/stop/step) picks deterministic subsets, e.g. for evaluation.
"""


class Task:
    def __init__(self, start=0, stop=None, step=1):
        self.start, self.stop, self.step = start, stop, step

    def num_examples(self):
        raise NotImplementedError

    def get_example(self, index):
        raise NotImplementedError

    def __len__(self):
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, (stop - self.start + self.step - 1) // self.step)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} of a task with {len(self)} examples")
        return self.get_example(self.start + i * self.step)

