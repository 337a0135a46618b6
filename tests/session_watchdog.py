"""
The GPU session's watchdog (tests/gpu_session.py starts it first, before torch's import; the standard library only,
so that it starts in milliseconds): a process of its own, so that it acts whatever the session's process does, a
call that never returns and holds the interpreter's lock included, where a thread of that process would never run
again.

    python tests/session_watchdog.py SETTINGS    # SETTINGS: JSON of out, pid, start, at, budget_s, parts, id

The session writes one JSON line to its stdin as each part starts ({"start": part, "estimate": seconds}) and ends
({"end": part}), as a process group of a part's is made or gone ({"group": id} / {"ungroup": id}), a temporary
folder of a part's made or gone ({"temp": path} / {"untemp": path}), its header written ({"header": true}), and when
its rows are complete ({"bye": true}: it ended of itself, or was interrupted and said so). A bye is not the end of
the watch: the session's exit (its atexit hooks, threads that are not daemons, the interpreter's teardown) runs on
under the same deadline, until its process is gone; only a caller whose process goes on after the session (a test
calling main) releases it ({"bye": true, "release": true}, then the pipe closed). The watchdog runs in a session of
its own (start_new_session), so that a signal to the session's process group (a Ctrl-C, `timeout`, `kill -- -PGID`)
leaves it to clean up after the session; it ignores SIGINT (the session handles it). The lines are read with
os.read into a buffer of its own and split there (a buffered readline would hold a burst of them where select no longer sees
them), and whatever is in the pipe is read before each act. It acts in two cases:
- at `at` (a time of time.monotonic, the same clock in every process): it stops the session and every process
  under it (SIGSTOP, so that none starts another), reads the last events, kills them all (SIGKILL: the parts'
  process groups, what their children left: see end_tree), then writes into DIR's results what became of each part
  it had not heard the end of, and a line: the session ran past its budget, and the part that was running;
  (after the session's bye: a line saying its rows were complete but it had not exited);
- the session gone without its "bye" (killed: its pid no longer this process's parent): it kills the processes the
  session had started (as last seen while it lived: every SNAPSHOT_EVERY, and after each event; never refreshed
  once it is found dead, when its children are another's) and the parts' groups, removes the parts' temporary
  folders, and writes one line saying the session died, when, and in which part; the rows it wrote stay as they are.
"""
import json
import os
import select
import shutil
import signal
import sys
import time

LOOK_EVERY = 0.1  # seconds between looks at whether the session lives
SNAPSHOT_EVERY = 0.1  # and at the processes under it (a few ms of /proc), also after each event heard: a process a
# part starts just before the session is killed is seen


def seconds_text(value):
    """A budget's seconds as printed: one decimal below 10 s (1.5 s, not "2 s"), whole seconds above."""
    return f"{value:.0f}" if value >= 10 or value == round(value) else f"{value:.1f}"


def append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------------------------
# The processes under a process (Linux's /proc; elsewhere none are found, and only the parts' groups are killed)

def processes():
    """-> {pid: (parent pid, process group, start time in clock ticks)} of every process running now."""
    found = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):  # ended between the listing and now
            continue
        if fields[0] not in (b"Z", b"X"):  # a zombie is dead already (its parent reaps it)
            found[int(name)] = (int(fields[1]), int(fields[2]), int(fields[19]))
    return found


def descendants(root, table=None):
    """-> {pid: (parent, group, start)} of the processes under root (children, theirs, ...)."""
    table = processes() if table is None else table
    children = {}
    for pid, (parent, *_) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid]
            todo.extend(children.get(pid, ()))
    return found


def signal_quietly(kill, target, number):
    try:
        kill(target, number)
    except (ProcessLookupError, PermissionError):  # ended already
        pass


def end_tree(root, spare=(), groups=(), kill_root=False):
    """Kills every process under root but those in spare (and root itself where kill_root): each one found is
    stopped first (SIGSTOP), and the tree looked at again until no new one appears, so that none starts another
    meanwhile; then each one's process group (the parts' own: pytest's, grpo.py's compile workers; never root's,
    which may hold the shell and a `| tee`) and each process are killed, with the groups named in groups.
    -> the pids killed."""
    root_group = os.getpgid(root) if root_alive(root) else None
    if kill_root:
        signal_quietly(os.kill, root, signal.SIGSTOP)
    stopped = {}
    while True:
        new = {pid: info for pid, info in descendants(root).items() if pid not in spare and pid not in stopped}
        if not new:
            break
        for pid in new:
            signal_quietly(os.kill, pid, signal.SIGSTOP)
        stopped.update(new)
    if kill_root:
        signal_quietly(os.kill, root, signal.SIGKILL)
    kill(stopped, groups, spare_groups={root_group, os.getpgrp()})
    return set(stopped)


def kill(found, groups=(), spare_groups=()):
    """Kills the processes found ({pid: (parent, group, start)}) that still run as the same processes (their start
    time unchanged: a pid is reused), their process groups and the groups named (not those in spare_groups)."""
    now = processes()
    same = {pid: info for pid, info in found.items() if pid in now and now[pid][2] == info[2]}
    for group in ({info[1] for info in same.values()} | set(groups)) - set(spare_groups) - {None}:
        signal_quietly(os.killpg, group, signal.SIGKILL)
    for pid in same:
        signal_quietly(os.kill, pid, signal.SIGKILL)


def root_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ----------------------------------------------------------------------------------------------------------------

class Watch:
    """What the session has said: the parts running (estimate, since), those ended, the groups, its "bye"."""

    def __init__(self, settings):
        self.settings, self.running, self.ended, self.groups, self.started = settings, {}, set(), set(), []
        self.buffer, self.bye, self.closed, self.heard = b"", False, False, False
        self.release, self.bye_at, self.temps, self.header = False, None, set(), False
        self.fd = sys.stdin.fileno()

    def take(self, data):
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:  # not an event (nothing else writes here): passed over, the watch goes on
                continue
            if "start" in event:
                self.running[event["start"]] = (event["estimate"], time.monotonic())
                self.started.append(event["start"])
            elif "end" in event:
                self.running.pop(event["end"], None)
                self.ended.add(event["end"])
            elif "group" in event:
                self.groups.add(event["group"])
            elif "ungroup" in event:
                self.groups.discard(event["ungroup"])
            elif "temp" in event:
                self.temps.add(event["temp"])
            elif "untemp" in event:
                self.temps.discard(event["untemp"])
            elif "header" in event:
                self.header = True
            elif "bye" in event:
                self.bye, self.release = True, bool(event.get("release"))
                self.bye_at = clock_of(self.settings)

    def read(self, wait):
        """Reads what the pipe holds (waiting at most `wait` seconds for the first of it), all of it."""
        while not self.closed and select.select([self.fd], [], [], wait)[0]:
            data = os.read(self.fd, 1 << 16)
            if not data:  # the session's end of the pipe closed: after its "bye", or killed
                self.closed = True
            self.take(data)
            self.heard, wait = True, 0

    def session_alive(self):
        return os.getppid() == self.settings["pid"]  # still its child: once it dies, this process is adopted


def main(settings):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the session's to handle (it says so in its results)
    watch, snapshot, looked = Watch(settings), {}, 0.0
    while True:
        left = settings["at"] - time.monotonic()
        if left <= 0:
            return past_budget(watch)
        if watch.closed:  # nothing more to read: the session's life alone to watch
            time.sleep(min(left, LOOK_EVERY))
        else:
            watch.read(min(left, LOOK_EVERY))
        if watch.bye and watch.release and watch.closed:
            return  # the session ended of itself in a process that goes on (a test's), and ended what it started
        if not watch.session_alive():
            watch.read(0)
            if not watch.bye:
                return died(watch, snapshot)
            return remove_temps(watch)  # its rows complete, its process gone
        if watch.heard or time.monotonic() >= looked + SNAPSHOT_EVERY:
            table = processes()
            found = descendants(settings["pid"], table)
            found.pop(os.getpid(), None)
            if watch.session_alive():  # taken while it lived (once it is dead, its children are another's): kept
                # with those seen before that still run as the same processes (one seen once is killed too)
                snapshot = {pid: info for pid, info in snapshot.items()
                            if pid in table and table[pid][2] == info[2]}
                snapshot.update(found)
            looked, watch.heard = time.monotonic(), False


def clock_of(settings):
    return time.monotonic() - settings["start"]


def remove_temps(watch):
    for path in watch.temps:
        shutil.rmtree(path, ignore_errors=True)


def running_line(watch):
    if watch.running:
        return f"part {', '.join(watch.running)} {'was' if len(watch.running) == 1 else 'were'} running"
    if not watch.started:
        return "no part had started (the session was starting: its imports, CUDA's start)"
    return f"no part was running (between parts; the last started: {watch.started[-1]})"


def past_budget(watch):
    settings, pid = watch.settings, watch.settings["pid"]
    # the session stopped first, so that nothing it writes lands after the lines below, and the last of what it
    # wrote to the pipe read; then it, everything under it, and its parts' groups killed
    if watch.session_alive():  # still its child: the id is the session's, not a later process's
        signal_quietly(os.kill, pid, signal.SIGSTOP)
        watch.read(0.05)
        end_tree(pid, spare={os.getpid()}, groups=watch.groups, kill_root=True)
    else:
        kill({}, watch.groups, spare_groups={os.getpgrp()})
    remove_temps(watch)
    now = time.monotonic()
    clock = clock_of(settings)
    rows = [(part, "stopped", now - begun, f"stopped at {now - begun:.0f} s (estimate {estimate:.0f} s): the "
             f"watchdog ended the session at {clock:.0f} s") for part, (estimate, begun) in watch.running.items()]
    rows += [(part, "skipped", 0.0, f"not started: the watchdog ended the session at {clock:.0f} s")
             for part, _ in settings["parts"] if part not in watch.ended and part not in watch.running]
    rows = [] if watch.bye else rows  # after its bye its rows were complete
    budget = seconds_text(settings["budget_s"])
    if watch.bye:
        line = (f"the watchdog ended the session at {clock:.0f} s: its rows were complete (its end at "
                f"{watch.bye_at:.0f} s) but its process had not exited by its {budget} s budget + "
                f"{settings['at'] - settings['start'] - settings['budget_s']:.0f} s (its exit: an atexit hook, a "
                f"thread that is not a daemon, the interpreter's teardown)")
    else:
        line = (f"the watchdog ended the session at {clock:.0f} s: the session ran past its {budget} s budget; "
                f"{running_line(watch)}")
    write(settings, rows, line, dict(line=line, clock_s=round(clock, 1), running=list(watch.running),
                                     ended="past its budget"), watch)


def died(watch, snapshot):
    settings = watch.settings
    clock = clock_of(settings)
    kill(snapshot, watch.groups, spare_groups={os.getpgrp()})
    remove_temps(watch)
    wrote = "the rows above are all it wrote" if watch.header else "it wrote no header and no row"
    line = (f"the session died at {clock:.0f} s (killed: it ended without its word of a normal end); "
            f"{running_line(watch)}; {wrote}")
    write(settings, [], line, dict(line=line, clock_s=round(clock, 1), running=list(watch.running), ended="died"),
          watch)


def write(settings, rows, line, record, watch):
    what = dict(settings["parts"])
    jsonl = [dict(part=part, what=what[part], status=status, seconds=round(seconds, 1), summary=summary,
                  clock_s=round(record["clock_s"], 1), session_id=settings.get("id"))
             for part, status, seconds, summary in rows]
    append(os.path.join(settings["out"], "results.jsonl"), "".join(json.dumps(row) + "\n" for row in jsonl) +
           json.dumps(dict(watchdog=dict(record, session_id=settings.get("id")))) + "\n")
    table = "".join(f"| {part} | {what[part]} | {status} | {summary} | {seconds:.0f} s |\n"
                    for part, status, seconds, summary in rows)
    if not watch.header:  # the session ended before its header: this one names it, so that the line has its session
        table = (f"\n## GPU session {settings.get('id')}: no header (the session ended before writing it, "
                 f"{clock_of(settings):.0f} s into its {seconds_text(settings['budget_s'])} s budget)\n\n"
                 + ("| part | what | status | result | seconds |\n| --- | --- | --- | --- | ---: |\n" if rows else "")
                 + table)
    append(os.path.join(settings["out"], "results.md"), f"{table}\n{line}\n")
    print(f"[watchdog] {line}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
