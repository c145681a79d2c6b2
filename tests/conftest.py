"""Shared test hygiene, and which tests are ``slow``.

No default process group (nor its MASTER_PORT) outlives the test that made it:
An in-process fit (one device) initialises a gloo process group in the pytest process, and Lightning
puts the port it picked in ``MASTER_PORT``. Left behind, the next test's spawned ranks inherit that
port and cannot bind it (``EADDRINUSE``): the group is destroyed and the variables restored after
every test.

``slow`` (:data:`SLOW`): the longest multi-process variants, each with a shorter twin in the default
run (the 2-process case of a 4-process test, another fault of the same kind). The default run
(``pytest -q``) leaves them out (``addopts`` in ``pyproject.toml``); ``pytest -q -m slow`` runs them,
and CI runs both.
"""

from __future__ import annotations

import os

import pytest

@pytest.fixture
def one_thread():
    """One intra-op thread for the test (``pytestmark = pytest.mark.usefixtures("one_thread")``): the test
    machines' few cores are shared, and oversubscribed OpenMP threads spin (a 0.3 s test took 12 s with two
    threads under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    before = {var: os.environ.get(var) for var in _DIST_VARS}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for var, value in before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


SLOW = {
    "test_any_sp_size.py::test_the_planners_own_sp3_plans_train_exactly_on_three_processes",
    "test_gpu_check.py::test_dry_run_without_cuda_writes_every_section",
    "test_hf.py::test_sp2_sp4_equal_single_process",
    # twin: [2-dcp-dcp-intra-and-bucket] (the same fits' checks on 2 processes: dcp and dcp-intra on qwen2/llama)
    "test_hf.py::test_dcp_trainer_equals_plain_training[4-dcp-and-random]",
    "test_multinode.py::test_slurm_variables_are_detected_and_train_exactly",
    # twin: [dcp] (the whole run.py, one policy's launch of 2 processes; the tables and plots of two policies:
    # test_reports_and_plots)
    "test_benchmarks.py::test_run_two_processes_one_step[dcp,packed]",
    # twin: [caught-all_gather-2] (the same stop of every rank at the step's end, from a fit); the metric's
    # refusal and message on real groups: test_guard_refuses_world_collectives_keeps_the_sp_groups_and_every_rank_...
    "test_collective_guard.py::test_world_collective_in_training_step_stops_every_rank_with_uneven_counts[metric-2]",
    # twin: test_two_optimizers_equal_ddp[none] (the same manual-optimization training under DCPStrategy on 2
    # processes, checked against DDP)
    "test_manual_optimization.py::test_the_docs_example_runs",
    # twin: [caught-all_gather-2] (the same stop of every rank, with the same message, from a 2-process fit); the
    # 3-process runs' idle rank: [all_gather-3], [metric-3], [caught-dist-3] (slow as well)
    "test_collective_guard.py::test_world_collective_in_training_step_stops_every_rank_with_uneven_counts[dist-3]",
    # twin: test_preflight.py's test_train_data_is_checked_against_the_global_batch and test_fit_start_errors_print_once
    # (the same check and message, printed once by rank 0, one line from rank 1), test_faults.py's
    # test_rank_dependent_dataset_stops_every_rank_before_profiling[profiling] (a fit-start stop before profiling)
    "test_preflight.py::test_small_dataset_stops_before_profiling_and_prints_once",
    # twin: [2x1] (two torchrun nodes of one process each: SP-2 groups across the nodes, the same exact check)
    "test_multinode.py::test_two_torchrun_nodes_train_exactly[2x2]",
    "test_hsdp.py::test_hsdp_four_processes_shard_groups_of_two_and_world",
    "test_sharding.py::test_sharded_exact_four_processes_mixed_sp",
    "test_safe_mode.py::test_unchanged_module_trains_exactly_in_safe_mode[encoder-4]",
    "test_profiler.py::test_three_ranks_profile_sp2_on_the_block_that_fits",
    "test_faults.py::test_rank_dependent_dataset_stops_every_rank_before_profiling[cached-profile]",
    # twin: test_rank_dependent_dataset_stops_every_rank_before_profiling[profiling] (the same rank-dependent dataset
    # and the same sample-count agreement error on every rank, at fit start, with profiling on)
    "test_faults.py::test_rank_dependent_dataset_stops_every_rank_at_setup",
    "test_faults.py::test_stuck_collective_ends_the_run_naming_step_item_and_group",
    "test_faults.py::test_world_size_three_trains_exactly_with_sp2_on_the_aligned_block",
    "test_faults.py::test_sigterm_ends_every_process_of_a_run_hung_in_a_collective",
    "test_diffusers.py::test_dcp_strategy_equals_single_process_training[4]",
    "test_diffusers_ltx.py::test_dcp_strategy_equals_single_process_training[4]",
    "test_diffusers_joint.py::test_dcp_strategy_equals_single_process_training[4]",
    "test_lora.py::test_lora_under_dcp_equals_plain_peft_training[2-more]",
    "test_lora.py::test_lora_under_dcp_equals_plain_peft_training[4-all]",
    "test_train_video.py::test_the_quick_start_runs_as_written",
    "test_ring.py::test_ring_at_sp4_on_two_heads_and_ring_four_are_exact",
    "test_ring.py::test_ulysses_and_ring_on_three_processes_are_exact",
    "test_ring.py::test_ulysses_and_ring_on_six_processes_are_exact",
    "test_any_sp_size.py::test_ring_at_sp4_on_a_two_head_model_is_exact[zigzag]",
    "test_any_sp_size.py::test_ring_at_sp4_on_a_two_head_model_is_exact[contiguous]",
    "test_any_sp_size.py::test_hf_twelve_heads_on_three_processes_sp3_and_ring_is_exact",
    "test_any_sp_size.py::test_diffusers_wan_six_heads_on_three_processes_sp3_and_ring_is_exact",
    "test_manual_optimization.py::test_two_optimizers_equal_ddp[zero1]",
    "test_trainer_features.py::test_fit_clip_csv_progress_bar_validate_test_predict[rich]",
    "test_ulysses.py::test_ulysses_matches_single_process_world4",
    "test_faults.py::test_out_of_memory_at_sp2_stops_with_a_checkpoint_that_resumes_exactly",
    "test_any_sp_size.py::test_sp6_on_six_processes_with_ring_past_the_heads_is_exact",
    "test_exactness.py::test_exact_with_prompt_masked_labels[4-sample-False]",
    # twin: [encoder-2] (the same module in safe mode, on 2 processes); one process: test_exactness.py's
    # test_exact_one_process
    "test_safe_mode.py::test_unchanged_module_trains_exactly_in_safe_mode[encoder-1]",
}
"""Test ids (file::name[params]) marked ``slow``."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW:
            item.add_marker(pytest.mark.slow)
