"""Ten programs in the style of keras.io's custom-fit and generative
examples, each written once over its base class (`keras.Model` or
`kt.TowerModel`), so that one test runs the same code under both.

Each `program_<name>(base)` returns a `Program`: the model, compiled as the
keras.io example compiles it, and how to train it (`fit` arguments, per
tower). The models are small (seconds to train); their shape follows the
examples: a VAE without `call()`, GANs with two to four optimizers that
build on first use, a gradient penalty (a tape inside a tape), a
`compute_loss` override, an endpoint layer adding its own loss, a custom
`test_step`, sample weights read with `keras.utils.unpack_x_y_sample_weight`.

Random numbers come from `keras.random` with a `SeedGenerator`, as in the
examples' Keras 3 versions: the same seed gives the same draws on one
tower in stock Keras and in kerastower. (keras.io's WGAN-GP draws with
`tf.random.normal` without a seed, whose op seed depends on the graph it
is traced into: no two programs, stock Keras included, draw alike there.)
"""

import collections

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

Program = collections.namedtuple("Program", ["model", "fit", "deterministic", "evaluate"],
                                 defaults=[None])
Program.__doc__ = """A compiled model, `fit(model, batch_size, **fit_arguments)`
training it (returning the History), whether N towers equal one device on the joined
batches (no random draws), and optionally `evaluate(model, batch_size)`."""

RNG = np.random.default_rng(0)
IMAGES = RNG.uniform(size=(32, 8, 8, 1)).astype("float32")
VECTORS = RNG.uniform(size=(32, 6)).astype("float32")
LABELS = RNG.integers(0, 3, size=(32,)).astype("int32")


def _arrays_fit(*data, epochs=2, **kwargs):
    """fit on arrays, shuffled (Keras's default) from the test's seed."""
    def fit(model, batch_size, **overrides):
        arguments = dict(batch_size=batch_size, epochs=epochs, verbose=0, **kwargs)
        return model.fit(*data, **dict(arguments, **overrides))
    return fit


def _dataset_fit(*data, epochs=2):
    def fit(model, batch_size, **overrides):
        dataset = tf.data.Dataset.from_tensor_slices(data if len(data) > 1 else data[0])
        return model.fit(dataset.batch(batch_size), **dict(dict(epochs=epochs, verbose=0), **overrides))
    return fit


# -- variational autoencoder (keras.io/examples/generative/vae) ---------------

class Sampling(layers.Layer):
    """z = z_mean + exp(z_log_var / 2) * epsilon."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def program_vae(base):
    latent_dim = 2
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Flatten()(x)
    x = layers.Dense(8, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(4 * 4 * 4, activation="relu")(latent_inputs)
    x = layers.Reshape((4, 4, 4))(x)
    x = layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

    class VAE(base):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
                kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
                kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {
                "loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result(),
            }

    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam())
    return Program(vae, _arrays_fit(IMAGES), deterministic=False)


# -- DCGAN (keras.io/examples/generative/dcgan_overriding_train_step) --------

class GAN:
    """keras.io's GAN class, its base chosen when the program is made."""

    @staticmethod
    def over(base):
        class GAN(base):
            def __init__(self, discriminator, generator, latent_dim):
                super().__init__()
                self.discriminator = discriminator
                self.generator = generator
                self.latent_dim = latent_dim
                self.seed_generator = keras.random.SeedGenerator(1337)

            def compile(self, d_optimizer, g_optimizer, loss_fn):
                super().compile()
                self.d_optimizer = d_optimizer
                self.g_optimizer = g_optimizer
                self.loss_fn = loss_fn
                self.d_loss_metric = keras.metrics.Mean(name="d_loss")
                self.g_loss_metric = keras.metrics.Mean(name="g_loss")

            @property
            def metrics(self):
                return [self.d_loss_metric, self.g_loss_metric]

            def train_step(self, real_images):
                batch_size = ops.shape(real_images)[0]
                random_latent_vectors = keras.random.normal(
                    shape=(batch_size, self.latent_dim), seed=self.seed_generator)
                generated_images = self.generator(random_latent_vectors)
                combined_images = ops.concatenate([generated_images, real_images], axis=0)
                labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
                with tf.GradientTape() as tape:
                    predictions = self.discriminator(combined_images)
                    d_loss = self.loss_fn(labels, predictions)
                grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
                self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

                random_latent_vectors = keras.random.normal(
                    shape=(batch_size, self.latent_dim), seed=self.seed_generator)
                misleading_labels = ops.zeros((batch_size, 1))
                with tf.GradientTape() as tape:
                    predictions = self.discriminator(self.generator(random_latent_vectors))
                    g_loss = self.loss_fn(misleading_labels, predictions)
                grads = tape.gradient(g_loss, self.generator.trainable_weights)
                self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

                self.d_loss_metric.update_state(d_loss)
                self.g_loss_metric.update_state(g_loss)
                return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

        return GAN


def _conv_discriminator(channels=1):
    return keras.Sequential([
        keras.Input(shape=(8, 8, channels)),
        layers.Conv2D(4, 3, strides=2, padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Flatten(),
        layers.Dense(1),
    ], name="discriminator")


def _conv_generator(latent_dim, channels=1):
    return keras.Sequential([
        keras.Input(shape=(latent_dim,)),
        layers.Dense(4 * 4 * 4),
        layers.Reshape((4, 4, 4)),
        layers.Conv2DTranspose(4, 3, strides=2, padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(channels, 3, padding="same", activation="sigmoid"),
    ], name="generator")


def program_dcgan(base):
    latent_dim = 4
    gan = GAN.over(base)(discriminator=_conv_discriminator(), generator=_conv_generator(latent_dim),
                         latent_dim=latent_dim)
    gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
                g_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return Program(gan, _dataset_fit(IMAGES), deterministic=False)


# -- WGAN-GP (keras.io/examples/generative/wgan_gp) ----------------------------

def program_wgan_gp(base):
    class WGAN(base):
        def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=2,
                     gp_weight=10.0):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.d_steps = discriminator_extra_steps
            self.gp_weight = gp_weight
            self.seed_generator = keras.random.SeedGenerator(7)

        def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.d_loss_fn = d_loss_fn
            self.g_loss_fn = g_loss_fn

        def gradient_penalty(self, batch_size, real_images, fake_images):
            alpha = keras.random.normal([batch_size, 1, 1, 1], 0.0, 1.0, seed=self.seed_generator)
            interpolated = real_images + alpha * (fake_images - real_images)
            with tf.GradientTape() as gp_tape:
                gp_tape.watch(interpolated)
                pred = self.discriminator(interpolated, training=True)
            grads = gp_tape.gradient(pred, [interpolated])[0]
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
            return tf.reduce_mean((norm - 1.0) ** 2)

        def train_step(self, real_images):
            if isinstance(real_images, tuple):
                real_images = real_images[0]
            batch_size = tf.shape(real_images)[0]
            for _ in range(self.d_steps):
                random_latent_vectors = keras.random.normal(
                    shape=(batch_size, self.latent_dim), seed=self.seed_generator)
                with tf.GradientTape() as tape:
                    fake_images = self.generator(random_latent_vectors, training=True)
                    fake_logits = self.discriminator(fake_images, training=True)
                    real_logits = self.discriminator(real_images, training=True)
                    d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                    gp = self.gradient_penalty(batch_size, real_images, fake_images)
                    d_loss = d_cost + gp * self.gp_weight
                d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
                self.d_optimizer.apply_gradients(zip(d_gradient, self.discriminator.trainable_variables))
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                generated_images = self.generator(random_latent_vectors, training=True)
                gen_img_logits = self.discriminator(generated_images, training=True)
                g_loss = self.g_loss_fn(gen_img_logits)
            gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
            self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
            return {"d_loss": d_loss, "g_loss": g_loss}

    def discriminator_loss(real_img, fake_img):
        return tf.reduce_mean(fake_img) - tf.reduce_mean(real_img)

    def generator_loss(fake_img):
        return -tf.reduce_mean(fake_img)

    latent_dim = 4
    wgan = WGAN(discriminator=_conv_discriminator(), generator=_conv_generator(latent_dim),
                latent_dim=latent_dim)
    wgan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
                 g_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
                 g_loss_fn=generator_loss, d_loss_fn=discriminator_loss)
    return Program(wgan, _arrays_fit(IMAGES), deterministic=False)


# -- CycleGAN (keras.io/examples/generative/cyclegan), four models -------------

def program_cyclegan(base):
    class CycleGan(base):
        def __init__(self, generator_G, generator_F, discriminator_X, discriminator_Y,
                     lambda_cycle=10.0, lambda_identity=0.5):
            super().__init__()
            self.gen_G = generator_G
            self.gen_F = generator_F
            self.disc_X = discriminator_X
            self.disc_Y = discriminator_Y
            self.lambda_cycle = lambda_cycle
            self.lambda_identity = lambda_identity

        def compile(self, gen_G_optimizer, gen_F_optimizer, disc_X_optimizer, disc_Y_optimizer,
                    gen_loss_fn, disc_loss_fn):
            super().compile()
            self.gen_G_optimizer = gen_G_optimizer
            self.gen_F_optimizer = gen_F_optimizer
            self.disc_X_optimizer = disc_X_optimizer
            self.disc_Y_optimizer = disc_Y_optimizer
            self.generator_loss_fn = gen_loss_fn
            self.discriminator_loss_fn = disc_loss_fn
            self.cycle_loss_fn = keras.losses.MeanAbsoluteError()
            self.identity_loss_fn = keras.losses.MeanAbsoluteError()

        def train_step(self, batch_data):
            real_x, real_y = batch_data
            with tf.GradientTape(persistent=True) as tape:
                fake_y = self.gen_G(real_x, training=True)
                fake_x = self.gen_F(real_y, training=True)
                cycled_x = self.gen_F(fake_y, training=True)
                cycled_y = self.gen_G(fake_x, training=True)
                same_x = self.gen_F(real_x, training=True)
                same_y = self.gen_G(real_y, training=True)
                disc_real_x = self.disc_X(real_x, training=True)
                disc_fake_x = self.disc_X(fake_x, training=True)
                disc_real_y = self.disc_Y(real_y, training=True)
                disc_fake_y = self.disc_Y(fake_y, training=True)
                gen_G_loss = self.generator_loss_fn(disc_fake_y)
                gen_F_loss = self.generator_loss_fn(disc_fake_x)
                cycle_loss_G = self.cycle_loss_fn(real_y, cycled_y) * self.lambda_cycle
                cycle_loss_F = self.cycle_loss_fn(real_x, cycled_x) * self.lambda_cycle
                id_loss_G = self.identity_loss_fn(real_y, same_y) * self.lambda_cycle * self.lambda_identity
                id_loss_F = self.identity_loss_fn(real_x, same_x) * self.lambda_cycle * self.lambda_identity
                total_loss_G = gen_G_loss + cycle_loss_G + id_loss_G
                total_loss_F = gen_F_loss + cycle_loss_F + id_loss_F
                disc_X_loss = self.discriminator_loss_fn(disc_real_x, disc_fake_x)
                disc_Y_loss = self.discriminator_loss_fn(disc_real_y, disc_fake_y)
            grads_G = tape.gradient(total_loss_G, self.gen_G.trainable_variables)
            grads_F = tape.gradient(total_loss_F, self.gen_F.trainable_variables)
            disc_X_grads = tape.gradient(disc_X_loss, self.disc_X.trainable_variables)
            disc_Y_grads = tape.gradient(disc_Y_loss, self.disc_Y.trainable_variables)
            self.gen_G_optimizer.apply_gradients(zip(grads_G, self.gen_G.trainable_variables))
            self.gen_F_optimizer.apply_gradients(zip(grads_F, self.gen_F.trainable_variables))
            self.disc_X_optimizer.apply_gradients(zip(disc_X_grads, self.disc_X.trainable_variables))
            self.disc_Y_optimizer.apply_gradients(zip(disc_Y_grads, self.disc_Y.trainable_variables))
            return {"G_loss": total_loss_G, "F_loss": total_loss_F,
                    "D_X_loss": disc_X_loss, "D_Y_loss": disc_Y_loss}

    def generator(name):
        inputs = keras.Input((8, 8, 1))
        x = layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
        return keras.Model(inputs, layers.Conv2D(1, 3, padding="same", activation="tanh")(x), name=name)

    def discriminator(name):
        inputs = keras.Input((8, 8, 1))
        x = layers.Conv2D(4, 3, strides=2, padding="same")(inputs)
        x = layers.LeakyReLU(negative_slope=0.2)(x)
        return keras.Model(inputs, layers.Conv2D(1, 3, padding="same")(x), name=name)

    adv_loss_fn = keras.losses.MeanSquaredError()

    def generator_loss_fn(fake):
        return adv_loss_fn(ops.ones_like(fake), fake)

    def discriminator_loss_fn(real, fake):
        return (adv_loss_fn(ops.ones_like(real), real) + adv_loss_fn(ops.zeros_like(fake), fake)) * 0.5

    model = CycleGan(generator("gen_G"), generator("gen_F"), discriminator("disc_X"), discriminator("disc_Y"))
    model.compile(*(keras.optimizers.Adam(learning_rate=2e-4, beta_1=0.5) for _ in range(4)),
                  gen_loss_fn=generator_loss_fn, disc_loss_fn=discriminator_loss_fn)
    return Program(model, _dataset_fit(IMAGES, IMAGES[::-1] * 2 - 1), deterministic=True)


# -- conditional GAN (keras.io/examples/generative/conditional_gan) ----------

def program_conditional_gan(base):
    num_classes, latent_dim = 3, 4

    class ConditionalGAN(base):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.seed_generator = keras.random.SeedGenerator(1337)
            self.gen_loss_tracker = keras.metrics.Mean(name="generator_loss")
            self.disc_loss_tracker = keras.metrics.Mean(name="discriminator_loss")

        @property
        def metrics(self):
            return [self.gen_loss_tracker, self.disc_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def train_step(self, data):
            real_images, one_hot_labels = data
            batch_size = ops.shape(real_images)[0]
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            random_vector_labels = ops.concatenate([random_latent_vectors, one_hot_labels], axis=1)
            generated = self.generator(random_vector_labels)
            fake_image_and_labels = ops.concatenate([generated, one_hot_labels], -1)
            real_image_and_labels = ops.concatenate([real_images, one_hot_labels], -1)
            combined = ops.concatenate([fake_image_and_labels, real_image_and_labels], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            random_vector_labels = ops.concatenate([random_latent_vectors, one_hot_labels], axis=1)
            misleading_labels = ops.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                fake_images = self.generator(random_vector_labels)
                fake_image_and_labels = ops.concatenate([fake_images, one_hot_labels], -1)
                g_loss = self.loss_fn(misleading_labels, self.discriminator(fake_image_and_labels))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.gen_loss_tracker.update_state(g_loss)
            self.disc_loss_tracker.update_state(d_loss)
            return {"g_loss": self.gen_loss_tracker.result(), "d_loss": self.disc_loss_tracker.result()}

    discriminator = keras.Sequential([keras.Input((6 + num_classes,)), layers.Dense(8),
                                      layers.LeakyReLU(negative_slope=0.2), layers.Dense(1)])
    generator = keras.Sequential([keras.Input((latent_dim + num_classes,)), layers.Dense(8),
                                  layers.LeakyReLU(negative_slope=0.2), layers.Dense(6, activation="sigmoid")])
    cond_gan = ConditionalGAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
    cond_gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                     g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                     loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    one_hot = keras.utils.to_categorical(LABELS, num_classes).astype("float32")
    return Program(cond_gan, _dataset_fit(VECTORS, one_hot), deterministic=False)


# -- knowledge distillation (keras.io/examples/vision/knowledge_distillation) -

def program_distillation(base):
    class Distiller(base):
        def __init__(self, student, teacher):
            super().__init__()
            self.teacher = teacher
            self.student = student

        def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                    temperature=3):
            super().compile(optimizer=optimizer, metrics=metrics)
            self.student_loss_fn = student_loss_fn
            self.distillation_loss_fn = distillation_loss_fn
            self.alpha = alpha
            self.temperature = temperature

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
            teacher_pred = self.teacher(x, training=False)
            student_loss = self.student_loss_fn(y, y_pred)
            distillation_loss = self.distillation_loss_fn(
                ops.softmax(teacher_pred / self.temperature, axis=1),
                ops.softmax(y_pred / self.temperature, axis=1),
            ) * (self.temperature ** 2)
            return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

        def call(self, x):
            return self.student(x)

    teacher = keras.Sequential([keras.Input((6,)), layers.Dense(16, activation="relu"), layers.Dense(3)],
                               name="teacher")
    student = keras.Sequential([keras.Input((6,)), layers.Dense(4, activation="relu"), layers.Dense(3)],
                               name="student")
    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(optimizer=keras.optimizers.Adam(),
                      metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)

    def evaluate(model, batch_size):
        return model.evaluate(VECTORS, LABELS, batch_size=batch_size, verbose=0, return_dict=True)

    return Program(distiller, _arrays_fit(VECTORS, LABELS), deterministic=True, evaluate=evaluate)


# -- contrastive learning on two augmented views (keras.io's SimCLR) ---------

def program_contrastive(base):
    temperature, width = 0.1, 8

    class ContrastiveModel(base):
        def __init__(self):
            super().__init__()
            self.seed_generator = keras.random.SeedGenerator(42)
            self.encoder = keras.Sequential([keras.Input((6,)), layers.Dense(width, activation="relu")],
                                            name="encoder")
            self.projection_head = keras.Sequential(
                [keras.Input((width,)), layers.Dense(width, activation="relu"), layers.Dense(width)],
                name="projection_head")
            self.linear_probe = keras.Sequential([keras.Input((width,)), layers.Dense(3)], name="linear_probe")

        def compile(self, contrastive_optimizer, probe_optimizer, **kwargs):
            super().compile(**kwargs)
            self.contrastive_optimizer = contrastive_optimizer
            self.probe_optimizer = probe_optimizer
            self.probe_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            self.contrastive_loss_tracker = keras.metrics.Mean(name="c_loss")
            self.contrastive_accuracy = keras.metrics.SparseCategoricalAccuracy(name="c_acc")
            self.probe_loss_tracker = keras.metrics.Mean(name="p_loss")
            self.probe_accuracy = keras.metrics.SparseCategoricalAccuracy(name="p_acc")

        @property
        def metrics(self):
            return [self.contrastive_loss_tracker, self.contrastive_accuracy,
                    self.probe_loss_tracker, self.probe_accuracy]

        def augment(self, x):
            return x + 0.1 * keras.random.normal(ops.shape(x), seed=self.seed_generator)

        def contrastive_loss(self, projections_1, projections_2):
            projections_1 = ops.normalize(projections_1, axis=1)
            projections_2 = ops.normalize(projections_2, axis=1)
            similarities = ops.matmul(projections_1, ops.transpose(projections_2)) / temperature
            batch_size = ops.shape(projections_1)[0]
            contrastive_labels = ops.arange(batch_size)
            self.contrastive_accuracy.update_state(contrastive_labels, similarities)
            self.contrastive_accuracy.update_state(contrastive_labels, ops.transpose(similarities))
            loss_1_2 = keras.losses.sparse_categorical_crossentropy(
                contrastive_labels, similarities, from_logits=True)
            loss_2_1 = keras.losses.sparse_categorical_crossentropy(
                contrastive_labels, ops.transpose(similarities), from_logits=True)
            return ops.mean(loss_1_2 + loss_2_1) / 2

        def train_step(self, data):
            images, labels = data
            with tf.GradientTape() as tape:
                features_1 = self.encoder(self.augment(images), training=True)
                features_2 = self.encoder(self.augment(images), training=True)
                contrastive_loss = self.contrastive_loss(self.projection_head(features_1, training=True),
                                                         self.projection_head(features_2, training=True))
            variables = self.encoder.trainable_weights + self.projection_head.trainable_weights
            gradients = tape.gradient(contrastive_loss, variables)
            self.contrastive_optimizer.apply_gradients(zip(gradients, variables))
            self.contrastive_loss_tracker.update_state(contrastive_loss)

            with tf.GradientTape() as tape:
                features = self.encoder(images, training=False)
                class_logits = self.linear_probe(features, training=True)
                probe_loss = self.probe_loss(labels, class_logits)
            gradients = tape.gradient(probe_loss, self.linear_probe.trainable_weights)
            self.probe_optimizer.apply_gradients(zip(gradients, self.linear_probe.trainable_weights))
            self.probe_loss_tracker.update_state(probe_loss)
            self.probe_accuracy.update_state(labels, class_logits)
            return {m.name: m.result() for m in self.metrics}

    model = ContrastiveModel()
    model.compile(contrastive_optimizer=keras.optimizers.Adam(), probe_optimizer=keras.optimizers.Adam())
    return Program(model, _arrays_fit(VECTORS, LABELS), deterministic=False)


# -- a custom test_step (keras.io's "Customizing what happens in fit()") ------

def program_custom_test_step(base):
    class CustomModel(base):
        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input(shape=(6,))
    model = CustomModel(inputs, layers.Dense(1)(layers.Dense(4, activation="relu")(inputs)))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    targets = VECTORS.sum(axis=1, keepdims=True)

    def evaluate(model, batch_size):
        return model.evaluate(VECTORS, targets, batch_size=batch_size, verbose=0, return_dict=True)

    return Program(model, _arrays_fit(VECTORS, targets), deterministic=True, evaluate=evaluate)


# -- sample weights read with unpack_x_y_sample_weight ------------------------

def program_sample_weight(base):
    class CustomModel(base):
        def train_step(self, data):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred, sample_weight=sample_weight)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input(shape=(6,))
    model = CustomModel(inputs, layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    targets = VECTORS.sum(axis=1, keepdims=True)
    weights = np.linspace(0.1, 2.0, len(VECTORS)).astype("float32")
    return Program(model, _arrays_fit(VECTORS, targets, sample_weight=weights), deterministic=True)


# -- an endpoint layer that adds its own loss (keras.io's functional API guide)

class LogisticEndpoint(layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets, logits, sample_weights=None):
        self.add_loss(self.loss_fn(targets, logits, sample_weights))
        return ops.softmax(logits)


def program_endpoint_layer(base):
    inputs = keras.Input(shape=(6,), name="inputs")
    targets = keras.Input(shape=(3,), name="targets")
    logits = layers.Dense(3)(inputs)
    predictions = LogisticEndpoint(name="predictions")(targets, logits)
    model = base(inputs=[inputs, targets], outputs=predictions)
    model.compile(optimizer="adam")
    data = {"inputs": VECTORS, "targets": keras.utils.to_categorical(LABELS, 3).astype("float32")}
    return Program(model, _arrays_fit(data), deterministic=True)


PROGRAMS = {
    name[len("program_"):]: function for name, function in sorted(globals().items())
    if name.startswith("program_")
}
