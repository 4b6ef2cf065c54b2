"""`kt.TowerSequential`: a `keras.Sequential` that trains with towers.

```python
import keras, kerastower as kt

model = kt.TowerSequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")   # then fit as any TowerModel
```
"""

import keras

from kerastower.model import TowerModel

__all__ = ["TowerSequential"]


@keras.saving.register_keras_serializable(package="kerastower")
class TowerSequential(TowerModel, keras.Sequential):
    """A `keras.Sequential` whose steps are tower functions, as `kt.TowerModel`'s.

    Everything `keras.Sequential` does (`add`, `pop`, a build deferred to
    the first batch, `layers`, saving) and everything a TowerModel does
    (`batch_size` per tower, N towers equal to one device on the joined
    batch). Create it under the strategy it trains with.

    Examples:
        >>> model = kt.TowerSequential([keras.layers.Dense(4, activation="relu")])
        >>> model.add(keras.layers.Dense(1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
        >>> model.loop.global_step, len(model.layers)
        (2, 2)
    """
