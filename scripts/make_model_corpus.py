#!/usr/bin/env python3
"""Write ``src/kvrelay/model_corpus.txt``: the text the default models' BPE tokenizer is
trained on (``kvrelay.models.build_tokenizer``).

    .venv/bin/python scripts/make_model_corpus.py

The corpus is a committed snapshot, not read from the live tree at model-generation time:
the tokenizer (so every token id, and the cache key of every generated model) must not
change when a doc is edited. It is this repository's docs and README as of the snapshot and
the first request bodies the two agent harnesses sent (``tests/data/harness``: their system
prompts and tool schemas), so English prose, Markdown, JSON and agent prompts tokenize at
~3.3 bytes per token. Rerunning it changes the default models (their fingerprint covers the
corpus's digest): only do so on purpose, and re-measure the bench figures.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "src" / "kvrelay" / "model_corpus.txt"


def corpus() -> str:
    parts = [p.read_text() for p in sorted([*REPO.glob("docs/*.md"), REPO / "README.md"])]
    for name in ("claude_code_session", "codex_session"):
        capture = json.loads((REPO / "tests" / "data" / "harness" / f"{name}.json").read_text())
        parts.append(json.dumps(capture["turns"][0]["body"], indent=2))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.write_text(corpus())
    print(f"{OUT}: {OUT.stat().st_size} bytes")
