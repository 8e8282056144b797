"""Which connector fixes a node runs, from what its vLLM and nixl do (pure decision)."""

import pytest

from kvrelay.vllm_plugin.fixes import FixFacts, FixSettings, plan_fixes

VLLM_032_033_CPU = FixFacts("cpu", worker_pins_main_thread=True, nixl_busy_polls=True,
                            scheduler_skips_processed_pull=False)
DEFAULTS = FixSettings(restore_affinity=True, progress_delay_us=1000)


def test_vllm_032_and_033_on_cpu_run_all_three_fixes():
    plan = plan_fixes(VLLM_032_033_CPU, DEFAULTS)
    assert (plan.restore_affinity, plan.progress_delay_us, plan.skip_processed_pull) == (
        True, 1000, True)
    assert plan.reason == (
        "restore main-thread affinity: on; NIXL progress delay: 1000 us; "
        "failed D->P read retried as recompute: on"
    )


def test_on_a_gpu_only_the_failed_read_fix_runs():
    plan = plan_fixes(FixFacts("cuda", True, True, False), DEFAULTS)
    assert (plan.restore_affinity, plan.progress_delay_us, plan.skip_processed_pull) == (
        False, 0, True)
    assert "vLLM re-pins on cpu only, device is cuda" in plan.reason
    assert "applied on cpu only, device is cuda" in plan.reason


def test_each_fix_turns_off_where_the_sources_no_longer_have_its_problem():
    plan = plan_fixes(FixFacts("cpu", False, False, True), DEFAULTS)
    assert (plan.restore_affinity, plan.progress_delay_us, plan.skip_processed_pull) == (
        False, 0, False)
    assert "does not re-pin" in plan.reason
    assert "does not hard-code" in plan.reason
    assert "checks _remote_blocks_processed itself" in plan.reason


def test_unreadable_sources_keep_every_fix_on():
    plan = plan_fixes(FixFacts("cpu", None, None, None), DEFAULTS)
    assert (plan.restore_affinity, plan.progress_delay_us, plan.skip_processed_pull) == (
        True, 1000, True)
    assert plan.reason.count("could not read") == 3


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (FixSettings(restore_affinity=False, progress_delay_us=1000), (False, 1000)),
        (FixSettings(restore_affinity=True, progress_delay_us=0), (True, 0)),
        (FixSettings(restore_affinity=True, progress_delay_us=-5), (True, 0)),
    ],
)
def test_operator_switches_can_only_turn_fixes_off(settings, expected):
    plan = plan_fixes(VLLM_032_033_CPU, settings)
    assert (plan.restore_affinity, plan.progress_delay_us) == expected
    assert plan.skip_processed_pull
