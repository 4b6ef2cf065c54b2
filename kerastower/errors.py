"""The errors kerastower raises, so that users can catch them by type."""

__all__ = [
    "KerasTowerError",
    "TowerRuleError",
    "InputSourceError",
    "StrategyError",
    "PeerFailureError",
]


class KerasTowerError(Exception):
    """Base class of every error kerastower raises on purpose."""


class TowerRuleError(KerasTowerError):
    """A tower function broke one of the tower rules (see docs/towers.md)."""


class InputSourceError(KerasTowerError, ValueError):
    """An input given to fit/evaluate/predict cannot feed the towers."""


class StrategyError(KerasTowerError, ValueError):
    """A strategy name, device list or strategy combination is not usable."""


class PeerFailureError(KerasTowerError):
    """Another worker of a multi-process training stopped responding."""
