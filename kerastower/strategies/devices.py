"""Device names for `kt.distributed`: checked before any strategy is built.

```python
import kerastower as kt

kt.distributed("mirrored", devices=["/cpu:0", "/cpu:1"])   # or "/gpu:0", "/device:GPU:1", ...
```

A name TensorFlow cannot parse, a device this process does not have (a
GPU on a machine without one, "/cpu:9" on four CPU devices), or one device
named twice raises `kt.StrategyError` at once, listing the logical devices
there are, instead of hanging or silently placing a tower elsewhere.
"""

from kerastower._tf import tf
from kerastower.arguments import integer
from kerastower.errors import StrategyError

__all__ = ["use_cpu_towers", "parse_devices", "local_devices"]

HOW_TO_MAKE_CPU_DEVICES = (
    "To split one CPU into N logical devices, call kt.use_cpu_towers(N) at the "
    "start of the program, before any TensorFlow op."
)


def use_cpu_towers(num_towers):
    """Splits the CPU into `num_towers` logical devices; returns their names.

    For several towers on a machine without GPUs (tests, examples, trying
    things out). Call it first thing, before TensorFlow runs any op; when
    the CPU is already split (or TensorFlow has started) into at least
    `num_towers` CPU devices, it returns the first ones.

    Examples:
        >>> devices = kt.use_cpu_towers(2)      # first thing in the program
        >>> devices
        ['/cpu:0', '/cpu:1']
        >>> with kt.distributed("mirrored", devices=devices) as strategy:
        ...     print(strategy.num_towers)
        2
    """
    num_towers = integer(num_towers, "num_towers", "use_cpu_towers", minimum=1)
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or []) >= num_towers:
        # Already split (by an earlier call) into enough devices: keep them.
        return [f"/cpu:{index}" for index in range(num_towers)]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_towers)]
        )
    except RuntimeError:  # TensorFlow has started: its devices are fixed
        made = tf.config.list_logical_devices("CPU")
        if len(made) < num_towers:
            raise StrategyError(
                f"use_cpu_towers({num_towers}): TensorFlow has already started with "
                f"{len(made)} CPU device(s), and its devices cannot change after it "
                "starts. Call kt.use_cpu_towers first thing in the program, before any "
                "TensorFlow op (creating a model or a tensor starts TensorFlow)."
            ) from None
    return [f"/cpu:{index}" for index in range(num_towers)]


def _logical_devices():
    return [device.name for device in tf.config.list_logical_devices()]


def _fail(strategy_name, problem, advice):
    listed = ", ".join(_logical_devices()) or "none"
    raise StrategyError(
        f"kt.distributed({strategy_name!r}): {problem} This process has the logical "
        f"devices {listed}. {advice}"
    )


def _parse_one(device, strategy_name):
    """A fully named local `tf.DeviceSpec` for one entry of `devices`."""
    if isinstance(device, tf.config.LogicalDevice):
        device = device.name
    elif isinstance(device, tf.DeviceSpec):
        device = device.to_string()
    example = 'e.g. "/cpu:0" or "/gpu:1"'
    if not isinstance(device, str):
        _fail(strategy_name, f"devices holds {device!r} ({type(device).__name__}), not a "
              "device name.", f"Name each device with a string, {example}.")
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError) as error:
        _fail(strategy_name, f"{device!r} is not a device name ({error}).",
              f"Write a device type and index, {example}.")
    if spec.device_type is None or spec.device_index is None:
        _fail(strategy_name, f"{device!r} does not name one device (it needs a type and an "
              "index).", f"Write a device type and index, {example}.")
    if spec.job not in (None, "localhost") or spec.replica not in (None, 0) or spec.task not in (None, 0):
        _fail(strategy_name, f"{device!r} is a device of another process.",
              'Towers of one process run on its own devices; for several processes use '
              'kt.distributed("horovod") or kt.distributed("multiworker") (docs/distributed.md).')
    return tf.DeviceSpec(device_type=spec.device_type.upper(), device_index=spec.device_index)


def parse_devices(devices, strategy_name):
    """`devices` as a list of (name given, local `tf.DeviceSpec`) pairs (None
    stays None).

    Checks what needs no TensorFlow runtime: each entry names one device of
    this process, and no device is named twice. Raises `StrategyError`.
    """
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)):
        _fail(strategy_name, f"devices is the string {devices!r}, not a list of names.",
              f"Write devices=[{devices!r}].")
    try:
        given = list(devices)
    except TypeError:
        _fail(strategy_name, f"devices is {devices!r}, not a list of device names.",
              'Write e.g. devices=["/cpu:0", "/cpu:1"], or leave it unset for the default.')
    if not given:
        _fail(strategy_name, "devices is an empty list.",
              "Name at least one device, or leave devices unset for the default.")
    specs = [_parse_one(device, strategy_name) for device in given]
    seen = {}
    for device, spec in zip(given, specs):
        name = spec.to_string()
        if name in seen:
            _fail(strategy_name, f"{seen[name]!r} and {device!r} both name {name}.",
                  "Every tower needs a device of its own: name each device once.")
        seen[name] = device
    return list(zip(given, specs))


def local_devices(devices, strategy_name):
    """The names of the logical devices `devices` asks for, checked to exist
    in this process; raises `StrategyError` naming what is missing."""
    parsed = parse_devices(devices, strategy_name)
    available = {}
    for name in _logical_devices():
        spec = tf.DeviceSpec.from_string(name)
        if spec.job in (None, "localhost"):
            available[(spec.device_type, spec.device_index)] = name
    missing = [(given, spec) for given, spec in parsed
               if (spec.device_type, spec.device_index) not in available]
    if missing:
        _missing(strategy_name, [spec for _, spec in parsed], missing, available)
    return [available[(spec.device_type, spec.device_index)] for _, spec in parsed]


def _missing(strategy_name, specs, missing, available):
    kind = missing[0][1].device_type
    named = [given for given, spec in missing if spec.device_type == kind]
    names = ", ".join(repr(given) for given in named)
    several = len(named) > 1
    have = sorted(index for device_type, index in available if device_type == kind)
    if kind == "GPU" and not have:
        _fail(strategy_name, f"{names} ask{'' if several else 's'} for "
              f"{'GPUs' if several else 'a GPU'}, but TensorFlow sees none in this process (no "
              "GPU, no driver, a CPU-only TensorFlow, or CUDA_VISIBLE_DEVICES hides them).",
              'Name CPU devices instead, e.g. devices=["/cpu:0", "/cpu:1"], or leave devices '
              'unset: "mirrored" then takes every GPU, or every logical CPU device where there '
              "is no GPU.")
    if not have:
        _fail(strategy_name, f"{names} ask{'' if several else 's'} for a {kind} device, and "
              "there is none here.", "Name devices from the list above.")
    wanted = sum(spec.device_type == kind for spec in specs)
    if wanted > len(have):
        count = f"{wanted} {kind} devices are asked for and {len(have)} exist"
    else:
        count = f"the {kind} devices are {kind}:0 to {kind}:{max(have)}"
    advice = "Name devices from the list above."
    if kind == "CPU":
        advice += " " + HOW_TO_MAKE_CPU_DEVICES
    _fail(strategy_name, f"{names} do{'' if several else 'es'} not exist: {count}.", advice)
