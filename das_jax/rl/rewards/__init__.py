"""das_jax.rl.rewards: reward functions with TRL's signature.

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

``columns`` are dataset columns, one value per completion (``answer``, ``problem_id``; for code
``test``, ``entry_point``, ``code_prompt``); ``das_jax.data.reward_kwargs(problems)`` builds them.

Public surface:
    math_accuracy_reward(prompts, completions, *, answer, **kw) -> list[float]   1.0 / 0.0
        graded on the last final answer (#### line or \\boxed{}, whichever comes later):
        exact numeric match only when that whole region is one number, normalised string
        match, then math-verify (main thread, bounded by signal timeouts); each sample alone.
    format_reward(prompts, completions, **kw) -> list[float]     1.0 if "#### <number>" or \\boxed{}
    code_reward(prompts, completions, *, test, entry_point | answer, code_prompt=None, **kw)
        -> list[float]                   1.0 if the tests pass; judged outside the solution's sandbox
    make_code_reward(*, timeout_s=5.0, memory_mb=1024, num_workers=None, max_procs=1,
                     sandbox="isolated", max_message_mb=64, wall_timeout_s=None)
        -> fn with fn.events (RewardEvents: timeouts etc.) and fn.self_test()
    check_solution(solution, tests, *, prompt=None, functions=None, limits=None,
                   sandbox="isolated", max_message_mb=64) -> CheckResult
    run_in_sandbox(program, *, timeout_s=5.0, memory_mb=1024, max_procs=1, max_file_mb=16,
                   guard=True, sandbox="isolated", wall_timeout_s=None) -> SandboxResult
                                            (``passed`` is not a verdict on hostile code)
    sandbox_capabilities(refresh=False) -> SandboxCapabilities
    require_sandbox(mode="isolated") -> SandboxCapabilities   or SandboxUnavailableError
    safe_reward(fn, name=None) -> fn        an exception -> each sample rescored alone, only the
                                            failing ones 0.0 (logged); wrong length -> zeros +
                                            logged error; None / NaN per sample -> 0.0
    combine_rewards(fns, weights=None, *, names=None) -> fn   weighted sum of safe rewards;
                                            fn.breakdown(...) -> (total, {name: values})
    get_reward_fn(name) -> fn               names: math_accuracy, format, code (KeyError otherwise)
    register_reward_fn(name, fn, *, overwrite=False)
    reward_fns_from_config(names, rewards_section) -> [fn]   ``code`` built from ``rewards:``
    self_test_rewards(fns)   the start-up self-test of those that have one (the code sandbox)
    math_answer_correct(completion, answer, *, use_math_verify=True, timeout_s=3) -> bool
    extract_final_number(completion) -> str | None   the final answer if it is one number
    parse_number(text) -> Fraction | None   exact value when the whole text is one number
"""

from das_jax.rl.rewards.code_check import CheckResult, check_solution
from das_jax.rl.rewards.code_reward import (
    RewardEvents,
    build_program,
    code_reward,
    default_workers,
    extract_code,
    make_code_reward,
)
from das_jax.rl.rewards.math_reward import (
    extract_final_number,
    format_reward,
    math_accuracy_reward,
    math_answer_correct,
    parse_number,
)
from das_jax.rl.rewards.registry import (REWARD_FUNCTIONS, get_reward_fn, register_reward_fn,
                                         reward_fns_from_config, self_test_rewards)
from das_jax.rl.rewards.safety import RewardFn, combine_rewards, reward_name, safe_reward
from das_jax.rl.rewards.sandbox import (
    SandboxCapabilities,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    require_sandbox,
    run_in_sandbox,
    sandbox_capabilities,
)

__all__ = [
    "RewardFn",
    "math_accuracy_reward",
    "format_reward",
    "code_reward",
    "make_code_reward",
    "build_program",
    "extract_code",
    "run_in_sandbox",
    "check_solution",
    "CheckResult",
    "SandboxLimits",
    "sandbox_capabilities",
    "SandboxResult",
    "SandboxCapabilities",
    "SandboxUnavailableError",
    "require_sandbox",
    "RewardEvents",
    "default_workers",
    "safe_reward",
    "combine_rewards",
    "reward_name",
    "get_reward_fn",
    "register_reward_fn",
    "reward_fns_from_config",
    "self_test_rewards",
    "REWARD_FUNCTIONS",
    "math_answer_correct",
    "extract_final_number",
    "parse_number",
]
