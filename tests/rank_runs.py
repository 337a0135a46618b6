"""
Several grpo.py runs, one after the other, in each process of one multi-process launch: the rank tests start their
ranks once (an interpreter and `import torch` per rank) instead of once per run. The process group stays up between
the runs; each run is grpo.run_script with its flags, as `python grpo.py <flags>` runs it.

    python tests/rank_runs.py RUNS.json      # RUNS.json: a list of flag lists; RANK, WORLD_SIZE, ... set as torchrun

An entry {"copy": [RUN_DIR, NEW_DIR, STEP]} instead of flags: rank 0 copies a run folder finished by an earlier
entry without its checkpoint of STEP (as if the run had stopped before saving it: copy_without_step), for a later
entry to resume, and the ranks go on together. An entry {"flags": FLAGS, ...} runs FLAGS with test-only changes:
"rehearsal": true, as rehearsal() has it; "update_seconds" / "save_seconds": a sleep before each policy update /
inside rank 0's checkpoint write (slow enough that a signal lands in it, as in a production step or a network-disk
write; the signal tests run this under torchrun).
"""
import glob
import json
import os
import shutil
import sys
import time
import zlib
from contextlib import contextmanager, nullcontext

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


@contextmanager
def slowed(update_seconds=0.0, save_seconds=0.0):
    """Each policy update starts update_seconds late; rank 0's checkpoint writes take save_seconds longer (a stop
    signal that comes then waits for the write, as for a real one)."""
    update, save = grpo.policy_update, grpo.save_training_state

    def slow_update(*a, **k):
        time.sleep(update_seconds)
        return update(*a, **k)

    def slow_save(*a, **k):
        with model.writing():
            time.sleep(save_seconds)
            return save(*a, **k)
    grpo.policy_update, grpo.save_training_state = slow_update, slow_save
    try:
        yield
    finally:
        grpo.policy_update, grpo.save_training_state = update, save


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
            with rehearsal() if entry.get("rehearsal") else nullcontext(), slowed(entry.get("update_seconds", 0.0),
                                                                                  entry.get("save_seconds", 0.0)):
                grpo.run_script(entry["flags"])
        else:
            grpo.run_script(entry)
    leave()
