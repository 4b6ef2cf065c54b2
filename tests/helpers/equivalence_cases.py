"""The models of the equivalence matrix: what Keras users write.

Each case: `build(optimizer)` makes a compiled kt.TowerModel, `data()` the
fit arguments (x, y and maybe sample_weight, class_weight, validation_data)
for STEPS steps of 2 x B examples. Imported by the in-process matrix, by
the Horovod / multi-worker script (so it imports no conftest) and by the
JAX matrix (tests/jax/test_jax_equivalence.py: so it is backend-neutral,
the keras.io custom step written for each backend as keras.io writes it).
"""

import keras
import numpy as np
from keras import ops

import kerastower as kt

B = 8
STEPS = 3
N = 2 * B * STEPS

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.3),
    "adam": lambda: keras.optimizers.Adam(0.03),
    "clipnorm": lambda: keras.optimizers.SGD(0.3, clipnorm=0.05),
}
# One update per STEPS steps: one device's on 2 x B x STEPS examples
# (`one_device_reference`). In the Horovod / multi-worker subset; the
# in-process matrix's are tests/shared/test_gradient_accumulation.py.
ACCUMULATING = {
    "adam_accumulating": lambda: keras.optimizers.Adam(0.03, gradient_accumulation_steps=STEPS),
    "sgd_accumulating": lambda: keras.optimizers.SGD(0.3, gradient_accumulation_steps=STEPS),
}


def one_device_reference(optimizer_name):
    """(the optimizer one device trains with, the steps its batch joins):
    an accumulating optimizer's cycle is one step of the optimizer without
    accumulation on the cycle's joined examples."""
    if optimizer_name.endswith("_accumulating"):
        return optimizer_name[:-len("_accumulating")], STEPS
    return optimizer_name, 1

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _features(seed=0, n=N, d=6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    return x, y


# ---------------------------------------------------------------------------
# The models. Each case: build(optimizer) -> compiled model; data() -> fit kwargs.


def _mlp_layers(inputs, **dense_kwargs):
    h = keras.layers.Dense(8, activation="tanh", **dense_kwargs)(inputs)
    return keras.layers.Dense(3)(h)


def dense_build(optimizer):
    inputs = keras.Input((6,))
    model = kt.TowerModel(inputs, _mlp_layers(inputs))
    model.compile(optimizer=optimizer, loss=SCCE, metrics=["accuracy"])
    return model


def sync_batchnorm_build(optimizer):
    inputs = keras.Input((6,))
    # No bias before BatchNormalization: its true gradient is 0, and Adam
    # would blow the float noise in it up to full-size steps.
    h = keras.layers.Dense(8, use_bias=False)(inputs)
    h = keras.layers.BatchNormalization(synchronized=True)(h)
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(keras.layers.Activation("relu")(h)))
    model.compile(optimizer=optimizer, loss=SCCE, metrics=["accuracy"])
    return model


def embedding_build(optimizer):
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(12, 4)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=optimizer, loss=SCCE, metrics=["accuracy"])
    return model


def embedding_data():
    rng = np.random.default_rng(1)
    # Few tokens, many repeats: sparse gradients with duplicate indices.
    x = rng.integers(0, 12, (N, 5)).astype("int32")
    y = rng.integers(0, 3, N).astype("int32")
    return {"x": x, "y": y}


def multi_output_build(optimizer):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(3, name="b")(h)}
    model = kt.TowerModel(inputs, outputs)
    model.compile(
        optimizer=optimizer,
        loss={"a": "mse", "b": SCCE},
        loss_weights={"a": 0.3, "b": 1.0},
        metrics={"b": ["accuracy"]},
    )
    return model


def multi_output_data():
    x, y = _features(2)
    return {"x": x, "y": {"a": x[:, :1] * 2.0, "b": y}}


class ComputeLossModel(kt.TowerModel):
    """compute_loss overridden the keras.io way, with its own tracker."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.out(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = ops.mean((y_pred - y) ** 2)
        self.loss_tracker.update_state(loss)
        return loss

    @property
    def metrics(self):
        return [self.loss_tracker]


def compute_loss_build(optimizer):
    model = ComputeLossModel()
    model.compile(optimizer=optimizer)
    return model


def regression_data():
    x, _ = _features(3)
    return {"x": x, "y": np.tanh(x[:, :1] - x[:, 1:2]).astype("float32")}


class KerasIoTrainStep(kt.TowerModel):
    """The custom train_step of keras.io's "Customizing what happens in
    fit()" (TensorFlow backend), with a Keras loss object and trackers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.acc = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.acc.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "accuracy": self.acc.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.acc]


class KerasIoJaxTrainStep(KerasIoTrainStep):
    """The same model with keras.io's JAX custom train_step ("Customizing
    what happens in fit() with JAX"): stateless, `compute_loss_and_updates`
    differentiated with `jax.value_and_grad`, metrics updated statelessly."""

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        return self.loss_fn(y, y_pred), (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        import jax

        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        new_metrics_variables, logs = [], []
        for metric in self.metrics:
            count = len(metric.variables)
            values = metrics_variables[len(new_metrics_variables):len(new_metrics_variables) + count]
            if metric.name == "loss":
                values = metric.stateless_update_state(values, loss)
            else:
                values = metric.stateless_update_state(values, y, y_pred)
            logs.append(metric.stateless_result(values))
            new_metrics_variables += values
        logs = {metric.name: result for metric, result in zip(self.metrics, logs)}
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      new_metrics_variables)


def keras_io_build(optimizer):
    jax_step = keras.backend.backend() == "jax"
    model = KerasIoJaxTrainStep() if jax_step else KerasIoTrainStep()
    model.compile(optimizer=optimizer)
    return model


def masked_build(optimizer):
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    outputs = keras.layers.Dense(3)(h)  # one prediction per token, masked
    model = kt.TowerModel(inputs, outputs)
    model.compile(optimizer=optimizer, loss=SCCE)
    return model


def masked_data():
    """Sequences padded with 0. Every tower batch holds the same number of
    real tokens: exact even with each tower's own token count."""
    rng = np.random.default_rng(4)
    x = rng.integers(1, 10, (N, 6)).astype("int32")
    lengths = np.tile(np.array([6, 2, 5, 3, 4, 4, 1, 5]), N // 8)
    for row, length in enumerate(lengths):
        x[row, length:] = 0
    y = rng.integers(0, 3, (N, 6)).astype("int32")
    return {"x": x, "y": y}


def unequal_padding_data():
    """Sequences padded with 0, tower 0's batches of 1-2 tokens a row and
    tower 1's of 5-6 (issue 27): exact only with the joined batch's count."""
    rng = np.random.default_rng(13)
    x = rng.integers(1, 10, (N, 6)).astype("int32")
    short = (np.arange(N) // B) % 2 == 0
    lengths = np.where(short, rng.integers(1, 3, N), rng.integers(5, 7, N))
    for row, length in enumerate(lengths):
        x[row, length:] = 0
    y = rng.integers(0, 3, (N, 6)).astype("int32")
    return {"x": x, "y": y}


def sample_weight_data():
    x, y = _features(5)
    weights = np.random.default_rng(5).uniform(0.1, 2.0, N).astype("float32")
    return {"x": x, "y": y, "sample_weight": weights}


def class_weight_data():
    x, y = _features(6)
    return {"x": x, "y": y, "class_weight": {0: 0.5, 1: 2.0, 2: 1.0}}


def regularized_build(optimizer):
    inputs = keras.Input((6,))
    outputs = _mlp_layers(inputs, kernel_regularizer=keras.regularizers.L2(0.05))
    model = kt.TowerModel(inputs, outputs)
    model.compile(optimizer=optimizer, loss=SCCE, metrics=["accuracy"])
    return model


def features_data():
    x, y = _features(7)
    return {"x": x, "y": y, "validation_data": _features(8, n=20)}


def mixed_float16_build(optimizer):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return dense_build(optimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")


CASES = {
    "dense": (dense_build, features_data),
    "sync_batchnorm": (sync_batchnorm_build, lambda: dict(zip("xy", _features(9)))),
    "embedding": (embedding_build, embedding_data),
    "multi_output": (multi_output_build, multi_output_data),
    "compute_loss": (compute_loss_build, regression_data),
    "keras_io_train_step": (keras_io_build, lambda: dict(zip("xy", _features(10)))),
    "masked_sequence": (masked_build, masked_data),
    "unequal_padding": (masked_build, unequal_padding_data),
    "sample_weight": (dense_build, sample_weight_data),
    "class_weight": (dense_build, class_weight_data),
    "kernel_regularizer": (regularized_build, lambda: dict(zip("xy", _features(11)))),
    "mixed_float16": (mixed_float16_build, lambda: dict(zip("xy", _features(12)))),
}
TOLERANCE = {"mixed_float16": 1e-3}

# (case, optimizer) run on 2 Horovod ranks and 2 multi-worker workers: the
# models whose semantics a multi-process strategy could break.
DISTRIBUTED_SUBSET = [
    ("dense", "adam"),            # with validation_data: validation equals one process
    ("compute_loss", "sgd"),
    ("keras_io_train_step", "clipnorm"),
    ("embedding", "adam"),
    ("sample_weight", "adam"),
    ("unequal_padding", "adam"),  # the masked loss's count is all processes' towers'
    ("dense", "adam_accumulating"),             # gradient accumulation over processes
    ("unequal_padding", "sgd_accumulating"),    # micro-steps weighed by their tokens
]


def initial_weights(case):
    """The case's model weights from seed 0, made on one device."""
    build, make_data = CASES[case]
    keras.utils.set_random_seed(0)
    with kt.distributed("single"):
        model = build(OPTIMIZERS["sgd"]())
        data = make_data()
        model.fit(data["x"], data["y"], batch_size=2 * B, epochs=0, verbose=0)
        return model.get_weights()


def fit_case(case, optimizer_name, batch_size, weights, epochs=2):
    """Trains the case's model from `weights` under the active strategy;
    returns (model, history dict)."""
    build, make_data = CASES[case]
    fit_kwargs = make_data()
    x, y = fit_kwargs.pop("x"), fit_kwargs.pop("y")
    model = build({**OPTIMIZERS, **ACCUMULATING}[optimizer_name]())
    model.fit(x, y, batch_size=batch_size, epochs=0, verbose=0)  # creates the variables
    model.set_weights(weights)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                        **fit_kwargs)
    return model, history.history


def check_towers_equal_one_device(case, optimizer_name, devices, per_tower=B):
    """Trains the case from one initial state on one device with batch
    `len(devices) x per_tower` and on `devices` with `per_tower` a tower,
    and compares the weights and every logged value."""
    import kerastower as kt

    initial = initial_weights(case)
    with kt.distributed("single"):
        one, one_logs = fit_case(case, optimizer_name, len(devices) * per_tower, initial)
    with kt.distributed("mirrored", devices=devices):
        many, many_logs = fit_case(case, optimizer_name, per_tower, initial)
    moved = max(float(np.abs(a - w).max()) for a, w in zip(one.get_weights(), initial))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    steps = int(one.optimizer.iterations.numpy())
    assert int(many.optimizer.iterations.numpy()) == steps == 2 * N // (len(devices) * per_tower)
    atol = TOLERANCE.get(case, 1e-5)
    for a, b, w in zip(one.get_weights(), many.get_weights(), one.weights):
        np.testing.assert_allclose(b, a, atol=atol, err_msg=f"{case}/{optimizer_name}: {w.path}")
    assert sorted(one_logs) == sorted(many_logs)
    for key in one_logs:
        np.testing.assert_allclose(many_logs[key], one_logs[key], atol=atol,
                                   err_msg=f"{case}/{optimizer_name}: logged {key}")
