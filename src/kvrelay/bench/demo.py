"""The short benchmark ``make demo`` shows: a few agent sessions and a small context sweep
against a router that is already running (in front of an already-started cluster).

    summary = run_demo("http://127.0.0.1:8000", Path("results/demo"))
    print(summary.markdown)

Sized for the ``tiny`` model on CPU (seconds, not minutes): 3 conversations x 5 turns of
150-token user turns and 64-token answers with ~0.2 s think time, then a sweep at 1k, 2k and
4k tokens, one conversation each. Both land in ``out_dir`` (``agent.*`` and ``sweep.*``,
see ``report``). Use ``run_demo_async`` from inside an event loop.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvrelay.bench.metrics import ModeSummary
from kvrelay.bench.report import BenchResults, ModeRun, write_report
from kvrelay.bench.runner import BenchOptions, bench_router
from kvrelay.bench.tokens import CountTokens, default_counter
from kvrelay.bench.workloads import Pacing, ThinkTime, agent_workload, sweep_workload


@dataclass(frozen=True)
class DemoSummary:
    """The demo's outcome: the Markdown of both reports, files written, both summaries."""

    markdown: str
    out_dir: Path
    files: tuple[Path, ...]
    agent: ModeSummary
    sweep: ModeSummary

    @property
    def errors(self) -> int:
        return self.agent.errors + self.sweep.errors


async def run_demo_async(
    router_url: str,
    out_dir: str | Path,
    *,
    mode: str = "pull",
    model: str = "tiny",
    served_model_name: str | None = None,
    conversations: int = 3,
    turns: int = 5,
    lengths: Sequence[int] = (1024, 2048, 4096),
    think_mean_s: float = 0.2,
    count_tokens: CountTokens | None = None,
    seed: int = 0,
    salt: str | None = None,
    charts: bool = True,
    progress: TextIO | None = None,
) -> DemoSummary:
    """Run the demo against ``router_url`` (see the module docstring); ``mode`` labels the
    results, ``model`` picks the token counter (and the served name unless given)."""
    out = Path(out_dir)
    salt = salt if salt is not None else secrets.token_hex(3)
    count = count_tokens or default_counter(model)
    name = served_model_name or model
    options = BenchOptions(id_prefix=f"demo-{salt}-", progress=progress)
    meta = {"model": name, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "salt": salt,
            "router_url": router_url}
    agent = agent_workload(
        count, conversations=conversations, turns=turns, system_tokens=512, user_tokens=150,
        answer_tokens=64, pacing=Pacing(ThinkTime("exponential", think_mean_s), 0.1),
        seed=seed, salt=salt,
    )
    sweep = sweep_workload(count, lengths=lengths, conversations_per_length=1, gap_s=0.5,
                           seed=seed, salt=salt)
    summaries: dict[str, ModeSummary] = {}
    markdown: list[str] = []
    files: list[Path] = []
    for workload in (agent, sweep):
        run: ModeRun = await bench_router(workload, mode, router_url, name, options)
        results = BenchResults(workload.kind, dict(workload.params), [run], meta)
        written = write_report(results, out, charts=charts)
        files += [written.json, written.markdown, *written.charts]
        markdown.append(written.markdown.read_text().rstrip())
        summaries[workload.kind] = results.summaries()[mode]
    return DemoSummary("\n\n".join(markdown), out, tuple(files), summaries["agent"],
                       summaries["sweep"])


def run_demo(router_url: str, out_dir: str | Path, **kwargs: Any) -> DemoSummary:
    """Synchronous ``run_demo_async`` (starts its own event loop; keyword arguments as
    there)."""
    return asyncio.run(run_demo_async(router_url, out_dir, **kwargs))
