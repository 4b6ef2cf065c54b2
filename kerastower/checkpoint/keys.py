"""The key each variable has in a checkpoint: restore by name, not position.

A checkpoint stores every variable a training run carries, each under a key
made from its Keras path (`variable.path`), so that reordering layers in
the code cannot load one layer's weights into another:

    model/<path>                  a model variable: weights, BatchNorm
                                  statistics, ... e.g. model/dense/kernel
    model/<layer>/seed_generator_state
                                  a `keras.random.SeedGenerator`'s state,
                                  keyed by the layer (or model) that owns it
                                  (`_1`, `_2` ... after `seed_generator` when
                                  it owns several), since Keras gives seed
                                  generators paths of their own
    <attribute>/<optimizer>/<variable>
                                  an optimizer variable: <attribute> is
                                  `optimizer` for the compiled one, else the
                                  model attribute holding it (a GAN's
                                  `d_optimizer`, `g_optimizer`), so several
                                  optimizers never collide; a slot is keyed by
                                  its model variable's key and the slot name,
                                  e.g. optimizer/adam/dense/kernel/momentum

Keras numbers automatic names process-wide (`dense`, `dense_1`, ...), so
the same code gives other paths when a process builds a model twice. Each
path component ending in `_<n>` is therefore replaced by its rank among the
components of this model with the same stem (`dense_4`, `dense_5` become
`dense`, `dense_1`; stems without a number rank first), which is the name a
fresh process would give. Give layers names that do not end in `_<n>` and
keys are exactly their paths. Two variables still sharing a key (layers of
the same name in two sub-models) get `#2`, `#3` ... in the order of
`model.variables`. The result is deterministic for a given model code.
"""

import re

from kerastower import _compat
from kerastower.checkpoint.training_state import training_optimizers

__all__ = ["keyed_variables", "optimizer_builds", "build_optimizers"]

_NUMBERED = re.compile(r"^(.*?)(?:_(\d+))?$")


def _optimizer_attributes(model):
    """(attribute name, optimizer) for every optimizer that trains `model`."""
    attributes = vars(model)
    named = []
    for optimizer in training_optimizers(model):
        if getattr(model, "optimizer", None) is optimizer:
            named.append(("optimizer", optimizer))
            continue
        name = next(n for n in sorted(attributes) if attributes[n] is optimizer)
        named.append((name, optimizer))
    return named


def _seed_owners(model):
    """id(state variable) -> path the owner gives it: `<layer>/seed_generator_state`."""
    owners = {}
    for layer in _compat.flatten_layers(model):
        for index, generator in enumerate(_compat.seed_generators(layer)):
            state = getattr(generator, "state", None)
            suffix = f"_{index}" if index else ""
            if state is not None and id(state) not in owners:
                owners[id(state)] = f"{layer.name}/seed_generator{suffix}_state"
    return owners


def _split_slot(name, flat_paths):
    """(model path, slot) when the optimizer variable `name` is a slot
    Keras named `<model path with _ for />_<slot>`, else None."""
    for cut in range(len(name) - 1, 0, -1):
        if name[cut] == "_" and name[:cut] in flat_paths:
            return flat_paths[name[:cut]], name[cut + 1:]
    return None


def _ranks(components):
    """component -> the name it would have in a fresh process (see the module docstring)."""
    stems = {}
    for component in components:
        stem, number = _NUMBERED.match(component).groups()
        stems.setdefault(stem, set()).add((int(number) if number else -1, component))
    ranked = {}
    for stem, numbered in stems.items():
        for rank, (_, component) in enumerate(sorted(numbered)):
            ranked[component] = stem if rank == 0 else f"{stem}_{rank}"
    return ranked


def keyed_variables(model):
    """[(key, path, variable)] for every variable a training run of `model`
    carries: the model's (seed-generator states included), then each
    optimizer's; keys unique and deterministic (see the module docstring)."""
    owners = _seed_owners(model)
    # Each entry: (first part, parts to rank, last part, Keras path, variable).
    raw = []
    for v in model.variables:
        *scopes, leaf = owners.get(id(v), v.path).split("/")
        raw.append(("model", scopes, leaf, v.path, v))
    flat = {v.path.replace("/", "_"): v.path for v in model.variables if v.trainable}
    for attribute, optimizer in _optimizer_attributes(model):
        for v in optimizer.variables:
            scope, _, name = v.path.rpartition("/")
            scopes = [scope] if scope else []
            slot = _split_slot(name, flat)
            if slot is None:
                raw.append((attribute, scopes, name, v.path, v))
            else:
                *model_scopes, model_leaf = slot[0].split("/")
                raw.append((attribute, scopes + model_scopes, f"{model_leaf}/{slot[1]}", v.path, v))
    rank = _ranks({c for _, scopes, _, _, _ in raw for c in scopes})
    keyed, seen = [], {}
    for first, scopes, last, path, variable in raw:
        key = "/".join([first, *(rank[c] for c in scopes), last])
        seen[key] = seen.get(key, 0) + 1
        keyed.append((key if seen[key] == 1 else f"{key}#{seen[key]}", path, variable))
    return keyed


def optimizer_builds(model):
    """{attribute: [model variable keys]}: what each built optimizer of
    `model` was built on, by checkpoint key (the same in every process).
    A checkpoint's manifest holds it (`optimizers`), so that a resume
    builds an optimizer that builds on first use (a GAN's second one)
    before restoring it, slots or none (an SGD has only its counter)."""
    keys = {id(variable): key for key, _, variable in keyed_variables(model) if key.startswith("model/")}
    return {attribute: [keys[id(v)] for v in _compat.optimizer_variables(optimizer) if id(v) in keys]
            for attribute, optimizer in _optimizer_attributes(model) if optimizer.built}


def build_optimizers(model, builds, scope):
    """Builds, inside `scope()`, each optimizer of `model` not yet built
    that `builds` (a checkpoint's `optimizer_builds`) names, on the
    variables it names; keys this model lacks are left to the restore's
    mismatch report."""
    by_key = {key: variable for key, _, variable in keyed_variables(model)}
    for attribute, optimizer in _optimizer_attributes(model):
        wanted = (builds or {}).get(attribute)
        if optimizer.built or not wanted or any(key not in by_key for key in wanted):
            continue
        with scope():
            optimizer.build([by_key[key] for key in wanted])
