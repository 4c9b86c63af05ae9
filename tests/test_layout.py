"""The package's layout holds: imports point one way (`loop` <- `tuning` <- `generate`, `loop` <-
`runtime` <- `generate`; `ssd` may use all the others), and no module outside `tuning/` and
`runtime/` keeps process-global mutable state."""

from __future__ import annotations

import ast
import copy
import importlib
import os
import pkgutil
import threading
import types

import pytest

import ssd_jax

PACKAGE = os.path.dirname(ssd_jax.__file__)
# Package -> the ssd_jax modules and packages it may not import (at module level or in a function).
FORBIDDEN = {
    "loop": ("ssd_jax.tuning", "ssd_jax.runtime", "ssd_jax.ssd", "ssd_jax.generate", "ssd_jax.decode",
             "ssd_jax.cli", "ssd_jax.plan"),
    "runtime": ("ssd_jax.tuning", "ssd_jax.ssd", "ssd_jax.generate", "ssd_jax.cli"),
    "tuning": ("ssd_jax.ssd", "ssd_jax.generate", "ssd_jax.cli", "ssd_jax.decode"),
}
STATEFUL_ALLOWED = ("ssd_jax.tuning", "ssd_jax.runtime")


def _modules(package: str) -> list[str]:
    folder = os.path.join(PACKAGE, package)
    return sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".py"))


def _imported(path: str) -> set[str]:
    """Every ssd_jax module a file imports, wherever in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("ssd_jax")}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    wrong = []
    for path in _modules(package):
        for name in sorted(_imported(path)):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package]):
                wrong.append(f"{os.path.relpath(path, PACKAGE)} imports {name}")
    assert not wrong, "\n".join(wrong)


def _all_modules() -> list[types.ModuleType]:
    names = [m.name for m in pkgutil.walk_packages(ssd_jax.__path__, "ssd_jax.") if not m.name.endswith("__main__")]
    return [importlib.import_module(name) for name in sorted(names)]


def _own_globals(module: types.ModuleType):
    """(name, value) of the module-level values a module makes itself (not imported ones, classes,
    functions or modules)."""
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, (types.ModuleType, types.FunctionType, type,
                                                       types.BuiltinFunctionType)):
            continue
        yield name, value


def _is_stateful(value) -> bool:
    """A lock, a counter, or an instance of one of the package's classes that is not a frozen
    dataclass, an enum member or a named tuple (those hold no state that changes)."""
    if isinstance(value, (type(threading.Lock()), type(threading.RLock()), threading.Event, threading.Condition)):
        return True
    kind = type(value)
    if kind.__module__ == "itertools":
        return True
    if not kind.__module__.startswith("ssd_jax"):
        return False
    params = getattr(kind, "__dataclass_params__", None)
    return not ((params is not None and params.frozen) or isinstance(value, tuple))


def _kept_by_tuning_or_runtime() -> set[int]:
    """The ids of the module-level values of tuning/ and runtime/ (other modules import some)."""
    return {id(value) for module in _all_modules() if module.__name__.startswith(STATEFUL_ALLOWED)
            for _, value in _own_globals(module)}


def test_no_module_outside_tuning_and_runtime_keeps_stateful_objects():
    theirs = _kept_by_tuning_or_runtime()
    found = [f"{module.__name__}.{name}: {type(value).__name__}"
             for module in _all_modules() if not module.__name__.startswith(STATEFUL_ALLOWED)
             for name, value in _own_globals(module) if _is_stateful(value) and id(value) not in theirs]
    assert not found, "\n".join(found)


def _containers() -> dict:
    """Deep copies of every module-level dict, list and set outside tuning/ and runtime/."""
    return {(module.__name__, name): copy.deepcopy(value)
            for module in _all_modules() if not module.__name__.startswith(STATEFUL_ALLOWED)
            for name, value in _own_globals(module) if type(value) in (dict, list, set)}


def test_no_module_outside_tuning_and_runtime_changes_a_container_while_decoding():
    """Module-level tables (defaults, option maps) are constants: "auto" calls that measure and
    remember (a measuring tuner) leave every one of them as it was."""
    from spec_models import pair

    before = _containers()
    target, draft = pair(vocab=64, seed=0, noise=0.3, layers=1)
    tuner = ssd_jax.Tuner(store=None)
    for method, with_draft in ((ssd_jax.SD(), True), (ssd_jax.PLD(), False), (ssd_jax.AR(), False)):
        ssd_jax.generate(target, [[3, 4, 5, 3, 4]], max_new_tokens=8, method=method,
                         draft=draft if with_draft else None, temperature=1.0, tuner=tuner)
    after = _containers()
    changed = sorted(f"{module}.{name}" for (module, name), value in after.items()
                     if before.get((module, name)) != value)
    assert not changed, changed
