"""The fast selection: the tests not marked slow, distributed or compile,

    .venv/bin/python -m pytest -n 2 -m "not slow and not distributed and not compile"

A test is slow where its decorator says so, or where :data:`SLOW` lists it (``conftest.py``
marks those): every test function that took over :data:`SECONDS`, its parametrisations
together, in a run of the whole suite on 2 cores, but those :data:`KEPT` for a module that
no faster test touches. The selection touches every module of liegroup_blr and experiments
(``tests/project/test_selection.py`` holds that). After a change of the tests, regenerate
the list from a whole run,

    .venv/bin/python -m pytest -n 2 --junitxml=/tmp/all.xml
    .venv/bin/python -m tests.selection /tmp/all.xml [more reports: the slowest counts]

and paste what the second command prints over :data:`SLOW`."""

from __future__ import annotations

import ast
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = ("slow", "distributed", "compile")
SECONDS = 0.3  # a test function over this is slow

# kept however long they take: the one test of a module no faster test touches
KEPT: dict[str, tuple[str, ...]] = {
    "tests/integrations/test_integrations_lightning.py": (
        "test_predict_at_the_model_average_of_samples",
    ),
    "tests/integrations/test_integrations_transformers.py": (
        "test_multiplicative_default_init_keeps_the_layer_norms_of_a_tiny_bert",
    ),
    "tests/library/test_checkpoint.py": (
        "test_a_run_saved_and_loaded_with_dcp_resumes_bit_for_bit",
    ),
}

SLOW: dict[str, tuple[str, ...]] = {
    "tests/drivers/test_benchmarks.py": (
        "test_a_part_over_its_budget_is_stopped",
        "test_gpu_dry_run_refuses_a_wheel_folder_that_lacks_a_wheel",
        "test_gpu_run_refuses_wheels_pip_cannot_install",
        "test_gpu_run_writes_every_parts_status_when_one_fails",
        "test_scale_quick_part_3_prints_the_time_left_and_every_rule",
        "test_step_time_quick_prints_the_time_left_and_every_row",
        "test_threads_quick_prints_every_setting_and_row",
    ),
    "tests/drivers/test_continual.py": (
        "test_a_diverged_run_is_reported_and_the_others_finish",
        "test_a_memory_keeps_examples_of_every_finished_task_on_its_head",
        "test_a_validation_run_never_reads_the_test_set",
        "test_an_optimizer_that_stops_on_skipped_steps_is_a_diverged_run",
        "test_each_memory_example_counts_as_one_of_the_task_and_the_prior_strength_is_passed_on",
        "test_ewc_penalty_changes_the_trajectory",
        "test_fromp_s_memory_is_refreshed_at_every_boundary_from_the_summed_ggn",
        "test_permuted_tasks_are_the_same_split_with_permuted_pixels",
        "test_replaying_the_memory_keeps_the_first_task",
        "test_resume_after_an_interruption_reaches_the_uninterrupted_result",
        "test_smoke_config_runs_from_the_cli",
        "test_the_posterior_of_a_rule_is_saved_and_becomes_the_prior",
        "test_the_prior_removed_keeps_the_first_task_s_regularisers",
        "test_tuning_trains_every_point_on_the_validation_split_and_chooses_the_best",
    ),
    "tests/drivers/test_docs_tables.py": (
        "test_a_comparison_folder_becomes_a_summary_the_pages_can_quote",
    ),
    "tests/drivers/test_experiments.py": (
        "test_cli_reports_errors_and_runs",
        "test_compare_writes_report_folder",
        "test_end_to_end",
        "test_resume_of_a_finished_run_only_evaluates",
        "test_resume_reaches_the_uninterrupted_result",
        "test_threads_sets_torchs_thread_count",
        "test_training_learns_the_synthetic_task",
    ),
    "tests/drivers/test_experiments_parts.py": (
        "test_mnist5k_split_is_stratified_in_file_order",
        "test_rules_train_nhwc_weights_as_nchw",
    ),
    "tests/drivers/test_experiments_tuning.py": (
        "test_tuning_trains_every_point_on_held_out_examples_and_chooses_the_best",
    ),
    "tests/drivers/test_failed_starts.py": ("test_a_failed_resume_leaves_the_earlier_run_intact",),
    "tests/drivers/test_figures.py": (
        "test_every_figure_of_a_comparison_names_it",
        "test_every_figure_of_a_run_names_its_data_rule_and_seed",
        "test_filter_grid_has_a_colour_bar_of_its_scale",
        "test_the_converged_figure_names_the_removals_and_the_floors_axis",
        "test_the_lifelong_figures_come_from_the_docs_summaries",
        "test_the_loo_figure_comes_from_the_docs_summary",
    ),
    "tests/drivers/test_memory_influence.py": (
        "test_the_hessian_is_autograds",
        "test_the_newton_step_is_the_first_order_change_of_the_minimiser",
        "test_with_the_draws_at_the_mean_the_newton_step_is_the_laplace_form",
    ),
    "tests/drivers/test_memory_map.py": (
        "test_a_training_killed_between_epochs_resumes_to_the_same_posterior",
        "test_retraining_is_deterministic_and_starts_from_the_trained_state",
        "test_the_command_writes_every_part_and_resumes_without_losing_a_retraining",
        "test_the_drift_floor_is_zero_where_retraining_is_deterministic_and_at_rest",
        "test_the_map_of_a_finished_run_is_written_into_its_folder",
    ),
    "tests/drivers/test_memory_map_converged.py": (
        "test_converged_retraining_moves_nothing_unless_an_example_is_removed",
        "test_multiplicative_retraining_moves_nothing_unless_an_example_is_removed",
        "test_the_command_writes_its_files_and_resumes_without_redoing_a_retraining",
    ),
    "tests/drivers/test_memory_map_loo.py": (
        "test_the_command_writes_every_criterion_per_delta_and_resumes",
    ),
    "tests/drivers/test_reporting.py": (
        "test_compare_figures_name_the_data_and_the_seeds",
        "test_compare_over_seeds_reports_mean_sd_and_per_seed",
        "test_compare_seeds_flag_overrides_the_config",
        "test_log_g_walk_runs_each_noise_and_reports_final_metrics",
    ),
    "tests/drivers/test_run_safety.py": (
        "test_a_changed_half_finished_run_starts_again",
        "test_a_checkpoint_without_rows_resumes_with_those_of_metrics_file",
        "test_a_finished_run_without_checkpoint_is_never_overwritten",
        "test_a_folder_in_use_is_refused_until_its_run_dies",
        "test_compare_checks_before_writing_its_config",
        "test_corrupt_checkpoint_is_one_line",
        "test_corrupt_metrics_file_is_rebuilt_on_resume",
        "test_corrupt_run_config_names_the_file",
        "test_interrupting_at_every_write_loses_nothing",
        "test_kill_after_a_checkpoint_loses_no_metrics_row",
        "test_kill_during_a_resume_loses_nothing",
        "test_resume_refuses_to_change_or_drop_what_has_run",
        "test_resume_takes_changes_to_runs_that_have_not_started",
    ),
    "tests/drivers/test_scale_step.py": ("test_scale_fixed_point_driver",),
    "tests/drivers/test_skeleton.py": (
        "test_continual_reports_the_time_left_after_every_epoch",
        "test_only_the_skeleton_seeds_restores_generators_or_steps_a_schedule",
    ),
    "tests/integrations/test_integrations_lightning.py": (
        "test_automatic_mc_samples_scheduler_and_clipping_equal_the_closure_loop",
    ),
    "tests/integrations/test_integrations_plain.py": (
        "test_importing_the_library_imports_no_training_stack",
    ),
    "tests/integrations/test_integrations_transformers.py": (
        "test_a_blr_trainer_without_a_lie_group_optimizer_warns",
        "test_a_resume_takes_the_checkpoint_s_weights_without_adopting_them",
        "test_evaluating_during_training_changes_no_step",
        "test_load_best_model_at_end_evaluates_and_saves_the_best_checkpoint",
        "test_the_callback_leaves_the_point_estimate_and_a_second_train_continues_exactly",
        "test_the_callback_saves_and_evaluates_the_point_estimate_during_training",
        "test_tiny_bert_trains_evaluates_saves_and_resumes",
        "test_trainer_evaluates_the_model_average_of_samples",
        "test_trainer_evaluating_the_model_average_during_training_resumes_bit_for_bit",
        "test_trainer_saves_the_point_estimate_and_resumes_bit_for_bit",
        "test_trainer_steps_the_clipped_gradient_at_samples_and_evaluates_at_the_point",
        "test_weight_decay_in_the_trainers_param_groups_is_the_gaussian_prior",
        "test_what_the_trainer_cannot_step_is_refused_in_one_line",
    ),
    "tests/library/test_custom_groups.py": ("test_monte_carlo_fisher_matches_the_declared_metric",),
    "tests/library/test_default_posterior.py": (
        "test_a_prior_keeps_the_old_task_better_than_fine_tuning",
        "test_next_task_trains_with_readme_values",
        "test_readme_values_learn_the_scale_in_ten_passes",
        "test_scale_step_is_the_fraction_of_the_way_at_every_n",
    ),
    "tests/library/test_distributions.py": (
        "test_sample_into_law",
        "test_student_t_integer_df_law_on_a_million_draws",
    ),
    "tests/library/test_geoopt.py": (
        "test_affine_kl_converges",
        "test_importing_the_library_raises_no_warning_where_warnings_are_errors",
        "test_multiplicative_log_cosh_converges",
    ),
    "tests/library/test_kl.py": (
        "test_closed_form_gradient_against_monte_carlo",
        "test_closed_form_kl_against_quadrature_per_coordinate",
        "test_library_monte_carlo_agrees_with_the_closed_form",
        "test_monte_carlo_affine_student_t_against_quadrature",
    ),
    "tests/library/test_kprior.py": (
        "test_at_full_memory_logistic_regression_ends_at_the_joint_map",
    ),
    "tests/library/test_mc.py": ("test_vectorised_samples_equal_the_sequential_loop",),
    "tests/library/test_optim.py": ("test_all_rules_train_a_network",),
    "tests/library/test_posterior.py": ("test_sample_moments_follow_the_group_and_base",),
    "tests/library/test_precision.py": (
        "test_half_precision_follows_the_float32_path_with_float32_state",
    ),
    "tests/library/test_prediction_draws.py": (
        "test_evaluating_between_steps_does_not_change_training",
    ),
    "tests/library/test_sensitivity.py": (
        "test_affine_rule_trained_at_a_temperature_gives_the_untempered_estimate",
    ),
    "tests/library/test_torch_optim_port.py": (
        "test_autocast_with_grad_scaler_trains",
        "test_every_scheduler_sets_the_rates_of_every_step",
        "test_forloop_goes_right_direction",
        "test_goes_right_direction",
    ),
    "tests/project/test_architecture.py": ("test_each_module_is_listed_once_on_its_floor",),
    "tests/project/test_docs.py": ("test_page_examples_run",),
    "tests/project/test_selection.py": (
        "test_every_test_listed_slow_exists",
        "test_the_fast_selection_touches_every_module",
        "test_the_reach_counts_names_and_their_imports_but_not_a_package_s",
    ),
    "tests/project/test_structure.py": (
        "test_nothing_below_the_optimizers_imports_them",
        "test_the_package_imports_form_a_tree",
    ),
}


def is_listed(nodeid: str) -> bool:
    """Whether :data:`SLOW` lists the test ``FILE::NAME[PARAMETERS]``."""
    path, _, name = nodeid.partition("::")
    return name.partition("[")[0] in SLOW.get(path, ())


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The ``pytest.mark.NAME`` of the decorators (called or not, in a list or not)."""
    found = set()
    for node in decorators:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute):
                if sub.value.attr == "mark":
                    found.add(sub.attr)
    return found


def test_functions(path: Path) -> dict[str, set[str]]:
    """The test functions of the file (``Class::name`` in a class) → their marks, the
    module's ``pytestmark`` included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            module_marks |= _marks([node.value])
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            found[node.name] = module_marks | _marks(node.decorator_list)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    marks = module_marks | _marks(node.decorator_list + item.decorator_list)
                    found[f"{node.name}::{item.name}"] = marks
    return found


def files() -> list[str]:
    """The test files with a test in the fast selection."""
    chosen = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        name = path.relative_to(ROOT).as_posix()
        if any(
            not marks & set(LEFT_OUT) and function not in SLOW.get(name, ())
            for function, marks in test_functions(path).items()
        ):
            chosen.append(name)
    return chosen


def slow_from_junit(*reports: Path) -> dict[str, list[str]]:
    """The test functions over :data:`SECONDS` in JUnit XML reports of the whole suite (in
    the slowest report of each), those a decorator already leaves out of the selection left
    out."""
    seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
    for report in reports:
        this: dict[tuple[str, str], float] = collections.defaultdict(float)
        for case in ET.parse(report).iter("testcase"):
            parts = case.attrib["classname"].split(".")
            split = next(i for i in range(len(parts), 0, -1) if parts[i - 1].startswith("test"))
            path = "/".join(parts[:split]) + ".py"
            function = "::".join([*parts[split:], case.attrib["name"].partition("[")[0]])
            this[path, function] += float(case.attrib.get("time", 0.0))
        for key, total in this.items():
            seconds[key] = max(seconds[key], total)
    marks = {path: test_functions(ROOT / path) for path, _ in seconds if (ROOT / path).is_file()}
    slow: dict[str, list[str]] = collections.defaultdict(list)
    for (path, function), total in sorted(seconds.items()):
        if function in marks.get(path, {}) and not marks[path][function] & set(LEFT_OUT):
            if total > SECONDS and function not in KEPT.get(path, ()):
                slow[path].append(function)
    return dict(slow)


def main(argv: list[str]) -> int:
    slow = slow_from_junit(*map(Path, argv))
    print("SLOW: dict[str, tuple[str, ...]] = {")
    for path, functions in slow.items():
        one = f'    "{path}": ("{functions[0]}",),'
        if len(functions) == 1 and len(one) <= 100:  # as ruff formats it
            print(one)
        else:
            print(f'    "{path}": (', *(f'        "{f}",' for f in functions), "    ),", sep="\n")
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
