"""The TowerModel's backend part on JAX: Keras's own JAX steps, run per tower.

`kt.TowerModel` takes `TowerModelBackend` as a base on JAX. Towers keep
Keras's JAX steps (`train_step(self, state, data)`, `compute_loss`
overrides, custom steps) as they are: the engine (engine.py) runs them
once per tower in one jitted call (step.py). The weights stay on the towers
between steps; what is here writes them into the model's variables when
something reads them.
"""

__all__ = ["TowerModelBackend"]


class TowerModelBackend:
    """The JAX part of `kt.TowerModel` (a mixin before `keras.Model`; see
    kerastower/model.py)."""

    def jax_state_sync(self):
        """Writes the weights the towers hold into the model's variables
        (Keras calls it when a callback reads `self.model`)."""
        super().jax_state_sync()
        engine = self.__dict__.get("engine")
        for steps in engine.all_tower_steps() if engine is not None else ():
            steps.sync()

    def reset_metrics(self):
        """Keras's reset, without an eager op per variable (metric_reset.py)."""
        engine = self.__dict__.get("engine")
        if engine is None:
            super().reset_metrics()
            return
        engine.metric_resets.reset(self)
        for steps in engine.all_tower_steps():
            steps.reset_metrics()

    def make_train_function(self, force=False):
        return self.engine.tower_steps()
