"""Every private Keras / TensorFlow / JAX-backend API kerastower uses, in one place.

Each one is looked up when first needed; a missing one raises a
`KerasTowerError` naming it and the installed versions, never a silent
fallback. Nothing outside this package imports `keras.src` or reaches for a
private attribute of a Keras or TensorFlow object. This module holds what
both backends and TensorFlow use; `on_jax.py` the JAX engine's hooks.

`TESTED` says which versions were tried; pyproject.toml allows the range.
"""

import functools
import importlib
import inspect
import threading

import keras

from kerastower._tf import tf
from kerastower.errors import KerasTowerError

__all__ = ["TESTED", "require", "tower_patches", "ScopedPatch"]

# The pairs CI runs: the newest (all tests) and the oldest pyproject.toml
# allows (scripts/test-oldest.sh: the equivalence tests).
TESTED = "Keras 3.15.1 with TensorFlow 2.21, and Keras 3.10.0 with TensorFlow 2.16.2"
TESTED_ON_JAX = "Keras 3.15.1 with JAX 0.10.2 (Keras 3.10.0's source has the same hooks)"


def _on_jax():
    return keras.backend.backend() == "jax"


def _versions():
    if _on_jax():
        import jax  # the backend in use: imported already

        return f"Keras {keras.__version__}, JAX {jax.__version__}"
    if keras.backend.backend() != "tensorflow":
        return f"Keras {keras.__version__} on {keras.backend.backend()}"
    return f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def _missing(what, error=None):
    detail = f" ({type(error).__name__}: {error})" if error is not None else ""
    tested, pair = ((TESTED_ON_JAX, "'keras==3.15.*' 'jax==0.10.*'") if _on_jax()
                    else (TESTED, "'tensorflow==2.21.*' 'keras==3.15.*'"))
    return KerasTowerError(
        f"kerastower needs {what}, which this installation does not have{detail}. "
        f"Installed: {_versions()}; kerastower is tested with {tested}. Install a "
        f"tested pair, e.g. pip install {pair}."
    )


@functools.cache
def require(module_name, attribute):
    """`module_name.attribute`, or a KerasTowerError naming it and the versions."""
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise _missing(f"{module_name}.{attribute}", error) from None


def _method(obj, name):
    method = getattr(obj, name, None)
    if method is None:
        raise _missing(f"{type(obj).__name__}.{name}")
    return method


# -- a concrete function called with its arguments bound once ------------------

def bound_call(concrete, args):
    """`concrete(*args)` as a function of no arguments. The arguments are
    matched to the trace and flattened here, once; each call then only runs
    the function on the same flat tensors (an iterator's are its resource
    handles, fixed for its life)."""
    canonicalize = require(
        "tensorflow.python.eager.polymorphic_function.function_type_utils",
        "canonicalize_function_inputs",
    )
    function_type = getattr(concrete, "function_type", None)
    if not hasattr(function_type, "unpack_inputs"):
        raise _missing("ConcreteFunction.function_type.unpack_inputs")
    call_flat = _method(concrete, "_call_flat")
    flat = function_type.unpack_inputs(canonicalize(args, {}, function_type))
    return lambda: call_flat(flat, concrete.captured_inputs)


# -- keras.src functions ------------------------------------------------------

def unpack_x_y_sample_weight(data):
    fn = require("keras.src.trainers.data_adapters.data_adapter_utils", "unpack_x_y_sample_weight")
    return fn(data)


def class_weight_to_sample_weights(y, class_weight):
    fn = require("keras.src.trainers.data_adapters.data_adapter_utils",
                 "class_weight_to_sample_weights")
    return fn(y, class_weight)


def train_validation_split(arrays, validation_split):
    fn = require("keras.src.trainers.data_adapters.array_slicing", "train_validation_split")
    return fn(arrays, validation_split=validation_split)


def print_msg(message):
    require("keras.src.utils.io_utils", "print_msg")(message)


def pythonify_logs(logs):
    return require("keras.src.utils.python_utils", "pythonify_logs")(logs)


def functional_init_arguments(args, kwargs):
    return require("keras.src.models.model", "functional_init_arguments")(args, kwargs)


def makes_functional(cls, base, args, kwargs):
    """Whether `cls(*args, **kwargs)` means a functional model, (inputs,
    outputs), as Keras decides it: unless `cls`'s own `__init__` (not
    `base`'s) starts with other parameters, a GAN's generator and
    discriminator say."""
    if not functional_init_arguments(args, kwargs) or issubclass(cls, functional_class()):
        return False
    if cls.__init__ is base.__init__:
        return True
    params = list(inspect.signature(cls.__init__).parameters.values())[1:3]
    if params and params[0].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return True
    return [p.name for p in params] == ["inputs", "outputs"]


def functional_class():
    return require("keras.src.models.functional", "Functional")


def compute_output_spec(fn, *args, **kwargs):
    backend = require("keras.src", "backend")
    return _method(backend, "compute_output_spec")(fn, *args, **kwargs)


# -- private members of keras.Model and layers ---------------------------------

def compute_loss(model, **kwargs):
    """The model's loss as Keras's own train_step computes it (which calls a
    user's `compute_loss` override with or without `training`)."""
    return _method(model, "_compute_loss")(**kwargs)


def call_has_training_arg(model):
    if not hasattr(model, "_call_has_training_arg"):
        raise _missing("keras.Model._call_has_training_arg")
    return model._call_has_training_arg


def loss_tracker(model):
    tracker = getattr(model, "_loss_tracker", False)
    if tracker is False:
        raise _missing("keras.Model._loss_tracker")
    return tracker


def flatten_layers(model):
    return list(_method(model, "_flatten_layers")())


def _traced_nodes(function):
    """Every node of the graphs `function` (a tf.function) has traced,
    nested functions included, each function counted once."""
    concrete = _method(function, "_list_all_concrete_functions")()
    functions, nodes = {}, []
    for graph_def in (c.graph.as_graph_def() for c in concrete):
        nodes += list(graph_def.node)
        functions.update((f.signature.name, f) for f in graph_def.library.function)
    return nodes + [n for f in functions.values() for n in f.node_def]


def xla_compiled_calls(function):
    """How many calls to XLA-compiled functions the graphs `function` (a
    tf.function) has traced hold, nested functions included."""
    return sum(1 for node in _traced_nodes(function)
               if "_XlaMustCompile" in node.attr and node.attr["_XlaMustCompile"].b)


def op_counts(function):
    """{op type: how many} over the graphs `function` has traced."""
    counts = {}
    for node in _traced_nodes(function):
        counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def op_determinism():
    """Whether tf.config.experimental.enable_op_determinism() is in effect."""
    return bool(require("tensorflow.python.framework.config", "is_op_determinism_enabled")())


def symbolic_build(model, data_batch):
    _method(model, "_symbolic_build")(data_batch=data_batch)


def assert_compile_called(model, method_name):
    _method(model, "_assert_compile_called")(method_name)


def flatten_metrics_in_order(model, logs):
    return _method(model, "_flatten_metrics_in_order")(logs)


def initial_epoch(model):
    """The epoch Keras's BackupAndRestore set to resume from, or None."""
    return getattr(model, "_initial_epoch", None)


def seed_generators(layer):
    """The layer's `keras.random.SeedGenerator`s (Dropout's, ...)."""
    return list(getattr(layer, "_seed_generators", None) or [])


def optimizer_variables(optimizer):
    """The variables a built optimizer updates, in the order it was built on."""
    if not hasattr(optimizer, "_trainable_variables"):
        raise _missing(f"{type(optimizer).__name__}._trainable_variables")
    return list(optimizer._trainable_variables)


# -- tf.distribute internals -----------------------------------------------------

class input_devices_kept:
    """Puts MirroredStrategy's input devices back after a PER_REPLICA input
    call: TF 2.21 keeps that call's devices for good, after which a shared
    pipeline feeds every tower the same batch."""

    def __init__(self, tf_strategy):
        self.extended = tf_strategy.extended

    def __enter__(self):
        self.saved = getattr(self.extended, "_input_workers_devices", None)
        return self

    def __exit__(self, *exc_info):
        if self.saved is not None:
            self.extended._input_workers_devices = self.saved
        return False


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


def _patch(owner, name, make_replacement):
    original = getattr(owner, name, None)
    if original is None:
        raise _missing(f"{getattr(owner, '__qualname__', owner.__name__)}.{name}")
    if getattr(original, "_kerastower_original", None) is not None:
        return
    replacement = functools.update_wrapper(make_replacement(original), original)
    replacement._kerastower_original = original
    setattr(owner, name, replacement)


class _PatchGroup:
    """ScopedPatches entered and left together."""

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

    return _PatchGroup([
        ScopedPatch(loss_module, "scale_loss_for_distribution", per_tower_scaling),
        ScopedPatch(loss_module, "unscale_loss_for_distribution", per_tower_scaling),
        ScopedPatch(lambda: require("keras.src.optimizers.base_optimizer", "BaseOptimizer"),
                    "apply", reduce_then_apply),
        ScopedPatch(lambda: require("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer"),
                    "apply", reduce_then_apply),
        ScopedPatch(lambda: require("keras.src.backend.tensorflow.optimizer", "TFOptimizer"),
                    "_all_reduce_sum_gradients", skip_if_reduced),
    ])


def apply_if(condition, apply, gradients):
    """Inside a tower: `apply(gradients)` on every tower where `condition`
    (the same on all towers) holds, else nothing.

    Where the strategy updates variables through `merge_call` (TF's
    MirroredStrategy), a `tf.cond` around the update must be taken in the
    cross-replica context, as Keras's LossScaleOptimizer does.
    """
    internal = require("tensorflow", "__internal__")
    supports_no_merge_call = _method(internal.distribute, "strategy_supports_no_merge_call")
    replica_ctx = tf.distribute.get_replica_context()
    if replica_ctx is None or supports_no_merge_call():
        tf.cond(condition, lambda: _no_output(apply(gradients)), _no_output)
        return

    def in_cross_replica(distribution, condition, gradients):
        first = distribution.experimental_local_results(condition)[0]

        def apply_on_every_tower():
            distribution.extended.call_for_each_replica(apply, args=(gradients,))

        tf.cond(first, apply_on_every_tower, _no_output)

    replica_ctx.merge_call(in_cross_replica, args=(condition, gradients))


def _no_output(*_):
    return None


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
