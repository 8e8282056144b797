"""Benchmark results on disk: a JSON file, a Markdown report and PNG charts per workload.

``write_report(results, out_dir)`` writes, for ``results.workload`` = ``W``:

* ``W.json``: ``{"workload", "params", "meta", "modes": {mode: summary},
  "comparisons": [...], "runs": [{"mode", "info", "records": [...]}]}`` (``load_results``
  reads it back, so reports and charts can be redrawn without rerunning);
* ``W.md``: the Markdown tables of ``markdown_report``;
* ``W_ttft_vs_context.png`` (when some turn has a context length) and
  ``W_ttft_by_turn.png`` (see ``charts``).

Times are seconds in JSON and milliseconds in Markdown.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.bench.charts import write_charts
from kvrelay.bench.metrics import Comparison, Dist, ModeSummary, TurnRecord, compare, summarize

#: The seed's published numbers (Qwen3-32B on GPU), quoted in every report for scale.
SEED_REFERENCE = (
    "Seed reference (Qwen3-32B on GPU, P/D with bidirectional KV transfer): TTFT with reuse "
    "122 ms at 2k -> 460 ms at 24k context; without reuse 158 ms -> 778 ms."
)


@dataclass
class ModeRun:
    """One mode's records plus what it ran on (``info``: cluster, router, /stats delta)."""

    mode: str
    records: list[TurnRecord]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchResults:
    """Every mode's run of one workload."""

    workload: str
    params: dict[str, Any]
    runs: list[ModeRun]
    meta: dict[str, Any] = field(default_factory=dict)

    def summaries(self) -> dict[str, ModeSummary]:
        return {run.mode: summarize(run.mode, self.workload, run.records) for run in self.runs}

    def comparisons(self) -> list[Comparison]:
        return compare(self.summaries())

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "params": self.params,
            "meta": self.meta,
            "modes": {m: s.to_json() for m, s in self.summaries().items()},
            "comparisons": [c.to_json() for c in self.comparisons()],
            "runs": [
                {"mode": r.mode, "info": r.info, "records": [x.to_json() for x in r.records]}
                for r in self.runs
            ],
        }


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    charts: tuple[Path, ...]


def load_results(path: str | Path) -> BenchResults:
    """Read a ``W.json`` written by ``write_report``."""
    data = json.loads(Path(path).read_text())
    return BenchResults(
        workload=data["workload"],
        params=data.get("params") or {},
        meta=data.get("meta") or {},
        runs=[
            ModeRun(r["mode"], [TurnRecord.from_json(x) for x in r["records"]], r.get("info") or {})
            for r in data["runs"]
        ],
    )


def write_report(results: BenchResults, out_dir: str | Path, *, charts: bool = True) -> ReportFiles:
    """Write the JSON, Markdown and (if ``charts``) PNG files; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = results.workload
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(results.to_json(), indent=2, allow_nan=False) + "\n")
    md_path = out / f"{stem}.md"
    md_path.write_text(markdown_report(results) + "\n")
    pngs: list[Path] = []
    if charts:
        pngs = write_charts(results.workload, results.summaries(), out)
    return ReportFiles(json_path, md_path, tuple(pngs))


def markdown_report(results: BenchResults) -> str:
    """The report: per-mode TTFT table, per-context table with ratios (sweeps), per-turn
    means, decisions, and the seed's reference numbers."""
    summaries = results.summaries()
    comparisons = results.comparisons()
    lines = [f"# kvrelay bench: {results.workload}", ""]
    meta = ", ".join(f"{k} {v}" for k, v in results.meta.items() if k in _META_KEYS)
    if meta:
        lines += [meta, ""]
    lines += mode_table(summaries.values())
    context_lines = context_table(summaries, comparisons)
    if context_lines:
        lines += ["", "## TTFT by context length (p50 of the measured turns, ms)", ""]
        lines += context_lines
    turn_lines = turn_table(summaries)
    if turn_lines:
        lines += ["", "## Mean TTFT by turn (ms)", "", *turn_lines]
    lines += ["", "## Decisions", "", *decision_table(summaries.values())]
    overall = [c for c in comparisons if c.overall is not None]
    if overall:
        lines += ["", "Turns >= 2, p50 TTFT ratio: " + ", ".join(
            f"{c.label} {c.overall:.2f}x" for c in overall if c.overall is not None)]
    lines += ["", SEED_REFERENCE]
    return "\n".join(lines)


_META_KEYS = ("model", "engines", "started", "salt", "router_url")


def mode_table(summaries: Iterable[ModeSummary]) -> list[str]:
    rows = [
        "| mode | turns | errors | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TTFT mean ms | "
        "turns>=2 TTFT p50 ms | TPOT p50 ms | e2e p50 s | hit rate | reused tokens (mean) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        rows.append(
            f"| {s.mode} | {s.turns} | {s.errors} | {_ms(s.ttft, 'p50')} | {_ms(s.ttft, 'p90')} "
            f"| {_ms(s.ttft, 'p99')} | {_ms(s.ttft, 'mean')} | {_ms(s.ttft_later_turns, 'p50')} "
            f"| {_ms(s.tpot, 'p50')} | {_s(s.e2e)} | {_pct(s.hit_rate)} "
            f"| {_num(s.reused_tokens_mean)} |"
        )
    return rows


def context_table(
    summaries: dict[str, ModeSummary], comparisons: Sequence[Comparison]
) -> list[str]:
    contexts = sorted({c for s in summaries.values() for c in s.ttft_by_context})
    if not contexts:
        return []
    modes = list(summaries)
    head = ["context", *modes, *(c.label for c in comparisons)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for ctx in contexts:
        cells = [str(ctx)]
        cells += [_ms(summaries[m].ttft_by_context.get(ctx), "p50") for m in modes]
        cells += [_ratio(c.by_context.get(ctx)) for c in comparisons]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def turn_table(summaries: dict[str, ModeSummary]) -> list[str]:
    turns = sorted({t for s in summaries.values() for t in s.ttft_by_turn})
    if not turns:
        return []
    modes = list(summaries)
    rows = ["| turn | " + " | ".join(modes) + " |", "|" + "---:|" * (len(modes) + 1)]
    for t in turns:
        cells = [_num(None if (v := summaries[m].ttft_by_turn.get(t)) is None else v * 1000)
                 for m in modes]
        rows.append(f"| {t} | " + " | ".join(cells) + " |")
    return rows


def decision_table(summaries: Iterable[ModeSummary]) -> list[str]:
    rows = ["| mode | actions | reasons | decided turns >= 2 | reuse rate |",
            "|---|---|---|---:|---:|"]
    for s in summaries:
        actions = ", ".join(f"{k} {v}" for k, v in s.actions.items()) or "-"
        reasons = ", ".join(f"{k} {v}" for k, v in s.reasons.items()) or "-"
        rows.append(f"| {s.mode} | {actions} | {reasons} | {s.decided_later_turns} "
                    f"| {_pct(s.reuse_rate)} |")
    return rows


def _ms(d: Dist | None, attr: str) -> str:
    return "-" if d is None else f"{getattr(d, attr) * 1000:.1f}"


def _s(d: Dist | None) -> str:
    return "-" if d is None else f"{d.p50:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"
