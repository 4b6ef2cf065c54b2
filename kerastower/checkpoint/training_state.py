"""What a training run carries: its optimizers and every variable to keep.

Checkpoints save these, and Horovod and multi-worker training broadcast them
from the chief when training starts.
"""

import keras

__all__ = ["training_optimizers", "training_state"]


def training_optimizers(model):
    """The optimizers that train `model`: its compiled `optimizer`, then every
    other Keras optimizer it holds as an attribute (a GAN's `d_optimizer` and
    `g_optimizer`), in attribute-name order, each once."""
    found = [getattr(model, "optimizer", None)]
    found += [vars(model)[name] for name in sorted(vars(model))]
    optimizers = []
    for candidate in found:
        if isinstance(candidate, keras.optimizers.Optimizer) and all(
            candidate is not known for known in optimizers
        ):
            optimizers.append(candidate)
    return optimizers


def training_state(model):
    """Every variable a training run carries: the model's (random-number
    states included) and its optimizers' (slots, step counters)."""
    variables = list(model.variables)
    for optimizer in training_optimizers(model):
        variables += list(optimizer.variables)
    return variables
