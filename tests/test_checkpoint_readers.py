"""A run's checkpoints read while it saves them: every reader finds the newest complete step (issue 56)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from model import CheckpointFileError, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVES = 24
# The trainer's own writer (grpo.save_training_state: state, meta, model, then old states pruned), saving a small
# model every "step" as fast as it can; it prints "go" once the first step is there.
WRITER = f"""
import sys, torch
sys.path.insert(0, {ROOT!r})
import grpo
from model import GPT, GPTConfig, Tokenizer
model = GPT(GPTConfig(sequence_len=64, vocab_size=Tokenizer.byte_level().vocab_size, n_layer=2, n_head=2,
                      n_kv_head=2, n_embd=128)).init_weights(0)
for step in range(1, {SAVES} + 1):
    grpo.save_training_state(sys.argv[1], "d2", step, model, None, [], {{}}, keep_states=1)
    if step == 1:
        print("go", flush=True)
"""


def nanochat_load(checkpoint_dir):
    """nanochat's loading order (docs/generations.md): the largest model_<step>.pt, then its meta_<step>.json."""
    step = max(int(m.group(1)) for name in os.listdir(checkpoint_dir) if (m := re.fullmatch(r"model_(\d+)\.pt", name)))
    torch.load(os.path.join(checkpoint_dir, f"model_{step:06d}.pt"), map_location="cpu")
    with open(os.path.join(checkpoint_dir, f"meta_{step:06d}.json")) as f:
        return json.load(f)["step"]


def test_checkpoints_loaded_while_a_run_saves_every_step_are_always_complete(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "go"
    checkpoint_dir = str(tmp_path / "chatrl_checkpoints" / "d2")
    loads, failures, seen = 0, [], set()
    try:
        while writer.poll() is None:
            for load in (lambda: load_checkpoint(checkpoint_dir, log=lambda line: None)[1]["step"],
                         lambda: nanochat_load(checkpoint_dir)):
                try:
                    seen.add(load())
                    loads += 1
                except (OSError, ValueError, RuntimeError) as e:
                    failures.append(f"{type(e).__name__}: {e}")
    finally:
        writer.wait()
    assert writer.returncode == 0
    assert not failures, f"{len(failures)} of {loads + len(failures)} loads failed, e.g. {failures[0]}"
    assert len(seen) >= 5 and loads >= 20  # the reader kept up with the saves: it read many of them
    assert load_checkpoint(checkpoint_dir, log=lambda line: None)[1]["step"] == SAVES


def test_a_model_file_whose_meta_is_not_written_yet_is_skipped_with_a_note(tmp_path):
    from model import GPT, GPTConfig, Tokenizer, save_checkpoint
    model = GPT(GPTConfig(sequence_len=64, vocab_size=Tokenizer.byte_level().vocab_size, n_layer=1, n_head=2,
                          n_kv_head=2, n_embd=32)).init_weights(0)
    for step in (1, 2):
        save_checkpoint(str(tmp_path), step, model)
    os.remove(tmp_path / "meta_000002.json")  # nanochat writes the model first: between its two files
    notes = []
    assert load_checkpoint(str(tmp_path), log=notes.append)[1]["step"] == 1
    assert len(notes) == 1 and "step 2" in notes[0] and "loading step 1" in notes[0]
    os.remove(tmp_path / "meta_000001.json")  # an older step without its meta: a damaged folder, one error
    with pytest.raises(CheckpointFileError, match="meta_000002.json is missing"):
        load_checkpoint(str(tmp_path))
