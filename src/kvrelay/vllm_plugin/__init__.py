"""kvrelay inside vLLM: the connector vLLM loads on P and D, and its contract with vLLM.

``connector`` is the only module here that imports vLLM: vLLM imports it, in its own
process, from ``kv_connector_module_path`` (``settings.CONNECTOR_MODULE_PATH``); it imports
only ``core`` and this package. The other modules are vLLM-free, so the launcher
(``kvrelay up``) and ``kvrelay deploy k8s`` can write the connector's settings, and
``make check-vllm`` can check a vLLM wheel without installing it:

* ``settings``: what ``--kv-transfer-config`` names (module path, ``kvrelay_*`` switches);
* ``fixes``: which of the connector's CPU fixes a node runs, from facts about its vLLM;
* ``contract``: what the connector needs from vLLM and NIXL, read from their sources
  (``python -m kvrelay.vllm_plugin.contract``), and the facts ``fixes`` decides from;
* ``pysource``: an ``ast`` index of a source tree, a wheel or a checkout;
* ``wheels``: the PyPI wheel cache the contract check reads.
"""
