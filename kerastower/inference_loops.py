"""The loops of `TowerModel.evaluate` and `predict`: no training, no epochs.

Both run the compiled tower step (kerastower/engine) over a per-tower input
until it ends: evaluation reads the metrics across towers, so every example
counts once; prediction concatenates the towers' outputs step by step, which
restores the input order (tower k of a step took the step's k-th batch).
"""

import numpy as np
import tensorflow as tf

from kerastower import _compat
from kerastower.engine import step_errors
from kerastower.engine import tf_step
from kerastower.errors import InputSourceError

__all__ = ["evaluate_loop", "predict_loop"]


def evaluate_loop(model, source, steps, callbacks):
    """Evaluates `model` on `source` (up to `steps` steps); returns the logs."""
    test_function = model.make_test_function()
    iterator = iter(source.distribute(model.tower_strategy))
    model.stop_evaluating = False
    callbacks.on_test_begin()
    model.reset_metrics()
    logs, step = {}, 0
    while not steps or step < steps:
        want = model.steps_per_execution if not steps else min(model.steps_per_execution, steps - step)
        callbacks.on_test_batch_begin(step)
        run = tf_step.run_steps(test_function, iterator, want, f"Evaluation step {step + 1}")
        if run.steps:
            logs = run.logs
            step += run.steps
            callbacks.on_test_batch_end(step - 1, logs)
        if run.steps < want or model.stop_evaluating:
            break
    if step == 0:
        raise InputSourceError(
            "evaluate() got no batch: the input is empty (or a one-shot source "
            "already used up), so there is nothing to measure. Pass data with at "
            "least one example."
        )
    if not model.tower_strategy.single_process:
        # The steps gave this process's metrics; the result is all towers'.
        logs = tf_step.logs_across_towers(model)
    logs = _compat.pythonify_logs(logs)
    callbacks.on_test_end(logs)
    return logs


def predict_loop(model, source, steps, callbacks):
    """`model`'s outputs on `source` (up to `steps` steps), in input order."""
    strategy = model.tower_strategy
    predict_function = model.make_predict_function()
    iterator = iter(source.distribute(strategy))
    model.stop_predicting = False
    callbacks.on_predict_begin()
    batches, step = [], 0
    while not steps or step < steps:
        callbacks.on_predict_batch_begin(step)
        has_data, next_batches = strategy.next_step(iterator)
        if not bool(has_data):  # no tower has data left
            break
        try:
            outputs = predict_function(next_batches())
        except tf.errors.OpError as error:
            failure = step_errors.explain(error, f"Prediction step {step + 1}")
            raise failure from failure.__cause__
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
    return tf.nest.map_structure(
        lambda *parts: np.concatenate([np.asarray(p) for p in parts], axis=0), *batches
    )
