#!/usr/bin/env python3
"""Codex CLI and Claude Code, unmodified, in multi-turn sessions against `kvrelay up`.

    flock /tmp/kvrelay-vllm.lock .venv/bin/python scripts/run_agent_harnesses.py
    make harnesses          # the same (not part of `make test`: real vLLM, minutes)

1. Installs both harnesses from npm into ``--npm-prefix`` if their binaries are missing
   (``@openai/codex@CODEX_VERSION``, ``@anthropic-ai/claude-code@CLAUDE_CODE_VERSION``).
2. Builds the model they run on (``build_harness_model``): the generated ``tiny`` (its BPE
   tokenizer and 128k context, in which Claude Code's first request, ~64 KB of tools and
   ~16 KB of system, is ~23k tokens), with an EOS the model emits after ~12 tokens on
   average (``MEAN_ANSWER_TOKENS``: the harnesses take an answer that stops at its token
   budget as a failure, or answer it with recovery requests; the default models never end
   an answer early, which the tests rely on).
3. Starts ``kvrelay up`` with that model (1 P, 1 D; D's ``max_new_tokens`` capped, as
   Codex sends no output budget), unless ``--router URL`` names a running router.
4. Runs Codex CLI (``codex exec``, then ``codex exec resume --last``), configured as its
   docs say for a custom endpoint (a ``[model_providers.kvrelay]`` with ``base_url`` at the
   router and ``wire_api = "responses"``), and Claude Code (``claude -p``, then ``claude
   -p --continue``) with ``ANTHROPIC_BASE_URL`` at the router and ``ANTHROPIC_MODEL`` the
   served model, ``--turns`` turns each, and prints every request's decision (the router's
   ``/stats``) and the tokens it pulled.

Exit status 0 when every harness turn succeeded and every follow-up turn's first request
pulled. docs/router.md, "The harnesses, measured", has the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODEX_VERSION = "0.171.0"
CLAUDE_CODE_VERSION = "2.1.197"
MEAN_ANSWER_TOKENS = 12
MAX_NEW_TOKENS = 256
SERVED_MODEL = "harness"
PROMPTS = ["List the files in this directory, briefly.", "Now say more about the first one.",
           "Summarize in one line.", "One more detail, please.", "Thanks: anything else?"]


# --- the model ------------------------------------------------------------------------

def model_fingerprint() -> str:
    from kvrelay.models import MODEL_SPECS

    payload = json.dumps({"tiny": MODEL_SPECS["tiny"].fingerprint(), "mean": MEAN_ANSWER_TOKENS,
                          "h": 3})
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def build_harness_model(out_dir: Path) -> None:
    """The generated ``tiny`` (``kvrelay.models``: architecture, tokenizer, context, shaping),
    except that EOS gets column 0 of ``lm_head`` raised so that, sampling at temperature 1
    (the harnesses send none), it ends an answer after ``MEAN_ANSWER_TOKENS`` on average
    (calibrated on a sample of the tokenizer's corpus)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from kvrelay.models import MODEL_SPECS, answer_token_ids, ensure_model

    tiny = ensure_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = Qwen3ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    spec = MODEL_SPECS["tiny"]
    eos_id = model.config.eos_token_id
    printable = answer_token_ids(tokenizer)
    lm_head = model.lm_head.weight
    with torch.no_grad():
        hidden = _answer_states(model, tokenizer, printable)
        anchor = hidden[:, 0]  # type: ignore[index]
        base = hidden @ lm_head.T
        lo, hi = -4.0 * spec.margin, 4.0 * spec.margin
        for _ in range(50):  # the EOS boost whose mean probability is 1 / MEAN_ANSWER_TOKENS
            mid = (lo + hi) / 2
            logits = base.clone()
            logits[:, eos_id] += (mid + 2 * spec.margin) * anchor
            p = torch.softmax(logits, dim=-1)[:, eos_id].mean().item()
            lo, hi = (mid, hi) if p < 1 / MEAN_ANSWER_TOKENS else (lo, mid)
        lm_head[eos_id, 0] = spec.margin + lo
    shutil.copytree(tiny, out_dir)  # tokenizer, config, generation config
    model.save_pretrained(out_dir, safe_serialization=True)


def _answer_states(model: object, tokenizer: object, printable: list[int]) -> object:
    """Final hidden states where an answer's tokens are chosen: chat prompts from the
    tokenizer's corpus with the generation prompt, then 0..23 random answer tokens."""
    import random

    import torch

    from kvrelay.models import CORPUS_PATH

    rng = random.Random(7)
    text = CORPUS_PATH.read_text()
    states = []
    for i in range(24):
        start = rng.randrange(0, len(text) - 4000)
        messages = [{"role": "system", "content": text[start:start + 1500]},
                    {"role": "user", "content": text[start + 1500:start + 1500 + 60 * (i + 1)]}]
        ids = list(tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        answer = [rng.choice(printable) for _ in range(24)]
        out = model.model(torch.tensor([ids + answer]))  # type: ignore[attr-defined]
        states.append(out.last_hidden_state[0, len(ids) - 1:])
    return torch.cat(states)


def ensure_harness_model(cache_dir: Path) -> Path:
    target = cache_dir / f"harness-{model_fingerprint()}"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    build_harness_model(tmp)
    tmp.rename(target)
    return target


# --- the harnesses -------------------------------------------------------------------

def ensure_harnesses(prefix: Path) -> tuple[Path, Path]:
    bins = prefix / "node_modules" / ".bin"
    codex, claude = bins / "codex", bins / "claude"
    if not (codex.exists() and claude.exists()):
        if shutil.which("npm") is None:
            raise SystemExit("npm is needed to install the harnesses (apt-get install npm)")
        subprocess.run(["npm", "install", "--prefix", str(prefix),
                        f"@openai/codex@{CODEX_VERSION}",
                        f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"], check=True)
    return codex, claude


def codex_home(root: Path, router: str) -> Path:
    """Codex's config for a custom endpoint (its docs' ``model_providers``)."""
    home = root / "codex-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'''model = "{SERVED_MODEL}"
model_provider = "kvrelay"
approval_policy = "never"
sandbox_mode = "read-only"

[model_providers.kvrelay]
name = "kvrelay"
base_url = "{router}/v1"
wire_api = "responses"
request_max_retries = 1
stream_max_retries = 1
stream_idle_timeout_ms = 1800000
''')
    return home


def claude_env(root: Path, router: str) -> dict[str, str]:
    """Claude Code's settings for a custom endpoint (its docs' environment variables)."""
    config = root / "claude-home"
    if config.exists():
        shutil.rmtree(config)  # a fresh session: --continue must find this run's turn 1
    config.mkdir(parents=True)
    return {
        "CLAUDE_CONFIG_DIR": str(config), "ANTHROPIC_BASE_URL": router,
        "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": SERVED_MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": SERVED_MODEL, "ANTHROPIC_SMALL_FAST_MODEL": SERVED_MODEL,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1", "API_TIMEOUT_MS": "1800000",
    }


@dataclass
class Turn:
    harness: str
    number: int
    rc: int
    seconds: float
    decisions: list[dict[str, object]]
    tail: str


def _get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        data: dict[str, object] = json.loads(resp.read())
        return data


def recent(router: str) -> list[dict[str, object]]:
    decisions = _get(router + "/stats")["decisions"]
    assert isinstance(decisions, dict)
    return list(decisions["recent"])


def run_turns(name: str, commands: list[list[str]], env: dict[str, str], workdir: Path,
              router: str, timeout_s: float) -> list[Turn]:
    turns = []
    for number, command in enumerate(commands, 1):
        before = len(recent(router))
        started = time.monotonic()
        try:
            proc = subprocess.run(command, cwd=workdir, env={**os.environ, **env},
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout_s)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out = 124, str(exc.stdout or "") + str(exc.stderr or "")
        seconds = time.monotonic() - started
        time.sleep(1.5)  # D's report of a streamed turn
        turns.append(Turn(name, number, rc, seconds, recent(router)[before:],
                          out.strip()[-300:]))
        show(turns[-1])
    return turns


def show(turn: Turn) -> None:
    parts = [f"{d['action']}/{d['reason']} reused {d.get('reused_tokens', 0):,}"
             for d in turn.decisions]
    print(f"{turn.harness} turn {turn.number}: rc {turn.rc}, {turn.seconds:.0f} s, "
          f"{len(turn.decisions)} request(s): {'; '.join(parts) or '-'}", flush=True)
    if turn.rc != 0:
        print("  " + turn.tail.replace("\n", "\n  "), flush=True)
    else:
        print(f"  answer: {turn.tail.splitlines()[-1] if turn.tail else ''!r}", flush=True)


# --- the cluster ---------------------------------------------------------------------

def wait_ready(router: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"kvrelay up exited ({process.returncode})")
        try:
            if _get(router + "/health").get("status") == "ok":
                return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"the cluster was not up after {timeout_s:.0f} s")


def start_cluster(args: argparse.Namespace, model: Path) -> subprocess.Popen[bytes]:
    command = [
        str(REPO / ".venv" / "bin" / "kvrelay"), "up", "--prefill", "1", "--decode", "1",
        "--model", str(model), "--served-model-name", SERVED_MODEL,
        "--max-model-len", "131072", "--base-port", str(args.base_port),
        "--side-channel-base-port", str(args.base_port - 2400),
        "--router-port", str(args.router_port), "--run-dir", str(args.workdir / "cluster"),
        "--startup-timeout-s", "900",
        "--decode-engine-arg=--override-generation-config",
        f"--decode-engine-arg={json.dumps({'max_new_tokens': MAX_NEW_TOKENS})}",
    ]
    log = (args.workdir / "cluster.log").open("wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--npm-prefix", type=Path,
                    default=Path.home() / ".cache" / "kvrelay" / "harness-npm")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "kvrelay" /
                    "harness-run", help="the harnesses' homes, their working dir, logs")
    ap.add_argument("--router", help="use this running router (its model must be served "
                    f"as {SERVED_MODEL!r}) instead of starting a cluster")
    ap.add_argument("--base-port", type=int, default=8300)
    ap.add_argument("--router-port", type=int, default=8390)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-timeout-s", type=float, default=1500.0)
    ap.add_argument("--only", choices=["codex", "claude"], help="run one harness")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    codex, claude = ensure_harnesses(args.npm_prefix)
    cluster = None
    router = args.router
    if router is None:
        model = ensure_harness_model(Path.home() / ".cache" / "kvrelay" / "models")
        print(f"model {model}", flush=True)
        cluster = start_cluster(args, model)
        router = f"http://127.0.0.1:{args.router_port}"
        wait_ready(router, cluster, 900.0)
    router = router.rstrip("/")
    project = args.workdir / "project"
    project.mkdir(exist_ok=True)
    (project / "README.md").write_text("A small project for the harnesses to look at.\n")
    turns: list[Turn] = []
    try:
        prompts = (PROMPTS * args.turns)[:args.turns]
        if args.only in (None, "codex"):
            home = codex_home(args.workdir, router)
            commands = [[str(codex), "exec", "--skip-git-repo-check", prompts[0]]] + [
                [str(codex), "exec", "resume", "--last", "--skip-git-repo-check", p]
                for p in prompts[1:]]
            turns += run_turns("codex", commands, {"CODEX_HOME": str(home)}, project, router,
                               args.turn_timeout_s)
        if args.only in (None, "claude"):
            env = claude_env(args.workdir, router)
            commands = [[str(claude), "-p", prompts[0]]] + [
                [str(claude), "-p", "--continue", p] for p in prompts[1:]]
            turns += run_turns("claude", commands, env, project, router, args.turn_timeout_s)
    finally:
        if cluster is not None:
            os.killpg(cluster.pid, signal.SIGINT)
            try:
                cluster.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(cluster.pid, signal.SIGKILL)
    ok = all(t.rc == 0 for t in turns) and all(
        t.decisions and t.decisions[0].get("reason") == "pull"
        for t in turns if t.number > 1)
    print("every follow-up pulled" if ok else "NOT every turn succeeded and pulled")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
