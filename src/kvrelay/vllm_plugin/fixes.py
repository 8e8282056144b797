"""Which of kvrelay's connector fixes a node runs, decided from what its vLLM and NIXL do.

kvrelay's ``NixlConnector`` (``kvrelay.vllm_plugin.connector``) carries three fixes; each one is
only worth running where the problem it fixes exists (docs/cpu-notes.md, "The fixes on each
vLLM version"):

1. *restore the worker's main-thread affinity*: vLLM's NIXL worker re-pins its calling thread
   to one reserved core, on the CPU platform only;
2. *NIXL progress-thread delay*: the nixl Python API hard-codes a busy-polling progress
   thread; a delay is only applied on the CPU platform, where that thread competes with the
   forward pass for the same few cores (on a GPU host it costs one idle host core, and a
   delay there is unmeasured);
3. *a failed D->P read is retried as a recompute*: vLLM's pull scheduler asks again for a
   load ``update_state_after_alloc`` will never queue; on every platform.

The facts come from reading the installed vLLM and nixl sources
(``kvrelay.vllm_plugin.contract.fix_facts``); a fact that could not be read is ``None`` and
keeps its fix on, which is what kvrelay did before it could tell.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixFacts:
    """What the node's vLLM and NIXL do (``None``: could not tell)."""

    device_type: str
    #: ``NixlBaseConnectorWorker.__init__`` calls ``os.sched_setaffinity(0, ...)``.
    worker_pins_main_thread: bool | None
    #: ``nixl_agent.__init__`` sets ``pthrDelay`` to the constant 0.
    nixl_busy_polls: bool | None
    #: The pull scheduler's ``get_num_new_matched_tokens`` itself looks at
    #: ``_remote_blocks_processed`` (then fix 3 is upstream).
    scheduler_skips_processed_pull: bool | None


@dataclass(frozen=True)
class FixSettings:
    """The operator's switches, from ``kv_connector_extra_config``."""

    restore_affinity: bool
    progress_delay_us: int


@dataclass(frozen=True)
class FixPlan:
    restore_affinity: bool
    progress_delay_us: int
    skip_processed_pull: bool
    reason: str


def plan_fixes(facts: FixFacts, settings: FixSettings) -> FixPlan:
    """The fixes to run on a node; ``reason`` says why each one is on or off."""
    restore, why_restore = _restore_affinity(facts, settings)
    delay_us, why_delay = _progress_delay(facts, settings)
    skip, why_skip = _skip_processed_pull(facts)
    return FixPlan(
        restore_affinity=restore,
        progress_delay_us=delay_us,
        skip_processed_pull=skip,
        reason=(
            f"restore main-thread affinity: {why_restore}; NIXL progress delay: {why_delay}; "
            f"failed D->P read retried as recompute: {why_skip}"
        ),
    )


def _restore_affinity(facts: FixFacts, settings: FixSettings) -> tuple[bool, str]:
    if not settings.restore_affinity:
        return False, "off (kvrelay_restore_affinity=false)"
    if facts.device_type != "cpu":
        return False, f"off (vLLM re-pins on cpu only, device is {facts.device_type})"
    if facts.worker_pins_main_thread is False:
        return False, "off (this vLLM's NIXL worker does not re-pin its main thread)"
    if facts.worker_pins_main_thread is None:
        return True, "on (could not read vLLM's NIXL worker)"
    return True, "on"


def _progress_delay(facts: FixFacts, settings: FixSettings) -> tuple[int, str]:
    if settings.progress_delay_us <= 0:
        return 0, "off (kvrelay_nixl_progress_delay_us=0)"
    if facts.device_type != "cpu":
        return 0, f"off (applied on cpu only, device is {facts.device_type})"
    if facts.nixl_busy_polls is False:
        return 0, "off (this nixl does not hard-code a busy-polling progress thread)"
    delay_us = settings.progress_delay_us
    if facts.nixl_busy_polls is None:
        return delay_us, f"{delay_us} us (could not read nixl's agent)"
    return delay_us, f"{delay_us} us"


def _skip_processed_pull(facts: FixFacts) -> tuple[bool, str]:
    if facts.scheduler_skips_processed_pull is True:
        return False, "off (vLLM's pull scheduler checks _remote_blocks_processed itself)"
    if facts.scheduler_skips_processed_pull is None:
        return True, "on (could not read vLLM's pull scheduler)"
    return True, "on"
