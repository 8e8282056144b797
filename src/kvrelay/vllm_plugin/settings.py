"""How vLLM is told to load kvrelay's connector, and the switches the connector reads.

The one home of what the launcher (``kvrelay up``, ``cluster.config.KvTransferSettings``)
and ``kvrelay deploy k8s`` write into a node's ``--kv-transfer-config`` and what
``connector`` reads back from ``kv_connector_extra_config``. vLLM-free.

* ``kvrelay_restore_affinity`` (bool, default true): fix 1 of the connector;
* ``kvrelay_nixl_progress_delay_us`` (int, default 0 = vLLM's busy-polling thread): fix 2;
* ``kvrelay_report_hosts`` (list of host names, addresses or IP networks; default
  ``core.report.DEFAULT_REPORT_HOSTS``, loopback): where D's connector may post reports.
"""

from __future__ import annotations

#: vLLM's ``kv_connector_module_path``: the module vLLM imports the connector class from.
CONNECTOR_MODULE_PATH = "kvrelay.vllm_plugin.connector"
#: vLLM's ``kv_connector``: kvrelay's class keeps vLLM's name (see ``connector``).
CONNECTOR_NAME = "NixlConnector"

RESTORE_AFFINITY_KEY = "kvrelay_restore_affinity"
PROGRESS_DELAY_KEY = "kvrelay_nixl_progress_delay_us"
REPORT_HOSTS_KEY = "kvrelay_report_hosts"
