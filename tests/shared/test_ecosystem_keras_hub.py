"""KerasHub tasks with their preprocessors train on raw inputs on N towers, on both backends.

A KerasHub task (`keras_hub.models.Task`) preprocesses in its own `fit`,
`evaluate` and `predict`: raw strings or images go in, its preprocessor
makes the model's inputs batch by batch. `kt.TowerModel(task)` does the
same on every tower: each tower's raw batch is preprocessed as stock
KerasHub preprocesses its batch. Proven here with tiny tasks built from
configs and vocabularies written in the test (nothing is downloaded):

- a BERT text classifier on arrays of strings and on a tf.data pipeline of
  strings, a Gemma causal LM on texts of unequal lengths (so unequal
  padding, the loss weighted by the padding mask; its SentencePiece
  tokenizer costs a fraction of GPT-2's byte-pair one to trace, which
  every fit, evaluate and predict does) and a VGG image classifier on raw
  images its preprocessor resizes and scales;
- for each: 1 tower gives stock KerasHub's weights, history, evaluation
  and predictions (within 1e-5), and 2 towers x B those of stock KerasHub
  on one device on the joined 2B;
- a trained tower model saves as `.keras` and loads back with its
  preprocessor (it predicts on raw strings as before), and both the task
  and the tower model save presets KerasHub loads back;
- inputs a task cannot preprocess get a kerastower error.
"""

import functools
import io
import os
import re
import sys

import keras
import numpy as np
import pytest

import kerastower as kt

from tests.helpers.common import BACKEND
from tests.helpers.common import tower_devices

# Its module-scoped fixture starts processes once: one pytest-xdist worker runs the module.
pytestmark = pytest.mark.xdist_group("test_ecosystem_keras_hub")

keras_hub = pytest.importorskip("keras_hub")
tf = pytest.importorskip("tensorflow")  # KerasHub preprocesses in tf.data on every backend

EPOCHS = 2
BATCH = 4  # per tower

# --------------------------------------------------------------------------
# Tiny tasks, each with its preprocessor.

BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
              *"the quick brown fox jumped over a lazy dog cat sat on mat".split()]
TEXTS = np.array([
    "the quick brown fox", "a cat sat on the mat", "the lazy dog", "fox jumped over the cat",
    "a dog", "the cat sat", "quick fox jumped over a lazy brown dog", "mat",
    "the brown cat", "a lazy fox sat on a mat", "dog jumped", "the quick cat jumped over the dog",
    "brown mat", "a fox", "the dog sat on the mat", "lazy cat",
])
LABELS = np.array(["cat" in text for text in TEXTS], "int32")  # unequal counts in every batch


def bert_classifier():
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=BERT_VOCAB)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=8)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(BERT_VOCAB), num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=8, dropout=0.0)
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=preprocessor, dropout=0.0)


@functools.lru_cache(maxsize=None)
def sentencepiece_proto():
    """A SentencePiece model of the words of TEXTS, trained here (no download)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS.tolist()), model_writer=model, vocab_size=24,
        hard_vocab_limit=False, model_type="WORD", minloglevel=2, pad_id=0, bos_id=1,
        eos_id=2, unk_id=3, pad_piece="<pad>", bos_piece="<bos>", eos_piece="<eos>",
        unk_piece="<unk>", user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
    return model.getvalue()


def gemma_lm():
    tokenizer = keras_hub.models.GemmaTokenizer(proto=sentencepiece_proto())
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=8)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=1, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=4)
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=preprocessor)


IMAGES = np.random.default_rng(7).uniform(0, 255, size=(16, 12, 12, 3)).astype("float32")


def vgg_classifier():
    converter = keras_hub.layers.VGGImageConverter(image_size=(8, 8), scale=1 / 255.0)
    preprocessor = keras_hub.models.VGGImageClassifierPreprocessor(converter)
    backbone = keras_hub.models.VGGBackbone(
        stackwise_num_repeats=[1], stackwise_num_filters=[4], image_shape=(8, 8, 3))
    return keras_hub.models.VGGImageClassifier(
        backbone, num_classes=2, preprocessor=preprocessor, pooling="flatten", pooling_hidden_dim=8)


TASKS = {
    # name: (builder, x, y, metrics, weighted_metrics); a causal LM's
    # preprocessor makes its own targets, weighted by the padding mask.
    "bert": (bert_classifier, TEXTS, LABELS, ["sparse_categorical_accuracy"], None),
    "gemma": (gemma_lm, TEXTS, None, None, ["sparse_categorical_accuracy"]),
    "vgg": (vgg_classifier, IMAGES, LABELS, ["sparse_categorical_accuracy"], None),
}


@pytest.fixture(scope="module")
def initial_weights():
    """Each task's initial weights, made once: every run of a task starts from them."""
    weights = {}
    for name, (build, *_) in TASKS.items():
        keras.utils.set_random_seed(11)
        weights[name] = build().get_weights()
    return weights


def compiled(model, name):
    _, _, _, metrics, weighted_metrics = TASKS[name]
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics, weighted_metrics=weighted_metrics)
    return model


def data(name, kind, batch):
    """The task's training data as `fit` takes it: arrays, or a tf.data
    pipeline of raw examples batched by `batch`; the image classifier is
    validated too, on raw images (the others skip it: each validation
    costs a trace of the preprocessor)."""
    _, x, y, *_ = TASKS[name]
    validation = {"validation_data": (IMAGES[:6], LABELS[:6])} if name == "vgg" else {}
    if kind == "arrays":
        return {"x": x, "y": y, "batch_size": batch, **validation}
    dataset = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(batch)
    return {"x": dataset, **validation}


@pytest.fixture(scope="module")
def stock(initial_weights):
    """Stock KerasHub on one device, `stock(name, batch, evaluate)`: the
    task's own fit on arrays, then its predict (and evaluate). Each run is
    made once and shared: every test compares with it and none changes it."""
    runs = {}

    def run(name, batch, evaluate):
        if (name, batch, evaluate) not in runs:
            task = compiled(TASKS[name][0](), name)
            task.set_weights(initial_weights[name])
            # KerasHub ignores shuffle (it reads arrays in order); said here only
            # to spare its warning. The tower model is left kerastower's default.
            history = task.fit(**data(name, "arrays", batch), epochs=EPOCHS, shuffle=False,
                               verbose=0)
            runs[name, batch, evaluate] = run_results(task, history, name, evaluate)
        return runs[name, batch, evaluate]

    return run


def on_towers(name, weights, num_towers, batch, kind, evaluate):
    """`kt.TowerModel(task)` on `num_towers` towers, `batch` raw examples per tower."""
    strategy = ("single", None) if num_towers == 1 else ("mirrored", tower_devices(num_towers))
    with kt.distributed(strategy[0], devices=strategy[1]):
        task = TASKS[name][0]()
        task.set_weights(weights)
        model = compiled(kt.TowerModel(task), name)
        history = model.fit(**data(name, kind, batch), epochs=EPOCHS, verbose=0)
        results = run_results(model, history, name, evaluate)
    results["weights"] = task.get_weights()
    return results


def run_results(model, history, name, evaluate):
    """What a run left: weights, history, predictions (every call of
    evaluate and predict preprocesses anew, which costs a trace of the
    preprocessor: the 1-tower runs leave evaluate to the 2-tower ones)."""
    _, x, y, *_ = TASKS[name]
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "evaluate": (model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
                     if evaluate else {}),
        "predict": model.predict(x, batch_size=BATCH, verbose=0),
    }


def assert_same_run(got, want, start):
    moved = max(np.abs(w - w0).max() for w, w0 in zip(want["weights"], start))
    assert moved > 1e-3, f"the task did not train (its weights moved {moved})"
    assert len(got["weights"]) == len(want["weights"])
    for i, (a, b) in enumerate(zip(got["weights"], want["weights"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"weight {i}")
    assert sorted(got["history"]) == sorted(want["history"])
    for key in want["history"]:
        np.testing.assert_allclose(got["history"][key], want["history"][key], rtol=1e-5,
                                   atol=1e-5, err_msg=f"history {key}")
    assert sorted(got["evaluate"]) == sorted(want["evaluate"])
    for key in want["evaluate"]:
        np.testing.assert_allclose(got["evaluate"][key], want["evaluate"][key], rtol=1e-5,
                                   atol=1e-5, err_msg=f"evaluate {key}")
    assert got["predict"].shape == want["predict"].shape
    np.testing.assert_allclose(got["predict"], want["predict"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,kind", [("bert", "arrays"), ("gemma", "arrays"), ("vgg", "arrays")])
def test_one_tower_gives_stock_keras_hub(name, kind, initial_weights, stock):
    start = initial_weights[name]
    assert_same_run(on_towers(name, start, 1, BATCH, kind, evaluate=False),
                    stock(name, BATCH, evaluate=False), start)


@pytest.mark.parametrize("name,kind", [("bert", "tf.data"), ("gemma", "arrays"), ("vgg", "tf.data")])
def test_two_towers_equal_one_device_on_the_joined_batch(name, kind, initial_weights, stock):
    """2 towers x B raw examples (tower k takes the k-th next batch) against
    stock KerasHub on the joined 2B, whose batches are the towers' joined."""
    start = initial_weights[name]
    assert_same_run(on_towers(name, start, 2, BATCH, kind, evaluate=True),
                    stock(name, 2 * BATCH, evaluate=True), start)


def test_raw_arrays_repeat_for_steps_per_epoch():
    """With steps_per_epoch an epoch is only a callback period: raw arrays
    go on pass after pass (in order, each batch preprocessed), as arrays do."""
    with kt.distributed("mirrored", devices=tower_devices(2)):
        model = compiled(kt.TowerModel(vgg_classifier()), "vgg")
        history = model.fit(IMAGES, LABELS, batch_size=BATCH, steps_per_epoch=3, epochs=2,
                            verbose=0)  # 4 batches a pass, 2 a step: 3 steps cross a pass
        assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
        assert len(history.history["loss"]) == 2


def test_the_padding_differs_between_the_towers_batches():
    """The causal LM case above is worth something only if the towers'
    batches hold unequal numbers of tokens (so a token-weighted loss is no
    mean of the towers' means)."""
    preprocessor = gemma_lm().preprocessor
    tokens = [int(np.sum(keras.ops.convert_to_numpy(preprocessor(tf.constant(TEXTS[i:i + BATCH]))[2])))
              for i in range(0, len(TEXTS), BATCH)]
    assert len(set(tokens)) > 1, tokens


# --------------------------------------------------------------------------
# What the tower model is, and saving it.


def test_the_tower_model_carries_the_task_and_its_compile(tmp_path):
    with kt.distributed("mirrored", devices=tower_devices(2)):
        task = bert_classifier()  # KerasHub compiles a task when it makes it
        model = kt.TowerModel(task)
        assert isinstance(model, kt.TowerModel)
        assert model.task is task and model.preprocessor is task.preprocessor
        assert model.compiled
        assert model.optimizer is not task.optimizer and not model.optimizer.built
        assert model.get_compile_config() == task.get_compile_config()
        assert {id(w) for w in model.weights} >= {id(w) for w in task.weights}


def test_a_saved_tower_model_loads_with_its_preprocessor_and_presets_save(tmp_path, initial_weights):
    with kt.distributed("mirrored", devices=tower_devices(2)):
        task = bert_classifier()
        task.set_weights(initial_weights["bert"])
        model = compiled(kt.TowerModel(task), "bert")
        model.train_on_batch(TEXTS[:2 * BATCH], LABELS[:2 * BATCH])  # raw too: a tower's half each
        want = model.predict(TEXTS, batch_size=BATCH, verbose=0)
        compile_config = model.get_compile_config()
        weights = task.get_weights()
        path = str(tmp_path / "tower.keras")
        model.save(path)
        task.save_to_preset(str(tmp_path / "task_preset"))
        model.save_to_preset(str(tmp_path / "tower_preset"))

    with kt.distributed("mirrored", devices=tower_devices(2)):
        loaded = keras.saving.load_model(path)
        assert type(loaded) is type(model) and loaded.num_towers == 2
        assert isinstance(loaded.task, keras_hub.models.BertTextClassifier)
        assert isinstance(loaded.preprocessor, keras_hub.models.BertTextClassifierPreprocessor)
        assert loaded.get_compile_config() == compile_config
        np.testing.assert_allclose(loaded.predict(TEXTS, batch_size=BATCH, verbose=0), want,
                                   rtol=1e-5, atol=1e-5)

    # A preset holds the trained weights and the preprocessor (its vocabulary).
    features = task.preprocessor(tf.constant(TEXTS))
    for preset in ("task_preset", "tower_preset"):
        restored = keras_hub.models.TextClassifier.from_preset(str(tmp_path / preset))
        assert isinstance(restored, keras_hub.models.BertTextClassifier)
        for got, saved in zip(restored.get_weights(), weights):
            np.testing.assert_array_equal(got, saved, err_msg=preset)
        for key, value in restored.preprocessor(tf.constant(TEXTS)).items():
            np.testing.assert_array_equal(value, features[key], err_msg=f"{preset}: {key}")


# --------------------------------------------------------------------------
# What a task cannot take.


def test_a_source_the_preprocessor_cannot_map_gets_a_kerastower_error():
    class RawBatches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return TEXTS[index * BATCH:(index + 1) * BATCH], LABELS[index * BATCH:(index + 1) * BATCH]

    def raw_batches():
        yield TEXTS[:BATCH], LABELS[:BATCH]

    sources = [raw_batches(), RawBatches()]
    if BACKEND == "tensorflow":
        sources.append(kt.DatasetInput(tf.data.Dataset.from_tensor_slices((TEXTS, LABELS)).batch(BATCH)))
    with kt.distributed("single"):
        model = compiled(kt.TowerModel(bert_classifier()), "bert")
        for source in sources:
            with pytest.raises(kt.InputSourceError, match="preprocessor") as raised:
                model.fit(source, verbose=0)
            assert type(source).__name__ in str(raised.value)
        with pytest.raises(kt.InputSourceError, match="a single one"):
            model.predict(np.array("the cat"), verbose=0)


def test_without_a_preprocessor_the_task_takes_its_inputs_as_before(initial_weights):
    with kt.distributed("mirrored", devices=tower_devices(2)):
        task = bert_classifier()
        task.set_weights(initial_weights["bert"])
        features = keras.tree.map_structure(keras.ops.convert_to_numpy,
                                            task.preprocessor(tf.constant(TEXTS)))
        want = keras.ops.convert_to_numpy(task(features))
        task.preprocessor = None
        model = kt.TowerModel(task)
        assert model.preprocessor is None
        np.testing.assert_allclose(model.predict(features, batch_size=BATCH, verbose=0), want,
                                   rtol=1e-5, atol=1e-5)


def test_kerastower_needs_no_keras_hub(monkeypatch):
    """kerastower imports keras_hub nowhere: a task exists only once the
    user imported it, and other models are wrapped as they always were."""
    root = os.path.dirname(kt.__file__)
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    source = f.read()
                assert not re.search(r"^\s*(import|from)\s+keras_hub", source, flags=re.M), name
    monkeypatch.delitem(sys.modules, "keras_hub")
    inputs = keras.Input((3,))
    with kt.distributed("single"):
        model = kt.TowerModel(keras.Model(inputs, keras.layers.Dense(1)(inputs)))
    assert type(model).__name__ == "FunctionalTowerModel"
