"""Same numbers (issue 82): demo runs of one version of grpo.py against another's, file by file.

    python tests/same_numbers.py run --code /work/base --out /work/same/before   # the old code (7103f36)
    python tests/same_numbers.py run --code . --out /work/same/after             # the restructured code
    python tests/same_numbers.py compare /work/same/before /work/same/after      # a line a run; exit 1 if one differs
    python tests/same_numbers.py resume --code . --out /work/same/before         # the new code resumes an old run

`run` trains each setting of SETTINGS for 12 steps on each seed, one process at a time with --threads 1, into
OUT/<setting>/seed<S>/ (its output in seed<S>.log beside it); first the teacher of the distillations and of LoRA
(OUT/teacher/seed100), then the resume source below. OUT must not hold those runs yet. `compare`: each run of BEFORE
(--partial: of AFTER) against the other side's: metrics.jsonl, samples.jsonl and evals/*.jsonl equal line by line but
for the keys IGNORED (timings, memory); every other file byte-identical (model_/state_*.pt: weights, optimizer state,
reference model), or if a .pt's bytes differ, its first differing entry named; config.json and meta_*.json (settings
and paths, not numbers) only noted.

Resume: `run` also trains grpo seed 0 into OUT/resume-full and copies it to OUT/resume-src as if it had stopped after
its step-6 save (step 12's files removed, as tests/rank_runs.py's copy_without_step). `resume --code NEW --out OUT`
copies resume-src to a fresh OUT/resume-NAME (resume-src is never written), runs NEW's grpo.py there with --resume and
the same flags, and says "exact" (against resume-full), "refused: <its error line>", or what differs. The old code
resuming its own run (`resume --code /work/base --out OUT --name base`) says "exact, same values": every number and
tensor equal, state_000012.pt's bytes not (its pickle's layout: see file_difference).
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

import torch

STEPS, TEACHER_SEED = 12, 100
# Small evals, a save every 6 steps (so a mid-run checkpoint is compared too; the last step is always saved) and
# nothing that reads the clock or the machine: identical on both sides.
COMMON = ["--demo", "--num-steps", str(STEPS), "--threads", "1", "--eval-every", "6", "--eval-examples", "32",
          "--final-eval-examples", "64", "--save-every", "6", "--keep-states", "0"]
TEACHER = "{out}/teacher/seed%d" % TEACHER_SEED
SETTINGS = {  # name -> flags added to COMMON; {out} and {code} are filled in
    "grpo": [],
    "reinforce": ["--algo", "reinforce"],
    "kl-reward": ["--kl-placement", "reward", "--kl-coef", "0.04"],
    # the teacher both ways --teacher takes it: a run folder of this program, a nanochat checkpoint folder
    "distill-sampled": ["--algo", "distill", "--distill-divergence", "sampled", "--teacher", TEACHER],
    "distill-forward": ["--algo", "distill", "--distill-divergence", "forward", "--distill-top-k", "16",
                        "--teacher", TEACHER + "/chatrl_checkpoints/d2"],
    "grpo-distill": ["--distill-coef", "0.5", "--distill-divergence", "forward", "--teacher", TEACHER],
    "gdpo": ["--reward-combination", "normalize-then-sum", "--reward-weights", "reward=1,exact=1"],
    "attempts": ["--attempts", "3", "--max-turn-tokens", "8", "--max-new-tokens", "32", "--eval-max-new-tokens", "32"],
    "episodes": ["--task", "{code}/docs/examples/guess_digit.py:GuessDigit", "--max-turns", "4", "--max-turn-tokens",
                 "1", "--max-new-tokens", "48", "--eval-max-new-tokens", "48", "--aggregation", "token"],
    "lora": ["--lora-rank", "4", "--lora-lr", "1e-2", "--init", TEACHER],  # adapts a trained model (not scratch)
    "ranks2": [],  # launched as 2 gloo processes (RANKS below); the optimizer state sharded, as by default there
    # variants of the objective and the optimizer that the restructure moves or splits apart
    "dapo": ["--algo", "dapo", "--overlong-buffer", "2"],
    "gspo": ["--algo", "gspo"],
    "cispo": ["--algo", "cispo", "--entropy-coef", "0.01"],
    "sapo": ["--algo", "sapo", "--rollout-correction", "tis"],
    "adamw": ["--optimizer", "adamw", "--lr", "1e-3", "--num-minibatches", "2", "--grad-clip", "1.0",
              "--lr-schedule", "cosine", "--warmup-steps", "2", "--no-pack"],
    "muon-v1": ["--optimizer-version", "v1", "--weight-decay", "0.01", "--ref-reset-every", "4"],
}
RANKS = {"ranks2": 2}
# the keys of metrics.jsonl that measure the clock or the machine's memory, not the algorithm: the only ones that
# differ between two runs of the same code (samples.jsonl and evals/ hold none). optimizer_state_mb stays: it is
# counted from the state's sizes. A new key on one side only is a difference.
IGNORED = {"time_sample", "time_logprobs", "time_update", "tokens_per_s", "wall_time", "peak_mem_mb"}


def launch(code, out, setting, seed, extra=(), run_dir=None):
    """One grpo.py run of `setting`, its stdout and stderr to a .log beside its folder -> (exit status, log path)."""
    run_dir = run_dir or os.path.join(out, setting, f"seed{seed}")
    flags = COMMON + [f.format(out=out, code=code) for f in SETTINGS.get(setting, [])] + \
        ["--seed", str(seed), "--runs-dir", os.path.dirname(run_dir), "--run-name", os.path.basename(run_dir)]
    ranks = RANKS.get(setting, 1)
    launcher = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    log = run_dir + ".log"
    with open(log, "w") as f:
        status = subprocess.call(launcher + [os.path.join(code, "grpo.py")] + flags + list(extra), cwd=code, env=env,
                                 stdout=f, stderr=subprocess.STDOUT)
    return status, log


def run(args):
    out, code = os.path.abspath(args.out), os.path.abspath(args.code)
    settings = args.settings.split(",") if args.settings else list(SETTINGS)
    jobs = [(s, int(seed)) for s in settings for seed in args.seeds.split(",")]
    needs_teacher = any(TEACHER in " ".join(SETTINGS[s]) for s in settings)  # distillations, LoRA's start
    if needs_teacher and not os.path.isdir(TEACHER.format(out=out)):
        jobs.insert(0, ("teacher", TEACHER_SEED))  # the default preset on another seed: not the students' weights
    failed = []
    for setting, seed in jobs:
        status, log = launch(code, out, setting, seed)
        print(f"{setting} seed {seed}: {'ok' if status == 0 else f'FAILED (exit {status}, {log})'}", flush=True)
        failed += [setting] if status else []
    if not args.settings and not os.path.isdir(os.path.join(out, "resume-src")):
        status, _ = launch(code, out, "grpo", 0, run_dir=os.path.join(out, "resume-full", "seed0"))
        src = os.path.join(out, "resume-src", "seed0")
        shutil.copytree(os.path.join(out, "resume-full", "seed0"), src)
        for path in glob.glob(os.path.join(src, "chatrl_checkpoints", "*", f"*_{STEPS:06d}.*")):
            os.remove(path)  # as if the run had stopped after step 6's save: --resume goes on from there
        print(f"resume source: {src} ({'ok' if status == 0 else 'FAILED'})")
    sys.exit(1 if failed else 0)


def jsonl_difference(a, b):
    """Two .jsonl files -> None when equal but for IGNORED keys, else where they first differ."""
    rows = [[json.loads(line) for line in open(p)] for p in (a, b)]
    for i, (x, y) in enumerate(zip(*rows)):
        for key in dict.fromkeys(list(x) + list(y)):
            if key not in IGNORED and json.dumps(x.get(key, "<absent>")) != json.dumps(y.get(key, "<absent>")):
                return f"line {i + 1} (step {x.get('step')}) key {key}: {x.get(key)} vs {y.get(key)}"
    return None if len(rows[0]) == len(rows[1]) else f"{len(rows[0])} lines vs {len(rows[1])}"


def entry_difference(x, y, where=""):
    """Two loaded torch.save objects -> the first entry that differs (tensors bit for bit), or None."""
    if torch.is_tensor(x) or torch.is_tensor(y):
        bits = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)  # -0.0 vs 0.0 and NaNs: as stored
        same = torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and \
            torch.equal(bits(x), bits(y))
        return None if same else f"tensor {where or '/'}"
    if isinstance(x, dict) and isinstance(y, dict):
        if list(x) != list(y):
            return f"keys of {where or '/'}: {sorted(map(str, set(x) ^ set(y))) or 'their order'}"
        return next((d for k in x if (d := entry_difference(x[k], y[k], f"{where}/{k}"))), None)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
        return next((d for i, (u, v) in enumerate(zip(x, y)) if (d := entry_difference(u, v, f"{where}/{i}"))), None)
    return None if type(x) is type(y) and repr(x) == repr(y) else f"{where or '/'}: {x!r} vs {y!r}"[:200]


def file_difference(a, b, name, roots):
    """How file `name` of two run folders compares -> (None: the same, "differs" or "note", what). roots: each
    side's OUT, named <OUT> in .json files (each run records its own folder)."""
    if name.endswith(".jsonl"):
        difference = jsonl_difference(a, b)
        return ("differs" if difference else None), difference
    if name.endswith(".json"):  # settings and paths, not numbers: a note
        # (a distillation's inputs/teacher is a hash of the teacher's meta file, which names its OUT: noted too)
        difference = entry_difference(*(json.loads(open(p).read().replace(r, "<OUT>")) for p, r in zip((a, b), roots)))
        return ("note" if difference else None), difference
    if open(a, "rb").read() == open(b, "rb").read():
        return None, None
    if not name.endswith(".pt"):
        return "differs", "bytes differ"
    # torch.save's bytes also follow Python object identity: the pickle writes a string once and refers back to it
    # when the same str object comes again, so equal contents built otherwise (a resumed run's state, read from its
    # file) give other bytes. Then every entry is held side by side: tensors bit for bit, the rest by value.
    entry = entry_difference(*(torch.load(p, map_location="cpu", weights_only=False) for p in (a, b)))
    return ("differs", f"first differing entry: {entry}") if entry else \
        ("note", "bytes differ, every tensor bit for bit and every entry equal (the pickle's layout)")


def run_folders(root):
    return sorted(os.path.relpath(os.path.dirname(p), root)
                  for p in glob.glob(os.path.join(root, "**", "metrics.jsonl"), recursive=True))


def files_of(folder):
    return {os.path.relpath(p, folder) for p in glob.glob(os.path.join(folder, "**"), recursive=True)
            if os.path.isfile(p)}  # not .lock: glob leaves out dot files


def compare_runs(before, after, roots):
    """One run folder of each side (roots: their OUT folders) -> (its line and notes, does it differ)."""
    names_before, names_after = files_of(before), files_of(after)
    if not names_after:
        return f"differs: no run at {after}", True
    differences, notes = [], []
    for name in sorted(names_before | names_after):
        if name not in names_before or name not in names_after:
            differences.append(f"{name} only in {before if name in names_before else after}")
            continue
        kind, what = file_difference(os.path.join(before, name), os.path.join(after, name), name, roots)
        {"differs": differences, "note": notes, None: []}[kind].append(f"{name}: {what}")
    layout = any(n.endswith("(the pickle's layout)") for n in notes)
    line = "differs: " + "; ".join(differences) if differences else "same values" if layout else "same"
    return line + "".join(f"\n    note: {n}" for n in notes), bool(differences)


def compare(args):
    # resume-src is resume-full cut short, resume-NAME what `resume` made of it: not runs of `run`
    rels = [r for r in run_folders(args.after if args.partial else args.before)
            if not r.startswith("resume-") or r.startswith("resume-full")]
    roots = tuple(os.path.abspath(r) for r in (args.before, args.after))
    results = [compare_runs(os.path.join(roots[0], rel), os.path.join(roots[1], rel), roots) for rel in rels]
    for rel, (line, _) in zip(rels, results):
        print(f"{rel}: {line}")
    differing, values = sum(d for _, d in results), sum(line.startswith("same values") for line, _ in results)
    print(f"{len(results) - differing} same ({values} of them in values alone: .pt bytes differ), {differing} differ")
    sys.exit(1 if differing or not results else 0)


def resume(args):
    out, name = os.path.abspath(args.out), f"resume-{args.name}"
    target = os.path.join(out, name, "seed0")
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    shutil.copytree(os.path.join(out, "resume-src", "seed0"), target)
    status, log = launch(os.path.abspath(args.code), out, "grpo", 0, ["--resume"], run_dir=target)
    if status:
        lines = [line for line in open(log).read().splitlines() if "error:" in line]  # grpo.py's, argparse's
        print(f"refused (exit {status}, {len(lines)} error line(s), {log}): {lines[-1] if lines else '?'}")
        sys.exit(2)
    line, differs = compare_runs(os.path.join(out, "resume-full", "seed0"), target, (out, out))
    print(f"{target} against the uninterrupted {out}/resume-full/seed0: {'exact, ' if not differs else ''}{line}")
    sys.exit(1 if differs else 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("run")
    p.add_argument("--code", required=True, help="the checkout whose grpo.py runs")
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--settings", default=None, help=f"comma-separated, of: {','.join(SETTINGS)} (default: all)")
    p = commands.add_parser("compare")
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--partial", action="store_true", help="AFTER reran some of BEFORE's runs: compare those alone")
    p = commands.add_parser("resume")
    p.add_argument("--code", required=True)
    p.add_argument("--out", required=True, help="the OUT of the old code's `run`, holding resume-src and resume-full")
    p.add_argument("--name", default="after", help="the resumed copy goes to OUT/resume-NAME (default: after)")
    args = parser.parse_args()
    {"run": run, "compare": compare, "resume": resume}[args.command](args)
