"""Runs a training command and exits with 75 when the run ended on a preemption.

    python -m kerastower.launch [--marks-in DIR] COMMAND [ARG...]

    python -m kerastower.launch horovodrun -np 4 -H localhost:4 --gloo python train.py

A preempted run's processes exit with 75 (`kt.Preempted`, AutoResume's
`exit_status`), which a scheduler's requeue rule can tell from a crash. A
launcher in between can hide it: `horovodrun` sees the first rank exit
with 75, stops the others (143) and exits with 1. This launcher runs the
command with `KERASTOWER_PREEMPTION_MARKS` naming a fresh folder; every
process that ends on a preemption (after its save, or when the watchdog
ends a step that did not end in time) leaves a file there
(kerastower/loop/preemption.py). When the command ends with a non-zero
status and such a file is there, the launcher exits with the status the
file holds (75 unless AutoResume was given another `exit_status`) and says
so on stderr; otherwise with the command's own status (128 + N for a
command killed by signal N). A command that ends with 0 ends the launcher
with 0.

The signals the launcher gets (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2)
are passed on to the command, so that a scheduler that signals only the
job's first process (Kubernetes' PID 1) reaches the run; `horovodrun`
passes SIGTERM and SIGINT on to its ranks as SIGTERM (and kills them 5 s
later). A copy of the same signal reaching a process twice at once (the
scheduler signals every process, and the launcher passes it on) is one
notice (`preemption.SAME_NOTICE_S`).

`--marks-in DIR` makes the folder in DIR instead of the system's temporary
folder: on several machines, give one that every machine sees (beside the
checkpoints), or the ranks of the other machines cannot leave their file
(rank 0's is enough, and it usually runs where the launcher runs).

`python -m kerastower.launch` imports the kerastower package, and with it
Keras and its backend (a few seconds at the start, no device is touched).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from kerastower.loop.preemption import MARKS_VARIABLE

__all__ = ["main", "run"]

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
USAGE = ("usage: python -m kerastower.launch [--marks-in DIR] COMMAND [ARG...]\n"
         "e.g.   python -m kerastower.launch horovodrun -np 4 -H localhost:4 --gloo python train.py")


def _reports(folder):
    """What the processes that ended on a preemption left in `folder`."""
    found = []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("preempted-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                report = json.load(f)
            status = report["status"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(status, int) and not isinstance(status, bool):
            found.append(report)
    return found


def run(command, marks_in=None):
    """Runs `command` (a list of arguments); returns the status to exit with."""
    folder = tempfile.mkdtemp(prefix="kerastower-launch-", dir=marks_in)
    try:
        try:
            child = subprocess.Popen(command, env=dict(os.environ, **{MARKS_VARIABLE: folder}))
        except OSError as error:
            print(f"kerastower.launch: cannot run {command[0]!r} ({error}). Give the command "
                  "to run after the launcher's options, e.g. `python -m kerastower.launch "
                  "horovodrun -np 4 python train.py`.", file=sys.stderr)
            return 127
        previous = {}

        def forward(signum, frame):
            try:
                child.send_signal(signum)
            except OSError:
                pass

        for name in FORWARDED:
            number = getattr(signal, name, None)
            if number is not None:
                previous[number] = signal.signal(number, forward)
        try:
            returned = child.wait()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
        status = 128 - returned if returned < 0 else returned
        reports = _reports(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if status == 0 or not reports:
        return status
    codes = sorted({report["status"] for report in reports})
    code = codes[0]
    saved = next((r["checkpoint"] for r in reports if r.get("checkpoint")), None)
    print(f"kerastower.launch: {len(reports)} process(es) of the run ended on a preemption"
          f"{f' (checkpoint {saved})' if saved else ''}; {os.path.basename(command[0])} ended "
          f"with status {status}. Exiting with status {code}, the preemption's: run the same "
          "command again and AutoResume goes on from the newest checkpoint.", file=sys.stderr)
    return code


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    marks_in = None
    while argv and argv[0].startswith("-"):
        option = argv.pop(0)
        if option == "--":
            break
        if option == "--marks-in" and argv:
            marks_in = argv.pop(0)
        elif option.startswith("--marks-in="):
            marks_in = option.split("=", 1)[1]
        elif option in ("-h", "--help"):
            print(USAGE)
            return 0
        else:
            print(f"kerastower.launch: unknown option {option!r}.\n{USAGE}", file=sys.stderr)
            return 2
    if not argv:
        print(f"kerastower.launch: no command to run.\n{USAGE}", file=sys.stderr)
        return 2
    if marks_in is not None and not os.path.isdir(marks_in):
        print(f"kerastower.launch: --marks-in {marks_in!r} is not a folder; give one that "
              "exists (on several machines, one they all see).", file=sys.stderr)
        return 2
    return run(argv, marks_in)


if __name__ == "__main__":
    sys.exit(main())
