"""
grpo.py with test-only delays, for the signal tests that run it under torchrun: a step's update, or rank 0's
checkpoint write, made slow enough that a signal lands inside it (a production run's step or network-disk write).

    torchrun --nproc_per_node=2 tests/slowed_run.py <grpo.py flags>

NANOGRPO_TEST_UPDATE_SECONDS: a sleep before each policy update; NANOGRPO_TEST_SAVE_SECONDS: a sleep inside rank 0's
checkpoint write (a stop signal that comes then waits for the write, as for a real one).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
import model  # noqa: E402

update, save = grpo.policy_update, grpo.save_training_state


def slow_update(*a, **k):
    time.sleep(float(os.environ.get("NANOGRPO_TEST_UPDATE_SECONDS", "0")))
    return update(*a, **k)


def slow_save(*a, **k):
    with model.writing():
        time.sleep(float(os.environ.get("NANOGRPO_TEST_SAVE_SECONDS", "0")))
        return save(*a, **k)


if __name__ == "__main__":
    grpo.policy_update, grpo.save_training_state = slow_update, slow_save
    grpo.main()
