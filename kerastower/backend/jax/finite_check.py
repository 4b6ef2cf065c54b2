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
program with the products' operands as extra outputs.
"""

import jax
import jax.numpy as jnp
import numpy as np

from kerastower._compat import on_jax as jax_compat
from kerastower.backend.jax.towers import abs_sum
from kerastower.backend.jax.towers import all_finite

__all__ = ["checked_gradients"]

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


def checked_gradients(branch, *args):
    """(`branch(*args)`, whether the gradients it returns are all finite).

    `branch` returns a tuple whose first item is the list of gradients.
    The plain check (`towers.all_finite`) reads the gradients no bound
    covers, and all of them where a bound is not met.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):
    ...     return [jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)], x
    >>> outputs, finite = jax.jit(lambda w, x: checked_gradients(step, w, x))(
    ...     jnp.ones((3, 4)), jnp.ones((2, 3)))
    >>> bool(finite)
    True
    """
    closed, shape = jax.make_jaxpr(branch, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    count = len(jax.tree.leaves(shape[0]))
    outvars = list(jaxpr.outvars)
    producers = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}
    products = [_product_operands(var, producers) for var in outvars[:count]]
    operands = list(dict.fromkeys(var for pair in products if pair for var in pair))
    run = jax_compat.jaxpr_as_fun(jax_compat.jaxpr_with_outputs(closed, outvars + operands))
    flat = run(*jax.tree.leaves(args))
    outputs = jax.tree.unflatten(jax.tree.structure(shape), flat[:len(outvars)])
    gradients = flat[:count]
    if not operands:
        return outputs, all_finite(gradients)
    # Each operand's sum of absolute values: at least its largest value,
    # NaN or Inf where one is.
    magnitudes = {var: abs_sum(value) for var, value in zip(operands, flat[len(outvars):])}
    within = []
    for pair, gradient in zip(products, gradients):
        if pair:
            a, b = (magnitudes[var] for var in pair)
            limit = np.asarray(np.finfo(gradient.dtype).max / _MARGIN, gradient.dtype)
            # NaN compares False: a NaN or Inf operand fails the bound. Each
            # sum is bounded too: an operand rounded to bfloat16 on its way
            # into the product must stay clear of the top of its range.
            within.append((a <= limit) & (b <= limit) & (a * b <= limit))
    unbounded = [g for pair, g in zip(products, gradients) if not pair]
    bounded = jnp.all(jnp.stack(within))

    def the_rest():
        return all_finite(unbounded) if unbounded else jnp.asarray(True)

    def every_gradient():
        return all_finite(gradients)

    return outputs, jax.lax.cond(bounded, the_rest, every_gradient)


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
