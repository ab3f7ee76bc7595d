"""Prompt rendering: a problem + an instruction -> the text the policy is prompted with.

A thin layer over a tokenizer's chat template. ``tokenizer_or_chat_fn`` may be anything with an
HF-style ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` method
(a ``transformers`` tokenizer, the project's own tokenizer wrapper, a test fake) or a plain
callable ``messages -> str``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from das_jax.data.problems import Problem

__all__ = [
    "MATH_INSTRUCTION",
    "MATH_BOXED_INSTRUCTION",
    "CODE_INSTRUCTION",
    "default_instruction",
    "build_messages",
    "render_prompt",
    "render_prompts",
]

MATH_INSTRUCTION = "Solve the problem step by step. Put the final answer after ####."
MATH_BOXED_INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."
CODE_INSTRUCTION = (
    "Complete the following Python function. Return the complete function in a single "
    "```python code block."
)

Message = dict[str, str]


def _is_code(problem: Problem) -> bool:
    return "entry_point" in problem.metadata


def default_instruction(problem: Problem, style: str = "hash") -> str:
    """The default instruction for a problem: :data:`CODE_INSTRUCTION` for code problems
    (metadata has ``entry_point``), else :data:`MATH_INSTRUCTION` (``style="hash"``) or
    :data:`MATH_BOXED_INSTRUCTION` (``style="boxed"``).

    Raises:
        ValueError: unknown ``style``.
    """
    if style not in ("hash", "boxed"):
        raise ValueError(f"style must be 'hash' or 'boxed', got {style!r}")
    if _is_code(problem):
        return CODE_INSTRUCTION
    return MATH_INSTRUCTION if style == "hash" else MATH_BOXED_INSTRUCTION


def build_messages(problem: Problem, instruction: str | None = None, system: str | None = None) -> list[Message]:
    """Chat messages for a problem: optional system message, then one user message holding the
    instruction and the problem text (code prompts are wrapped in a ```python block)."""
    instr = default_instruction(problem) if instruction is None else instruction
    body = f"```python\n{problem.prompt.rstrip()}\n```" if _is_code(problem) else problem.prompt
    user = f"{instr}\n\n{body}" if instr else body
    msgs: list[Message] = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": user})
    return msgs


def render_prompt(
    problem: Problem,
    tokenizer_or_chat_fn: Any = None,
    instruction: str | None = None,
    chat: bool = True,
    *,
    system: str | None = None,
) -> str:
    """Render the prompt text for ``problem``.

    Args:
        problem: the problem.
        tokenizer_or_chat_fn: an object with ``apply_chat_template(messages, tokenize=False,
            add_generation_prompt=True)``, or a callable ``list[dict] -> str``. Ignored (may be
            None) when ``chat`` is False.
        instruction: instruction text; None -> :func:`default_instruction`; "" -> none.
        chat: True: apply the chat template (with the generation prompt). False: plain text
            ``"<instruction>\\n\\n<problem>\\n"`` (completion-style models).
        system: optional system message (chat mode only).

    Returns:
        The prompt string (not tokenized).

    Raises:
        TypeError: ``chat`` is True and ``tokenizer_or_chat_fn`` has no ``apply_chat_template``
            and is not callable, or the template does not return a string.
    """
    msgs = build_messages(problem, instruction, system)
    if not chat:
        return msgs[-1]["content"] + "\n"
    apply = getattr(tokenizer_or_chat_fn, "apply_chat_template", None)
    if apply is not None:
        out = apply(msgs, tokenize=False, add_generation_prompt=True)
    elif callable(tokenizer_or_chat_fn):
        out = tokenizer_or_chat_fn(msgs)
    else:
        raise TypeError(
            "render_prompt(chat=True) needs a tokenizer with apply_chat_template(messages, "
            "tokenize=False, add_generation_prompt=True) or a callable messages -> str; got "
            f"{type(tokenizer_or_chat_fn).__name__}. Pass chat=False for plain-text prompts."
        )
    if not isinstance(out, str):
        raise TypeError(f"chat template returned {type(out).__name__}, expected str (tokenize=False)")
    return out


def render_prompts(
    problems: Sequence[Problem],
    tokenizer_or_chat_fn: Any = None,
    instruction: str | None = None,
    chat: bool = True,
    *,
    system: str | None = None,
) -> list[str]:
    """:func:`render_prompt` over a sequence of problems."""
    return [render_prompt(p, tokenizer_or_chat_fn, instruction, chat, system=system) for p in problems]


ChatFn = Callable[[list[Message]], str]
