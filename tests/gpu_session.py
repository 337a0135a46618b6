"""
One GPU session: every GPU number the project waits on, from one command on one H100 or H200, in priority order
within a time budget. Each part's result is written to DIR the moment it is measured (a JSON line in
DIR/results.jsonl, a row of DIR/results.md; appended, flushed and synced), so a call cut at its limit keeps what it
measured.

    python tests/gpu_session.py --prepare .gpu        # here: GSM8K, one fixture, nanochat's code (~6 MiB) into .gpu/
    python3 tests/gpu_session.py --out DIR            # there: every part that fits --budget-s (540 s)
    python tests/gpu_session.py --plan                # each part's expected seconds on a GPU, and its source
    python tests/gpu_session.py --smoke --out DIR     # every part at tiny shapes on the CPU (the suite runs it)
    python3 tests/gpu_session.py --out DIR --parts 6a,6b,6d --budget-s 120   # a second call on the warm machine

The device tool's call, ready to paste, is in docs/performance.md. Parts, in priority order (PLAN holds each one's
expected seconds and where that number comes from):
 1   the suite's CUDA tests (`pytest -m cuda`: the real kernels against the masked paths), a process of its own;
 2   the main command (grpo.py) on a trained fixture with a GPU run's defaults (bf16, compile, captured decode, the
     self-check), 2 steps: its self-check line. 1 and 2 run beside 3a, and end before anything is timed;
 3a  the d20 models (nanochat's GPT with its init, seed 0, and ours holding the same weights), our decode compiled;
 3b  rollouts at d20, graph + compile, at full length and at GSM8K's real lengths, the decode against its bound;
     nanochat's Engine as chat_rl.py calls it on the same weights and lengths (a few questions: its rate);
 4   the compiled d20 update, `grpo` then `reinforce` on 3b's replies, packed at the memory plan's fit for `grpo`
     (`reinforce` at the same size, so that it reuses the compiled pass): seconds, MFU, peak memory next to the
     plan, the top kernels;
 5a  nanochat's chat_rl update loop and our `reinforce` update on the same rows (3b's real-length replies);
 5b  nanochat's base_train step on the same model, compiled (the ceiling of its training speed here);
 6a  the d20 self-check, eager; 6b the other decode modes and one prompt a call; 6c the d20 self-check compiled;
 6d  episodes and a tool: forced tokens (an environment's turn, a tool's output) in the captured and the static
     decode against the dynamic one, and a batch of 3-attempt episodes' rollouts against a single-turn batch.
A part is skipped, with a row saying so, when its expected seconds exceed what is left of the budget; one that
fails writes its error's line and the next part runs. Each part runs in a thread of its own (1 and 2: a process
group too) under its own deadline, MARGIN x its expected seconds (SMOKE_MARGIN x with --smoke), at most what is
left of the budget: at its deadline a process part's group is killed, an in-process part is stopped at its next
line of Python (Stopped raised in its thread); its row says "stopped at N s (estimate M s)" and the next part
starts. A part that a stop does not end (a call in C that never returns) is left behind after STOP_GRACE, its row
saying so. A timed part (3b on) on the GPU waits for parts 1 and 2, which share the GPU, each at most until its
deadline; 3a, 6a and 6c wait for nothing.
--smoke runs every part on the CPU at tiny shapes: eager (compiling on a CPU takes minutes: 6c is skipped), the
flash kernels through their strict stand-ins (tests/kernels.py), the main command in float32 with --self-check.

The budget's clock starts with the process (before torch's import), so --budget-s counts the imports and CUDA's
start too (STARTUP in the plan); more than 0 and at most 560 s (the watchdog, WATCHDOG_AFTER past the budget, at least
WATCHDOG_BEFORE_LIMIT before the device's 600 s limit), else refused in one line. Before torch's import,
the arguments and --out are checked and a watchdog is started, a process of its own (tests/session_watchdog.py: it
acts even where a hung call, torch's import or CUDA's start included, holds this process's interpreter): it ends
the session WATCHDOG_AFTER seconds past the budget (560 s for the default 540, 40 s before the device tool's 600 s
limit): it kills it, every process under it and its parts' process groups, and writes a row for each part it did
not hear the end of and a line: the session ran past its budget, and the part that was running. A session that
ends of itself tells it so ("bye") and then ends every process it started and those they left (it adopts them:
Linux's child subreaper), with their groups; one killed without its bye is seen by the watchdog, which kills what
it had started and writes one line saying it died. A second call, on the machine still warm (about 30 s after a
call), gets --budget-s of what the lend has left less 60 s (docs/performance.md).

--out may be anywhere, inside the checkout too, but not the checkout's root nor a folder git tracks, nor a folder
holding files other than a session's (SESSION_FILES: a previous session's rows are appended to, each row with its
session's id), nor one another session writes now (a lock): refused in one line before anything runs. Part 1's
tests are told to leave the session's own files out of their check that no test writes into the repository
(NANOGRPO_SESSION_FILES, tests/conftest.py), since this process writes rows there beside them.
"""
import argparse
import ctypes
import datetime
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import nullcontext
from types import SimpleNamespace

STARTED = time.monotonic()  # the budget's clock, before torch's import and the benches' (seconds; the standard
# library's above take milliseconds)
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]
import session_watchdog  # noqa: E402  (the standard library alone)

# What the device copy needs from ../shared, relative to it (--prepare lays out the same paths under its folder)
GSM8K = os.path.join("data", "gsm8k")
FIXTURE = os.path.join("fixtures", "nanochat", "smear-backout", "base")  # the newest generation, its tokenizer too
CHECKPOINT = os.path.join(FIXTURE, "chatsft_checkpoints", "d4")
NANOCHAT = os.path.join("peers", "nanochat")
CARRIED = (GSM8K, FIXTURE, os.path.join(NANOCHAT, "nanochat"), os.path.join(NANOCHAT, "LICENSE"))
SHARED = os.path.join(ROOT, "..", "shared")
PREPARED = os.path.join(ROOT, ".gpu")  # where --prepare lays it out by default: ignored, carried
WATCHDOG = os.path.join(TESTS, "session_watchdog.py")

# Each part: id, what, expected seconds on one H100 or H200, on the 2-core CPU with --smoke (beside other work,
# 2026-11-27: parts 1 and 2 are processes importing torch beside this one), and where the GPU number comes from
# (docs/performance.md: H100 of 2026-11-24, H200 of 2026-11-26; "estimate" where none was measured). Parts 1 and 2
# run beside 3a; the rest one after another.
PLAN = [
    ("1", "the suite's CUDA tests", 90, 20, "6 passed in 85-89 s (H200, 2026-11-26); the 2 added since are eager"),
    ("2", "the main command on a fixture, 2 steps", 150, 25,
     "estimate: grpo.py's start and its self-check's compile at d4 (136 s at d20: H200, 2026-11-26), 2 steps"),
    ("3a", "d20 models, the decode step compiled", 100, 1,
     "compiling the decode step 86 s (H100, 2026-11-24; 59 s H200, 2026-11-26), building the models"),
    ("3b", "rollouts at d20 and nanochat's Engine", 40, 3,
     "a call 2.1 s full length (H100, 2026-11-24); the Engine's 4 questions an estimate (~25 s)"),
    ("4", "the compiled d20 update, grpo and reinforce", 190, 12,
     "compiling grpo 138 s, a step 4.3 s; reinforce with the compile warm 13 s, 2.9 s (H200, 2026-11-26)"),
    ("5a", "nanochat's chat_rl update beside ours", 55, 2,
     "estimate: nanochat's eager loop and its optimizer's compile; ours reuses 4's compiled pass"),
    ("5b", "nanochat's base_train step", 100, 2,
     "estimate: like compiling our reinforce update (75 s, H200, 2026-11-26), then 4 steps of 65,536 tokens"),
    ("6a", "the d20 self-check, eager", 15, 1, "8.0 s (H200, 2026-11-26)"),
    ("6b", "the other decode modes, one prompt a call", 40, 1,
     "graph / static / dynamic 2.1 / 4.9 / 5.2 s a call, one prompt a call 12.5 s (H100, 2026-11-24), warm-ups"),
    ("6c", "the d20 self-check, compiled", 140, 0, "135.8 s with its compile (H200, 2026-11-26)"),
    ("6d", "episodes and a tool in the decodes, d20", 45, 3,
     "estimate: 3 float32 calls of 64 rows x 96 tokens, eager, a float64 one and 2 in bf16; 2 x 2 calls of 256 rows "
     "x 256 tokens, graph + compile (2.1 s a call, H100, 2026-11-24)"),
]
STARTUP = (5, 6, "estimate: importing torch, dynamo (through nanochat's code) and the benches 3-4 s on the CPU, "
           "CUDA's start; the header's startup_s measures it")  # before the first part: GPU, --smoke seconds
WHAT = {part: what for part, what, *_ in PLAN}
BACKGROUND = ("1", "2")  # processes of their own, beside 3a
UNTIMED = ("3a", "6a", "6c")  # what they measure is not a speed: on the GPU the others wait for 1 and 2 (which share
# it), each at most until its deadline
MARGIN = 1.5  # a part is stopped at MARGIN x its expected seconds (at most what is left of the budget): the GPU
# numbers the estimates come from vary by a third between machines and days (the decode's compile: 59 / 86 s)
SMOKE_MARGIN = 5.0  # --smoke's: the 2-core CPU's seconds vary 3x with what else it runs (docs/performance.md)
STOP_GRACE = 10.0  # seconds a stopped part has to end (a kernel, a compile's step) before it is left behind
WATCHDOG_AFTER = 20.0  # the watchdog ends the session this long after the budget: a part stopped at the budget's
# end has had its STOP_GRACE, the interpreter its exit
WATCHDOG_BEFORE_LIMIT = 20.0  # and at least this long before the device's limit (its kill would lose the watchdog's
# rows and line): a budget past DEVICE_LIMIT - WATCHDOG_AFTER - WATCHDOG_BEFORE_LIMIT (560 s) is refused
TICK = 0.05  # how often the session looks at its parts' deadlines


secs = session_watchdog.seconds_text  # a budget's seconds as printed: 1.5 s, 540 s


def expected(part, smoke):
    return next(row[3 if smoke else 2] for row in PLAN if row[0] == part)


def deadline(part, smoke):
    """A part's seconds before it is stopped (less where the budget has less left when it starts)."""
    return (SMOKE_MARGIN if smoke else MARGIN) * expected(part, smoke)


def timeline(budget, smoke, parts=WHAT):
    """-> [(part, expected seconds, its end, whether it fits)] if each part takes its expected seconds: 1 and 2 from the
    start-up's end beside 3a, each later part after them and after the part before it. A part that would end past
    the budget does not fit (at run time it is skipped where what is left of the budget is short of its seconds)."""
    rows, start = [], STARTUP[1 if smoke else 0]
    background = clock = start
    for part in (p for p, *_ in PLAN if p in parts):
        seconds = expected(part, smoke)
        if part in BACKGROUND:
            end = start + seconds
            background = max(background, end)
        else:
            end = clock = (clock if part == "3a" else max(clock, background)) + seconds
        rows.append((part, seconds, end, end <= budget))
    return rows


def print_plan(budget, smoke, parts=WHAT):
    """The parts chosen (--parts), each with its expected seconds, its deadline and when it would end."""
    sources = {part: source for part, *_, source in PLAN}
    rows = timeline(budget, smoke, parts)
    where = "on the CPU (--smoke)" if smoke else "on one H100 / H200"
    print(f"expected seconds a part {where}, budget {secs(budget)} s; the start-up {STARTUP[1 if smoke else 0]} s"
          f"{'' if smoke else ': ' + STARTUP[2]}")
    for part, seconds, end, fits in rows:
        print(f"  {part:3s} {seconds:4.0f} s (stopped past {deadline(part, smoke):3.0f} s), ends at {end:4.0f} s "
              f"{'' if fits else '(if time is left) '}{WHAT[part]}: {'' if smoke else sources[part]}")
    planned = [(part, end) for part, _, end, fits in rows if fits]
    print(f"planned: {', '.join(part for part, _ in planned) or 'none'}, ending at "
          f"{max((end for _, end in planned), default=0):.0f} s; if time is left: "
          f"{', '.join(part for part, *_, fits in rows if not fits) or 'none'}")
    print(f"each part is stopped at {SMOKE_MARGIN if smoke else MARGIN:g}x its expected seconds, or where the budget "
          f"ends if sooner; the watchdog ends the session at {budget + WATCHDOG_AFTER:.0f} s (the budget + "
          f"{WATCHDOG_AFTER:.0f} s): give the device call a timeout_s of "
          f"{min(budget + WATCHDOG_AFTER + 40, DEVICE_LIMIT):.0f} s or more")


# ----------------------------------------------------------------------------------------------------------------
# The results: each row appended and synced the moment it is known

def append(path, text):
    """Appends text to path and puts it on the disk now: a process killed a moment later keeps it."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


WRITERS = set()  # the rows' writers at work (the session's end waits for them)
WRITE_LOCK = threading.Lock()  # taken by a writer alone (never stopped): one row's two lines before the next's


def write_both(out, jsonl, md):
    """Appends a row to DIR/results.jsonl and DIR/results.md, both, in a thread of its own: a stop raised in the
    calling thread (a part's deadline, an interrupt) lands after the row's write or before it, never between the
    two files."""
    def both():
        try:
            with WRITE_LOCK:
                append(os.path.join(out, "results.jsonl"), jsonl)
                append(os.path.join(out, "results.md"), md)
        finally:
            WRITERS.discard(writer)
    writer = threading.Thread(target=both, name="a row's write")
    WRITERS.add(writer)
    writer.start()
    writer.join()


def record(s, part, status, seconds, summary, **numbers):
    row = dict(part=part, what=WHAT[part], status=status, seconds=round(seconds, 1), summary=summary,
               clock_s=round(time.monotonic() - s.start, 1), session_id=s.id, **numbers)  # clock_s: the budget's
    # clock at the end; session_id: the header's id (a folder holds the rows of each session that wrote there)
    cells = (part, WHAT[part], status, summary.replace("|", "/").replace("\n", "; "), f"{seconds:.0f} s")
    with s.lock:  # the background parts' threads record too
        if getattr(s, "closed", False):  # the session was interrupted: its line is the last
            return
        write_both(s.out, json.dumps(row, default=str) + "\n", "| " + " | ".join(cells) + " |\n")
    print(f"[{part}] {status} in {seconds:.0f} s: {summary}", flush=True)


def finish(s, part, status, seconds, summary, **numbers):
    """Records a part's last row, once: a part left behind may still return after its row is written (and a stop
    may land while it writes its own). Tells the watchdog it ended."""
    with s.lock:
        if part in s.finished:
            return
        s.finished.add(part)
    beside = [other for other in s.left_behind if other != part and s.runs[other].thread.is_alive()]
    if beside and part not in UNTIMED and status != "skipped":
        summary += (f" (beside part {', '.join(beside)}, stopped but not ended: it may still be running, its share "
                    "of the machine taken from this part)")
    s.numbers[part] = numbers
    record(s, part, status, seconds, summary, **numbers)
    tell_watchdog(s, end=part)


def stopped_at(s, part, when=None):
    """A stopped part's summary: seconds from its start to its stop (now, unless when), and its estimate."""
    when = clock(s) if when is None else when
    return f"stopped at {when - s.runs[part].begin:.0f} s (estimate {expected(part, s.smoke):.0f} s)"


def clock(s):
    return time.monotonic() - s.start


def inside(path, folder):
    """Whether path is folder or under it, links followed (a link outside to a folder inside is inside)."""
    return not os.path.relpath(os.path.realpath(path), os.path.realpath(folder)).startswith("..")


def command_output(argv):
    try:
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_commit(s):
    """The checkout's commit (+ "dirty" with changes not committed); on the device, which gets a copy of the files
    without git, the one --prepare wrote beside the data."""
    commit = command_output(["git", "rev-parse", "--short", "HEAD"])
    if commit:
        return commit + (" + changes not committed" if command_output(["git", "status", "--porcelain"]) else "")
    path = os.path.join(s.shared, "SOURCE")
    return open(path).read().strip() + " (as --prepare found it)" if os.path.isfile(path) else "unknown"


# ----------------------------------------------------------------------------------------------------------------
# The start, before torch's import (the standard library only, milliseconds): the arguments and --out checked, the
# watchdog started, so that a hang in torch's import or CUDA's start is under it too

DEVICE_LIMIT = 600.0  # the device tool's limit on one command (see WATCHDOG_BEFORE_LIMIT)
RELEASE_ON_RETURN = False  # True where main's caller goes on after it (the suite's tests call it in their process):
# the watchdog is released when main returns; else it watches the process until it is gone, its exit included
SESSION_FILES = ("results.jsonl", "results.md", "errors.log", "cuda_tests.log", "main_command.log", "session.log")
# the files a session writes into --out (session.log: the documented command's `| tee`); a folder holding any other
# is refused, and part 1's tests leave these alone out of their check that no test writes into the repository
PR_SET_CHILD_SUBREAPER = 36  # Linux's prctl: the processes the session's children leave behind become its own


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block above it
        self.exit(2, f"error: {message} (--help lists the options)\n")


def budget_seconds(text):
    """--budget-s: seconds, more than 0 and at most the device's limit less WATCHDOG_AFTER and WATCHDOG_BEFORE_LIMIT:
    the watchdog acts at least WATCHDOG_BEFORE_LIMIT before the device's kill."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    most = DEVICE_LIMIT - WATCHDOG_AFTER - WATCHDOG_BEFORE_LIMIT
    if not 0 < value <= most:  # nan and inf fail it too
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds above 0 and at most {most:.0f} (the watchdog ends the session "
            f"{WATCHDOG_AFTER:.0f} s past the budget, at least {WATCHDOG_BEFORE_LIMIT:.0f} s before the device's "
            f"{DEVICE_LIMIT:.0f} s limit)")
    return value


def arguments(argv):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the folder the results go to (results.jsonl, results.md, logs): empty, new, "
                                      "or one a previous session wrote; not the checkout's root nor a folder git "
                                      "tracks")
    parser.add_argument("--budget-s", type=budget_seconds, default=540.0,
                        help=f"seconds for the whole session (at most "
                             f"{DEVICE_LIMIT - WATCHDOG_AFTER - WATCHDOG_BEFORE_LIMIT:.0f})")
    parser.add_argument("--parts", default=",".join(WHAT), help="comma-separated, of " + ", ".join(WHAT))
    parser.add_argument("--shared", help="the folder holding data/gsm8k, fixtures/nanochat and peers/nanochat "
                                         "(default: .gpu where --prepare made it, else ../shared; --prepare copies "
                                         "from ../shared)")
    parser.add_argument("--smoke", action="store_true", help="every part on the CPU at tiny shapes")
    parser.add_argument("--plan", action="store_true", help="print the parts' expected seconds and exit")
    parser.add_argument("--prepare", metavar="DIR", help="lay out the device copy's data under DIR and exit")
    args = parser.parse_args(argv)
    args.parts = args.parts.split(",")
    if "" in (part.strip() for part in args.parts):
        parser.error(f"--parts {args.parts and ','.join(args.parts)!r} has an empty entry: name parts separated by "
                     f"commas, of {', '.join(WHAT)}")
    unknown = [part for part in args.parts if part not in WHAT]
    if unknown:
        parser.error(f"no part {', '.join(unknown)}: the parts are {', '.join(WHAT)}")
    if not (args.out or args.plan or args.prepare):
        parser.error("--out DIR is needed (or --plan, or --prepare DIR)")
    return args


def refuse(out, why, do):
    sys.exit(f"error: --out {out}: {why}: {do}")


def claim_out(out):
    """Checks --out, makes it, and locks it for this session (flock on the folder, held until the session's end) ->
    the folder's descriptor. Refused in one line: a file; the checkout's root or a folder git tracks (whose files
    the CUDA tests' check that nothing is written into the repository would see change); a folder holding files of
    its own (a session's are SESSION_FILES: a previous session's rows are appended to); one that cannot be made or
    written; one another session is writing."""
    fresh = "pass a folder of its own (made if missing), e.g. --out /tmp/gpu-session, or runs/gpu-session in the " \
            "checkout (git ignores runs/)"
    if os.path.exists(out) and not os.path.isdir(out):
        refuse(out, "is a file, not a folder", fresh)
    real = os.path.realpath(out)
    if real == os.path.realpath(ROOT):
        refuse(out, "is the checkout's root", fresh)
    if inside(real, ROOT) and os.path.isdir(real):
        tracked = command_output(["git", "ls-files", "--", os.path.relpath(real, os.path.realpath(ROOT))])
        if tracked:
            refuse(out, f"is a folder git tracks ({len(tracked.splitlines())} files)", fresh)
    if os.path.isdir(real):
        others = sorted(name for name in os.listdir(real) if name not in SESSION_FILES)
        if others:
            refuse(out, f"holds files that are not a session's ({', '.join(others[:3])}"
                        f"{', ...' if len(others) > 3 else ''})", "pass an empty folder, a new one, or one a previous "
                                                                  "session wrote (its rows are kept, ours appended)")
        odd = sorted(name for name in SESSION_FILES if os.path.lexists(os.path.join(real, name)) and
                     not os.path.isfile(os.path.join(real, name)))
        if odd:
            refuse(out, f"holds {', '.join(odd)} that is not a file", "pass an empty folder, a new one, or one a "
                                                                    "previous session wrote")
    try:
        os.makedirs(real, exist_ok=True)
        open(os.path.join(real, "results.md"), "a").close()
        descriptor = os.open(real, os.O_RDONLY)
    except OSError as e:
        refuse(out, f"cannot be made or written ({e.strerror or e})", "pass a folder you can write, e.g. --out "
                                                                      "/tmp/gpu-session")
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        refuse(out, "another session is writing there now", "wait for it, or pass another folder")
    return descriptor


def child_subreaper(on):
    """Makes this process the one the processes its children leave behind (an orphan: `sh -c "x &"`) are given to,
    rather than init, so that the session's end finds and ends them (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
    except (AttributeError, OSError):
        pass


def begin(argv, started):
    """The session's start, before anything else (as a script: before torch's import): the arguments checked (--plan
    printed), --out claimed, the watchdog started. -> what main goes on with (done: nothing more to do)."""
    args = arguments(argv)
    early = SimpleNamespace(args=args, done=False, watchdog=None, descriptor=None, started=started,
                            lock=threading.Lock(), id=None, existing=set(), temps=set(), handlers=None)
    if args.plan:
        print_plan(args.budget_s, args.smoke, args.parts)
        early.done = True
        return early
    if args.prepare:
        return early
    early.descriptor = claim_out(args.out)
    early.id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
    early.existing = set(session_watchdog.descendants(os.getpid()))  # (in a test's process: the ones before it)
    child_subreaper(True)
    settings = dict(out=os.path.realpath(args.out), pid=os.getpid(), start=started,
                    at=started + args.budget_s + WATCHDOG_AFTER, budget_s=args.budget_s, id=early.id,
                    parts=[(part, what) for part, what in WHAT.items() if part in args.parts])
    # -I -S: the standard library alone, started in milliseconds; a session of its own, so that a signal to the
    # session's process group (Ctrl-C, `timeout`, kill -- -PGID) leaves it to end what the session left
    early.watchdog = subprocess.Popen([sys.executable, "-I", "-S", WATCHDOG, json.dumps(settings)],
                                      stdin=subprocess.PIPE, start_new_session=True)
    if threading.current_thread() is threading.main_thread():  # SIGTERM as Ctrl-C: the session says it was
        # interrupted, with the parts running, and ends its children (restored at its end: a test's process)
        early.handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGTERM, interrupt)
    return early


class Interrupted(BaseException):
    """Raised in the session's main thread by SIGTERM (SIGINT raises KeyboardInterrupt)."""


def interrupt(number, frame):
    raise Interrupted(signal.Signals(number).name)


def interrupted(early, s, e):
    """The session interrupted (SIGINT, SIGTERM): each running part's row, then a line naming them; no more rows
    after it (the parts' threads may still return). Further signals are ignored: the session ends its children."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
    how = "SIGINT, Ctrl-C" if isinstance(e, KeyboardInterrupt) else str(e)
    now = time.monotonic() - early.started
    running = [] if s is None else [part for part, run in s.runs.items() if not run.ended.is_set()]
    for part in running:
        finish(s, part, "stopped", clock(s) - s.runs[part].begin, f"{stopped_at(s, part)}: the session was "
               f"interrupted ({how})")
    if s is not None:
        s.closed = True
    which = f"part {', '.join(running)} {'was' if len(running) == 1 else 'were'} running" if running else \
        "no part was running" if s is not None and s.runs else "no part had started"
    line = f"the session was interrupted ({how}) at {now:.0f} s; {which}: its processes ended"
    with early.lock:
        write_both(early.args.out, json.dumps(dict(interrupted=dict(line=line, clock_s=round(now, 1),
                                                                    running=running, session_id=early.id))) + "\n",
                   f"\n{line}\n")
    print(line, file=sys.stderr, flush=True)


def end(early):
    """The session's end, whatever ended it (but the watchdog): the watchdog told its rows are complete ("bye"):
    it goes on watching this process until it is gone (its exit: atexit hooks, threads that are not daemons), under
    the same deadline; where main's caller goes on (RELEASE_ON_RETURN) it is released and waited for. Then every
    process the session started, and those they left, ended with their process groups (a compile's workers, a
    part's children: one holding the output open would keep a `| tee` waiting), the parts' temporary folders
    removed; --out unlocked."""
    watchdog = early.watchdog
    if early.handlers and threading.current_thread() is threading.main_thread():  # no interrupt inside the end
        for number in early.handlers:
            signal.signal(number, signal.SIG_IGN)
    for writer in list(WRITERS):  # rows being written (a part's thread stopped while its row was written)
        writer.join(5)
    if watchdog is not None:
        with early.lock:
            try:
                watchdog.stdin.write(json.dumps(dict(bye=True, release=RELEASE_ON_RETURN)).encode() + b"\n")
                watchdog.stdin.close()
            except (OSError, ValueError):  # it had ended
                print(f"note: the watchdog had ended (exit status {watchdog.poll()})", flush=True)
        if RELEASE_ON_RETURN:
            watchdog.wait()
    compile_workers = getattr(sys.modules.get("torch._inductor.async_compile"), "shutdown_compile_workers", None)
    if compile_workers is not None:  # inductor's compile workers asked to end first (else its exit's own shutdown
        # would write to the pipes of the killed ones, and warn), for at most STOP_GRACE: then killed with the rest
        asked = threading.Thread(target=compile_workers, name="compile workers' end", daemon=True)
        asked.start()
        asked.join(STOP_GRACE)
    spare = early.existing | ({watchdog.pid} if watchdog is not None and watchdog.poll() is None else set())
    killed = session_watchdog.end_tree(os.getpid(), spare=spare)
    for path in list(early.temps):
        shutil.rmtree(path, ignore_errors=True)
    waited = time.monotonic() + 2
    for pid in killed:  # the ones this process adopted, or started and no one waits for: reaped
        while time.monotonic() < waited:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # not its child, or reaped (by its Popen)
                break
            time.sleep(0.01)
    child_subreaper(False)
    if early.descriptor is not None:
        os.close(early.descriptor)  # (the lock with it)
    if early.handlers and threading.current_thread() is threading.main_thread():
        for number, handler in early.handlers.items():
            signal.signal(number, handler)


if __name__ == "__main__":
    EARLY = begin(sys.argv[1:], STARTED)
    if EARLY.done:
        sys.exit(0)

try:  # a signal in the imports (seconds) is an interrupt as any other: said, the processes ended, its exit status
    import grpo  # noqa: E402, F401  (before torch: it bounds how long OpenMP's waiting threads spin, as in a run)
    import torch  # noqa: E402

    import bench_gpu  # noqa: E402
    import bench_vs_nanochat  # noqa: E402
    import model as model_module  # noqa: E402
    from bench_shared import stopping_at, timed  # noqa: E402
    from kernels import flash_on_the_cpu  # noqa: E402
except (KeyboardInterrupt, Interrupted) as e:
    if __name__ != "__main__":
        raise
    interrupted(EARLY, None, e)
    end(EARLY)
    sys.exit(128 + (signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.Signals[str(e)]))


def header(s):
    driver = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if s.cuda else "-"
    info = dict(id=s.id, device=s.gpu.name, driver=driver or "unknown", torch=torch.__version__,
                cuda=torch.version.cuda, commit=source_commit(s), budget_s=s.budget,
                watchdog_s=s.budget + WATCHDOG_AFTER, smoke=s.smoke, out=os.path.abspath(s.out),
                out_in_checkout=inside(s.out, ROOT), startup_s=round(time.monotonic() - s.start, 1),
                started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with s.lock:
        write_both(s.out, json.dumps(dict(session=info)) + "\n", f"\n## GPU session {s.id}, {info['started']}\n\n"
               f"{info['device']}, driver {info['driver']}, torch {info['torch']} (CUDA {info['cuda']}), commit "
               f"{info['commit']}; budget {secs(s.budget)} s, {info['startup_s']:.0f} s of it spent starting (imports, "
               f"CUDA), the watchdog at {info['watchdog_s']:.0f} s; each part stopped at "
               f"{SMOKE_MARGIN if s.smoke else MARGIN:g}x its estimate; out {info['out']}"
               f"{' (inside the checkout)' if info['out_in_checkout'] else ''}"
               f"{' (--smoke, on the CPU)' if s.smoke else ''}\n\n| part | what | status | result | "
               "seconds |\n| --- | --- | --- | --- | ---: |\n")
    tell_watchdog(s, header=True)
    print(f"session: {info}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Parts 1 and 2: processes of their own

def run_logged(s, part, argv, log, env=None):
    """-> (exit status, output lines) of argv run from the repository's root, its output going to DIR/log as it
    comes; in a process group of its own (pytest's, grpo.py's compile workers), killed whole at the part's deadline
    (status None) or when the part is stopped. A group, not a session: the device tool ends what a call leaves."""
    path = os.path.join(s.out, log)
    with open(path, "a", encoding="utf-8") as out:  # a previous session's log kept: this one's after its header
        out.write(f"\n=== session {s.id}, part {part}: {' '.join(argv)}\n")
        out.flush()
        offset = out.tell()
        process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, process_group=0)
        tell_watchdog(s, group=process.pid)
        status = None
        try:  # a wait with a timeout polls in Python, where a stop lands; without one it would block in C
            status = process.wait(timeout=max(0.0, s.runs[part].deadline - clock(s)))
        except subprocess.TimeoutExpired:
            pass
        finally:  # the group killed whole, what its leader left running too
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # none of it left
                pass
            if status is None:
                process.wait()
            tell_watchdog(s, ungroup=process.pid)
    with open(path, "rb") as f:
        f.seek(offset)
        return status, f.read().decode("utf-8", errors="replace").splitlines()


def outcome(s, part, status, log):
    """-> (a process part's status, and its summary where it was stopped or failed without its line)."""
    if status is None:
        return "stopped", f"{stopped_at(s, part)}: what it wrote is in {log}"
    return ("ok" if status == 0 else "failed"), f"exit status {status}, no summary line: see {log}"


def cuda_test_files():
    """The suite's files that hold CUDA tests (pytest collects only these: each file collected costs seconds)."""
    return sorted(os.path.join("tests", name) for name in os.listdir(TESTS) if name.startswith("test_") and
                  name.endswith(".py") and "pytest.mark.cuda" in open(os.path.join(TESTS, name)).read())


def part_cuda_tests(s):
    # pytest's plugins found by their entry points stay out: the CUDA tests use none, and loading them (hypothesis)
    # costs seconds of a process that runs beside the timed parts' start
    # NANOGRPO_SESSION_FILES: this process writes its rows (and pytest its log) into --out beside the tests; the
    # suite's check that no test writes into the repository leaves these files alone out where --out is inside it
    # (tests/conftest.py), and sees any other file a test writes there
    env = dict(NANOGRPO_FIXTURES=os.path.join(s.shared, "fixtures", "nanochat"), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               NANOGRPO_SESSION_FILES=json.dumps([os.path.join(os.path.realpath(s.out), name)
                                                  for name in SESSION_FILES]))  # (JSON: a path may hold a ':')
    if s.smoke:  # the plumbing alone: the tests skip without a GPU (one thread: see part 2)
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    status, lines = run_logged(s, "1", [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                        *cuda_test_files()], "cuda_tests.log", env)
    last = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
    counts = {word.rstrip("s"): int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
    failing = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    status, otherwise = outcome(s, "1", status, "cuda_tests.log")
    summary = (last.strip("= ") if last and status != "stopped" else otherwise) + \
        "".join(f"; {line}" for line in failing)
    # the tests by name alone: how much of each reason pytest prints depends on the terminal's width
    failed = [line.split(" - ", 1)[0] for line in failing]
    return dict(status=status, summary=summary, counts=counts, failed=failed)


def temporary_folder(s):
    """-> a new folder under /tmp, removed by the part (then untold), by the session's end, or, where the session
    dies or is ended by its watchdog, by the watchdog."""
    path = tempfile.mkdtemp(prefix="gpu_session_runs_")
    s.temps.add(path)
    tell_watchdog(s, temp=path)
    return path


def part_main_command(s):
    checkpoint, gsm8k = os.path.join(s.shared, CHECKPOINT), os.path.join(s.shared, GSM8K)
    if not os.path.isdir(checkpoint) or not os.path.isfile(os.path.join(gsm8k, "train.jsonl")):
        return dict(status="skipped", summary=f"no fixture at {checkpoint} or no GSM8K at {gsm8k} (--prepare)")
    size = ["--num-steps", "2", "--prompts-per-step", "2", "--max-new-tokens", "64"]
    if s.smoke:  # a CPU run, its self-check asked for (on the GPU it is the default); one thread, as tiny shapes
        # gain nothing from a second one, which would only take a core from this process beside it
        size = ["--device", "cpu", "--self-check", "--num-steps", "1", "--prompts-per-step", "1", "--num-samples", "2",
                "--max-new-tokens", "8", "--threads", "1"]
    runs = temporary_folder(s)  # a run's checkpoints stay out of DIR
    try:
        status, lines = run_logged(s, "2", [sys.executable, "grpo.py", "--init", checkpoint, "--task", "gsm8k",
                                            "--gsm8k-dir", gsm8k, "--eval-every", "0", "--log-samples", "0",
                                            "--no-plot", "--runs-dir", runs, "--run-name", "gpu-session"] + size,
                                   "main_command.log")
    finally:
        shutil.rmtree(runs, ignore_errors=True)
        s.temps.discard(runs)
        tell_watchdog(s, untemp=runs)
    check = next((line for line in lines if line.startswith(("self-check:", "error:"))), None)
    steps = [line for line in lines if line.startswith("step ")]
    exit_status, (status, otherwise) = status, outcome(s, "2", status, "main_command.log")
    cut = otherwise if status == "stopped" else None
    return dict(status=status, summary=" / ".join(filter(None, [cut, check or "no self-check line", *steps[-1:]])),
                self_check=check, steps=steps, exit_status=exit_status)


# ----------------------------------------------------------------------------------------------------------------
# Parts 3-6: this process, one model pair, compiles shared

def models(s):
    """-> (nanochat's GPT or None, ours): the session's one pair, built on first use, with the same weights
    (nanochat's init); without nanochat's code, ours alone (tests/bench_gpu.py's random model)."""
    if s.ours is None:
        if s.vs.nc:
            s.theirs, s.ours, s.logits_apart = bench_vs_nanochat.the_same_random_weights(s.vs)
        else:
            s.ours = bench_gpu.random_model(s.gpu, s.vs.shape)
        s.ours.eval()
    return s.theirs, s.ours


def their_attention(s):
    """-> the attention nanochat ran in this process, and its compute dtype. Its FA3 comes from the `kernels` package
    (a hub that fetches the kernel), imported by that name: in this process `kernels` is tests/kernels.py, the
    suite's stand-ins, first on the path, so nanochat falls back to PyTorch's SDPA here, whatever the machine has
    (tests/bench_vs_nanochat.py run alone says which it got)."""
    attention, common = s.vs.nc.flash_attention, sys.modules["nanochat.common"]
    dtype = str(common.COMPUTE_DTYPE).replace("torch.", "")
    if getattr(attention, "USE_FA3", attention.HAS_FA3):
        return f"FA3, {dtype}"
    shadowed = os.path.dirname(getattr(sys.modules.get("kernels"), "__file__", None) or "") == TESTS
    return f"SDPA ({'tests/kernels.py shadows the package FA3 comes from' if shadowed else 'no FA3'}), {dtype}"


def kind(attention):
    """-> an attention's name alone (its why and dtype left out): a ratio's label."""
    return attention.split(",")[0].split(" (")[0]


def our_attention(decode):
    """-> the attention our model ran (bf16 autocast, as a run's): torch's flash varlen_attn (packed passes; the
    static decode step over each row's written columns), its strict CPU stand-in (--smoke), or SDPA (a decode step
    the flash kernel refused reads the whole cache, masked; no varlen_attn in this torch)."""
    if decode and model_module.DECODE_FLASH["failed"]:
        name = "SDPA (masked: the flash kernel refused the decode step)"
    elif model_module.varlen_attn is None:
        name = "SDPA"
    elif getattr(model_module.varlen_attn, "__module__", None) == "kernels":
        name = "varlen stand-in (tests/kernels.py)"
    else:
        name = "varlen (flash)"
    return f"{name}, bf16 autocast"


def part_models(s):
    theirs, ours = models(s)
    label, decode, compiled = s.modes[0]
    ours.use_compile = compiled
    _, seconds = timed(lambda: bench_gpu.rollouts(s.gpu, ours, s.prompts[:2], decode), s.cuda)
    params = sum(p.numel() for p in ours.parameters())
    same = "nanochat's code not found: ours alone" if theirs is None else \
        f"nanochat's init read into ours, logits {s.logits_apart:.1e} apart"
    return dict(summary=f"{params / 1e6:.3g}M parameters, {same}; the first decode call ({label}) {seconds:.1f} s",
                parameters=params, logits_apart=s.logits_apart, decode_compile_s=seconds)


def part_rollouts(s):
    g, (theirs, ours) = s.gpu, models(s)
    bandwidth = bench_gpu.copy_bandwidth(g)
    label = s.modes[0][0]
    calls, _ = bench_gpu.rollout_modes(g, ours, s.prompts, s.modes)
    s.samples, seconds = calls[label]
    prefill, step, bound = bench_gpu.decode_step(g, ours, s.prompts, seconds, label, bandwidth)
    tokens = len(s.prompts) * g.samples * g.new_tokens
    numbers = dict(bandwidth_gbs=bandwidth / 1e9, full_tokens_s=tokens / seconds, full_s=seconds,
                   decode_step_ms=1e3 * step, decode_bound_ms=1e3 * bound, decode_share=bound / step)
    summary = [f"{label}, full length: {tokens / seconds:,.0f} tokens/s ({seconds:.2f} s), a decode step "
               f"{1e3 * step:.2f} ms, bound {1e3 * bound:.2f} ms: {bound / step:.0%}"]
    s.lengths = bench_gpu.real_length_lengths(g, len(s.prompts) * g.samples)
    if s.lengths is not None:
        s.real_samples, call, decode, bound = bench_gpu.real_length_rollouts(
            g, ours, s.prompts, s.lengths, bandwidth, prefill, s.modes[:1])[label]
        real = int(s.lengths.sum())
        numbers.update(real_tokens_s=real / call, real_s=call, real_decode_s=decode, real_bound_s=bound,
                       real_decode_share=bound / decode)
        summary.append(f"real lengths: {real / call:,.0f} tokens/s ({call:.2f} s), decode {decode:.2f} s, bound "
                       f"{bound:.2f} s: {bound / decode:.0%}")
        if theirs is not None:
            some = s.prompts[:s.engine_prompts]
            _, their_seconds = bench_vs_nanochat.engine_rollouts(s.vs, theirs, some, s.lengths)
            theirs_rate = int(s.lengths[:len(some) * g.samples].sum()) / their_seconds
            theirs_ran, ours_ran = their_attention(s), our_attention(decode=True)
            numbers.update(engine_tokens_s=theirs_rate, engine_s=their_seconds,
                           ours_over_engine=real / call / theirs_rate, their_attention=theirs_ran,
                           our_attention=ours_ran)
            questions = f"{len(some)} question{'s' * (len(some) != 1)}"
            summary.append(f"nanochat's Engine ({questions}; {theirs_ran}) {theirs_rate:,.0f} tokens/s: ours "
                           f"({ours_ran}) {real / call / theirs_rate:.1f}x, {kind(ours_ran)} against "
                           f"{kind(theirs_ran)}")
    return dict(summary="; ".join(summary), **numbers)


def shown(value, form):
    return "-" if value is None else form.format(value)


def step_numbers(step, sample_s):
    """-> (a row's line, its numbers) of one training step (bench_gpu.training_step), sampled in sample_s."""
    numbers = {k: step[k] for k in ("logprobs_s", "update_s", "compile_s", "mfu", "peak_gib", "plan_gib",
                                    "micro_batches", "kernels")}
    numbers.update(sample_s=sample_s, step_s=None if sample_s is None else
                   sample_s + step["logprobs_s"] + step["update_s"])
    kernels = ", ".join(f"{name[:40]} {share:.0%}" for name, _, share in (step["kernels"] or [])[:4])
    summary = (f"{step['size']} tokens a pass: update {step['update_s']:.2f} s, MFU {shown(step['mfu'], '{:.1%}')}, "
               f"old+ref log-probs {step['logprobs_s']:.2f} s, step {shown(numbers['step_s'], '{:.2f} s')} "
               f"(sampling: 3b's full-length call); peak {shown(step['peak_gib'], '{:.1f} GiB')}, plan "
               f"{step['plan_gib']:.1f} GiB; compile {shown(step['compile_s'], '{:.0f} s')}; top kernels: "
               f"{kernels or '-'}")
    return summary, numbers


def part_update(s):
    g, (theirs, ours) = s.gpu, models(s)
    if theirs is not None:
        theirs.cpu()  # the GPU holds the bench's one model, as in the earlier measurements
    _, s.tokens_per_pass = bench_gpu.fitted_sizes(g, ours, "grpo", s.cuda)
    sample_s = s.numbers.get("3b", {}).get("full_s")
    for algo in ("grpo", "reinforce"):
        # on the CPU, reading a profile's ~17,000 op events back takes seconds: --smoke rehearses it once
        g.profile = s.cuda or algo == "grpo"
        begin = time.monotonic()
        step = bench_gpu.training_step(g, ours, s.prompts, algo, s.cuda, ("tokens", s.tokens_per_pass),
                                       samples=s.samples)
        summary, numbers = step_numbers(step, sample_s if s.samples is not None else step["sample_s"])
        numbers.update(algo=algo, algo_s=time.monotonic() - begin)  # its compile, warm-up and timed steps
        if algo == "grpo":  # kept now, whatever becomes of reinforce's step; this row's seconds are grpo's alone
            record(s, "4", "ok", numbers["algo_s"], f"grpo ({numbers['algo_s']:.0f} s, this row's seconds): "
                   f"{summary}", **numbers)
    s.update_mfu = numbers["mfu"]
    # the part's last row: its seconds are the whole part's (the pass size's fit, grpo's, reinforce's)
    return dict(summary=f"reinforce ({numbers['algo_s']:.0f} s; this row's seconds: the whole part, the pass size's "
                        f"fit and grpo's included): {summary}", **numbers)


def part_vs_chat_rl(s):
    vs, (theirs, ours) = s.vs, models(s)
    if theirs is None:
        return dict(status="skipped", summary=f"nanochat's code is not at {vs.nanochat}")
    theirs.to(s.device)
    if s.real_samples is None:  # 3b did not run: replies at the real lengths now (full length without GSM8K)
        lengths = bench_gpu.real_length_lengths(s.gpu, len(s.prompts) * vs.num_samples)
        with stopping_at(lengths, vs.tokenizer.assistant_end) if lengths is not None else nullcontext():
            s.real_samples = bench_gpu.rollouts(s.gpu, ours, s.prompts)
    rows = bench_vs_nanochat.engine_rows(vs, s.real_samples, s.prompts)
    their_s, our_s, real = bench_vs_nanochat.update_side_by_side(vs, theirs, ours, s.prompts, rows,
                                                                 s.tokens_per_pass)
    theirs_ran, ours_ran = their_attention(s), our_attention(decode=False)
    return dict(summary=f"{len(rows)} rows, {real} tokens: chat_rl.py's loop ({theirs_ran}) {their_s:.2f} s "
                        f"({real / their_s:,.0f} tokens/s), our reinforce update ({ours_ran}) {our_s:.2f} s: "
                        f"{their_s / our_s:.1f}x, {kind(ours_ran)} against {kind(theirs_ran)}",
                chat_rl_s=their_s, ours_s=our_s, tokens=real, ratio=their_s / our_s, their_attention=theirs_ran,
                our_attention=ours_ran)


def part_vs_base_train(s):
    vs, (theirs, ours) = s.vs, models(s)
    if theirs is None:
        return dict(status="skipped", summary=f"nanochat's code is not at {vs.nanochat}")
    ours.cpu()  # nanochat's batch of 32 full rows is sized for a GPU that holds its model alone
    theirs.to(s.device)
    try:
        tokens_s, mfu, first_s = bench_vs_nanochat.pretrain_step(vs, theirs)
    finally:
        theirs.cpu()
        ours.to(s.device)
    theirs_ran, ours_ran = their_attention(s), our_attention(decode=False)
    ratio = "" if mfu is None or s.update_mfu is None else \
        f"; our reinforce update's MFU (4; {ours_ran}) {s.update_mfu / mfu:.2f}x, " \
        f"{kind(ours_ran)} against {kind(theirs_ran)}"
    return dict(summary=f"{vs.pretrain_rows} rows of {vs.seq_len} ({theirs_ran}): {tokens_s:,.0f} tokens/s, MFU "
                        f"{shown(mfu, '{:.1%}')}{ratio}; first step (its compile) {first_s:.0f} s",
                tokens_s=tokens_s, mfu=mfu, first_step_s=first_s, their_attention=theirs_ran, our_attention=ours_ran)


def part_self_check(s, compiled):
    if compiled and not s.cuda:
        return dict(status="skipped", summary="compiling on a CPU takes minutes: left to the GPU")
    lines = bench_gpu.fast_path_check(s.gpu, models(s)[1], compiled=(compiled,))
    return dict(summary=" / ".join(lines), lines=lines)


def part_decode_modes(s):
    g, ours = s.gpu, models(s)[1]
    modes = [("graph", "graph", False)] * s.cuda + [("static", "static", False), ("dynamic", "dynamic", False)]
    calls, _ = bench_gpu.rollout_modes(g, ours, s.prompts, modes)
    tokens = len(s.prompts) * g.samples * g.new_tokens
    _, per_prompt = timed(lambda: [bench_gpu.rollouts(g, ours, [p]) for p in s.prompts], s.cuda)
    rates = {label: tokens / seconds for label, (_, seconds) in calls.items()}
    rates["one prompt a call"] = tokens / per_prompt
    return dict(summary="; ".join(f"{label} {rate:,.0f} tokens/s" for label, rate in rates.items()), tokens_s=rates)


def part_episodes(s):
    g, ours = s.gpu, models(s)[1]
    # forced tokens in each decode against the dynamic one, in float32 (bf16's rounding would part the sampled tokens
    # of kernels that sum in another order; the graph replays the static step's kernels, so in bf16 it is compared
    # with the static decode, bit for bit). On the CPU the graph's step runs uncaptured: the static decode's.
    prompts, new_tokens = s.prompts[:4], 96 if s.cuda else 60
    decodes = ("static", "graph") if s.cuda else ("static",)
    f32 = bench_gpu.decodes_compared(ours, g.tokenizer, prompts, g.samples, new_tokens, decodes)
    # each decode's own distance from the float64 decode at most twice the dynamic one's: 3x that apart at most
    bound = None if f32["exact"] is None else 3 * f32["exact"]
    agree = all(f32[d]["equal"] == f32["rows"] and (bound is None or f32[d]["apart"] <= bound) for d in decodes)
    summary = [f"respond + tool, {f32['rows']} rows x {new_tokens} ({f32['forced']} forced columns), float32: "
               + " / ".join(f"{d} {f32[d]['equal']}/{f32['rows']} rows equal, log-probs "
                            f"{shown(f32[d]['apart'], '{:.1e}')}" for d in decodes)
               + f" apart (bound {shown(bound, '{:.1e}')}: 3x the dynamic decode's distance from float64)"]
    numbers = dict(float32=f32)
    if s.cuda:
        bf16 = bench_gpu.decodes_compared(ours, g.tokenizer, prompts, g.samples, new_tokens, ("graph",), "static",
                                          g.autocast)
        agree &= bf16["graph"]["equal"] == bf16["rows"] and bf16["graph"]["apart"] == 0
        summary.append(f"bf16: graph vs static {bf16['graph']['equal']}/{bf16['rows']} rows equal, "
                       f"{shown(bf16['graph']['apart'], '{:.1e}')} apart")
        numbers.update(bf16=bf16)
    # the run's decode (graph + compile) where 3a compiled it in this process; else the graph uncompiled, not a
    # minute's compile inside this part (a second call: --parts 6a,6b,6d). On the CPU the plumbing alone, in the
    # dynamic decode (the static one's steps through the flash stand-in take seconds; checked with forced tokens above)
    label, decode, compiled = ("dynamic (the CPU's: the plumbing alone)", "dynamic", False) if not s.cuda else \
        s.modes[0] if "decode_compile_s" in s.numbers.get("3a", {}) else \
        ("graph (not compiled: 3a did not run)", "graph", False)
    ours.use_compile = compiled
    rates = bench_gpu.episode_rollouts(g, ours, s.prompts, decode, g.new_tokens if s.cuda else 140, warm=s.cuda)
    single, episodes = (rates["tokens"] / rates[f"{k}_s"] for k in ("single", "episodes"))
    summary.append(f"{label}: 3-attempt episodes ({rates['turns']} turns, {rates['forced']} forced columns) "
                   f"{episodes:,.0f} tokens/s against one turn to the same lengths {single:,.0f}: "
                   f"{rates['episodes_s'] / rates['single_s']:.2f}x the time")
    numbers.update(episodes_tokens_s=episodes, single_tokens_s=single, **rates)
    return dict(status="ok" if agree else "failed", summary=("" if agree else "the decodes differ: ") +
                "; ".join(summary), **numbers)


IN_PROCESS = {"3a": part_models, "3b": part_rollouts, "4": part_update, "5a": part_vs_chat_rl,
              "5b": part_vs_base_train, "6a": lambda s: part_self_check(s, False), "6b": part_decode_modes,
              "6c": lambda s: part_self_check(s, True), "6d": part_episodes}
PARTS = {"1": part_cuda_tests, "2": part_main_command, **IN_PROCESS}


# ----------------------------------------------------------------------------------------------------------------
# Running the parts: each in a thread under its deadline, the session under the watchdog

class Stopped(BaseException):
    """Raised in a part's thread at its deadline (a BaseException: the parts' and benches' `except Exception` let
    it through)."""


def stop(thread):
    """Raises Stopped in the thread at its next line of Python: a call in C (a kernel's wait, a lock) ends first."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Stopped))


def run_part(s, part):
    """A part's thread: runs it and records its row (a failure's too: its line, the traceback in DIR/errors.log; a
    stopped one's: when)."""
    run = s.runs[part]
    try:
        try:
            numbers = PARTS[part](s)
            run.returned = True
            status, summary = numbers.pop("status", "ok"), numbers.pop("summary")
        except Stopped:
            status, summary, numbers = "stopped", stopped_at(s, part), {}
        except Exception as e:  # the next part runs: one part's failure is one finding
            status, summary, numbers = "failed", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}", {}
            with s.lock:
                append(os.path.join(s.out, "errors.log"), f"part {part}:\n{traceback.format_exc()}\n")
        finish(s, part, status, clock(s) - run.begin, summary, **numbers)
        if status != "ok" and s.cuda:  # what it held, freed for the next part (a collection: seconds, after the row)
            bench_gpu.free_memory(s.gpu)
    except Stopped:  # landed in the bookkeeping after the part's end
        finish(s, part, "stopped", clock(s) - run.begin, stopped_at(s, part))
    except BaseException as e:  # a kill's stand-in, an interrupt: the session ends with it, as it would in one thread
        s.raised = e
    finally:
        run.ended.set()


def fits(s, part):
    """Whether the part's expected seconds fit in what is left of the budget; records it skipped where not."""
    left, seconds = s.budget - clock(s), expected(part, s.smoke)
    if seconds <= left:
        return True
    finish(s, part, "skipped", 0.0, f"not started: none of the budget left ({secs(s.budget)} s spent)" if left <= 0 else
           f"not started: expected {seconds:.0f} s, {left:.1f} s of the budget left")
    return False


def start(s, part):
    """Starts the part in a thread of its own (a daemon: one left behind does not hold the process's exit), under its
    deadline: MARGIN x its expected seconds, at most what is left of the budget."""
    now = clock(s)
    run = s.runs[part] = SimpleNamespace(begin=now, deadline=now + min(deadline(part, s.smoke), s.budget - now),
                                         stop_sent=None, returned=False, ended=threading.Event())
    tell_watchdog(s, start=part, estimate=expected(part, s.smoke))
    run.thread = threading.Thread(target=run_part, args=(s, part), name=f"part {part}", daemon=True)
    run.thread.start()


def wait_for(s, parts):
    """Waits until these parts have ended, meanwhile stopping every running part at its deadline (a process part a
    second later: it kills its own group at its deadline, and reads what its log says). A part that a stop has not
    ended after STOP_GRACE (a call in C that does not return) gets its row and is left behind."""
    while True:
        if s.raised is not None:
            raise s.raised
        for part, run in s.runs.items():
            if run.ended.is_set():
                continue
            if run.stop_sent is None and not run.returned and clock(s) >= run.deadline + (part in BACKGROUND):
                run.stop_sent = clock(s)
                stop(run.thread)
            elif run.stop_sent is not None and clock(s) >= run.stop_sent + STOP_GRACE:
                finish(s, part, "stopped", clock(s) - run.begin, f"{stopped_at(s, part, run.stop_sent)}: it did not "
                       f"stop when asked (still running {STOP_GRACE:.0f} s after its stop: a call that does not "
                       "return, or code that caught the stop) and was left behind")
                s.left_behind.append(part)
                run.ended.set()
        if all(s.runs[part].ended.is_set() for part in parts):
            return
        time.sleep(TICK)


def tell_watchdog(s, **event):
    with s.lock:
        try:
            s.watchdog.stdin.write(json.dumps(event).encode() + b"\n")
            s.watchdog.stdin.flush()
        except (AttributeError, OSError, ValueError):  # none started (a test's session), or it is gone
            pass


def run_session(s):
    header(s)
    # on the CPU: the GPU's kernels through their stand-ins (their contracts checked), and nothing compiled (nanochat
    # compiles its optimizer's steps: minutes on a CPU). Entered before 1 and 2 start: set_stance imports dynamo
    # (seconds), which would otherwise run on their clocks with no deadline looked at
    with flash_on_the_cpu() if s.smoke else nullcontext(), \
            torch.compiler.set_stance("force_eager") if s.smoke else nullcontext():
        for part in BACKGROUND:
            if part in s.parts and fits(s, part):
                start(s, part)
        for part in (p for p in IN_PROCESS if p in s.parts):
            if s.cuda and part not in UNTIMED:  # nothing timed beside 1 and 2, on the same GPU
                wait_for(s, [p for p in BACKGROUND if p in s.runs])
            if fits(s, part):
                start(s, part)
                wait_for(s, [part])
    wait_for(s, list(s.runs))


# ----------------------------------------------------------------------------------------------------------------

def prepare(target, shared):
    """Lays out what the device copy needs from ../shared under target (an ignored folder for the device tool's
    carry), and the commit it was prepared at."""
    for path in CARRIED:
        source, copy = os.path.join(shared, path), os.path.join(target, path)
        if not os.path.exists(source):
            sys.exit(f"error: {source} not found: pass --shared, the folder holding data/, fixtures/ and peers/")
        if os.path.isdir(source):
            shutil.copytree(source, copy, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            os.makedirs(os.path.dirname(copy), exist_ok=True)
            shutil.copy2(source, copy)
    commit = command_output(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    with open(os.path.join(target, "SOURCE"), "w") as f:
        f.write(commit + (" + changes not committed" if command_output(["git", "status", "--porcelain"]) else ""))
    size = sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(target) for name in names)
    print(f"{target}: {size / 2 ** 20:.1f} MiB (the device tool carries at most 64 MiB in all)")
    # the device tool copies the tracked files, the untracked ones git does not ignore, and the ignored paths its
    # carry names
    if os.path.relpath(os.path.abspath(target), ROOT).startswith(".."):
        print(f"note: {target} is outside the checkout: the device copy does not take it (--prepare .gpu)")
    elif command_output(["git", "check-ignore", os.path.abspath(target)]) is None:
        print(f"note: git does not ignore {target}: the device copy takes it as it is, but `git add -A` would commit "
              "it (.gpu is ignored)")
    else:
        print(f"note: git ignores {target}: name it in the device call's carry (carry=[\"{target}\"])")


def settings(args, started):
    """The session's shared state: both benches configured alike (the d20 shapes of docs/performance.md, or tiny
    ones on the CPU), the prompts, and the slots the parts fill in for the parts after them."""
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    shape, vocab, prompts, samples, prompt_len, new_tokens = ("tiny", "512", "2", "2", "8", "12") if smoke else \
        ("d20", "65536", "16", "16", "128", "256")
    common = ["--vocab-size", vocab, "--prompts", prompts, "--prompt-len", prompt_len, "--device", device,
              "--gsm8k-dir", os.path.join(args.shared, GSM8K)]
    gpu = bench_gpu.configure(common + ["--shapes", shape, "--samples", samples, "--new-tokens", new_tokens,
                                        "--profile"])
    vs = bench_vs_nanochat.configure(common + ["--shape", shape, "--num-samples", samples, "--max-new-tokens",
                                               new_tokens, "--nanochat", os.path.join(args.shared, NANOCHAT)] +
                                     (["--seq-len", "32", "--device-batch-size", "2", "--pretrain-rows", "2"] * smoke))
    modes = [("graph+compile", "graph", True)] if not smoke else [("static (the GPU's graph+compile)", "static", False)]
    return SimpleNamespace(out=args.out, shared=args.shared, budget=args.budget_s, smoke=smoke, parts=args.parts,
                           cuda=not smoke, device=gpu.device, gpu=gpu, vs=vs, modes=modes,
                           prompts=bench_gpu.random_prompts(gpu), engine_prompts=1 if smoke else 4,
                           start=started, lock=threading.Lock(), numbers={}, runs={}, finished=set(),
                           left_behind=[], raised=None, watchdog=None, temps=set(), closed=False, id=None,
                           theirs=None, ours=None,
                           logits_apart=None, samples=None, real_samples=None, lengths=None, tokens_per_pass=None,
                           update_mfu=None)


def main(argv=None, started=None, early=None):
    """started: the budget clock's zero (the process's, run as a script; else now, the imports done before). early:
    begin's (run as a script, it ran before torch's import; else it runs now)."""
    started = time.monotonic() if started is None else started
    early = begin(argv, started) if early is None else early
    args = early.args
    if early.done:
        return
    if args.prepare:
        return prepare(args.prepare, args.shared or SHARED)
    args.shared = args.shared or (PREPARED if os.path.isdir(PREPARED) else SHARED)
    s = None
    try:
        if not args.smoke and not torch.cuda.is_available():  # in DIR too: the device call's $OUT says why it is empty
            line = "error: gpu_session.py measures a CUDA GPU and torch finds none here: run it on one, or pass --smoke"
            append(os.path.join(args.out, "results.md"), line + "\n")
            sys.exit(line)
        if not args.smoke:  # one process shows the compiled functions many models (each step's copies), each its own
            torch._dynamo.config.recompile_limit = 64  # guards: past dynamo's 8 a function would run eagerly, untold
        s = settings(args, started)
        s.lock, s.watchdog, s.id, s.temps = early.lock, early.watchdog, early.id, early.temps
        run_session(s)
    except (KeyboardInterrupt, Interrupted) as e:  # its line written, its processes ended below; then the exit
        # status of the signal, no traceback (re-raised where main's caller goes on)
        interrupted(early, s, e)
        if RELEASE_ON_RETURN:
            raise
        sys.exit(128 + (signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.Signals[str(e)]))
    finally:  # the watchdog told, what the session started ended (before a part's re-raised kill, too)
        end(early)
    if s.left_behind and not RELEASE_ON_RETURN:  # a call that never returns: the interpreter's exit would wait on it, or tear CUDA down under it
        print(f"the session ends here, leaving behind part {', '.join(s.left_behind)}", flush=True)
        os._exit(0)


if __name__ == "__main__":
    main(started=STARTED, early=EARLY)
