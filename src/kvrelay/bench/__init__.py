"""``kvrelay bench``: multi-turn TTFT benchmarks of the router (pull vs recompute vs local).

Modules: ``workloads`` / ``replay`` (what to send), ``client`` (one measured turn),
``execute`` (a workload through a client), ``modes`` / ``runner`` / ``fake_engines`` (what it
runs on), ``metrics`` / ``report`` / ``charts`` (what comes out), ``demo`` (``run_demo`` for
``make demo``), ``cli`` (``kvrelay bench``). See ``docs/bench.md``.
"""
