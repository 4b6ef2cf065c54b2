"""Gradient reduction across towers, done before the optimizer clips.

Keras 3's TensorFlow optimizer all-reduces gradients inside `apply`, after it
has clipped them, so under N towers a clipping threshold acts on each tower's
share rather than on the gradient that is applied. kerastower reduces first,
and tells the optimizer that the gradients it gets are already reduced, so that
clipping and LossScaleOptimizer's non-finite check see the applied gradient.
"""

import contextlib
import threading

__all__ = ["adopt_optimizer", "gradients_already_reduced"]

# A counter, not a thread-local flag: MirroredStrategy may run the optimizer's
# merge_call and call_for_each_replica in threads other than the one that
# entered the block.
_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def gradients_already_reduced():
    """Within this block, an adopted optimizer's `apply` skips its all-reduce."""
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


def adopt_optimizer(optimizer):
    """Lets `gradients_already_reduced()` switch off `optimizer`'s all-reduce.

    Outside that block the optimizer behaves exactly as before, so a custom
    `train_step` that calls `optimizer.apply` itself keeps Keras's semantics.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or getattr(opt, "_kerastower_adopted", False):
            continue
        if not hasattr(opt, "_all_reduce_sum_gradients"):
            continue
        keras_all_reduce = opt._all_reduce_sum_gradients

        def all_reduce_unless_reduced(grads_and_vars, _keras=keras_all_reduce):
            if _depth > 0:
                return list(grads_and_vars)
            return _keras(grads_and_vars)

        opt._all_reduce_sum_gradients = all_reduce_unless_reduced
        opt._kerastower_adopted = True
