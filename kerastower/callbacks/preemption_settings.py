"""AutoResume's preemption settings: which signals save, the exit status, how long a step may go on.

Read by `kt.callbacks.AutoResume` (callbacks/saver.py) when it is made, and
by the loop's preemption handling (loop/preemption.py) while it trains.

Example:
    >>> from kerastower.callbacks.preemption_settings import signal_numbers
    >>> [s.name for s in signal_numbers(("SIGTERM", "sigusr1"), "AutoResume")]
    ['SIGTERM', 'SIGUSR1']
"""

import math
import numbers
import signal

from kerastower.errors import ArgumentError

__all__ = ["DEFAULT_SIGNALS", "EXIT_STATUS", "STEP_GRACE_S", "signal_numbers", "grace_seconds"]

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
EXIT_STATUS = 75  # sysexits.h's EX_TEMPFAIL: a temporary failure; run it again
# How long after the first signal the save may wait for the running step
# (and the callbacks after it) to end: longer than most steps and an
# epoch's validation, about as long as the longest usual kill grace (SLURM's
# KillWait and Kubernetes' terminationGracePeriodSeconds default to 30 s,
# AWS spot gives 2 minutes); None waits forever.
STEP_GRACE_S = 120.0


def signal_numbers(signals, owner):
    """`signals` (names like "SIGTERM", numbers or `signal.Signals`) as
    `signal.Signals`; a KerasTowerError naming a bad one."""
    if signals is None:
        return []
    if isinstance(signals, (str, int)):
        signals = [signals]
    chosen = []
    for value in signals:
        try:
            if isinstance(value, str):
                chosen.append(signal.Signals[value.upper()])
            else:
                chosen.append(signal.Signals(value))
        except (KeyError, ValueError):
            raise ArgumentError(
                f"{owner}: save_on_signals holds {value!r}, which is not a signal; give "
                "names such as 'SIGTERM', 'SIGUSR1', 'SIGINT' (or () to turn it off)."
            ) from None
    if signal.SIGKILL in chosen:
        raise ArgumentError(
            f"{owner}: SIGKILL cannot be caught; give signals such as 'SIGTERM' or 'SIGUSR1'."
        )
    return chosen


def grace_seconds(value, owner):
    """`value` (seconds, or None: wait forever) as a float; an ArgumentError
    naming a bad one."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value)
            or value <= 0):
        raise ArgumentError(
            f"{owner}: step_grace_s={value!r} is not a number of seconds above 0; give how "
            f"long a step may go on after a preemption signal (e.g. {STEP_GRACE_S:g}), or "
            "None to wait for it however long it takes.")
    return float(value)
