"""What a training run carries: its optimizers and every variable to keep.

Checkpoints save these, and Horovod and multi-worker training broadcast them
from the chief when training starts.
"""

import keras

__all__ = ["training_optimizers", "training_state"]


def training_optimizers(model):
    """The optimizers that train `model`: its compiled `optimizer`, then every
    other Keras optimizer it holds as an attribute (a GAN's `d_optimizer` and
    `g_optimizer`) or in a list, tuple or dict attribute (a CycleGAN's four
    in a list), in attribute-name order, a container's in its own order,
    each once.

    Examples:
        >>> from kerastower.checkpoint.training_state import training_optimizers
        >>> model = kt.TowerModel(keras.Input((2,)), keras.Input((2,)))
        >>> model.gan_optimizers = [keras.optimizers.Adam(name="g"), keras.optimizers.SGD(name="d")]
        >>> [optimizer.name for optimizer in training_optimizers(model)]
        ['g', 'd']
    """
    found = [getattr(model, "optimizer", None)]
    for name in sorted(vars(model)):
        found += _optimizers_in(vars(model)[name])
    optimizers = []
    for candidate in found:
        if isinstance(candidate, keras.optimizers.Optimizer) and all(
            candidate is not known for known in optimizers
        ):
            optimizers.append(candidate)
    return optimizers


def _optimizers_in(value, depth=0):
    """`value` if it is an optimizer, else the optimizers in it where it is a
    list, tuple or dict (Keras's tracked ones too), two levels deep at most."""
    if isinstance(value, keras.optimizers.Optimizer):
        return [value]
    if depth >= 2:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [found for item in value for found in _optimizers_in(item, depth + 1)]
    return []


def training_state(model):
    """Every variable a training run carries: the model's (random-number
    states included) and its optimizers' (slots, step counters)."""
    variables = list(model.variables)
    for optimizer in training_optimizers(model):
        variables += list(optimizer.variables)
    return variables
