"""Where each automatically named layer sits in the model: what a swap of its name would hide.

A checkpoint restores variables by key (kerastower/checkpoint/keys.py), and
a key is made of layer names. Keras names layers in the order the code
creates them (`dense`, `dense_1`, ...), so two layers of one class created
in the other order after a code change trade names, and each would take the
other's weights, silently when their shapes agree. A checkpoint therefore
also records, for each variable of a layer whose name Keras generated, the
layer's place in the model:

    the attribute that holds it    "encoder", "blocks[1]" (subclassed models)
    else its rank among the        "Dense#0": the first Dense in the model's
    layers of its class            graph order (Functional, Sequential)

and a restore whose key now lands in a layer at another place goes by
place instead, with a warning, when every saved place has one counterpart
here (the names traded one for one), and otherwise refuses, naming both
places (kerastower/checkpoint/store.py). Layers the user named are
trusted by name. A place is stable under changes that keep the structure:
adding a layer without weights (Dropout) moves no Dense's rank.

Examples:
    >>> from kerastower.checkpoint.places import variable_places
    >>> first, second = keras.layers.Dense(2), keras.layers.Dense(2)
    >>> inputs = keras.Input((2,))
    >>> model = keras.Model(inputs, first(second(inputs)))   # second is applied first
    >>> sorted(set(variable_places(model).values()))
    ['Dense#0', 'Dense#1']
    >>> variable_places(model)[id(second.kernel)]
    'Dense#0'
"""

import re

from kerastower import _compat

__all__ = ["variable_places"]

_NUMBERED = re.compile(r"^(.*?)(?:_\d+)?$")


def _snake_case(name):
    """A class name as Keras derives automatic layer names from it (Conv2D -> conv2d)."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


def _auto_named(layer):
    return _NUMBERED.match(layer.name).group(1) == _snake_case(type(layer).__name__)


def _attribute_places(model):
    """id(layer) -> the public attribute of `model` holding it ("encoder", "blocks[1]")."""
    places = {}
    for name, value in vars(model).items():
        if name.startswith("_"):
            continue
        items = (enumerate(value) if isinstance(value, (list, tuple))
                 else value.items() if isinstance(value, dict) else None)
        if items is None:
            places.setdefault(id(value), name)
            continue
        for index, item in items:
            places.setdefault(id(item), f"{name}[{index!r}]")
    return places


def variable_places(model):
    """id(variable) -> the place of its layer, for the variables of every
    layer of `model` whose name Keras generated (see the module docstring)."""
    layers = [layer for layer in _compat.flatten_layers(model) if layer is not model]
    owners = {}
    for layer in layers:  # parents come before their sublayers: the innermost owner wins
        for variable in layer.weights:
            owners[id(variable)] = layer
    attributes = _attribute_places(model)
    ranks, seen = {}, {}
    for layer in layers:
        kind = type(layer).__name__
        ranks[id(layer)] = f"{kind}#{seen.get(kind, 0)}"
        seen[kind] = seen.get(kind, 0) + 1
    return {
        key: attributes.get(id(layer), ranks[id(layer)])
        for key, layer in owners.items() if _auto_named(layer)
    }
