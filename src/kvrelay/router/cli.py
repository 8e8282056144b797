"""``kvrelay route``: run the router in front of vLLM prefill and decode servers.

Settings, later winning: built-in defaults, ``--config FILE`` (TOML, keys as in
``config.build_config``), ``KVRELAY_*`` env vars (``config.ENV_KEYS``), then flags.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any) -> None:
    route = sub.add_parser(
        "route",
        help="run the KV-aware router in front of vLLM P/D servers",
        description="OpenAI-compatible router that reuses D's retained KV across turns.",
    )
    add_route_arguments(route)
    route.set_defaults(func=_route)


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", metavar="URL", default=None,
                        help="prefill (P) server URL; repeat for several (env KVRELAY_PREFILL, "
                             "comma-separated)")
    parser.add_argument("--decode", action="append", metavar="URL", default=None,
                        help="decode (D) server URL; repeat for several (env KVRELAY_DECODE)")
    parser.add_argument("--side-channel", action="append", metavar="URL=HOST[:PORT]",
                        default=None,
                        help="address by which the other role reaches this node's NIXL side "
                             "channel (default: as the node advertises it)")
    parser.add_argument("--ttl-s", type=float, default=None,
                        help="D's decoder_kv_blocks_ttl in seconds (default 480)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="D's KV block size in tokens (default: inferred from its params; "
                             "set it for non-power-of-two block sizes)")
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    parser.add_argument("--internal-host", default=None,
                        help="address of the internal listener D posts reports to "
                             "(default 127.0.0.1)")
    parser.add_argument("--internal-port", type=int, default=None,
                        help="port of the internal listener (default: --port + 1)")
    parser.add_argument("--internal-url", default=None,
                        help="how D reaches the internal listener (set it when D is on "
                             "another host), default http://INTERNAL_HOST:INTERNAL_PORT")
    parser.add_argument("--guard", choices=["auto", "connector", "tokenize"], default=None,
                        help="where the exact prefix check runs: in kvrelay's connector on "
                             "P (connector), in the router with P's /tokenize (tokenize), or "
                             "per node as the nodes show (auto, default)")
    parser.add_argument("--turn-log", default=None, metavar="PATH",
                        help="append one JSON line per turn (sizes, timing, decision; no "
                             "content) for `kvrelay tune`")
    parser.add_argument("--turn-log-max-mb", type=int, default=None,
                        help="rotate the turn log at this size (default 64)")
    parser.add_argument("--turn-log-backups", type=int, default=None,
                        help="rotated turn logs kept (default 5)")
    parser.add_argument("--session-header", action="append", default=None, metavar="NAME",
                        help="request header carrying a client's conversation id "
                             "(repeatable; replaces the default list, see docs/router.md)")
    parser.add_argument("--gateway-id-header", action="append", default=None, metavar="NAME",
                        help="request header a gateway in front of the router sets (and strips "
                             "from clients) with the caller's conversation or user id; its id "
                             "is bound to one caller (repeatable, docs/security.md)")
    parser.add_argument("--id-precedence", choices=["gateway", "client"], default=None,
                        help="which id wins when a request has a gateway id header and a "
                             "client id (conversation_id, session header): gateway (default)")
    parser.add_argument("--tenant-is-one-caller", action="store_true", default=None,
                        help="each tenant key is held by one caller: its ids are bound "
                             "(an edited history continues the id's latest entry)")
    parser.add_argument("--config", default=None, metavar="FILE", help="TOML config file")
    parser.add_argument("--check-config", action="store_true",
                        help="build the configuration from the file, KVRELAY_* variables and "
                             "flags, say whether it is valid and exit (0 valid, 2 not) "
                             "without listening")
    parser.add_argument("--kv-recompute-threshold", type=int, default=None,
                        help="reusable spans shorter than this (tokens) are recomputed; as "
                             "vLLM's kv_recompute_threshold (default 64)")
    parser.add_argument("--near-expiry-s", type=float, default=None,
                        help="an entry this close to D's expiry is not pulled (default 15)")
    parser.add_argument("--pull-cost-factor", type=float, default=None,
                        help="> 1 biases the cost model towards recompute (default 1.0)")
    parser.add_argument("--fixed-costs", default=None, metavar="KEY=SECONDS,...",
                        help="fixed cost lines, never learned from timings: "
                             "prefill_s_per_token, prefill_fixed_s, pull_s_per_token, "
                             "pull_fixed_s (unset keys: the priors); e.g. "
                             "prefill_s_per_token=1e-4,pull_s_per_token=1e-6")
    parser.add_argument("--direct", action="store_true", default=None,
                        help="enable the direct action (whole turn to the holding D)")
    parser.add_argument("--no-learned-retention", dest="learned_retention",
                        action="store_false", default=None,
                        help="send D no per-turn retention time (kvrelay_retain_s): D keeps "
                             "every turn its TTL (default: learned from the gaps between "
                             "turns, docs/router.md \"Retention\")")
    parser.add_argument("--retain-quantile", type=float, default=None,
                        help="share of returning follow-ups the learned retention time "
                             "waits for, per kind of turn end, with a log-normal fit of "
                             "the tail (default 0.997)")
    parser.add_argument("--report-wait-s", type=float, default=None,
                        help="how long a turn waits for the D report of the turn it continues "
                             "(default 1.0)")
    parser.add_argument("--health-interval-s", type=float, default=None,
                        help="seconds between health checks of every node (default 5)")
    parser.add_argument("--room-interval-s", type=float, default=None,
                        help="seconds between reads of every D's room from vLLM's own "
                             "/metrics (default 1; 0: never)")
    parser.add_argument("--max-entries", type=int, default=None,
                        help="conversation entries kept, least recently used evicted "
                             "first (default 100000; env KVRELAY_MAX_ENTRIES)")
    parser.add_argument("--state", default=None, metavar="redis://HOST:PORT/DB",
                        help="share conversation state with other router replicas in Redis "
                             "(default: in this process)")
    parser.add_argument("--state-timeout-ms", type=float, default=None,
                        help="bound on each Redis call; on timeout the turn recomputes "
                             "(default 50)")
    parser.add_argument("--deployment", default=None,
                        help="namespace of this deployment's Redis keys (default 'default')")
    parser.add_argument("--response-store", choices=["off", "memory", "redis"], default=None,
                        help="keep store:true Responses (their content: input and output "
                             "items) for previous_response_id and GET /v1/responses/{id}: in "
                             "this process (memory) or in the --state Redis, shared by "
                             "replicas (redis); default off")
    parser.add_argument("--response-store-ttl-s", type=float, default=None,
                        help="how long a stored response is kept (default 3600)")
    parser.add_argument("--response-store-max-mb", type=int, default=None,
                        help="bound on the stored responses, the oldest evicted first "
                             "(default 256)")
    parser.add_argument("--response-store-max-mb-per-tenant", type=int, default=None,
                        help="bound on one tenant's stored responses, its own oldest evicted "
                             "first, so no tenant can push out another's (default: "
                             "--response-store-max-mb)")
    parser.add_argument("--log-level", default=None,
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="default info")
    add_security_arguments(parser)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """Auth and limits (docs/router.md, "Security and limits")."""
    parser.add_argument("--api-key", action="append", metavar="[TENANT:]KEY", default=None,
                        help="require 'Authorization: Bearer KEY'; the key's tenant scopes "
                             "conversation ids (bare KEY: tenant 'default'); repeat for "
                             "several (prefer env KVRELAY_API_KEYS: flags show in ps)")
    parser.add_argument("--admin-key", default=None, metavar="KEY",
                        help="enables /admin/* and unfiltered /stats for this bearer key "
                             "(env KVRELAY_ADMIN_KEY)")
    parser.add_argument("--metrics-key", default=None, metavar="KEY",
                        help="the public /metrics needs 'Authorization: Bearer KEY' (or the "
                             "admin key); without it, it serves no request-size series (env "
                             "KVRELAY_METRICS_KEY)")
    parser.add_argument("--metrics-listener", choices=["public", "internal"], default=None,
                        help="serve /metrics on the public listener too (public, default) or "
                             "only on the internal one (internal)")
    parser.add_argument("--tag-key", default=None, metavar="SECRET",
                        help="key of the conversation tags in /stats and the turn log, shared "
                             "by replicas that must agree (default: random per process; prefer "
                             "env KVRELAY_TAG_KEY)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="largest request body, else 413 (default 8 MiB)")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="generation requests in flight, else 429 (default 1024)")
    parser.add_argument("--max-in-flight-per-tenant", type=int, default=None,
                        help="generation requests one tenant may have in flight (default: "
                             "--max-in-flight)")
    parser.add_argument("--max-entries-per-tenant", type=int, default=None,
                        help="retained entries one tenant may hold (default: --max-entries)")
    parser.add_argument("--header-timeout-s", type=float, default=None,
                        help="a connection must send a request's headers within this "
                             "(default 30)")
    parser.add_argument("--body-timeout-s", type=float, default=None,
                        help="a request's whole body must arrive within this, else 408 "
                             "(default 60)")
    parser.add_argument("--drain-timeout-s", type=float, default=None,
                        help="on SIGTERM, how long in-flight requests may finish (default 30)")


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line as a settings layer (unset flags omitted)."""
    from kvrelay.router.config import ConfigError

    side: dict[str, str] = {}
    for item in args.side_channel or ():
        node, sep, address = item.partition("=")
        if not sep or not node or not address:
            raise ConfigError(f"--side-channel needs URL=HOST[:PORT], got {item!r}")
        side[node.rstrip("/")] = address
    out: dict[str, Any] = {
        "prefill": args.prefill,
        "decode": args.decode,
        "ttl_s": args.ttl_s,
        "block_size": args.block_size,
        "host": args.host,
        "port": args.port,
        "internal_host": args.internal_host,
        "internal_port": args.internal_port,
        "internal_url": args.internal_url,
        "guard": args.guard,
        "session_headers": args.session_header,
        "gateway_id_headers": args.gateway_id_header,
        "id_precedence": args.id_precedence,
        "tenant_is_one_caller": args.tenant_is_one_caller,
        "turn_log": args.turn_log,
        "turn_log_max_mb": args.turn_log_max_mb,
        "turn_log_backups": args.turn_log_backups,
        "kv_recompute_threshold": args.kv_recompute_threshold,
        "near_expiry_s": args.near_expiry_s,
        "pull_cost_factor": args.pull_cost_factor,
        "costs": getattr(args, "fixed_costs", None),
        "learn_costs": False if getattr(args, "fixed_costs", None) is not None else None,
        "direct_enabled": args.direct,
        "learned_retention": getattr(args, "learned_retention", None),
        "retain_quantile": getattr(args, "retain_quantile", None),
        "report_wait_s": args.report_wait_s,
        "health_interval_s": args.health_interval_s,
        "room_interval_s": args.room_interval_s,
        "max_entries": getattr(args, "max_entries", None),
        "log_level": args.log_level,
        "api_keys": getattr(args, "api_key", None),
        "admin_key": getattr(args, "admin_key", None),
        "tag_key": getattr(args, "tag_key", None),
        "metrics_key": getattr(args, "metrics_key", None),
        "metrics_listener": getattr(args, "metrics_listener", None),
        "max_body_bytes": getattr(args, "max_body_bytes", None),
        "max_in_flight": getattr(args, "max_in_flight", None),
        "max_in_flight_per_tenant": getattr(args, "max_in_flight_per_tenant", None),
        "max_entries_per_tenant": getattr(args, "max_entries_per_tenant", None),
        "header_timeout_s": getattr(args, "header_timeout_s", None),
        "body_timeout_s": getattr(args, "body_timeout_s", None),
        "drain_timeout_s": getattr(args, "drain_timeout_s", None),
        "state": args.state,
        "state_timeout_ms": args.state_timeout_ms,
        "deployment": args.deployment,
        "response_store": getattr(args, "response_store", None),
        "response_store_ttl_s": getattr(args, "response_store_ttl_s", None),
        "response_store_max_mb": getattr(args, "response_store_max_mb", None),
        "response_store_max_mb_per_tenant": getattr(args, "response_store_max_mb_per_tenant",
                                                    None),
    }
    if side:
        out["side_channels"] = side
    return {k: v for k, v in out.items() if v is not None}


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Any:
    """The ``RouterConfig`` for parsed ``kvrelay route`` arguments."""
    from kvrelay.router.config import build_config, settings_from_env, settings_from_toml

    layers = []
    if args.config:
        layers.append(settings_from_toml(args.config))
    layers.append(settings_from_env(environ))
    layers.append(settings_from_args(args))
    return build_config(*layers)


def _route(args: argparse.Namespace) -> int:
    from kvrelay.router.config import ConfigError
    from kvrelay.router.server import ListenError, serve

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if config.state is not None and config.response_store == "memory":
        print("warning: --response-store memory with --state: each replica keeps its own "
              "responses, so a previous_response_id another replica answered is not found "
              "(--response-store redis shares them)", file=sys.stderr, flush=True)
    if not config.api_keys:
        print("note: no API keys: the router serves every client (--api-key or "
              "KVRELAY_API_KEYS; docs/security.md)", file=sys.stderr, flush=True)
    if args.check_config:
        print("config ok", flush=True)
        return 0
    nodes = ", ".join(f"{n.node_id}={n.url}" for n in config.nodes)
    reports = (config.report_url if config.listen_internal_port != 0
               else "a free port, logged once bound")
    print(f"kvrelay router on http://{config.host}:{config.port} (reports on "
          f"{reports}, prefix guard {config.guard}) -> {nodes}", flush=True)
    try:
        serve(config)
    except ListenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
