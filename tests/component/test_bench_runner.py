"""Managed runs: one cluster and one router subprocess per mode, started and stopped in
order; a router that does not come up is reported with its log. The cluster is a stand-in
(URLs only) and the router a stub script speaking the router's HTTP surface."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvrelay.bench.modes import parse_modes
from kvrelay.bench.runner import BenchOptions, run_managed
from kvrelay.bench.tokens import byte_template_counter
from kvrelay.bench.workloads import Pacing, ThinkTime, agent_workload
from kvrelay.cli import main
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.launcher import ServiceProcess, ServiceStartError

STUB_ROUTER = Path(__file__).with_name("bench_stub_router.py")


class FakeClusters:
    """A cluster factory that records configs, and whether each cluster was stopped."""

    def __init__(self):
        self.started = []
        self.stopped = []

    def __call__(self, config, run_dir):
        index = len(self.started)
        self.started.append((config, run_dir))
        clusters = self

        class Handle:
            def __init__(self):
                self.prefill_urls = [f"http://127.0.0.1:1{index}01"]
                self.decode_urls = [f"http://127.0.0.1:1{index}02"]
                self.served_model_name = "tiny"

            def stop(self):
                clusters.stopped.append(index)

        return Handle()


def stub_router_command(mode, prefill_urls, decode_urls, *, host, port, ttl_s):
    cmd = [sys.executable, str(STUB_ROUTER), "--port", str(port)]
    return cmd + (["--direct"] if mode.direct else [])


def small_workload():
    return agent_workload(byte_template_counter, conversations=2, turns=3, system_tokens=300,
                          user_tokens=60, answer_tokens=8,
                          pacing=Pacing(ThinkTime("constant", 0.0), arrival_mean_s=0))


def test_every_mode_gets_its_own_cluster_and_router(tmp_path):
    clusters = FakeClusters()
    base = ClusterConfig(num_prefill=2, model="tiny")
    runs = run_managed(small_workload(), parse_modes("pull,recompute,local,direct"), base,
                       tmp_path, BenchOptions(id_prefix="x-"), cluster_factory=clusters,
                       command_factory=stub_router_command, router_args=["--extra-flag"])
    assert [r.mode for r in runs] == ["pull", "recompute", "local", "direct"]
    assert clusters.stopped == [0, 1, 2, 3]
    configs = [c for c, _ in clusters.started]
    assert [(c.bidirectional, c.prefill_prefix_caching, c.num_prefill) for c in configs] == [
        (True, False, 2), (False, False, 2), (False, True, 1), (True, False, 2)]
    assert [d for _, d in clusters.started] == [tmp_path / m / "cluster" for m in
                                                ("pull", "recompute", "local", "direct")]
    for run in runs:
        assert len(run.records) == 6 and all(r.succeeded for r in run.records)
        assert run.records[0].conversation_id == f"x-{run.mode}-agent-0"
        assert run.info["run_dir"] == str(tmp_path / run.mode)
        log = (tmp_path / run.mode / "router.log").read_text()
        assert log.splitlines()[0].endswith("--extra-flag")  # the command line, as logged
    assert runs[0].info["bidirectional"] is True and runs[2].info["num_prefill"] == 1
    later = [r.action for r in runs[3].records if r.turn > 1]
    assert later == ["direct"] * 4
    assert runs[0].info["router_stats_delta"]["by_action"] == {"pull": 4, "recompute": 2}


def test_a_router_that_exits_is_reported_and_the_cluster_stopped(tmp_path):
    clusters = FakeClusters()

    def crashing(mode, prefill_urls, decode_urls, *, host, port, ttl_s):
        return [sys.executable, "-c", "print('router: bad flag --oops'); raise SystemExit(2)"]

    with pytest.raises(ServiceStartError, match=r"router exited with 2(.|\n)*bad flag --oops"):
        run_managed(small_workload(), parse_modes("pull,recompute"), ClusterConfig(), tmp_path,
                    BenchOptions(), cluster_factory=clusters, command_factory=crashing)
    assert clusters.stopped == [0] and len(clusters.started) == 1


def test_a_router_that_never_answers_times_out_and_is_killed(tmp_path):
    proc = ServiceProcess("router", [sys.executable, "-c", "import time; time.sleep(60)"],
                          ["http://127.0.0.1:9/stats"], tmp_path / "router.log",
                          ready_timeout_s=0.5)
    with pytest.raises(ServiceStartError, match="not ready"):
        proc.start()
    assert proc.process is not None and proc.process.poll() is not None


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "sweep", "--modes", "pull,turbo", "--router-url", "http://x"], "unknown mode"),
    (["bench", "sweep", "--lengths", "50", "--router-url", "http://x"], "below the fixed"),
    (["bench", "replay", "--file", "/nonexistent.json", "--router-url", "http://x"],
     "cannot read"),
])
def test_cli_rejects_bad_arguments_with_status_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
