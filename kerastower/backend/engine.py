"""StepEngine: the one contract between the loop and a backend's towers.

`TowerModel.fit`, `evaluate` and `predict`, `FitSteps` and the inference
loops are written once, against this interface; `backend/tensorflow/engine.py`
and `backend/jax/engine.py` implement it. An engine makes a source of
per-tower batches from what `fit` was given, builds the model from it, and
runs steps on it: every tower takes its own batch (tower k of step s the
source's batch s*N+k), runs the model's tower step under its
`TowerContext`, and the update is reduced over towers in one place per
backend (`backend/tensorflow/gradients.py`, `backend/jax/step.py`).

Examples:
    >>> inputs = keras.Input((3,))
    >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    >>> isinstance(model.engine, kt.backend.engine.StepEngine)
    True
"""

import contextlib
import dataclasses

from kerastower.errors import KerasTowerError

__all__ = ["StepEngine", "StepRun", "Feed", "TowerFunctionRunner"]


@dataclasses.dataclass
class StepRun:
    """What some steps of one call of the step function did.

    Attributes:
        taken: steps whose batches were taken from the input (a failed
            step's included).
        done: steps whose update was applied (`taken`, less a failed one).
        logs: the metrics after the last step, read across this process's
            towers, or what a user's step returned (`backend/step_values.py`).
        final_logs: None, or what the end of the epoch (or of evaluate)
            logs after these steps where it is not `logs`: the metrics, when
            the step returned exactly their keys, as Keras.
        tower_batches: batches each tower took, in tower order.
        examples: examples all towers took.
        tower_examples: each tower's examples in the first step (the total
            batch line), or None.
        nonfinite_towers: None, or the towers (of this process) whose
            gradients were not finite in the failed step (an empty list: a
            tower of another process).
        settle: None, or (only where the Feed may read its flags late,
            `Feed.flags_read_late`) a function that waits for the steps'
            finite flags and returns the StepRun they make: the counts
            above assume every step was applied until it is called.
    """

    taken: int = 0
    done: int = 0
    logs: dict = dataclasses.field(default_factory=dict)
    final_logs: dict = None
    tower_batches: list = dataclasses.field(default_factory=list)
    examples: int = 0
    tower_examples: list = None
    nonfinite_towers: list = None
    settle: object = None


class Feed:
    """fit's input, opened: one iterator through the run, or one per pass.

    The engine's `fit_feed` makes it; `FitSteps` calls `start` once,
    `begin_pass` before every epoch and `run` for every call of the step.
    """

    def start(self, skip_batches, epoch_num):
        """Opens the input before epoch `epoch_num`; on a resume, skips
        `skip_batches` (each tower's batches taken: of the pass
        `epoch_num - 1` when an epoch is one pass, else of the whole run)."""
        raise NotImplementedError

    def begin_pass(self, loop):
        """At every epoch: when an epoch is one pass, a new iterator over
        pass `loop.epoch_num - 1` (setting `loop.tower_batches`)."""
        raise NotImplementedError

    # Set by FitSteps where nothing reads a step before the epoch's end
    # (no callback with a batch hook but a progress bar): a call may then come back before its
    # finite flags are read (`StepRun.settle`), the next call gated on them.
    flags_read_late = False

    def run(self, num_steps, loop):
        """Up to `num_steps` training steps; returns a `StepRun`."""
        raise NotImplementedError


class TowerFunctionRunner:
    """Compiles and runs one `kt.Trainer.tower_function` on a backend (its
    `fn`, `reduce`, `training` and names are the TowerFunction's); each
    engine's `run_tower_function` keeps one per tower function."""

    def __init__(self, tower_function):
        self.tower_function = tower_function
        self._compiled = None

    def __getattr__(self, name):
        if "tower_function" not in self.__dict__:  # copy and pickle ask before __init__
            raise AttributeError(name)
        return getattr(self.__dict__["tower_function"], name)

    def __call__(self, model, args):
        """Runs the function once per tower of `model` on `args`."""
        raise NotImplementedError


class StepEngine:
    """What `TowerModel` and the loop need from a backend.

    Args:
        model: the TowerModel whose steps this engine runs.

    Attributes:
        backend: the Keras backend it runs on ("tensorflow", "jax"), as
            checkpoints record the input order it follows.
        pass_order: stock Keras's order of shuffled arrays on that backend
            (`inputs/keras_order.py`), which fit's passes follow where
            Keras's seed is set.
    """

    backend = None
    pass_order = None

    def __init__(self, model):
        self.model = model

    # compile

    def keras_jit_compile(self, jit_compile):
        """The `jit_compile` to hand to `keras.Model.compile`."""
        return jit_compile

    def compiled(self, jit_compile):
        """After `compile`: forget steps built for the old compile."""

    # input

    def check_validation_split(self, x, validation_split):
        """Refuses a `validation_split` this backend cannot cut from `x`."""

    def input_source(self, x, y=None, sample_weight=None, batch_size=None, shuffle=False,
                     repeat=False, method="fit", steps=None):
        """What `method` ("fit", "evaluate", "predict") got, as a source of
        per-tower batches (`steps`: how many that call takes, or None for
        one pass: then the source must end)."""
        raise NotImplementedError

    def validation_source(self, validation_data, batch_size, steps=None):
        """fit's `validation_data` as a source."""
        raise NotImplementedError

    def build_for(self, source, step=None, with_targets=True):
        """Creates every variable (layers, metrics, optimizer slots) from
        tower 0's first batch, so that no tower step creates one."""
        raise NotImplementedError

    def place(self, source, pass_index=0, skip_batches=None):
        """`source` on the towers: what a step takes its towers' batches from.

        The input layer (kerastower/inputs/) has decided which batch each
        tower takes: tower k of step s takes batch s*N+k. The engine places
        those batches where its step reads them. Returns an iterable of
        steps over pass `pass_index` (and the passes after it, for a source
        made with `repeat`), less the `skip_batches` each tower took of it
        before (a resumed run). TensorFlow places tf.data pipelines through
        the strategy (`TowerStrategy.place_input`) and its step takes one
        step's batches at a time (`backend/tensorflow/feeding.py`); JAX
        gives each step's numpy batches, which its step puts on the towers'
        devices (`backend/jax/placement.py`).
        """
        raise NotImplementedError

    # steps

    def fit_feed(self, source, steps_per_epoch, steps_per_call):
        """fit's `Feed` over `source`."""
        raise NotImplementedError

    def open_inference(self, source, steps=None):
        """An iterator over one pass of `source` for evaluate or predict
        (`steps`: the most steps the caller will take, None: the pass)."""
        return iter(self.place(source))

    def test_steps(self, iterator, num_steps, first_step):
        """Up to `num_steps` evaluation steps (`first_step`: the 0-based
        index of the first, for error messages); returns a `StepRun`."""
        raise NotImplementedError

    def predict_step(self, iterator, step):
        """The towers' outputs of one prediction step, joined in tower
        order; None when the input has ended."""
        raise NotImplementedError

    def joined_outputs(self, parts):
        """One output's prediction steps joined as stock Keras's predict
        joins them on this backend, where that is not numpy's
        `np.concatenate` (which the loop does, None returned); raises for
        outputs Keras cannot join on it."""
        return None

    def training_metrics_kept(self):
        """A context: the training metrics (every tower's) are put back as
        they were when it ends (an evaluation mid-training resets them)."""
        raise NotImplementedError

    def inference_sums(self, source, counters, compiled):
        """Each of `counters`' (`kt.callbacks.Inferencer`s) sums over every
        example of `source`, data-parallel over the towers; `compiled`, a
        dict the caller keeps, holds what was compiled for it."""
        raise NotImplementedError

    def run_tower_function(self, tower_function, args):
        """Runs a `kt.Trainer.tower_function` once per tower on `args` (the
        towers' batches first), its results reduced over towers."""
        raise NotImplementedError

    # state

    def logs_of_every_tower(self, logs):
        """`logs` (this process's towers') as the metrics of every tower."""
        return dict(logs)

    def sync_state(self):
        """Writes what the towers hold into the model's variables (before
        callbacks, validation or a checkpoint read them)."""

    def wait_for_steps(self):
        """Returns once the steps dispatched so far have run (TensorFlow's
        have when they return; JAX dispatches ahead of the loop)."""

    def memory_peaks(self):
        """Each tower device's peak memory in bytes, where devices report it
        (GPUs); an empty list elsewhere."""
        return []

    def reset_memory_peaks(self):
        """Starts the devices' peak memory over, where the backend can."""

    def optimizer_state_bytes(self):
        """{device name: bytes of the optimizer's state it holds}, over the
        towers' devices of this process, read from the devices' buffers
        (`kt.optimizer_state_bytes`)."""
        raise NotImplementedError(f"{type(self).__name__} must say its optimizer_state_bytes.")

    def collectives_per_step(self, mode):
        """What one step of `mode` launched (see `kt.collectives_per_step`)."""
        raise KerasTowerError(
            f"kt.collectives_per_step counts the collectives of TensorFlow's step "
            f"functions; this model runs on {type(self).__name__}, whose collectives "
            "XLA places inside the one jitted step. Read them from the compiled step's "
            "HLO instead (docs/jax.md).")

    def running(self, source=None):
        """The context `fit`, `evaluate` and `predict` run in, reading
        `source` (what `input_source` made): nothing its iterators started
        keeps running after it."""
        return contextlib.nullcontext()
