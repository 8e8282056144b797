"""core.report: D's report body, its checks against the turn, turn ids bound to D."""

from __future__ import annotations

import json

import pytest
from msgspec.structs import replace

from kvrelay.core.fingerprint import fingerprint_tokens
from kvrelay.core.report import (
    MAX_BATCH_BYTES,
    MAX_REPORTS_PER_POST,
    ReportError,
    ReportExpectation,
    check_report,
    issue_turn_id,
    parse_report,
    report_body,
    report_items,
    report_posts,
    report_target,
    turn_id_for,
)
from tests.unit.test_core_guard import BLOCKS

HELD = replace(BLOCKS, num_tokens=1000, fingerprint=fingerprint_tokens(list(range(1000))))
EXPECT = ReportExpectation(engine_id="d-engine", side_channel=("127.0.0.1", 5601),
                           block_size=128, num_prompt_tokens=990, max_output_tokens=16)


def report(**changes: object) -> object:
    body = report_body("t1", HELD.to_json(), 990, 11)
    body.update(changes)
    return json.loads(json.dumps(body))


def test_a_matching_report_is_ok() -> None:
    parsed = parse_report(report())
    assert parsed.blocks == HELD and parsed.num_prompt_tokens == 990
    assert check_report(EXPECT, parsed) == "ok"
    assert check_report(ReportExpectation(), parsed) == "ok"


@pytest.mark.parametrize(("blocks", "prompt", "output", "verdict"), [
    (replace(HELD, engine_id="other"), 990, 11, "mismatch_engine"),
    (replace(HELD, host="10.0.0.9"), 990, 11, "mismatch_side_channel"),
    (replace(HELD, port=1), 990, 11, "mismatch_side_channel"),
    (HELD, 991, 11, "mismatch_tokens"),
    (HELD, None, 11, "mismatch_tokens"),
    (HELD, 990, 17, "mismatch_tokens"),
    (replace(HELD, num_tokens=1001, fingerprint=fingerprint_tokens(list(range(1001)))), 990,
     11, "mismatch_tokens"),
    (replace(HELD, block_ids=((1, 2, 3),)), 990, 11, "mismatch_blocks"),
    (replace(HELD, block_size=16), 990, 11, "mismatch_blocks"),
    (replace(HELD, fingerprint=fingerprint_tokens(list(range(900)))), 990, 11,
     "mismatch_fingerprint"),
])
def test_what_disagrees_with_the_turn_is_refused(
    blocks: object, prompt: int | None, output: int, verdict: str
) -> None:
    body = report_body("t1", blocks.to_json(), 0, output)  # type: ignore[attr-defined]
    body["num_prompt_tokens"] = prompt
    assert check_report(EXPECT, parse_report(json.loads(json.dumps(body)))) == verdict


def test_nothing_retained_is_a_report_too() -> None:
    parsed = parse_report(report_body("t1", None, 990, 11))
    assert parsed.blocks is None and check_report(EXPECT, parsed) == "ok"


@pytest.mark.parametrize("raw", [
    [], "x", {"turn_id": 3}, {"turn_id": "t", "num_prompt_tokens": 1},
    {"turn_id": "t", "num_prompt_tokens": -1, "num_output_tokens": 1},
    {"turn_id": "t", "num_prompt_tokens": 1, "num_output_tokens": 1,
     "kv_transfer_params": {**HELD.to_json(), "do_remote_prefill": True,
                            "do_remote_decode": False}},
    {"turn_id": "t", "num_prompt_tokens": 1, "num_output_tokens": 1,
     "kv_transfer_params": {**HELD.to_json(), "remote_port": "x"}},
])
def test_malformed_reports_are_refused(raw: object) -> None:
    with pytest.raises(ReportError):
        parse_report(raw)


def test_turn_ids_are_bound_to_their_decode_node_and_key() -> None:
    key = b"k" * 32
    tid = issue_turn_id(key, b"n" * 12, "decode-0")
    assert turn_id_for(key, tid, "decode-0")
    assert not turn_id_for(key, tid, "decode-1")
    assert not turn_id_for(b"x" * 32, tid, "decode-0")
    assert not turn_id_for(key, "made-up", "decode-0")
    assert issue_turn_id(key, b"m" * 12, "decode-0") != tid


def test_batches_stay_within_their_bounds_and_keep_order() -> None:
    small = [json.dumps({"turn_id": str(i)}).encode() for i in range(150)]
    posts = report_posts(small)
    assert [n for _, n in posts] == [MAX_REPORTS_PER_POST, MAX_REPORTS_PER_POST, 22]
    ids = [r["turn_id"] for body, _ in posts for r in report_items(json.loads(body))]
    assert ids == [str(i) for i in range(150)]
    big = [b'{"turn_id":"%d","pad":"%s"}' % (i, b"x" * (MAX_BATCH_BYTES // 3))
           for i in range(4)]
    assert [n for _, n in report_posts(big)] == [2, 2]
    assert report_posts(small[:1]) == [(small[0], 1)]
    with pytest.raises(ReportError):
        report_items([{}] * (MAX_REPORTS_PER_POST + 1))


def test_a_report_target_needs_both_the_url_and_the_turn_id() -> None:
    url = "http://127.0.0.1:8001/internal/kv-report"
    params = {"do_remote_decode": True, "kvrelay_report_url": url, "kvrelay_turn_id": "t1"}
    assert report_target(params) == (url, "t1")
    assert report_target({**params, "kvrelay_turn_id": ""}) is None
    assert report_target({"kvrelay_report_url": url}) is None
    assert report_target(None) is None and report_target({}) is None
