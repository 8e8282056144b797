"""The vLLM releases the fake engine speaks, and everything that differs between them on the wire.

``FakeEngineConfig.vllm_version`` picks one; ``wire_protocol(version)`` is the only place that
says what that choice changes, read from each release's wheel sources (docs/vllm-versions.md,
"What 0.33 changed on the wire"):

* ``registration_generation``: NIXL connector version 15 (0.33) adds
  ``remote_registration_generation`` to every ``kv_transfer_params`` a node returns, P's and
  D's alike (``pull_scheduler.py`` ``request_finished``), between
  ``remote_blocks_expiry_time`` and ``transfer_mode``. Its value counts the node's worker
  ranks whose handshake payload changed since start-up: a fresh server has published once per
  rank, so it sends ``tp_size * pp_size`` (1 for TP=1, PP=1). The fake has no sleep mode, so
  the value never grows.
* ``stream_kv_params``: 0.33's streamed chat and completions responses carry the request's
  params on the chunk with ``finish_reason`` (``null`` when the node retained nothing) and
  ``"kv_transfer_params": null`` on every earlier token chunk; the chat role chunk and the
  usage chunk have no such key. 0.32 never streams them.
* ``weight_versions``: 0.33 adds ``"weight_versions": null`` to every non-streamed choice, to
  the final chunk's choice of a chat stream and to every choice of a completions stream.

Everything else (request bodies, the other params keys, non-streamed placement, errors) is
the same in both releases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

VllmVersion = Literal["0.32", "0.33"]
VLLM_VERSIONS: tuple[VllmVersion, ...] = get_args(VllmVersion)
REGISTRATION_GENERATION_KEY = "remote_registration_generation"


@dataclass(frozen=True)
class WireProtocol:
    """What one vLLM release puts on the wire, as far as the fake engine emulates it."""

    version: VllmVersion
    nixl_connector_version: int
    registration_generation: bool
    stream_kv_params: bool
    weight_versions: bool

    @property
    def release(self) -> str:
        """The release the fake stands for, as vLLM prints its version (``0.33.0``)."""
        return f"{self.version}.0"


_PROTOCOLS: Mapping[str, WireProtocol] = MappingProxyType({
    "0.32": WireProtocol("0.32", nixl_connector_version=14, registration_generation=False,
                         stream_kv_params=False, weight_versions=False),
    "0.33": WireProtocol("0.33", nixl_connector_version=15, registration_generation=True,
                         stream_kv_params=True, weight_versions=True),
})


def wire_protocol(version: str) -> WireProtocol:
    """The protocol of ``version``; ``ValueError`` naming the supported ones otherwise."""
    protocol = _PROTOCOLS.get(version)
    if protocol is not None:
        return protocol
    raise ValueError(f"vllm_version must be one of {', '.join(VLLM_VERSIONS)}, got {version!r}")


def with_registration_generation(
    params: dict[str, object], generation: int
) -> dict[str, object]:
    """``params`` with ``remote_registration_generation`` where 0.33 puts it: right before
    ``transfer_mode`` (at the end if there is none)."""
    out: dict[str, object] = {}
    for key, value in params.items():
        if key == "transfer_mode":
            out[REGISTRATION_GENERATION_KEY] = generation
        out[key] = value
    out.setdefault(REGISTRATION_GENERATION_KEY, generation)
    return out
