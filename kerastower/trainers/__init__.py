"""Trainers for training that is not one cost under `fit`: `kt.Trainer`
(the loop, with `run_step()` to override) and the GAN trainers."""

from kerastower.trainers.base import StopTraining
from kerastower.trainers.base import Trainer
from kerastower.trainers.gan import GANModel
from kerastower.trainers.gan import GANTrainer
from kerastower.trainers.gan import SeparateGANTrainer
from kerastower.trainers.minimize import minimize

__all__ = ["GANModel", "GANTrainer", "SeparateGANTrainer", "StopTraining", "Trainer", "minimize"]
