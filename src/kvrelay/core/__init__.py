"""kvrelay's pure decision core: no I/O, no clocks, no logging; time comes in as ``now_s``.

One concept per module: ``params`` (vLLM's kv_transfer_params and kvrelay's keys in them),
``fingerprint`` (proof of the held tokens), ``guard`` (the exact prefix check P and the
router share), ``identity`` (which entry a request continues, from digests), ``report``
(D's report and its checks), ``conversation`` (what is remembered between turns), ``costs``
(learned throughput), ``selection`` (which node), ``policy`` (pull, recompute or direct) and
``consequences`` (what follows from a decision or a failure).
"""
