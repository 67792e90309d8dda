"""Prompts for the three task families, rendered for chat or plain-text models.

A user message is built per task (code, math, multiple choice); `render` wraps it in the
tokenizer's chat template when it has one (user turn + generation prompt), and otherwise
appends a plain-text cue that starts the answer ("```python", "Answer:"). The same
message text is what a retained set stores as its `prompt`, so generation and retained-KL
contexts see identical prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CSQA_LABELS = ("A", "B", "C", "D", "E")


def code_message(text: str, first_test: str) -> str:
    """An MBPP problem: statement plus its first test, asking for a Python function."""
    return (
        f"{text.strip()}\n"
        f"Your code should pass this test:\n\n{first_test.strip()}\n\n"
        "Write the Python function in a single ```python code block."
    )


def code_pair(text: str, first_test: str, code: str, pair_id: str) -> dict:
    """A code training pair: the generation prompt's user message -> the code in one fenced block
    (what the model is asked to write, so training and generation see the same message)."""
    return {"prompt": code_message(text, first_test), "response": f"```python\n{code.strip()}\n```", "id": pair_id}


def math_message(question: str) -> str:
    """A GSM8K question; the answer format is what `answers.extract_gsm8k_answer` reads first."""
    return (
        "Solve the following math problem step by step. End your response with "
        '"The answer is N", where N is the final number.\n\n'
        f"Question: {question.strip()}"
    )


def math_pair(question: str, solution: str, final: str, pair_id: str) -> dict:
    """A math training pair: the math prompt -> the reference solution with its closing "#### N"
    line rewritten as "The answer is N." (the ending `math_message` asks for, which
    `answers.extract_gsm8k_answer` reads when no "####" is left)."""
    cut = solution.rfind("####")
    body = (solution[:cut] if cut >= 0 else solution).rstrip()
    return {"prompt": math_message(question), "response": f"{body}\nThe answer is {final}.", "id": pair_id}


def choice_message(stem: str, texts: Sequence[str], labels: Sequence[str] = CSQA_LABELS) -> str:
    """A multiple-choice question with labelled options; the reply should be one label."""
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} option texts for {len(labels)} labels")
    options = "\n".join(f"{label}. {text}" for label, text in zip(labels, texts))
    return f"Question: {stem.strip()}\n{options}\nReply with the letter of the correct option ({', '.join(labels)})."


# What a plain-text (no chat template) model sees after the message: a cue that starts the answer.
PLAIN_CUES = {"code": "```python\n", "math": "Answer:", "choice": "Answer:"}


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer: Any, message: str, task: str, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The full prompt string for one user message.

    `task` ("code", "math", "choice") picks the plain-text cue; `chat_template_kwargs` go to
    `apply_chat_template` (e.g. {"enable_thinking": False} for Qwen3)."""
    if task not in PLAIN_CUES:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(PLAIN_CUES)}")
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}],
            tokenize=False,
            add_generation_prompt=True,
            **(chat_template_kwargs or {}),
        )
    return f"{message}\n\n{PLAIN_CUES[task]}"


def label_continuations(tokenizer: Any, labels: Sequence[str] = CSQA_LABELS) -> list[str]:
    """How each label is written as the first thing after a rendered choice prompt.

    Chat prompts end at the start of the assistant turn, so the label comes bare ("A");
    plain prompts end with "Answer:", so it comes after a space (" A")."""
    return list(labels) if has_chat_template(tokenizer) else [f" {label}" for label in labels]


def add_special_tokens_for(tokenizer: Any) -> bool:
    """Chat templates already write BOS and the like; plain prompts need the tokenizer's own."""
    return not has_chat_template(tokenizer)
