"""The quick tier: `python -m pytest -m quick`, for development (about 2 minutes on 2 busy cores).

It covers every area once (the planner, schedules, codecs and links, config, the control-plane
protocol, checkpoints, gradient sync, live moves, one small end-to-end run) with the tests that
are quick; what it leaves out (most multi-process runs, hostile inputs at length, precision,
TLS, recovery) the full suite runs, as CI does. Kept in one place, so that a reader sees the
whole tier and files that others edit need not change to be in it; conftest.py marks the
tests, and a name here that no longer names a test fails the quick run instead of shrinking it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Whole modules: their tests take under a few seconds together.
MODULES = {
    "test_planner", "test_exact_pricing", "test_plan_output", "test_planner_dp", "test_batch_sizes",
    "test_contention", "test_hierarchical_sync_cost", "test_sealed_cost", "test_schedule_choice",  # the planner
    "test_search_bounds", "test_bounded_pricing", "test_pair_splits", "test_window_cuts", "test_sync_floor",  # the search's bounds against brute force
    "test_simulation_core", "test_cut_front", "test_compiled_cut_loops",  # the planner's compiled loops against their Python ones
    "test_schedules", "test_typed_schedules", "test_split_backward", "test_device_schedules", "test_bubble_fill",  # schedules and the split backward
    "test_wire_rounding",  # bf16 on links
    "test_codecs", "test_registry", "test_link", "test_link_layout", "test_link_hostile_peer", "test_link_probe",
    "test_grad_sync", "test_sealing",  # codecs, links, sync, seals
    "test_cluster_config", "test_hostile_yaml", "test_cli_errors", "test_memory_limit", "test_slurm_config",  # config
    "test_protos", "test_coordinator", "test_coordinator_hostile_agent", "test_move_protocol", "test_rendezvous_store",
    "test_step_reporter",  # the control-plane protocol
    "test_model", "test_data", "test_checkpoint", "test_part_store", "test_recipe", "test_whole_file",  # the model, data, checkpoints, optimizers
    "test_import_rules", "test_process_rules", "test_packaging", "test_late_steps", "test_topology", "test_pinned_windows_priced",
    "test_report_marks", "test_report_rows",  # report: the events marked on training.png, metrics rows read sampled
    "test_islands_plan",  # islands: grouping, H, the merged plan, the YAML
    "test_device_plans", "test_device_schedule_config",  # several stages per node: plans and the YAML
    "test_auto_device_schedules",  # ... and schedule: auto choosing them
    "test_k8s_manifests",  # deploy k8s: rendered manifests against Kubernetes' schemas
    "test_remote_start_checks",  # what up checks before starting agents elsewhere (ssh, Slurm, Ray)
}

# Single tests of slower modules (module::test function).
TESTS = {
    "test_pause_up::test_the_clock_leaves_out_a_gap_longer_than_a_pause_and_keeps_short_ones",
    "test_end_to_end::test_tiny_example_trains_and_writes_the_run_dir",  # one small end-to-end run
    "test_memory_summary::test_the_summary_keeps_each_stages_largest_report_beside_the_prediction",
    "test_live_move::test_transfers_come_from_the_old_holder_in_the_same_pipeline_in_one_order",
    "test_live_move::test_the_straggler_watch_judges_no_step_while_a_live_move_it_asked_for_is_under_way",
    "test_calibration::test_speed_changes_take_effect_at_their_step_and_are_checked",
    "test_calibration::test_calibration_fits_each_nodes_compute_and_prices_the_plan_again",
    "test_coordinator_torch_free::test_importing_every_launcher_module_loads_no_torch",
    "test_island_recovery::test_a_replica_checkpoint_takes_its_parts_from_one_island",
}

# Tests of the modules above that are not quick: a whole `up`, a large brute force, a process
# per case or seconds of emulated waiting each (8-18 s apiece with a busy loop beside them).
SLOW = {
    "test_planner_dp::test_two_pipelines_near_brute_force_with_sync",
    "test_batch_sizes::test_up_with_a_global_batch_profiles_two_sizes_and_trains_at_the_chosen_one",
    "test_batch_sizes::test_global_batch_plan_is_the_best_of_its_candidate_sizes",
    "test_cli_errors::test_node_that_never_joins",
    "test_cli_errors::test_agent_with_wrong_token_is_refused",
    "test_memory_limit::test_up_with_a_stage_over_its_nodes_memory_fails_in_one_line",
    "test_recipe::test_sgd_run_with_evaluation_reports_the_held_out_loss_of_its_weights",
    "test_rendezvous_store::test_up_listens_on_one_port_only_while_a_job_trains",
    "test_checkpoint::test_a_crash_mid_write_leaves_the_last_checkpoint",
    "test_batch_sizes::test_plan_command_global_batch_offline",
    "test_grad_sync::test_emulated_sync_starts_when_the_last_holder_joins",
    # a CLI process per case; one-line CLI errors stay in the tier with test_hostile_yaml's others
    "test_cli_errors::test_bad_config_is_one_line_and_exit_2",
    "test_cli_errors::test_usage_error_is_one_line_and_exit_2",
    "test_cli_errors::test_help_still_works_after_usage_errors_became_one_line",
    "test_hostile_yaml::test_cli_bad_names",
    "test_hostile_yaml::test_cli_deep_nesting_is_one_line",
    # 32 plans of 6 nodes, with the sync floor and without (40 s); its bound test stays
    "test_sync_floor::test_pruning_by_it_returns_the_plan_of_the_search_without_it",
    # 15 brute forces of two pipelines (65 s under load); test_planner's brute force stays
    "test_planner_dp::test_two_pipelines_equal_brute_force_when_sync_is_free",
    # a fresh interpreter per launcher module (15 s); test_coordinator_torch_free's one import stays
    "test_import_rules::test_no_launcher_module_loads_torch_when_imported",
    # the three slowest left (2026-12-07: the tier took 180-199 s, over its 3 minutes, on this VM):
    # the coordinator's 10 s handshake timeout waited out, a link probe grown to its time bound (5 s),
    # a sweep of chains priced bounded and unbounded (6 s; test_search_bounds' checks stay)
    "test_coordinator::test_a_connection_that_never_speaks_is_closed_before_it_can_pile_up",
    "test_link_probe::test_the_link_probe_stops_growing_where_a_size_would_take_too_long",
    "test_bounded_pricing::test_bounded_pricing_over_a_sweep_of_chains_equals_unbounded_pricing_or_rules_out",
    # three `plan --profile` processes (2026-12-07: the tier was at 175 s of its 3 minutes), and then,
    # at 181-194 s, every cut of the bench's clusters simulated (15 s; test_cut_front's plan checks stay)
    "test_cli_errors::test_plan_from_a_saved_profile_plans_the_yamls_nodes_only",
    "test_window_cuts::test_plans_equal_the_plan_of_every_cut_on_the_benchs_clusters",
}


def mark_quick(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the quick tier's tests; with `-m quick` over whole folders, fail on a stale name."""
    seen_modules, seen_tests = set(), set()
    for item in items:
        module = Path(str(item.fspath)).stem
        test = f"{module}::{getattr(item, 'originalname', item.name)}"
        seen_modules.add(module)
        seen_tests.add(test)
        if (module in MODULES and test not in SLOW) or test in TESTS:
            item.add_marker(pytest.mark.quick)
    whole = all(Path(arg.split("::")[0]).is_dir() for arg in config.args)
    if "quick" in (config.option.markexpr or "") and whole:
        stale = sorted((MODULES - seen_modules) | ((TESTS | SLOW) - seen_tests))
        if stale:
            raise pytest.UsageError(f"tests/quick_tier.py names tests that were not collected: {', '.join(stale)}")
