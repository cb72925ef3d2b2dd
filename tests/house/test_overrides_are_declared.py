"""Every method of ours that overrides a Lightning (or torch optimizer) method says so with ``@override``, so a
hook renamed upstream, or misspelt here, is a type error instead of a method Lightning never calls."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import lightning_hpc


def _undeclared_overrides() -> list[str]:
    missing = []
    for info in pkgutil.walk_packages(lightning_hpc.__path__, "lightning_hpc."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # optional dependencies (Horovod) are checked where installed
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.startswith(("lightning.", "torch.optim"))]
            if not bases:
                continue
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
            for node in tree.body[0].body:  # type: ignore[attr-defined]
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
                    continue
                if any(hasattr(b, node.name) for b in bases) and not any(
                    "override" in ast.unparse(d) for d in node.decorator_list
                ):
                    missing.append(f"{cls.__module__}.{cls.__qualname__}.{node.name}")
    return missing


def test_every_overridden_lightning_method_is_marked_override():
    assert _undeclared_overrides() == []
