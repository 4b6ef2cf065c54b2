"""`StepFailures`: what went wrong in a run's feeds and tower steps, kept for the error it raises.

TensorFlow passes on as text only an exception a Python generator feeding
tf.data raised, and a tower's DataMismatchError raised while its step was
traced. The feeds (sources.py, python_input.py) record the generators'
exceptions, and the towers' batch checks
(kerastower/backend/tensorflow/batch_checks.py) their mismatches, into the
run's StepFailures; the TensorFlow engine's error for a failed step
(backend/tensorflow/step_errors.py) chains them.
"""

import contextlib
import dataclasses
import threading

__all__ = ["GeneratorError", "StepFailures", "feeding_failures"]


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
    (backend/tensorflow/batch_checks.py). The error the run raises chains them.

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
