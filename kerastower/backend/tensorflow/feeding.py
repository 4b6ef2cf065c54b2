"""Where a TensorFlow step takes its towers' batches: one step's worth, from a placed input.

The input layer (kerastower/inputs/) decides which batch each tower takes
and the strategy places the pipelines on the towers
(`TowerStrategy.place_input`). Inside the step function, `next_step` takes
the next step's batches from that placed input: every tower its own, and a
tower whose data ran out while another's did not an empty batch, so a
pass's short last step still runs. Whether any tower has data left is
agreed by the strategy's one reduction for it (`any_process_has`), so every
process runs the step or none does; an endless input needs no agreement.
"""

from kerastower._tf import tf

__all__ = ["next_step"]


def next_step(strategy, iterator, endless=False):
    """(whether any tower has a batch left, a function giving this step's
    per-tower batches), inside a step function.

    Args:
        strategy: the `kt.TowerStrategy` that placed the input.
        iterator: the iterator of the placed input (`iter` of what
            `place_input` returned).
        endless: every tower's input is endless, on every process: the step
            takes its batches without asking whether any is left.
    """
    if endless:
        return tf.constant(True), iterator.get_next
    optional = iterator.get_next_as_optional()
    mine = optional.has_value()
    anyone = strategy.any_process_has(mine)
    if anyone is mine:
        return mine, optional.get_value
    # A process out of data must still join the step while another has
    # some, or the other's collectives would wait for it forever.
    spec = iterator.element_spec

    def empty_batch():
        return tf.nest.map_structure(
            lambda s: tf.zeros([0 if d is None else d for d in [0] + s.shape.as_list()[1:]], s.dtype),
            spec,
        )

    return anyone, lambda: tf.cond(mine, optional.get_value, empty_batch)
