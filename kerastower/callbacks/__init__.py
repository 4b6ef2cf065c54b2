"""tensorpack's callbacks as Keras callbacks: `kt.callbacks.*`.

They mix freely with Keras callbacks in one `callbacks=[...]` list.

Examples:
    >>> inputs = keras.Input((3,))
    >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=4, epochs=2, verbose=0,
    ...                     callbacks=[kt.callbacks.ThroughputTracker(), keras.callbacks.CSVLogger("/dev/null")])
    >>> len(history.history["samples_per_sec"])
    2
"""

from kerastower._backend_required import running_backend
from kerastower.callbacks.base import Callback
from kerastower.callbacks.inference import ClassificationError
from kerastower.callbacks.inference import InferenceRunner
from kerastower.callbacks.inference import Inferencer
from kerastower.callbacks.inference import ScalarStats
from kerastower.callbacks.monitors import EstimatedTimeLeft
from kerastower.callbacks.monitors import JSONWriter
from kerastower.callbacks.monitors import OptimizerMemoryTracker
from kerastower.callbacks.monitors import PeakMemoryTracker
from kerastower.callbacks.monitors import ProgressBar
from kerastower.callbacks.monitors import ScalarPrinter
from kerastower.callbacks.monitors import TensorBoard
from kerastower.callbacks.monitors import ThroughputTracker
from kerastower.callbacks.param import HyperParamSetter
from kerastower.callbacks.param import HyperParamSetterWithFunc
from kerastower.callbacks.param import ScheduledHyperParamSetter
from kerastower.callbacks.param import StatMonitorParamSetter
from kerastower.callbacks.saver import AutoResume
from kerastower.callbacks.saver import MaxSaver
from kerastower.callbacks.saver import MinSaver
from kerastower.callbacks.saver import ModelSaver
from kerastower.callbacks.trigger import EnableCallbackIf
from kerastower.callbacks.trigger import PeriodicTrigger
from kerastower.callbacks.trigger import ProxyCallback

if running_backend() == "jax":  # tf.summary is TensorFlow's: write events without it
    from kerastower.callbacks.event_scalars import ScalarTensorBoard as TensorBoard

__all__ = [
    "AutoResume",
    "Callback",
    "ClassificationError",
    "EnableCallbackIf",
    "EstimatedTimeLeft",
    "HyperParamSetter",
    "HyperParamSetterWithFunc",
    "InferenceRunner",
    "Inferencer",
    "JSONWriter",
    "MaxSaver",
    "MinSaver",
    "ModelSaver",
    "OptimizerMemoryTracker",
    "PeakMemoryTracker",
    "PeriodicTrigger",
    "ProgressBar",
    "ProxyCallback",
    "ScalarPrinter",
    "ScalarStats",
    "ScheduledHyperParamSetter",
    "StatMonitorParamSetter",
    "TensorBoard",
    "ThroughputTracker",
]
