"""Keras's gradient accumulation (`optimizer(gradient_accumulation_steps=k)`) on towers.

Keras's own variables carry a cycle (`_iterations`, `_accumulated_gradients`),
so a checkpoint of the optimizer holds its progress. Two things are added:

- `accumulate_or_apply`: on TensorFlow, the accumulate-or-apply choice taken
  where MirroredStrategy can update (the cross-replica context).
- `count_weighted`: a token-normalised loss's micro-steps weighted by their
  token counts, so the k-th step applies the gradient of the summed token
  losses of all k micro-steps divided by all their tokens, not the mean of
  the k micro-steps' own token means (Keras's average; transformers #34191).
  The counts of a cycle so far are one more optimizer variable,
  `accumulated_loss_count` (`keep_loss_counts`), saved with the others.
- `cycle_logged_loss`: the same cycle's logged loss, one device's on the
  joined k x N x B examples (the cycle's token mean, counted once for all
  its examples), kept in one more variable, `accumulated_loss_log`.
"""

import functools

import keras

from kerastower._tf import tf
from kerastower._tf import tf_loaded
from kerastower._compat.required import _method
from kerastower._compat.required import _missing
from kerastower._compat.required import require

__all__ = ["accumulation_steps", "accumulate_or_apply", "keep_loss_counts", "loss_count_variable",
           "count_weighted", "loss_log_variable", "tracker_sums", "cycle_logged_loss"]

LOSS_COUNT_NAME = "accumulated_loss_count"
LOSS_LOG_NAME = "accumulated_loss_log"


def _no_output(*_):
    return None


def accumulation_steps(optimizer):
    """k of an optimizer built with `gradient_accumulation_steps=k`, else None
    (a LossScaleOptimizer's is its inner optimizer's)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    steps = getattr(optimizer if inner is None else inner, "gradient_accumulation_steps", None)
    return int(steps) if steps else None


def _accumulation_state(optimizer, variables):
    """(the micro-step counter, the accumulator of each of `variables`) of a
    built optimizer with gradient accumulation: Keras's own variables
    (`_iterations`, `_accumulated_gradients`), so a checkpoint of the
    optimizer holds a cycle's progress."""
    for name in ("_iterations", "_accumulated_gradients"):
        if not hasattr(optimizer, name):
            raise _missing(f"{type(optimizer).__name__}.{name}")
    index = _method(optimizer, "_get_variable_index")
    return optimizer._iterations, [optimizer._accumulated_gradients[index(v)] for v in variables]


class _accumulation_off:
    """Keras's own accumulation switched off while the k-th micro-step's
    update is traced (the accumulated mean is applied as one gradient),
    its count of updates (`optimizer.iterations`, `_iterations // k`, which
    Adam's bias correction reads) kept: the optimizer is, for that while,
    of a subclass whose `iterations` is Keras's accumulating one. Entered
    by one thread while no other traces the optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __enter__(self):
        self.cls = type(self.optimizer)
        self.steps = self.optimizer.gradient_accumulation_steps
        if not isinstance(getattr(self.cls, "iterations", None), property):
            raise _missing(f"{self.cls.__name__}.iterations as a property")
        self.optimizer.__class__ = _updating_class(self.cls, self.steps)
        self.optimizer.gradient_accumulation_steps = None
        return self

    def __exit__(self, *exc_info):
        self.optimizer.gradient_accumulation_steps = self.steps
        self.optimizer.__class__ = self.cls
        return False


@functools.cache
def _updating_class(cls, steps):
    import keras

    def iterations(self):
        return keras.ops.floor_divide(self._iterations, steps)

    return type(cls.__name__, (cls,), {"iterations": property(iterations),
                                       "__module__": cls.__module__})


def _dense(gradient):
    if tf_loaded() and isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def _cycle_step(steps, counter, update_and_reset, accumulate, finite):
    """The k-th micro-step of a cycle updates and resets, the others
    accumulate; none of it where `finite` (a boolean tensor, or None: no
    check) is False."""
    def step():
        tf.cond((counter + 1) % steps == 0, lambda: _no_output(update_and_reset()),
                lambda: _no_output(accumulate()))

    if finite is None:
        step()
    else:
        tf.cond(finite, lambda: _no_output(step()), _no_output)


def accumulate_or_apply(optimizer, apply, gradients, variables, finite=None, assign=()):
    """Inside a TensorFlow tower, on gradients already reduced over the
    towers (the same on every tower): Keras's gradient accumulation,
    `optimizer.gradient_accumulation_steps = k`, made to run under a
    strategy that updates through `merge_call` (MirroredStrategy).

    As Keras: the first k-1 micro-steps add their gradients to Keras's
    accumulators and count one iteration; the k-th applies `(g + acc) / k`
    through `apply(gradients)` (Keras's own apply, its accumulation off:
    clipping, weight decay, the update, one iteration) and zeroes the
    accumulators. Keras takes that choice in a `tf.cond` in the replica
    context, from which MirroredStrategy cannot reduce; here the cond is
    taken in the cross-replica context, as `apply_if`'s. `finite` (the same
    on every tower), when given: a step whose gradients are not finite
    neither accumulates nor counts. `assign`: (variable, value) pairs
    assigned on every micro-step that counts (`count_weighted`'s counts).
    """
    targets = [variable for variable, _ in assign]
    steps = accumulation_steps(optimizer)
    counter, accumulators = _accumulation_state(optimizer, variables)
    internal = require("tensorflow", "__internal__")
    supports_no_merge_call = _method(internal.distribute, "strategy_supports_no_merge_call")

    def update(gradients):
        apply([(_dense(g) + a.value) / steps for g, a in zip(gradients, accumulators)])

    replica_ctx = tf.distribute.get_replica_context()
    if replica_ctx is None or supports_no_merge_call():
        def update_and_reset():
            with _accumulation_off(optimizer):
                update(gradients)
            for a in accumulators:
                a.assign(tf.zeros(a.shape, a.dtype))
            for variable, value in assign:
                variable.assign(value)

        def accumulate():
            for g, a in zip(gradients, accumulators):
                a.assign(a.value + _dense(g))
            for variable, value in assign:
                variable.assign(value)
            counter.assign_add(1)

        _cycle_step(steps, counter, update_and_reset, accumulate, finite)
        return

    def in_cross_replica(distribution, finite, gradients, values):
        def assign_values():
            for variable, value in zip(targets, values):
                distribution.extended.update(
                    variable.value, lambda v, x: v.assign(x), args=(value,), group=False)

        def update_and_reset():
            # Switched off here, in the one cross-replica thread, while
            # the towers' threads wait: not by each tower's thread.
            with _accumulation_off(optimizer):
                distribution.extended.call_for_each_replica(update, args=(gradients,))
            for a in accumulators:
                distribution.extended.update(
                    a.value, lambda v: v.assign(tf.zeros(v.shape, v.dtype)), group=False)
            assign_values()

        def accumulate():
            for g, a in zip(gradients, accumulators):
                distribution.extended.update(
                    a.value, lambda v, g: v.assign(v + _dense(g)), args=(g,), group=False)
            assign_values()
            counter.assign_add(1)

        _cycle_step(steps, counter, update_and_reset, accumulate,
                    None if finite is None else distribution.experimental_local_results(finite)[0])

    replica_ctx.merge_call(in_cross_replica, args=(finite, gradients, [value for _, value in assign]))


# -- micro-steps weighted by their loss's count -----------------------------------

def keep_loss_counts(optimizer):
    """Makes an optimizer with gradient accumulation keep its cycle's loss
    counts so far and what its cycle logged, in two more optimizer
    variables made when it is built (now, where it is built already): what
    `count_weighted` and `cycle_logged_loss` read. Other optimizers are
    left as they are."""
    if not accumulation_steps(optimizer) or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return
    if optimizer.built:
        _add_loss_count(optimizer)
        return
    if "build" in vars(optimizer):
        return  # wrapped already (compiled again)
    build = optimizer.build

    def build_and_count(variables):
        build(variables)
        _add_loss_count(optimizer)

    # An instance attribute, as the towers' `stateless_apply` on JAX: the
    # optimizer's tracking would take a function assigned plainly for state.
    object.__setattr__(optimizer, "build", build_and_count)


def _add_loss_count(optimizer):
    if loss_count_variable(optimizer) is None:
        optimizer.add_variable(shape=(), initializer="zeros", dtype="float32", name=LOSS_COUNT_NAME)
    if loss_log_variable(optimizer) is None:
        optimizer.add_variable(shape=(3,), initializer="zeros", dtype="float32", name=LOSS_LOG_NAME)


def _named(optimizer, name):
    found = [v for v in optimizer.variables if v.name == name]
    return found[0] if found else None


def loss_count_variable(optimizer):
    """The optimizer's `accumulated_loss_count` variable, or None."""
    return _named(optimizer, LOSS_COUNT_NAME)


def loss_log_variable(optimizer):
    """The optimizer's `accumulated_loss_log` variable (what its cycle so
    far logged: the summed token losses, the tokens, the examples), or None."""
    return _named(optimizer, LOSS_LOG_NAME)


def tracker_sums(tracker):
    """(total, count): the variables of a `keras.metrics.Mean` (the model's
    loss tracker), which `cycle_logged_loss` corrects."""
    for name in ("total", "count"):
        if not isinstance(getattr(tracker, name, None), keras.Variable):
            raise _missing(f"{type(tracker).__name__}.{name} (a keras.metrics.Mean's variable)")
    return tracker.total, tracker.count


def count_weighted(optimizer, gradients, variables, count, read=None):
    """(the gradients to hand Keras's accumulation, the new value of the
    cycle's summed loss counts), for a micro-step whose loss divided a sum
    by `count` (the joined count of every tower, the same on each).

    Keras's accumulators add what they are given, and the k-th micro-step
    applies `(g + acc) / k`. Given `count * g` on the first k-1 micro-steps
    (the gradient of the summed token losses), and on the k-th
    `k * (acc + count * g) / (counts + count) - acc`, Keras applies
    `sum_j count_j * g_j / sum_j count_j`: the gradient of the k
    micro-steps' summed token losses divided by all their tokens. `read`
    gives a variable's value in the step (JAX's stateless state); by
    default its own."""
    read = read or (lambda variable: variable.value)
    steps = accumulation_steps(optimizer)
    counter, accumulators = _accumulation_state(optimizer, variables)
    counts = read(loss_count_variable(optimizer))
    last = keras.ops.equal((read(counter) + 1) % steps, 0)
    total = counts + keras.ops.cast(count, counts.dtype)
    weighted = []
    for gradient, accumulator in zip(gradients, accumulators):
        gradient = _dense(gradient)
        scaled = gradient * keras.ops.cast(count, gradient.dtype)
        accumulated = read(accumulator)
        applied = (accumulated + scaled) * keras.ops.cast(steps / total, gradient.dtype) - accumulated
        weighted.append(keras.ops.where(last, applied, scaled))
    return weighted, keras.ops.where(last, keras.ops.zeros_like(total), total)


def cycle_logged_loss(optimizer, step, count, read=None):
    """(what to add to the loss tracker's total, the new value of the
    optimizer's `accumulated_loss_log`), for a micro-step whose
    token-normalised loss divided by `count` (joined over the towers).

    `step`: this micro-step's [its addition to the tracker's total, to its
    count (its examples), the tracker's count before it], each summed over
    the towers. One device on the k x N x B joined examples logs a cycle
    once, as its token mean `sum_j count_j * loss_j / sum_j count_j` times
    its examples; each micro-step adds its own token mean. The correction
    makes the tracker hold, for the cycle so far, its token mean times its
    examples so far: at the cycle's end, one device's figure. A tracker
    reset within a cycle (a new epoch) starts the cycle's log again, from
    the micro-steps it holds."""
    read = read or (lambda variable: variable.value)
    steps = accumulation_steps(optimizer)
    counter, _ = _accumulation_state(optimizer, [])
    log = read(loss_log_variable(optimizer))
    added, examples, before = step[0], step[1], step[2]
    held = keras.ops.greater_equal(before, log[2])   # else: reset since
    losses, tokens, seen = (keras.ops.where(held, value, keras.ops.zeros_like(value))
                            for value in (log[0], log[1], log[2]))
    count = keras.ops.cast(count, log.dtype)
    mean = keras.ops.divide_no_nan(added, examples)
    new_losses, new_tokens, new_seen = losses + count * mean, tokens + count, seen + examples
    was = seen * keras.ops.divide_no_nan(losses, tokens)
    now = keras.ops.where(new_tokens > 0, new_seen * keras.ops.divide_no_nan(new_losses, new_tokens),
                          was + added)
    last = keras.ops.equal((read(counter) + 1) % steps, 0)
    new_log = keras.ops.stack([new_losses, new_tokens, new_seen])
    return now - was - added, keras.ops.where(last, keras.ops.zeros_like(new_log), new_log)
