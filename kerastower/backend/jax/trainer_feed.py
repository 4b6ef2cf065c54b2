"""kt.Trainer's feed on JAX: what `next_batches()` takes from.

A Python generator, iterator or iterable of batches, or a
`keras.utils.PyDataset`, dealt out as fit deals them (inputs/chooser.py):
tower k of step s takes the source's batch s*N+k.
"""

import contextlib

import keras

from kerastower.errors import InputSourceError

__all__ = ["JaxFeed"]


class JaxFeed:
    """A generator, iterator, iterable or PyDataset of per-tower batches."""

    def __init__(self, input, owner):
        from kerastower.backend.jax.inputs import place
        from kerastower.inputs.chooser import choose
        from kerastower.inputs.chooser import kind_of

        if kind_of(input) not in ("batches", "dataset"):
            raise InputSourceError(
                f"{owner}: on JAX the input is a Python generator (or iterable) of "
                "batches or a keras.utils.PyDataset, each batch one tower's; got "
                f"{type(input).__name__}. For numpy arrays, yield their batches: "
                "(x[i:i + n] for i in itertools.cycle(range(0, len(x) - n + 1, n))).")
        self.source = place(choose(input))
        self.source.repeated = True   # an epoch is only a period: pass after pass
        self.iterator = None

    def reading(self):
        """The context a `train()` reads the input in: nothing runs in the
        background here."""
        return contextlib.nullcontext()

    def open(self, engine, skip_batches):
        """Opens the input on `engine`'s towers, less the `skip_batches` each
        tower took before."""
        self.iterator = iter(engine.place(self.source, skip_batches=skip_batches))

    def next(self, strategy):
        """(one step's batches, a `TowerBatches`; examples by tower), or None
        at the input's end. Batches that differ only in their number of
        examples are joined, and the step runs as one tower on them."""
        from kerastower.backend.jax.tower_function import TowerBatches

        batches = next(self.iterator, None)
        if batches is None:
            return None
        return TowerBatches(batches), [len(keras.tree.flatten(b)[0]) for b in batches]
