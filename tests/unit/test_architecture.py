"""docs/architecture.md matches the code: one line per module of ``src/kvrelay`` (a module
added without a line fails, and so does a line naming a module that is gone), a row per
package, and no package importing one its row does not allow (lazy and ``TYPE_CHECKING``
imports included). The command lines (``kvrelay.cli`` and the modules it registers) may
import anything."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from kvrelay.cli import COMMAND_MODULES
from tests.unit.import_graph import SRC, import_graph, module_files

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
COMMANDS = frozenset({"kvrelay.cli", *COMMAND_MODULES})

_MODULE_LINE = re.compile(r"^- `([\w.]+)` — \S")
_PACKAGE_ROW = re.compile(r"^\| `(\w+)` \|[^|]+\|([^|]+)\|$")


def section(text: str, title: str) -> list[str]:
    """The lines of the ``## title`` section."""
    lines = text.splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def documented_modules(text: str) -> list[str]:
    """Dotted names of the modules the ``Modules`` section has a line for (``core.params`` is
    ``kvrelay.core.params``; ``kvrelay`` is the root package)."""
    names = [m.group(1) for line in section(text, "Modules") if (m := _MODULE_LINE.match(line))]
    return [n if n == "kvrelay" else f"kvrelay.{n}" for n in names]


def allowed_imports(text: str) -> dict[str, frozenset[str]]:
    """Package -> the packages its row says it may import."""
    rows = (_PACKAGE_ROW.match(line) for line in section(text, "Packages and how imports run"))
    return {m.group(1): frozenset(re.findall(r"`(\w+)`", m.group(2))) for m in rows if m}


def package_of(module: str) -> str | None:
    """``kvrelay.core.params`` -> ``core``, ``kvrelay.models`` -> ``models``; ``None`` for the
    root package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layering_violations(
    graph: Mapping[str, set[str]], allowed: Mapping[str, frozenset[str]],
    commands: frozenset[str],
) -> list[str]:
    """``importer -> imported`` for each import across packages that ``allowed`` does not
    permit (command modules exempt)."""
    out = []
    for module, imported in sorted(graph.items()):
        own = package_of(module)
        if module in commands or own is None:
            continue
        for target in sorted(imported):
            other = package_of(target)
            if other not in (None, own) and other not in allowed.get(own, frozenset()):
                out.append(f"{module} -> {target}")
    return out


def test_every_module_has_a_line_and_every_line_a_module() -> None:
    documented = documented_modules(DOC.read_text())
    assert len(documented) == len(set(documented)), "a module has two lines"
    actual = set(module_files(SRC))
    assert len(actual) > 100
    missing = sorted(actual - set(documented))
    assert not missing, f"modules without a line in docs/architecture.md: {missing}"
    gone = sorted(set(documented) - actual)
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def test_every_package_has_a_row_and_may_import_only_packages_with_rows() -> None:
    allowed = allowed_imports(DOC.read_text())
    packages = {package_of(m) for m in module_files(SRC) if m != "kvrelay.cli"} - {None}
    assert set(allowed) == packages
    assert allowed["core"] == frozenset()
    assert all(deps <= set(allowed) for deps in allowed.values())


def test_packages_import_only_what_their_row_allows() -> None:
    allowed = allowed_imports(DOC.read_text())
    violations = layering_violations(import_graph(SRC), allowed, COMMANDS)
    assert not violations, f"imports docs/architecture.md does not allow: {violations}"


def test_the_layering_check_finds_an_upward_import() -> None:
    graph = {
        "kvrelay.core.a": {"kvrelay.core.b"},
        "kvrelay.core.b": set(),
        "kvrelay.router.x": {"kvrelay.core.a"},
        "kvrelay.router.cli": {"kvrelay.bench.y"},
        "kvrelay.bench.y": {"kvrelay.router.x", "kvrelay.core.a"},
        "kvrelay.core.c": {"kvrelay.router.x"},
    }
    allowed = {"core": frozenset(), "router": frozenset({"core"}),
               "bench": frozenset({"core", "router"})}
    assert layering_violations(graph, allowed, frozenset({"kvrelay.router.cli"})) == [
        "kvrelay.core.c -> kvrelay.router.x"]


def test_the_doc_parser_reads_module_lines_and_package_rows() -> None:
    text = "\n".join([
        "## Packages and how imports run", "| package | for | may import |", "|---|---|---|",
        "| `core` | pure | — |", "| `router` | HTTP | `core` |",
        "## Modules", "- `kvrelay` — the root.", "- `core.params` — params.",
        "- not a module line", "## Other", "- `core.elsewhere` — not in Modules.",
    ])
    assert documented_modules(text) == ["kvrelay", "kvrelay.core.params"]
    assert allowed_imports(text) == {"core": frozenset(), "router": frozenset({"core"})}
