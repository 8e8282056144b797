"""Start, supervise and stop a local vLLM P/D cluster as child processes.

Contract: ``LocalCluster.start()`` returns only when every node answers ``/health`` with 200,
or raises ``ClusterStartError`` naming the node and showing its last log lines; in that case
every node already started is stopped. ``stop()`` terminates every server's whole process
group (vLLM's API server forks an engine core and workers) and is idempotent. Children never
outlive the launcher: each one gets ``PR_SET_PDEATHSIG`` (SIGTERM when the launcher dies,
even by SIGKILL), ``stop()`` runs at interpreter exit, and SIGTERM/SIGINT are turned into a
clean stop by ``kvrelay up``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

from kvrelay.cluster.config import (
    ClusterConfig,
    NodeSpec,
    block_size_of,
    plan_nodes,
    process_cores,
    router_command,
    served_model_name,
    server_command,
    server_env,
    tool_call_parser_for,
)
from kvrelay.models import MODEL_SPECS, ensure_model

_PR_SET_PDEATHSIG = 1


class ClusterStartError(RuntimeError):
    """A node did not become healthy; the message holds the tail of its log."""


@dataclass
class RunningNode:
    """A started server: its spec, its process and where it logs."""

    spec: NodeSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    url: str

    @property
    def side_channel(self) -> str:
        return f"{self.url.split('//')[1].split(':')[0]}:{self.spec.side_channel_port}"

    def alive(self) -> bool:
        return self.process.poll() is None


def resolve_model(model: str) -> Path:
    """A generated default model size, or an existing local model directory."""
    if model in MODEL_SPECS:
        return ensure_model(model)
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"--model {model!r}: not a default size ({', '.join(MODEL_SPECS)}) "
            "and not a local model directory with a config.json"
        )
    return path


def model_type_of(model_path: Path) -> str | None:
    """``model_type`` from the model directory's ``config.json`` (``None`` if unreadable)."""
    try:
        data = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    return model_type if isinstance(model_type, str) else None


def default_run_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"cluster-{stamp}-{os.getpid()}"


CommandFactory = Callable[[ClusterConfig, NodeSpec, Path], list[str]]


class LocalCluster:
    """A supervised set of vLLM servers described by a ``ClusterConfig``.

    ``command`` builds each node's command line (default: the vLLM OpenAI server); tests
    replace it with a stub server to exercise supervision without vLLM.
    """

    def __init__(
        self,
        config: ClusterConfig,
        run_dir: Path | None = None,
        command: CommandFactory = server_command,
    ) -> None:
        self.config = config
        self.run_dir = run_dir or default_run_dir()
        self._command = command
        self.nodes: list[RunningNode] = []
        self.model_path: Path | None = None
        self._log_files: dict[str, IO[bytes]] = {}
        self._scratch: str | None = None
        self._stopped = False

    @property
    def prefill(self) -> list[RunningNode]:
        return [n for n in self.nodes if n.spec.role == "prefill"]

    @property
    def decode(self) -> list[RunningNode]:
        return [n for n in self.nodes if n.spec.role == "decode"]

    @property
    def served_model_name(self) -> str:
        assert self.model_path is not None
        return served_model_name(self.config, self.model_path)

    def start(self) -> LocalCluster:
        """Spawn every node and wait until all are healthy (see the module contract).

        Resolves ``tool_call_parser="auto"`` against the model first, so ``self.config``
        holds the parser every node runs with (``"none"`` when the family has none known).
        """
        self.model_path = resolve_model(self.config.model)
        parser = tool_call_parser_for(self.config.tool_call_parser, model_type_of(self.model_path))
        self.config = dataclasses.replace(self.config, tool_call_parser=parser or "none")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # short (a ZMQ socket path must fit in 107 bytes), ours, gone at stop()
        self._scratch = tempfile.mkdtemp(prefix="kvrelay-vllm-")
        atexit.register(self.stop)
        try:
            for spec in plan_nodes(self.config):
                self.nodes.append(self._spawn(spec, self.model_path))
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate every node's process group; SIGKILL what is left after ``timeout_s``."""
        if self._stopped:
            return
        self._stopped = True
        for node in self.nodes:
            _signal_group(node.process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            remaining = max(0.1, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=remaining)
            _signal_group(node.process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=5)
        for f in self._log_files.values():
            f.close()
        self._log_files.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        atexit.unregister(self.stop)

    def respawn(self, node: RunningNode) -> None:
        """Start ``node`` again with the same spec, ports and log file, and return at once.

        What is left of its previous process group (a vLLM engine core whose API server
        died, say) is killed first, so the ports and the KV cache memory are free. The
        caller waits for ``/health`` (``kvrelay up``'s supervisor does).
        """
        if self._stopped or self.model_path is None:
            raise RuntimeError("respawn() needs a started, not stopped, cluster")
        stop_group(node.process, timeout_s=0.0)
        old_log = self._log_files.pop(node.spec.name, None)
        if old_log is not None:
            old_log.close()
        fresh = self._spawn(node.spec, self.model_path)
        node.process = fresh.process

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def healthy(self, node: RunningNode) -> bool:
        """``node`` answers ``GET /health`` with 200 right now."""
        return _healthy(node.url)

    def log_tail(self, node: RunningNode, num_lines: int = 40) -> str:
        return log_tail(node.log_path, num_lines)

    def _spawn(self, spec: NodeSpec, model_path: Path) -> RunningNode:
        log_path = self.run_dir / f"{spec.name}.log"
        cmd = self._command(self.config, spec, model_path)
        base = dict(os.environ)
        # the server's TMPDIR is our scratch dir; torch's compile cache stays where it was
        # (its default is under the temp dir), so the next start still finds it
        base.setdefault("TORCHINDUCTOR_CACHE_DIR", str(
            Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"))
        scratch = None
        if self._scratch is not None:
            scratch = os.path.join(self._scratch, spec.name)
            os.makedirs(scratch, exist_ok=True)
        env = server_env(self.config, spec, base, scratch)
        process, log = spawn_supervised(cmd, log_path, env, process_cores(self.config, spec))
        self._log_files[spec.name] = log
        url = f"http://{self.config.host}:{spec.http_port}"
        return RunningNode(spec=spec, process=process, log_path=log_path, url=url)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        pending = list(self.nodes)
        while pending:
            for node in list(pending):
                if not node.alive():
                    tail = self.log_tail(node)
                    headline = error_line(tail)
                    raise ClusterStartError(
                        f"{node.spec.name} exited with status {node.process.returncode} "
                        f"during startup{': ' + headline if headline else ''}\n"
                        f"last lines of {node.log_path}:\n{tail}"
                    )
                if _healthy(node.url):
                    pending.remove(node)
            if not pending:
                return
            if time.monotonic() > deadline:
                node = pending[0]
                raise ClusterStartError(
                    f"{node.spec.name} not healthy after {self.config.startup_timeout_s:.0f} s; "
                    f"last lines of {node.log_path}:\n{self.log_tail(node)}"
                )
            time.sleep(1.0)


class ServiceStartError(ClusterStartError):
    """A supervised service (router, fake engines) exited or did not answer in time; the
    message holds the tail of its log."""


class ServiceProcess:
    """One supervised child service: own process group, dies with us, logs to a file.

    ``start()`` returns once every URL in ``ready_urls`` answers 200, or raises
    ``ServiceStartError`` (the process is then stopped). ``stop()`` is idempotent.
    ``url`` is where clients reach the service, if it has one.
    """

    def __init__(self, name: str, command: list[str], ready_urls: list[str], log_path: Path,
                 ready_timeout_s: float = 60.0, url: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.command = list(command)
        self.ready_urls = list(ready_urls)
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.url = url
        self._env = env
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> ServiceProcess:
        self.spawn()
        assert self.process is not None
        try:
            self._wait_ready(self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self) -> None:
        """Start the process (after killing what is left of a previous one) and return at
        once; ``ready()`` says when it answers."""
        if self.process is not None:
            stop_group(self.process, timeout_s=0.0)
        if self._log is not None:
            self._log.close()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process, self._log = spawn_supervised(
            self.command, self.log_path, self._env or dict(os.environ)
        )

    def ready(self) -> bool:
        """Every URL in ``ready_urls`` answers 200 right now."""
        return all(_get_ok(url) for url in self.ready_urls)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is not None:
            stop_group(self.process, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(self.ready_urls)
        while pending:
            if process.poll() is not None:
                raise ServiceStartError(
                    f"{self.name} exited with {process.returncode}; "
                    f"log {self.log_path}:\n{log_tail(self.log_path, 30)}"
                )
            if _get_ok(pending[0]):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"{self.name} not ready after {self.ready_timeout_s:.0f} s ({pending[0]}); "
                    f"log {self.log_path}:\n{log_tail(self.log_path, 30)}"
                )
            time.sleep(0.2)


def _router_command(config: ClusterConfig, prefill_urls: list[str], decode_urls: list[str],
                    port: int, extra: list[str]) -> list[str]:
    return router_command(
        prefill_urls, decode_urls, host=config.host, port=port,
        ttl_s=config.decoder_kv_blocks_ttl_s, block_size=block_size_of(config),
        kv_recompute_threshold=config.kv_recompute_threshold, python=config.python,
        extra=extra, learned_retention=config.retention != "stock",
    )


def check_router(config: ClusterConfig, port: int, extra: list[str]) -> None:
    """Raise ``ClusterStartError`` with the router's own error unless the router that
    ``start_router`` would start accepts its configuration (``kvrelay route --check-config``,
    in a child process: the cluster does not import the router). Run before the engines
    start, so that a bad ``--router-arg`` or a ``--ttl-s`` the router refuses is told in
    seconds, not after vLLM's minute of startup."""
    if "--check-config" in extra:
        raise ClusterStartError("--router-arg=--check-config would make the router exit")
    urls = {role: [f"http://{config.host}:{n.http_port}" for n in plan_nodes(config)
                   if n.role == role] for role in ("prefill", "decode")}
    cmd = _router_command(config, urls["prefill"], urls["decode"], port, extra)
    done = subprocess.run([*cmd, "--check-config"], capture_output=True, text=True,
                          timeout=120, check=False)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise ClusterStartError(f"the router refuses its configuration: "
                                f"{lines[-1] if lines else f'exit {done.returncode}'}")


def start_router(
    config: ClusterConfig, cluster: LocalCluster, port: int, extra: list[str]
) -> ServiceProcess:
    """Start ``kvrelay route`` in front of ``cluster`` and wait until it answers /health.
    With ``--retention stock`` D keeps every turn its TTL whatever it is told, so the router
    learns no retention times (``--no-learned-retention``): its entries last as long as D's
    blocks do."""
    cmd = _router_command(config, [n.url for n in cluster.prefill],
                          [n.url for n in cluster.decode], port, extra)
    url = f"http://{config.host}:{port}"
    return ServiceProcess("router", cmd, [f"{url}/health"], cluster.run_dir / "router.log",
                          url=url).start()


def spawn_supervised(
    cmd: list[str], log_path: Path, env: dict[str, str], cores: Sequence[int] | None = None
) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """Start ``cmd`` in its own process group, logging to ``log_path``, dying with us.

    ``cores``: CPU affinity of the process and everything it starts (inherited), e.g. a vLLM
    CPU server's API server, engine core and worker. The caller owns the returned log file
    and stops the group with ``stop_group``.
    """
    log = open(log_path, "ab")  # noqa: SIM115 - returned to the caller, who closes it
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    process = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent if cores is None else partial(_prepare_child, tuple(cores)),
    )
    return process, log


def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM ``process``'s group, then SIGKILL whatever is left after ``timeout_s``."""
    _signal_group(process, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout_s)
    _signal_group(process, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on ``host`` right now (bind to port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the OS says are free on ``host`` right now: all are bound at
    once while they are picked, so two of them are never the same (``free_port`` twice can
    answer one port twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port_block(size: int, start: int = 20000, stop: int = 60000) -> int:
    """First port ``p`` in [start, stop) such that p..p+size-1 can all be bound right now."""
    port = start
    while port + size < stop:
        socks: list[socket.socket] = []
        try:
            for p in range(port, port + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            port += size + 7
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {size} free ports in [{start}, {stop})")


def _healthy(url: str) -> bool:
    return _get_ok(f"{url}/health")


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _prepare_child(cores: tuple[int, ...]) -> None:
    _die_with_parent()
    os.sched_setaffinity(0, cores)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def error_line(log_text: str, max_lines: int = 4) -> str | None:
    """The server's own words for why it failed: the last line of its log that states an
    error (``api_server.py: error: ...`` from argparse, ``ValueError: ...`` ending a
    traceback) and the few lines after it (pydantic puts the reason there), or ``None``."""
    lines = log_text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if _ERROR_LINE.search(lines[i]):
            return "\n".join(line.rstrip() for line in lines[i : i + max_lines])
    return None


_ERROR_LINE = re.compile(r"(\berror: |^\w*(Error|Exception): )")


def log_tail(path: Path, num_lines: int) -> str:
    """The last ``num_lines`` lines of a log file (at most its last 64 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read log: {exc})"
    return "\n".join(lines[-num_lines:])
