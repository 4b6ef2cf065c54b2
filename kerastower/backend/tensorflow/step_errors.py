"""What a user sees when a compiled step fails: their own error, chained.

TensorFlow reports an error raised inside a step function (a label out of
range, a Python generator's exception) as an `OpError` whose message holds
one "root error" per tower, node names and "0 derived errors ignored".
`explain` turns it into a `StepFailedError` that names the step and the
towers and gives the root error first, chained to TensorFlow's error; an
exception a `GeneratorInput` generator raised is chained itself, so that
`except MyError` in user code still sees it as the cause.

Those exceptions, and the towers' batch mismatches (batch_checks.py), are
kept for the error in one `StepFailures` per TensorFlow engine
(`engine.failures`, kerastower/inputs/step_failures.py), handed to the code
that records into them when the feed or the step is built.
"""

import re

from kerastower.errors import StepFailedError
from kerastower.inputs.dealing import batch_words

__all__ = ["explain"]


_ROOT = re.compile(r"^\s*\((\d+)\)\s+([A-Z_]+):\s*(.*)$")
_REPLICA = re.compile(r"replica_(\d+)")


def _root_errors(message):
    """[(status, first line, tower index or None)] of an OpError's message."""
    lines = message.splitlines()
    found = []
    for number, line in enumerate(lines):
        match = _ROOT.match(line)
        if not match:
            continue
        detail = " ".join(lines[number + 1:number + 3])
        tower = _REPLICA.search(detail)
        found.append((match.group(2), match.group(3).strip(),
                      int(tower.group(1)) if tower else None))
    return found


def explain(error, what, failures=None):
    """A StepFailedError for the OpError `error` raised by `what` (e.g.
    "training step 12"), naming the generator error `failures` (the run's
    StepFailures) holds; the caller raises it."""
    recorded = failures.take_generator_error() if failures is not None else None
    if recorded is not None:
        cause = recorded.error
        if recorded.batch is not None:
            which = batch_words(recorded.batch)
        else:
            which = f"making batch {recorded.items_yielded + 1} of this pass, for that tower"
        return _chained(StepFailedError(
            f"{what} failed on tower {recorded.tower}: the generator of {recorded.source_name} raised "
            f"{type(cause).__name__}: {cause} ({which}). Fix the generator; the exception is this "
            "error's cause."
        ), cause)
    roots = _root_errors(error.message)
    if roots:
        towers = sorted({t for _, _, t in roots if t is not None})
        status, first, _ = roots[0]
        where = f" on tower{'s' if len(towers) > 1 else ''} {', '.join(map(str, towers))}" if towers else ""
        summary = f"{status}: {first}"
    else:
        where = ""
        summary = f"{type(error).__name__}: {error.message.strip().splitlines()[0]}"
    return _chained(StepFailedError(
        f"{what} failed{where}: {summary}\n(TensorFlow's full error is this error's "
        "cause. An error about a label, shape or dtype usually means the input's "
        "y does not fit the model's outputs or loss.)"
    ), error)


def _chained(new_error, cause):
    new_error.__cause__ = cause
    return new_error
