"""Saving on a preemption signal: the step ends, every process agrees, a checkpoint is written.

Spot and preemptible machines, TPU/GPU pools and SLURM announce the end of
a job with a signal (SIGTERM, or SIGUSR1 with `--signal`) and kill it a
grace period later. While `fit` (or `kt.Trainer.train`) runs with
`kt.callbacks.AutoResume`, its signals are caught (`SignalWatch`) instead
of ending the process at once. The loop (kerastower/loop/main_loop.py)
asks after every step whether any process got one (`StopAgreement`: with
several processes, one small all-reduce every few steps, as many as keep
its cost near 0.5% of theirs and at most a second of steps apart, and at
each epoch's end; none with one), so that every Horovod rank, multi-worker
worker and JAX process stops after the same step even when only one was
signalled. Then the chief
writes a checkpoint of that step into AutoResume's folder and verifies it,
every process waits for it, and `Preempted` ends the process with exit
status 75 (`EX_TEMPFAIL`: "try again"), which a scheduler's retry can tell
from a crash. Run the same command again: AutoResume goes on from that step.

A step that does not end is not waited for forever. The signals reach a
watchdog thread as they come (through `signal.set_wakeup_fd`, even while
the main thread is stuck in TensorFlow's or XLA's C++ code, where Python
runs no handler). If the save has not begun `grace_s` seconds after the
first signal (AutoResume's `step_grace_s`, 120 s by default), or a second
signal comes while the step still runs, the watchdog ends the process at
once with the same exit status and a message saying what was interrupted
and which checkpoint the next launch goes on from. It never ends it during
the preemption save: a second signal then is counted and the save goes on
(it takes seconds, and it is what the next launch needs). A kill during a
save (SIGKILL, the end of the scheduler's grace period, or the watchdog
during another callback's save) leaves the checkpoints before it intact:
a checkpoint is written into a `.writing-*` folder and renamed into place
(kerastower/checkpoint/files.py).

A launcher that watches the run (`python -m kerastower.launch`,
kerastower/launch.py) passes a folder in `KERASTOWER_PREEMPTION_MARKS`;
a process that ends on a preemption leaves a file there, so that the
launcher can exit with 75 where `horovodrun` says 1.

Examples:
    >>> import signal
    >>> from kerastower.loop.preemption import SignalWatch
    >>> with SignalWatch([signal.SIGUSR1]) as watch:
    ...     signal.raise_signal(signal.SIGUSR1)
    ...     watch.received_name
    'SIGUSR1'
"""

import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
import warnings

from kerastower.callbacks.preemption_settings import DEFAULT_SIGNALS
from kerastower.callbacks.preemption_settings import EXIT_STATUS
from kerastower.callbacks.preemption_settings import STEP_GRACE_S

__all__ = ["Preempted", "SignalWatch", "DEFAULT_SIGNALS", "EXIT_STATUS", "STEP_GRACE_S",
           "MARKS_VARIABLE", "StopAgreement", "report_to_launcher"]

# A second signal within this many seconds of the first is the same notice
# delivered twice (a scheduler signalling every process of the job while
# horovodrun, srun or a launcher forwards its own copy), not a second one.
SAME_NOTICE_S = 1.0
MARKS_VARIABLE = "KERASTOWER_PREEMPTION_MARKS"  # set by kerastower/launch.py


class Preempted(SystemExit):
    """Training stopped on a signal after saving a checkpoint of its last step.

    A `SystemExit`, so an uncaught one ends the process with `code` (75 by
    default) and no traceback; catch it (`except kt.Preempted`) to do
    something else, e.g. in a notebook.

    Attributes:
        code: the exit status.
        global_step: the step the checkpoint holds.
        checkpoint: its path (the chief wrote it; every process is told).
        signal_name: the signal's name ("SIGTERM"), or None on a process
            that was not signalled itself.

    Examples:
        >>> issubclass(kt.Preempted, SystemExit)
        True
    """

    def __init__(self, code, global_step, checkpoint, signal_name):
        super().__init__(code)
        self.global_step = global_step
        self.checkpoint = checkpoint
        self.signal_name = signal_name


class SignalWatch:
    """Notes the first of `signals` the process gets while it is entered,
    and ends the process when the save cannot begin in time.

    Entered, it replaces those signals' handlers (in the main thread only:
    Python runs handlers there); left, it puts the previous ones back. A
    signal that came after the last step was checked is passed on to the
    previous handler when the watch is left, so it is not lost.

    While entered, a watchdog thread reads the signals from a wakeup pipe
    (`signal.set_wakeup_fd`: written by the C-level handler the moment a
    signal comes, even while the main thread is stuck in C++ code). Unless
    the save has begun (`begin_save`), it ends the process `grace_s`
    seconds after the first signal (None: never), or at once on a second
    signal that comes `SAME_NOTICE_S` or more after the first: it calls
    `on_end(reason)`, which returns `(status, message)`, writes the message
    to stderr, flushes stdout and stderr, and calls `exit(status)`
    (`os._exit`: a step stuck in C++ code cannot be interrupted otherwise).

    Attributes:
        received: the first signal received (a `signal.Signals`), or None.
        count: signals received so far.
    """

    def __init__(self, signals, grace_s=None, on_end=None, exit=os._exit):
        self.signals = list(signals)
        self.grace_s = grace_s
        self.on_end = on_end
        self._exit = exit
        self.received = None
        self.count = 0
        self.received_at = None
        self.acted_on = False
        self.saving = False
        self.ended = None  # the reason the watchdog gave, once it ended the process
        self._previous = {}
        self._lock = threading.Lock()
        self._thread = None
        self._pipe = None
        self._previous_wakeup = -1
        self._closed = False

    @property
    def received_name(self):
        return None if self.received is None else signal.Signals(self.received).name

    def _handle(self, signum, frame):
        self.count += 1
        if self.received is None:
            self.received = signum
            self.received_at = time.perf_counter()

    def begin_save(self):
        """Called before the preemption save: from now on the watchdog does
        not end the process (it waits here if it is ending it already)."""
        with self._lock:
            self.acted_on = True
            self.saving = True

    def __enter__(self):
        if not self.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "kerastower: AutoResume cannot save on "
                f"{', '.join(s.name for s in map(signal.Signals, self.signals))} here: "
                "Python catches signals in the main thread only, and training runs in "
                "another. Run fit in the main thread to save on preemption.",
                stacklevel=2,
            )
            self.signals = []
            return self
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        self._start_watchdog()
        return self

    def __exit__(self, *exc):
        self._stop_watchdog()
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}
        if self.received is not None and not self.acted_on:
            # It came too late to stop at a step: do what it would have done.
            signal.raise_signal(self.received)
        return False

    # The watchdog.

    def _start_watchdog(self):
        try:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
        except OSError:
            return
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read)
            os.close(write)
            return
        self._pipe = (read, write)
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="kerastower-preemption-watchdog",
                                        daemon=True)
        self._thread.start()

    def _stop_watchdog(self):
        if self._pipe is None:
            return
        read, write = self._pipe
        self._closed = True
        try:
            signal.set_wakeup_fd(self._previous_wakeup)
        except (ValueError, OSError):
            pass
        try:
            os.write(write, b"\0")  # wakes the watchdog, which sees _closed
        except OSError:
            pass
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            os.close(read)
        os.close(write)
        self._pipe = self._thread = None

    def _watch(self):
        read = self._pipe[0]
        numbers = {int(n) for n in self.signals}
        first = first_name = deadline = None
        while not self._closed:
            timeout = None
            if deadline is not None and not self.saving:
                timeout = max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([read], [], [], timeout)
            except (OSError, ValueError):
                return
            if self._closed:
                return
            if not ready:
                self._end(f"got {first_name} and the running step has not ended "
                          f"{self.grace_s:g} s later (AutoResume's step_grace_s={self.grace_s:g})")
                deadline = None  # the save began meanwhile: it is not cut off
                continue
            try:
                data = os.read(read, 512)
            except BlockingIOError:
                continue
            except OSError:
                return
            if self._previous_wakeup >= 0:  # someone else's wakeup fd (asyncio's): pass it on
                try:
                    os.write(self._previous_wakeup, data)
                except OSError:
                    pass
            for number in data:
                if number not in numbers:
                    continue
                now = time.monotonic()
                if first is None:
                    first, first_name = now, signal.Signals(number).name
                    if self.grace_s is not None:
                        deadline = now + self.grace_s
                elif now - first >= SAME_NOTICE_S and not self.saving:
                    self._end(f"got {first_name}, then {signal.Signals(number).name} "
                              f"{now - first:.1f} s later while the step was still running")

    def _end(self, reason):
        """Ends the process now unless the save has begun."""
        with self._lock:
            if self.saving or self._closed:
                return
            self.ended = reason
            status, message = (EXIT_STATUS, f"kerastower: {reason}: exiting with status "
                               f"{EXIT_STATUS}.") if self.on_end is None else self.on_end(reason)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 (ending anyway)
                    pass
            try:
                os.write(2, ("\n" + message + "\n").encode("utf-8", "replace"))
            except OSError:
                pass
            self._exit(status)


def report_to_launcher(status, message, checkpoint=None):
    """Leaves a file saying this process ends on a preemption in the folder
    a launcher (kerastower/launch.py) named in `KERASTOWER_PREEMPTION_MARKS`,
    if any; never raises."""
    folder = os.environ.get(MARKS_VARIABLE)
    if not folder:
        return
    name = f"preempted-{socket.gethostname()}-{os.getpid()}.json"
    try:
        staging = os.path.join(folder, "." + name)
        with open(staging, "w") as f:
            json.dump({"status": status, "message": message, "checkpoint": checkpoint,
                       "host": socket.gethostname(), "pid": os.getpid()}, f)
        os.replace(staging, os.path.join(folder, name))
    except OSError:
        pass


# The share of the steps' time that agreeing whether to stop may take, and
# the longest a stop may wait for the next agreement after a signal.
AGREEMENT_SHARE = 0.005
MOST_SECONDS_BETWEEN = 1.0
_MOST_STEPS_BETWEEN = 1_000_000


class StopAgreement:
    """Whether training stops now: whether any process of the run got one
    of its signals, agreed by every process after the same step.

    One process decides alone, after every step. Several agree in one
    all-reduce of two integers (a process's signal, the chief's interval),
    after the same global steps: after the first step, then every
    `interval` steps, and at every epoch's end. The interval is the chief's
    choice, sent in the same all-reduce: as many steps as make the
    agreement cost `AGREEMENT_SHARE` of their time (its cost measured on
    the chief), but no more than `MOST_SECONDS_BETWEEN` seconds of steps,
    so a stop waits that long at most. A model whose step takes longer
    than the agreement 1 / AGREEMENT_SHARE times over agrees after every
    step.

    Example:
        >>> import types
        >>> one_process = types.SimpleNamespace(single_process=True)
        >>> StopAgreement(one_process).stop_now(got_one=True, global_step=3)
        True
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.interval = 1
        self.cost_s = None     # the agreement's cost, as the chief measured it
        self._last_step = None
        self._last_time = None

    def stop_now(self, got_one, global_step, epoch_end=False):
        """Whether to stop after `global_step` (at an epoch's end: `epoch_end`)."""
        if getattr(self.strategy, "single_process", True):
            return got_one
        if (self._last_step is not None and not epoch_end
                and global_step - self._last_step < self.interval):
            return False
        proposal = self._proposal(global_step)
        start = time.perf_counter()
        signalled, interval = self.strategy.sum_over_processes(
            [int(got_one), proposal if self.strategy.is_chief else 0])
        now = time.perf_counter()
        cost = now - start
        self.cost_s = cost if self.cost_s is None else 0.5 * (self.cost_s + cost)
        self.interval = max(1, int(interval))
        self._last_step, self._last_time = global_step, now
        return signalled > 0

    def _proposal(self, global_step):
        """The steps until the next agreement, from the steps since the last."""
        if self._last_step is None or self.cost_s is None or global_step <= self._last_step:
            return 1
        step_s = max((time.perf_counter() - self._last_time) / (global_step - self._last_step), 1e-9)
        wanted = math.ceil(self.cost_s / (AGREEMENT_SHARE * step_s))
        most = max(1, math.floor(MOST_SECONDS_BETWEEN / step_s))
        return max(1, min(wanted, most, _MOST_STEPS_BETWEEN))
