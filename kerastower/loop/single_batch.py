"""`train_on_batch`, `test_on_batch` and `predict_on_batch`: one step on a given batch.

On one tower these are Keras's: one step on the batch, its metrics reset
first (as Keras 3.15 does: the logs are this batch's alone). On
N towers the given batch is the joined batch: tower k takes its k-th equal
part, so the step is the one one device takes on the whole batch (the
update, the metrics and the outputs). A batch that N towers cannot share
equally is refused, naming the sizes.

Written once for every backend, over the model's step engine: the batch
becomes a one-step source (`engine.input_source` with `batch_size` = the
batch's size / N), which the engine's feed and inference steps run as fit
and evaluate would.
"""

import keras
import numpy as np

from kerastower import _compat
from kerastower import arguments
from kerastower.errors import DataMismatchError
from kerastower.errors import nonfinite_error
from kerastower.loop.main_loop import LoopState
from kerastower.loop.main_loop import check_strategy

__all__ = ["train_on_batch", "test_on_batch", "predict_on_batch"]


def tower_share(model, method, *arrays):
    """Each tower's number of examples of the batch `arrays` (x, y,
    sample_weight; None for absent ones), which N towers take in equal parts."""
    leaves = [leaf for leaf in keras.tree.flatten([a for a in arrays if a is not None])]
    sizes = sorted({int(np.shape(leaf)[0]) for leaf in leaves if np.ndim(leaf) >= 1})
    if len(sizes) != 1:
        raise DataMismatchError(
            f"{method}: x, y and sample_weight must have the same number of examples "
            f"(one batch); got {sizes or 'no array'}.")
    size, towers = sizes[0], model.num_towers
    if size == 0 or size % towers:
        raise DataMismatchError(
            f"{method}: the batch has {size} examples, which {towers} towers cannot take "
            f"in equal parts. On N towers the batch of {method} is the joined batch "
            f"(tower k takes its k-th part): pass a batch whose size is a multiple of "
            f"{towers}, or call fit/evaluate/predict, where each tower takes batches "
            "of its own.")
    return size // towers


def _logs(model, logs, return_dict):
    logs = _compat.pythonify_logs(model.engine.logs_of_every_tower(logs))
    return logs if return_dict else _compat.flatten_metrics_in_order(model, logs)


def train_on_batch(model, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
    """One training step on the batch (x, y, sample_weight); Keras's logs."""
    _compat.assert_compile_called(model, "train_on_batch")
    check_strategy(model, "train_on_batch")
    x, y, sample_weight, _ = arguments.fit_data(x, y, sample_weight, class_weight, 0.0, None)
    engine = model.engine
    source = engine.input_source(
        x, y, sample_weight, tower_share(model, "train_on_batch", x, y, sample_weight),
        shuffle=False, method="fit")
    engine.build_for(source, step="train")
    if model.loop.global_step == 0 and model.optimizer is not None:
        model.loop.global_step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    # A scratch loop state: fit's input position is not this call's.
    loop = LoopState()
    loop.epoch_num, loop.global_step = 1, model.loop.global_step
    feed = engine.fit_feed(source, None, 1)
    model.reset_metrics()
    with engine.running():
        feed.start(None, 1)
        feed.begin_pass(loop)
        run = feed.run(1, loop)
    engine.sync_state()  # the caller reads the weights next
    if run.nonfinite_towers is not None:
        raise nonfinite_error(model.loop.global_step + 1, run.nonfinite_towers, model.num_towers)
    model.loop.global_step += run.done
    return _logs(model, run.logs, return_dict)


def test_on_batch(model, x, y=None, sample_weight=None, return_dict=False):
    """One evaluation step on the batch; Keras's logs."""
    _compat.assert_compile_called(model, "test_on_batch")
    check_strategy(model, "test_on_batch")
    engine = model.engine
    source = engine.input_source(
        x, y, sample_weight, tower_share(model, "test_on_batch", x, y, sample_weight),
        method="evaluate")
    engine.build_for(source, step="test")
    model.reset_metrics()
    with engine.running():
        run = engine.test_steps(engine.open_inference(source), 1, 0)
    return _logs(model, run.logs, return_dict)


def predict_on_batch(model, x):
    """The model's outputs on the batch `x`, as numpy arrays."""
    check_strategy(model, "predict_on_batch")
    engine = model.engine
    source = engine.input_source(
        x, None, None, tower_share(model, "predict_on_batch", x), method="predict")
    engine.build_for(source, step=None, with_targets=False)
    with engine.running():
        outputs = engine.predict_step(engine.open_inference(source), 0)
    return keras.tree.map_structure(np.asarray, outputs)
