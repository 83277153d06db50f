"""The package's layering, as docs/design.md and STYLE.md state it, read from its source."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torchrl_batchserve"
MODULES = {str(p.relative_to(PACKAGE)): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function, and each ``from`` name as ``module.name``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def importers(top: str) -> set[str]:
    """The package's modules that import ``top`` or anything under it."""
    return {name for name, path in MODULES.items() if any(m == top or m.startswith(top + ".") for m in imported(path))}


def test_the_package_is_read_whole():
    assert {"server.py", "serve.py", "transport/hub.py", "config.py", "ray.py"} <= set(MODULES)


def test_only_the_edges_import_the_server():
    # "nothing below imports server": the core builds no server and knows none by its class.
    assert importers("torchrl_batchserve.server") == {"__init__.py", "config.py", "ray.py", "gateway.py"}


@pytest.mark.parametrize(
    "dependency, allowed",
    [("hydra", {"config.py"}), ("omegaconf", {"config.py"}), ("ray", {"ray.py"})],
)
def test_an_optional_dependency_is_imported_by_its_one_module(dependency, allowed):
    assert importers(dependency) <= allowed


def test_no_private_module_or_name_of_torch_tensordict_or_torchrl_is_imported():
    private = []
    for name, path in MODULES.items():
        for module in imported(path):
            parts = module.split(".")
            if parts[0] in ("torch", "tensordict", "torchrl") and any(p.startswith("_") for p in parts):
                private.append(f"{name}: {module}")
    assert private == []


def test_no_private_tensordict_call_and_no_scheduling_change():
    # The names #20 removed, and every way to change a caller's thread or process scheduling.
    pattern = re.compile(
        r"\b(_get_str|_set_str|_interaction_type)\b|sched_set\w+|SCHED_BATCH|setpriority|os\.nice\(|sched_setaffinity"
    )
    found = [
        f"{name}:{n}: {line.strip()}"
        for name, path in MODULES.items()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_every_module_is_named_in_the_design_documents_table_of_parts():
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    parts = design[design.index("## The parts and what each owns") :].split("\n## ")[0]
    unnamed = [
        name for name in MODULES if not name.endswith("__init__.py") and f"`{pathlib.Path(name).name}`" not in parts
    ]
    assert unnamed == []
