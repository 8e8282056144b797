"""Router CPU per completions request in the lookup path, by entries in one scope (a
benchmark, not a test; issue #23, finding 4).

Every completions prompt under 1 KiB in a scope shares one anchor (block 0). For each
``--entries`` count N, the router's in-memory index (``InMemoryIndex``) is filled with N
conversations' first turns in one scope, filed exactly as the router commits them (prompts
of 80-900 bytes, each with its answer), then ``--lookups`` follow-ups of those
conversations (prompt + answer + a new line, each continuing its entry, picked with a prime
stride so that every N sees the same mix of prompt lengths) go through
what the router does per completions request to find its entry: the request's identity
(``text_identity``) and ``index.lookup``. The figure is CPU seconds (``time.process_time``)
per request; every follow-up must find its own entry.

``--before-python PATH`` runs this same script under another checkout's interpreter (its
``kvrelay``: e.g. main before the change) for each N, interleaved with this checkout in
``--rounds`` rounds, so before and after are measured side by side on the same machine at
the same time; the table gives the median of the rounds and the ratio.

    flock /tmp/kvrelay-heavy.lock .venv/bin/python scripts/bench_lookup.py \
        --before-python /work/wt-before/.venv/bin/python

``--redis URL`` measures ``RedisIndex`` on that Redis instead (this checkout only; its
figures include the round trips).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from kvrelay.core.conversation import new_entry, with_fingerprint
from kvrelay.core.fingerprint import fingerprint_tokens
from kvrelay.core.identity import RequestIdentity, scope_of, text_identity
from kvrelay.core.params import parse_remote_blocks
from kvrelay.router.index import ConversationIndex, EntryRef, InMemoryIndex

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "tests" / "data" / "vllm-0.32.0" / "chat_turn1.json"
CONTEXT = b'{"model":"tiny","ids":false}'
SCOPE = scope_of("tenant", None)
WORDS = ("wind", "west", "ship", "lamp", "oil", "dusk", "dawn", "storm", "gull", "tide",
         "rock", "fog", "bell", "rope", "salt", "keeper")


def prompt_of(i: int) -> bytes:
    """Conversation ``i``'s first prompt: 80-900 bytes, distinct from its first bytes."""
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12 + (i * 37) % 150)]
    return f"[log {i:06d}] {' '.join(words)}\nA:".encode()


def answer_of(i: int) -> bytes:
    return f" the {WORDS[i % len(WORDS)]} at {i % 24:02d}h.".encode()


try:
    from kvrelay.router.index import MAX_TEXT_DIGESTS  # noqa: F401  (bounded lookups)
    BOUNDED = True
except ImportError:
    BOUNDED = False


def filed_at(identity: RequestIdentity, answer: bytes) -> EntryRef:
    """Where the router files a completions entry (whichever version of kvrelay runs)."""
    try:
        from kvrelay.core.identity import text_entry  # type: ignore[attr-defined]
    except ImportError:  # before issue #23: under the prompt's anchor, a scanned slot
        from kvrelay.core.identity import text_continuation  # type: ignore[attr-defined]

        cont = text_continuation(identity, answer)
        return EntryRef(identity.scope, identity.anchor, cont.slot())
    anchor, cont = text_entry(identity, answer)
    return EntryRef(identity.scope, anchor, cont.slot())


async def measure(num_entries: int, num_lookups: int, redis_url: str | None) -> dict[str, Any]:
    """Fill an index with ``num_entries`` entries in one scope, then time follow-ups."""
    blocks = parse_remote_blocks(json.loads(PARAMS.read_text())["d1"]["kv_transfer_params"])
    blocks = with_fingerprint(blocks, fingerprint_tokens(list(range(2056))))
    entry = new_entry(decode_node_id="d0", blocks=blocks, now_s=time.monotonic(), turn=1,
                      conversation="c", num_bytes=800, ttl_s=3600.0)
    digests: list[int] = []
    counted: dict[str, Any] = {"on_text_digests": digests.append} if BOUNDED else {}
    index: ConversationIndex
    if redis_url is None:
        index = InMemoryIndex(max_entries=max(100_000, num_entries), **counted)
    else:
        from kvrelay.router.index_redis import RedisIndex

        index = RedisIndex.from_url(redis_url, timeout_s=5.0, deployment=f"bench{num_entries}",
                                    max_entries=max(100_000, num_entries), **counted)
    try:
        for i in range(num_entries):
            identity = text_identity(SCOPE, CONTEXT, prompt_of(i))
            await index.put(filed_at(identity, answer_of(i)), replace(entry, turn=i + 1),
                            tenant="tenant")
        picked = [(k * 7919) % num_entries for k in range(num_lookups)]  # a prime stride:
        follow_ups = [prompt_of(i) + answer_of(i) + b"\nQ: and the next night?\nA:"
                      for i in picked]  # the same mix of lengths at every N (lookups take nothing)
        found = 0
        start = time.process_time()
        for text in follow_ups:
            hit = await index.lookup(text_identity(SCOPE, CONTEXT, text))
            found += hit is not None
        cpu_s = time.process_time() - start
    finally:
        await index.aclose()
    if found != len(follow_ups):
        raise SystemExit(f"{num_entries} entries: only {found} of {len(follow_ups)} found")
    return {"entries": num_entries, "lookups": len(follow_ups),
            "cpu_ms_per_request": cpu_s * 1000 / len(follow_ups),
            "digests_per_lookup": sum(digests) / len(digests) if digests else None}


def run_before(python: Path, num_entries: int, num_lookups: int) -> dict[str, Any]:
    out = subprocess.run(
        [str(python), __file__, "--json", "--entries", str(num_entries),
         "--lookups", str(num_lookups)],
        capture_output=True, text=True, check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", default="100,1000,10000,100000",
                    help="entry counts in the scope, comma-separated")
    ap.add_argument("--lookups", type=int, default=1000,
                    help="follow-ups timed per entry count (before: at most this many)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before-python", type=Path, default=None,
                    help="another checkout's venv python: its kvrelay measured alongside")
    ap.add_argument("--redis", default=None, help="measure RedisIndex on this redis:// URL")
    ap.add_argument("--json", action="store_true",
                    help="one JSON line per entry count (what --before-python reads)")
    args = ap.parse_args()
    counts = [int(x) for x in args.entries.split(",")]
    if args.json:
        for n in counts:
            print(json.dumps(asyncio.run(measure(n, args.lookups, args.redis))), flush=True)
        return
    rows = []
    for n in counts:
        after: list[float] = []
        before: list[float] = []
        work: float | None = None
        for _ in range(args.rounds):
            if args.before_python is not None:
                # the old lookup scans the bucket: fewer follow-ups keep it to seconds
                few = max(5, min(args.lookups, 2_000_000 // max(n, 1)))
                before.append(run_before(args.before_python, n, few)["cpu_ms_per_request"])
            result = asyncio.run(measure(n, args.lookups, args.redis))
            after.append(result["cpu_ms_per_request"])
            work = result["digests_per_lookup"]
        rows.append((n, statistics.median(before) if before else None,
                     statistics.median(after), work))
        print(f"  {n} entries done", file=sys.stderr, flush=True)
    index = "RedisIndex" if args.redis else "InMemoryIndex"
    print(f"router CPU per completions request, lookup path ({index}, one scope; "
          f"median of {args.rounds} rounds)\n")
    def digests(work: float | None) -> str:
        return "-" if work is None else f"{work:.1f}"

    if args.before_python is not None:
        print("| entries in the scope | before (ms) | after (ms) | before / after "
              "| digests per lookup (after) |")
        print("|---:|---:|---:|---:|---:|")
        for n, b, a, w in rows:
            assert b is not None
            print(f"| {n:,} | {b:.3f} | {a:.3f} | {b / a:.1f}x | {digests(w)} |")
    else:
        print("| entries in the scope | CPU per request (ms) | digests per lookup |")
        print("|---:|---:|---:|")
        for n, _, a, w in rows:
            print(f"| {n:,} | {a:.3f} | {digests(w)} |")
    first = rows[0][2]
    print(f"\nafter: {rows[-1][2] / first:.2f}x the CPU per request at {rows[-1][0]:,} "
          f"entries of that at {rows[0][0]:,}")


if __name__ == "__main__":
    main()
