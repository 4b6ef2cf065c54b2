"""The package's layout: packages by concept, no import circles, no import
climbing back up the layers, no module importing the package root back, few
modules at the top.

Read statically from the source, counting every import statement, those
inside functions and methods too: a circle or a climbing import fails here
even where Python would get away with it today (an import run late).
"""

import ast
import os

import pytest

from tests.helpers.common import ROOT

PACKAGE = os.path.join(ROOT, "kerastower")
TOP_MODULES_AT_MOST = 12


def _modules():
    """{dotted name: path} of every module of kerastower."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].split(os.sep)
                if relative[-1] == "__init__":
                    relative = relative[:-1]
                found[".".join(relative)] = path
    return found


MODULES = _modules()


def _module_level_statements(tree):
    """Statements run at import: the module's own, and those inside a
    module-level if/try/with (not inside a def or class)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    pending.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])


def _imports(name, path, module_level_only=False):
    """The kerastower modules `name` imports: anywhere in its source, inside
    functions and methods too, or with `module_level_only` those imported
    when it is."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    edges = set()
    for node in _module_level_statements(tree) if module_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names if alias.name.startswith("kerastower")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("kerastower"):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                edges.add(submodule if submodule in MODULES else base)
    return edges


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
AT_IMPORT = {name: _imports(name, path, module_level_only=True) for name, path in MODULES.items()}


def _cycles(graph):
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_import_graph_reads_real_imports():
    # The checks below are only worth something if edges are found.
    for graph in (GRAPH, AT_IMPORT):
        assert "kerastower.loop.main_loop" in graph["kerastower.loop"]
        assert "kerastower.backend.engine" in graph["kerastower.backend.tensorflow.engine"]
    # An import inside a function (a backend's modules, imported on that backend only).
    assert "kerastower.backend.jax.engine" in GRAPH["kerastower.backend"]
    assert "kerastower.backend.jax.engine" not in AT_IMPORT["kerastower.backend"]


def test_no_import_circles():
    """Counting imports inside functions: one run late still closes a circle."""
    graph = {name: edges - {"kerastower"} for name, edges in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The layers, lowest first: a module imports from its own layer and those
# below it, never from one above. A layer is a list of modules and packages
# (a package: its modules too); a module is in the layer naming it or its
# nearest package.
LAYERS = [
    # Leaves: import nothing of kerastower (the exceptions, TensorFlow's
    # handle, the backend guard, the table of moved modules).
    ["kerastower.errors", "kerastower._tf", "kerastower._backend_required", "kerastower._moved"],
    # The tower scope every tower computation reads (kt.TowerContext).
    ["kerastower.tower"],
    # Keras and TensorFlow shims and scoped patches (some enter tower scopes).
    ["kerastower._compat"],
    # Rules the layers above share: user arguments checked, losses divided over towers.
    ["kerastower.arguments", "kerastower.loss_divisors", "kerastower.loss_reductions"],
    # Checkpoint files, keys and the training state: on the layers below only.
    ["kerastower.checkpoint"],
    # Where a tower's batches come from, the record of the feeds' failures included.
    ["kerastower.inputs"],
    # How a step runs on the towers, per backend; reads sources and states.
    ["kerastower.backend"],
    # Where the towers run; a strategy uses its backend's collectives and scopes.
    ["kerastower.strategies"],
    # Callbacks run by the loop; they read the model, its engine and checkpoints.
    ["kerastower.callbacks"],
    # The training and inference loops: run the engine, callbacks and strategies.
    ["kerastower.loop"],
    # The model classes: fit, evaluate and predict over the loop and the engine.
    ["kerastower.model", "kerastower.functional", "kerastower.sequential"],
    # kt.Trainer and its tower functions: built on TowerModel and the loop.
    ["kerastower.trainers"],
    # The public names, and the launcher run as a program.
    ["kerastower", "kerastower.launch"],
]

# Imports that climb up a layer: (importer, imported): why it is left. Keep it short.
CLIMBING_ALLOWED = {}


def _layer(module):
    """The index in LAYERS of the layer `module` is in."""
    candidates = [(len(entry), index) for index, layer in enumerate(LAYERS) for entry in layer
                  if module == entry or (entry != "kerastower" and module.startswith(entry + "."))]
    assert candidates, f"{module} is in no layer: add it to LAYERS"
    return max(candidates)[1]


def _climbing_imports():
    return {(name, target) for name, edges in GRAPH.items() for target in edges
            if target in GRAPH and _layer(target) > _layer(name)}


def test_every_module_is_in_one_layer():
    for module in MODULES:
        _layer(module)
    entries = [entry for layer in LAYERS for entry in layer]
    assert len(entries) == len(set(entries))
    assert set(entries) <= set(MODULES), "LAYERS names a module that no longer exists"


def test_no_import_climbs_back_up():
    """Counting imports inside functions: a module imports only from its
    own layer and those below (a backend's modules may be imported late,
    on that backend only, but not from a lower layer)."""
    climbing = _climbing_imports()
    assert sorted(climbing - set(CLIMBING_ALLOWED)) == [], "imports that climb up the layers"
    assert sorted(set(CLIMBING_ALLOWED) - climbing) == [], "allowed climbs no longer there: drop them"


def test_no_module_imports_the_package_root_back():
    offenders = sorted(name for name, edges in GRAPH.items()
                       if name != "kerastower" and "kerastower" in edges)
    assert offenders == []


# The modules outside kerastower/backend/ that ask which backend runs, each
# through `_backend_required.running_backend()`: at most 4 (issue 56). What
# else differs by backend is the engine's to say (`backend/engine.py`).
BACKEND_CHECKS_ALLOWED = {
    "kerastower",                          # imports each backend's own modules on it only
    "kerastower.strategies.switch",        # the registry is keyed by backend
    "kerastower._compat.required",         # names the versions in its errors
    "kerastower.callbacks",                # tf.summary on TensorFlow, its own event writer on JAX
}


def _backend_checks(path):
    """(helper calls, other ways of asking) in a module: calls of
    running_backend, and of keras.backend.backend or backend.name."""
    with open(path) as f:
        tree = ast.parse(f.read())
    helper, other = 0, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called.split(".")[-1] in ("running_backend", "_running_backend"):
                helper += 1
            elif called in ("keras.backend.backend", "backend.backend", "backend.name"):
                other.append(called)
    return helper, other


def test_backend_checks_outside_backend_go_through_one_helper_in_few_modules():
    checking, others = set(), {}
    for name, path in MODULES.items():
        if name.startswith("kerastower.backend") or name == "kerastower._backend_required":
            continue
        helper, other = _backend_checks(path)
        if helper:
            checking.add(name)
        if other:
            others[name] = other
    assert others == {}, "ask through _backend_required.running_backend()"
    assert sorted(checking - BACKEND_CHECKS_ALLOWED) == [], "a new module asks which backend runs"
    assert sorted(BACKEND_CHECKS_ALLOWED - checking) == [], "no longer asks: drop it from the list"
    assert len(BACKEND_CHECKS_ALLOWED) <= 4


def test_few_modules_at_the_top():
    top = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py") and n != "__init__.py")
    assert len(top) <= TOP_MODULES_AT_MOST, top


@pytest.mark.parametrize("package", sorted(
    name for name, path in MODULES.items() if path.endswith("__init__.py")))
def test_every_package_says_what_it_holds(package):
    with open(MODULES[package]) as f:
        docstring = ast.get_docstring(ast.parse(f.read()))
    assert docstring and len(docstring.splitlines()[0]) > 10, package


def test_moved_modules_still_import_with_a_deprecation_warning():
    import importlib
    import sys
    import warnings

    from kerastower import _moved

    pytest.importorskip("jax")  # some moved modules are the JAX engine's
    for old, new in sorted(_moved.MOVED.items()):
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
                   for w in caught), old


# Module-level state that may change while kerastower runs, each reviewed:
# what it holds and why it is not a run's or a step's (which live in the
# engine's records: StepCache, StepFailures, the TrainingRun).
REVIEWED_MODULE_STATE = {
    # The scopes the current thread has open (towers, strategies, a tower
    # function being traced, synchronized moments, a feed being built):
    # stacks that empty as the scopes close.
    ("kerastower._compat.patches", "_state"),
    ("kerastower.backend.jax.sync", "_local"),
    ("kerastower.backend.jax.tower_function", "_tracing"),
    ("kerastower.inputs.step_failures", "_building"),
    ("kerastower.backend.tensorflow.collectives", "_active"),
    ("kerastower.strategies.switch", "_local"),
    ("kerastower.tower", "_local"),
    # The optimizers first used in the step `step_calls.traced` is tracing, and
    # whether it is tracing one: emptied when that trace ends (a trace is
    # synchronous; the towers' threads all note into it).
    ("kerastower.backend.tensorflow.gradients", "_first_uses"),
    ("kerastower.backend.tensorflow.gradients", "_retrying"),
    # Registries filled at import, and warn-once memories.
    ("kerastower.strategies.switch", "_REGISTRY"),
    ("kerastower.inputs.chooser", "_REGISTERED"),  # the input kinds registered, for the process
    ("kerastower.strategies.switch", "_BACKENDS"),
    ("kerastower.strategies.tf_backend", "_warned_stock_models"),  # weak: models die with their users
    ("kerastower.backend.tensorflow.xla", "_warned"),
    ("kerastower.loss_reductions", "_warned"),  # weak: the models warned about an unseen reduction
    ("kerastower.functional", "_FUNCTIONAL_TWINS"),
    # A cache keyed weakly by the iterator it binds: dropped with it.
    ("kerastower.backend.tensorflow.step_calls", "_bound_calls"),
    # The folders this process holds locked (a count per folder), which
    # is the process's, not a run's: two runs in one process share a lock
    # (a log folder that is also the checkpoint folder); emptied as they
    # release it, and in a forked child.
    ("kerastower.checkpoint.folder_lock", "_held"),
}
_MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "OrderedDict", "deque", "Counter",
                  "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local"}


_MUTATING_METHODS = {"append", "add", "setdefault", "update", "pop", "clear", "extend", "remove"}


def _mutated_names(tree):
    """Names that are stored into (`name[k] = v`) or changed by a method
    call (`name.append(...)`) anywhere in the module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name):
            yield node.value.id
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _MUTATING_METHODS and isinstance(node.func.value, ast.Name):
            yield node.func.value.id


def _mutable_module_state(module, path):
    with open(path) as f:
        tree = ast.parse(f.read())
    mutated = set(_mutated_names(tree))
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        value = node.value
        if isinstance(value, ast.Call):
            called = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
            mutable = called in _MUTABLE_CALLS
        else:
            mutable = isinstance(value, (ast.List, ast.Set, ast.ListComp, ast.SetComp, ast.DictComp))
            # A dict literal is a constant table unless something stores into it.
            mutable = mutable or isinstance(value, ast.Dict)
        for target in targets:
            if not isinstance(target, ast.Name) or target.id == "__all__":
                continue
            if mutable and (not isinstance(value, ast.Dict) or target.id in mutated):
                yield module, target.id


def test_module_level_state_is_only_what_was_reviewed():
    """Per-run and per-step state lives in the engine's and the loop's
    records, not in module globals (a dict keyed by id() and never cleared
    was one): new module-level state must be reviewed and listed above."""
    found = {state for module, path in MODULES.items() for state in _mutable_module_state(module, path)}
    assert found - REVIEWED_MODULE_STATE == set(), "unreviewed module-level state"
    assert REVIEWED_MODULE_STATE - found == set(), "listed state that no longer exists: drop it"
