"""``kvrelay tune``'s output files: ``tune.md`` (the recommendation and its reasoning, the
table by TTL, the assumptions), ``tune.json`` (``TuneResult.to_json``) and the charts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvrelay.tune.analyze import TuneResult
from kvrelay.tune.model import GIB, TtlPoint
from kvrelay.tune.recommend import format_ttl

ASSUMPTIONS = (
    "Entries are single-use: a follow-up that pulls consumes the previous turn's KV, and "
    "every turn leaves a new entry (prompt + output tokens) on its D.",
    "D's TTL counts from the end of a turn; a trace's turn ends "
    "`output_length x --decode-s-per-token` after it arrives (0 by default, so gaps are "
    "inter-arrival times); a turn log records the gaps as measured.",
    "A follow-up hits when its gap <= TTL - router margin (`ttl_safety_margin_s + "
    "near_expiry_s` of the router); it is pulled when it also reuses at least "
    "`kv_recompute_threshold` tokens and the cost model says the pull pays.",
    "KV not pulled stays pinned for the whole TTL; pulled KV is freed when its follow-up "
    "arrives. Memory is counted at the exact token count, not rounded to blocks.",
    "Traces: conversations are spread round robin over the D's in order of arrival (the "
    "router keeps a conversation on its D); a turn log says which D held each turn.",
    "Peak, p95 and mean of pinned memory are per D, time-weighted over the trace (first to "
    "last arrival); the busiest D is reported.",
    "Prefill time saved = prefill_s(reused) - pull_s(reused) per pull, with the router's "
    "formulas (core.costs); the new tokens cost the same either way.",
)


@dataclass(frozen=True)
class TuneFiles:
    markdown: Path
    json: Path
    charts: tuple[Path, ...]


def write_report(result: TuneResult, out_dir: Path, *, charts: bool = True) -> TuneFiles:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "tune.json"
    json_path.write_text(json.dumps(result.to_json(), indent=1, allow_nan=False) + "\n")
    md_path = out_dir / "tune.md"
    pngs: list[Path] = []
    if charts:
        from kvrelay.tune.charts import write_charts

        pngs = write_charts(result, out_dir)
    md_path.write_text(markdown_report(result, [p.name for p in pngs]) + "\n")
    return TuneFiles(md_path, json_path, tuple(pngs))


def markdown_report(result: TuneResult, charts: list[str] | None = None) -> str:
    r = result
    gaps = ", ".join(f"{k} {_dur(v)}" for k, v in r.gap_percentiles.items()) or "none"
    c = r.costs
    lines = [
        "# kvrelay tune",
        "",
        f"Input: {', '.join(r.inputs)} ({r.fmt}): {r.num_turns} turns in "
        f"{r.num_conversations} conversations, {r.ceiling.followups} follow-ups, over "
        f"{_dur(r.span_s)}. Gaps from a turn's end to the next turn: {gaps}.",
        "",
        f"KV: {r.kv.bytes_per_token:,.0f} bytes per token ({r.kv.formula}). Cost model: "
        f"{c.source}: prefill {c.prefill_s_per_token * 1e6:.3g} µs/token (attention knee "
        f"{c.attention_knee_tokens} tokens), pull {c.transfer_overhead_s * 1e3:.3g} ms + "
        f"{c.transfer_s_per_token * 1e6:.3g} µs/token. Router margin "
        f"{r.params.router_margin_s:g} s, threshold {r.params.threshold_tokens} tokens, "
        f"pull cost factor {r.params.pull_cost_factor:g}, {r.num_decode_nodes} D node(s).",
        "",
        "## Recommendation",
        "",
    ]
    rec = r.recommendation
    if rec.ttl_s is not None:
        lines.append(f"* **TTL: {format_ttl(rec.ttl_s)}** (`decoder_kv_blocks_ttl` on D, "
                     f"`kvrelay route --ttl-s {rec.ttl_s:g}`). " + " ".join(rec.reasoning))
    else:
        head = "none fits" if rec.rule == "budget" else "no recommendation"
        lines.append(f"* **TTL: {head}.** " + " ".join(rec.reasoning))
    if r.threshold_tokens is not None:
        n = r.threshold_tokens
        costs = r.params.costs
        lines.append(
            f"* **Recompute threshold: {n} tokens** (`--kv-recompute-threshold {n}`, and "
            f"`kv_recompute_threshold` on P). Below it the cost model predicts a pull slower "
            f"than recomputing: at {n} tokens pull {costs.pull_s(n) * 1e3:.3g} ms vs prefill "
            f"{costs.prefill_s(n) * 1e3:.3g} ms; at {max(1, n - 1)} pull "
            f"{costs.pull_s(max(1, n - 1)) * 1e3:.3g} ms vs prefill "
            f"{costs.prefill_s(max(1, n - 1)) * 1e3:.3g} ms."
        )
    else:
        lines.append("* **Recompute threshold:** no pull pays under this cost model.")
    p = r.provision
    if p is not None and p.ttl_s is not None and p.point is not None:
        per_d = ", ".join(f"{d.node} {d.peak_gib:.2f}" for d in p.point.decode)
        lines.append(
            f"* **D memory for a {p.target_hit_rate:.0%} hit rate:** TTL >= "
            f"{p.ttl_s:.0f} s pins up to {p.point.peak_gib:.2f} GiB per D (p95 "
            f"{p.point.p95_gib:.2f} GiB; peak by D: {per_d}); provision that much of each "
            "D's KV cache for retention, on top of what running requests need."
        )
    elif p is not None:
        why = ("the input has no follow-ups" if r.ceiling.followups == 0 else
               "too many follow-ups come after turns that retained no KV")
        lines.append(f"* **D memory for a {p.target_hit_rate:.0%} hit rate:** not reachable: "
                     f"{why}.")
    lines += ["", "## By TTL", "", *ttl_table(r), ""]
    if charts:
        lines += ["## Charts", "", *(f"![{name}]({name})" for name in charts), ""]
    lines += ["## Assumptions", "", *(f"* {a}" for a in ASSUMPTIONS)]
    if r.notes:
        lines += ["", "## Notes", "", *(f"* {n}" for n in r.notes)]
    return "\n".join(lines)


def ttl_table(r: TuneResult) -> list[str]:
    rows = [
        "| TTL | hit rate | pull rate | tokens reused | prefill saved (s) | of unlimited | "
        "pinned peak GiB | pinned p95 GiB | pinned mean GiB | expired unused (GiB·h) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ceiling = r.ceiling.time_saved_s
    scale = r.kv.bytes_per_token / GIB / 3600
    for p in r.points:
        mark = " *" if p.ttl_s == r.recommendation.ttl_s else ""
        rows.append(
            f"| {format_ttl(p.ttl_s)}{mark} | {_pct(p.hit_rate)} | {_pct(p.pull_rate)} | "
            f"{p.tokens_reused:,} | {p.time_saved_s:,.1f} | "
            f"{_pct(p.time_saved_s / ceiling if ceiling else None)} | {p.peak_gib:.2f} | "
            f"{p.p95_gib:.2f} | {_mean(p):.2f} | {p.wasted_token_s * scale:,.2f} |"
        )
    u = r.ceiling
    rows.append(f"| unlimited | {_pct(u.hit_rate)} | {_pct(u.pull_rate)} | "
                f"{u.tokens_reused:,} | {u.time_saved_s:,.1f} | 100% | - | - | - | - |")
    return rows


def _mean(p: TtlPoint) -> float:
    return max((d.mean_gib for d in p.decode), default=0.0)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _dur(seconds: float) -> str:
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"
