"""The decision core stays pure: no I/O, clocks, logging or threads; no mutable globals.

The router feeds time in as ``now_s`` and performs every effect itself, which is what makes
the core's decisions reproducible in unit tests.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import kvrelay.core

FORBIDDEN_TOP_LEVEL = frozenset(
    {
        "aiohttp",
        "asyncio",
        "datetime",
        "http",
        "httpx",
        "importlib",
        "logging",
        "os",
        "redis",
        "requests",
        "socket",
        "starlette",
        "subprocess",
        "threading",
        "time",
        "urllib",
    }
)
MAX_MODULE_LINES = 400


def forbidden_imports(source: str) -> list[str]:
    """Forbidden modules ``source`` imports, including ``__import__("x")`` calls."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        found += [name for name in names if name.split(".")[0] in FORBIDDEN_TOP_LEVEL]
    return found


def mutable_globals(source: str) -> list[str]:
    """Module-level names bound to list/dict/set displays or constructor calls."""
    mutable_calls = {"list", "dict", "set", "bytearray", "defaultdict", "deque", "Counter"}
    found: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
        is_display = isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp)
        is_call = (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in mutable_calls
        )
        if names and (is_display or is_call):
            found += names
    return found


def core_modules() -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = [("kvrelay.core", Path(kvrelay.core.__file__))]
    for info in pkgutil.walk_packages(kvrelay.core.__path__, "kvrelay.core."):
        spec = importlib.util.find_spec(info.name)
        assert spec is not None and spec.origin is not None
        out.append((info.name, Path(spec.origin)))
    return out


def test_core_has_the_expected_modules() -> None:
    names = {name for name, _ in core_modules()}
    for expected in ("params", "fingerprint", "conversation", "costs", "selection", "policy"):
        assert f"kvrelay.core.{expected}" in names


@pytest.mark.parametrize(("name", "path"), core_modules(), ids=lambda v: str(v))
def test_core_module_is_pure(name: str, path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert forbidden_imports(source) == [], f"{name} imports forbidden modules"
    assert mutable_globals(source) == [], f"{name} has module-level mutable state"
    assert len(source.splitlines()) < MAX_MODULE_LINES, f"{name} is too long"


@pytest.mark.parametrize(
    "snippet",
    [
        "import time",
        "import time as t",
        "from time import monotonic",
        "import os.path",
        "from http.client import HTTPConnection",
        "def f():\n    import asyncio\n",
        "x = __import__('logging')",
    ],
)
def test_detector_flags_impure_imports(snippet: str) -> None:
    assert forbidden_imports(snippet) != []


@pytest.mark.parametrize(
    "snippet",
    [
        "import hashlib",
        "from dataclasses import dataclass",
        "from . import time",
        "from kvrelay.core.params import RemoteBlocks",
        "import timeit_like_name_is_not_time",
    ],
)
def test_detector_allows_pure_imports(snippet: str) -> None:
    assert forbidden_imports(snippet) == []


def test_mutable_global_detector() -> None:
    assert mutable_globals("CACHE = {}\nSEEN: list[int] = []\nS = set()") == [
        "CACHE",
        "SEEN",
        "S",
    ]
    assert mutable_globals("__all__ = ['a']\nLIMITS = (1, 2)\nNAMES = frozenset({'a'})") == []
