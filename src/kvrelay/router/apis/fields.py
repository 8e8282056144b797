"""Strict JSON and the field checks every API adapter shares.

``load_json`` refuses what vLLM's parser would choke on after the router (non-UTF-8, lone
surrogates, non-finite numbers however written, nesting beyond ``MAX_JSON_DEPTH``);
``optional`` checks one field's type; ``check_id`` bounds a conversation id. Every failure is
a ``ClientError`` (400), which each adapter renders in its API's error shape.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvrelay.router.errors import ClientError
from kvrelay.router.request_limits import RequestLimits, check_counts

MAX_CONVERSATION_ID_BYTES = 256
MAX_JSON_DEPTH = 128
"""Deeper JSON is refused: vLLM's own parser fails near 1000 levels, after the router."""

JsonObject = dict[str, Any]
"""A client body: free-form JSON the router forwards, touching only the keys it owns."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_LONE_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


def encode(obj: object) -> bytes:
    return _ENCODER.encode(obj)


def load_json(raw: bytes, limits: RequestLimits | None = None) -> Any:
    """Strict JSON (module docstring); ``ClientError`` 400 if not, or if an object body
    carries more than ``limits`` allow (counted before the depth walk)."""
    try:
        body = _DECODER.decode(raw)
    except RecursionError:
        raise ClientError("Invalid JSON body: nested too deeply") from None
    except msgspec.ValidationError as exc:
        raise ClientError(f"Invalid JSON body: {exc}") from None
    except msgspec.DecodeError as exc:
        if str(exc) == "Input data was truncated" and _LONE_HIGH.search(raw):
            # msgspec's words for a high surrogate with no low one after it (probe 13, H5)
            raise ClientError("Invalid JSON body: a lone UTF-16 surrogate escape (\\ud800-"
                              "\\udbff not followed by \\udc00-\\udfff)") from None
        raise ClientError(f"Invalid JSON body: {exc}") from None
    if limits is not None and isinstance(body, dict):
        check_counts(body, limits)
    if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH and _too_deep(body, MAX_JSON_DEPTH):
        raise ClientError(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    return body


def _too_deep(obj: object, limit: int) -> bool:
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if type(value) is dict:
            stack.extend((v, depth + 1) for v in value.values() if type(v) in (dict, list))
        elif type(value) is list:
            stack.extend((v, depth + 1) for v in value if type(v) in (dict, list))
    return False


def context_bytes(body: Mapping[str, Any], fields: Sequence[str]) -> bytes:
    """The fields of ``body`` that change the rendered prompt, as one JSON object's bytes."""
    return _ENCODER.encode({k: body[k] for k in fields if k in body})


def check_id(conversation_id: str) -> None:
    """Ids are scoped, hashed and never echoed, but bounded and free of control characters
    (they may come from a header and must stay safe to put in one)."""
    try:
        size = len(conversation_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise ClientError("conversation_id is not valid UTF-8", "conversation_id") from None
    if size > MAX_CONVERSATION_ID_BYTES:
        raise ClientError(
            f"conversation_id is longer than {MAX_CONVERSATION_ID_BYTES} bytes", "conversation_id"
        )
    if _CONTROL.search(conversation_id):
        raise ClientError("conversation_id contains control characters", "conversation_id")


def optional(body: Mapping[str, Any], name: str, kind: type) -> Any:
    """``body[name]`` if present and not null, checked to be a ``kind`` (a bool is no int)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ClientError(f"{name} must be of type {kind.__name__}", name)
    return value


def positive(body: Mapping[str, Any], name: str) -> int | None:
    """An optional integer field that must be at least 1."""
    value: int | None = optional(body, name, int)
    if value is not None and value < 1:
        raise ClientError(f"{name} must be at least 1", name)
    return value


def message_text(content: object) -> str:
    """A message's text: the string, or the text parts of a content list joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def single_text(content: object) -> str | None:
    """The text of content that is one plain text part (``type`` and ``text`` only), which
    vLLM renders as that string; ``None`` for anything else."""
    if isinstance(content, list) and len(content) == 1:
        only = content[0]
        if isinstance(only, dict) and only.get("type") == "text" \
                and set(only) == {"type", "text"} and isinstance(only["text"], str):
            return only["text"]
    return None


def ints(values: list[object]) -> list[int]:
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


MEDIA_PART_TYPES = frozenset({
    "image_url", "input_audio", "audio_url", "video_url", "file", "image_embeds",  # chat
    "audio_embeds", "image_pil",
    "input_image", "input_file",  # Responses (and input_audio)
    "image", "document",  # Messages (also inside a tool_result's content)
})
"""Content part types that carry media (images, audio, video, files) in any API's history."""

MEDIA_PART_KEYS = frozenset({
    "image_url", "image_pil", "image_embeds", "audio_embeds", "audio_url", "input_audio",
    "video_url", "file",
})
"""Keys from which vLLM's chat parser infers a medium when a part has no ``type``, or has a
``uuid`` whatever its ``type`` (``_parse_chat_message_content_mm_part``): a part holding
one is a medium to the router too, whatever it says it is."""


def carries_media(body: Mapping[str, Any]) -> bool:
    """Whether a body's history holds a media part: ``messages`` (chat, Messages) or the
    Responses ``input``, each item's ``content`` (and a tool output's ``output``) parts, and
    the parts of a Messages ``tool_result``. The engine renders a media part as placeholder
    tokens that are equal for equal-sized media, so a token-id proof does not tell two
    images apart (see ``core.identity``: such a history never continues an entry it does
    not match). Looks only where the APIs put parts (a full walk of a long history cost a
    fifth of parsing it)."""
    for key in ("messages", "input"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        for item in items:
            if not isinstance(item, dict):
                continue
            if item.get("type") in MEDIA_PART_TYPES or _parts_carry_media(item.get("content")) \
                    or _parts_carry_media(item.get("output")):
                return True
    return False


def _parts_carry_media(parts: object) -> bool:
    if not isinstance(parts, list):
        return False
    for part in parts:
        if isinstance(part, dict):
            kind = part.get("type")
            if kind in MEDIA_PART_TYPES or not MEDIA_PART_KEYS.isdisjoint(part):
                return True
            if kind == "tool_result" and _parts_carry_media(part.get("content")):
                return True
    return False
