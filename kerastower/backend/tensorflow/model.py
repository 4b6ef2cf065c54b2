"""The TowerModel's tower steps on TensorFlow (the class's backend part).

`kt.TowerModel` takes `TowerModelBackend` as a base on TensorFlow: its
`train_step`, `test_step` and `predict_step` are tower functions, called
once per tower per step under a `TowerContext` on that tower's own batch
(the step function that calls them: step.py). Override them as in Keras.
"""

import warnings

import tensorflow as tf

from kerastower import _compat
from kerastower.backend.tensorflow import batch_checks
from kerastower.backend.tensorflow import gradients as tower_gradients
from kerastower.backend.tensorflow import step as tf_step
from kerastower.backend.tensorflow import tower_scope
from kerastower.backend.tensorflow import xla
from kerastower.errors import TowerRuleError

__all__ = ["TowerModelBackend"]


class TowerModelBackend:
    """The tower steps of `kt.TowerModel` on TensorFlow (a mixin before
    `keras.Model`; see kerastower/model.py)."""

    # ------------------------------------------------------------------
    # Tower functions: called once per tower, under a TowerContext.

    def tower_loss(self, x, y, y_pred, sample_weight=None, training=True):
        """This tower's loss: the compiled loss (plus `model.losses`), or
        what an overridden `compute_loss` returns; a scalar, the tower's own
        mean (Keras does not divide it by the number of towers in a tower)."""
        loss = _compat.compute_loss(
            self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )
        if loss.shape.rank != 0:
            raise TowerRuleError(
                f"The loss must be a scalar; got a tensor of shape {loss.shape}. "
                "Tower rule: compute_loss returns one number per tower (reduce "
                "with a mean or sum over the batch). See docs/towers.md, rule 4."
            )
        return loss

    def run_on_towers(self, fn, data, is_training=False):
        """Calls `fn(tower_data)` once per tower under its TowerContext.

        `data` is one step's per-tower batches (what the distributed iterator
        of an InputSource gives); returns the per-tower results, whose values
        `self.tower_strategy.tower_values(result)` lists in tower order.
        """
        def in_tower(tower_data):
            with self.tower_scope(is_training, getattr(fn, "__qualname__", "run_on_towers")):
                return fn(tower_data)

        return self._tower_strategy.run(in_tower, args=(data,))

    def tower_scope(self, is_training, step_name, name=None, examples=None):
        """Inside a tower: enters its TowerContext and the tower rules.

        Only the main tower records `tf.summary` data, and creating a variable
        raises a TowerRuleError naming `step_name`. In training, the towers'
        replica-local weights (BatchNormalization's statistics) follow the
        main tower's when the block ends. `examples`, this tower's batch
        size, sets the share `optimizer.apply` weights its gradients by
        (default: 1/N). Yields the TowerContext.
        """
        return tower_scope.tower_scope(self, is_training, step_name, name=name, examples=examples)

    def _call_tower(self, x, training):
        if _compat.call_has_training_arg(self):
            return self(x, training=training)
        return self(x)

    @batch_checks.computes_compiled_loss
    def train_step(self, data):
        """One tower's training step on its own batch `data`.

        Computes the gradient of this tower's mean loss, as one device would,
        and calls `optimizer.apply`, which inside a tower applies the
        example-weighted mean over towers (reduced before clipping). Returns
        this tower's metric results; `fit` logs the metrics read across towers.
        """
        x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
        num_examples = tf_step.num_examples(data)
        variables = self.trainable_weights
        if not variables:
            warnings.warn("The model does not have any trainable weights.")  # as Keras

        @xla.compiled_in(self)
        def forward_backward():
            with batch_checks.checked_step(self, "train", x, y) as check:
                with tf.GradientTape() as tape:
                    y_pred = check.outputs(self._call_tower(x, training=True))
                    loss = self.tower_loss(x, y, y_pred, sample_weight, training=True)
                    # An empty batch has a NaN mean loss; it must count as zero.
                    loss = tf.where(num_examples > 0, loss, tf.zeros_like(loss))
                    scaled_loss = self.optimizer.scale_loss(loss)
                _compat.loss_tracker(self).update_state(loss, sample_weight=num_examples)
                self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return tape.gradient(scaled_loss, variables)

        gradients = tower_gradients.gradients_unless_empty(self, forward_backward, num_examples, variables)
        self.optimizer.apply(gradients, variables)
        return self.get_metrics_result()

    @batch_checks.computes_compiled_loss
    def test_step(self, data):
        """One tower's evaluation step on its own batch `data`."""
        x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
        num_examples = tf_step.num_examples(data)
        with batch_checks.checked_step(self, "test", x, y) as check:
            y_pred = check.outputs(self._call_tower(x, training=False))
            loss = self.tower_loss(x, y, y_pred, sample_weight, training=False)
            loss = tf.where(num_examples > 0, loss, tf.zeros_like(loss))
            _compat.loss_tracker(self).update_state(loss, sample_weight=num_examples)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data):
        """One tower's predictions for its own batch `data`."""
        x, _, _ = _compat.unpack_x_y_sample_weight(data)
        return self._call_tower(x, training=False)

    # ------------------------------------------------------------------
    # Step functions: one batch per tower per step (kerastower/engine).

    def make_train_function(self, force=False):
        if self.train_function is None or force:
            xla.warn_if_not_compiled(self, type(self).train_step is not TowerModelBackend.train_step)
            self.train_function = tf_step.make_step_function(self, self.train_step, "train")
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self.test_function = tf_step.make_step_function(self, self.test_step, "test")
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:
            self.predict_function = tf_step.make_step_function(self, self.predict_step, "predict")
        return self.predict_function
