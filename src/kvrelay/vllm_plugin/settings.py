"""How vLLM is told to load kvrelay's connector, and the switches the connector reads.

The one home of what the launcher (``kvrelay up``, ``cluster.config.KvTransferSettings``)
and ``kvrelay deploy k8s`` write into a node's ``--kv-transfer-config`` and what
``connector`` reads back from ``kv_connector_extra_config``. vLLM-free.

* ``kvrelay_restore_affinity`` (bool, default true): fix 1 of the connector;
* ``kvrelay_nixl_progress_delay_us`` (int, default 0 = vLLM's busy-polling thread): fix 2;
* ``kvrelay_report_hosts`` (list of host names, addresses or IP networks; default
  ``core.report.DEFAULT_REPORT_HOSTS``, loopback): where D's connector may post reports
  and sync its retention;
* ``kvrelay_retention`` (``managed``, the default, or ``stock``): whether D's connector
  releases retained turns itself (under pressure, over headroom, at ``kvrelay_retain_s``,
  on the router's orders) or leaves them to vLLM's global TTL, as stock vLLM does (it still
  accounts and syncs them);
* ``kvrelay_retention_headroom`` (float in [0, 1], default 0): the fraction of D's KV
  cache kept free of retention (managed only).
"""

from __future__ import annotations

#: vLLM's ``kv_connector_module_path``: the module vLLM imports the connector class from.
CONNECTOR_MODULE_PATH = "kvrelay.vllm_plugin.connector"
#: vLLM's ``kv_connector``: kvrelay's class keeps vLLM's name (see ``connector``).
CONNECTOR_NAME = "NixlConnector"

RESTORE_AFFINITY_KEY = "kvrelay_restore_affinity"
PROGRESS_DELAY_KEY = "kvrelay_nixl_progress_delay_us"
REPORT_HOSTS_KEY = "kvrelay_report_hosts"
RETENTION_KEY = "kvrelay_retention"
RETENTION_HEADROOM_KEY = "kvrelay_retention_headroom"
RETENTION_MODES = ("managed", "stock")


def retention_mode(value: object) -> str:
    """``kvrelay_retention``'s value, checked (a node must not start with a typo)."""
    if value not in RETENTION_MODES:
        raise ValueError(f"{RETENTION_KEY} is one of {', '.join(RETENTION_MODES)}, got {value!r}")
    return str(value)


def retention_headroom(value: object) -> float:
    """``kvrelay_retention_headroom``'s value, checked: a fraction in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"{RETENTION_HEADROOM_KEY} is a fraction in [0, 1], got {value!r}")
    return float(value)
