"""D's report: which blocks D retained after a streamed turn, and how the router checks it.

vLLM <= 0.32 does not put ``kv_transfer_params`` on a stream's final chunk, so kvrelay's
connector on D POSTs, when a request whose params carry ``kvrelay_report_url`` and
``kvrelay_turn_id`` finishes, this body (``report_body``) to that URL::

    {"turn_id": str, "kv_transfer_params": {...} | null,
     "num_prompt_tokens": int, "num_output_tokens": int}

``kv_transfer_params`` is D's retained params (``do_remote_decode: true``, with the
fingerprint of the held tokens), or ``null`` when nothing was retained. Reports that are due
while a post is in flight go out together: the body is then a JSON list of such objects (at
most ``MAX_REPORTS_PER_POST``).

A report is trusted only as far as it agrees with the turn it names (``check_report``): the
D the turn went to, that D's engine id and side channel as the router knows them from D's
own responses, a block list consistent with the token count and block size, the prompt
token count P computed for the turn, and a fingerprint of exactly the held tokens. Turn ids
are bound to their D with an HMAC (``issue_turn_id``), so a turn id is useless for any
other node and unforgeable without the router's key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from kvrelay.core.params import (
    REPORT_TURN_KEY,
    REPORT_URL_KEY,
    KVParamsError,
    RemoteBlocks,
    parse_optional_remote_blocks,
)

DEFAULT_REPORT_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")
"""Hosts kvrelay's connector posts reports to unless configured (``kvrelay_report_hosts``)."""

MAX_REPORT_BYTES = 1024 * 1024
"""Report bodies larger than this are refused unread (a 128k-token turn's report is about
90 KiB); senders split a batch to stay under ``MAX_BATCH_BYTES``."""
MAX_BATCH_BYTES = 512 * 1024
MAX_REPORTS_PER_POST = 64

_NONCE_BYTES = 12
_MAC_BYTES = 12


class ReportHosts:
    """Which hosts reports may go to: exact names or addresses, and IP networks."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            entry = str(entry).strip()
            if "/" in entry:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            else:
                self.names.add(entry.lower())

    def allows(self, host: str) -> bool:
        if host.lower() in self.names:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return str(address) in self.names or any(address in net for net in self.networks)


class ReportError(ValueError):
    """A report body that is not the connector's format."""


class DecodeReport(msgspec.Struct, frozen=True):
    """A parsed report; ``num_prompt_tokens`` is ``None`` when the report lacks it (then
    it cannot match a turn whose prompt length is known)."""

    turn_id: str
    blocks: RemoteBlocks | None
    num_prompt_tokens: int | None
    num_output_tokens: int


def report_target(params: Mapping[str, object] | None) -> tuple[str, str] | None:
    """``(url, turn_id)`` when a D request's params ask for a report (the router put
    ``kvrelay_report_url`` and ``kvrelay_turn_id`` there), else ``None``."""
    if not params:
        return None
    url, turn_id = params.get(REPORT_URL_KEY), params.get(REPORT_TURN_KEY)
    if not url or not turn_id:
        return None
    return str(url), str(turn_id)


def report_body(
    turn_id: str,
    params: Mapping[str, object] | None,
    num_prompt_tokens: int,
    num_output_tokens: int,
) -> dict[str, object]:
    """The JSON object kvrelay's connector (and the fake engine) posts."""
    retained = dict(params) if params and params.get("do_remote_decode") else None
    return {
        "turn_id": turn_id,
        "kv_transfer_params": retained,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
    }


def report_posts(encoded: list[bytes]) -> list[tuple[bytes, int]]:
    """Bodies to post for reports already encoded as JSON objects, in order, each with the
    number of reports it carries: one report as itself, several as JSON lists of at most
    ``MAX_REPORTS_PER_POST`` reports and ``MAX_BATCH_BYTES`` (a larger report goes alone)."""
    posts: list[tuple[bytes, int]] = []
    batch: list[bytes] = []
    size = 0
    for item in encoded:
        if batch and (len(batch) >= MAX_REPORTS_PER_POST or size + len(item) > MAX_BATCH_BYTES):
            posts.append(_post(batch))
            batch, size = [], 0
        batch.append(item)
        size += len(item) + 1
    if batch:
        posts.append(_post(batch))
    return posts


def _post(batch: list[bytes]) -> tuple[bytes, int]:
    body = batch[0] if len(batch) == 1 else b"[" + b",".join(batch) + b"]"
    return body, len(batch)


def report_items(raw: object) -> list[object]:
    """The reports of a body: one object, or a list of at most ``MAX_REPORTS_PER_POST``."""
    if isinstance(raw, list):
        if len(raw) > MAX_REPORTS_PER_POST:
            raise ReportError(f"at most {MAX_REPORTS_PER_POST} reports per post")
        return raw
    return [raw]


def parse_report(raw: object) -> DecodeReport:
    """A report body, parsed; ``ReportError`` if it is not the connector's format."""
    if not isinstance(raw, Mapping):
        raise ReportError("a report is a JSON object")
    turn_id = raw.get("turn_id")
    if not isinstance(turn_id, str) or not turn_id:
        raise ReportError("turn_id must be a non-empty string")
    counts: list[int | None] = []
    for key in ("num_prompt_tokens", "num_output_tokens"):
        value = raw.get(key)
        if value is None and key == "num_prompt_tokens":
            counts.append(None)
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ReportError(f"{key} must be a non-negative integer")
        counts.append(value)
    try:
        blocks = parse_optional_remote_blocks(raw.get("kv_transfer_params"))
    except KVParamsError as exc:
        raise ReportError(f"kv_transfer_params: {exc}") from None
    if blocks is not None and blocks.direction != "decode_to_prefill":
        raise ReportError("kv_transfer_params are not D's retained params")
    output = counts[1]
    assert output is not None
    return DecodeReport(turn_id, blocks, counts[0], output)


ReportVerdict = Literal[
    "ok",
    "mismatch_engine",
    "mismatch_side_channel",
    "mismatch_blocks",
    "mismatch_tokens",
    "mismatch_fingerprint",
]


class ReportExpectation(msgspec.Struct, frozen=True):
    """What the router knows of a turn when its report arrives.

    ``engine_id`` and ``side_channel`` are D's, from D's own responses (``None``: not known
    yet, e.g. nothing but streams since D started); ``block_size`` D's when configured or
    learned; ``num_prompt_tokens`` the prompt length P reported for the turn (``None``: the
    turn went direct to D); ``max_output_tokens`` the request's cap, if any.
    """

    engine_id: str | None = None
    side_channel: tuple[str, int] | None = None
    block_size: int | None = None
    num_prompt_tokens: int | None = None
    max_output_tokens: int | None = None


def check_report(expect: ReportExpectation, report: DecodeReport) -> ReportVerdict:
    """Whether ``report`` agrees with its turn (module docstring); the first disagreement."""
    blocks = report.blocks
    prompt, output = report.num_prompt_tokens, report.num_output_tokens
    if expect.num_prompt_tokens is not None and prompt != expect.num_prompt_tokens:
        return "mismatch_tokens"
    if expect.max_output_tokens is not None and output > expect.max_output_tokens:
        return "mismatch_tokens"
    if blocks is None:
        return "ok"
    if prompt is None:
        return "mismatch_tokens"
    if expect.engine_id is not None and blocks.engine_id != expect.engine_id:
        return "mismatch_engine"
    if expect.side_channel is not None and (blocks.host, blocks.port) != expect.side_channel:
        return "mismatch_side_channel"
    if blocks.num_tokens != prompt + output - 1:
        return "mismatch_tokens"
    size = blocks.block_size or expect.block_size
    if expect.block_size is not None and blocks.block_size not in (None, expect.block_size):
        return "mismatch_blocks"
    if size is not None:
        need = -(-blocks.num_tokens // size)
        if any(len(group) != need for group in blocks.block_ids):
            return "mismatch_blocks"
    fingerprint = blocks.fingerprint
    if fingerprint is not None and fingerprint.num_tokens != blocks.num_tokens:
        return "mismatch_fingerprint"
    return "ok"


def issue_turn_id(key: bytes, nonce: bytes, decode_node_id: str) -> str:
    """A turn id for a request sent to ``decode_node_id``: a random nonce and its HMAC."""
    if len(nonce) != _NONCE_BYTES:
        raise ValueError(f"nonce must be {_NONCE_BYTES} bytes")
    return base64.urlsafe_b64encode(nonce + _mac(key, nonce, decode_node_id)).decode("ascii")


def turn_id_for(key: bytes, turn_id: str, decode_node_id: str) -> bool:
    """Whether ``turn_id`` was issued by this key for ``decode_node_id``."""
    try:
        raw = base64.urlsafe_b64decode(turn_id.encode("ascii"))
    except (ValueError, UnicodeEncodeError, binascii.Error):
        return False
    if len(raw) != _NONCE_BYTES + _MAC_BYTES:
        return False
    nonce, mac = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:]
    return hmac.compare_digest(mac, _mac(key, nonce, decode_node_id))


def _mac(key: bytes, nonce: bytes, decode_node_id: str) -> bytes:
    """Keyed BLAKE2b (a MAC by construction, one C call): this runs twice per turn."""
    h = hashlib.blake2b(key=key[:64], digest_size=_MAC_BYTES, person=b"kvrelay-turn")
    h.update(nonce + b"\x00" + decode_node_id.encode("utf-8"))
    return h.digest()
