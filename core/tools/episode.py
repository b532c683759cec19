"""The tool-use loop around a single-turn environment: :class:`ToolUseEnvironment`.

Each turn of the model either calls tools or answers. A turn with calls (or calls the parser could not read) gets
the results back as ``tool`` messages, and the episode goes on; the answer (a turn with no call) ends it, and the
wrapped environment sees it. An episode also ends, unanswered, when a turn would take the episode past
``max_tool_calls`` calls (a call the parser could not read counts: the model spent a turn on it); those calls are
not run. The rollout driver may end it earlier, at its token budget (``tools.max_tokens``).

The wrapped environment is single-turn, so it is stepped once per batch, on the step its last row ends, with each
row's final text (its answer, or its last turn when it ran out of calls). Its info therefore reaches the turn records
of the rows that end on that step; a row that answered earlier has the tool-use info only (rewards read the episode's
metadata, which every row keeps).

Every observation after the first extends the one before: ``prompt`` is the previous prompt, the model's turn
exactly as sampled, then the tool results in plain text (``<tool_response>`` blocks); ``messages`` likewise gains an
``assistant`` message and one ``tool`` message per call. The one-sequence rollout relies on that.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from palestra.errors import ConfigError
from palestra.tools.calls import ToolCallParser
from palestra.tools.runner import ToolResult, ToolRunner
from palestra.types import AgentId, Environment, Message, Observation, StepResult

__all__ = ["ToolUseEnvironment", "render_tool_results"]


def render_tool_results(results: Sequence[ToolResult]) -> str:
    """The tool messages as plain text, appended to the prompt after the model's turn (Hermes' response tags)."""
    return "".join(f"\n<tool_response>\n{r.content}\n</tool_response>" for r in results) + "\n"


@dataclass
class _Row:
    """One episode's progress: its latest observation, calls spent, its final text and whether it answered."""

    obs: Observation
    calls: int = 0
    live: bool = True
    final: str | None = None
    answered: bool = False


class ToolUseEnvironment:
    """``inner`` (a single-turn, single-agent environment) with tools: see the module docstring.

    ``runner`` runs the calls, ``parser`` reads them from the model's text and describes the tools;
    ``system_prompt`` goes before that description in ``Observation.tool_prompt``.
    """

    def __init__(
        self,
        inner: Environment,
        runner: ToolRunner,
        parser: ToolCallParser,
        *,
        max_tool_calls: int,
        system_prompt: str | None = None,
        name: str = "",
    ) -> None:
        label = f"environment {name!r}" if name else f"environment {type(inner).__name__}"
        if getattr(inner, "max_turns", None) != 1:
            raise ConfigError(
                f"tools: the tool loop wraps a single-turn environment; {label} has max_turns="
                f"{getattr(inner, 'max_turns', None)!r} (give the tools to a single-turn environment)"
            )
        if len(tuple(inner.agent_ids)) != 1:
            raise ConfigError(
                f"tools: the tool loop wraps a single-agent environment; {label} has agents {tuple(inner.agent_ids)}"
            )
        self.inner, self.runner, self.parser = inner, runner, parser
        self.agent_ids: tuple[AgentId, ...] = tuple(inner.agent_ids)
        self.max_tool_calls, self.system_prompt = max_tool_calls, system_prompt
        self.max_turns = max_tool_calls + 1
        self.specs = [t.spec() for t in runner.tools.values()]
        described = parser.describe(self.specs)
        self.tool_prompt = f"{system_prompt}\n\n{described}" if system_prompt else described
        self._rows: list[_Row] = []

    # ---- the Environment protocol ------------------------------------------------------------------
    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        first = [self._first(obs) for obs in self.inner.reset(batch_size, seed=seed, group_size=group_size)]
        self._rows = [_Row(obs) for obs in first]
        return list(first)

    def step(self, actions: Sequence[str | None]) -> StepResult:
        if len(actions) != len(self._rows):
            raise ValueError(f"tools: got {len(actions)} actions for a batch of {len(self._rows)} rows")
        n = len(self._rows)
        observations: list[Observation | None] = [None] * n
        info: list[dict[AgentId, dict[str, Any]]] = [{} for _ in range(n)]
        ending: list[int] = []
        live = [i for i, row in enumerate(self._rows) if row.live]
        for i, (record, observations[i]) in zip(live, self._turns(live, actions)):
            info[i] = {self._rows[i].obs.agent_id: record}
            if observations[i] is None:
                ending.append(i)
        if ending and not any(r.live for r in self._rows):
            self._step_inner(info, ending)
        done = [obs is None for obs in observations]
        return StepResult(observations=observations, done=done, info=info)

    # ---- one row's turn --------------------------------------------------------------------------------
    def _first(self, obs: Observation) -> Observation:
        messages = list(obs.messages) if obs.messages else [Message("user", obs.prompt)]
        return replace(obs, messages=messages, tools=self.specs, tool_prompt=self.tool_prompt, turn=0)

    def _turns(
        self, live: Sequence[int], actions: Sequence[str | None]
    ) -> list[tuple[dict[str, Any], Observation | None]]:
        """Every live row's turn. Rows run side by side (each row's calls in order), so a step lasts about as long
        as its slowest row, not the sum of every row's calls: a batch of hanging tools costs one timeout, which
        ``train.data_timeout_s`` must allow (checked when the run is built)."""
        if len(live) <= 1:
            return [self._turn(self._rows[i], actions[i]) for i in live]
        with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="palestra-tool-row") as pool:
            return list(pool.map(lambda i: self._turn(self._rows[i], actions[i]), live))

    def _turn(self, row: _Row, action: str | None) -> tuple[dict[str, Any], Observation | None]:
        """Apply ``action`` to ``row``: its turn's info record, and its next observation (None: the row ended)."""
        if action is None:  # the driver ended the row (its token budget): unanswered
            row.live, row.final = False, ""
            return {"tool_calls": [], "answered": False}, None
        turn = self.parser.parse(action)
        if turn.is_final:
            row.live, row.final, row.answered = False, action, True
            return {"tool_calls": [], "answered": True}, None
        wanted = len(turn.calls) + len(turn.errors)
        if row.calls + wanted > self.max_tool_calls:  # out of calls: none of this turn's runs
            row.live, row.final = False, action
            return {"tool_calls": [], "answered": False, "out_of_calls": True}, None
        row.calls += wanted
        results = [ToolResult(f"error: {e}", "malformed") for e in turn.errors]
        names: list[tuple[str | None, Any]] = [(None, None)] * len(turn.errors)
        for call in turn.calls:
            results.append(self.runner.run(call))
            names.append((call.name, call.arguments))
        calls = [
            {"name": n, "arguments": a, "error": r.error, "latency_s": r.latency_s, "content": r.content}
            for (n, a), r in zip(names, results)
        ]
        row.obs = self._next(row.obs, action, results)
        return {"tool_calls": calls, "answered": False}, row.obs

    def _next(self, obs: Observation, action: str, results: Sequence[ToolResult]) -> Observation:
        messages = [*(obs.messages or []), Message("assistant", action), *(Message("tool", r.content) for r in results)]
        prompt = obs.prompt + action + render_tool_results(results)
        return replace(obs, prompt=prompt, messages=messages, token_ids=None, turn=obs.turn + 1)

    def _step_inner(self, info: list[dict[AgentId, dict[str, Any]]], ending: Sequence[int]) -> None:
        """Step the wrapped environment with every row's final text, and give its info to the rows ending now."""
        result = self.inner.step([row.final or "" for row in self._rows])
        for i in ending:
            for agent, inner_info in result.info[i].items():
                info[i].setdefault(agent, {}).update({k: v for k, v in inner_info.items() if k not in info[i][agent]})

    # ---- optional protocols, forwarded -------------------------------------------------------------------
    # Checkpointable (state_dict/load_state_dict) and HeldOutSplit (held_out) exactly when the wrapped environment
    # is: the trainer tells them apart with isinstance, which looks the methods up through __getattr__.
    def __getattr__(self, name: str) -> Any:
        if name in ("state_dict", "load_state_dict") and hasattr(self.__dict__.get("inner"), name):
            return getattr(self.inner, name)
        if name == "held_out" and hasattr(self.__dict__.get("inner"), "held_out"):
            return self._held_out
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _held_out(self) -> ToolUseEnvironment:
        """The wrapped environment's held-out split, with the same tools."""
        return ToolUseEnvironment(
            self.inner.held_out(),  # type: ignore[attr-defined]
            self.runner,
            self.parser,
            max_tool_calls=self.max_tool_calls,
            system_prompt=self.system_prompt,
        )
