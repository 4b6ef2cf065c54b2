"""Checking and preparing the arguments of fit, evaluate, predict and compile.

Integers may be Python or numpy integers (`np.int64(3)`, e.g. from a config
array); they are turned into Python ints, so that nothing downstream (a
checkpoint's JSON, `range`, Keras) sees a numpy scalar. A bool, a float or
a str where an int is needed raises `kt.errors.ArgumentError` naming the
argument and the value. Any module may use `integer` for its own arguments.
"""

import numbers

import keras
import numpy as np

from kerastower import _compat
from kerastower.errors import ArgumentError
from kerastower.errors import InputSourceError

__all__ = [
    "integer",
    "verbosity",
    "fit_integers",
    "inference_integers",
    "fit_data",
    "inference_callbacks",
    "compile_kwargs",
    "boolean",
]


def integer(value, name, owner, minimum=None, none_ok=False):
    """`value` as a Python int, or an ArgumentError.

    Args:
        value: what the user passed.
        name: the argument's name, for the message.
        owner: what takes it (e.g. "fit", "PeriodicTrigger"), for the message.
        minimum: the smallest value allowed, or None.
        none_ok: whether None is allowed (and returned as None).
    """
    if value is None and none_ok:
        return None
    wanted = "an int" if minimum is None else (
        "a positive int" if minimum == 1 else f"an int >= {minimum}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentError(
            f"{owner}: {name} must be {wanted}; got {value!r} ({type(value).__name__}). "
            "Pass a whole number (a Python or numpy integer; a bool does not count)."
        )
    if minimum is not None and value < minimum:
        raise ArgumentError(f"{owner}: {name} must be {wanted}; got {value!r}.")
    return int(value)


def boolean(value, name, owner):
    """`value` as a Python bool (numpy bools too), or an ArgumentError."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(
            f"{owner}: {name} must be True or False; got {value!r} ({type(value).__name__})."
        )
    return bool(value)


def verbosity(value, owner):
    """`verbose`: "auto" or an int 0, 1, 2 (numpy ints too)."""
    if isinstance(value, str):
        if value == "auto":
            return value
        raise ArgumentError(f'{owner}: verbose must be "auto", 0, 1 or 2; got {value!r}.')
    return integer(value, "verbose", owner, minimum=0)


def fit_integers(batch_size, epochs, verbose, initial_epoch, steps_per_epoch,
                 validation_steps, validation_batch_size, validation_freq):
    """fit's integer arguments as Python ints, in the order given (see the
    module docstring)."""
    freq = validation_freq
    if isinstance(freq, (list, tuple, set, range)):
        freq = [integer(e, "an epoch in validation_freq", "fit", minimum=1) for e in freq]
    else:
        freq = integer(freq, "validation_freq", "fit", minimum=1)
    return (
        integer(batch_size, "batch_size", "fit", minimum=1, none_ok=True),
        integer(epochs, "epochs", "fit", minimum=0),
        verbosity(verbose, "fit"),
        integer(initial_epoch, "initial_epoch", "fit", minimum=0),
        integer(steps_per_epoch, "steps_per_epoch", "fit", minimum=1, none_ok=True),
        integer(validation_steps, "validation_steps", "fit", minimum=1, none_ok=True),
        integer(validation_batch_size, "validation_batch_size", "fit", minimum=1, none_ok=True),
        freq,
    )


def compile_kwargs(kwargs):
    """compile's keyword arguments with `steps_per_execution` checked."""
    if "steps_per_execution" in kwargs:
        kwargs = dict(kwargs, steps_per_execution=integer(
            kwargs["steps_per_execution"], "steps_per_execution", "compile", minimum=1))
    return kwargs


def inference_integers(owner, batch_size, steps, verbose):
    """evaluate's or predict's (batch_size, steps, verbose), checked."""
    return (
        integer(batch_size, "batch_size", owner, minimum=1, none_ok=True),
        integer(steps, "steps", owner, minimum=1, none_ok=True),
        verbosity(verbose, owner),
    )


def fit_data(x, y, sample_weight, class_weight, validation_split, validation_data):
    """(x, y, sample_weight, validation_data) after Keras's validation_split
    and class_weight, which kerastower applies before batching."""
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = _compat.train_validation_split(
            (x, y, sample_weight), validation_split=validation_split
        )
    if class_weight is not None:
        if sample_weight is not None:
            raise InputSourceError(
                "class_weight and sample_weight cannot both be given (as in "
                "Keras): fold the class weights into sample_weight."
            )
        if not isinstance(y, np.ndarray):
            raise InputSourceError(
                "class_weight works with numpy arrays; for a dataset, add "
                "per-example weights as its third element instead."
            )
        sample_weight = _compat.class_weight_to_sample_weights(y, class_weight)
    return x, y, sample_weight, validation_data


def inference_callbacks(model, callbacks, verbose, steps, source):
    """evaluate's or predict's `callbacks` as a CallbackList (with Keras's
    progress bar unless verbose=0); a CallbackList is used as it is."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(
        callbacks,
        add_progbar=verbose != 0,
        verbose=verbose,
        epochs=1,
        steps=steps or source.steps(model.num_towers),
        model=model,
    )
