"""Shared fixtures.

SmolLM2-135M-Instruct (session scope; tests using them should be marked `slow`):
  smollm2_gguf_path         local path of the named source's GGUF (fetched once into the cache)
  smollm2_das               das-jax `load("smollm2-135m-instruct")` -> (config, params, Tokenizer)
  smollm2_hf                transformers (tokenizer, model) loaded from the same GGUF, float32
  smollm2_greedy_reference  [(prompt_ids, continuation_ids)] for SMOLLM2_PROMPTS: transformers'
                            greedy continuation (max 64 new tokens, stops at eos)
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

# XLA's CPU backend at optimization level 0 (LLVM's passes off) for the whole run, this process
# and the subprocesses tests start: the suite's wall time is mostly compiling tiny programs that
# then run for microseconds, and level 0 compiles them in ~60% of the CPU time. The HLO (fusion,
# layout, what is computed in which order) is the same at every level; only LLVM's optimization
# of the code emitted for it differs, and every comparison a test makes runs both sides under
# the same flags. An XLA_FLAGS that names an optimization level is left as it is.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

# One persistent JAX compilation cache for the whole run, shared by this process and every
# subprocess a test starts (they inherit the environment): the suite compiles the same tiny
# programs many times over (a fresh jit per Engine / trainer / CLI process), and XLA compiles are
# most of its wall time on CPU. A hit loads the same executable a compile would produce; tracing
# and lowering still run (and still count in `jax.monitoring`). A new, empty directory per run,
# removed at its end, unless JAX_COMPILATION_CACHE_DIR is set already (then that one is used).
_JIT_CACHE_DIR = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _JIT_CACHE_DIR = tempfile.mkdtemp(prefix="das-jax-tests-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JIT_CACHE_DIR
_JIT_CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # tiny programs compile in < 1 s
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}
if importlib.util.find_spec("filelock") is not None:
    # A size limit turns on jax's file lock (it needs `filelock`): concurrent processes never
    # read a half-written entry.
    _JIT_CACHE_ENV["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
for _k, _v in _JIT_CACHE_ENV.items():
    os.environ.setdefault(_k, _v)
if "jax" in sys.modules:  # already imported (by a plugin): its config has read the environment
    _jax = sys.modules["jax"]
    _jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    _jax.config.update("jax_persistent_cache_min_compile_time_secs",
                       float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    _jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                       int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
    if "JAX_COMPILATION_CACHE_MAX_SIZE" in os.environ:
        _jax.config.update("jax_compilation_cache_max_size",
                           int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))


def pytest_unconfigure(config):
    if _JIT_CACHE_DIR is not None:
        shutil.rmtree(_JIT_CACHE_DIR, ignore_errors=True)


# The files that load the real SmolLM2 model (session fixtures below): one scope, so one worker
# loads it (and computes transformers' greedy reference) once.
_REAL_MODEL_FILES = ("test_exact_mode.py", "test_engine_smollm2.py", "test_models_smollm2.py")


# The files that take longest, first (ranked by their fast tests' time in a `--durations` run):
# under `-n 2 --dist loadfile` (pyproject's addopts) each worker takes whole files in collection
# order, so a long file left for the end would run alone on one worker while the other idles.
# The rest keep pytest's order. (A file missing here only costs balance, never a test.)
_LONG_FILES_FIRST = (
    "test_exact_mode.py", "test_paged_kv_cache.py", "test_engine.py",
    "test_cross_platform_export.py", "test_bench_replay.py", "test_decode_attention.py",
    "test_rewards_sandbox.py", "test_grpo_train_step.py", "test_engine_settings.py",
    "test_packed_prefill.py", "test_advantages_equal_groups.py", "test_memory.py",
    "test_packed_verify.py", "test_grpo_losses.py", "test_das_policy.py",
    "test_paged_attention.py", "test_run_log.py", "test_head_logprobs.py", "test_export.py",
    "test_train_window.py", "test_engine_smollm2.py", "test_models_smollm2.py",
    "test_models_hf.py", "test_trainer_run_dir.py", "test_fused_update.py",
    "test_multihost_train.py", "test_old_logprobs.py", "test_evaluate.py",
    "test_sampling_numerics.py", "test_trainer.py", "test_async_grpo.py",
    "test_precompile_share.py", "test_sharding_cli.py", "test_bench_rollout.py",
    "test_sharding_train.py", "test_multi_device.py",
)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that the real-model files go to one worker together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "real-model files" if os.path.basename(path) in _REAL_MODEL_FILES else path

    return _Scheduling(config, log)


# The heaviest tests that do not load the real model, marked `slow` here (each took >= ~20 s of
# one worker's time in a `--durations=0` run on the 2-core machine): several processes or 4-8
# forced devices, eager twins of jitted tests, and a second temperature, loss or variant of a
# test whose other variants stay in the fast suite. `python -m pytest -q` deselects every `slow`
# test (`addopts` in pyproject.toml) so that it stays under 15 minutes there; `.ci/run` runs them
# after it (`python -m pytest -q -m slow`). Entries are node ids (a name without a parameter id
# covers all its parameters); one that matches no collected test of its file is an error.
_SLOW_TESTS = (
    "tests/test_async_train_bench.py::test_end_to_end_on_a_tiny_model",
    "tests/test_async_grpo.py::test_kill_9_and_resume_loses_and_repeats_no_step[update]",
    "tests/test_async_grpo.py::test_kill_9_and_resume_loses_and_repeats_no_step[logged]",
    "tests/test_async_grpo.py::test_kill_9_and_resume_loses_and_repeats_no_step[checkpoint]",
    "tests/test_async_grpo.py::test_kill_9_and_resume_loses_and_repeats_no_step[after-checkpoint]",
    "tests/test_async_grpo.py::test_a_stale_batch_is_dropped_and_generated_again",
    "tests/test_async_grpo.py::test_disaggregated_rollout_device_gives_the_colocated_run",
    "tests/test_engine_settings.py::test_chunked_prefill_changes_no_bit[paged]",
    "tests/test_cross_platform_export.py::test_engine_program_exports[VerifySpec3-fast-bfloat16-cuda]",
    "tests/test_cross_platform_export.py::test_engine_program_exports[VerifySpec3-fast-bfloat16-tpu]",
    "tests/test_cross_platform_export.py::test_engine_program_exports[VerifySpec3-exact-float32-cuda]",
    "tests/test_cross_platform_export.py::test_engine_program_exports[VerifySpec3-exact-float32-tpu]",
    "tests/test_paged_kv_cache.py::test_paged_operations_equal_the_dense_ones[eager]",
    "tests/test_paged_kv_cache.py::test_preempted_rows_resume_with_the_same_tokens[fast-drafts]",
    "tests/test_paged_kv_cache.py::test_odd_pages_without_sharing_under_a_tight_budget",
    "tests/test_sharding_train.py::test_sharded_train_step_equals_one_device",
    "tests/test_sharding_train.py::test_per_device_train_state_is_an_eighth",
    "tests/test_sharding_cli.py::test_four_devices_with_a_mesh_log_the_same_metrics",
    "tests/test_evaluate.py::test_trainer_evaluates_at_start_every_and_end",
    "tests/test_gpu_lease_check.py::test_smoke_runs_every_part",
    "tests/test_gpu_lease_check.py::test_smoke_counts_give_a_full_run_within_the_budget",
    "tests/test_packed_prefill.py::test_packed_prefill_without_jit_matches_jit",
    "tests/test_advantages_equal_groups.py::test_equal_groups_zero_others_match_reference",
    "tests/test_bench_rollout.py::test_bench_rollout_core",
    "tests/test_trainer.py::test_training_is_lossless_with_das",
    "tests/test_multi_device.py::test_two_replicas_on_one_device_in_threads_are_token_identical",
    "tests/test_bench_replay.py::test_replay_of_a_paged_pool_matches_the_engine[suffix]",
    "tests/test_sampling_numerics.py::test_tiny_temperature_equals_greedy[1e-10]",
    "tests/test_exact_mode.py::"
    "test_generate_exact_tokens_and_logprobs_identical_with_speculation[0.6]",
    "tests/test_memory.py::test_mixed_precision_master_weights",
    "tests/test_memory.py::test_kv_cache_layout_ops",
    "tests/test_fused_update.py::test_fused_update_mixed_precision_tracks_unfused",
    "tests/test_fused_update.py::test_fused_update_equals_unfused[dapo_clipped]",
    "tests/test_engine.py::test_speculation_never_changes_tokens[t0.6]",
    "tests/test_grpo_train_step.py::test_skip_zero_advantage_rows_same_loss_and_gradient[dr_grpo]",
    "tests/test_decode_steps.py::test_multi_step_decode_equals_single_steps[t1]",
    "tests/test_rewards_sandbox.py::test_trainer_reports_reward_timeouts",
    "tests/test_paged_attention.py::test_kernels_equal_the_reference[2-2-1-1-8-16-5-pallas_gpu]",
    "tests/test_paged_attention.py::test_kernels_equal_the_reference[4-2-2-1-8-4-13-pallas_gpu]",
    "tests/test_paged_attention.py::test_kernels_equal_the_reference[3-2-2-3-16-8-16-pallas_gpu]",
    "tests/test_paged_attention.py::test_kernels_in_bfloat16[pallas_gpu]",
    "tests/test_paged_attention.py::test_cached_forward_on_pages_equals_the_dense_cache[pallas_tpu]",
    "tests/test_paged_kv_cache.py::test_a_resumed_request_and_its_fresh_sibling_are_admitted_by_"
    "their_real_pages[1-64]",
    "tests/test_paged_kv_cache.py::test_paged_rollouts_equal_dense_plain_decoding[1]",
    "tests/test_grpo_train_step.py::test_train_step_jit_and_eager_decrease_loss_and_move_params",
    "tests/test_fused_update.py::test_fused_update_of_a_step_with_nothing_to_train_on",
    "tests/test_precompile_share.py::test_precompile_covers_generate[True]",
    "tests/test_precompile_share.py::test_share_prompts_same_rollouts[True]",
    "tests/test_models_hf.py::test_kv_cache_chunks_equal_one_shot[llama]",
    "tests/test_models_hf.py::test_logits_match_transformers_with_padding[llama]",
    "tests/test_head_logprobs.py::test_values_and_gradients_equal_full_logits[False-96-32]",
    "tests/test_head_logprobs.py::test_grad_stats_reduce_the_gradient_it_never_builds[96-32]",
    "tests/test_multi_device.py::test_data_parallel_replicas_match_one_device",
    "tests/test_packed_verify.py::test_generate_packed_equals_padded_and_plain",
    "tests/test_engine.py::test_batch_invariance[t0.6]",
    "tests/test_trainer_run_dir.py::test_save_every_zero_disables_saving",
    "tests/test_leafwise_update.py::test_leafwise_apply_matches_optax[1.0]",
    "tests/test_old_logprobs.py::test_on_policy_step_top_p_no_clipping_and_gap_reported[rollout]",
    "tests/test_trainer.py::test_resume_equals_uninterrupted",
    "tests/test_multi_device.py::test_tensor_parallel_replicas_match_one_device",
    "tests/test_bench_rollout.py::test_bench_rollout_report_with_reference_and_paper_replay",
    "tests/test_paged_kv_cache.py::test_preempted_rows_resume_with_the_same_tokens[exact-decode8]",
    "tests/test_models_hf.py::test_kv_cache_chunks_equal_one_shot[qwen2]",
    "tests/test_paged_attention.py::test_kernels_equal_the_reference[4-2-2-1-8-4-13-pallas_tpu]",
    "tests/test_paged_attention.py::test_kernels_equal_the_reference[2-2-1-1-8-16-5-pallas_tpu]",
    "tests/test_head_logprobs.py::test_values_and_gradients_equal_full_logits[False-100-32]",
    "tests/test_head_logprobs.py::test_grad_stats_reduce_the_gradient_it_never_builds[100-32]",
    "tests/test_engine.py::test_speculation_never_changes_tokens[greedy]",
    "tests/test_fused_update.py::test_fused_update_equals_unfused[grpo_kl_unclipped]",
    "tests/test_train_window.py::test_windowed_head_matches_full_reference[dr_grpo-0.04-2]",
    "tests/test_train_window.py::test_shared_prompt_packing_matches_full_reference[grpo-0.04-3]",
    "tests/test_bench_replay.py::test_replay_matches_engine_suffix[greedy]",
    "tests/test_engine.py::test_logprobs_match_teacher_forced_forward",
    "tests/test_async_grpo.py::test_async_resume_equals_uninterrupted",
    "tests/test_async_grpo.py::test_kill_9_and_resume_loses_and_repeats_no_step[rollout-ahead]",
    "tests/test_async_grpo.py::"
    "test_the_drafter_history_is_tagged_with_the_sampling_policy_version[0]",
    "tests/test_async_grpo.py::test_memory_plan_of_a_colocated_async_run_counts_both_sides",
    "tests/test_evaluate.py::test_eval_disabled_writes_no_eval_record",
    "tests/test_trainer.py::test_a_raising_reward_scores_zero_and_the_run_continues",
    "tests/test_packed_prefill.py::test_generate_packed_prefill_equals_padded_prefill[packed]",
    "tests/test_bench_replay.py::test_replay_of_a_paged_pool_matches_the_engine[none]",
    "tests/test_fused_update.py::test_fused_update_equals_unfused[no_clip_untied]",
    "tests/test_sampling_numerics.py::test_tiny_temperature_equals_greedy[1e-30]",
    "tests/test_grpo_train_step.py::test_skip_zero_advantage_rows_same_loss_and_gradient[dapo]",
    "tests/test_layer_loop.py::test_forward_unrolled_and_unstacked_equal_scan[eager]",
    "tests/test_sharding_cli.py::test_a_mesh_that_does_not_fit_is_a_one_line_error",
    "tests/test_das_policy.py::test_full_speculation_stack_is_lossless_over_epochs[das-unlimited]",
    # tests on a module fixture that trains a run (the fixture runs only where one is selected)
    "tests/test_run_log.py::test_plain_step_lines_and_phases_without_a_terminal",
    "tests/test_run_log.py::test_samples_file_and_the_samples_command",
    "tests/test_run_log.py::test_metrics_carry_the_rollout_time_split_and_plots_are_written",
    "tests/test_run_log.py::test_compare_prints_a_table_and_writes_one_png",
    "tests/test_run_log.py::"
    "test_bench_main_job_compares_the_runs_drafter_with_none_from_its_checkpoint",
    "tests/test_run_log.py::test_a_pickle_in_a_run_dir_is_never_executed",
    "tests/test_run_log.py::test_samples_and_compare_report_torn_lines_and_bad_utf8",
    "tests/test_run_log.py::test_train_errors_found_with_the_model_are_one_line_naming_the_key",
    "tests/test_export.py::test_export_of_a_run_loads_in_transformers_with_das_jax_greedy_tokens",
    "tests/test_export.py::test_export_step_and_dtype",
    "tests/test_export.py::test_one_line_errors",
    "tests/test_export.py::test_corrupt_checkpoint_is_one_line",
    "tests/test_trainer_run_dir.py::test_resume_of_a_finished_run_and_its_extension",
    "tests/test_trainer_run_dir.py::"
    "test_corrupt_latest_checkpoint_falls_back_to_the_newest_readable",
    "tests/test_trainer_run_dir.py::test_no_readable_checkpoint_is_one_clear_error",
    # several processes
    "tests/test_multihost_train.py::test_a_dead_peer_stops_the_other_process",
    "tests/test_multihost_train.py::test_processes_with_different_configs_refuse_to_start",
    "tests/test_async_grpo.py::test_async_steps_zero_is_the_synchronous_loop",
    "tests/test_train_window.py::test_windowed_head_matches_full_reference[dapo-0.0-6]",
    "tests/test_trainer.py::test_checkpoint_of_another_model_is_rejected",
    "tests/test_exact_mode.py::test_row_logits_bitwise_equal_at_every_shape_in_exact_mode",
    "tests/test_exact_mode.py::test_property_einsum_row_invariant",
    "tests/test_bench_replay.py::"
    "test_das_budget_beats_unlimited_drafts_at_paper_scale_on_a_gpu_model",
    "tests/test_grpo_train_step.py::test_optimizer_warmup_and_clipping",
    "tests/test_memory.py::test_chunked_remat_path_matches_reference[grpo]",
    "tests/test_paged_kv_cache.py::test_plan_reports_the_paged_pool",
    "tests/test_leafwise_update.py::test_leafwise_apply_matches_optax[0.0]",
    "tests/test_old_logprobs.py::test_on_policy_step_top_p_no_clipping_and_gap_reported[recompute]",
    "tests/test_kernel_warmup.py::test_a_rollout_after_the_warm_up_compiles_no_kernel[das]",
    "tests/test_gpu_check.py::test_gpu_check_smoke",
)


def _mark_slow_tests(config, items) -> None:
    """Adds the `slow` mark to the tests named in `_SLOW_TESTS`.

    Raises:
      pytest.UsageError: an entry matches no collected test although its whole file was
        collected (a test renamed or removed: update the list).
    """
    matched, files = set(), set()
    for item in items:
        files.add(item.nodeid.split("::", 1)[0])
        for entry in (item.nodeid, item.nodeid.split("[", 1)[0]):
            if entry in _SLOW_TESTS:
                item.add_marker(pytest.mark.slow)
                matched.add(entry)
    stale = [e for e in _SLOW_TESTS if e not in matched and e.split("::", 1)[0] in files]
    if stale and not any("::" in str(a) for a in config.args):   # whole files collected
        raise pytest.UsageError(f"conftest._SLOW_TESTS names no collected test: {stale}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    _mark_slow_tests(config, items)
    rank = {name: i for i, name in enumerate(_LONG_FILES_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[id(item)]))


SMOLLM2_PROMPTS = (
    "Explain why the sky is blue in a few sentences.",
    "Write a short story about a robot who learns to paint.",
    "List five tips for staying productive when working from home.",
)
SMOLLM2_MAX_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from das_jax.models import sources
    return sources.fetch("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_das(smollm2_gguf_path):
    from das_jax.models import load
    return load("smollm2-135m-instruct")


def _hf_model_from_gguf(directory: str, filename: str):
    """transformers' own GGUF loading (needs `accelerate` in transformers 5); without accelerate,
    the same dequantization through transformers' legacy GGUF checkpoint reader."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        import accelerate  # noqa: F401
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        config = AutoConfig.from_pretrained(directory, gguf_file=filename)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(os.path.join(directory, filename), return_tensors=True,
                                       model_to_load=model)["tensors"]
        model.load_state_dict(tensors, strict=False)
        model.tie_weights()
        return model


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf_path):
    import torch
    from transformers import AutoTokenizer
    torch.set_num_threads(2)
    directory, filename = os.path.split(smollm2_gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = _hf_model_from_gguf(directory, filename).eval()
    return tokenizer, model


@pytest.fixture(scope="session")
def smollm2_greedy_reference(smollm2_hf):
    import torch
    tokenizer, model = smollm2_hf
    out = []
    for prompt in SMOLLM2_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=SMOLLM2_MAX_NEW_TOKENS, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        out.append((list(ids), gen[0, len(ids):].tolist()))
    return out


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module, drop the engine's shared executables and jax's caches: the whole
    suite runs in one process, and thousands of compiled CPU programs kept alive to its end cost
    gigabytes (no test relies on an executable compiled by another module)."""
    yield
    import gc
    import sys
    programs = sys.modules.get("das_jax.engine.programs")
    if programs is not None:
        programs.COMPILED.clear()
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
    gc.collect()
