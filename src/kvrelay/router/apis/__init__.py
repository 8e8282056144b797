"""The client APIs the router serves, one adapter each (``base.ApiAdapter``): chat,
completions, Responses and Messages. ``ADAPTERS`` maps an endpoint name to its adapter."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvrelay.router.apis.base import ApiAdapter
from kvrelay.router.apis.chat import ChatAdapter
from kvrelay.router.apis.completions import CompletionsAdapter
from kvrelay.router.apis.messages import MessagesAdapter
from kvrelay.router.apis.responses import ResponsesAdapter

ADAPTERS: Mapping[str, ApiAdapter] = MappingProxyType({
    a.endpoint: a
    for a in (ChatAdapter(), CompletionsAdapter(), ResponsesAdapter(), MessagesAdapter())
})
