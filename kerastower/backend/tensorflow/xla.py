"""XLA in towers: what `compile(jit_compile=...)` compiles, per tower.

Keras turns XLA off under `tf.distribute`, because its step all-reduces
inside the compiled function. kerastower keeps the cross-tower work (the
gradient all-reduce, the finite check, the optimizer's update under
MirroredStrategy) outside XLA and compiles what each tower computes alone:

- one tower under "single": the whole tower step, optimizer update included;
- N towers (or one under "mirrored", whose update is a cross-replica
  call): `train_step`'s forward and backward (loss, metrics, gradients),
  the whole `test_step` and `predict_step`.

`jit_compile="auto"` (Keras's default) compiles when the machine has an
accelerator and every layer supports XLA, as Keras decides on one device.
"""

import warnings

import tensorflow as tf

from kerastower import _compat
from kerastower import loss_divisors
from kerastower.errors import ArgumentError

__all__ = ["resolve", "compiled"]


def _has_accelerator():
    return any(d.device_type != "CPU" for d in tf.config.list_physical_devices())


def _layers_support_xla(model):
    return all(getattr(layer, "supports_jit", True) for layer in _compat.flatten_layers(model))


def resolve(model, jit_compile):
    """`jit_compile` (True, False or "auto") as the bool the steps use."""
    if jit_compile not in (True, False, "auto"):
        raise ArgumentError(
            f'jit_compile must be True, False or "auto"; got {jit_compile!r}.'
        )
    if jit_compile is False:
        return False
    if model.run_eagerly:
        if jit_compile is True:
            warnings.warn(
                "kerastower: run_eagerly=True runs the steps eagerly, so "
                "jit_compile=True is not applied.", stacklevel=3)
        return False
    if jit_compile == "auto":
        return _has_accelerator() and _layers_support_xla(model) and not _compat.op_determinism()
    if not _layers_support_xla(model):
        unsupported = [layer.name for layer in _compat.flatten_layers(model)
                       if not getattr(layer, "supports_jit", True)]
        warnings.warn(
            f"kerastower: jit_compile=True is not applied: the layers {unsupported} do "
            "not support XLA (Keras says so with `layer.supports_jit = False`).",
            stacklevel=3)
        return False
    return True


def compiled(model, fn):
    """`fn` compiled with XLA when the model's steps use it, else `fn`.

    A forward pass that all-reduces (a masked loss's divisor on several
    towers, `loss_divisors.py`) cannot inside XLA here: found while it is
    traced, it runs uncompiled, and the model's steps say so once."""
    if not getattr(model, "tower_jit_compile", False) or model.run_eagerly:
        return fn

    def without_collectives(*args, **kwargs):
        with loss_divisors.without_collectives():
            return fn(*args, **kwargs)

    xla_fn = tf.function(without_collectives, jit_compile=True, reduce_retracing=True)
    cache = model.engine.cache

    @tf.autograph.experimental.do_not_convert
    def call(*args, **kwargs):
        if cache.forward_collectives:
            return fn(*args, **kwargs)
        try:
            return xla_fn(*args, **kwargs)
        except loss_divisors.ForwardCollectiveNeeded:
            cache.forward_collectives = True
            warnings.warn(
                f"kerastower: jit_compile does not compile {type(model).__name__}'s tower "
                "steps: a masked loss divides by the joined batch's token count, an "
                "all-reduce before the backward pass, which cannot run inside XLA here "
                "(docs/losses.md).", stacklevel=2)
            return fn(*args, **kwargs)
    return call


def compiled_in(model):
    """A decorator: `compiled(model, fn)`."""
    return lambda fn: compiled(model, fn)


def whole_step(model, mode):
    """Whether the whole tower step of `mode` is compiled: it launches no
    collective (evaluation, prediction, or training under "single"). Under
    tf.distribute's mirrored strategies the optimizer's update is a
    cross-replica call even on one device, which XLA cannot hold."""
    strategy = model.tower_strategy
    return mode != "train" or (strategy.num_towers == 1 and strategy.name == "single")


_warned = set()


def warn_if_not_compiled(model, overridden_train_step):
    """Says once per class that jit_compile does not reach an overridden
    train_step on several towers (its optimizer.apply all-reduces)."""
    key = type(model)
    if (not getattr(model, "tower_jit_compile", False) or not overridden_train_step
            or whole_step(model, "train") or key in _warned):
        return
    _warned.add(key)
    warnings.warn(
        f"kerastower: jit_compile does not compile {type(model).__name__}.train_step on "
        f"{model.num_towers} towers: its optimizer.apply all-reduces across towers, "
        "which cannot run inside XLA here. Compile your forward and backward pass "
        "yourself, e.g. `grads = tf.function(forward_backward, jit_compile=True)()` "
        "before optimizer.apply. test_step and predict_step are compiled.",
        stacklevel=4)
