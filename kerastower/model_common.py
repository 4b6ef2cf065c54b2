"""What the TowerModel of every backend adds to keras.Model alike.

model.py (TensorFlow) and jax_model.py (JAX) hold each backend's
TowerModel; both take these: a model loaded from a `.keras` file is
compiled as Keras would compile it, and the single-batch methods are
refused, since one batch cannot feed several towers without splitting it.
"""

import keras

__all__ = ["TowerModelCommon"]


class TowerModelCommon:
    """Mixed into both TowerModels, before `keras.Model`."""

    def get_compile_config(self):
        """Keras's compile config, with `check_finite` when it was turned off."""
        config = super().get_compile_config()
        if config is not None and not getattr(self, "tower_check_finite", True):
            config = dict(config, check_finite=False)
        return config

    def compile_from_config(self, config):
        """Compiles a loaded model as Keras would; needed because `compile`
        is overridden (it takes `check_finite`)."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def _no_single_batch(self, method, instead):
        raise NotImplementedError(
            f"TowerModel.{method} is not supported: one batch cannot feed several "
            f"towers without splitting it. Use {instead} on that batch instead (as "
            "arrays, or a one-batch tf.data.Dataset on TensorFlow).")

    def train_on_batch(self, *args, **kwargs):
        self._no_single_batch("train_on_batch", "fit(..., steps_per_epoch=1)")

    def test_on_batch(self, *args, **kwargs):
        self._no_single_batch("test_on_batch", "evaluate(...)")

    def predict_on_batch(self, *args, **kwargs):
        self._no_single_batch("predict_on_batch", "predict(...)")
