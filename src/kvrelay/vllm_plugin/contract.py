"""What kvrelay's connector needs from vLLM (and NIXL), checked by reading their sources.

kvrelay's ``NixlConnector`` (``kvrelay.vllm_plugin.connector``) subclasses vLLM's
``NixlPullConnector``, overrides its scheduler hooks and wraps its worker's constructor. A
hook renamed or given a new parameter in a vLLM release would break every node that loads
kvrelay's connector, and only at run time, so each release is checked here first, without
importing it (GPU users run CUDA wheels this machine cannot import):

    python -m kvrelay.vllm_plugin.contract --version 0.33.0   # PyPI wheel, cached
    python -m kvrelay.vllm_plugin.contract --source DIR|WHEEL  # a checkout or a wheel
    python -m kvrelay.vllm_plugin.contract --installed         # the vLLM installed here
    make check-vllm VERSION=0.33.0

``CONTRACT`` below is the whole contract, one requirement per line: adding a hook to the
connector is adding one ``Hook(...)`` line. NIXL is a separate package; its side (the
``nixlAgent`` binding the progress-delay fix wraps) is checked against the nixl installed here.

The same reading tells which of the connector's fixes a release still needs
(:func:`fix_facts`, used by the connector at start-up; docs/vllm-versions.md).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from kvrelay.vllm_plugin.fixes import FixFacts
from kvrelay.vllm_plugin.pysource import (
    DirectoryTree,
    Located,
    PyIndex,
    RedirectedTree,
    SourceTree,
    WheelTree,
    calls,
    dotted,
    is_abstract,
    mentions,
    module_constant,
    positional_params,
)
from kvrelay.vllm_plugin.wheels import (
    WheelDownloadError,
    download_wheel,
    find_wheel,
    validate_version,
    wheel_cache_dir,
)

Tree = Literal["vllm", "nixl"]
_T = TypeVar("_T")

NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


@dataclass(frozen=True)
class ClassRef:
    module: str
    name: str
    tree: Tree = "vllm"


@dataclass(frozen=True)
class FunctionRef:
    """A module-level function, or a method (``Class.name``) resolved along the class's MRO."""

    module: str
    qualname: str
    tree: Tree = "vllm"


def method(cls: ClassRef, name: str) -> FunctionRef:
    return FunctionRef(cls.module, f"{cls.name}.{name}", cls.tree)


CONNECTOR = ClassRef(f"{NIXL_PACKAGE}.connector", "NixlPullConnector")
SCHEDULER = ClassRef(f"{NIXL_PACKAGE}.pull_scheduler", "NixlPullConnectorScheduler")
WORKER = ClassRef(f"{NIXL_PACKAGE}.pull_worker", "NixlPullConnectorWorker")
BASE_WORKER = ClassRef(f"{NIXL_PACKAGE}.base_worker", "NixlBaseConnectorWorker")
ROLE = ClassRef("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole")
REQUEST = ClassRef("vllm.v1.request", "Request")
TRANSFER_CONFIG = ClassRef("vllm.config.kv_transfer", "KVTransferConfig")
FACTORY = ClassRef("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory")
CONNECTOR_BASE = ClassRef("vllm.distributed.kv_transfer.kv_connector.v1.base",
                          "KVConnectorBase_V1")
CORE_SCHEDULER = ClassRef("vllm.v1.core.sched.scheduler", "Scheduler")
KV_CACHE_MANAGER = ClassRef("vllm.v1.core.kv_cache_manager", "KVCacheManager")
BLOCK_POOL = ClassRef("vllm.v1.core.block_pool", "BlockPool")
KV_CACHE_BLOCK = ClassRef("vllm.v1.core.kv_cache_utils", "KVCacheBlock")
KV_CACHE_CONFIG = ClassRef("vllm.v1.kv_cache_interface", "KVCacheConfig")
CONNECTOR_OUTPUT = ClassRef("vllm.v1.outputs", "KVConnectorOutput")
V1_CONNECTORS = "vllm.distributed.kv_transfer.kv_connector.v1"
NIXL_UTILS = "vllm.distributed.nixl_utils"
NIXL_AGENT = ClassRef("nixl._api", "nixl_agent", tree="nixl")
ENGINE_CORE_PROC = ClassRef("vllm.v1.engine.core", "EngineCoreProc")
INPUT_PROCESSOR = ClassRef("vllm.v1.engine.input_processor", "InputProcessor")
COMPLETION_SERVING = ClassRef("vllm.entrypoints.openai.completion.serving",
                              "OpenAIServingCompletion")


@dataclass(frozen=True)
class Finding:
    ok: bool
    what: str
    detail: str
    why: str


class Missing(LookupError):
    """What a requirement or fact reads is not in the trees (the message says what): the
    requirement fails (``check``), the fact is unknown (``Fact.value`` ``None``)."""


class Context:
    """The trees a contract is checked against: a vLLM release and the nixl installed here.
    Lookups raise ``Missing`` when what they name is not there."""

    def __init__(
        self, vllm: SourceTree, nixl: SourceTree | None, nixl_version: str | None
    ) -> None:
        self.vllm = PyIndex(vllm)
        self.nixl = PyIndex(nixl) if nixl is not None else None
        self.nixl_version = nixl_version

    def index(self, tree: Tree) -> PyIndex:
        index = self.vllm if tree == "vllm" else self.nixl
        if index is None:
            raise Missing("nixl is not installed here")
        return index

    def function(self, ref: FunctionRef) -> Located:
        """The definition ``ref`` names."""
        found = self.index(ref.tree).find_function(ref.module, ref.qualname)
        if found is None:
            raise Missing(f"{ref.qualname} not found in {ref.module}")
        return found

    def cls(self, ref: ClassRef) -> Located:
        found = self.index(ref.tree).find_class(ref.module, ref.name)
        if found is None:
            raise Missing(f"class {ref.name} not found in {ref.module}")
        return found


def _line_in(
    ctx: Context, where: FunctionRef, what: str, why: str,
    find: Callable[[Located], int | None], missing: Callable[[Located], str],
) -> Finding:
    """The finding of a requirement met by a line of function ``where`` (``find``: its
    number, ``None`` if no line meets it; ``missing``: what to say then)."""
    fn = ctx.function(where)
    line = find(fn)
    if line is None:
        return Finding(False, what, missing(fn), why)
    return Finding(True, what, f"{fn.module.relpath}:{line}", why)


class Requirement(Protocol):
    """One line of the contract; ``check`` may raise ``Missing`` (a failed finding)."""

    @property
    def what(self) -> str: ...

    @property
    def why(self) -> str: ...

    def check(self, ctx: Context) -> Finding: ...


@dataclass(frozen=True)
class Symbol:
    """``from module import name`` works."""

    module: str
    name: str
    why: str
    tree: Tree = "vllm"

    @property
    def what(self) -> str:
        return f"import {self.module}.{self.name}"

    def check(self, ctx: Context) -> Finding:
        binding = ctx.index(self.tree).lookup(self.module, self.name)
        if binding is None:
            return Finding(False, self.what, f"{self.name} is not defined in {self.module}",
                           self.why)
        where = binding.definition.where if binding.definition else (
            f"{binding.module.relpath}:{binding.line} ({binding.target})")
        return Finding(True, self.what, where, self.why)


@dataclass(frozen=True)
class Hook:
    """A method kvrelay overrides and calls through ``super()``: implemented (not abstract)
    by a class under ``implemented_under``, taking exactly ``params`` by position."""

    cls: ClassRef
    name: str
    params: tuple[str, ...]
    why: str
    implemented_under: str = NIXL_PACKAGE

    @property
    def what(self) -> str:
        return f"hook {self.cls.name}.{self.name}({', '.join(self.params)})"

    def check(self, ctx: Context) -> Finding:
        found = ctx.index(self.cls.tree).resolve_method(ctx.cls(self.cls), self.name)
        if not found:
            return Finding(False, self.what,
                           f"{self.name} is not defined on {self.cls.name} or its bases", self.why)
        first = found[0]
        fn = first.node
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        if is_abstract(fn) or not first.module.name.startswith(self.implemented_under):
            return Finding(False, self.what,
                           f"{self.name} is only {'abstract' if is_abstract(fn) else 'defined'} "
                           f"at {first.where}, outside {self.implemented_under}", self.why)
        params = positional_params(fn)
        required_kwonly = [a.arg for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults,
                                                 strict=True) if d is None]
        if params != self.params or required_kwonly:
            got = ", ".join([*params, *(f"*, {k}" for k in required_kwonly)])
            return Finding(False, self.what,
                           f"signature changed: vLLM has {self.name}({got}) at {first.where}",
                           self.why)
        return Finding(True, self.what, first.where, self.why)


@dataclass(frozen=True)
class Attribute:
    """Instances of ``cls`` have attribute ``name`` (set on ``self``, a property or a class
    attribute, on the class or a base)."""

    cls: ClassRef
    name: str
    why: str

    @property
    def what(self) -> str:
        return f"attribute {self.cls.name}.{self.name}"

    def check(self, ctx: Context) -> Finding:
        for klass in ctx.index(self.cls.tree).mro(ctx.cls(self.cls)):
            line = _attribute_line(klass, self.name)
            if line is not None:
                return Finding(True, self.what, f"{klass.module.relpath}:{line}", self.why)
        return Finding(False, self.what,
                       f"{self.cls.name} and its bases never set {self.name}", self.why)


@dataclass(frozen=True)
class Subclass:
    cls: ClassRef
    base: ClassRef
    why: str

    @property
    def what(self) -> str:
        return f"{self.cls.name} subclasses {self.base.name}"

    def check(self, ctx: Context) -> Finding:
        cls, base = ctx.cls(self.cls), ctx.cls(self.base)
        if not ctx.index(self.cls.tree).is_subclass(cls, base):
            return Finding(False, self.what, f"{cls.where} does not derive from {base.where}",
                           self.why)
        return Finding(True, self.what, cls.where, self.why)


@dataclass(frozen=True)
class Calls:
    """``where`` calls ``callee`` (``a.b``, ``Name`` or ``super().__init__``)."""

    where: FunctionRef
    callee: str
    why: str

    @property
    def what(self) -> str:
        return f"{self.where.qualname} calls {self.callee}"

    def check(self, ctx: Context) -> Finding:
        def first_call(fn: Located) -> int | None:
            lines = [c.lineno for c in calls(fn.node) if _callee(c.func) == self.callee]
            return lines[0] if lines else None

        return _line_in(ctx, self.where, self.what, self.why, first_call,
                        lambda fn: f"no call to {self.callee} in {fn.where}")


@dataclass(frozen=True)
class CallsOnlyIn:
    """Every call to ``callee`` in ``package``'s modules is inside ``allowed`` (the code path
    kvrelay wraps)."""

    package: str
    callee: str
    allowed: FunctionRef
    why: str

    @property
    def what(self) -> str:
        return f"{self.callee} is only called in {self.allowed.qualname}"

    def check(self, ctx: Context) -> Finding:
        allowed = ctx.function(self.allowed)
        start, end = allowed.node.lineno, allowed.node.end_lineno or allowed.node.lineno
        outside = []
        for relpath in ctx.vllm.tree.python_files(self.package.replace(".", "/")):
            module = ctx.vllm.module(relpath.removesuffix(".py").replace("/", ".")
                                     .removesuffix(".__init__"))
            if module is None:
                continue
            for call in calls(module.node):
                if _callee(call.func) != self.callee:
                    continue
                if module.relpath != allowed.module.relpath or not start <= call.lineno <= end:
                    outside.append(f"{module.relpath}:{call.lineno}")
        if outside:
            return Finding(False, self.what, f"also called at {', '.join(outside)}", self.why)
        return Finding(True, self.what, allowed.where, self.why)


@dataclass(frozen=True)
class Mentions:
    """``where`` names ``word`` (a variable, attribute, keyword or string)."""

    where: FunctionRef
    word: str
    why: str

    @property
    def what(self) -> str:
        return f"{self.where.qualname} uses {self.word!r}"

    def check(self, ctx: Context) -> Finding:
        return _line_in(ctx, self.where, self.what, self.why,
                        lambda fn: mentions(fn.node, self.word),
                        lambda fn: f"{fn.where} does not use {self.word!r}")


@dataclass(frozen=True)
class ParamsKey:
    """``where`` reads or writes ``kv_transfer_params[key]``."""

    where: FunctionRef
    key: str
    use: Literal["reads", "writes"]
    why: str

    @property
    def what(self) -> str:
        return f"{self.where.qualname} {self.use} kv_transfer_params[{self.key!r}]"

    def check(self, ctx: Context) -> Finding:
        return _line_in(ctx, self.where, self.what, self.why,
                        lambda fn: _params_key_line(fn.node, self.key, self.use),
                        lambda fn: f"{fn.where} never {self.use} {self.key!r}")


@dataclass(frozen=True)
class SetsAttribute:
    """``where`` assigns ``<object>.<attr> = ...``."""

    where: FunctionRef
    attr: str
    why: str

    @property
    def what(self) -> str:
        return f"{self.where.qualname} sets .{self.attr}"

    def check(self, ctx: Context) -> Finding:
        return _line_in(ctx, self.where, self.what, self.why,
                        lambda fn: _attribute_store_line(fn.node, self.attr, value=None),
                        lambda fn: f"{fn.where} never sets .{self.attr}")


@dataclass(frozen=True)
class NixlVersionFloor:
    """The nixl installed here is at least the version ``where`` demands
    (``check_nixl_version("X")``), if it demands one."""

    where: FunctionRef
    why: str

    @property
    def what(self) -> str:
        return "installed nixl meets vLLM's minimum"

    def check(self, ctx: Context) -> Finding:
        fn = ctx.function(self.where)
        floors = [
            (str(call.args[0].value), call.lineno)
            for call in calls(fn.node)
            if _callee(call.func) == "check_nixl_version"
            and call.args and isinstance(call.args[0], ast.Constant)
        ]
        if not floors:
            return Finding(True, self.what, f"no minimum stated in {fn.where}", self.why)
        floor, line = floors[0]
        installed = ctx.nixl_version
        if installed is None:
            return Finding(False, self.what, f"vLLM needs nixl >= {floor}; none installed here",
                           self.why)
        if _numeric(installed) < _numeric(floor):
            return Finding(False, self.what,
                           f"vLLM needs nixl >= {floor} ({fn.module.relpath}:{line}); "
                           f"{installed} is installed", self.why)
        return Finding(True, self.what, f"nixl {installed} >= {floor} "
                       f"({fn.module.relpath}:{line})", self.why)


#: Everything kvrelay's connector (``kvrelay.vllm_plugin.connector``) relies on. One line each.
CONTRACT: tuple[Requirement, ...] = (
    # What connector.py imports and how vLLM loads it.
    Symbol(CONNECTOR.module, CONNECTOR.name, "kvrelay's NixlConnector subclasses it"),
    Symbol(ROLE.module, ROLE.name, "the connector tells worker from scheduler"),
    Attribute(ROLE, "WORKER", "the connector tells worker from scheduler"),
    Symbol("vllm.logger", "init_logger", "the connector logs through vLLM's logger"),
    Hook(TRANSFER_CONFIG, "get_from_extra_config", ("key", "default"),
         "kvrelay_* switches come from kv_connector_extra_config", "vllm.config"),
    Mentions(method(FACTORY, "get_connector_class"), "kv_connector_module_path",
             "vLLM loads kvrelay.vllm_plugin.connector from kv_connector_module_path"),
    # Hooks kvrelay overrides and calls through super().
    Hook(CONNECTOR, "__init__", ("vllm_config", "role", "kv_cache_config"),
         "fixes 1-2 wrap the constructor"),
    Hook(CONNECTOR, "get_num_new_matched_tokens", ("request", "num_computed_tokens"),
         "fix 3; P-side prefix verification"),
    Hook(CONNECTOR, "update_state_after_alloc", ("request", "blocks", "num_external_tokens"),
         "sets the _remote_blocks_processed mark fix 3 reads"),
    Hook(CONNECTOR, "request_finished", ("request", "block_ids"),
         "reports D's retained params; D-side fingerprints"),
    Hook(CONNECTOR, "request_finished_all_groups", ("request", "block_ids"),
         "reports D's retained params (hybrid KV cache manager)"),
    # Fixes 1-2: the worker, its core pinning and its NIXL agent are built in the constructor.
    Calls(method(CONNECTOR, "__init__"), WORKER.name, "fixes 1-2 wrap the worker's construction"),
    Subclass(WORKER, BASE_WORKER, "the base worker's constructor pins cores, creates the agent"),
    Calls(method(WORKER, "__init__"), "super().__init__", "reaches the base worker constructor"),
    CallsOnlyIn(NIXL_PACKAGE, "os.sched_setaffinity", method(BASE_WORKER, "__init__"),
                "fix 1 restores affinity around the constructor only"),
    Mentions(method(BASE_WORKER, "__init__"), "NixlWrapper",
             "fix 2 wraps agent creation during the constructor"),
    Mentions(FunctionRef(NIXL_UTILS, "_load_nixl_attr"), "nixl_agent",
             "vLLM's NixlWrapper is nixl's nixl_agent"),
    Mentions(FunctionRef(NIXL_UTILS, "_get_nixl_module_name"), "._api",
             "vLLM takes nixl_agent from nixl._api, the module fix 2 patches"),
    NixlVersionFloor(method(BASE_WORKER, "__init__"), "vLLM refuses older nixl at start-up"),
    # Fix 2, nixl's side: nixl_agent builds its config and hands it to nixlBind.nixlAgent.
    Symbol(NIXL_AGENT.module, "nixlBind", "fix 2 replaces nixl._api.nixlBind.nixlAgent", "nixl"),
    Calls(method(NIXL_AGENT, "__init__"), "nixlBind.nixlAgent", "fix 2 wraps this call"),
    SetsAttribute(method(NIXL_AGENT, "__init__"), "pthrDelay", "fix 2 overrides this field"),
    # Request attributes the connector reads.
    Attribute(REQUEST, "kv_transfer_params", "fix 3, reports, P-side verification"),
    Attribute(REQUEST, "num_prompt_tokens", "reports"),
    Attribute(REQUEST, "num_output_tokens", "reports"),
    Attribute(REQUEST, "prompt_token_ids", "P-side verification, D-side fingerprints"),
    Attribute(REQUEST, "output_token_ids", "D-side fingerprints"),
    Attribute(REQUEST, "num_computed_tokens", "D-side fingerprints"),
    # kv_transfer_params keys the connector and the router rely on.
    Mentions(method(SCHEDULER, "get_num_new_matched_tokens"), "kv_transfer_params",
             "P-side verification edits request.kv_transfer_params before super()"),
    ParamsKey(method(SCHEDULER, "update_state_after_alloc"), "_remote_blocks_processed",
              "writes", "fix 3 reads the mark"),
    ParamsKey(method(SCHEDULER, "get_num_new_matched_tokens"), "do_remote_decode", "reads",
              "a D->P pull is params with do_remote_decode"),
    ParamsKey(method(SCHEDULER, "get_num_new_matched_tokens"), "remote_block_ids", "reads",
              "the router caps remote_block_ids"),
    ParamsKey(method(SCHEDULER, "get_num_new_matched_tokens"), "remote_num_tokens", "reads",
              "the router caps remote_num_tokens"),
    *(
        ParamsKey(method(SCHEDULER, "request_finished"), key, "writes",
                  "kvrelay.core.params parses it from P's and D's params")
        for key in ("do_remote_prefill", "do_remote_decode", "remote_block_ids",
                    "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                    "remote_num_tokens")
    ),
    # A D run data parallel behind one URL (the router's core.engine_group).
    Mentions(method(ENGINE_CORE_PROC, "run_engine_core"), "_dp",
             "each rank's engine id is the configured one + _dp<rank>: the router groups them"),
    Mentions(method(COMPLETION_SERVING, "_create_completion"), "_get_data_parallel_rank",
             "an engine check asks one rank of a data-parallel D"),
    Mentions(method(COMPLETION_SERVING, "_get_data_parallel_rank"), "X-data-parallel-rank",
             "the header the router names a rank with (follow-ups, engine checks)"),
    Mentions(method(INPUT_PROCESSOR, "process_inputs"), "local_engines_only",
             "the header indexes the server's own engines: ranks are named only to a D "
             "seen as rank 0 (core.engine_group.addressable)"),
    # Retention on D (docs/vllm-versions.md, "Retention hooks"): accounting.
    Hook(CONNECTOR, "bind_kv_cache_manager", ("kv_cache_manager",),
         "retention reads the watermark and the block pool", V1_CONNECTORS),
    Hook(CONNECTOR, "bind_gpu_block_pool", ("gpu_block_pool",),
         "retention reads D's free blocks", V1_CONNECTORS),
    Calls(method(CORE_SCHEDULER, "__init__"), "self.connector.bind_kv_cache_manager",
          "the scheduler hands the connector its cache manager"),
    Calls(method(CONNECTOR_BASE, "bind_kv_cache_manager"), "self.bind_gpu_block_pool",
          "binding the cache manager binds its block pool"),
    Attribute(KV_CACHE_MANAGER, "block_pool", "retention reads D's free blocks"),
    Attribute(KV_CACHE_MANAGER, "watermark_blocks", "a waiting request needs the watermark too"),
    Hook(BLOCK_POOL, "get_num_free_blocks", (), "retention reads D's free blocks", "vllm.v1"),
    Hook(CONNECTOR, "update_connector_output", ("connector_output",),
         "retention forgets a turn whose blocks vLLM freed"),
    Calls(method(CORE_SCHEDULER, "_update_from_kv_xfer_finished"),
          "self.connector.update_connector_output",
          "the connector sees finished_sending before the scheduler frees the blocks"),
    Attribute(CONNECTOR_OUTPUT, "finished_sending", "retention forgets freed turns"),
    Attribute(REQUEST, "request_id", "retention keys turns by D's request id"),
    Attribute(REQUEST, "num_tokens", "retention sizes a waiting request's blocks"),
    Attribute(REQUEST, "block_hashes", "a waiting request's prefix-cache hit is looked up"),
    Hook(BLOCK_POOL, "get_cached_block", ("block_hash", "kv_cache_group_ids"),
         "hit blocks another request holds need no release", "vllm.v1"),
    Attribute(KV_CACHE_BLOCK, "ref_cnt",
              "a hit block in the free queue (0) takes a free one; a release frees only "
              "the blocks no other request holds"),
    Attribute(KV_CACHE_BLOCK, "is_null", "the null block is never freed"),
    Attribute(BLOCK_POOL, "blocks", "holder counts are read block by block"),
    Attribute(KV_CACHE_CONFIG, "kv_cache_groups", "hits are looked up in a single group only"),
    Mentions(method(CORE_SCHEDULER, "schedule"), "block_aligned_local",
             "the connector is given the waiting request's local prefix-cache hit"),
    # Retention: a turn's own deadline, and releases through vLLM's TTL path.
    Attribute(SCHEDULER, "decoder_kv_blocks_ttl", "kvrelay_retain_s is clamped to D's TTL"),
    Attribute(SCHEDULER, "_reqs_need_send", "a turn's deadline and a release are set here"),
    ParamsKey(method(SCHEDULER, "request_finished"), "remote_blocks_expiry_time", "writes",
              "D stamps a turn's own deadline in the params it returns"),
    Hook(CONNECTOR, "build_connector_meta", ("scheduler_output",),
         "releases are handed to vLLM before the step's metadata is built"),
    Mentions(method(SCHEDULER, "build_connector_meta"), "reqs_to_send",
             "the scheduler sends each deadline to the worker"),
    Mentions(method(WORKER, "start_load_kv"), "reqs_to_send",
             "the worker takes the latest deadline of each request"),
    Calls(method(BASE_WORKER, "get_transfer_results"), "self._reap_expired_send_leases",
          "the worker's expiry sweep frees a released turn"),
    Mentions(method(WORKER, "_is_turn2_read_expired"), "blocks_expiry_time",
             "P declines a read near the deadline stamped in the params"),
    # Retention: pressure makes the scheduler wait instead of preempting.
    Hook(CONNECTOR, "has_pending_block_frees", (),
         "a running request waits for a release instead of being preempted", V1_CONNECTORS),
    Calls(method(CORE_SCHEDULER, "schedule"), "self.connector.has_pending_block_frees",
          "the scheduler asks before it preempts"),
    Calls(method(CORE_SCHEDULER, "schedule"), "self.connector.get_num_new_matched_tokens",
          "a waiting request is sized before its allocation"),
    Mentions(method(CORE_SCHEDULER, "schedule"), "ext_tokens",
             "a None answer skips the waiting request for this step"),
    # A stock D's turn released through P (router.stock_release): a prompt too short to pull.
    Mentions(method(SCHEDULER, "get_num_new_matched_tokens"), "kv_recompute_threshold",
             "P pulls nothing of a span below the threshold"),
    Mentions(method(SCHEDULER, "update_state_after_alloc"), "_reqs_need_recv",
             "P queues the read of D's params even with nothing to pull"),
    Calls(method(WORKER, "_read_blocks"), "self.nixl_wrapper.send_notif",
          "an empty read still notifies D, which frees its turn"),
)


@dataclass(frozen=True)
class Fact:
    """Something a release does that decides a fix or the wire format (not a requirement)."""

    label: str
    value: bool | None
    where: str


def facts(ctx: Context) -> list[Fact]:
    """Read the release: which fixes it still needs and what it sends to the router."""
    return [
        _pins_main_thread(ctx),
        _nixl_busy_polls(ctx),
        _scheduler_skips_processed_pull(ctx),
        _keyword_in_call(ctx, "vllm.entrypoints.openai.chat_completion.serving",
                         "ChatCompletionStreamResponse", "kv_transfer_params",
                         "streamed chat responses carry kv_transfer_params (final chunk)"),
        _keyword_in_call(ctx, "vllm.entrypoints.openai.completion.serving",
                         "CompletionStreamResponse", "kv_transfer_params",
                         "streamed completions carry kv_transfer_params (final chunk)"),
        _writes_key(ctx, method(SCHEDULER, "request_finished"), "remote_registration_generation",
                    "params carry remote_registration_generation"),
        _writes_key(ctx, FunctionRef("vllm.v1.core.sched.scheduler",
                                     "Scheduler.update_from_output"),
                    "remote_prefill_cached_tokens",
                    "the scheduler adds remote_prefill_cached_tokens to P's params"),
    ]


PINS_MAIN_THREAD = "the NIXL worker re-pins its main thread (fix 1 needed on cpu)"
NIXL_BUSY_POLLS = "nixl hard-codes pthrDelay = 0 (fix 2 useful on cpu)"
SKIPS_PROCESSED = "the pull scheduler skips processed D->P params (fix 3 upstream)"


def fix_facts(ctx: Context, device_type: str) -> FixFacts:
    """The facts ``kvrelay.vllm_plugin.fixes.plan_fixes`` decides from."""
    return FixFacts(
        device_type=device_type,
        worker_pins_main_thread=_pins_main_thread(ctx).value,
        nixl_busy_polls=_nixl_busy_polls(ctx).value,
        scheduler_skips_processed_pull=_scheduler_skips_processed_pull(ctx).value,
    )


def _line_fact(
    ctx: Context, label: str, where: FunctionRef, find: Callable[[Located], int | None]
) -> Fact:
    """A fact that holds when a line of function ``where`` meets ``find`` (its number, ``None``
    if none does); unknown when ``where`` is missing."""
    try:
        fn = ctx.function(where)
    except Missing as exc:
        return Fact(label, None, str(exc))
    line = find(fn)
    return Fact(label, line is not None,
                f"{fn.module.relpath}:{line}" if line is not None else fn.where)


def _pins_main_thread(ctx: Context) -> Fact:
    def pins(fn: Located) -> int | None:
        return next((call.lineno for call in calls(fn.node)
                     if _callee(call.func) == "os.sched_setaffinity" and call.args
                     and isinstance(call.args[0], ast.Constant) and call.args[0].value == 0),
                    None)

    return _line_fact(ctx, PINS_MAIN_THREAD, method(BASE_WORKER, "__init__"), pins)


def _nixl_busy_polls(ctx: Context) -> Fact:
    return _line_fact(ctx, NIXL_BUSY_POLLS, method(NIXL_AGENT, "__init__"),
                      lambda fn: _attribute_store_line(fn.node, "pthrDelay", value=0))


def _scheduler_skips_processed_pull(ctx: Context) -> Fact:
    return _line_fact(ctx, SKIPS_PROCESSED, method(SCHEDULER, "get_num_new_matched_tokens"),
                      lambda fn: mentions(fn.node, "_remote_blocks_processed"))


def _keyword_in_call(ctx: Context, module_name: str, callee: str, keyword: str,
                     label: str) -> Fact:
    module = ctx.vllm.module(module_name)
    if module is None:
        return Fact(label, None, f"{module_name} not found")
    for call in calls(module.node):
        for kw in call.keywords:
            if _callee(call.func) == callee and kw.arg == keyword:
                return Fact(label, True, f"{module.relpath}:{kw.lineno}")
    return Fact(label, False, module.relpath)


def _writes_key(ctx: Context, where: FunctionRef, key: str, label: str) -> Fact:
    return _line_fact(ctx, label, where, lambda fn: _params_key_line(fn.node, key, "writes"))


def _callee(func: ast.expr) -> str | None:
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call)
            and dotted(func.value.func) == "super"):
        return f"super().{func.attr}"
    return dotted(func)


def _attribute_line(cls: Located, name: str) -> int | None:
    assert isinstance(cls.node, ast.ClassDef)
    for stmt in cls.node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
            return stmt.lineno
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign):
            targets = [stmt.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return stmt.lineno
    for stmt in cls.node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(stmt):
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                        and node.attr == name and isinstance(node.value, ast.Name)
                        and node.value.id == "self"):
                    return node.lineno
    return None


def _attribute_store_line(fn: ast.AST, attr: str, value: object | None) -> int | None:
    """Line of ``x.attr = ...`` in ``fn`` (with ``value`` given: ``x.attr = <value>``)."""
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        if not any(isinstance(t, ast.Attribute) and t.attr == attr for t in node.targets):
            continue
        if value is None or (isinstance(node.value, ast.Constant) and node.value.value == value):
            return node.lineno
    return None


def _params_key_line(fn: ast.AST, key: str, use: Literal["reads", "writes"]) -> int | None:
    for node in ast.walk(fn):
        if use == "writes":
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.slice, ast.Constant) and node.slice.value == key):
                return node.lineno
            if (isinstance(node, ast.Call) and dotted(node.func) == "dict"
                    and any(k.arg == key for k in node.keywords)):
                return next(k.value.lineno for k in node.keywords if k.arg == key)
            if isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value == key for k in node.keys
            ):
                return node.lineno
        else:
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == key):
                return node.lineno
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                    and isinstance(node.slice, ast.Constant) and node.slice.value == key):
                return node.lineno
    return None


def _numeric(version: str) -> tuple[int, ...]:
    match = re.match(r"[0-9]+(\.[0-9]+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


@dataclass(frozen=True)
class Report:
    source: str
    vllm_version: str | None
    connector_version: int | None
    nixl: str
    findings: list[Finding]
    facts: list[Fact]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]


def check(ctx: Context, contract: Sequence[Requirement] = CONTRACT) -> Report:
    return Report(
        source=ctx.vllm.tree.label,
        vllm_version=_module_value(ctx.vllm, "vllm._version", "__version__", str),
        connector_version=_module_value(ctx.vllm, f"{NIXL_PACKAGE}.metadata",
                                        "NIXL_CONNECTOR_VERSION", int),
        nixl=(f"nixl {ctx.nixl_version} ({ctx.nixl.tree.label})" if ctx.nixl is not None
              else "nixl not installed"),
        findings=[_finding(ctx, requirement) for requirement in contract],
        facts=facts(ctx),
    )


def _finding(ctx: Context, requirement: Requirement) -> Finding:
    try:
        return requirement.check(ctx)
    except Missing as exc:
        return Finding(False, requirement.what, str(exc), requirement.why)


def _module_value(index: PyIndex, module_name: str, name: str, kind: type[_T]) -> _T | None:
    module = index.module(module_name)
    found = module_constant(module, name) if module is not None else None
    return found[0] if found is not None and isinstance(found[0], kind) else None


def format_report(report: Report) -> str:
    lines = [
        f"vLLM {report.vllm_version or '(unknown version)'} from {report.source}",
        f"NIXL_CONNECTOR_VERSION {report.connector_version}; {report.nixl}",
        "",
    ]
    for f in report.findings:
        lines.append(f"{'ok  ' if f.ok else 'FAIL'}  {f.what}: {f.detail}"
                     + ("" if f.ok else f"  [needed because: {f.why}]"))
    lines += ["", "facts:"]
    for fact in report.facts:
        value = {True: "yes", False: "no", None: "unknown"}[fact.value]
        lines.append(f"  {fact.label}: {value} ({fact.where})")
    bad = report.failures
    lines.append("")
    lines.append(f"contract: {len(report.findings) - len(bad)}/{len(report.findings)} ok"
                 + (f"; FAILED: {', '.join(f.what for f in bad)}" if bad else ""))
    return "\n".join(lines)


def vllm_tree(path: Path) -> SourceTree:
    """A vLLM wheel, a directory holding the ``vllm`` package, or the package itself."""
    if path.is_file() and path.suffix == ".whl":
        return WheelTree(path)
    if (path / "vllm" / "__init__.py").is_file():
        return DirectoryTree(path)
    if path.name == "vllm" and (path / "__init__.py").is_file():
        return DirectoryTree(path.parent)
    raise ValueError(f"{path} is neither a vLLM wheel nor a directory with the vllm package")


def installed_root(package: str) -> Path | None:
    """The directory holding an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


#: Backends the ``nixl`` meta package installs as ``nixl._api``, in the order it tries them.
NIXL_BACKENDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def installed_nixl() -> tuple[SourceTree | None, str | None]:
    """The nixl package installed here as a tree where ``nixl/_api.py`` is the module that
    ``import nixl._api`` really loads, and its version."""
    root = installed_root("nixl")
    if root is None:
        return None, None
    tree = DirectoryTree(root)
    backend = next((b for b in NIXL_BACKENDS if (root / b / "_api.py").is_file()), None)
    version: str | None
    try:
        version = importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if backend is None:
        return tree, version
    return RedirectedTree(tree, (("nixl/_api.py", f"{backend}/_api.py"),)), version


def installed_context() -> Context:
    root = installed_root("vllm")
    if root is None:
        raise ValueError("vllm is not installed in this Python")
    nixl, nixl_version = installed_nixl()
    return Context(DirectoryTree(root), nixl, nixl_version)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvrelay.vllm_plugin.contract",
        description="Check that a vLLM release provides what kvrelay's connector needs, "
        "by reading its sources (nothing is imported from it).",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", help="a vLLM release on PyPI, e.g. 0.33.0 (wheel cached)")
    which.add_argument("--source", type=Path, help="a vLLM wheel or source directory")
    which.add_argument("--installed", action="store_true", help="the vLLM installed here")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="wheel cache (default: $KVRELAY_VLLM_WHEELS or "
                        "~/.cache/kvrelay/vllm-wheels)")
    parser.add_argument("--no-download", action="store_true",
                        help="with --version: fail instead of downloading a missing wheel")
    args = parser.parse_args(argv)

    try:
        if args.installed:
            ctx = installed_context()
        else:
            if args.version is not None:
                cache = args.cache_dir or wheel_cache_dir()
                path = find_wheel(validate_version(args.version), cache)
                if path is None and args.no_download:
                    raise ValueError(f"vllm {args.version} is not in {cache}")
                if path is None:
                    print(f"downloading vllm=={args.version} into {cache} ...", file=sys.stderr)
                    path = download_wheel(args.version, cache)
            else:
                path = args.source
            nixl, nixl_version = installed_nixl()
            ctx = Context(vllm_tree(path), nixl, nixl_version)
    except (ValueError, WheelDownloadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = check(ctx)
    print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
