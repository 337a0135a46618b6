"""
Several grpo.py runs, one after the other, in each process of one multi-process launch: the rank tests start their
ranks once (an interpreter and `import torch` per rank) instead of once per run. The process group stays up between
the runs; each run is grpo.main with its flags, as `python grpo.py <flags>` runs it.

    python tests/rank_runs.py RUNS.json      # RUNS.json: a list of flag lists; RANK, WORLD_SIZE, ... set as torchrun

An entry {"copy": [RUN_DIR, NEW_DIR, STEP]} instead of flags: rank 0 copies a run folder finished by an earlier
entry without its checkpoint of STEP (as if the run had stopped before saving it: copy_without_step), for a later
entry to resume, and the ranks go on together. An entry {"rehearsal": FLAGS}: the run as rehearsal() has it.
"""
import glob
import json
import os
import shutil
import sys
import zlib
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.distributed as dist  # noqa: E402

import grpo  # noqa: E402
import model  # noqa: E402
from tasks.gsm8k import GSM8K  # noqa: E402


@contextmanager
def rehearsal():
    """What a CPU cannot take of a GPU run from a trained chat checkpoint, stood in for, all else as it is: the
    compiler by the functions it compiles (--compile's static packed shapes, its static decode, its memory plan
    kept; the --slow tests compile for real), and a trained model's GSM8K rewards by a hash of the reply (the
    fixtures' random models solve nothing: every group would be equal, every update without signal)."""
    saved = (model.compiled_hidden, model.compiled_head_logprobs, model.compiled_decode_step, GSM8K.reward)
    model.compiled_hidden = lambda static: model.GPT.hidden
    model.compiled_head_logprobs = lambda: model.GPT.head_logprobs
    model.compiled_decode_step = lambda: model.decode_step
    GSM8K.reward = lambda task, conversation, reply: float(zlib.crc32(reply.encode()) % 3 == 0)
    try:
        yield
    finally:
        model.compiled_hidden, model.compiled_head_logprobs, model.compiled_decode_step, GSM8K.reward = saved


def copy_without_step(run_dir, new_dir, step):
    shutil.copytree(run_dir, new_dir)
    for path in glob.glob(os.path.join(new_dir, "chatrl_checkpoints", "*", f"*_{step:06d}.*")):
        os.remove(path)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    leave = grpo.leave_process_group
    grpo.leave_process_group = dist.barrier  # every run but the last ends with the ranks together, the group kept
    for entry in runs:
        if isinstance(entry, dict) and "copy" in entry:
            if dist.get_rank() == 0:
                copy_without_step(*entry["copy"])
            dist.barrier()
        elif isinstance(entry, dict):
            with rehearsal():
                grpo.main(entry["rehearsal"])
        else:
            grpo.main(entry)
    leave()
