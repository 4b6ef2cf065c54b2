"""The errors and warnings kerastower raises, so that users can catch them by type."""

__all__ = [
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
    """Base class of every error kerastower raises on purpose."""


class TowerRuleError(KerasTowerError):
    """A tower function broke one of the tower rules (see docs/towers.md)."""


class InputSourceError(KerasTowerError, ValueError):
    """An input given to fit/evaluate/predict cannot feed the towers."""


class DataMismatchError(InputSourceError):
    """A tower's batch does not fit the model: x against its inputs, or y
    against its outputs and loss (shape or dtype). `__cause__` is Keras's
    own error, where Keras raised one."""


class StrategyError(KerasTowerError, ValueError):
    """A strategy name, device list or strategy combination is not usable."""


class ArgumentError(KerasTowerError, TypeError, ValueError):
    """An argument of kerastower's API has the wrong type or value (e.g. a
    float or a str where an int is needed); both `except TypeError` and
    `except ValueError` catch it."""


class PeerFailureError(KerasTowerError):
    """Another worker of a multi-process training stopped responding."""


class NonFiniteError(KerasTowerError, FloatingPointError):
    """A training step's gradients held NaN or Inf (see docs/training.md).

    Attributes:
        global_step: the 1-based number of the step that failed (its update
            was not applied; the weights are those after the step before).
        towers: the indices of this process's towers whose gradients were
            not finite (empty when only another process's were).
    """

    def __init__(self, message, global_step, towers):
        super().__init__(message)
        self.global_step = global_step
        self.towers = towers


class StepFailedError(KerasTowerError):
    """A training, evaluation or prediction step failed inside TensorFlow.

    `__cause__` is the user's own exception when a GeneratorInput's
    generator raised, else TensorFlow's error.
    """


class MonitorWriteWarning(UserWarning):
    """A monitor (TensorBoard, JSONWriter) could not write its log folder;
    training and checkpoints go on without those logs."""
