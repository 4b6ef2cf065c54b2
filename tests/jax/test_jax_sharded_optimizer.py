"""Sharded optimizer state on JAX: each tower keeps 1/N of every slot, with the replicated run's numbers.

Each case of the equivalence matrix (tests/helpers/equivalence_cases.py)
is trained twice from one initial state on the same towers: with every
tower holding the whole optimizer state, and with
`kt.distributed(..., shard_optimizer=True)`. The weights, every optimizer
variable and every logged value must agree within 1e-6. The replicated
run is itself checked against one device by the equivalence matrix.
"""

import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower.backend.jax import tower_state
from tests.helpers.common import Stop
from tests.helpers.common import StopAt
from tests.helpers.equivalence_cases import CASES
from tests.helpers.equivalence_cases import initial_weights

ATOL = 1e-6


def _adamw_sparing_biases():
    optimizer = keras.optimizers.AdamW(0.03, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


SHARDED_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.03),
    "adamw": _adamw_sparing_biases,
    "sgd_momentum": lambda: keras.optimizers.SGD(0.3, momentum=0.9, nesterov=True),
    "clipnorm": lambda: keras.optimizers.Adam(0.03, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.3, momentum=0.5, global_clipnorm=0.05),
    "ema": lambda: keras.optimizers.Adam(0.03, use_ema=True, ema_momentum=0.5),
}

# Every optimizer on the dense model; with Adam, the model kinds whose
# step sharding could meet otherwise than the dense model's (the sparse
# embedding gradients, masked losses, synchronized BatchNormalization's
# statistics beside the update, keras.io's own JAX train_step calling
# stateless_apply itself; the other cases change only the gradients,
# which sharding takes as they come); on 4 towers, the
# pieces of a 3-wide bias are smaller than a tower's share (padding).
# These small models' calls launch ahead of their flags (the state is not
# donated: tower_state.py); `donated` runs them as a large model's are.
MATRIX = ([("dense", name, 2, 1, False) for name in sorted(SHARDED_OPTIMIZERS)]
          + [(case, "adam", 2, 1, False) for case in ("embedding", "masked_sequence", "sync_batchnorm",
                                                       "keras_io_train_step")]
          + [("dense", "global_clipnorm", 4, 3, False), ("embedding", "adamw", 4, 1, False),
             ("unequal_padding", "sgd_momentum", 4, 1, False),
             ("dense", "adam", 2, 1, True), ("embedding", "sgd_momentum", 4, 2, True)])


def _fit(case, optimizer_name, towers, weights, shard_optimizer, steps_per_execution=1):
    build, make_data = CASES[case]
    fit_kwargs = make_data()
    x, y = fit_kwargs.pop("x"), fit_kwargs.pop("y")
    batch_size = 8 if towers == 2 else 6
    with kt.distributed("mirrored", devices=list(range(towers)), shard_optimizer=shard_optimizer):
        model = build(SHARDED_OPTIMIZERS[optimizer_name]())
        if steps_per_execution > 1:
            model.compile(optimizer=model.optimizer, loss=model.loss, steps_per_execution=steps_per_execution)
        model.fit(x, y, batch_size=batch_size, epochs=0, verbose=0)
        model.set_weights(weights)
        history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0, **fit_kwargs)
    return model, history.history


@pytest.mark.parametrize("case,optimizer_name,towers,steps_per_execution,donated", MATRIX)
def test_sharded_equals_replicated(case, optimizer_name, towers, steps_per_execution, donated, monkeypatch):
    if donated:
        monkeypatch.setattr(tower_state, "LAUNCH_AHEAD_MAX_BYTES_CPU", 0)
    initial = initial_weights(case)
    whole, whole_logs = _fit(case, optimizer_name, towers, initial, False, steps_per_execution)
    sharded, sharded_logs = _fit(case, optimizer_name, towers, initial, True, steps_per_execution)
    steps = sharded.engine.tower_steps()
    assert steps.optimizer_shards() is not None and steps._launches_ahead is not donated   # as weighed at the first step
    moved = max(float(np.abs(a - w).max()) for a, w in zip(whole.get_weights(), initial))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    for a, b, w in zip(whole.get_weights(), sharded.get_weights(), whole.weights):
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0, err_msg=f"{case}/{optimizer_name}: {w.path}")
    assert len(whole.optimizer.variables) == len(sharded.optimizer.variables)
    for a, b in zip(whole.optimizer.variables, sharded.optimizer.variables):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), atol=ATOL, rtol=0,
                                   err_msg=f"{case}/{optimizer_name}: {a.path}")
    assert sorted(whole_logs) == sorted(sharded_logs)
    for key in whole_logs:
        np.testing.assert_allclose(sharded_logs[key], whole_logs[key], atol=ATOL, rtol=0,
                                   err_msg=f"{case}/{optimizer_name}: logged {key}")


def _mlp(towers, shard, optimizer=None, **compile_args):
    keras.utils.set_random_seed(1)
    with kt.distributed("mirrored", devices=list(range(towers)), shard_optimizer=shard):
        inputs = keras.Input((6,))
        h = keras.layers.Dense(33, activation="tanh")(inputs)     # 6 x 33 + 33: no N divides all
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_args)
    return model


def _data(n=48):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


@pytest.mark.parametrize("towers", [2, 4])
def test_each_device_holds_its_piece_of_every_slot(towers):
    """Read from the devices' buffers: Adam's two slots of each weight take
    ceil(size / N) values a device, the step count and rate stay whole."""
    x, y = _data()
    held = {}
    for shard in (False, True):
        model = _mlp(towers, shard)
        history = model.fit(x, y, batch_size=16 // towers, epochs=1, verbose=0,
                            callbacks=[kt.callbacks.OptimizerMemoryTracker()])
        held[shard] = kt.optimizer_state_bytes(model)
        assert history.history["optimizer_state_mb"] == [max(held[shard].values()) / 2**20]
    sizes = [6 * 33, 33, 33 * 3, 3]
    scalars = sum(np.asarray(v.value).nbytes for v in model.optimizer.variables if v.shape == ())
    assert sorted(held[False]) == sorted(held[True]) == [f"cpu:{i}" for i in range(towers)]
    assert set(held[False].values()) == {2 * 4 * sum(sizes) + scalars}
    assert set(held[True].values()) == {2 * 4 * sum(-(-s // towers) for s in sizes) + scalars}
    slots = {shard: max(held[shard].values()) - scalars for shard in held}
    assert slots[True] <= slots[False] / towers + 2 * 4 * len(sizes)   # 1/N, plus at most a value of padding a slot


def test_a_pass_whose_last_step_is_short_equals_replicated():
    """44 rows in batches of 8 on 2 towers: each pass's last step has 12
    examples, run on fewer towers (engine.py), whose state is handed on
    whole and cut again; 3 shuffled epochs, as replicated. With the
    finite check off: the update applied outright (the matrix checks)."""
    x, y = _data(44)
    state = {}
    for shard in (False, True):
        model = _mlp(2, shard, check_finite=False)
        model.fit(x, y, batch_size=8, epochs=3, verbose=0)
        state[shard] = _state(model)
    for a, b in zip(state[False], state[True]):
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)


def test_every_optimizer_it_admits_equals_replicated_on_3_towers():
    """The optimizers the matrix above does not train (optimizer_shards.
    ELEMENTWISE), on 3 towers, where every weight's pieces are padded."""
    from kerastower.backend.jax.optimizer_shards import ELEMENTWISE

    x, y = _data()
    names = sorted(set(ELEMENTWISE) - {"SGD", "Adam", "AdamW"})
    assert len(names) == 7
    for name in names:
        state = {}
        for shard in (False, True):
            model = _mlp(3, shard, optimizer=getattr(keras.optimizers, name)(0.05))
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            state[shard] = _state(model)
        for a, b in zip(state[False], state[True]):
            np.testing.assert_allclose(b, a, atol=ATOL, rtol=0, err_msg=name)


def _resumed_run(folder, towers, shard, stop_at=None):
    x, y = _data()
    model = _mlp(towers, shard)
    callbacks = [kt.callbacks.AutoResume(folder),
                 kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(folder), every_k_steps=2)]
    if stop_at is not None:
        callbacks.append(StopAt(stop_at))
    model.fit(x, y, batch_size=16 // towers, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return model


def _state(model):
    return model.get_weights() + [np.asarray(v.value) for v in model.optimizer.variables]


def test_a_sharded_checkpoint_holds_the_whole_state_and_resumes_anywhere(tmp_path):
    """Stopped at step 5 of 6 (checkpoint at step 4): resumed sharded on the
    same towers it ends bit-equal to the run that never stopped; resumed on
    4 towers, or with the state whole on every tower, within 1e-6."""
    import shutil

    whole = _resumed_run(str(tmp_path / "whole"), 2, True)
    with pytest.raises(Stop):
        _resumed_run(str(tmp_path / "stopped"), 2, True, stop_at=5)
    checkpoint = kt.checkpoint.latest_checkpoint(str(tmp_path / "stopped"))
    assert checkpoint.endswith("ckpt-00000004")
    stored = np.load(f"{checkpoint}/variables.npz")
    momentum = sorted(name for name in stored.files if name.startswith("optimizer/") and name.endswith("/momentum"))
    assert [stored[name].shape for name in momentum] == [(33,), (6, 33), (3,), (33, 3)]   # whole, not pieces
    assert all(np.abs(stored[name]).max() > 0 for name in momentum)   # the state of 4 steps
    for towers, shard, exact in ((2, True, True), (4, True, False), (2, False, False)):
        folder = str(tmp_path / f"resumed_{towers}_{shard}")
        shutil.copytree(str(tmp_path / "stopped"), folder)
        resumed = _resumed_run(folder, towers, shard)
        assert int(resumed.optimizer.iterations.numpy()) == 6
        for a, b in zip(_state(whole), _state(resumed)):
            if exact:
                np.testing.assert_array_equal(b, a)
            else:
                np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)


def test_a_nonfinite_step_is_skipped_on_every_tower_alike():
    """Tower 1's gradients hold Inf at step 2: sharded as replicated, no
    tower applies its piece, and the error names the step and the tower."""
    x, y = _data(32)
    x[13] = np.inf    # step 2 (examples 8-15), tower 1 (examples 12-15)
    found = {}
    for shard in (False, True):
        model = _mlp(2, shard, optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
        with pytest.raises(kt.NonFiniteError) as caught:
            model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        found[shard] = (caught.value.global_step, caught.value.towers, _state(model))
    assert found[True][:2] == found[False][:2] == (2, [1])
    for a, b in zip(found[False][2], found[True][2]):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("optimizer,message", [
    (lambda: keras.optimizers.Lamb(0.01), "Lamb, whose update"),
    (lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), "accumulates gradients"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)), "LossScaleOptimizer"),
])
def test_an_optimizer_that_cannot_be_sharded_exactly_is_refused(optimizer, message):
    x, y = _data(16)
    model = _mlp(2, True, optimizer=optimizer())
    with pytest.raises(kt.KerasTowerError, match=message):
        model.fit(x, y, batch_size=4, verbose=0)


def test_strategies_without_sharding_refuse_it():
    class OneProcess(kt.TowerStrategy):
        num_towers = 1

    with pytest.raises(kt.StrategyError, match='"single" and "mirrored" on JAX'):
        OneProcess("mine").shard_optimizer_state()
    block = kt.distributed("mirrored", devices=[0, 1], shard_optimizer=True)
    assert block.strategy.shards_optimizer_state and "shard_optimizer=True" in repr(block)
    assert not kt.distributed("mirrored", devices=[0, 1]).strategy.shards_optimizer_state


def test_the_docs_page_runs(tmp_path, monkeypatch):
    """docs/sharded-optimizer.md's examples (TensorFlow's docs test leaves
    this page to JAX) and the module's own."""
    import os
    import re

    from kerastower.backend.jax import optimizer_shards
    from tests.helpers.common import ROOT
    from tests.helpers.doctests import examples_of
    from tests.helpers.doctests import run_examples

    monkeypatch.chdir(tmp_path)
    page = os.path.join(ROOT, "docs", "sharded-optimizer.md")
    with open(page) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, page, "exec"), {"__name__": "docs_sharded_optimizer"})
    failures = run_examples(examples_of(optimizer_shards), tmp_path)
    assert not failures, failures[-3000:]
