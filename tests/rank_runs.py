"""
Several grpo.py runs, one after the other, in each process of one multi-process launch: the rank tests start their
ranks once (an interpreter and `import torch` per rank) instead of once per run. The process group stays up between
the runs; each run is grpo.main with its flags, as `python grpo.py <flags>` runs it.

    python tests/rank_runs.py RUNS.json      # RUNS.json: a list of flag lists; RANK, WORLD_SIZE, ... set as torchrun
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.distributed as dist  # noqa: E402

import grpo  # noqa: E402

with open(sys.argv[1]) as f:
    runs = json.load(f)
leave = grpo.leave_process_group
grpo.leave_process_group = dist.barrier  # every run but the last ends with the ranks together, the group kept
for flags in runs:
    grpo.main(flags)
leave()
