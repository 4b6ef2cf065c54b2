"""The loops of `TowerModel.evaluate` and `predict`: no training, no epochs.

Written once for every backend, over the model's step engine
(kerastower/backend/engine.py): evaluation reads the metrics across towers,
so every example counts once; prediction concatenates the towers' outputs
step by step, which restores the input order (tower k of a step took the
step's k-th batch). Keras's test and predict callbacks run around each step.
"""

import keras
import numpy as np

from kerastower import _compat
from kerastower.errors import InputSourceError
from kerastower.inputs import ragged_sparse

__all__ = ["evaluate_loop", "predict_loop"]


def evaluate_loop(model, source, steps, callbacks):
    """Evaluates `model` on `source` (up to `steps` steps); returns the logs."""
    engine = model.engine
    iterator = engine.open_inference(source, steps)
    model.stop_evaluating = False
    callbacks.on_test_begin()
    model.reset_metrics()
    logs, final_logs, step = {}, None, 0
    # A source of known length ends after its last step, as in Keras.
    limit = steps or source.steps(model.num_towers)
    while not limit or step < limit:
        want = model.steps_per_execution if not limit else min(model.steps_per_execution, limit - step)
        callbacks.on_test_batch_begin(step)
        run = engine.test_steps(iterator, want, step)
        if run.done:
            logs, final_logs = run.logs, run.final_logs
            step += run.done
            callbacks.on_test_batch_end(step - 1, logs)
        if run.done < want or model.stop_evaluating:
            break
    if step == 0:
        raise InputSourceError(
            "evaluate() got no batch: the input is empty (or a one-shot source "
            "already used up), so there is nothing to measure. Pass data with at "
            "least one example."
        )
    # As Keras's `_get_metrics_result_or_logs` (StepRun.final_logs).
    logs = _compat.pythonify_logs(engine.logs_of_every_tower(logs if final_logs is None else final_logs))
    callbacks.on_test_end(logs)
    return logs


def predict_loop(model, source, steps, callbacks):
    """`model`'s outputs on `source` (up to `steps` steps), in input order."""
    engine = model.engine
    iterator = engine.open_inference(source)
    model.stop_predicting = False
    callbacks.on_predict_begin()
    batches, step = [], 0
    limit = steps or source.steps(model.num_towers)
    while not limit or step < limit:
        callbacks.on_predict_batch_begin(step)
        outputs = engine.predict_step(iterator, step)
        if outputs is None:
            break
        batches.append(outputs)
        callbacks.on_predict_batch_end(step, {"outputs": outputs})
        step += 1
        if model.stop_predicting:
            break
    callbacks.on_predict_end()
    if not batches:
        raise InputSourceError(
            "predict() got no batch: the input is empty (or a one-shot source "
            "already used up). Pass data with at least one example."
        )
    return keras.tree.map_structure(lambda *parts: _joined(list(parts), engine), *batches)


def _joined(parts, engine):
    """One output's steps joined as stock Keras joins its batches: as the
    engine's backend joins them where that is its own (ragged and sparse
    outputs on TensorFlow), else numpy arrays of one shape beyond the batch
    by `np.concatenate` (outputs of different widths refused, as Keras's
    `np.concatenate` refuses them)."""
    joined = engine.joined_outputs(parts)
    if joined is not None:
        return joined
    arrays = [np.asarray(p) for p in parts]
    shapes = [a.shape for a in arrays]
    if len({s[1:] for s in shapes}) > 1:
        raise ragged_sparse.describe_mismatch(shapes)
    return np.concatenate(arrays, axis=0)
