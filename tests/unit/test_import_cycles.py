"""No import cycle in ``src/kvrelay``: the package layering stays a graph that runs one way;
and vLLM is imported by the module vLLM loads, nowhere else.

Every ``import`` and ``from ... import`` counts, at module level, inside functions and under
``TYPE_CHECKING`` alike: a cycle broken by a lazy import is still two modules that depend on
each other. Read with ``ast`` (nothing is imported), so modules that need vLLM count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.import_graph import SRC, cycles, import_graph, module_files


def test_the_checker_finds_cycles_lazy_relative_and_type_checking_imports(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import x\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "d.py").write_text("import pkg.a\nimport json\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.sub.b", "pkg.sub.c"})]


def test_src_has_no_import_cycle() -> None:
    graph = import_graph(SRC)
    assert len(graph) > 50 and "kvrelay.router.app" in graph
    found = [sorted(c) for c in cycles(graph)]
    assert not found, f"import cycles: {found}"


def test_only_the_vllm_plugins_connector_imports_vllm() -> None:
    """The launcher, the router and the contract check run where vLLM is not installed."""
    importers = set()
    for name, path in module_files(SRC).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            if any(root.split(".")[0] == "vllm" for root in roots):
                importers.add(name)
    assert importers == {"kvrelay.vllm_plugin.connector"}
