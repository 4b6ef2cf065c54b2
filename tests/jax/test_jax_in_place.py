"""JAX: a training call updates the weights and optimizer slots in place.

The state a call takes as its own is donated; XLA writes the new weights
into its buffers only where nothing may still read the old ones. Applied
outright (the finite check off), a kernel that the backward pass still
reads was copied first, and in K unrolled steps (`steps_per_execution`)
XLA:CPU fused the momentum updates into chains that compute each step's
weights again from every earlier step's gradients, all kept alive (57 MB
of temporaries for 8 steps of this MLP, against 7 MB). The step gates its
update with a cond, checked or not, whose operands order it after every
read (backend/jax/step.py). These tests read the compiled call's text
and memory figures.
"""

import keras
import numpy as np
import pytest

import kerastower as kt

FEATURES, WIDTH, BATCH = 784, 1024, 64
OPTIMIZERS = {"momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9), "adam": keras.optimizers.Adam}


def _compiled_calls(model):
    """Wraps each compiled train call of `model`'s towers so that its first
    call's compiled executable is kept: {mode: jax.stages.Compiled}."""
    tower_steps = model.engine.tower_steps()
    compiled = {}
    original_function = tower_steps._function

    def function(mode, body):
        jitted = original_function(mode, body)

        def call(*args):
            if mode not in compiled:
                compiled[mode] = jitted.lower(*args).compile()
            return jitted(*args)

        return call

    tower_steps._function = function
    return compiled


def _state_bytes(model):
    variables = model.trainable_variables + model.non_trainable_variables + model.optimizer.variables
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("check_finite", [True, False])
@pytest.mark.parametrize("steps_per_execution", [1, 8])
def test_a_call_writes_the_new_state_into_the_one_it_took(check_finite, steps_per_execution, optimizer):
    keras.utils.set_random_seed(0)
    with kt.distributed("single", devices=[0]):
        inputs = keras.Input((FEATURES,))
        h = keras.layers.Dense(WIDTH, activation="relu")(inputs)
        h = keras.layers.Dense(WIDTH, activation="relu")(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(4)(h))
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse", check_finite=check_finite,
                      steps_per_execution=steps_per_execution)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * BATCH, FEATURES)).astype("float32")
    y = rng.normal(size=(8 * BATCH, 4)).astype("float32")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)  # builds the optimizer
    compiled = _compiled_calls(model)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    (mode, call), = compiled.items()
    assert mode == ("train" if steps_per_execution == 1 else f"train_steps:{steps_per_execution}")
    # No copy of the inner kernel (the backward pass reads it for the
    # first layer's gradient)...
    copies = [line for line in call.as_text().splitlines()
              if " copy(" in line and f"f32[{WIDTH},{WIDTH}]" in line.split("copy(")[0]]
    assert copies == []
    # ...and no state of its own per step: what the call needs besides its
    # arguments and outputs is less than one more state.
    memory = call.memory_analysis()
    assert memory.temp_size_in_bytes < _state_bytes(model), memory


class _ReadsEachStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


def test_a_call_launched_ahead_writes_each_new_value_once():
    """A call launched ahead does not take its state (it stays the towers'
    until committed), so it writes a new one: with a select, each value
    once; a cond copied the whole state into its operands and out of its
    untaken branch."""
    keras.utils.set_random_seed(0)
    with kt.distributed("single", devices=[0]):
        inputs = keras.Input((16,))
        h = keras.layers.Dense(32, activation="relu")(inputs)
        h = keras.layers.Dense(32, activation="relu")(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(4)(h))
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 4)).astype("float32")
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    compiled = _compiled_calls(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[_ReadsEachStep()])
    assert model.engine.tower_steps().launches_ahead()
    (call,) = compiled.values()
    copies = [line for line in call.as_text().splitlines()
              if " copy(" in line and "f32[32,32]" in line.split("copy(")[0]]
    assert copies == []
