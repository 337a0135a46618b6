"""
The GPU session's watchdog (tests/gpu_session.py starts it; the standard library only, so that it starts in
milliseconds): a process of its own, so that it acts whatever the session's process does, a call that never returns
and holds the interpreter's lock included, where a thread of that process would never run again.

    python tests/session_watchdog.py SETTINGS    # SETTINGS: JSON of out, pid, start, at, budget_s, parts

The session writes one JSON line to its stdin as each part starts ({"start": part, "estimate": seconds}) and ends
({"end": part}), and as a process group of a part's is made or gone ({"group": id} / {"ungroup": id}). When the
session ends it closes the pipe, and the watchdog exits. At `at` (a time of time.monotonic, the same clock in every
process) it kills the session and the groups, then writes into DIR's results what became of each part it had not
heard the end of, and a line naming the part that was running.
"""
import json
import os
import select
import signal
import sys
import time


def append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def main(settings):
    running, ended, groups = {}, set(), set()
    while True:
        left = settings["at"] - time.monotonic()
        if left <= 0:
            break
        if select.select([sys.stdin], [], [], left)[0]:
            line = sys.stdin.readline()
            if not line:  # the session ended (or died): nothing left to watch
                return
            event = json.loads(line)
            if "start" in event:
                running[event["start"]] = (event["estimate"], time.monotonic())
            elif "end" in event:
                running.pop(event["end"], None)
                ended.add(event["end"])
            elif "group" in event:
                groups.add(event["group"])
            elif "ungroup" in event:
                groups.discard(event["ungroup"])
    # The session first, so that nothing it writes lands after the lines below; then what its parts started
    if os.getppid() == settings["pid"]:  # still its child: the id is the session's, not a later process's
        os.kill(settings["pid"], signal.SIGKILL)
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    now = time.monotonic()
    clock = now - settings["start"]
    what = dict(settings["parts"])
    rows = [(part, "stopped", now - begun, f"stopped at {now - begun:.0f} s (estimate {estimate:.0f} s): the "
             f"watchdog ended the session at {clock:.0f} s") for part, (estimate, begun) in running.items()]
    rows += [(part, "skipped", 0.0, f"not started: the watchdog ended the session at {clock:.0f} s")
             for part, _ in settings["parts"] if part not in ended and part not in running]
    past = settings["at"] - settings["start"] - settings["budget_s"]
    line = (f"the watchdog ended the session at {clock:.0f} s, {past:g} s past its budget of "
            f"{settings['budget_s']:g} s, during part "
            f"{', '.join(running) or 'none (the session between parts, or starting)'}")
    jsonl = [dict(part=part, what=what[part], status=status, seconds=round(seconds, 1), summary=summary,
                  clock_s=round(clock, 1)) for part, status, seconds, summary in rows]
    append(os.path.join(settings["out"], "results.jsonl"), "".join(json.dumps(row) + "\n" for row in jsonl) +
           json.dumps(dict(watchdog=dict(line=line, clock_s=round(clock, 1), running=list(running)))) + "\n")
    table = "".join(f"| {part} | {what[part]} | {status} | {summary} | {seconds:.0f} s |\n"
                    for part, status, seconds, summary in rows)
    append(os.path.join(settings["out"], "results.md"), f"{table}\n{line}\n")
    print(f"[watchdog] {line}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
