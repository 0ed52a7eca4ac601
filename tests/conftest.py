import os
import sys
import warnings

# tests/models.py holds the small models shared by the backend tests.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def fresh_dynamo():
    """Compile from scratch: each test sees its own graphs (and the next test none of them)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- slow tests ----------------------------------------------------------------------------
# `make test-fast` runs `pytest -m "not slow"`: what a developer runs between edits, under 3
# minutes on 2 cores; `make test` runs everything. The slow tests are named here, in one table,
# rather than marked in each file: a test file (all its tests), a test function (all its
# parametrizations) or one node id, relative to the repository root. The times are each
# entry's share of one `--durations=0` run of the whole suite (call + setup + teardown, all
# cases; TRITON_INTERPRET=1, 2 cores shared with other test runs at a load of 4 to 8, so
# inflated; 604 s recorded in all, 10 min 18 s wall), commit 4a8fa94. The rule: a test
# function whose cases take 1 s or more in all is slow (532 s of the 604), except in
# tests/test_layout.py (the import contracts: what a refactoring breaks), test_digits.py and
# test_formats.py (the numerics' own definitions), which stay fast. Then `-m "not slow"` ran
# 1547 tests on 97 s of CPU (3 min 35 s wall at 45% of a core under that load). Re-measure with
#   TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider --durations=0
# An entry that matches nothing in a file that was collected whole is reported as a warning
# (a renamed test would otherwise silently become fast).
SLOW_TESTS = (
    # 54.3 s, 36 cases
    "tests/kernels/test_accumulate_kernel.py::test_every_mode_block_and_format_is_emulate_matmul_bit_for_bit",
    "tests/kernels/test_accumulate_kernel.py::test_broadcasting_like_matmul",  # 4.0 s, 4 cases
    # 3.8 s, 2 cases
    "tests/kernels/test_accumulate_kernel.py::test_the_analysis_gemm_is_the_same_bits_with_every_kernel",
    # 3.8 s, 6 cases
    "tests/kernels/test_accumulate_kernel.py::test_stacked_samples_draw_as_the_analysis_cpu_path",
    # 2.8 s
    "tests/kernels/test_accumulate_kernel.py::test_an_analysed_linear_reads_the_same_digits_with_the_triton_kernel",
    "tests/kernels/test_accumulate_kernel.py::test_subnormal_and_overflowing_accumulators",  # 1.1 s
    # 2.1 s
    "tests/kernels/test_dispatch.py::test_no_import_side_effects_and_triton_on_cpu_says_why",
    "tests/kernels/test_round_digits.py::test_formats_modes_bit_exact",  # 3.2 s, 75 cases
    "tests/kernels/test_round_digits.py::test_shapes_and_sample_counts",  # 3.2 s, 4 cases
    # 1.0 s
    "tests/monitor/test_calibrate.py::test_per_family_thresholds_detect_what_one_global_pair_cannot",
    "tests/monitor/test_monitor.py::test_projection_estimate_tracks_full_norm",  # 4.4 s, 2 cases
    # 3.9 s
    "tests/monitor/test_monitor.py::test_settled_operators_are_checked_on_one_turn_in_settle_every",
    "tests/monitor/test_monitor.py::test_schedule_covers_all_candidates",  # 1.4 s
    # 1.4 s
    "tests/monitor/test_monitor.py::test_promotion_switches_implementation_without_recompiling",
    # 1.0 s, 2 cases
    "tests/monitor/test_monitor.py::test_outputs_and_gradients_unchanged_without_promotion",
    # 7.6 s, 2 cases
    "tests/test_accumulation.py::test_cestac_digits_with_a_random_accumulator_are_not_over_optimistic",
    "tests/test_accumulation.py::test_an_hf_gpt2s_conv1d_projections_are_modelled",  # 1.8 s
    # 1.8 s
    "tests/test_accumulation.py::test_the_fast_accumulator_loses_more_with_k_and_promotion_bounds_it",
    # 1.6 s, 8 cases
    "tests/test_accumulation.py::test_fp8_operands_are_scaled_and_rounded_as_the_recipes_say",
    "tests/test_alloc.py::test_tuned_allocator_stops_refaulting_freed_temporaries",  # 5.9 s
    "tests/test_alloc.py::test_user_malloc_settings_are_left_alone",  # 3.6 s
    "tests/test_alloc.py::test_trim_returns_the_free_pages_a_fragmented_heap_keeps",  # 3.5 s
    "tests/test_aten_backend.py::test_cpu_kernels_match_the_torch_references",  # 1.8 s, 3 cases
    # 1.5 s, 3 cases
    "tests/test_aten_backend.py::test_deterministic_output_and_gradients_unchanged",
    # 4.3 s, 2 cases
    "tests/test_aten_coverage.py::test_transformer_encoder_fast_path_is_lowered_from_its_composite",
    "tests/test_aten_coverage.py::test_dynamic_model_is_lowered_once_and_analysed",  # 1.9 s
    "tests/test_backend.py::test_deterministic_output_is_bit_identical_to_eager",  # 7.8 s, 9 cases
    "tests/test_backend.py::test_default_selection_instruments_the_operator_families",  # 1.1 s
    "tests/test_backend.py::test_a_model_s_attention_runs_the_fused_kernel_on_its_samples",  # 1.0 s
    "tests/test_backward.py::test_training_is_unchanged_bit_for_bit",  # 4.4 s, 2 cases
    "tests/test_bench_localization.py::test_two_cases_write_scored_rows",  # 2.7 s
    "tests/test_ci.py::test_the_workflows_steps_on_two_commits",  # 13.0 s
    "tests/test_cli.py::test_ci_script_with_the_backend",  # 16.8 s
    "tests/test_cli.py::test_ci_script_with_stand_in_backend",  # 10.9 s
    "tests/test_cli.py::test_show_into_a_closed_pipe_prints_no_traceback",  # 3.0 s
    "tests/test_cli.py::test_diff_as_a_subprocess",  # 2.1 s
    "tests/test_cli.py::test_show_of_the_demo_recorded_in_fp16_names_the_nan_origin_first",  # 2.0 s
    "tests/test_cli.py::test_an_installed_package_target_from_another_folder",  # 1.9 s
    "tests/test_cli.py::test_demo_ends_with_what_to_fix_first",  # 1.8 s
    "tests/test_cli.py::test_show_prints_worst_and_localization_and_draws",  # 1.1 s
    "tests/test_coverage.py::test_opinfo_sweep_stride",  # 26.6 s, 4 cases
    # 3.1 s, 2 cases
    "tests/test_coverage.py::test_transformer_encoder_fast_path_is_analysed_with_the_unfused_names",
    # 1.7 s, 2 cases
    "tests/test_coverage.py::test_recurrent_layers_are_rounded_with_the_deterministic_dropout_masks",
    "tests/test_coverage.py::test_multihead_attention_is_one_analysed_operator",  # 1.0 s, 2 cases
    # 21.4 s, 2 cases
    "tests/test_ddp.py::test_training_is_unchanged_and_the_gathered_map_merges_every_rank",
    "tests/test_ddp.py::test_a_backend_that_never_ran_says_so",  # 5.9 s
    # 104.6 s
    "tests/test_gpu_check.py::test_the_dry_run_reaches_every_step_and_writes_the_summary",
    "tests/test_gpu_check.py::test_e2e_refuses_cuda_without_a_device",  # 2.0 s
    "tests/test_hf_models.py",  # 34 s, every test loads a Hugging Face model
    "tests/test_html_pages.py::test_demo_map_page_in_chromium",  # 6.2 s
    "tests/test_html_pages.py::test_training_map_page_heatmap_and_lines_in_chromium",  # 4.5 s
    "tests/test_html_pages.py::test_pages_are_self_contained_and_name_every_operator",  # 2.1 s
    "tests/test_html_pages.py::test_a_250_operator_map_over_100_steps_stays_under_2_mb",  # 1.1 s
    "tests/test_lowp_gemm.py::test_a_hf_model_in_bf16_reads_its_weights_as_they_are",  # 17 s
    "tests/test_maps_ab.py::test_the_checkout_against_itself_is_equal",  # 4.3 s
    "tests/test_native.py::test_binary_steps_give_the_same_maps_on_opinfo_operators",  # 17.3 s
    "tests/test_native.py::test_first_build_says_so_once_on_stderr",  # 4.8 s
    # 4.1 s, 10 cases
    "tests/test_native.py::test_perturbation_of_every_sample_count_is_the_reference",
    "tests/test_native.py::test_binary_kernel_is_the_operator_then_the_rounder",  # 4.0 s, 60 cases
    "tests/test_native.py::test_disabled_by_environment",  # 3.2 s
    "tests/test_native.py::test_sample_counts_and_odd_sizes",  # 2.6 s, 60 cases
    "tests/test_native.py::test_missing_compiler_falls_back_with_one_warning",  # 2.4 s
    "tests/test_native.py::test_binary_steps_give_the_general_paths_maps",  # 1.7 s, 2 cases
    "tests/test_packaging.py::test_installed_wheel_analyses_and_runs_the_demo",  # 21.7 s
    # 27.6 s, 14 cases
    "tests/test_passes.py::test_aten_sampled_graph_gives_the_reports_and_counters_of_the_untraced_rules",
    # 8.1 s, 10 cases
    "tests/test_passes.py::test_sampled_graph_gives_the_reports_of_the_untraced_rules",
    # 1.5 s
    "tests/test_passes.py::test_an_untraceable_graph_runs_its_rules_untraced_with_a_warning",
    # 11.0 s
    "tests/test_plan.py::test_a_plan_promotes_both_planted_hazards_and_little_else_and_the_real_run_keeps_its_digits",
    "tests/test_plan.py::test_a_plan_names_the_modules_that_can_run_whole_in_fp32",  # 2.2 s
    "tests/test_plan.py::test_a_loss_before_a_graph_break_is_planned_too",  # 1.9 s
    "tests/test_plots.py::test_plot_graph_writes_pictures_that_name_the_origin",  # 2.3 s
    # 3.7 s, 2 cases
    "tests/test_report.py::test_reports_read_at_the_end_equal_reports_read_after_every_call",
    # (tests/test_torchao.py measured alone, commit 2f7b02e) 5.3 s, 2 cases
    "tests/test_torchao.py::test_a_transformer_block_trains_as_the_program_runs",
    # 4.1 s, 4 cases
    "tests/test_torchao.py::test_backward_casts_are_roundings_into_their_float8_formats",
    # 2.5 s, 4 cases
    "tests/test_torchao.py::test_forward_map_names_the_float8_gemms_with_their_recipe",
    # 2.4 s, 4 cases (commit 62fda6a)
    "tests/test_torchao.py::test_the_arithmetic_level_rounds_the_casts_into_float8",
)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _node_id(item: pytest.Item) -> str:
    """The item's node id relative to the repository root, whatever pytest's rootdir is."""
    path = os.path.relpath(str(item.path), _ROOT).replace(os.sep, "/")
    _, sep, rest = item.nodeid.partition("::")
    return path + sep + rest


def _names(entry: str, node_id: str) -> bool:
    """Whether a SLOW_TESTS entry names the test: the same id, or a prefix that ends where a
    file, a class, a function or its parameters end."""
    return node_id == entry or (node_id.startswith(entry) and node_id[len(entry)] in ":[")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marks
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Mark the tests SLOW_TESTS names as ``slow``."""
    used, files = set(), set()
    for item in items:
        node_id = _node_id(item)
        files.add(node_id.partition("::")[0])
        for entry in SLOW_TESTS:
            if _names(entry, node_id):
                item.add_marker(pytest.mark.slow)
                used.add(entry)
                break
    whole = not config.option.keyword and not any("::" in str(a) for a in config.args)
    stale = [e for e in SLOW_TESTS if e not in used and e.partition("::")[0] in files]
    if whole and stale:
        warnings.warn(pytest.PytestWarning(
            f"tests/conftest.py: SLOW_TESTS names tests that do not exist (renamed?): "
            f"{', '.join(stale)}"))
