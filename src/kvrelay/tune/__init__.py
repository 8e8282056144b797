"""``kvrelay tune``: what TTL, recompute threshold and D memory a deployment needs.

Modules: ``trace`` (turn logs and public trace formats -> turns), ``retention`` (turns ->
what each turn pins on D and what its follow-up can reuse), ``model`` (numpy: hit rate,
reuse, time saved and pinned memory per TTL), ``recommend`` (the rules), ``kvbytes``
(config.json -> KV bytes per token), ``costsource`` (the router's learned costs or flags),
``analyze`` (end to end), ``report`` / ``charts`` (output), ``synth`` (synthetic traces),
``cli``. See docs/tune.md.
"""
