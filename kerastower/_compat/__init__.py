"""Every private Keras / TensorFlow / JAX-backend API kerastower uses, in one place.

Each one is looked up when first needed; a missing one raises a
`KerasTowerError` naming it and the installed versions, never a silent
fallback. Nothing outside this package imports `keras.src` or reaches for a
private attribute of a Keras or TensorFlow object. `required.py` finds a
private name or fails loudly; `patches.py` is where Keras is patched and for
how long; this module holds the accessors both backends and TensorFlow use;
`on_jax.py` the JAX engine's hooks; `accumulation.py` Keras's gradient
accumulation on towers.

`TESTED` says which versions were tried; pyproject.toml allows the range.
"""

import functools
import inspect

from kerastower._tf import tf
from kerastower._compat.accumulation import accumulate_or_apply
from kerastower._compat.accumulation import accumulation_steps
from kerastower._compat.accumulation import count_weighted
from kerastower._compat.accumulation import keep_loss_counts
from kerastower._compat.accumulation import loss_count_variable
from kerastower._compat.accumulation import loss_log_variable
from kerastower._compat.accumulation import tracker_sums
from kerastower._compat.accumulation import cycle_logged_loss
from kerastower._compat.patches import PatchGroup
from kerastower._compat.patches import ScopedPatch
from kerastower._compat.patches import gradients_already_reduced
from kerastower._compat.patches import graph_reset_wrapped
from kerastower._compat.patches import is_reducing
from kerastower._compat.patches import loss_reductions_replaced
from kerastower._compat.patches import masked_losses_divided_by
from kerastower._compat.patches import stock_fit_checked
from kerastower._compat.patches import tower_patches
from kerastower._compat.required import TESTED
from kerastower._compat.required import TESTED_ON_JAX
from kerastower._compat.required import _method
from kerastower._compat.required import _missing
from kerastower._compat.required import require

__all__ = ["TESTED", "TESTED_ON_JAX", "require", "tower_patches", "ScopedPatch", "PatchGroup",
           "stock_fit_checked", "graph_reset_wrapped", "gradients_already_reduced", "is_reducing", "masked_losses_divided_by",
           "loss_reductions_replaced", "accumulation_steps", "accumulate_or_apply", "count_weighted",
           "keep_loss_counts", "loss_count_variable", "loss_log_variable", "tracker_sums",
           "cycle_logged_loss"]

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


def compiled_loss_or_metrics_unbuilt(model):
    """Whether the loss or metrics `compile` gave `model` are not built yet."""
    return any(not getattr(getattr(model, name, None), "built", True)
               for name in ("_compile_metrics", "_compile_loss"))


def keras_random_seed():
    """The seed `keras.utils.set_random_seed` set last, else None."""
    get = require("keras.src.backend.common.global_state", "get_global_attribute")
    return get(require("keras.src.utils.rng_utils", "GLOBAL_RANDOM_SEED"))


def keras_array_batches(length, batch_size, shuffle):
    """Keras's own tf.data pipeline of `fit(x)` over the arrays of
    `length` examples (its ArrayDataAdapter), fed the row indices: each
    element is one batch of the rows Keras reads, in its order."""
    adapter = require("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter")
    import numpy as np

    return adapter(np.arange(length, dtype=np.int64), batch_size=batch_size,
                   shuffle=shuffle).get_tf_dataset()


def class_weight_to_sample_weights(y, class_weight):
    fn = require("keras.src.trainers.data_adapters.data_adapter_utils",
                 "class_weight_to_sample_weights")
    return fn(y, class_weight)


def train_validation_split(arrays, validation_split):
    fn = require("keras.src.trainers.data_adapters.array_slicing", "train_validation_split")
    return fn(arrays, validation_split=validation_split)


def py_dataset_adapter(dataset):
    """Keras's own reader of a `keras.utils.PyDataset`: its worker threads or
    processes, queue and `on_epoch_begin`/`on_epoch_end`, in index order."""
    adapter_class = require("keras.src.trainers.data_adapters.py_dataset_adapter",
                            "PyDatasetAdapter")
    adapter = adapter_class(dataset, shuffle=False)
    for name in ("on_epoch_begin", "on_epoch_end", "get_numpy_iterator"):
        _method(adapter, name)
    return adapter


def tf_predictions_joined(parts):
    """One output's batches of predictions joined as Keras's TensorFlow
    `predict` joins them: ragged and sparse ones with tf.concat and
    tf.sparse.concat, dense ones of different shapes into a RaggedTensor;
    numpy arrays, except what stays ragged or sparse."""
    module = "keras.src.backend.tensorflow.trainer"
    joined = require(module, "potentially_ragged_concat")(parts)
    return require(module, "convert_to_np_if_not_ragged")(joined)


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


def _flush_async_batch_hooks(callbacks):
    # Keras 3.10 named it `_clear_futures`.
    name = "_clear_futures" if hasattr(callbacks, "_clear_futures") else "_flush_futures"
    _method(callbacks, name)()


def end_async_batch_hooks(callbacks):
    """Waits for the batch hooks Keras's CallbackList runs in a thread and
    ends its thread pool, as its on_train_end does, without calling any
    callback's on_train_end (a failed fit). Keras 3.10's pool lives as
    long as the list: there is nothing to end."""
    if getattr(callbacks, "_async_train", False):
        _flush_async_batch_hooks(callbacks)
        if not hasattr(callbacks, "_clear_futures"):
            _method(callbacks, "_on_end")()


def run_train_batch_hooks_in_loop(callbacks):
    """Makes Keras's CallbackList call its train-batch hooks in the loop's
    thread from now on, where it chose its thread pool when it was made
    (every callback then had no batch hook, or was `async_safe`): a callback
    added to it since may read the model between steps."""
    if getattr(callbacks, "_async_train", False):
        _flush_async_batch_hooks(callbacks)
        callbacks._async_train = False


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


def uses_weight_decay(optimizer, variable):
    """Whether `optimizer` decays `variable` (its `exclude_from_weight_decay`
    settings, by the variable's identity or name)."""
    return bool(_method(optimizer, "_use_weight_decay")(variable))


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
