"""Python source trees read without importing them: a directory or a wheel, parsed with ``ast``.

kvrelay checks what it needs from vLLM's and NIXL's code (``kvrelay.vllm_plugin.contract``)
in releases it cannot import here: a CUDA wheel of vLLM on a CPU-only machine. A
:class:`PyIndex` answers the few questions that needs, by reading sources only:

* where a module-level name is defined, following ``from x import y`` re-exports and
  ``Alias = Name`` assignments;
* a class's bases, in method-resolution order, as far as they are defined in the tree;
* which definition of a method a call through ``super()`` reaches.

Nothing here executes the code it reads.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class SourceTree(Protocol):
    """Text of files by ``/``-separated path relative to the tree's root."""

    @property
    def label(self) -> str: ...

    def read(self, relpath: str) -> str | None: ...

    def python_files(self, package: str) -> list[str]:
        """Paths of the ``.py`` files under ``package`` (``a/b``), sorted."""
        ...

    def origin(self, relpath: str) -> str:
        """The file ``read(relpath)`` really reads, for messages."""
        ...


@dataclass(frozen=True)
class DirectoryTree:
    """Sources under ``root`` (a directory that contains top-level packages)."""

    root: Path

    @property
    def label(self) -> str:
        return str(self.root)

    def read(self, relpath: str) -> str | None:
        path = self.root / relpath
        if not path.is_file():
            return None
        return path.read_text(encoding="utf-8")

    def origin(self, relpath: str) -> str:
        return relpath

    def python_files(self, package: str) -> list[str]:
        base = self.root / package
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*.py"))


class WheelTree:
    """Sources inside a wheel; only the members asked for are decompressed. The archive stays
    open while the tree is in use (its index is read once)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._archive = zipfile.ZipFile(path)
        self._names = frozenset(self._archive.namelist())

    @property
    def label(self) -> str:
        return str(self._path)

    def read(self, relpath: str) -> str | None:
        if relpath not in self._names:
            return None
        return self._archive.read(relpath).decode("utf-8")

    def origin(self, relpath: str) -> str:
        return relpath

    def python_files(self, package: str) -> list[str]:
        prefix = package.rstrip("/") + "/"
        return sorted(n for n in self._names if n.startswith(prefix) and n.endswith(".py"))


@dataclass(frozen=True)
class RedirectedTree:
    """``tree`` with some files read from other paths of the same tree.

    Models a package that installs another one's module under its name at import time (the
    ``nixl`` meta package puts ``nixl_cu12._api`` in ``sys.modules["nixl._api"]``).
    """

    tree: SourceTree
    redirects: tuple[tuple[str, str], ...]

    @property
    def label(self) -> str:
        return self.tree.label

    def read(self, relpath: str) -> str | None:
        for source, target in self.redirects:
            if relpath == source:
                return self.tree.read(target)
        return self.tree.read(relpath)

    def python_files(self, package: str) -> list[str]:
        return self.tree.python_files(package)

    def origin(self, relpath: str) -> str:
        return dict(self.redirects).get(relpath, relpath)


@dataclass(frozen=True)
class Module:
    """A parsed module; ``relpath`` is the file it was read from."""

    name: str
    relpath: str
    node: ast.Module
    is_package: bool


@dataclass(frozen=True)
class Located:
    """A class or function definition and the module it is written in."""

    module: Module
    node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def where(self) -> str:
        return f"{self.module.relpath}:{self.node.lineno}"


@dataclass(frozen=True)
class Binding:
    """What a module-level name is bound to.

    ``definition`` is set when the name leads to a class or function in the tree; otherwise
    ``target`` says what it is bound to (a module that is not Python source, a value).
    """

    module: Module
    line: int
    definition: Located | None
    target: str


class PyIndex:
    """Parsed modules of one :class:`SourceTree`, each read and parsed at most once."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        if name not in self._modules:
            self._modules[name] = self._load(name)
        return self._modules[name]

    def _load(self, name: str) -> Module | None:
        base = name.replace(".", "/")
        for relpath in (f"{base}.py", f"{base}/__init__.py"):
            text = self.tree.read(relpath)
            if text is not None:
                origin = self.tree.origin(relpath)
                return Module(name, origin, ast.parse(text, filename=origin),
                              relpath.endswith("/__init__.py"))
        return None

    def lookup(self, module_name: str, name: str, _seen: frozenset[str] = frozenset()) -> (
        Binding | None
    ):
        """Where ``name`` in module ``module_name`` comes from, or ``None`` if it is unbound.

        Imports are followed into the tree; imports inside ``if``/``try`` blocks count (a
        ``TYPE_CHECKING`` stub that imports from one of several backends resolves to the
        first one present in the tree).
        """
        key = f"{module_name}:{name}"
        module = self.module(module_name)
        if module is None or key in _seen:
            return None
        seen = _seen | {key}
        fallback: Binding | None = None
        for stmt in _module_statements(module.node):
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if stmt.name == name:
                    return Binding(module, stmt.lineno, Located(module, stmt), "definition")
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    source = _absolute(module, stmt.module, stmt.level)
                    found = self.lookup(source, alias.name, seen)
                    if found is not None:
                        return found
                    if self.module(f"{source}.{alias.name}") is not None:
                        return Binding(module, stmt.lineno, None, f"module {source}.{alias.name}")
                    fallback = fallback or Binding(
                        module, stmt.lineno, None, f"{source}.{alias.name} (not in the tree)"
                    )
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        return Binding(module, stmt.lineno, None, f"module {alias.name}")
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    value = stmt.value
                    if isinstance(value, ast.Name) and value.id != name:
                        found = self.lookup(module_name, value.id, seen)
                        if found is not None:
                            return found
                    return Binding(module, stmt.lineno, None, "value")
        return fallback

    def find_class(self, module_name: str, name: str) -> Located | None:
        binding = self.lookup(module_name, name)
        if binding is None or binding.definition is None:
            return None
        return binding.definition if isinstance(binding.definition.node, ast.ClassDef) else None

    def find_function(self, module_name: str, qualname: str) -> Located | None:
        """A module-level function (``name``) or a method (``Class.name``, resolved like a
        call on an instance of ``Class``)."""
        if "." in qualname:
            class_name, method = qualname.split(".", 1)
            cls = self.find_class(module_name, class_name)
            if cls is None:
                return None
            found = self.resolve_method(cls, method)
            return found[0] if found else None
        binding = self.lookup(module_name, qualname)
        if binding is None or binding.definition is None:
            return None
        node = binding.definition.node
        return binding.definition if not isinstance(node, ast.ClassDef) else None

    def bases(self, cls: Located) -> list[Located]:
        """Direct bases of ``cls`` that are defined in the tree (``ABC``, ``Generic[T]`` and
        other outside bases are left out)."""
        assert isinstance(cls.node, ast.ClassDef)
        out: list[Located] = []
        for base in cls.node.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            found: Located | None = None
            if isinstance(expr, ast.Name):
                found = self.find_class(cls.module.name, expr.id)
            elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
                binding = self.lookup(cls.module.name, expr.value.id)
                if binding is not None and binding.target.startswith("module "):
                    found = self.find_class(binding.target.split(" ", 1)[1], expr.attr)
            if found is not None:
                out.append(found)
        return out

    def mro(self, cls: Located) -> list[Located]:
        """``cls`` and its in-tree bases in C3 method-resolution order."""
        return _c3(cls, self.bases)

    def resolve_method(self, cls: Located, name: str) -> list[Located]:
        """Every definition of method ``name`` along ``cls``'s MRO, the one a call reaches
        first."""
        out: list[Located] = []
        for klass in self.mro(cls):
            assert isinstance(klass.node, ast.ClassDef)
            for stmt in klass.node.body:
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                    out.append(Located(klass.module, stmt))
        return out

    def is_subclass(self, cls: Located, base: Located) -> bool:
        return any(_same(k, base) for k in self.mro(cls))


def _same(a: Located, b: Located) -> bool:
    return a.module.relpath == b.module.relpath and a.node.lineno == b.node.lineno


def _c3(cls: Located, bases_of: Callable[[Located], list[Located]]) -> list[Located]:
    sequences = [_c3(base, bases_of) for base in bases_of(cls)]
    sequences.append(bases_of(cls))
    out = [cls]
    while any(sequences):
        for seq in sequences:
            if not seq:
                continue
            head = seq[0]
            if not any(_same(head, k) for other in sequences for k in other[1:]):
                break
        else:  # inconsistent hierarchy: fall back to depth-first order
            head = next(seq[0] for seq in sequences if seq)
        out.append(head)
        sequences = [[k for k in seq if not _same(k, head)] for seq in sequences]
    return out


def _absolute(module: Module, name: str | None, level: int) -> str:
    if level == 0:
        return name or ""
    parts = module.name.split(".")
    package = parts if module.is_package else parts[:-1]
    package = package[: len(package) - (level - 1)]
    return ".".join([*package, name] if name else package)


def _module_statements(node: ast.Module) -> Iterator[ast.stmt]:
    """Statements that bind module-level names, including those nested in ``if``/``try``."""
    stack: list[ast.stmt] = list(reversed(node.body))
    while stack:
        stmt = stack.pop()
        yield stmt
        nested: list[ast.stmt] = []
        if isinstance(stmt, ast.If):
            nested = [*stmt.body, *stmt.orelse]
        elif isinstance(stmt, ast.Try):
            nested = [*stmt.body, *[s for h in stmt.handlers for s in h.body], *stmt.orelse]
        stack.extend(reversed(nested))


def dotted(expr: ast.expr) -> str | None:
    """``a.b.c`` for a name or attribute chain, else ``None``."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = dotted(expr.value)
        return f"{inner}.{expr.attr}" if inner is not None else None
    return None


def calls(node: ast.AST) -> Iterator[ast.Call]:
    """Every call inside ``node``."""
    for child in ast.walk(node):
        if isinstance(child, ast.Call):
            yield child


def mentions(node: ast.AST, word: str) -> int | None:
    """Line of the first place ``node`` names ``word``: a variable, an attribute, a keyword
    argument or a string (f-string parts included); ``None`` if nowhere."""
    for child in ast.walk(node):
        hit = (
            (isinstance(child, ast.Name) and child.id == word)
            or (isinstance(child, ast.Attribute) and child.attr == word)
            or (isinstance(child, ast.keyword) and child.arg == word)
            or (isinstance(child, ast.Constant) and child.value == word)
        )
        if hit:
            return getattr(child, "lineno", None) or getattr(node, "lineno", 0)
    return None


def positional_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """Names of the parameters a caller can pass by position, without ``self``/``cls``."""
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    return tuple(names[1:] if names and names[0] in ("self", "cls") else names)


def is_abstract(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated ``@abstractmethod``, or a body that only raises ``NotImplementedError``."""
    if any(dotted(d) in ("abstractmethod", "abc.abstractmethod") for d in fn.decorator_list):
        return True
    body = [s for s in fn.body if not _is_docstring(s)]
    if len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None:
        exc = body[0].exc
        target = exc.func if isinstance(exc, ast.Call) else exc
        return dotted(target) == "NotImplementedError"
    return False


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def module_constant(module: Module, name: str) -> tuple[object, int] | None:
    """Value and line of a module-level ``name = <literal>`` (chained assignments too)."""
    for stmt in module.node.body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            try:
                return ast.literal_eval(value), stmt.lineno
            except ValueError:
                return None
    return None
