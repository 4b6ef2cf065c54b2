"""GAN trainers, as in tensorpack's GAN examples.

The model says what a GAN is (`kt.GANModel`: generator, discriminator, their
losses and optimizers); the trainer says how an iteration runs them:
`GANTrainer` takes one generator step then one discriminator step per
iteration, `SeparateGANTrainer` runs each on its own period. Both are
data-parallel: every tower takes its own batch of real samples and the
gradients are summed over towers before each optimizer applies them.

```python
import keras, numpy as np, tensorflow as tf, kerastower as kt

generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
gan = kt.GANModel(generator, discriminator)
gan.compile(g_optimizer=keras.optimizers.Adam(1e-3), d_optimizer=keras.optimizers.Adam(1e-3))
real = tf.data.Dataset.from_tensor_slices(np.random.normal(3, 1, (256, 2)).astype("float32"))
history = kt.GANTrainer(gan, real.batch(32).repeat()).train(steps_per_epoch=8, verbose=0)
print(history.history["d_loss"], history.history["g_loss"])
```
"""

import keras

from kerastower import _compat
from kerastower.arguments import integer
from kerastower.model import TowerModel
from kerastower.trainers.base import Trainer
from kerastower.trainers.minimize import minimize

__all__ = ["GANModel", "GANTrainer", "SeparateGANTrainer"]


class GANModel(TowerModel):
    """A generator and a discriminator, trained against each other.

    The place to define a GAN: pass the two networks, override the loss
    methods to change the losses, and give each its optimizer in `compile`.
    The default losses are the non-saturating ones of Goodfellow et al.

    Args:
        generator: a Keras model mapping noise `(batch, latent_dim)` to samples.
        discriminator: a Keras model mapping samples to one logit per sample.
        latent_dim: the noise size; default: the generator's input size.
        seed: seeds the noise (each tower draws its own).

    Examples:
        >>> import tensorflow as tf
        >>> generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> gan = kt.GANModel(generator, discriminator)
        >>> gan.compile(g_optimizer="adam", d_optimizer="adam")
        >>> images = tf.data.Dataset.from_tensor_slices(np.ones((64, 2), "float32")).batch(8).repeat()
        >>> _ = kt.GANTrainer(gan, kt.DatasetInput(images)).train(steps_per_epoch=2, max_epoch=2, verbose=0)
        >>> tuple(gan.generate(16).shape)
        (16, 2)
    """

    def __init__(self, generator, discriminator, latent_dim=None, seed=None, **kwargs):
        super().__init__(**kwargs)
        if latent_dim is None:
            try:
                latent_dim = int(generator.inputs[0].shape[-1])
            except (AttributeError, ValueError, TypeError, IndexError):
                raise ValueError(
                    "GANModel: pass latent_dim, or build the generator on a "
                    "keras.Input((latent_dim,)) so its input size is known."
                ) from None
        self.generator = generator
        self.discriminator = discriminator
        self.latent_dim = latent_dim
        self.noise_seed = keras.random.SeedGenerator(seed)
        # generate() draws outside the towers: from a stream of its own, or
        # it would set every tower's copy of the training stream alike.
        self.sample_seed = keras.random.SeedGenerator(None if seed is None else seed + 1)
        self.g_optimizer = None
        self.d_optimizer = None

    def compile(self, g_optimizer, d_optimizer, **kwargs):
        """Gives the generator and the discriminator each its optimizer
        (instances or names, as `keras.optimizers.get` takes)."""
        g_optimizer = keras.optimizers.get(g_optimizer)
        d_optimizer = keras.optimizers.get(d_optimizer)
        if g_optimizer is d_optimizer:
            raise ValueError(
                "GANModel.compile: g_optimizer and d_optimizer are the same "
                f"optimizer object ({g_optimizer.name}); each keeps slots for its own "
                "variables, so give each side a new optimizer instance."
            )
        super().compile(optimizer=None, **kwargs)
        self.g_optimizer = g_optimizer
        self.d_optimizer = d_optimizer

    def build_optimizers(self):
        """Creates both optimizers' slots (GAN trainers call it at set-up)."""
        if self.g_optimizer is None or self.d_optimizer is None:
            raise ValueError(
                "GANModel has no optimizers: call gan.compile(g_optimizer=..., "
                "d_optimizer=...) before training."
            )
        self.g_optimizer.build(self.generator.trainable_variables)
        self.d_optimizer.build(self.discriminator.trainable_variables)

    def call(self, noise, training=False):
        return self.generator(noise, training=training)

    def generate(self, num_samples):
        """`num_samples` samples from the generator, as a numpy array."""
        noise = keras.random.normal((num_samples, self.latent_dim), seed=self.sample_seed)
        return keras.ops.convert_to_numpy(self.generator(noise, training=False))

    # What a GAN is: override these.

    def real_samples(self, data):
        """The real samples in a tower's batch: its x."""
        x, _, _ = _compat.unpack_x_y_sample_weight(data)
        return x

    def sample_noise(self, data):
        """Noise for the generator, one row per real sample of `data`."""
        real = keras.tree.flatten(self.real_samples(data))[0]
        return keras.random.normal((keras.ops.shape(real)[0], self.latent_dim), seed=self.noise_seed)

    def generator_loss(self, fake_logits):
        """The generator wants its samples called real: -log D(G(z))."""
        return keras.ops.mean(keras.ops.softplus(-fake_logits))

    def discriminator_loss(self, real_logits, fake_logits):
        """The discriminator tells real (1) from generated (0)."""
        return keras.ops.mean(keras.ops.softplus(-real_logits)) + keras.ops.mean(
            keras.ops.softplus(fake_logits)
        )

    # Tower steps: one tower's update on its own batch (kt.minimize averages
    # the gradients over the towers before the optimizer applies them).

    def generator_tower_step(self, data):
        """One data-parallel generator update; returns {"g_loss": ...}."""
        noise = self.sample_noise(data)

        def loss():
            fake = self.generator(noise, training=True)
            return self.generator_loss(self.discriminator(fake, training=True))

        return {"g_loss": minimize(self.g_optimizer, loss, self.generator.trainable_variables)}

    def discriminator_tower_step(self, data):
        """One data-parallel discriminator update; returns {"d_loss": ...}."""
        fake = self.generator(self.sample_noise(data), training=True)
        real = self.real_samples(data)

        def loss():
            real_logits = self.discriminator(real, training=True)
            fake_logits = self.discriminator(fake, training=True)
            return self.discriminator_loss(real_logits, fake_logits)

        return {"d_loss": minimize(self.d_optimizer, loss, self.discriminator.trainable_variables)}


class GANTrainer(Trainer):
    """Per iteration: one generator step, then one discriminator step.

    Both steps use the iteration's batches (one per tower) and are one
    hooked run, whose outputs are {"g_loss", "d_loss"}, each the
    example-weighted mean over towers.

    Args:
        model: a compiled `kt.GANModel`.
        input: real samples, batched per tower and endless: a
            `kt.InputSource` or `tf.data.Dataset`.

    Examples:
        >>> import tensorflow as tf
        >>> gan = kt.GANModel(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
        ...                   keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
        >>> gan.compile(g_optimizer=keras.optimizers.Adam(1e-3), d_optimizer=keras.optimizers.Adam(1e-3))
        >>> real = tf.data.Dataset.from_tensor_slices(np.ones((64, 2), "float32")).batch(8).repeat()
        >>> history = kt.GANTrainer(gan, real).train(steps_per_epoch=4, verbose=0)
        >>> sorted(history.history)
        ['d_loss', 'g_loss']
    """

    def __init__(self, model, input):
        if not isinstance(model, GANModel):
            raise TypeError(
                f"{type(self).__name__} trains a kt.GANModel; got {type(model).__name__}."
            )
        super().__init__(model, input)

    def _setup(self):
        self.model.build_optimizers()

    def run_step(self):
        return self.hooked_run(self.generator_then_discriminator, self.next_batches())

    @Trainer.tower_function
    def generator_then_discriminator(self, data):
        logs = self.model.generator_tower_step(data)
        logs.update(self.model.discriminator_tower_step(data))
        return logs


class SeparateGANTrainer(GANTrainer):
    """Runs the discriminator every `d_period` and the generator every
    `g_period` iterations, each as its own hooked run.

    An iteration takes one batch per tower; the discriminator step (when due)
    runs first, then the generator step. "Due" means `global_step % period
    == 0`, where `global_step` counts iterations from 0, so in N iterations
    the discriminator takes ceil(N / d_period) steps and the generator
    ceil(N / g_period).

    Args:
        model: a compiled `kt.GANModel`.
        input: real samples, batched per tower and endless.
        d_period: iterations between discriminator steps.
        g_period: iterations between generator steps.

    Examples:
        >>> import tensorflow as tf
        >>> gan = kt.GANModel(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
        ...                   keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
        >>> gan.compile(g_optimizer=keras.optimizers.Adam(1e-3), d_optimizer=keras.optimizers.Adam(1e-3))
        >>> real = tf.data.Dataset.from_tensor_slices(np.ones((64, 2), "float32")).batch(8).repeat()
        >>> history = kt.SeparateGANTrainer(gan, real, d_period=1, g_period=2).train(steps_per_epoch=4, verbose=0)
        >>> sorted(history.history)
        ['d_loss', 'g_loss']
    """

    def __init__(self, model, input, d_period=1, g_period=1):
        d_period = integer(d_period, "d_period", "SeparateGANTrainer", minimum=1)
        g_period = integer(g_period, "g_period", "SeparateGANTrainer", minimum=1)
        super().__init__(model, input)
        self.d_period = d_period
        self.g_period = g_period

    def run_step(self):
        data = self.next_batches()
        if self.global_step % self.d_period == 0:
            self.hooked_run(self.discriminator_step, data)
        if self.global_step % self.g_period == 0:
            self.hooked_run(self.generator_step, data)

    @Trainer.tower_function
    def discriminator_step(self, data):
        return self.model.discriminator_tower_step(data)

    @Trainer.tower_function
    def generator_step(self, data):
        return self.model.generator_tower_step(data)
