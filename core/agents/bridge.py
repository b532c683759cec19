"""The environment whose rows are agent episodes: :class:`AgentEnvironment`.

It wraps a single-turn environment, which supplies the tasks. ``reset`` resets it, starts one agent coroutine per
row on the endpoint's loop, and waits until every row has sent its first request (or finished); the requests are
the first observations. ``step`` answers each row's request with the text the policy sampled and waits until every
live row has sent its next request or finished. So the rollout (its batched sampling, behaviour log-probs, one token
sequence per episode, budgets, resume) is the trainer's own; nothing samples outside it.

An episode ends when its agent returns (its answer is the episode's completion for the wrapped environment and the
rewards), raises (answer ``""``, one warning), sends nothing for ``request_timeout_s`` (answer ``""``), or asks past
``max_turns`` requests (the request is refused; the agent's answer then ends it, marked truncated). The wrapped
environment is stepped once, with every row's answer, on the step its batch's last episode ends.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from palestra.agents.api import AgentTask, as_result
from palestra.agents.records import RequestError, answer, plain_text, to_messages
from palestra.agents.server import EPISODE_HEADER, AgentServer, Row
from palestra.errors import ConfigError
from palestra.types import AgentId, Environment, Message, Observation, StepResult

__all__ = ["AgentEnvironment"]

CLIENT_TIMEOUT_S = 3600.0  # a response waits for the batch's sampling; the trainer's own timeouts bound that


class AgentEnvironment:
    """``inner`` (single-turn, single-agent) played by ``agent`` through ``server``: see the module docstring."""

    def __init__(
        self,
        inner: Environment,
        agent: Any,
        server: AgentServer,
        parser: Any,
        *,
        max_turns: int,
        request_timeout_s: float,
        max_concurrency: int | None = None,
        name: str = "",
        agent_name: str = "",
    ) -> None:
        label = f"environment {name!r}" if name else f"environment {type(inner).__name__}"
        if getattr(inner, "max_turns", None) != 1:
            raise ConfigError(
                f"agent: an agent plays the tasks of a single-turn environment; {label} has max_turns="
                f"{getattr(inner, 'max_turns', None)!r} (the agent makes its own turns)"
            )
        if len(tuple(inner.agent_ids)) != 1:
            raise ConfigError(
                f"agent: an agent plays a single-agent environment; {label} has agents {tuple(inner.agent_ids)}"
            )
        self.inner, self.agent, self.server, self.parser = inner, agent, server, parser
        self.agent_name = agent_name or type(agent).__name__
        self.agent_ids: tuple[AgentId, ...] = tuple(inner.agent_ids)
        self.max_turns, self.request_timeout_s, self.max_concurrency = max_turns, request_timeout_s, max_concurrency
        self._rows: list[Row] = []
        self._tasks: list[Observation] = []
        self._slots: asyncio.Semaphore | None = None

    # ---- the Environment protocol --------------------------------------------------------------------
    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        self.close_rollout()
        self._tasks = list(self.inner.reset(batch_size, seed=seed, group_size=group_size))
        self.server.start()
        if self._slots is None and self.max_concurrency is not None:
            self._slots = asyncio.Semaphore(self.max_concurrency)  # used on the endpoint's loop only
        self._rows = [self._row(i, obs) for i, obs in enumerate(self._tasks)]
        self.server.open(self._rows)
        for row in self._rows:
            row.deadline = time.monotonic() + self.request_timeout_s
            row.handle = self.server.submit(self._play(row))
        self._wait(self._rows)
        return [self._observation(row) for row in self._rows]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        if len(actions) != len(self._rows):
            raise ValueError(f"agent: got {len(actions)} actions for a batch of {len(self._rows)} rows")
        answered = []
        for row, action in zip(self._rows, actions):
            if row.reported:
                continue
            if action is None:  # the rollout ended the row (its token budget)
                self.server.end(
                    row, RequestError(409, "the trainer ended this episode", "episode_ended"), ended_by_trainer=True
                )
            elif row.status == "pending":
                self.server.answer(row, answer(action, self.parser), self.request_timeout_s)
                answered.append(row)
        self._wait(answered)
        n = len(self._rows)
        observations: list[Observation | None] = [None] * n
        info: list[dict[AgentId, dict[str, Any]]] = [{} for _ in range(n)]
        ending = []
        for i, row in enumerate(self._rows):
            if row.reported:
                continue
            if row.status == "pending":
                observations[i] = self._observation(row)
            else:
                row.reported = True
                info[i] = {self.agent_ids[0]: self._ended(row)}
                ending.append(i)
        if ending and all(row.reported for row in self._rows):
            self._step_inner(info, ending)
        return StepResult(observations=observations, done=[obs is None for obs in observations], info=info)

    def close_rollout(self) -> None:
        """Retire the last rollout's episodes (their keys get 410; an agent still running is cancelled)."""
        if self._rows:
            self.server.retire(self._rows)
            self._rows = []

    def close(self) -> None:
        """Stop the endpoint (the run ended): no thread, socket or agent is left."""
        self._rows = []
        self.server.stop()

    # ---- the rows --------------------------------------------------------------------------------------
    def _row(self, index: int, obs: Observation) -> Row:
        messages = [m.as_dict() for m in obs.messages] if obs.messages else [{"role": "user", "content": obs.prompt}]
        task = AgentTask(obs.prompt, messages, MappingProxyType(dict(obs.metadata)), self.server.model, index)
        row = Row(secrets.token_urlsafe(16), index, task, self.max_turns, self.parser)
        row.slots = self._slots
        return row

    async def _play(self, row: Row) -> None:
        """Run the agent on ``row``'s task with a client bound to the episode (on the endpoint's loop)."""
        import openai

        client = openai.AsyncOpenAI(
            base_url=self.server.url,
            api_key=self.server.api_key,
            default_headers={EPISODE_HEADER: row.key},
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
        )
        try:
            if row.slots is not None:
                await row.slots.acquire()
                row.holds_slot = True
            result = as_result(await self.agent.rollout(client, row.task))
            self.server.finish(row, result=result)
        except Exception as e:  # noqa: BLE001 - an agent's failure ends its episode, never the run
            first = (str(e).strip().splitlines() or [""])[0]
            self.server.finish(row, error=f"{type(e).__name__}: {first}" if first else type(e).__name__)
        finally:
            if row.slots is not None and row.holds_slot:
                row.holds_slot = False
                row.slots.release()
            await client.close()

    def _wait(self, rows: Sequence[Row]) -> None:
        """Until each of ``rows`` has a request waiting or has ended; a row silent past its deadline is ended."""
        cond = self.server.cond
        with cond:
            while True:
                now = time.monotonic()
                waiting = [r for r in rows if r.status == "running"]
                late = [r for r in waiting if r.deadline <= now]
                if late:
                    break
                if not waiting:
                    return
                cond.wait(timeout=min(r.deadline for r in waiting) - now)
        why = RequestError(
            409, f"the episode timed out (agent.request_timeout_s={self.request_timeout_s:g})", "timeout"
        )
        for row in late:
            self.server.end(row, why, timed_out=True)
        self._wait(rows)

    def _observation(self, row: Row) -> Observation:
        """The row's pending request as its next observation (a row that ended before asking: its task, one token)."""
        task = self._tasks[row.index]
        pending = row.request
        if pending is None:
            return replace(task, max_new_tokens=1, turn=0)
        stop = list(dict.fromkeys([*(task.stop or []), *pending.stop])) or None
        turn = row.requests - 1
        if pending.kind == "completion":
            return Observation(
                pending.prompt,
                task.agent_id,
                metadata=task.metadata,
                stop=stop,
                turn=turn,
                max_new_tokens=pending.max_tokens,
            )
        messages, _ = to_messages(pending.messages, row.given)
        tools = pending.tools
        return Observation(
            self._plain(task, messages),
            task.agent_id,
            messages=messages,
            metadata=task.metadata,
            stop=stop,
            turn=turn,
            max_new_tokens=pending.max_tokens,
            tools=tools,
            tool_prompt=self.parser.describe(tools) if tools else None,
        )

    @staticmethod
    def _plain(task: Observation, messages: list[Message]) -> str:
        """The plain-text prompt: the task's own prompt when the conversation starts with the task's messages (then
        each later message appended), else every message in plain text."""
        first = list(task.messages) if task.messages else [Message("user", task.prompt)]
        if messages[: len(first)] == first:
            return task.prompt + plain_text(messages[len(first) :])
        return plain_text(messages)

    def _ended(self, row: Row) -> dict[str, Any]:
        """The info of the step ``row`` ended on: its answer (what the rewards score), the agent's metadata and reward,
        and what the metrics count."""
        if row.error is not None:
            warnings.warn(
                f"agent {self.agent_name!r} raised {row.error} (episode {row.index}); "
                "the episode ends with the answer ''",
                stacklevel=2,
            )
        result = row.result
        return {
            "agent_answer": result.answer if result is not None else "",
            "agent_metadata": dict(result.metadata) if result is not None else {},
            "agent_reward": result.reward if result is not None else None,
            "agent_requests": row.requests,
            "agent_error": row.error,
            "agent_timeout": row.timed_out,
            "agent_truncated": row.over_turns or row.ended_by_trainer,
            # as the tool loop says it (the tool_format reward reads it): the agent returned an answer, within limits
            "answered": result is not None and bool(result.answer) and not row.over_turns,
            "agent_latency_s": (row.ended or time.monotonic()) - row.started,
        }

    def _step_inner(self, info: list[dict[AgentId, dict[str, Any]]], ending: Sequence[int]) -> None:
        """Step the wrapped environment with every row's answer (``""`` for one that failed or timed out), and give its
        info to the rows ending now."""
        result = self.inner.step([row.result.answer if row.result is not None else "" for row in self._rows])
        for i in ending:
            for agent, inner_info in result.info[i].items():
                info[i].setdefault(agent, {}).update({k: v for k, v in inner_info.items() if k not in info[i][agent]})

    # ---- optional protocols, forwarded --------------------------------------------------------------
    # Checkpointable and HeldOutSplit exactly when the wrapped environment is (see ToolUseEnvironment).
    def __getattr__(self, name: str) -> Any:
        if name in ("state_dict", "load_state_dict") and hasattr(self.__dict__.get("inner"), name):
            return getattr(self.inner, name)
        if name == "held_out" and hasattr(self.__dict__.get("inner"), "held_out"):
            return self._held_out
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _held_out(self) -> AgentEnvironment:
        return AgentEnvironment(
            self.inner.held_out(),  # type: ignore[attr-defined]
            self.agent,
            self.server,
            self.parser,
            max_turns=self.max_turns,
            request_timeout_s=self.request_timeout_s,
            max_concurrency=self.max_concurrency,
            agent_name=self.agent_name,
        )
