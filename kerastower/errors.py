"""The errors and warnings kerastower raises, so that users can catch them by type."""

__all__ = [
    "nonfinite_error",
    "KerasTowerError",
    "TowerRuleError",
    "InputSourceError",
    "DataMismatchError",
    "StrategyError",
    "ArgumentError",
    "PeerFailureError",
    "NonFiniteError",
    "StepFailedError",
    "MonitorWriteWarning",
]


class KerasTowerError(Exception):
    """Base class of every error kerastower raises on purpose.

    Examples:
        >>> try:
        ...     kt.distributed("no-such-strategy")
        ... except kt.KerasTowerError as error:
        ...     print(type(error).__name__)
        StrategyError
    """


class TowerRuleError(KerasTowerError):
    """A tower function broke one of the tower rules (see docs/towers.md),
    e.g. created a variable inside a tower.

    Examples:
        >>> issubclass(kt.TowerRuleError, kt.KerasTowerError)
        True
    """


class InputSourceError(KerasTowerError, ValueError):
    """An input given to fit/evaluate/predict cannot feed the towers.

    Examples:
        >>> try:
        ...     kt.GeneratorInput(iter([]), None)     # a generator, not a function
        ... except kt.InputSourceError as error:
        ...     print(str(error)[:49])
        GeneratorInput needs a function that returns a ne
    """


class DataMismatchError(InputSourceError):
    """A tower's batch does not fit the model: x against its inputs, or y
    against its outputs and loss (shape or dtype). `__cause__` is Keras's
    own error, where Keras raised one.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> try:
        ...     model.fit(np.zeros((4, 5)), np.zeros((4, 1)), verbose=0)
        ... except kt.DataMismatchError:
        ...     print("x does not fit the model's input")
        x does not fit the model's input
    """


class StrategyError(KerasTowerError, ValueError):
    """A strategy name, device list or strategy combination is not usable.

    Examples:
        >>> try:
        ...     with kt.distributed("mirrored", devices=["/cpu:99"]):
        ...         pass
        ... except kt.StrategyError as error:
        ...     print("'/cpu:99' does not exist" in str(error))
        True
    """


class ArgumentError(KerasTowerError, TypeError, ValueError):
    """An argument of kerastower's API has the wrong type or value (e.g. a
    float or a str where an int is needed); both `except TypeError` and
    `except ValueError` catch it.

    Examples:
        >>> try:
        ...     kt.use_cpu_towers("two")
        ... except ValueError as error:
        ...     print(type(error).__name__)
        ArgumentError
    """

    # Exception's own constructor, not TypeError's: TensorFlow's AutoGraph
    # re-raises an error from a traced step (`kt.loss_divisor` in a loss)
    # as its own type only where `__init__` is Exception's; else it becomes
    # a StagingError.
    __init__ = Exception.__init__


class PeerFailureError(KerasTowerError):
    """Another worker of a multi-process training stopped responding
    (docs/reliability.md); restart every worker, and AutoResume goes on
    from the last checkpoint.

    Examples:
        >>> issubclass(kt.PeerFailureError, kt.KerasTowerError)
        True
    """


class NonFiniteError(KerasTowerError, FloatingPointError):
    """A training step's gradients held NaN or Inf (see docs/training.md).

    Attributes:
        global_step: the 1-based number of the step that failed (its update
            was not applied; the weights are those after the step before).
        towers: the indices of this process's towers whose gradients were
            not finite (empty when only another process's were).

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x = np.ones((8, 3), "float32")
        >>> x[5] = np.nan                        # in the second batch of 4
        >>> try:
        ...     model.fit(x, np.ones((8, 1)), batch_size=4, shuffle=False, verbose=0)
        ... except kt.NonFiniteError as error:
        ...     print(error.global_step, model.loop.global_step)
        2 1
    """

    def __init__(self, message, global_step, towers):
        super().__init__(message)
        self.global_step = global_step
        self.towers = towers


class StepFailedError(KerasTowerError):
    """A training, evaluation or prediction step failed inside TensorFlow.

    `__cause__` is the user's own exception when a GeneratorInput's
    generator raised, else TensorFlow's error.

    Examples:
        >>> import tensorflow as tf
        >>> def batches():
        ...     yield np.zeros((2, 3), "float32"), np.zeros((2, 1), "float32")
        ...     raise OSError("record 2 is unreadable")
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> source = kt.GeneratorInput(batches, (tf.TensorSpec((None, 3)), tf.TensorSpec((None, 1))))
        >>> try:
        ...     model.fit(source, epochs=1, verbose=0)
        ... except kt.StepFailedError as error:
        ...     print(repr(error.__cause__))
        OSError('record 2 is unreadable')
    """


class MonitorWriteWarning(UserWarning):
    """A monitor (TensorBoard, JSONWriter) could not write its log folder;
    training and checkpoints go on without those logs.

    Examples:
        >>> import warnings
        >>> warnings.simplefilter("error", kt.MonitorWriteWarning)  # or make it fatal
    """


def nonfinite_error(global_step, bad_towers, num_towers):
    """The NonFiniteError of the step `global_step` (1-based), whose
    non-finite gradients came from this process's `bad_towers`."""
    if bad_towers:
        plural = "s" if len(bad_towers) > 1 else ""
        where = f"on tower{plural} {', '.join(map(str, bad_towers))} of {num_towers}"
    else:
        where = "on a tower of another process"
    return NonFiniteError(
        f"Training step {global_step} produced NaN or Inf gradients {where}; its "
        "update was skipped and training stopped (the weights are those after step "
        f"{global_step - 1}). Look for a non-finite loss (log of 0, division by "
        "zero, a too-high learning rate) or bad input values in that step's "
        "batch. For mixed precision, keras.optimizers.LossScaleOptimizer skips "
        "such steps instead of stopping.",
        global_step,
        list(bad_towers),
    )
