"""Talking to OpenAI-compatible servers (the router, vLLM, the fake engine) as a client.

* ``sse``: server-sent events as vLLM and the router stream them: framing, the JSON chunk of
  an event, its generated text, its usage, its error;
* ``prometheus``: the Prometheus text format ``/metrics`` answers, as numbers to compare;
* ``pd``: one turn straight on a P and a D, no router in between (``PDClient``).

Used by ``bench``, ``scripts/`` and the tests. The router's own relay (``router.sse``) and
the fake engine (which writes events) stay apart: they are the servers.
"""
