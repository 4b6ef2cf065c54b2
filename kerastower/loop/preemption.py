"""Saving on a preemption signal: the step ends, every process agrees, a checkpoint is written.

Spot and preemptible machines, TPU/GPU pools and SLURM announce the end of
a job with a signal (SIGTERM, or SIGUSR1 with `--signal`) and kill it a
grace period later. While `fit` (or `kt.Trainer.train`) runs with
`kt.callbacks.AutoResume`, its signals are caught (`SignalWatch`) instead
of ending the process at once. The loop (kerastower/loop/main_loop.py)
asks after every step whether any process got one (`stop_agreed`: one
small all-reduce per step when the run has several processes, none
otherwise), so that every Horovod rank, multi-worker worker and JAX process
stops after the same step even when only one was signalled. Then the chief
writes a checkpoint of that step into AutoResume's folder and verifies it,
every process waits for it, and `Preempted` ends the process with exit
status 75 (`EX_TEMPFAIL`: "try again"), which a scheduler's retry can tell
from a crash. Run the same command again: AutoResume goes on from that step.

A second signal while the checkpoint is written changes nothing: it is
counted and the save goes on. A kill (SIGKILL, the end of the grace period)
during the save leaves the checkpoints before it intact (checkpoints are
written under a temporary name and renamed into place).

Examples:
    >>> import signal
    >>> from kerastower.loop.preemption import SignalWatch
    >>> with SignalWatch([signal.SIGUSR1]) as watch:
    ...     signal.raise_signal(signal.SIGUSR1)
    ...     watch.received_name
    'SIGUSR1'
"""

import signal
import threading
import time
import warnings

__all__ = ["Preempted", "SignalWatch", "DEFAULT_SIGNALS", "EXIT_STATUS", "stop_agreed"]

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
EXIT_STATUS = 75  # sysexits.h's EX_TEMPFAIL: a temporary failure; run it again


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
        >>> import kerastower as kt
        >>> issubclass(kt.Preempted, SystemExit)
        True
    """

    def __init__(self, code, global_step, checkpoint, signal_name):
        super().__init__(code)
        self.global_step = global_step
        self.checkpoint = checkpoint
        self.signal_name = signal_name


def signal_numbers(signals, owner):
    """`signals` (names like "SIGTERM", numbers or `signal.Signals`) as
    `signal.Signals`; a KerasTowerError naming a bad one."""
    from kerastower.errors import ArgumentError

    if signals is None:
        return []
    if isinstance(signals, (str, int)):
        signals = [signals]
    numbers = []
    for value in signals:
        try:
            if isinstance(value, str):
                numbers.append(signal.Signals[value.upper()])
            else:
                numbers.append(signal.Signals(value))
        except (KeyError, ValueError):
            raise ArgumentError(
                f"{owner}: save_on_signals holds {value!r}, which is not a signal; give "
                "names such as 'SIGTERM', 'SIGUSR1', 'SIGINT' (or () to turn it off)."
            ) from None
    if signal.SIGKILL in numbers:
        raise ArgumentError(
            f"{owner}: SIGKILL cannot be caught; give signals such as 'SIGTERM' or 'SIGUSR1'."
        )
    return numbers


class SignalWatch:
    """Notes the first of `signals` the process gets while it is entered.

    Entered, it replaces those signals' handlers (in the main thread only:
    Python runs handlers there); left, it puts the previous ones back. A
    signal that came after the last step was checked is passed on to the
    previous handler when the watch is left, so it is not lost.

    Attributes:
        received: the first signal received (a `signal.Signals`), or None.
        count: signals received so far.
    """

    def __init__(self, signals):
        self.signals = list(signals)
        self.received = None
        self.count = 0
        self.received_at = None
        self.acted_on = False
        self._previous = {}

    @property
    def received_name(self):
        return None if self.received is None else signal.Signals(self.received).name

    def _handle(self, signum, frame):
        self.count += 1
        if self.received is None:
            self.received = signum
            self.received_at = time.perf_counter()

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
        return self

    def __exit__(self, *exc):
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}
        if self.received is not None and not self.acted_on:
            # It came too late to stop at a step: do what it would have done.
            signal.raise_signal(self.received)
        return False


def stop_agreed(watch, strategy):
    """Whether training stops now: whether any process of the run got one
    of its signals. One all-reduce of a flag across processes when the run
    has several; every process calls it after the same step."""
    got_one = watch.received is not None
    if getattr(strategy, "single_process", True):
        return got_one
    return not strategy.all_agree(not got_one)
