"""Kubernetes manifests for a kvrelay deployment (``kvrelay deploy k8s``).

Topology (docs/deploy.md has the why):

* P and D are StatefulSets behind headless Services, so every pod has a stable DNS name
  (``NAME-decode-0.NAME-decode``): the router sends a conversation's next turn to the D that
  holds its KV, so it must address pods, not a load-balanced Service. Each engine advertises
  its pod IP as its NIXL side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST`` from the downward API).
* The router is a Deployment of ``router_replicas`` behind a ClusterIP Service, sharing
  conversation state in Redis. Each replica listens for D's reports on its own internal port
  and tells D to post them to its pod IP (``--internal-url http://$(POD_IP):PORT``); D's
  connector accepts report targets only inside ``pod_cidrs``.
* PodDisruptionBudgets keep all but one pod of each component up through voluntary
  disruptions; a ServiceMonitor has Prometheus scrape P and D on their http port and every
  router replica on its internal listener, through the headless ``NAME-router-metrics``
  Service: ``/metrics`` there is complete, where the public one leaves out the request-size
  series (or needs ``--metrics-key``, docs/security.md).

Pure: ``render(config)`` returns the manifests, ``to_yaml`` prints them.
"""

from __future__ import annotations

import json

from kvrelay.cluster.config import KvTransferSettings, Role
from kvrelay.deploy.config import DeployConfig, DeployConfigError, route_parser
from kvrelay.deploy.jsontypes import JsonValue, Manifest

#: Label on the Services Prometheus scrapes (the ServiceMonitor selects it).
METRICS_LABEL = "kvrelay.io/metrics"


def render(config: DeployConfig) -> list[Manifest]:
    """Every manifest of the deployment, in an order ``kubectl apply -f`` handles;
    ``DeployConfigError`` if its routers would refuse to start (``check_router_config``)."""
    check_router_config(config)
    docs: list[Manifest] = []
    if config.redis_url is None:
        docs += [_redis_deployment(config), _redis_service(config)]
    for role in ("prefill", "decode"):
        docs += [_engine_service(config, role), _engine_statefulset(config, role),
                 _pdb(config, role)]
    docs += [_router_service(config), _router_metrics_service(config),
             _router_deployment(config), _pdb(config, "router")]
    if config.service_monitor:
        docs.append(_service_monitor(config))
    return docs


def to_yaml(docs: list[Manifest]) -> str:
    """A multi-document YAML stream of ``docs``."""
    import yaml

    return str(yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, width=100))


# -- names and addresses -------------------------------------------------------------------


def component_name(config: DeployConfig, component: str) -> str:
    return f"{config.name}-{component}"


def engine_urls(config: DeployConfig, role: Role) -> list[str]:
    """The router's view of each P or D pod: its stable DNS name through the headless
    Service (resolvable from any pod in the namespace)."""
    sts = component_name(config, role)
    count = config.prefill if role == "prefill" else config.decode
    return [f"http://{sts}-{i}.{sts}:{config.engine_port}" for i in range(count)]


def redis_url(config: DeployConfig) -> str:
    return config.redis_url or f"redis://{component_name(config, 'redis')}:6379/0"


def labels(config: DeployConfig, component: str) -> dict[str, JsonValue]:
    return {
        "app.kubernetes.io/name": "kvrelay",
        "app.kubernetes.io/instance": config.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": config.name,
    }


def selector(config: DeployConfig, component: str) -> dict[str, JsonValue]:
    return {
        "app.kubernetes.io/instance": config.name,
        "app.kubernetes.io/component": component,
    }


def _metadata(config: DeployConfig, name: str, component: str,
              extra_labels: dict[str, JsonValue] | None = None) -> Manifest:
    meta: Manifest = {"name": name, "labels": {**labels(config, component),
                                               **(extra_labels or {})}}
    if config.namespace:
        meta["namespace"] = config.namespace
    return meta


# -- P and D -------------------------------------------------------------------------------


def data_parallel(config: DeployConfig, role: Role) -> int:
    """The ranks a P or D pod runs (vLLM's side channel of rank ``k`` is the port + ``k``)."""
    return config.prefill_data_parallel if role == "prefill" else config.decode_data_parallel


def engine_args(config: DeployConfig, role: Role) -> list[str]:
    """``vllm serve`` arguments of a P or D pod (the model first, as the positional tag)."""
    settings = KvTransferSettings(
        device="cuda",
        decoder_kv_blocks_ttl_s=config.ttl_s,
        kv_recompute_threshold=config.kv_recompute_threshold,
        kv_lease_duration_s=config.kv_lease_duration_s,
        restore_affinity=False,
        nixl_progress_delay_us=0,
        report_hosts=config.pod_cidrs,
    )
    caching = config.prefill_prefix_caching if role == "prefill" else config.decode_prefix_caching
    args = [
        config.model,
        "--served-model-name", config.model_name,
        "--host", "0.0.0.0",
        "--port", str(config.engine_port),
        "--tensor-parallel-size", str(config.gpus_per_node),
        "--block-size", str(config.block_size),
        "--kv-transfer-config", json.dumps(settings.for_role(role), separators=(",", ":")),
        "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
    ]
    ranks = data_parallel(config, role)
    if ranks > 1:  # one URL, vLLM's balancer; the router names each follow-up's rank
        args += ["--data-parallel-size", str(ranks)]
    if config.max_model_len is not None:
        args += ["--max-model-len", str(config.max_model_len)]
    if config.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    role_args = config.prefill_engine_args if role == "prefill" else config.decode_engine_args
    return args + list(config.engine_args) + list(role_args)


def _engine_service(config: DeployConfig, role: Role) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(config, component_name(config, role), role,
                              {METRICS_LABEL: "true"}),
        "spec": {
            "clusterIP": "None",
            # Pods are addressable while they start, so the router's health checks (not
            # DNS) decide when a restarted node takes traffic again.
            "publishNotReadyAddresses": True,
            "selector": selector(config, role),
            "ports": [
                {"name": "http", "port": config.engine_port, "targetPort": "http"},
                {"name": "nixl", "port": config.side_channel_port, "targetPort": "nixl"},
            ],
        },
    }


def _engine_statefulset(config: DeployConfig, role: Role) -> Manifest:
    name = component_name(config, role)
    count = config.prefill if role == "prefill" else config.decode
    env: list[JsonValue] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # NIXL's side channel: the other role connects to this pod's IP on this port.
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
         "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(config.side_channel_port)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if config.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": config.hf_token_secret, "key": "HF_TOKEN"}}})
    gpus = str(config.gpus_per_node * data_parallel(config, role))
    rank_ports: list[JsonValue] = [  # vLLM's side channel of rank k: the port + k
        {"name": f"nixl-dp{rank}", "containerPort": config.side_channel_port + rank,
         "protocol": "TCP"} for rank in range(1, data_parallel(config, role))]
    container: Manifest = {
        "name": "vllm",
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": list(engine_args(config, role)),
        "env": env,
        "ports": [
            {"name": "http", "containerPort": config.engine_port, "protocol": "TCP"},
            {"name": "nixl", "containerPort": config.side_channel_port, "protocol": "TCP"},
            *rank_ports,
        ],
        "resources": {
            "requests": {"cpu": config.engine_cpu, "memory": config.engine_memory,
                         config.gpu_resource: gpus},
            "limits": {"memory": config.engine_memory, config.gpu_resource: gpus},
        },
        # Loading weights and warming up can take many minutes: liveness waits for this.
        "startupProbe": _http_probe("/health", "http", period_s=10, failures=180),
        "readinessProbe": _http_probe("/health", "http", period_s=5, failures=2),
        "livenessProbe": _http_probe("/health", "http", period_s=10, failures=6),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(config, name, role),
        "spec": {
            "serviceName": name,
            "replicas": count,
            # Nodes are independent: start and replace them all at once.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(config, role)},
            "template": {
                "metadata": {"labels": labels(config, role)},
                "spec": {
                    "terminationGracePeriodSeconds": 60,
                    "containers": [container],
                    "volumes": [{"name": "dshm", "emptyDir": {
                        "medium": "Memory", "sizeLimit": config.shm_size}}],
                },
            },
        },
    }


# -- router ----------------------------------------------------------------------------------


def check_router_config(config: DeployConfig) -> None:
    """Build the config every router replica will build from its arguments (as ``kvrelay
    route`` does), so that a value it refuses (a TTL too short for its margins, a bad
    ``--router-arg`` value) is an error when rendering, not replicas that exit at start-up
    and crash-loop. The Secret's environment is not known here: with ``router_secret`` the
    replicas are taken to have API keys (settings that need them are judged so)."""
    from kvrelay.router.cli import config_from_args
    from kvrelay.router.config import ConfigError

    env = {"KVRELAY_API_KEYS": "render-check:" + "0" * 32} if config.router_secret else {}
    try:
        config_from_args(route_parser().parse_args(router_args(config)), env)
    except ConfigError as exc:
        raise DeployConfigError(f"the router would refuse its settings: {exc}") from None


def router_args(config: DeployConfig) -> list[str]:
    """``kvrelay route`` arguments of every router replica."""
    port = config.router_internal_port
    args = [
        "--host", "0.0.0.0",
        "--port", str(config.router_port),
        # D's reports: a listener of their own, reached on this pod's IP (per replica).
        "--internal-host", "0.0.0.0",
        "--internal-port", str(port),
        "--internal-url", f"http://$(POD_IP):{port}",
        "--state", redis_url(config),
        "--deployment", config.name,
        "--ttl-s", str(config.ttl_s),
        "--block-size", str(config.block_size),
        "--kv-recompute-threshold", str(config.kv_recompute_threshold),
        "--drain-timeout-s", str(config.drain_timeout_s),
    ]
    for url in engine_urls(config, "prefill"):
        args += ["--prefill", url]
    for url in engine_urls(config, "decode"):
        args += ["--decode", url]
    return args + list(config.router_args)


def _router_service(config: DeployConfig) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(config, component_name(config, "router"), "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(config, "router"),
            # Only the OpenAI API: D posts reports to each replica's pod IP, not through here.
            "ports": [{"name": "http", "port": config.router_port, "targetPort": "http"}],
        },
    }


def _router_metrics_service(config: DeployConfig) -> Manifest:
    """Every replica's internal listener, for Prometheus only (headless: one target per
    pod): its ``/metrics`` is complete and needs no key."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(config, component_name(config, "router-metrics"), "router",
                              {METRICS_LABEL: "true"}),
        "spec": {
            "clusterIP": "None",
            "selector": selector(config, "router"),
            "ports": [{"name": "internal", "port": config.router_internal_port,
                       "targetPort": "internal"}],
        },
    }


def _router_deployment(config: DeployConfig) -> Manifest:
    container: Manifest = {
        "name": "router",
        "image": config.router_image_or_default,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["python3", "-m", "kvrelay.cli", "route"],
        "args": list(router_args(config)),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        # the keys (a tag key shared by the replicas, API, admin, metrics keys) come from a
        # Secret the operator creates, never in the args (docs/deploy.md, "Keys")
        **({"envFrom": [{"secretRef": {"name": config.router_secret}}]}
           if config.router_secret else {}),
        "ports": [
            {"name": "http", "containerPort": config.router_port, "protocol": "TCP"},
            {"name": "internal", "containerPort": config.router_internal_port,
             "protocol": "TCP"},
        ],
        "resources": {
            "requests": {"cpu": config.router_cpu, "memory": config.router_memory},
            "limits": {"memory": config.router_memory},
        },
        # /health is 200 while one P and one D are up: a replica with no node to route to
        # leaves the Service. Liveness must not depend on the nodes (a dead D would restart
        # every router), so it asks /metrics, which only the router process answers: on the
        # internal listener, which serves it to anyone there (the public one may need
        # --metrics-key, or not serve it at all with --metrics-listener internal).
        "readinessProbe": _http_probe("/health", "http", period_s=5, failures=2),
        "livenessProbe": _http_probe("/metrics", "internal", period_s=10, failures=3),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(config, component_name(config, "router"), "router"),
        "spec": {
            "replicas": config.router_replicas,
            "selector": {"matchLabels": selector(config, "router")},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(config, "router")},
                "spec": {
                    # SIGTERM drains streams for drain_timeout_s (docs/router.md, "Shutdown").
                    "terminationGracePeriodSeconds": config.drain_timeout_s + 15,
                    "containers": [container],
                    "affinity": {"podAntiAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [{
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": selector(config, "router")},
                            },
                        }],
                    }},
                },
            },
        },
    }


# -- redis, PDBs, monitoring ---------------------------------------------------------------


def _redis_deployment(config: DeployConfig) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(config, component_name(config, "redis"), "redis"),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(config, "redis")},
            "template": {
                "metadata": {"labels": labels(config, "redis")},
                "spec": {"containers": [{
                    "name": "redis",
                    "image": config.redis_image,
                    "imagePullPolicy": config.image_pull_policy,
                    # Entries are block locations that expire within the TTL: nothing worth
                    # persisting. A restarted Redis costs every conversation one recompute.
                    "args": ["--save", "", "--appendonly", "no"],
                    "ports": [{"name": "redis", "containerPort": 6379, "protocol": "TCP"}],
                    "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                                  "limits": {"memory": "1Gi"}},
                    "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
                    "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
                }]},
            },
        },
    }


def _redis_service(config: DeployConfig) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(config, component_name(config, "redis"), "redis"),
        "spec": {"selector": selector(config, "redis"),
                 "ports": [{"name": "redis", "port": 6379, "targetPort": "redis"}]},
    }


def _pdb(config: DeployConfig, component: str) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(config, component_name(config, component), component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(config, component)}},
    }


def _service_monitor(config: DeployConfig) -> Manifest:
    extra: dict[str, JsonValue] = {}
    for label in config.service_monitor_labels:
        key, value = label.split("=", 1)
        extra[key] = value
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(config, config.name, "monitoring", extra),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/part-of": config.name,
                                         METRICS_LABEL: "true"}},
            # P and D on their http port, the router replicas on their internal listener
            # (NAME-router-metrics): a Service without the named port yields no target.
            # ``component`` (router, prefill, decode) is the label the dashboard's queries
            # use (kvrelay.deploy.panels), as the local scrape config sets it.
            "endpoints": [{
                "port": port, "path": "/metrics", "interval": "15s",
                "relabelings": [{
                    "sourceLabels": [
                        "__meta_kubernetes_service_label_app_kubernetes_io_component"],
                    "targetLabel": "component",
                }],
            } for port in ("http", "internal")],
        },
    }


def _http_probe(path: str, port: str, *, period_s: int, failures: int) -> Manifest:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s,
            "timeoutSeconds": 5, "failureThreshold": failures}
