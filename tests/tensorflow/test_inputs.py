"""Each tower takes whole batches of its own: proven by what each tower saw."""

import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import Recorder, id_data, mlp


def _train_ids(recorder):
    return {k[1]: v for k, v in recorder.seen.items() if k[3]}


def test_shared_dataset_each_tower_takes_its_own_successive_batches(two_towers):
    x, y = id_data(40)
    recorder = Recorder()
    model = mlp(recorder)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    model.fit(kt.DatasetInput(dataset), epochs=1, verbose=0)
    seen = _train_ids(recorder)
    assert sorted(seen) == [0, 1]
    # 10 batches of 4, two towers: tower k of step s takes batch 2s + k.
    assert seen[0] == [list(range(8 * s, 8 * s + 4)) for s in range(5)]
    assert seen[1] == [list(range(8 * s + 4, 8 * s + 8)) for s in range(5)]
    assert all(len(batch) == 4 for t in seen.values() for batch in t)


def test_plain_dataset_is_not_split_but_read_in_order_with_nothing_skipped(two_towers):
    x, y = id_data(36)
    recorder = Recorder()
    model = mlp(recorder)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), verbose=0)
    seen = _train_ids(recorder)
    order = [i for step in zip(seen[0], seen[1]) for batch in step for i in batch]
    order += [i for batch in seen[0][len(seen[1]):] for i in batch]
    assert order == list(range(36))
    # 9 batches on 2 towers: in the last step tower 1 has no batch and does
    # not run the model at all (it only joins the gradient all-reduce).
    assert len(seen[0]) == 5 and len(seen[1]) == 4


def test_per_tower_pipelines_feed_only_their_own_tower(two_towers):
    x, y = id_data(64)

    def pipeline(ctx):
        start = 1000 * (ctx.index + 1)
        ids = np.arange(start, start + 16, dtype="float32")
        features = np.repeat(ids[:, None], 4, axis=1)
        labels = np.zeros(16, "int32")
        return tf.data.Dataset.from_tensor_slices((features, labels)).batch(4)

    recorder = Recorder()
    model = mlp(recorder)
    model.fit(kt.DatasetInput(pipeline), epochs=1, verbose=0)
    seen = _train_ids(recorder)
    assert [i for b in seen[0] for i in b] == list(range(1000, 1016))
    assert [i for b in seen[1] for i in b] == list(range(2000, 2016))


def test_arrays_batch_size_is_per_tower_and_total_is_announced(two_towers, capsys):
    x, y = id_data(48)
    recorder = Recorder()
    model = mlp(recorder)
    model.fit(x, y, batch_size=6, epochs=2, shuffle=True, verbose=1)
    out = capsys.readouterr().out
    assert out.count("kerastower: 2 tower(s) x 6 examples = total batch 12") == 1
    seen = _train_ids(recorder)
    for tower in (0, 1):
        assert all(len(b) == 6 for b in seen[tower])
    # Each epoch, every example once, across both towers.
    per_epoch = len(seen[0]) // 2
    epoch_one = [i for t in (0, 1) for b in seen[t][:per_epoch] for i in b]
    assert sorted(epoch_one) == list(range(48))


def test_shared_source_stays_shared_after_a_per_tower_one(two_towers):
    """TF keeps a MirroredStrategy's per-replica input devices after one
    per-tower distribution; kerastower undoes that."""
    x, y = id_data(16)
    model = mlp()
    model.fit(kt.DummyConstantInput((x[:4], y[:4])), steps_per_epoch=1, verbose=0)
    assert model.predict(x, batch_size=16, verbose=0).shape == (16, 3)
    recorder = Recorder()
    model = mlp(recorder)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), verbose=0)
    seen = _train_ids(recorder)
    assert sorted(i for t in seen.values() for b in t for i in b) == list(range(16))


def test_towers_with_different_input_shapes_train(two_towers):
    import keras

    def images(ctx):
        side = 8 if ctx.index == 0 else 12
        rng = np.random.default_rng(ctx.index)
        pics = rng.normal(size=(32, side, side, 1)).astype("float32")
        labels = rng.integers(0, 2, 32).astype("int32")
        return tf.data.Dataset.from_tensor_slices((pics, labels)).batch(4).repeat()

    recorder = Recorder()
    inputs = keras.Input((None, None, 1))
    h = recorder(inputs)
    h = keras.layers.Conv2D(4, 3, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(kt.DatasetInput(images), steps_per_epoch=5, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    shapes = {k[1]: set(v) for k, v in recorder.shapes.items() if k[3]}
    assert shapes == {0: {(4, 8, 8, 1)}, 1: {(4, 12, 12, 1)}}
    assert any(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))


def test_generator_input_runs_ahead_of_the_step(two_towers):
    produced = []

    def batches():
        for i in range(40):
            produced.append(i)
            ids = np.full((2, 4), i, "float32")
            yield ids, np.zeros((2,), "int32")

    signature = (
        tf.TensorSpec((None, 4), tf.float32),
        tf.TensorSpec((None,), tf.int32),
    )
    recorder = Recorder()
    model = mlp(recorder)
    ahead = []

    def note_ahead(batch, logs):
        consumed = 2 * (batch + 1)
        ahead.append(len(produced) - consumed)

    import keras

    callback = keras.callbacks.LambdaCallback(on_train_batch_end=note_ahead)
    model.fit(kt.GeneratorInput(batches, signature), epochs=1, verbose=0, callbacks=[callback])
    seen = _train_ids(recorder)
    assert sorted(b[0] for t in (0, 1) for b in seen[t]) == list(range(40))
    # The background prefetch had produced batches no tower had asked for yet.
    assert max(ahead) >= 2


def test_dummy_constant_input_feeds_every_tower(two_towers):
    recorder = Recorder()
    model = mlp(recorder)
    batch = (np.full((3, 4), 7, "float32"), np.zeros((3,), "int32"))
    model.fit(kt.DummyConstantInput(batch), steps_per_epoch=4, epochs=1, verbose=0)
    seen = _train_ids(recorder)
    assert seen == {0: [[7, 7, 7]] * 4, 1: [[7, 7, 7]] * 4}


def test_bad_inputs_get_clear_errors(two_towers):
    x, y = id_data(8)
    model = mlp()
    with pytest.raises(kt.InputSourceError, match="got x of type str"):
        model.fit("data.csv", verbose=0)
    with pytest.raises(kt.InputSourceError, match="batched already"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(2), batch_size=2, verbose=0)
    with pytest.raises(kt.InputSourceError, match="same number of examples"):
        model.fit(x, y[:5], verbose=0)
    with pytest.raises(kt.InputSourceError, match="not my_gen()"):
        kt.GeneratorInput((i for i in range(3)), None)
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    with pytest.raises(kt.InputSourceError, match=r"ran out after 2 of steps_per_epoch=5.*repeat\(\)"):
        model.fit(finite, steps_per_epoch=5, verbose=0)


def test_several_inputs_as_a_list_or_tuple(two_towers):
    import keras

    rng = np.random.default_rng(0)
    x1 = rng.normal(size=(20, 3)).astype("float32")
    x2 = rng.normal(size=(20, 5)).astype("float32")
    y = rng.normal(size=(20, 1)).astype("float32")
    a, b = keras.Input((3,)), keras.Input((5,))
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
    model = kt.TowerModel([a, b], out)
    model.compile(optimizer="sgd", loss="mse")
    model.fit([x1, x2], y, batch_size=4, verbose=0)
    assert np.isfinite(model.evaluate((x1, x2), y, batch_size=4, verbose=0))
    assert model.predict([x1, x2], batch_size=3, verbose=0).shape == (20, 1)
    assert model.predict((x1, x2), batch_size=3, verbose=0).shape == (20, 1)


def test_weights_arguments_are_checked(two_towers):
    x, y = id_data(8)
    model = mlp()
    with pytest.raises(kt.InputSourceError, match="sample_weight was given without y"):
        model.fit(x, None, sample_weight=np.ones(8), verbose=0)
    with pytest.raises(kt.InputSourceError, match="class_weight and sample_weight cannot both"):
        model.fit(x, y, sample_weight=np.ones(8), class_weight={0: 1.0, 1: 1.0, 2: 1.0}, verbose=0)


def test_arrays_with_steps_per_epoch_run_as_an_endless_source(two_towers):
    x, y = id_data(16)
    recorder = Recorder()
    model = mlp(recorder)
    model.fit(x, y, batch_size=4, steps_per_epoch=3, epochs=3, verbose=0)  # 9 steps > 2 per pass
    assert model.loop.global_step == 9
    seen = _train_ids(recorder)
    first_pass = sorted(i for t in (0, 1) for b in seen[t][:2] for i in b)
    assert first_pass == list(range(16))


def test_arrays_on_cpu_towers_are_dealt_to_host_iterators(two_towers):
    """On CPU devices each tower reads its share of the arrays from a plain
    host iterator (tf.distribute's per-device prefetch costs a CPU step more
    than it saves): tower k of step s still takes batch 2s + k, and a resumed
    run skips what both towers took."""
    from kerastower.backend.tensorflow.inputs import as_input_source

    x, y = id_data(20)
    source = as_input_source(x, y, batch_size=4)
    assert two_towers.host_fed()

    def tower_ids(distributed):
        return [
            [[int(i) for i in tower[:, 0]] for tower in two_towers.tower_values(batch[0])]
            for batch in distributed
        ]

    steps = tower_ids(source.distribute(two_towers))
    assert steps == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]],
                     [[16, 17, 18, 19], []]]
    first = next(iter(source.distribute(two_towers)))[0]
    assert {v.device.split("/")[-1] for v in two_towers.tower_values(first)} == {"device:CPU:0"}
    assert tower_ids(source.distribute(two_towers, skip_batches=[1, 2])) == [
        [[12, 13, 14, 15], [16, 17, 18, 19]]]


def _composite_data():
    rng = np.random.default_rng(0)
    dense = (rng.uniform(size=(40, 6)) > 0.6) * rng.normal(size=(40, 6))
    rows = [rng.integers(1, 20, size=rng.integers(1, 6)).tolist() for _ in range(40)]
    y = rng.normal(size=(40, 1)).astype("float32")
    return tf.sparse.from_dense(dense.astype("float32")), tf.ragged.constant(rows), y


def _composite_model(kind, model_type, optimizer):
    import keras

    keras.utils.set_random_seed(2)
    if kind == "sparse":
        inputs = keras.Input((6,), sparse=True)
        features = inputs
    else:
        inputs = keras.Input((None,), ragged=True, dtype="int64")
        embedded = keras.layers.Embedding(20, 4)(inputs)
        features = keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=1))(embedded)
    model = model_type(inputs, keras.layers.Dense(1)(features))
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_sparse_and_ragged_tensors_train_as_keras_and_equal_on_two_towers(kind):
    """As Keras's array adapter takes them: rows gathered per tower (shuffled
    too), one tower equal to stock Keras, two towers to one on the joined batch."""
    sparse, ragged, y = _composite_data()
    x = sparse if kind == "sparse" else ragged
    import keras

    # Against stock Keras, SGD: both inputs give sparse gradients, whose
    # repeated indices kerastower sums before Adam squares them, where stock
    # Keras squares each (docs/training.md); between towers, Adam.
    stock = _composite_model(kind, keras.Model, keras.optimizers.SGD(0.1))
    want = stock.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    weights = {}
    for towers, batch_size in ((1, 8), (2, 4)):
        with kt.distributed("mirrored", devices=[f"/cpu:{i}" for i in range(towers)]):
            model = _composite_model(kind, kt.TowerModel, keras.optimizers.SGD(0.1))
            got = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history
            np.testing.assert_allclose(got["loss"], want, atol=1e-5, err_msg=f"{towers} towers")
            model = _composite_model(kind, kt.TowerModel, keras.optimizers.Adam(0.05))
            model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=True, verbose=0)
            weights[towers] = model.get_weights()
            predicted = model.predict(x, batch_size=batch_size, verbose=0)
            np.testing.assert_allclose(predicted, model(x), atol=1e-5)
            evaluated = model.evaluate(x, y, batch_size=batch_size, verbose=0)
            np.testing.assert_allclose(evaluated, np.mean((np.asarray(model(x)) - y) ** 2), atol=1e-5)
    for a, b in zip(weights[1], weights[2]):
        np.testing.assert_allclose(a, b, atol=1e-5)
