"""Supervision of local servers: health wait, startup errors, process-group shutdown, and
children dying with their parent. A stub server stands in for vLLM (see stub_server.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvrelay.cluster.config import ClusterConfig, NodeSpec, RestartPolicy, process_cores
from kvrelay.cluster.launcher import ClusterStartError, LocalCluster, spawn_supervised
from kvrelay.cluster.supervisor import NodeUnit, Supervisor
from tests.ports import free_port_block

STUB = Path(__file__).with_name("stub_server.py")


def stub_command(config: ClusterConfig, node: NodeSpec, model_path: Path) -> list[str]:
    return [sys.executable, str(STUB), "--port", str(node.http_port)]


def fake_model(tmp_path: Path) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return str(model)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def pids_in(d: Path, prefix: str) -> list[int]:
    return [int(p.read_text()) for p in d.glob(f"{prefix}-*")]


def test_start_waits_for_health_and_stop_kills_process_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("STUB_CHILD", "1")
    monkeypatch.setenv("STUB_PID_DIR", str(tmp_path))
    monkeypatch.setenv("STUB_DELAY_S", "1.5")
    config = ClusterConfig(num_prefill=1, num_decode=2, model=fake_model(tmp_path),
                           base_port=free_port_block(3), startup_timeout_s=60)
    cluster = LocalCluster(config, tmp_path / "run", command=stub_command).start()
    assert [n.spec.name for n in cluster.nodes] == ["prefill-0", "decode-0", "decode-1"]
    assert all(n.alive() for n in cluster.nodes)
    assert (tmp_path / "run" / "decode-1.log").read_text().count("stub: serving") == 1
    children = pids_in(tmp_path, "child")
    assert len(children) == 3 and all(alive(p) for p in children)
    cluster.stop()
    assert not any(n.alive() for n in cluster.nodes)
    assert wait_dead(children) == []
    cluster.stop()  # idempotent


def test_what_a_server_leaves_in_its_temp_dir_goes_with_the_cluster(tmp_path, monkeypatch):
    """vLLM leaves its engine's ZMQ sockets and ``vllm_dist_*`` files in the temp dir when it
    is killed; each server's temp dir is the cluster's, removed at stop()."""
    monkeypatch.setenv("STUB_PID_DIR", str(tmp_path))
    config = ClusterConfig(num_prefill=1, num_decode=1, model=fake_model(tmp_path),
                           base_port=free_port_block(2), startup_timeout_s=60)
    cluster = LocalCluster(config, tmp_path / "run", command=stub_command).start()
    left = [Path(p.read_text()) for p in tmp_path.glob("tmp-*")]
    assert len(left) == 2 and all(p.exists() for p in left)
    assert len({p.parent for p in left}) == 2  # one dir per server
    assert all(p.parent.parent.name.startswith("kvrelay-vllm-") for p in left)
    cluster.stop()
    assert not any(p.exists() for p in left)
    assert not left[0].parent.parent.exists()


def test_startup_failure_names_node_and_shows_log_tail(tmp_path, monkeypatch):
    monkeypatch.setenv("STUB_FAIL", "1")
    config = ClusterConfig(model=fake_model(tmp_path), base_port=free_port_block(2),
                           startup_timeout_s=60)
    cluster = LocalCluster(config, tmp_path / "run", command=stub_command)
    with pytest.raises(ClusterStartError) as err:
        cluster.start()
    assert "exited with status 1" in str(err.value)
    assert "simulated startup failure" in str(err.value)
    assert not any(n.alive() for n in cluster.nodes)


def test_startup_timeout_stops_everything(tmp_path, monkeypatch):
    monkeypatch.setenv("STUB_DELAY_S", "30")
    monkeypatch.setenv("STUB_PID_DIR", str(tmp_path))
    config = ClusterConfig(model=fake_model(tmp_path), base_port=free_port_block(2),
                           startup_timeout_s=2)
    cluster = LocalCluster(config, tmp_path / "run", command=stub_command)
    with pytest.raises(ClusterStartError, match="not healthy after 2 s"):
        cluster.start()
    assert wait_dead(pids_in(tmp_path, "server")) == []


def test_unknown_model_is_a_clear_error(tmp_path):
    cluster = LocalCluster(ClusterConfig(model=str(tmp_path / "nope")), tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="not a default size"):
        cluster.start()


def test_servers_die_when_the_launcher_is_killed(tmp_path):
    """SIGKILL the launching process: PR_SET_PDEATHSIG takes its servers down."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from pathlib import Path
        from kvrelay.cluster.config import ClusterConfig
        from kvrelay.cluster.launcher import LocalCluster
        from tests.component.test_launcher import stub_command
        config = ClusterConfig(model={fake_model(tmp_path)!r}, base_port={free_port_block(2)})
        LocalCluster(config, Path({str(tmp_path / "run")!r}), command=stub_command).start()
        print("ready", flush=True)
        time.sleep(600)
    """)
    # a killed launcher cannot remove its scratch dir: let it make that in tmp_path
    env = {**os.environ, "STUB_PID_DIR": str(tmp_path), "TMPDIR": str(tmp_path)}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    assert parent.stdout is not None
    assert parent.stdout.readline().strip() == b"ready"
    servers = pids_in(tmp_path, "server")
    assert len(servers) == 2 and all(alive(p) for p in servers)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_dead(servers) == []


def test_spawned_server_and_its_children_are_pinned_to_the_given_cores(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:1]
    probe = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
             "subprocess.run([sys.executable, '-c', "
             "'import os; print(sorted(os.sched_getaffinity(0)))'])")
    log_path = tmp_path / "probe.log"
    process, log = spawn_supervised([sys.executable, "-c", probe], log_path, dict(os.environ),
                                    cores)
    try:
        assert process.wait(timeout=60) == 0
    finally:
        log.close()
    assert log_path.read_text().splitlines()[1:] == [str(cores), str(cores)]


def test_cpu_nodes_are_pinned_unless_disabled():
    node = NodeSpec(role="prefill", index=0, http_port=1, side_channel_port=2, cores=(1,),
                    gpu=None, prefix_caching=False)
    assert process_cores(ClusterConfig(), node) == (1,)
    assert process_cores(ClusterConfig(pin_processes=False), node) is None
    assert process_cores(ClusterConfig(device="cuda"), node) is None


def test_supervisor_restarts_a_killed_node_and_leaves_the_others_alone(tmp_path, monkeypatch):
    """kill -9 of one node's whole process group: the supervisor starts it again on the same
    port (a new process, logged), the other node keeps its process."""
    monkeypatch.setenv("STUB_CHILD", "1")
    monkeypatch.setenv("STUB_PID_DIR", str(tmp_path))
    config = ClusterConfig(model=fake_model(tmp_path), base_port=free_port_block(2),
                           startup_timeout_s=60)
    cluster = LocalCluster(config, tmp_path / "run", command=stub_command).start()
    said: list[str] = []
    try:
        p, d = cluster.nodes
        p_pid, d_pid = p.process.pid, d.process.pid
        policy = RestartPolicy(initial_backoff_s=0.1)
        supervisor = Supervisor([NodeUnit(cluster, n) for n in cluster.nodes], policy, 60,
                                say=said.append)
        os.killpg(d_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not any(line.startswith("decode-0: back") for line in said):
            assert time.monotonic() < deadline, said
            supervisor.poll()
            time.sleep(0.1)
        assert said[0] == "decode-0: exited with status -9; restarting in 0 s (attempt 1/5)"
        assert d.process.pid != d_pid and d.alive() and cluster.healthy(d)
        assert p.process.pid == p_pid and p.alive()
        log = d.log_path.read_text()
        assert log.count("stub: serving") == 2
        assert "--- kvrelay up: decode-0: restarting (attempt 1/5) ---" in log
    finally:
        cluster.stop()
    assert wait_dead(pids_in(tmp_path, "child")) == []


def test_up_refuses_a_router_config_before_any_engine_starts(monkeypatch, capsys):
    """``kvrelay up --ttl-s 20``: the router refuses a TTL below near-expiry + margin (15 +
    10 s). ``up`` asks the router (``kvrelay route --check-config``) before it starts vLLM,
    so the error comes in seconds and no engine is started (it came after vLLM's startup,
    from the router's log)."""
    import kvrelay.cluster.cli as cluster_cli
    from kvrelay.cli import build_parser

    started: list[object] = []
    monkeypatch.setattr(cluster_cli, "LocalCluster", lambda *a: started.append(a))
    args = build_parser().parse_args(["up", "--ttl-s", "20"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "router refuses its configuration" in err and "ttl_s (20)" in err
    assert started == []


def test_the_router_check_passes_a_valid_config_and_names_a_bad_router_arg():
    from kvrelay.cluster.launcher import check_router

    config = ClusterConfig(decoder_kv_blocks_ttl_s=120)
    check_router(config, 8000, ["--max-entries", "100"])  # valid: returns
    with pytest.raises(ClusterStartError, match="max_in_flight"):
        check_router(config, 8000, ["--max-in-flight=0"])
    with pytest.raises(ClusterStartError, match="--check-config"):
        check_router(config, 8000, ["--check-config"])
