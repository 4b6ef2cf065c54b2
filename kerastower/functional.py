"""The TowerModel variants `kt.TowerModel(...)` makes: functional, wrapped, a task.

Keras makes `SomeModel(inputs, outputs)` functional by rewriting the bases
of SomeModel and of its parents, which would turn TowerModel, and every
later subclass, functional for good. TowerModel instead builds a functional
twin of the class, once.

A KerasHub task (`keras_hub.models.Task`) becomes a `TaskTowerModel`: it
calls the task and carries its preprocessor, which kerastower applies to
every tower's raw batch (kerastower/inputs/preprocessing.py).
"""

import sys
import warnings

import keras

from kerastower import _compat
from kerastower.model import TowerModel

__all__ = ["FunctionalTowerModel", "WrappedTowerModel", "TaskTowerModel", "wrap", "wrapped_by_new",
           "built_by_new", "is_keras_hub_task"]


@keras.saving.register_keras_serializable(package="kerastower")
class FunctionalTowerModel(TowerModel, _compat.functional_class()):
    """What `kt.TowerModel(inputs, outputs)` makes: a functional TowerModel
    (registered, so that a saved one loads without custom_objects)."""


_FUNCTIONAL_TWINS = {TowerModel: FunctionalTowerModel}


def functional_twin(cls):
    """`cls` with Functional mixed in, for `cls(inputs, outputs)`."""
    if cls not in _FUNCTIONAL_TWINS:
        _FUNCTIONAL_TWINS[cls] = type(cls.__name__, (cls, _compat.functional_class()), {"__module__": cls.__module__})
    return _FUNCTIONAL_TWINS[cls]


def wrap(cls, model):
    """`cls.wrap(model)`: `model`'s layers as a functional `cls`, a thin
    WrappedTowerModel calling a subclassed model, or a TaskTowerModel
    calling a KerasHub task."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"TowerModel.wrap takes a keras.Model; got {type(model).__name__}.")
    if isinstance(model, TowerModel):
        return model
    if is_keras_hub_task(model):
        # A rebuild on the task's inputs and outputs would lose what the
        # task is beyond its graph: its preprocessor, save_to_preset.
        return TaskTowerModel(model)
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if inputs and outputs:
        return cls(inputs=inputs, outputs=outputs, name=f"tower_{model.name}")
    return WrappedTowerModel(model)


def wrapped_by_new(cls, args, kwargs):
    """What `kt.TowerModel(model)` returns: `cls.wrap(model)`, marked so that
    the `__init__(model)` Python calls on it next leaves it as it is."""
    model = args[0]
    if len(args) > 1 or kwargs:
        extra = [type(a).__name__ for a in args[1:]] + sorted(kwargs)
        raise TypeError(
            f"kt.TowerModel(model) takes an existing Keras model alone; got also "
            f"{', '.join(extra)}. Build the Keras model as you want it (its name "
            "included), then call kt.TowerModel(model)."
        )
    built = wrap(cls, model)
    object.__setattr__(built, "_built_from_model", id(model))
    return built


def built_by_new(tower_model, args, kwargs):
    """Whether this `__init__` call is the one Python makes after
    `wrapped_by_new` (the model built already); clears the mark."""
    marker = tower_model.__dict__.get("_built_from_model")
    if marker is None or kwargs or len(args) != 1 or marker != id(args[0]):
        return False
    del tower_model.__dict__["_built_from_model"]
    return True


@keras.saving.register_keras_serializable(package="kerastower")
class WrappedTowerModel(TowerModel):
    """A TowerModel calling another, non-functional Keras model."""

    def __init__(self, model, **kwargs):
        if built_by_new(self, (model,), kwargs):
            return
        super().__init__(name=kwargs.pop("name", f"tower_{model.name}"), **kwargs)
        self.inner = model

    def call(self, inputs, training=None):
        return self.inner(inputs, training=training)


def is_keras_hub_task(model):
    """Whether `model` is a KerasHub task (`keras_hub.models.Task`).

    keras_hub is never imported here: a task exists only once it is.

    >>> from kerastower.functional import is_keras_hub_task
    >>> inputs = keras.Input((2,))
    >>> is_keras_hub_task(keras.Model(inputs, inputs))
    False
    """
    keras_hub = sys.modules.get("keras_hub")
    task_class = getattr(getattr(keras_hub, "models", None), "Task", None)
    return task_class is not None and isinstance(model, task_class)


@keras.saving.register_keras_serializable(package="kerastower")
class TaskTowerModel(TowerModel):
    """What `kt.TowerModel(task)` makes of a KerasHub task: the task on towers, its preprocessing included.

    `fit`, `evaluate` and `predict` take raw inputs (strings, images) as the
    task's own do: each tower's batch goes through the task's
    `preprocess_samples` (its preprocessor) before the tower step, as
    KerasHub maps it over its batches (kerastower/inputs/preprocessing.py).
    The tower model shares the task's layers and weights; it is compiled as
    the task was (new objects from `task.get_compile_config()`), until
    `compile` says otherwise. `save_to_preset` saves the task, and a saved
    `.keras` tower model loads back with its task and preprocessor.

    Examples:
        >>> import keras_hub
        >>> vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "cat", "dog"]
        >>> preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        ...     keras_hub.models.BertTokenizer(vocabulary=vocabulary), sequence_length=4)
        >>> backbone = keras_hub.models.BertBackbone(
        ...     vocabulary_size=8, num_layers=1, num_heads=1, hidden_dim=4,
        ...     intermediate_dim=4, max_sequence_length=4)
        >>> task = keras_hub.models.BertTextClassifier(backbone, 2, preprocessor=preprocessor)
        >>> model = kt.TowerModel(task)
        >>> type(model).__name__, model.preprocessor is task.preprocessor
        ('TaskTowerModel', True)
        >>> history = model.fit(np.array(["a cat", "a dog"]), np.array([0, 1]), batch_size=2, verbose=0)
        >>> model.predict(np.array(["a cat"]), verbose=0).shape
        (1, 2)
    """

    def __init__(self, task, **kwargs):
        if built_by_new(self, (task,), kwargs):
            return
        if not is_keras_hub_task(task):
            raise TypeError(
                f"TaskTowerModel takes a KerasHub task (keras_hub.models.Task); got "
                f"{type(task).__name__}. Wrap other models with kt.TowerModel(model).")
        super().__init__(name=kwargs.pop("name", f"tower_{task.name}"), **kwargs)
        self.task = task
        # As a functional model is: every variable is the task's, made already,
        # so a first predict (on JAX, a stateless call) has nothing to build.
        self.built = True
        if getattr(task, "compiled", False):
            self._compile_as(task)

    def _compile_as(self, task):
        try:
            # Not compile_from_config, which builds the optimizer: its slots
            # would take memory before fit, or for nothing if compile is called.
            self.compile(**keras.saving.deserialize_keras_object(task.get_compile_config()))
        except (TypeError, ValueError) as error:
            # Left uncompiled, fit says to compile: the objects the task was
            # compiled with may not be serializable (an unregistered loss).
            warnings.warn(
                f"kt.TowerModel({task.name}) could not compile as the task was compiled "
                f"({type(error).__name__}: {error}); call compile() on the tower model.",
                stacklevel=4)

    def call(self, inputs, training=None):
        return self.task(inputs, training=training)

    @property
    def preprocessor(self):
        """The task's preprocessor (None: the inputs are the model's own)."""
        return self.task.preprocessor

    @preprocessor.setter
    def preprocessor(self, value):
        self.task.preprocessor = value

    def preprocess_samples(self, x, y=None, sample_weight=None):
        """The task's preprocessing of one batch: `(x, y, sample_weight)` packed as Keras packs them."""
        return self.task.preprocess_samples(x, y, sample_weight)

    def save_to_preset(self, preset_dir, max_shard_size=10):
        """Saves the task (its trained weights, its preprocessor) as a KerasHub preset."""
        self.task.save_to_preset(preset_dir, max_shard_size=max_shard_size)

    def get_config(self):
        task = keras.saving.serialize_keras_object(self.task)
        # The tower model's own compile config is saved; the task's would
        # only make Keras warn, on loading, that a task's compile is custom.
        task.pop("compile_config", None)
        return {"task": task, "name": self.name}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        task = keras.saving.deserialize_keras_object(config.pop("task"), custom_objects=custom_objects)
        return cls(task, **config)


# TowerModel makes these variants without importing this module, which builds on it.
TowerModel._variants = sys.modules[__name__]
