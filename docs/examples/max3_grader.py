"""A grader function for docs/examples/max3.jsonl, as --grader takes one (docs/tasks.md):

    python grpo.py --demo --task docs/examples/max3.jsonl --grader docs/examples/max3_grader.py:largest

grpo.py calls it once per reply with the problem's question, the reply's text (without its stop token) and the
line's answer, and trains on the number it returns."""


def largest(question, reply, answer):
    """1.0 when the reply is the answer's digit alone, else 0.0. Only spaces and line breaks around the digit are
    forgiven: a reward that ignored other characters (str.strip() also removes control characters) would be earned
    by padded replies too, and a policy learns to pad."""
    return float(reply.strip(" \n") == answer)
