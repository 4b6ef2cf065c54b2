"""What a callback carries across a resume: its state, saved with the checkpoint.

A stateful callback decides from what it saw in earlier epochs:
EarlyStopping's best value, wait count and best weights, ReduceLROnPlateau's
wait and cooldown, ModelCheckpoint's best. A run resumed from a checkpoint
(`kt.callbacks.AutoResume`) decides as the uninterrupted run only if those
come back too. So every checkpoint the loop writes (ModelSaver's, a
preemption's) holds the state of each callback of the run that has one, and
AutoResume gives it back after `on_train_begin` (which resets Keras's
callbacks), before the first resumed step.

The protocol, which any callback may implement:

- `get_resume_state()` returns a dict of what it carries: numbers, strings,
  None, lists and dicts of them, and numpy arrays (kept beside the
  checkpoint's variables, bit-exact);
- `set_resume_state(state)` takes that dict back.

kerastower implements it for Keras's EarlyStopping, ReduceLROnPlateau and
ModelCheckpoint (their public counters: `_KERAS_STATE`) and for its own
stateful callbacks. LearningRateScheduler and TerminateOnNaN carry nothing
(the learning rate is an optimizer variable, saved with the others).
Callbacks are matched by class name and order among those of the class,
so the resumed run must be given the same callbacks.

Examples:
    >>> from kerastower.callbacks import carried_state
    >>> class CountEpochs(keras.callbacks.Callback):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.seen = 0
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         self.seen += 1
    ...     def get_resume_state(self):
    ...         return {"seen": self.seen, "marks": np.arange(3)}
    ...     def set_resume_state(self, state):
    ...         self.seen = state["seen"]
    >>> counter = CountEpochs()
    >>> counter.seen = 4
    >>> texts, arrays = carried_state.states_of([counter])
    >>> texts, sorted(arrays)
    ({'CountEpochs': {'seen': 4, 'marks': {'__array__': 'CountEpochs/marks'}}}, ['CountEpochs/marks'])
    >>> again = CountEpochs()
    >>> carried_state.restore_states([again], texts, arrays)
    >>> again.seen
    4
"""

import warnings

import keras
import numpy as np

from kerastower.callbacks.base import unwrapped

__all__ = ["states_of", "restore_states"]

# Keras's stateful callbacks: the public attributes that hold what they saw.
_KERAS_STATE = {
    keras.callbacks.EarlyStopping: ("wait", "stopped_epoch", "best", "best_weights", "best_epoch"),
    keras.callbacks.ReduceLROnPlateau: ("wait", "cooldown_counter", "best"),
    keras.callbacks.ModelCheckpoint: ("best",),
}
_ARRAY = "__array__"


def _keras_kind(callback):
    for kind in _KERAS_STATE:
        if isinstance(callback, kind) and not hasattr(callback, "get_resume_state"):
            return kind
    return None


def _state(callback):
    """The callback's state, or None for one that carries nothing."""
    if hasattr(callback, "get_resume_state"):
        return callback.get_resume_state()
    kind = _keras_kind(callback)
    if kind is None:
        return None
    return {name: getattr(callback, name, None) for name in _KERAS_STATE[kind]}


def _set_state(callback, state):
    if hasattr(callback, "set_resume_state"):
        callback.set_resume_state(state)
        return
    for name, value in state.items():
        setattr(callback, name, value)


def _keyed(callbacks):
    """(key, callback) for each callback of `callbacks` (a list or a
    CallbackList; wrappers unwrapped): its class name, numbered from the
    second of a class on."""
    held = getattr(callbacks, "callbacks", callbacks) or []
    seen = {}
    for callback in held:
        callback = unwrapped(callback)
        name = type(callback).__name__
        seen[name] = seen.get(name, 0) + 1
        yield (name if seen[name] == 1 else f"{name}#{seen[name]}"), callback


def _split(value, key, arrays):
    """`value` with its numpy arrays moved into `arrays` (placeholders left)."""
    if isinstance(value, np.ndarray) or (hasattr(value, "shape") and hasattr(value, "dtype")
                                         and not isinstance(value, np.generic)):
        arrays[key] = np.asarray(value)
        return {_ARRAY: key}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _split(v, f"{key}/{k}", arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, f"{key}/{i}", arrays) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot be saved with a checkpoint: {key} is a {type(value).__name__}; "
                    "give numbers, strings, None, lists, dicts and numpy arrays")


def _joined(value, arrays):
    if isinstance(value, dict):
        if set(value) == {_ARRAY}:
            return arrays[value[_ARRAY]]
        return {k: _joined(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_joined(v, arrays) for v in value]
    return value


def states_of(callbacks):
    """(the callbacks' states as JSON-able dicts by callback key, the numpy
    arrays they hold by name), for a checkpoint to hold."""
    texts, arrays = {}, {}
    for key, callback in _keyed(callbacks):
        state = _state(callback)
        if state is None:
            continue
        try:
            texts[key] = _split(dict(state), key, arrays)
        except TypeError as error:
            raise TypeError(f"{key}.get_resume_state(): {error}") from None
    return texts, arrays


def restore_states(callbacks, texts, arrays):
    """Gives each callback of `callbacks` the state `states_of` took from
    its counterpart; warns about a saved state no callback takes."""
    texts = dict(texts or {})
    for key, callback in _keyed(callbacks):
        if key in texts and (hasattr(callback, "set_resume_state")
                             or _keras_kind(callback) is not None):
            _set_state(callback, _joined(texts.pop(key), arrays or {}))
    if texts:
        warnings.warn(
            f"kerastower: the checkpoint holds the state of {sorted(texts)}, which this run "
            "does not have (callbacks are matched by class and order): their state is not "
            "restored. Give the resumed run the callbacks of the run that wrote it.",
            stacklevel=2)
