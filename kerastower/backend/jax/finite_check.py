"""The NaN/Inf check of one tower's gradients, bounded from what produced them.

A step whose gradients are not all finite changes nothing (step.py). The
plain check reads every gradient once more after the backward pass has
written it (`towers.all_finite`: one sum per gradient); stock Keras-JAX
does no check, and on a 1024-wide MLP on a CPU that pass was 1-3% of the
step. Most of a network's weights are kernels whose gradient is one
matrix product, `dot_general(a, b)`, of an activation and a backward
signal that together are far smaller than the kernel (a batch of 64
against 784x1024 weights: a seventh). Every element and every partial sum
of such a product is at most `sum|a| * sum|b|` in size, so when both sums
and their product are well below the dtype's largest value, the product
can hold no NaN or Inf. The check then reads `a` and `b`, not the
gradient, and XLA may sum them as soon as they exist, the activation's
during the forward pass.

Where that bound is not met (a NaN or Inf in `a` or `b`, or values so
large that the product might overflow), the check reads every gradient as
before, so the flag is the plain check's in every case: exact, never a
false alarm. The bound is taken only where it holds and pays
(`_product_operands`): one float dtype of at least 32 bits, a
`lax.Precision` level (not a `DotAlgorithm`, which may round to float16),
operands together smaller than the gradient, each of at most 2**24
values. Other gradients (a bias's sum, an embedding's scatter, a
half-precision product, a weight used twice, whose gradients are added, a
long sequence's activations against a kernel) are read directly.

`checked_gradients` traces a tower's step once to a jaxpr (JAX's program
text), reads which equation produced each gradient, and runs the same
program with the products' operands as extra outputs. On a CPU the
products the bound covers are computed where the update uses them
(`CheckedGradients.values`): inside the cond that applies it, where the
thunks of one layer's product and another's update may run side by side.

Gating the update rests on a flag that needs no second look
(`CheckedGradients.apply_if_finite`): the bound met and the other
gradients' sums finite. The rare step where that is not so (a NaN, an
Inf, or a sum that overflowed from finite values) reads every gradient
and decides exactly. On XLA:CPU each conditional costs about as much as
a small pass over the weights (a 1024-wide MLP's step on a 2-core VM:
5.02 ms with its update in a cond, 4.94 applied outright), so the common
step runs two: one that only hands the flag on, and the update's.

A `keras.optimizers.LossScaleOptimizer` (mixed precision) is left to do
what it does, as on TensorFlow (`step_checks_finite`): its scaled
gradients overflow by design while the scale is too high, and it skips
such a step itself and lowers its scale. What it applies is only ever
the unscaled gradients it found finite, so the step is built without the
check and training goes on, as with stock Keras-JAX.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np

from kerastower._compat import on_jax as jax_compat
from kerastower.backend.jax.towers import abs_sum
from kerastower.backend.jax.towers import all_finite
from kerastower.backend.jax.towers import sums_finite

__all__ = ["checked_gradients", "CheckedGradients", "step_checks_finite"]

# Equations that move a product's values without changing them.
_SAME_VALUES = frozenset({"transpose", "reshape", "squeeze", "copy"})
# Rounding shrinks a computed sum of n non-negative terms by at most a
# factor (1 - eps)**n, and grows the product's partial sums by at most
# (1 + eps)**k over k terms: for n, k up to 2**24 in float32 (unit roundoff
# 2**-24) each factor is under e, and the three together (two sums low, the
# product high) under e**3 = 20.1, inside this margin. Operands rounded to
# bfloat16 or TF32 before the product (lax.Precision.DEFAULT on a TPU or
# GPU) grow by at most 2**-8 each.
_MARGIN = 32.0
_MOST_VALUES = 1 << 24


def step_checks_finite(model):
    """Whether `model`'s train steps check their gradients for NaN/Inf:
    unless compiled with `check_finite=False` or its optimizer is a
    `keras.optimizers.LossScaleOptimizer`, which checks the (scaled)
    gradients itself, skips a step that overflowed and lowers its loss
    scale: a check here would stop training at the first such step.

    Example:

    >>> from kerastower.backend.jax.finite_check import step_checks_finite
    >>> model = keras.Sequential([keras.layers.Dense(1)])
    >>> model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    >>> step_checks_finite(model)
    False
    """
    if isinstance(getattr(model, "optimizer", None), keras.optimizers.LossScaleOptimizer):
        return False
    return getattr(model, "tower_check_finite", True)


class CheckedGradients:
    """A tower's gradients, some still to be computed from their products'
    operands, and a flag that is True only where all of them are finite.

    Attributes:
        surely_finite: a boolean on the device; True: every gradient is
            finite. False: one may not be (`finite` or `apply_if_finite`
            then reads every gradient).
    """

    def __init__(self, gradients, surely_finite):
        self._gradients = gradients
        self.surely_finite = surely_finite

    @classmethod
    def of(cls, gradients):
        """Gradients already computed, sure where their sums are finite."""
        return cls(list(gradients), sums_finite(gradients))

    def values(self):
        """The gradients, the products among them computed here: called
        inside a cond's branch, they are computed there."""
        return [g.value() if isinstance(g, _Product) else g for g in self._gradients]

    def finite(self, going):
        """Whether every gradient is finite and `going`, exactly: the cond's
        common branch only hands `surely_finite` on; the other reads every
        gradient (`values()`, computed there)."""
        sure = jnp.logical_and(self.surely_finite, going)
        return jax.lax.cond(sure, lambda: sure,
                            lambda: jnp.logical_and(all_finite(self.values()), going))

    def apply_if_finite(self, apply, keep, going):
        """(`apply(values())` where every gradient is finite and `going`,
        else `keep()`; the flag saying which). The common step runs the
        update's cond after one that only hands on `surely_finite`; every
        gradient is read only where that flag is False.

        Example:

        >>> import jax.numpy as jnp
        >>> from kerastower.backend.jax.finite_check import CheckedGradients
        >>> checked = CheckedGradients.of([jnp.array([1.0, jnp.nan])])
        >>> new, finite = checked.apply_if_finite(
        ...     lambda g: g[0] * 2, lambda: jnp.zeros(2), jnp.asarray(True))
        >>> new.tolist(), bool(finite)
        ([0.0, 0.0], False)
        """
        finite = self.finite(going)
        return jax.lax.cond(finite, lambda: apply(self.values()), keep), finite


class _Product:
    """A gradient that is one matrix product (and moves of its values),
    computed when `value()` is called."""

    def __init__(self, equations, operands):
        self.equations = equations
        self.operands = operands

    def value(self):
        return jax_compat.run_equations(self.equations, self.operands)


def checked_gradients(branch, *args, defer_products=True):
    """(`branch(*args)` with its gradients as a `CheckedGradients`).

    `branch` returns a tuple whose first item is the list of gradients
    (None for a variable without one). With `defer_products`, those that
    a bound covers, and that nothing else in the step reads, are computed
    when `CheckedGradients.values` is called; the others are summed
    (`towers.sums_finite`).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from kerastower.backend.jax.finite_check import checked_gradients
    >>> def step(w, x):
    ...     return [jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)], x
    >>> def checked_step(w, x):
    ...     checked, x = checked_gradients(step, w, x)
    ...     return checked.values(), checked.surely_finite
    >>> gradients, surely_finite = jax.jit(checked_step)(jnp.ones((3, 4)), jnp.ones((2, 3)))
    >>> gradients[0].shape, bool(surely_finite)
    ((3, 4), True)
    """
    closed, shape = jax.make_jaxpr(branch, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    count = len(jax.tree.leaves(shape[0]))
    outvars = list(jaxpr.outvars)
    producers = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}
    products = [_product_operands(var, producers) for var in outvars[:count]]
    uses = _uses(jaxpr)
    deferred = [bool(pair) and defer_products and _read_once(var, producers, uses)
                for var, pair in zip(outvars[:count], products)]
    operands = list(dict.fromkeys(var for pair in products if pair for var in pair))
    # A deferred product is not an output here: this part of the step does
    # not compute it, and `values()` computes it where it is used.
    kept = [var for var, later in zip(outvars[:count], deferred) if not later] + outvars[count:]
    run = jax_compat.jaxpr_as_fun(jax_compat.jaxpr_with_outputs(closed, kept + operands))
    flat = run(*jax.tree.leaves(args))
    operand_values = dict(zip(operands, flat[len(kept):]))
    computed = iter(flat[:len(kept)])
    gradients = [_Product(_equations_to(var, producers), [operand_values[o] for o in pair]) if later
                 else next(computed) for var, pair, later in zip(outvars[:count], products, deferred)]
    rest = list(computed)
    outputs = jax.tree.unflatten(jax.tree.structure(shape), [None] * count + rest)
    unbounded = [g for g, pair in zip(gradients, products) if not pair]
    surely_finite = sums_finite(unbounded)
    if operands:
        # Each operand's sum of absolute values: at least its largest value,
        # NaN or Inf where one is.
        magnitudes = {var: abs_sum(operand_values[var]) for var in operands}
        within = []
        for pair in products:
            if pair:
                a, b = (magnitudes[var] for var in pair)
                dtype = pair[0].aval.dtype
                limit = np.asarray(np.finfo(dtype).max / _MARGIN, dtype)
                # NaN compares False: a NaN or Inf operand fails the bound.
                # Each sum is bounded too: an operand rounded to bfloat16 on
                # its way into the product must stay clear of the top of
                # its range.
                within.append((a <= limit) & (b <= limit) & (a * b <= limit))
        surely_finite = jnp.logical_and(surely_finite, jnp.all(jnp.stack(within)))
    # The gradients in the branch's own structure: a None (a variable
    # without a gradient) back in its place.
    gradients = jax.tree.unflatten(jax.tree.structure(shape[0]), gradients)
    return (CheckedGradients(gradients, surely_finite), *outputs[1:])


def _uses(jaxpr):
    """How many times each variable is read: by an equation or as an output."""
    uses = {}
    for var in [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars):
        if not jax_compat.is_jaxpr_literal(var):
            uses[var] = uses.get(var, 0) + 1
    return uses


def _read_once(var, producers, uses):
    """Whether the product's values, on their way to the gradient `var`,
    are read only there: the gradient taken once, no value of its chain
    read elsewhere (a logged norm). Else computing it again where the
    update uses it would compute it twice."""
    chain = _equations_to(var, producers)
    return all(uses.get(eqn.outvars[0], 0) == 1 for eqn in chain)


def _equations_to(var, producers):
    """The equations from a product (`dot_general`) to `var`, in order."""
    equations = []
    while producers[var].primitive.name in _SAME_VALUES:
        equations.append(producers[var])
        var = producers[var].invars[0]
    equations.append(producers[var])
    return equations[::-1]


def _product_operands(var, producers):
    """The two operands of the matrix product whose values `var` holds
    (through transposes and reshapes), where the bound applies and costs
    less than the plain check: one float dtype of at least 32 bits
    throughout, operands smaller together than the gradient (a batch's
    activations against a kernel; not a long sequence's), each of at most
    2**24 values (the rounding of their sums then stays inside
    `_MARGIN`). Else None."""
    if _is_literal(var):
        return None
    dtype, size = var.aval.dtype, _size(var)
    while var in producers and producers[var].primitive.name in _SAME_VALUES:
        var = producers[var].invars[0]
        if _is_literal(var):
            return None
    eqn = producers.get(var)
    if eqn is None or eqn.primitive.name != "dot_general" or len(eqn.invars) != 2:
        return None
    if not (jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 32):
        return None
    preferred = eqn.params.get("preferred_element_type")
    if preferred is not None and preferred != dtype:
        return None
    if not _full_range(eqn.params.get("precision")):
        return None
    operands = tuple(eqn.invars)
    if any(_is_literal(operand) or operand.aval.dtype != dtype for operand in operands):
        return None
    sizes = [_size(operand) for operand in operands]
    if sum(sizes) >= size or max(sizes) > _MOST_VALUES:
        return None
    return operands


def _full_range(precision):
    """Whether a product of this `precision` keeps its operands' exponent
    range: `lax.Precision` levels round float32 to bfloat16 or TF32 at the
    least, whose range is float32's; a `DotAlgorithm` may take float16 or
    float8 (Inf past 65504 or 448), so it is read directly."""
    if precision is None:
        return True
    levels = precision if isinstance(precision, (tuple, list)) else (precision,)
    return all(level is None or isinstance(level, jax.lax.Precision) for level in levels)


def _is_literal(var):
    return jax_compat.is_jaxpr_literal(var)


def _size(var):
    return int(np.prod(var.aval.shape, dtype=np.int64))
