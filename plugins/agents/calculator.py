"""``calculator_agent``: the word-problem calculator task of docs/tools.md, written as agent code against a plain
``openai`` client (the ``agent:`` section; docs/environments.md).

It sends the task's messages (after its own system prompt) with the calculator's function spec, runs the
``tool_calls`` it gets back with Palestra's ``calculator`` tool (its spec and its function, through the same
:class:`~palestra.tools.runner.ToolRunner` the built-in loop uses, so the model reads the same results and errors),
sends each result back as a ``tool`` message with its ``tool_call_id``, and returns the first reply without calls as
the answer. A reply holding a call the endpoint could not read (broken JSON: the endpoint returns it as content, since
the OpenAI schema has no broken call) is read with the same parser and answered with its ``error: ...`` lines as tool
messages, as the built-in loop answers it. With ``max_turns`` replies and no answer, the episode ends unanswered
(answer ``""``).

Its metadata carries ``tool_calls`` (each call's name, arguments, error, latency and result), so the ``tool_format``
reward scores an agent episode as it scores the built-in loop's.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from palestra import option
from palestra.agents import AgentResult, AgentTask


@dataclass
class CalculatorAgentOptions:
    """Options of ``calculator_agent`` (``agent.options`` in a config)."""

    max_turns: int = option(3, ge=1)  # the model's replies; the last one must answer (max_turns - 1 calls at most)
    system_prompt: str | None = None  # a system message before the task's messages (the tools' description follows)
    max_digits: int = option(30, ge=1, le=4000)  # the calculator's bounds (its tool options)
    max_length: int = option(1000, ge=1, le=100_000)
    max_result_chars: int = option(2000, ge=16)  # a result is cut to this, as tools.max_result_chars does
    tool_parser: str = (
        "hermes"  # the endpoint's (agent.tool_parser): reads a call the endpoint could not turn into tool_calls
    )


class CalculatorAgent:
    """Solves a task with the calculator through an OpenAI-compatible client (see the module docstring)."""

    def __init__(
        self,
        max_turns: int = 3,
        system_prompt: str | None = None,
        max_digits: int = 30,
        max_length: int = 1000,
        max_result_chars: int = 2000,
        tool_parser: str = "hermes",
    ) -> None:
        from palestra.config import build_component
        from palestra.plugins.tools.calculator import calculator
        from palestra.tools.runner import ToolRunner

        self.max_turns, self.system_prompt = max_turns, system_prompt
        self.tool = calculator(max_digits=max_digits, max_length=max_length)
        self.runner = ToolRunner([self.tool], max_result_chars=max_result_chars)
        self.parser = build_component("tool_parser", {"name": tool_parser}, path="agent.options.tool_parser")

    async def rollout(self, client: Any, task: AgentTask) -> AgentResult:
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        messages += [dict(m) for m in task.messages]
        calls: list[dict[str, Any]] = []
        for _ in range(self.max_turns):
            response = await client.chat.completions.create(
                model=task.model, messages=messages, tools=[self.tool.spec()]
            )
            message = response.choices[0].message
            broken = [] if message.tool_calls else self.parser.parse(message.content or "").errors
            if not message.tool_calls and not broken:
                return AgentResult(answer=message.content or "", metadata={"tool_calls": calls})
            messages.append(message.model_dump(exclude_none=True))  # echoed as received: the sequence stays exact
            for error in broken:  # a call the endpoint could not read: the model is told, as the built-in loop does
                calls.append({"name": None, "arguments": None, "error": "malformed", "latency_s": 0.0})
                messages.append({"role": "tool", "content": f"error: {error}"})
            for call in message.tool_calls or []:
                content, record = await asyncio.to_thread(self.call, call.function.name, call.function.arguments)
                calls.append(record)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        return AgentResult(answer="", metadata={"tool_calls": calls, "out_of_turns": True})

    def call(self, name: str, arguments: str) -> tuple[str, dict[str, Any]]:
        """Run one call: the text the model reads, and its record (as the built-in loop writes it)."""
        from palestra.tools import ToolCall

        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = arguments
        result = self.runner.run(ToolCall(name, parsed if isinstance(parsed, dict) else {"": parsed}))
        record = {"name": name, "arguments": parsed, "error": result.error, "latency_s": result.latency_s}
        return result.content, {**record, "content": result.content}
