"""How the hf policy renders an observation's chat: its messages, and the tools it may call.

Tools go through the model's own chat template (``apply_chat_template(..., tools=...)``) when the template has a
tool section. Many templates have none and silently drop the ``tools`` argument (SmolLM2's is one), so the renderer
checks once, by rendering a probe tool and looking for its name, and otherwise puts the tool-call parser's
description of the tools (``observation.tool_prompt``) into the system message. A template that rejects the
``tool`` role gets tool results as user messages wrapped in ``<tool_response>`` tags.

It also answers whether the template is *prefix-preserving*: whether the rendering of a conversation extended by an
assistant turn and a tool result starts with the earlier rendering plus that turn's text. Only then can a
multi-turn episode train as one token sequence (:mod:`palestra.engine.trajectory`); some templates re-render earlier
turns (Qwen3 drops past reasoning, for example).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from palestra.types import Observation

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "palestra_probe_tool",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "x"}}},
    },
}
_PROBE_CALL = '<tool_call>\n{"name": "palestra_probe_tool", "arguments": {"x": "1"}}\n</tool_call>'


class ChatRenderer:
    """Renders observations with one tokenizer's chat template (see the module docstring)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    def _render(self, messages: Sequence[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> str:
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        text = self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **kwargs)
        return str(text)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template has a tool section (the probe tool's name shows in its rendering)."""
        try:
            return "palestra_probe_tool" in self._render([{"role": "user", "content": "hi"}], [_PROBE_TOOL])
        except Exception:  # noqa: BLE001 - a template that fails on tools= has no usable tool section
            return False

    @functools.cached_property
    def renders_tool_role(self) -> bool:
        """Whether the template accepts a ``tool`` message (some raise on any role but system, user, assistant)."""
        try:
            self._render(self._probe_conversation())
        except Exception:  # noqa: BLE001 - jinja's TemplateError, or a raise_exception() inside the template
            return False
        return True

    def _probe_conversation(self) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": _PROBE_CALL},
            {"role": "tool", "content": "5"},
        ]

    @functools.cached_property
    def prefix_preserving(self) -> bool:
        """Whether a conversation's rendering extends the rendering of its beginning plus the assistant's text."""
        probe = self._tool_role_fallback(self._probe_conversation())
        try:
            first = self._render(probe[:1])
            full = self._render(probe)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe cannot be relied on either
            return False
        return full.startswith(first + _PROBE_CALL)

    def _tool_role_fallback(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        if self.renders_tool_role:
            return messages
        return [
            {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            if m["role"] == "tool"
            else m
            for m in messages
        ]

    def render(self, observation: Observation) -> str:
        """The templated conversation of ``observation`` (its messages, and its tools), ending with the assistant's
        generation prompt."""
        assert observation.messages, "render() is for observations with messages"
        messages = self._tool_role_fallback([m.as_dict() for m in observation.messages])
        tools = observation.tools or None
        if tools and not self.renders_tools:
            if observation.tool_prompt:
                messages = with_system_text(messages, observation.tool_prompt)
            tools = None
        return self._render(messages, tools)


def with_system_text(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """``messages`` with ``text`` appended to the system message (one is put first when there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
