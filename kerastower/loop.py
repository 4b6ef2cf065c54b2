"""Where training is: tensorpack's loop counters, kept by `TowerModel.fit`
and by `kt.Trainer`.

Training runs

    for epoch_num in range(starting_epoch, max_epoch + 1):
        for local_step in range(steps_per_epoch):
            step()

and an epoch is only the period at which callbacks run. `epoch_num` is
1-based, as in tensorpack; Keras callbacks receive the 0-based index
`epoch_num - 1` as their `epoch` argument.
"""

__all__ = ["LoopState"]


class LoopState:
    """The counters of the training loop, readable from any callback.

    Attributes:
        starting_epoch: the first epoch_num of this `fit` call (1-based).
        max_epoch: the last epoch_num (Keras's `epochs`).
        steps_per_epoch: steps in an epoch, or None when an epoch is one pass
            over data of unknown length.
        epoch_num: the current (or last) epoch, 1-based; 0 before training.
        local_step: steps done in the current epoch.
        global_step: steps done, continuous across epochs, calls and resumed
            runs: under `fit`, the optimizer's iteration count; under
            `kt.Trainer`, the iterations (`run_step()` calls) done.
        tower_batches: batches each tower has taken from the input in this
            run (since the current pass began, when an epoch is one pass):
            the input position a checkpoint records.
        examples_seen: examples trained on by all towers, in this process.

    Example:

    ```python
    class PrintWhere(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            loop = self.model.loop
            print(loop.epoch_num, loop.local_step, loop.global_step)
    ```
    """

    def __init__(self, model, counts_iterations=False):
        self._model = model
        # kt.Trainer's run_step may use several optimizers or none: it
        # counts its iterations itself.
        self.iterations = 0 if counts_iterations else None
        self.starting_epoch = 1
        self.max_epoch = 0
        self.steps_per_epoch = None
        self.epoch_num = 0
        self.local_step = 0
        self.tower_batches = []
        self.examples_seen = 0

    @property
    def global_step(self):
        if self.iterations is not None:
            return self.iterations
        optimizer = getattr(self._model, "optimizer", None)
        if optimizer is None:
            return 0
        return int(optimizer.iterations.numpy())

    def __repr__(self):
        return (
            f"LoopState(epoch_num={self.epoch_num}, local_step={self.local_step}, "
            f"global_step={self.global_step}, steps_per_epoch={self.steps_per_epoch}, "
            f"starting_epoch={self.starting_epoch}, max_epoch={self.max_epoch})"
        )
