"""The models the benchmarks train: each a function of the Model class."""

import os

import keras
import numpy as np

IMAGE = (32, 32, 3)
# ResNet-50's images: 224 x 224 as on ImageNet; smaller to try it on a CPU.
RESNET_IMAGE = (int(os.environ.get("KT_BENCH_RESNET_SIZE", "224")),) * 2 + (3,)
FEATURES = 784
SEQUENCE, WIDTH = 32, 64


def mlp(model_cls, width=1024):
    """784-1024-1024-10: few, large matrix multiplications."""
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(width, activation="relu")(inputs)
    h = keras.layers.Dense(width, activation="relu")(h)
    return model_cls(inputs, keras.layers.Dense(10)(h))


def small_mlp(model_cls):
    """784-64-64-10: a step so cheap that per-step overheads show."""
    return mlp(model_cls, width=64)


def convnet(model_cls):
    """Conv(32)-MaxPool-Conv(64)-GAP-Dense(128)-Dense(10) on 32x32x3."""
    inputs = keras.Input(IMAGE)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(128, activation="relu")(h)
    return model_cls(inputs, keras.layers.Dense(10)(h))


def transformer(model_cls):
    """One transformer block (4-head attention, layer norms, GELU MLP) on
    32 tokens of width 64, mean-pooled: many small ops, where XLA's fusion
    helps even on a CPU."""
    inputs = keras.Input((SEQUENCE, WIDTH))
    attended = keras.layers.MultiHeadAttention(4, WIDTH // 4)(inputs, inputs)
    h = keras.layers.LayerNormalization()(inputs + attended)
    mlp_out = keras.layers.Dense(WIDTH)(keras.layers.Dense(4 * WIDTH, activation="gelu")(h))
    h = keras.layers.LayerNormalization()(h + mlp_out)
    return model_cls(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))


def resnet50(model_cls):
    """keras.applications' ResNet-50 (no weights), 10 classes, logits: the
    GPU anchor's model (with `--dtype mixed_bfloat16`, batch 256)."""
    base = keras.applications.ResNet50(weights=None, input_shape=RESNET_IMAGE, classes=10,
                                       classifier_activation=None)
    return model_cls(base.inputs, base.outputs)


INPUT_SHAPES = {
    mlp: (FEATURES,), small_mlp: (FEATURES,), convnet: IMAGE, transformer: (SEQUENCE, WIDTH),
    resnet50: RESNET_IMAGE,
}


def compile_model(model, jit_compile=False, steps_per_execution=1, **tower_options):
    """`tower_options` (check_finite) go to a TowerModel's compile only."""
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
        **tower_options,
    )
    return model


def examples(build, size, seed=0):
    """`size` random (x, y) examples for the model `build` makes."""
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(size,) + INPUT_SHAPES[build]).astype("float32"),
        rng.integers(0, 10, size).astype("int32"),
    )


def mlp256(model_cls):
    """784-256-256-10: issue 29's MLP, where fit's numpy input path shows."""
    return mlp(model_cls, width=256)


INPUT_SHAPES[mlp256] = (FEATURES,)
