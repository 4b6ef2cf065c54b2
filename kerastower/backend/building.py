"""Whether a model needs a symbolic forward pass before its first step.

kerastower builds every variable before the first tower step (tower rule
2, docs/towers.md): each engine runs Keras's symbolic build on tower 0's
batch spec. A model whose parts are all built already needs no forward
pass to make its variables, and a model without `call()` (keras.io's VAE
and GANs, whose encoder, decoder, generator and discriminator were built on
`keras.Input`) cannot have one. Such a model is marked built here, as
stock Keras trains it without ever building it, and only what its compile
made (loss, metrics, optimizer) is built.
"""

import keras

from kerastower import _compat
from kerastower.errors import TowerRuleError

__all__ = ["has_call", "unbuilt_layers", "mark_built_by_parts"]


def has_call(model):
    """Whether `model` implements `call()` (a functional or Sequential
    model does; keras.io's VAE and GANs do not)."""
    return type(model).call not in (keras.Model.call, keras.layers.Layer.call)


def unbuilt_layers(model):
    """The layers under `model` (itself excluded) that are not built."""
    return [layer for layer in _compat.flatten_layers(model) if layer is not model and not layer.built]


def mark_built_by_parts(model):
    """Marks `model` built when it has no `call()` and its layers are all
    built (see the module docstring). A model with `call()` is left to
    Keras's symbolic build, which runs it on a symbolic batch.

    Raises:
        TowerRuleError: `model` has no `call()` and some of its layers are
            not built (nothing could build them before the towers run), or
            it was compiled with a loss or metrics, which need predictions.
    """
    if model.built or has_call(model):
        return
    unbuilt = unbuilt_layers(model)
    if unbuilt:
        names = ", ".join(f"{layer.name!r} ({type(layer).__name__})" for layer in unbuilt)
        raise TowerRuleError(
            f"{type(model).__name__} has no call(), so kerastower cannot build it on a "
            f"symbolic batch, and these layers of it are not built: {names}. Tower rule: "
            "every variable exists before the first step, which runs once per tower. "
            "Build them before fit: make each sub-model on keras.Input (as keras.io's "
            "encoders and generators are), call it once on a batch, or call "
            "layer.build(input_shape). See docs/towers.md, rule 2.")
    if _compat.compiled_loss_or_metrics_unbuilt(model):
        raise TowerRuleError(
            f"{type(model).__name__} has no call(), but was compiled with a loss or "
            "metrics, which need its predictions. Compute the loss in train_step (as "
            "keras.io's VAE and GANs do), or give the model a call().")
    model.built = True
