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
- from_flags(split, args) and default_num_steps(prompts_per_step): how grpo.py's flags build the task;
- fingerprint(): the sha256 of the data files read, or None where the data is a function of the flags alone
  (a resumed run refuses data that changed under it);
- longest_prompt(tokenizer): the longest prompt in tokens, for the memory plan.
"""


class Task:
    """What the tasks share: no tool, runs ranked by eval_reward, one reward term, and indexing that ends at the
    last example (len and example(index) are the task's own)."""
    tool = None
    score = "reward"
    reward_terms = ("reward",)

    def reward_parts(self, conversation, reply_text):
        return {"reward": self.reward(conversation, reply_text)}

    def fingerprint(self):
        return None

    def longest_prompt(self, tokenizer):
        """Of the first 10,000 examples (all of GSM8K's train split): a bound for the memory plan, not a limit."""
        return max(len(tokenizer.render_for_completion(self[i])) for i in range(min(len(self), 10_000)))

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} of a task with {len(self)} examples")
        return self.example(index)
