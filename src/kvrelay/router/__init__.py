"""kvrelay's OpenAI-compatible router in front of vLLM P/D servers (see docs/router.md).

Entry points: ``kvrelay.router.app.create_app``, ``kvrelay.router.server.serve``,
``kvrelay.router.config.RouterConfig`` and ``kvrelay route`` (``kvrelay.router.cli``).
Nothing is imported here, so ``kvrelay --help`` stays fast.
"""
