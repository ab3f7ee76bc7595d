"""das_jax.data: RL problem sets and prompt rendering.

Public surface:
    Problem(problem_id: str, prompt: str, answer: str, metadata: dict = {})   frozen dataclass
    synthetic_arithmetic(num_problems, seed=0, *, min_steps=1, max_steps=5, templates=None,
                         id_prefix="arith") -> list[Problem]       built-in, seeded, offline
    load_gsm8k(path, split=None, limit=None) -> list[Problem]      answer = number after ####
    load_math(path, limit=None) -> list[Problem]                   answer = last \\boxed{...}
    load_humaneval(path, limit=None) -> list[Problem]              jsonl or jsonl.gz
    load_hf_dataset(name, *, kind="gsm8k", config=None, split="train", limit=None,
                    cache_dir=None) -> list[Problem]               needs the optional `datasets`
    load_dataset_from_config(kind, path=None, **kw) -> list[Problem]
        kinds: arithmetic | gsm8k | math | humaneval | hf
    problems_from_config(config.data) -> list[Problem]          the training set of a config
    reward_kwargs(problems) -> dict[str, list]                     TRL-style reward columns
    render_prompt(problem, tokenizer_or_chat_fn=None, instruction=None, chat=True, *,
                  system=None) -> str
    render_prompts(problems, ...) -> list[str]
    MATH_INSTRUCTION, MATH_BOXED_INSTRUCTION, CODE_INSTRUCTION, default_instruction(problem, style)
    DatasetError (ValueError): missing files, bad records, unknown kinds, `datasets` unavailable.

Data files are read from the paths given; nothing is copied.
"""

from das_jax.data.problems import (
    DatasetError,
    Problem,
    extract_gsm8k_answer,
    extract_last_boxed,
    humaneval_harness,
    load_gsm8k,
    load_hf_dataset,
    load_humaneval,
    load_math,
    normalize_number,
    read_jsonl,
    reward_kwargs,
)
from das_jax.data.registry import DATASET_KINDS, load_dataset_from_config, problems_from_config
from das_jax.data.synthetic import ARITHMETIC_TEMPLATES, synthetic_arithmetic
from das_jax.data.templates import (
    CODE_INSTRUCTION,
    MATH_BOXED_INSTRUCTION,
    MATH_INSTRUCTION,
    build_messages,
    default_instruction,
    render_prompt,
    render_prompts,
)

__all__ = [
    "Problem",
    "DatasetError",
    "synthetic_arithmetic",
    "ARITHMETIC_TEMPLATES",
    "load_gsm8k",
    "load_math",
    "load_humaneval",
    "load_hf_dataset",
    "load_dataset_from_config",
    "problems_from_config",
    "DATASET_KINDS",
    "read_jsonl",
    "reward_kwargs",
    "extract_gsm8k_answer",
    "extract_last_boxed",
    "normalize_number",
    "humaneval_harness",
    "render_prompt",
    "render_prompts",
    "build_messages",
    "default_instruction",
    "MATH_INSTRUCTION",
    "MATH_BOXED_INSTRUCTION",
    "CODE_INSTRUCTION",
]
