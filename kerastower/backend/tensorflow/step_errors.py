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
(`engine.failures`), handed to the code that records into them when the
feed or the step is built.
"""

import contextlib
import dataclasses
import re
import threading

from kerastower.errors import StepFailedError
from kerastower.inputs.dealing import batch_words

__all__ = ["GeneratorError", "StepFailures", "feeding_failures", "explain"]


@dataclasses.dataclass(frozen=True)
class GeneratorError:
    """An exception a Python generator feeding tf.data raised."""

    error: BaseException
    source_name: str
    items_yielded: int   # items the generator gave in this pass before it raised
    tower: int           # the tower the next batch was for
    batch: tuple = None  # (number in the pass, towers, source index) where known (dealing.failed_batch)


@dataclasses.dataclass
class StepFailures:
    """What went wrong inside one run's steps that TensorFlow passes on as
    text only: the exceptions of the Python generators feeding the steps,
    and each tower's DataMismatchError raised while its step was traced
    (batch_checks.py). The error the run raises chains them.

    One per TensorFlow engine (`engine.failures`), emptied when fit,
    evaluate or predict begins. The code that records into it is handed it
    when the feed or step is built (`feeding`, `feeding_failures`; a step's
    batch checks reach it through their model); generators record from
    tf.data's threads and towers trace in threads of their own, hence the lock.
    """

    generator_errors: list = dataclasses.field(default_factory=list)  # GeneratorErrors, in order
    batch_errors: dict = dataclasses.field(default_factory=dict)  # tower: (DataMismatchError, cause)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def record_generator_error(self, error, source_name, items_yielded, tower, batch=None):
        """Called when a feed's generator raises, with the tower the next
        batch was for, and where known the batch that failed, (number in
        the pass, towers): remembers the exception for `explain`."""
        if batch is not None and batch[1]:
            tower = batch[0] % batch[1]
        else:
            batch = None
        with self.lock:
            self.generator_errors.append(
                GeneratorError(error, source_name, items_yielded, tower, batch))

    def take_generator_error(self):
        """The first GeneratorError recorded (or None); forgets them all."""
        with self.lock:
            found = self.generator_errors[0] if self.generator_errors else None
            self.generator_errors.clear()
        return found

    def record_batch_error(self, tower, error, cause):
        """Remembers tower `tower`'s first DataMismatchError and its cause."""
        with self.lock:
            self.batch_errors.setdefault(tower, (error, cause))

    def take_batch_error(self):
        """(the lowest tower's DataMismatchError, its cause), or (None,
        None); forgets them all."""
        with self.lock:
            found = self.batch_errors[min(self.batch_errors)] if self.batch_errors else (None, None)
            self.batch_errors.clear()
        return found

    def forget_batch_errors(self):
        """Drops the batch mismatches no step took."""
        with self.lock:
            self.batch_errors.clear()

    def clear(self):
        """Drops what no step took (when fit, evaluate or predict begins)."""
        with self.lock:
            self.generator_errors.clear()
            self.batch_errors.clear()

    @contextlib.contextmanager
    def feeding(self):
        """Within it, feeds built in this thread record their generators'
        errors here (see `feeding_failures`)."""
        stack = _feeding_stack()
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()


_building = threading.local()


def _feeding_stack():
    if not hasattr(_building, "stack"):
        _building.stack = []
    return _building.stack


def feeding_failures():
    """The StepFailures a feed built now records its generator's errors
    into: the one `StepFailures.feeding` holds in this thread (the run's in
    progress). A feed built outside every run (by hand, `source.distribute`)
    gets a record of its own that no step reads: its errors are reported
    without their cause. Call it when the feed is built, not from tf.data's
    threads."""
    stack = _feeding_stack()
    return stack[-1] if stack else StepFailures()


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
