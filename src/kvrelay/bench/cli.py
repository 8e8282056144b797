"""``kvrelay bench sweep|agent|replay``: multi-turn TTFT benchmarks through the router.

    kvrelay bench sweep --modes pull,recompute,local --model bench --lengths 2048 8192 16384
    kvrelay bench agent --conversations 16 --turns 10 --think-mean-s 30 --ttl-s 60
    kvrelay bench replay --file conversations.json --max-conversations 50
    kvrelay bench replay --trace trace.jsonl --time-scale 30 --ttls 60,300,1200
    kvrelay bench agent --router-url http://127.0.0.1:8000 --mode-label mine
    kvrelay bench retention --conversations 24 --time-scale 32 --decode-kv-blocks 40

Without ``--router-url`` every mode gets its own local cluster (the ``kvrelay up`` flags
apply) and router, one after another. Results go to ``--out`` (JSON, Markdown, PNG); the
Markdown is also printed. Exit status: 0 when every mode ran (even with failed turns, which
the report counts), 1 when a cluster or router did not start or a mode had no successful
turn, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from kvrelay.bench.modes import DEFAULT_MODES
from kvrelay.fakevllm.versions import VLLM_VERSIONS


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help="multi-turn TTFT benchmarks: pull vs recompute vs local",
                           description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = bench.add_subparsers(dest="bench_command", metavar="WORKLOAD", required=True)

    sweep = kinds.add_parser("sweep", help="follow-up TTFT per context length")
    sweep.add_argument("--lengths", type=int, nargs="+",
                       default=[2048, 4096, 8192, 16384, 24576], help="context lengths (tokens)")
    sweep.add_argument("--conversations", type=int, default=3,
                       help="conversations per context length")
    sweep.add_argument("--answer-tokens", type=int, default=32, help="turn 1 max_tokens")
    sweep.add_argument("--user-tokens", type=int, default=64, help="follow-up message tokens")
    sweep.add_argument("--followup-answer-tokens", type=int, default=16)
    sweep.add_argument("--gap-s", type=float, default=1.0,
                       help="pause before the follow-up (lets D's KV report reach the router)")

    agent = kinds.add_parser("agent", help="concurrent agent sessions with think times")
    agent.add_argument("--conversations", type=int, default=16)
    agent.add_argument("--turns", type=int, default=10)
    agent.add_argument("--system-tokens", type=int, default=1024)
    agent.add_argument("--user-tokens", type=int, default=150, help="user/tool turn tokens")
    agent.add_argument("--answer-tokens", type=int, default=300, help="max_tokens per answer")

    replay = kinds.add_parser("replay", help="replay a conversations file (vLLM or ShareGPT), "
                              "or a trace (--trace) against kvrelay tune's predictions")
    source = replay.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", type=Path, help="conversations with their messages")
    source.add_argument("--trace", type=Path,
                        help="a trace or turn log (kvrelay tune's formats): its turns are sent "
                             "with its sizes and gaps, time-scaled, on fake engines, once per "
                             "--ttls; the report compares the hit rate with tune's prediction")
    trace = replay.add_argument_group("--trace")
    trace.add_argument("--time-scale", type=float, default=30.0,
                       help="trace seconds per real second (default 30)")
    trace.add_argument("--ttls", default="60,300,1200",
                       help="D TTLs in trace seconds, one run each (default 60,300,1200)")
    trace.add_argument("--trace-format", default="auto",
                       choices=["auto", "turnlog", "chat", "mooncake", "csv"])
    trace.add_argument("--decode-s-per-token", type=float, default=0.0,
                       help="as for kvrelay tune: a trace's turn ends this x its output after "
                            "it arrives")
    trace.add_argument("--num-gpu-blocks", type=int, default=1 << 16,
                       help="fake engines' KV blocks (128 tokens) each")
    replay.add_argument("--max-conversations", type=int, default=None)
    replay.add_argument("--max-turns", type=int, default=None)
    replay.add_argument("--max-answer-tokens", type=int, default=1024)
    replay.add_argument("--default-answer-tokens", type=int, default=128)

    for parser in (agent, replay):
        parser.add_argument("--think", choices=["exponential", "lognormal", "uniform",
                                                "constant"], default="exponential")
        parser.add_argument("--think-mean-s", type=float, default=5.0)
        parser.add_argument("--think-sigma", type=float, default=1.0, help="lognormal sigma")
        parser.add_argument("--arrival-mean-s", type=float, default=1.0,
                            help="mean gap between conversation starts (0: all at once)")
        parser.add_argument("--concurrency", type=int, default=None,
                            help="conversations in flight at most (default: all)")
    for name, parser in (("sweep", sweep), ("agent", agent), ("replay", replay)):
        _common(parser)
        parser.set_defaults(func=_run, bench_kind=name)
    _retention_parser(kinds)


def _retention_parser(kinds: Any) -> None:
    """``bench retention``: issue #21's benchmark (``bench.retention_bench``)."""
    r = kinds.add_parser(
        "retention", help="managed vs stock vs no retention on fake engines under D memory "
        "pressure (agent sessions over the Messages API: tool calls with heavy-tailed tool "
        "times, replies with heavy-tailed think times, abandoned conversations)")
    r.add_argument("--modes", default="managed,stock,none",
                   help="comma-separated, run in order: managed, stock, none")
    r.add_argument("--conversations", type=int, default=48)
    r.add_argument("--prelude-conversations", type=int, default=128,
                   help="conversations of the same workload (another seed) run unmeasured "
                        "first, so the router's learned retention is a steady state's "
                        "(0: start cold)")
    r.add_argument("--max-turns", type=int, default=8)
    r.add_argument("--abandon-p", type=float, default=0.3,
                   help="probability the user never comes back after a reply")
    r.add_argument("--tool-p", type=float, default=0.8,
                   help="probability a turn's answer is a tool call (default 0.8)")
    r.add_argument("--tool-mean-s", type=float, default=8.0,
                   help="mean tool execution time (lognormal), workload seconds (default 8)")
    r.add_argument("--tool-sigma", type=float, default=1.5,
                   help="tool execution time's lognormal sigma (default 1.5)")
    r.add_argument("--tool-max-s", type=float, default=120.0,
                   help="the tool timeout: execution times are cut to it, workload seconds "
                        "(default 120, Claude Code's Bash default)")
    r.add_argument("--api", choices=["messages", "chat"], default="messages",
                   help="the API the turns go over (default messages, Claude Code's; chat "
                        "only with --tool-p 0: it cannot force tool calls)")
    r.add_argument("--system-tokens", type=int, default=512)
    r.add_argument("--shared-system-tokens", type=int, default=0,
                   help="of the system prompt's tokens, about how many every conversation "
                        "shares (an agent's system prompt and tools; default 0: none)")
    r.add_argument("--user-tokens", type=int, default=96, help="user/tool turn tokens")
    r.add_argument("--answer-tokens", type=int, default=48,
                   help="max_tokens per answer (a tool call's adds its wrapper's tokens)")
    r.add_argument("--think", choices=["exponential", "lognormal", "uniform", "constant"],
                   default="lognormal")
    r.add_argument("--think-mean-s", type=float, default=60.0,
                   help="mean think time, workload seconds (default 60)")
    r.add_argument("--think-sigma", type=float, default=1.5, help="lognormal sigma")
    r.add_argument("--think-max-s", type=float, default=600.0,
                   help="think times above this are cut to it, workload seconds (default "
                        "600: past every TTL, a miss in every mode; bounds the wall time)")
    r.add_argument("--arrival-mean-s", type=float, default=32.0,
                   help="mean gap between conversation starts, workload seconds")
    r.add_argument("--time-scale", type=float, default=32.0,
                   help="workload seconds per real second (think times, arrivals, TTL)")
    r.add_argument("--ttl-s", type=float, default=480.0,
                   help="D's global TTL (stock's, and managed's upper bound), workload seconds")
    r.add_argument("--decode-kv-blocks", type=int, default=40,
                   help="D's KV cache in blocks of 128 tokens")
    r.add_argument("--retention-headroom", type=float, default=None,
                   help="managed D's share of the cache kept free of retention")
    r.add_argument("--fake-latency", choices=["cpu", "fast"], default="cpu")
    r.add_argument("--fake-vllm-version", choices=VLLM_VERSIONS, default="0.32")
    r.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every mode's router (repeatable)")
    r.add_argument("--model", default="tiny", help="tokenizer for sizing the prompts")
    r.add_argument("--out", type=Path, default=None,
                   help="results folder (default results/bench-retention-TIMESTAMP)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--salt", default=None)
    r.add_argument("--tenant", default="default")
    r.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    r.set_defaults(func=_run_retention, bench_kind="retention")


def _run_retention(args: argparse.Namespace) -> int:
    """``bench retention``: run the modes, write JSON and Markdown, print the table."""
    import json

    from kvrelay.bench.hindsight import hindsight, hindsight_line
    from kvrelay.bench.retention_bench import (
        RetentionBenchOptions,
        parse_retention_modes,
        run_retention_bench,
    )
    from kvrelay.bench.retention_report import (
        RetentionSummary,
        check_goals,
        markdown_table,
        summarize_retention,
    )
    from kvrelay.bench.tokens import default_counter
    from kvrelay.bench.workloads import (
        Pacing,
        ThinkTime,
        Workload,
        WorkloadError,
        agent_workload,
    )
    from kvrelay.cluster.launcher import ServiceStartError
    from kvrelay.fakevllm.config import FakeEngineConfig

    try:
        modes = parse_retention_modes(args.modes)
        if not args.time_scale > 0:
            raise ValueError("--time-scale must be > 0")
        if args.api == "chat" and args.tool_p != 0:
            raise ValueError("--api chat cannot force tool calls: use --tool-p 0 with it "
                             "(or --api messages)")
        scale = args.time_scale
        salt = args.salt if args.salt is not None else secrets.token_hex(3)
        pacing = Pacing(ThinkTime(args.think, args.think_mean_s / scale, args.think_sigma,
                                  args.think_max_s / scale),
                        args.arrival_mean_s / scale)
        tool_time = ThinkTime("lognormal", args.tool_mean_s / scale, args.tool_sigma,
                              args.tool_max_s / scale)
        if args.prelude_conversations < 0:
            raise ValueError("--prelude-conversations must be >= 0")
        count = default_counter(args.model)

        def build(conversations: int, seed: int, salt: str) -> Workload:
            return agent_workload(
                count, conversations=conversations, turns=args.max_turns,
                system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                answer_tokens=args.answer_tokens, pacing=pacing, abandon_p=args.abandon_p,
                tool_p=args.tool_p, tool_time=tool_time, seed=seed, salt=salt,
                shared_system_tokens=args.shared_system_tokens)

        workload = build(args.conversations, args.seed, salt)
        prelude = build(args.prelude_conversations, args.seed + 1_000_003, f"{salt}-prelude") \
            if args.prelude_conversations else None
        options = RetentionBenchOptions(
            time_scale=scale, ttl_s=args.ttl_s, decode_kv_blocks=args.decode_kv_blocks,
            retention_headroom=args.retention_headroom, latency=args.fake_latency,
            vllm_version=args.fake_vllm_version, tenant=args.tenant, id_prefix=f"{salt}-",
            extra_body={"ignore_eos": True}, timeout_s=args.timeout_s,
            router_args=tuple(args.router_arg), api=args.api)
    except (ValueError, WorkloadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("results") / f"bench-retention-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"retention: {len(workload.conversations)} conversations, {workload.num_turns} "
          f"turns, modes {','.join(modes)}; results in {out}", file=sys.stderr, flush=True)
    try:
        runs = run_retention_bench(workload, modes, out / "runs", options, prelude=prelude)
    except ServiceStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summaries: dict[str, RetentionSummary] = {
        r.mode: summarize_retention(r.mode, r.run.records, r.trace, scale) for r in runs}
    goals = check_goals(summaries)
    none_run = next((r for r in runs if r.mode == "none"), None)
    seen = hindsight(none_run.run.records, num_blocks=args.decode_kv_blocks,
                     block_size=FakeEngineConfig().block_size,
                     shared_tokens=args.shared_system_tokens) if none_run else None
    lines = [f"`{' '.join(sys.argv)}`", "",
             f"{len(workload.conversations)} conversations, {workload.num_turns} turns "
             f"({sum(t.tool_call for c in workload.conversations for t in c.turns)} tool "
             f"calls, over {args.api}); time scale {scale:g}; D {args.decode_kv_blocks} "
             f"blocks; TTL {args.ttl_s:g} s; prelude {args.prelude_conversations} "
             f"conversations; modes side by side",
             "", *markdown_table(summaries, goals),
             *(["", hindsight_line(seen)] if seen is not None else [])]
    out.mkdir(parents=True, exist_ok=True)
    (out / "retention.md").write_text("\n".join(lines) + "\n")
    (out / "retention.json").write_text(json.dumps({
        "command": " ".join(sys.argv), "params": workload.params,
        "modes": {m: s.to_json() for m, s in summaries.items()},
        "goals": [vars(g) for g in goals],
        "hindsight": vars(seen) if seen is not None else None,
        "runs": [{"mode": r.mode, "info": r.run.info, "trace": {
            "samples": r.trace.samples, "end_s": r.trace.end_s,
            "num_preemptions": r.trace.num_preemptions, "releases": dict(r.trace.releases)},
            "records": [x.to_json() for x in r.run.records]} for r in runs],
    }, indent=1) + "\n")
    print("\n".join(lines))
    return 0 if all(s.new_ttft_p99_s is not None for s in summaries.values()) else 1


def _common(parser: argparse.ArgumentParser) -> None:
    from kvrelay.cluster.arguments import add_cluster_arguments

    g = parser.add_argument_group("benchmark")
    g.add_argument("--modes", default=DEFAULT_MODES,
                   help=f"comma-separated, run in order: pull, recompute, local, direct "
                        f"(default {DEFAULT_MODES})")
    g.add_argument("--router-url", default=None,
                   help="bench this running router instead of starting clusters")
    g.add_argument("--mode-label", default="router", help="mode name with --router-url")
    g.add_argument("--out", type=Path, default=None,
                   help="results folder (default results/bench-KIND-TIMESTAMP)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--salt", default=None,
                   help="session tag in every prompt (default random: no cache hits across runs)")
    g.add_argument("--tenant", default="default", help="router tenant (for the /stats fallback)")
    g.add_argument("--timeout-s", type=float, default=900.0, help="per-request timeout")
    g.add_argument("--allow-eos", action="store_true",
                   help="do not send ignore_eos (answers may end before max_tokens)")
    g.add_argument("--no-charts", action="store_true")
    g.add_argument("--engines", choices=["vllm", "fake"], default="vllm",
                   help="what each mode's cluster runs: real vLLM servers, or kvrelay's fake "
                        "engines (no vLLM needed; simulated latency, see --fake-latency)")
    g.add_argument("--fake-latency", choices=["cpu", "fast"], default="cpu",
                   help="latency preset of --engines fake")
    g.add_argument("--fake-vllm-version", choices=VLLM_VERSIONS, default="0.32",
                   help="vLLM protocol of --engines fake (0.33: D's params on the final "
                        "streamed chunk)")
    c = parser.add_argument_group("cluster (without --router-url; modes set bidirectional and "
                                  "P prefix caching)")
    add_cluster_arguments(c)  # type: ignore[arg-type]


def _run(args: argparse.Namespace) -> int:
    from kvrelay.bench.replay import ReplayFormatError
    from kvrelay.bench.workloads import WorkloadError

    try:
        return _bench(args)
    except (ValueError, ReplayFormatError, WorkloadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    from kvrelay.bench.modes import parse_modes
    from kvrelay.bench.report import BenchResults, write_report
    from kvrelay.bench.runner import BenchOptions
    from kvrelay.cluster.launcher import ServiceStartError

    if args.bench_kind == "replay" and args.trace is not None:
        return _trace(args)
    modes = parse_modes(args.modes)
    salt = args.salt if args.salt is not None else secrets.token_hex(3)
    workload = build_workload(args, salt)
    out = args.out or Path("results") / f"bench-{args.bench_kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    options = BenchOptions(
        id_prefix=f"{salt}-", tenant=args.tenant, timeout_s=args.timeout_s,
        extra_body=None if args.allow_eos else {"ignore_eos": True},
    )
    meta = {"model": args.model, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "salt": salt,
            "command": " ".join(sys.argv)}
    print(f"{args.bench_kind}: {len(workload.conversations)} conversations, "
          f"{workload.num_turns} turns; results in {out}", file=sys.stderr, flush=True)
    try:
        if args.router_url:
            from kvrelay.bench.runner import run_external

            meta["router_url"] = args.router_url
            runs = run_external(workload, args.router_url, args.mode_label,
                                _served_model(args), options)
        else:
            from kvrelay.bench.runner import ClusterFactory, local_cluster, run_managed
            from kvrelay.cluster.arguments import cluster_config_from_args
            from kvrelay.cluster.launcher import ClusterStartError

            run_dir = args.run_dir or out / "runs"
            factory: ClusterFactory = local_cluster
            if args.engines == "fake":
                from kvrelay.bench.fake_engines import fake_engine_cluster

                factory = fake_engine_cluster(args.fake_latency,
                                              vllm_version=args.fake_vllm_version)
                meta["engines"] = (f"fake ({args.fake_latency} latency, "
                                   f"vLLM {args.fake_vllm_version} protocol)")
            try:
                runs = run_managed(workload, modes, cluster_config_from_args(args), run_dir,
                                   options, cluster_factory=factory,
                                   router_args=getattr(args, "router_arg", None) or ())
            except ClusterStartError as exc:
                print(f"error: cluster did not start: {exc}", file=sys.stderr)
                return 1
    except ServiceStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    results = BenchResults(workload.kind, dict(workload.params), runs, meta)
    files = write_report(results, out, charts=not args.no_charts)
    print(files.markdown.read_text())
    for path in (files.json, files.markdown, *files.charts):
        print(f"wrote {path}", file=sys.stderr)
    empty = [s.mode for s in results.summaries().values() if s.ttft is None]
    if empty:
        print(f"error: no successful turn in mode(s) {empty}", file=sys.stderr)
        return 1
    return 0


def _trace(args: argparse.Namespace) -> int:
    """``bench replay --trace``: one fake-engine run per TTL, compared with tune's model."""
    import json

    from kvrelay.bench.report import BenchResults, write_report
    from kvrelay.bench.tokens import default_counter
    from kvrelay.bench.trace_replay import (
        ReplayOptions,
        compare,
        comparison_markdown,
        run_trace_replay,
        trace_workload,
    )
    from kvrelay.cluster.arguments import cluster_config_from_args
    from kvrelay.cluster.launcher import ServiceStartError
    from kvrelay.tune.cli import parse_ttls
    from kvrelay.tune.trace import TraceFormatError, read_turns

    if args.router_url:
        raise ValueError("--trace runs its own fake engines and routers (no --router-url)")
    ttls = parse_ttls(args.ttls)
    salt = args.salt if args.salt is not None else secrets.token_hex(3)
    try:
        turns = list(read_turns(args.trace, args.trace_format, sort=True))
    except TraceFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    count = default_counter(args.model)
    workload = trace_workload(turns, count, time_scale=args.time_scale,
                              decode_s_per_token=args.decode_s_per_token,
                              max_conversations=args.max_conversations, salt=salt,
                              seed=args.seed)
    out = args.out or Path("results") / f"bench-trace-{time.strftime('%Y%m%d-%H%M%S')}"
    options = ReplayOptions(
        time_scale=args.time_scale, latency=args.fake_latency,
        vllm_version=args.fake_vllm_version,
        num_gpu_blocks=args.num_gpu_blocks, tenant=args.tenant, id_prefix=f"{salt}-",
        extra_body=None if args.allow_eos else {"ignore_eos": True},
        timeout_s=args.timeout_s, router_args=tuple(getattr(args, "router_arg", None) or ()),
    )
    print(f"trace {args.trace}: {len(workload.conversations)} conversations, "
          f"{workload.num_turns} turns, TTLs {ttls} at time scale {args.time_scale:g}; "
          f"results in {out}", file=sys.stderr, flush=True)
    try:
        runs = run_trace_replay(workload, ttls, cluster_config_from_args(args),
                                args.run_dir or out / "runs", options)
    except ServiceStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rows = compare(runs, turns, decode_s_per_token=args.decode_s_per_token,
                   threshold_tokens=args.kv_recompute_threshold)
    meta = {"model": args.model, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "salt": salt,
            "command": " ".join(sys.argv), "engines": f"fake ({args.fake_latency} latency)",
            "trace": str(args.trace)}
    results = BenchResults("trace", dict(workload.params), [r.run for r in runs], meta)
    files = write_report(results, out, charts=not args.no_charts)
    table = comparison_markdown(rows, args.time_scale)
    files.markdown.write_text(files.markdown.read_text() + "\n" + "\n".join(table) + "\n")
    (out / "trace_vs_tune.json").write_text(json.dumps({
        "time_scale": args.time_scale, "trace": str(args.trace),
        "ttls": [c.to_json() for c in rows],
        "samples": {f"{r.settings.ttl_s:g}": {"router": r.samples.router,
                                              "decode": r.samples.decode} for r in runs},
    }, indent=1) + "\n")
    print(files.markdown.read_text())
    for path in (files.json, files.markdown, out / "trace_vs_tune.json", *files.charts):
        print(f"wrote {path}", file=sys.stderr)
    return 0 if all(c.followups for c in rows) else 1


def build_workload(args: argparse.Namespace, salt: str) -> Any:
    """The workload ``args`` describe (token counting from ``--model``)."""
    from kvrelay.bench.tokens import default_counter
    from kvrelay.bench.workloads import Pacing, ThinkTime, agent_workload, sweep_workload

    count = default_counter(args.model)
    if args.bench_kind == "sweep":
        return sweep_workload(
            count, lengths=args.lengths, conversations_per_length=args.conversations,
            setup_answer_tokens=args.answer_tokens, followup_tokens=args.user_tokens,
            followup_answer_tokens=args.followup_answer_tokens, gap_s=args.gap_s,
            seed=args.seed, salt=salt,
        )
    pacing = Pacing(ThinkTime(args.think, args.think_mean_s, args.think_sigma),
                    args.arrival_mean_s, args.concurrency)
    if args.bench_kind == "agent":
        return agent_workload(
            count, conversations=args.conversations, turns=args.turns,
            system_tokens=args.system_tokens, user_tokens=args.user_tokens,
            answer_tokens=args.answer_tokens, pacing=pacing, seed=args.seed, salt=salt,
        )
    from kvrelay.bench.replay import load_conversations, replay_workload

    return replay_workload(
        load_conversations(args.file), count, max_conversations=args.max_conversations,
        max_turns=args.max_turns, default_answer_tokens=args.default_answer_tokens,
        max_answer_tokens=args.max_answer_tokens, pacing=pacing, seed=args.seed, salt=salt,
    )


def _served_model(args: argparse.Namespace) -> str:
    """``--served-model-name``, else what the router lists, else ``--model``."""
    if args.served_model_name:
        return str(args.served_model_name)
    import asyncio

    from kvrelay.bench.client import ChatClient

    async def ask() -> str | None:
        async with ChatClient(args.router_url, "") as client:
            return await client.served_model()

    return asyncio.run(ask()) or str(args.model)
