"""Tower contexts: which replica of the model is being built, and the tower rules.

A *tower* is one replica of the model on one device. kerastower calls the
model's step once per tower, each time under a `TowerContext`, so code inside
`call`, `compute_loss` or a custom step can ask which tower it is on:

```python
import kerastower as kt

class Net(kt.TowerModel):
    def call(self, x, training=False):
        ctx = kt.get_current_tower_context()
        if ctx is not None and ctx.is_main_training_tower:
            pass  # e.g. add a summary only once per step
        return self.dense(x)
```
"""

import contextlib
import threading

from kerastower._tf import tf
from kerastower.errors import TowerRuleError

__all__ = ["TowerContext", "get_current_tower_context"]

# MirroredStrategy runs each replica's function in its own thread while
# tracing, so the stack of active contexts must be per thread.
_local = threading.local()


def _stack():
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class TowerContext:
    """Describes the tower whose step is running.

    Attributes:
        index: Python int, 0..total-1. A plain int, so code may branch on it
            while a step is traced.
        total: Python int, the number of towers taking part in the step.
        is_training: True in `fit`, False in `evaluate` and `predict`.
        name: "tower{index}" in training, "eval_tower{index}" or
            "predict_tower{index}" otherwise.
        num_examples: in a training step, this tower's batch size (a scalar
            tensor); None elsewhere.
        example_weight: in a training step, this tower's share of the step's
            examples, `n_i / sum_j n_j` (a float32 tensor): what
            `optimizer.apply` weights this tower's gradients by. It may be
            read in the forward pass: a loss summed over the tower's batch,
            divided by it, is summed over the joined batch (see
            docs/training.md, "Loss reductions over towers").
        strategy: the `kt.TowerStrategy` running the tower (None when the
            context was made by hand).
        batch_size: this tower's batch size in the step (a scalar tensor),
            in training and evaluation; None when made by hand.
        sum_over_towers: sums a value over every tower (and process) of the
            step, inside it; None on one tower or when made by hand. Used by
            `kt.global_sum` and `kt.loss_divisor`.

    Examples:
        >>> with kt.TowerContext(index=1, total=2, is_training=True) as ctx:
        ...     kt.get_current_tower_context().name
        'tower1'
    """

    def __init__(self, index, total, is_training, name=None):
        if not (isinstance(index, int) and isinstance(total, int)):
            raise TypeError(
                "TowerContext needs Python ints for index and total; got "
                f"index={index!r}, total={total!r}."
            )
        if not 0 <= index < total:
            raise ValueError(
                f"TowerContext index must be in [0, total); got index={index}, "
                f"total={total}."
            )
        self.index = index
        self.total = total
        self.is_training = bool(is_training)
        if name is None:
            name = f"tower{index}" if self.is_training else f"eval_tower{index}"
        self.name = name
        self.num_examples = None
        self._example_weight = None
        self._weight_fn = None
        self.strategy = None
        self.check_finite = True
        self.batch_size = None
        self.sum_over_towers = None
        # Whether the tower's code summed a value over the towers (kt.loss_divisor,
        # kt.global_sum, example_weight): its loss is then normalised over the
        # joined batch by its own hand (loss_reductions.py reads it).
        self.summed_over_towers = False
        # The reductions of Keras losses kerastower cannot see the end of
        # (loss_reductions.py), as (reduction, owner) pairs.
        self.unseen_reductions = []
        self.forward_without_collectives = False  # traced where no all-reduce can run
        # In a kt.Trainer tower function: the optimizers the model holds,
        # which checkpoints save (kt.minimize refuses any other).
        self.held_optimizers = None

    @property
    def sum_over_towers(self):
        if self._sum_over_towers is None:
            return None

        def summed(value):
            self.summed_over_towers = True
            return self._sum_over_towers(value)
        return summed

    @sum_over_towers.setter
    def sum_over_towers(self, function):
        self._sum_over_towers = function

    @property
    def example_weight(self):
        # Computed (with an all-reduce of the example counts) only when read:
        # optimizer.apply folds the counts into its gradient all-reduce.
        if self._example_weight is None and self._weight_fn is not None:
            self._example_weight = self._weight_fn()
        return self._example_weight

    @example_weight.setter
    def example_weight(self, value):
        self._example_weight = value
        self._weight_fn = None

    def defer_example_weight(self, weight_fn):
        """Makes `example_weight` the value of `weight_fn()`, computed when
        first read."""
        self._example_weight = None
        self._weight_fn = weight_fn

    @property
    def example_weight_deferred(self):
        """True while `example_weight` has not been computed."""
        return self._example_weight is None and self._weight_fn is not None

    @property
    def is_main_training_tower(self):
        """True on tower 0 of a training step: the tower that owns summaries."""
        return self.is_training and self.index == 0

    @property
    def is_main_tower(self):
        """True on tower 0, in training and in inference."""
        return self.index == 0

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc_info):
        popped = _stack().pop()
        assert popped is self, (popped, self)
        return False

    def __repr__(self):
        return (
            f"TowerContext(name={self.name!r}, index={self.index}, "
            f"total={self.total}, is_training={self.is_training})"
        )


def get_current_tower_context():
    """Returns the active `TowerContext`, or None outside any tower.

    Examples:
        >>> kt.get_current_tower_context() is None
        True
    """
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def forbid_variable_creation(step_name):
    """Raises `TowerRuleError` when a variable is created inside a tower step.

    Every variable must exist before the first step is traced (layers are
    built, the optimizer has its slots), so that each tower reuses the same
    variables: the Keras reading of tensorpack's "respect variable reuse".
    """

    def refuse(next_creator, **kwargs):
        del next_creator
        name = kwargs.get("name") or "<unnamed>"
        scope = tf.get_current_name_scope()
        # Inside a Keras layer's call the name scope is the layer's path.
        layer = f" (by the layer '{scope}', not built before the first step)" if scope else ""
        raise TowerRuleError(
            f"{step_name} created the variable '{name}'{layer}. Tower rule: every "
            "variable must exist before the first step, because the step runs once "
            "per tower and each tower must reuse the same variables. Build that layer "
            "before fit: create it in __init__ and call it once on a batch or on "
            "keras.Input (kerastower runs call() on a symbolic batch, building what it "
            "reaches), or call layer.build(input_shape); create tf.Variables outside "
            "train_step. See docs/towers.md, rule 2."
        )

    with tf.variable_creator_scope(refuse):
        yield
