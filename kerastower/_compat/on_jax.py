"""The private Keras APIs of the JAX engine (see the package's docstring).

A `keras.StatelessScope` opened inside another does not read the outer
one's values (a variable it does not map reads its stored value), so a
step that differentiates inside a tower function would see stale weights;
`inheriting_stateless_scope` starts from the outer scope's mapping.

Keras 3 refuses `BatchNormalization(synchronized=True)` on JAX (its
constructor raises, and `keras.src.backend.jax.nn.moments` raises for
`synchronized=True`). Two `ScopedPatch`es change that, only while
kerastower holds them (backend/jax/sync.py says when):
`synchronized_batchnorm_admitted` lets the layer be built,
`synchronized_moments_routed` routes its moments to kerastower's, which
reduce over the towers.

Inside the towers' `shard_map`, JAX types every value as the same on all
towers or as each tower's own, and `lax.scan` wants its carry's type not
to change: a recurrent layer's initial state (zeros, the same everywhere)
becomes each tower's own after one step, and Keras's JAX `rnn` fails.
`rnn_initial_states_typed` hands Keras's `rnn` its initial states already
typed as each tower's own while a tower's step is traced.
"""

import contextlib
import functools
import importlib
import inspect

import keras

from kerastower._compat.patches import ScopedPatch
from kerastower._compat.required import _missing
from kerastower._compat.required import require

__all__ = ["require_function", "stored_values", "jaxpr_as_fun", "jaxpr_with_outputs", "run_equations", "is_jaxpr_literal", "synchronized_moments_routed", "synchronized_batchnorm_admitted",
           "rnn_initial_states_typed", "current_stateless_scope", "inheriting_stateless_scope", "compile_metrics_parts",
           "gathered_over"]

_MOMENTS = ("keras.src.backend.jax.nn", "moments")
_STATELESS_SCOPE = ("keras.src.backend.common.stateless_scope", "get_stateless_scope")
_BATCHNORM = ("keras.src.layers.normalization.batch_normalization", "BatchNormalization")
_COMPILE_METRICS = ("keras.src.trainers.compile_utils", "CompileMetrics")
_METRICS_LIST = ("keras.src.trainers.compile_utils", "MetricsList")


def require_function(module_name, attribute):
    """`module_name.attribute` as a function or class, or a KerasTowerError
    naming it and the versions."""
    found = require(module_name, attribute)
    if not callable(found):
        raise _missing(f"{module_name}.{attribute} as a function or class")
    return found


def jaxpr_as_fun(closed_jaxpr):
    """A closed jaxpr as a function of its inputs' leaves, run in the current
    trace (jax.extend's `jaxpr_as_fun`): the towers' step traced once, then
    run as one computation or as a switch's branches (backend/jax/towers.py)."""
    return require_function("jax.extend.core", "jaxpr_as_fun")(closed_jaxpr)


def jaxpr_with_outputs(closed_jaxpr, outvars):
    """`closed_jaxpr` returning `outvars` (its own variables) instead of its
    outputs: the same program, more of its values kept, and the equations
    none of them needs left out (but those with effects), so that running
    it does not trace them (jax.extend's `Jaxpr.replace`)."""
    jaxpr = closed_jaxpr.jaxpr
    if not callable(getattr(jaxpr, "replace", None)) or not callable(getattr(closed_jaxpr, "replace", None)):
        raise _missing("jax.extend.core.Jaxpr.replace and ClosedJaxpr.replace")
    needed = {var for var in outvars if not is_jaxpr_literal(var)}
    kept = []
    for equation in reversed(jaxpr.eqns):
        if equation.effects or any(var in needed for var in equation.outvars):
            kept.append(equation)
            needed.update(var for var in equation.invars if not is_jaxpr_literal(var))
    return closed_jaxpr.replace(jaxpr=jaxpr.replace(outvars=list(outvars), eqns=kept[::-1]))


def run_equations(equations, inputs):
    """The value of a chain of a jaxpr's equations, each taking the one
    before's output (the first: `inputs`), run in the current trace
    (jax.extend's `Primitive.bind` with each equation's parameters)."""
    value = None
    for index, equation in enumerate(equations):
        bind = getattr(getattr(equation, "primitive", None), "bind", None)
        if not callable(bind) or not isinstance(getattr(equation, "params", None), dict):
            raise _missing("jax.extend.core.JaxprEqn with a primitive to bind and its params")
        # The context the equation was traced in (compute type, XLA
        # metadata, mesh), as JAX's own evaluation of a jaxpr enters it.
        context = getattr(getattr(equation, "ctx", None), "manager", None)
        with context if context is not None else contextlib.nullcontext():
            value = bind(*(inputs if index == 0 else [value]), **equation.params)
    return value


def is_jaxpr_literal(atom):
    """Whether a jaxpr's atom is a literal (jax.extend's `Literal`), not a
    variable: a literal cannot be hashed."""
    return isinstance(atom, require_function("jax.extend.core", "Literal"))


def _parameter(function, name, what):
    parameters = inspect.signature(function).parameters
    if name not in parameters:
        raise _missing(f"{what} with a `{name}` argument")
    return parameters[name]


def synchronized_moments_routed(synchronized_moments):
    """A `ScopedPatch`: while entered, Keras's JAX `moments(x, axes, keepdims,
    synchronized=True)` calls `synchronized_moments(x, axes, keepdims,
    local)`, `local` being Keras's own unsynchronized moments; with
    `synchronized=False` it is Keras's own. Checked when first entered."""

    def find_module():
        moments = require_function(*_MOMENTS)
        _parameter(moments, "synchronized", ".".join(_MOMENTS))
        return importlib.import_module(_MOMENTS[0])

    def routed(original):
        def moments(x, axes, keepdims=False, synchronized=False):
            if not synchronized:
                return original(x, axes, keepdims, synchronized=False)
            return synchronized_moments(x, axes, keepdims, functools.partial(original, synchronized=False))
        return moments

    return ScopedPatch(find_module, _MOMENTS[1], routed)


def synchronized_batchnorm_admitted():
    """A `ScopedPatch`: while entered, `BatchNormalization(synchronized=True)`
    builds on JAX (Keras's constructor raises for it off TensorFlow).

    The constructor is given `synchronized=False` for Keras's backend check
    and the layer then says `synchronized=True`, so `get_config` round-trips.
    Checked when first entered.
    """

    def find_class():
        batchnorm = require_function(*_BATCHNORM)
        _parameter(batchnorm.__init__, "synchronized", "BatchNormalization.__init__")
        return batchnorm

    def accepting_synchronized(original):
        signature = inspect.signature(original)

        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            synchronized = bool(bound.arguments.get("synchronized", False))
            bound.arguments["synchronized"] = False
            original(*bound.args, **bound.kwargs)
            self.synchronized = synchronized

        # Keras reads the constructor's arguments for get_config
        # (inspect.getfullargspec, which does not follow __wrapped__).
        __init__.__signature__ = signature
        return __init__

    return ScopedPatch(find_class, "__init__", accepting_synchronized)


def rnn_initial_states_typed(typed):
    """A `ScopedPatch`: while entered, Keras's `backend.rnn` (what every
    recurrent layer calls) gets its initial states as `typed(state)`."""

    def typed_states(original):
        def rnn(step_function, inputs, initial_states, *args, **kwargs):
            states = [typed(state) for state in initial_states]
            return original(step_function, inputs, type(initial_states)(states)
                            if isinstance(initial_states, (list, tuple)) else states, *args, **kwargs)
        return rnn

    def owner():
        backend_module = importlib.import_module("keras.src.backend")
        _parameter(require_function("keras.src.backend", "rnn"), "initial_states", "keras.src.backend.rnn")
        return backend_module

    return ScopedPatch(owner, "rnn", typed_states)


def current_stateless_scope():
    """The innermost open `keras.StatelessScope`, or None."""
    return require_function(*_STATELESS_SCOPE)()


def inheriting_stateless_scope(state_mapping, collect_losses=False):
    """A `keras.StatelessScope` mapping `state_mapping` (pairs of variable and
    value) over what the scope it is opened in maps, so every variable reads
    its value inside the enclosing step, not its stored one."""
    scope = keras.StatelessScope(state_mapping=state_mapping, collect_losses=collect_losses)
    outer = current_stateless_scope()
    if outer is None:
        return scope
    inherited = getattr(outer, "state_mapping", None)
    if not isinstance(inherited, dict) or not isinstance(getattr(scope, "state_mapping", None), dict):
        raise _missing("keras.StatelessScope.state_mapping as a dict of variable id to value")
    scope.state_mapping = {**inherited, **scope.state_mapping}
    return scope


def compile_metrics_parts(metric):
    """The metrics inside `metric` when `compile(metrics=...)` made it (Keras's
    CompileMetrics, and the MetricsList of each output inside it, whose
    `reset_state` resets each of them; none before it is built), else None."""
    if isinstance(metric, require_function(*_METRICS_LIST)):
        names = ("metrics",)
    elif isinstance(metric, require_function(*_COMPILE_METRICS)):
        if not metric.built:
            return []
        names = ("_flat_metrics", "_flat_weighted_metrics")
    else:
        return None
    parts = []
    for name in names:
        found = getattr(metric, name, None)
        if not isinstance(found, (list, tuple)):
            raise _missing(f"{type(metric).__name__}.{name} as a list")
        parts.extend(part for part in found if part)
    return parts


def stored_values(variables):
    """What each Keras variable stores (`Variable._value`), without the
    autocast-scope and global-state lookups of `.value` (4 us a variable):
    whether a variable was set since is told by its identity. Outside any
    stateless scope, `.value` returns it."""
    try:
        return [v._value for v in variables]
    except AttributeError as error:
        raise _missing("keras.Variable._value (the array a variable stores)", error) from None


def gathered_over(value, axis_name):
    """Inside `shard_map`, every tower's `value` joined along axis 0, in
    tower order, typed as the same on every tower (JAX's `all_gather` with
    `to="invarying"`): what the towers' shards of a weight become
    (backend/jax/optimizer_shards.py). Checked when first called."""
    import jax

    _parameter(jax.lax.all_gather, "to", "jax.lax.all_gather")
    try:
        return jax.lax.all_gather(value, axis_name, tiled=True, to="invarying")
    except ValueError as error:
        if "to" not in str(error):
            raise
        raise _missing('jax.lax.all_gather(..., to="invarying")', error) from None
