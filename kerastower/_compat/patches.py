"""Where kerastower patches Keras, and for how long: only while it needs to.

A `ScopedPatch` replaces a Keras function while some scope holds it and
puts Keras's own back when the last scope ends. TensorFlow's towers enter
`tower_patches` (a tower's loss is its own mean; its `optimizer.apply`
reduces over the towers first); `kt.distributed` enters the stock-`fit`
check; on JAX, `kt.distributed` and the engine's steps enter the patches
that admit synchronized BatchNormalization (on_jax.py). Nothing is
patched when kerastower is imported.
"""

import functools
import threading

from kerastower._compat.required import _missing
from kerastower._compat.required import require

__all__ = ["ScopedPatch", "PatchGroup", "tower_patches", "stock_fit_checked", "graph_reset_wrapped",
           "gradients_already_reduced", "is_reducing", "loss_reductions_replaced"]


# -- patches: tower semantics for Keras's losses and optimizers -------------------
#
# Inside a kerastower tower, (1) Keras's losses are NOT divided by the number
# of replicas (each tower's loss is its own mean, as on one device), and (2)
# `optimizer.apply(gradients)` applies the example-weighted mean of the
# towers' gradients, reduced BEFORE the optimizer clips. Outside a tower,
# Keras behaves exactly as it does without kerastower.

_state = threading.local()
_reduced_lock = threading.Lock()
_reduced_depth = 0  # global: tf.distribute runs merge calls in other threads


def _in_tower():
    from kerastower.tower import get_current_tower_context

    return get_current_tower_context() is not None


def is_reducing():
    """True in the thread applying gradients kerastower already reduced."""
    return getattr(_state, "reducing", False)


class gradients_already_reduced:
    """Within it, the optimizer's own all-reduce is switched off."""

    def __enter__(self):
        global _reduced_depth
        _state.reducing = True
        with _reduced_lock:
            _reduced_depth += 1
        return self

    def __exit__(self, *exc_info):
        global _reduced_depth
        _state.reducing = False
        with _reduced_lock:
            _reduced_depth -= 1
        return False


class PatchGroup:
    """ScopedPatches entered and left together (all or none)."""

    def __init__(self, patches):
        self._patches = list(patches)

    def __enter__(self):
        entered = []
        try:
            for patch in self._patches:
                patch.__enter__()
                entered.append(patch)
        except BaseException:
            for patch in reversed(entered):
                patch.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info):
        for patch in reversed(self._patches):
            patch.__exit__(*exc_info)
        return False


def tower_patches(apply_in_tower):
    """The patches a TensorFlow tower runs under, as one scope to enter
    while a tower is traced or run (TensorFlow's `tower_scope`): outside
    every tower, Keras's losses and optimizers are Keras's own.
    `apply_in_tower(optimizer, apply, grads, variables)` is called for
    `optimizer.apply` inside a training tower; `apply` is Keras's own, to
    be called on the reduced gradients."""

    def per_tower_scaling(original):
        def scale(value):
            return value if _in_tower() else original(value)
        return scale

    def reduce_then_apply(original):
        def apply(self, grads, trainable_variables=None):
            from kerastower.tower import get_current_tower_context

            ctx = get_current_tower_context()
            if ctx is None or not ctx.is_training or is_reducing():
                return original(self, grads, trainable_variables)
            return apply_in_tower(self, original, grads, trainable_variables)
        return apply

    def skip_if_reduced(original):
        def all_reduce(self, grads_and_vars):
            if _reduced_depth > 0:
                return list(grads_and_vars)
            return original(self, grads_and_vars)
        return all_reduce

    def loss_module():
        return require("keras.src.losses", "loss")

    return PatchGroup([
        ScopedPatch(loss_module, "scale_loss_for_distribution", per_tower_scaling),
        ScopedPatch(loss_module, "unscale_loss_for_distribution", per_tower_scaling),
        ScopedPatch(lambda: require("keras.src.optimizers.base_optimizer", "BaseOptimizer"),
                    "apply", reduce_then_apply),
        ScopedPatch(lambda: require("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer"),
                    "apply", reduce_then_apply),
        ScopedPatch(lambda: require("keras.src.backend.tensorflow.optimizer", "TFOptimizer"),
                    "_all_reduce_sum_gradients", skip_if_reduced),
    ])


class ScopedPatch:
    """A replacement of `owner.name`, in place only while a scope holds it.

    Entering installs it (the first of nested or concurrent scopes does);
    leaving the last scope puts Keras's original back, so code outside
    every scope runs Keras unchanged. `owner` is found (and checked, with
    the versions named if it moved) when first entered.
    """

    def __init__(self, find_owner, name, make_replacement):
        self._find_owner = find_owner
        self._name = name
        self._make_replacement = make_replacement
        self._lock = threading.Lock()
        self._depth = 0
        self._original = None

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                owner = self._find_owner()
                original = getattr(owner, self._name, None)
                if original is None:
                    raise _missing(f"{getattr(owner, '__qualname__', owner.__name__)}.{self._name}")
                self._owner, self._original = owner, original
                setattr(owner, self._name,
                        functools.update_wrapper(self._make_replacement(original), original))
            self._depth += 1
        return self

    def __exit__(self, *exc_info):
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                setattr(self._owner, self._name, self._original)
                self._original = None
        return False


def masked_losses_divided_by(divisor):
    """A `ScopedPatch` of Keras's `losses.loss.apply_mask`: while entered, a
    masked loss reduced by its mean (`"sum_over_batch_size"`) divides its
    sum by `divisor(valid, batch_size)` (`valid`: the unmasked entries
    counted) in place of `valid`, unless `divisor` gives None. Keras's own
    weights are rescaled, not recomputed: `total / valid` becomes
    `total / divisor`."""

    def divided(original):
        def apply_mask(sample_weight, mask, dtype, reduction):
            weights = original(sample_weight, mask, dtype, reduction)
            if mask is None or reduction not in ("mean", "sum_over_batch_size"):
                return weights
            import keras

            valid = keras.ops.sum(keras.ops.cast(mask, dtype))
            new = divisor(valid, keras.ops.shape(mask)[0])
            if new is None:
                return weights
            return weights * keras.ops.cast(keras.ops.divide_no_nan(valid, new), weights.dtype)
        return apply_mask

    return ScopedPatch(lambda: require("keras.src.losses", "loss"), "apply_mask", divided)


def loss_reductions_replaced(reduce, output_weight):
    """A `PatchGroup` of Keras's `losses.loss.reduce_values`, of
    `CompileLoss.call` and of `metrics.Mean.update_state`: while entered, a
    Keras loss reduces its values as
    `reduce(keras_reduce, values, sample_weight, reduction, compiled)`,
    `keras_reduce` being Keras's own and `compiled` whether the loss is a
    component of the compiled loss (called by `CompileLoss.call` in this
    thread), whose reductions and sum kerastower knows; and the compiled
    loss's per-output trackers (`a_loss`), which Keras weighs by the
    batch's static size, weigh a batch whose static size is unknown by
    `output_weight()` (None: as Keras, once)."""
    local = threading.local()

    def marking(original):
        def call(self, *args, **kwargs):
            depth, trackers = getattr(local, "depth", 0), getattr(local, "trackers", ())
            local.depth, local.trackers = depth + 1, tuple(self.metrics)
            try:
                return original(self, *args, **kwargs)
            finally:
                local.depth, local.trackers = depth, trackers
        return call

    def replaced(original):
        def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
            return reduce(original, values, sample_weight, reduction, getattr(local, "depth", 0) > 0)
        return reduce_values

    def weighed(original):
        def update_state(self, values, sample_weight=None):
            if sample_weight is None and any(self is t for t in getattr(local, "trackers", ())):
                sample_weight = output_weight()
            return original(self, values, sample_weight=sample_weight)
        return update_state

    return PatchGroup([
        ScopedPatch(lambda: require("keras.src.losses", "loss"), "reduce_values", replaced),
        ScopedPatch(lambda: require("keras.src.trainers.compile_utils", "CompileLoss"), "call", marking),
        ScopedPatch(lambda: require("keras.src.metrics.reduction_metrics", "Mean"), "update_state", weighed),
    ])


def stock_fit_checked(check):
    """A `ScopedPatch`: while entered, `check(model)` runs before stock
    Keras's `fit` trains a model (not a TowerModel, whose fit is
    kerastower's). TensorFlow's trainer only."""

    def checked_fit(original):
        def fit(self, *args, **kwargs):
            check(self)
            return original(self, *args, **kwargs)
        return fit

    return ScopedPatch(lambda: require("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"),
                       "fit", checked_fit)


def graph_reset_wrapped(around):
    """A scoped patch of TensorFlow's `reset_default_graph` (which
    `keras.backend.clear_session()` calls as `tf.compat.v1.reset_default_graph`):
    while entered, a reset runs as `around(reset)`, `reset` being
    TensorFlow's own. The reset makes a new default graph, and the
    `tf.distribute` scopes entered on the old one are gone with it.

    TensorFlow exports the function from several module objects (importing
    `tensorflow.compat.v1` by name makes a new one and rebinds
    `tf.compat.v1` to it), so every module holding it is patched."""
    return _EveryBinding("reset_default_graph", around)


class _EveryBinding:
    """While entered, every loaded module whose `name` is TensorFlow's
    function of that name calls `around(original)` instead (nested and
    concurrent scopes share one installation; the last to leave restores)."""

    def __init__(self, name, around):
        self._name = name
        self._around = around
        self._lock = threading.Lock()
        self._depth = 0
        self._patched = []

    def __enter__(self):
        import sys

        with self._lock:
            if self._depth == 0:
                from kerastower._tf import tf

                original = getattr(tf.compat.v1, self._name, None)
                if original is None:
                    raise _missing(f"tf.compat.v1.{self._name}")

                def replacement():
                    return self._around(original)

                functools.update_wrapper(replacement, original)
                self._patched = [module for module in list(sys.modules.values())
                                 if getattr(module, self._name, None) is original]
                for module in self._patched:
                    setattr(module, self._name, replacement)
                self._original = original
            self._depth += 1
        return self

    def __exit__(self, *exc_info):
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for module in self._patched:
                    setattr(module, self._name, self._original)
                self._patched = []
        return False
