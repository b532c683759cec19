"""A verifiers episode run against an OpenAI-compatible client (Palestra's rollout endpoint): the loop of verifiers'
tool-less ``null`` chat harness, run in this process instead of as a ``uv`` program in a sandbox.

Why in-process: verifiers' harness programs are PEP 723 scripts that ``uv`` installs (from the network) into
``~/.cache/verifiers`` and that reach the model through verifiers' interception proxy; Palestra's endpoint already
is the model, tool calls included (issue 24's parsers), and a training run must not download or write outside its
run folder. What stays verifiers' own: the tasks, the task's toolsets (its ``@vf.tool`` methods, registered on an
in-process MCP server exactly as ``Toolset.register`` serves them, advertised as ``<prefix>_<tool>``), the
environment's ``run()`` for multi-turn episodes (its user turns go through :class:`Interaction`), and the scoring
(``Task.score`` on the finished :class:`verifiers.v1.Trace`).

Limits: one model call per request (``n=1``); ``max_turns`` model calls per agent run (then the run stops as
verifiers' ``max_turns`` stop); a tool that raises or gets bad arguments answers the model with ``Error: ...``; the
environment's cross-agent ``finalize()`` and runtime-dependent rewards (those that need a sandbox) are not run.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from palestra.plugins.envs.verifiers_env import (
    LoadedEnv,
    Scored,
    build_trace,
    import_verifiers,
    prompt_messages,
    score_trace,
)

REFUSALS = ("max_turns", "episode_ended")  # the endpoint's error codes for a request past the episode's limits


@dataclass
class Limits:
    max_turns: int = 8  # model calls per agent run
    max_tokens: int | None = None  # per model call (the endpoint also caps it)
    temperature: float | None = None


@dataclass
class ToolBox:
    """The task's toolsets on in-process MCP servers: OpenAI tool specs and a dispatcher."""

    specs: list[dict[str, Any]] = field(default_factory=list)
    routes: dict[str, tuple[Any, str]] = field(default_factory=dict)  # advertised name -> (server, tool name)

    async def call(self, name: str, arguments: str) -> str:
        if name not in self.routes:
            return f"Error: unknown tool {name!r}; the tools are {', '.join(self.routes) or 'none'}"
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            return f"Error: the arguments of {name} are not JSON ({e.msg})"
        if not isinstance(args, dict):
            return f"Error: the arguments of {name} must be a JSON object"
        server, tool = self.routes[name]
        try:
            result = await server.call_tool(tool, args)
        except Exception as e:  # noqa: BLE001 - a tool failing is the model's information, not a crashed episode
            return f"Error: {' '.join(str(e).split())}"
        texts = [getattr(block, "text", None) or str(block) for block in getattr(result, "content", [])]
        return "\n".join(texts)


async def open_toolbox(env: LoadedEnv, task: Any) -> ToolBox:
    """Register the task's (and the taskset's) toolsets on fresh in-process MCP servers, per episode as verifiers
    launches task toolsets per rollout."""
    from mcp.server.mcpserver import MCPServer

    taskset = env.env.taskset
    toolsets = [*type(task).toolsets(task.config), *type(taskset).toolsets(taskset.config)]
    box = ToolBox()
    for toolset in toolsets:
        await toolset.setup()
        await toolset.setup_task(task)
        server = MCPServer(name=toolset.server_name or "tools")
        toolset.register(server)
        for tool in await server.list_tools():
            name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
            box.routes[name] = (server, tool.name)
            function = {"name": name, "description": tool.description or "", "parameters": tool.input_schema}
            box.specs.append({"type": "function", "function": function})
    return box


class ChatRun:
    """One agent run's conversation (a verifiers trace being built) and the loop that extends it."""

    def __init__(self, client: Any, model: str, env: LoadedEnv, task: Any, box: ToolBox, limits: Limits) -> None:
        self.client, self.model, self.box, self.limits = client, model, box, limits
        self.task = task
        self.turns: list[tuple[Any, bool]] = [(m, False) for m in prompt_messages(task)]
        self.calls = 0
        self.refused = False  # the endpoint refused a request: the episode's limits (agent.max_turns, its budget)

    @property
    def exhausted(self) -> bool:
        return self.calls >= self.limits.max_turns or self.refused

    async def segment(self) -> list[Any]:
        """Call the model until it answers without a tool call (or the turn limit); the messages it added."""
        vf = import_verifiers()
        start = len(self.turns)
        while not self.exhausted:
            reply = await self._ask()
            if reply is None:
                break
            self.turns.append((reply, True))
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                text = await self.box.call(call.name, call.arguments)
                self.turns.append((vf.ToolMessage(tool_call_id=call.id, content=text, name=call.name), False))
        return [m for m, _ in self.turns[start:]]

    async def _ask(self) -> Any | None:
        from verifiers.v1.dialects.chat import message_to_wire

        vf = import_verifiers()
        extra: dict[str, Any] = {}
        if self.box.specs:
            extra["tools"] = self.box.specs
        if self.limits.max_tokens is not None:
            extra["max_tokens"] = self.limits.max_tokens
        if self.limits.temperature is not None:
            extra["temperature"] = self.limits.temperature
        self.calls += 1
        try:
            response = await self.client.chat.completions.create(
                model=self.model, messages=[message_to_wire(m) for m, _ in self.turns], **extra
            )
        except Exception as e:
            # the endpoint's limits end the conversation where it is (scored as verifiers scores a max_turns stop);
            # any other failure is the episode's
            if getattr(e, "code", None) not in REFUSALS:
                raise
            self.refused = True
            return None
        message = response.choices[0].message
        calls = [
            vf.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments or "{}")
            for c in (message.tool_calls or [])
        ]
        return vf.AssistantMessage(content=message.content, tool_calls=calls or None)

    def trace(self) -> Any:
        trace = build_trace(self.task, self.turns)
        last = self.turns[-1][0] if self.turns else None
        # the limit cut the run short when its last message still waits for the model (a tool result, a user turn)
        if self.exhausted and (getattr(last, "role", "") != "assistant" or getattr(last, "tool_calls", None)):
            trace.stop("max_turns")
        trace.is_completed = True
        trace.ok = True
        return trace


class Interaction:
    """verifiers' ``Interaction`` surface for an environment's ``run()``: the caller is the run's user."""

    def __init__(self, run: ChatRun) -> None:
        self.run = run

    @property
    def trace(self) -> Any:
        return self.run.trace()

    async def turn(self, message: str | None = None) -> Any:
        vf = import_verifiers()
        if self.run.exhausted:
            return vf.Segment(messages=[], terminated=True)
        if message is not None:
            self.run.turns.append((vf.UserMessage(content=message), False))
        return vf.Segment(messages=await self.run.segment())


class Agent:
    """One seat of the environment (``agents.agent``): its runs go to the same endpoint, the policy under training."""

    def __init__(self, episode: Episode, name: str) -> None:
        self.episode, self.name = episode, name
        self.trainable = True

    def _start(self, task: Any) -> ChatRun:
        run = ChatRun(
            self.episode.client, self.episode.model, self.episode.env, task, self.episode.box, self.episode.limits
        )
        self.episode.runs.append((self, run))
        return run

    async def run(self, task: Any) -> Any:
        run = self._start(task)
        await run.segment()
        return run.trace()

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any) -> AsyncIterator[Interaction]:
        yield Interaction(self._start(task))


class Agents:
    """verifiers' ``Agents`` surface: one :class:`Agent` per role the environment's config declares."""

    def __init__(self, episode: Episode, roles: list[str]) -> None:
        self._agents = {name: Agent(episode, name) for name in roles}

    def __getattr__(self, name: str) -> Agent:
        agents = self.__dict__.get("_agents", {})
        if name not in agents:
            raise AttributeError(f"the environment declares no agent {name!r} (its agents: {', '.join(agents)})")
        return agents[name]

    def __getitem__(self, name: str) -> Agent:
        return getattr(self, name)


@dataclass
class Episode:
    client: Any
    model: str
    env: LoadedEnv
    box: ToolBox
    limits: Limits
    runs: list[tuple[Agent, ChatRun]] = field(default_factory=list)


@dataclass
class Outcome:
    """A finished verifiers episode: the scored trace's last reply, its scores and the number of model calls."""

    answer: str
    scored: Scored
    model_calls: int
    turns: int

    def metadata(self) -> dict[str, Any]:
        return {
            "rewards": self.scored.as_metadata()["rewards"],
            "metrics": self.scored.metrics,
            "error": self.scored.error,
            "model_calls": self.model_calls,
        }


async def run_episode(client: Any, model: str, env: LoadedEnv, index: int, limits: Limits) -> Outcome:
    """Play task ``index`` of ``env`` with the model behind ``client`` and score it as verifiers does."""
    task = env.tasks[index]
    box = await open_toolbox(env, task)
    episode = Episode(client, model, env, box, limits)
    from verifiers.v1.configs.agent import agent_config_fields

    agents = Agents(episode, list(agent_config_fields(env.env.config)))
    await env.env.setup(agents)
    await env.env.run(task, agents)
    scored_run = _scored_run(episode, task)
    trace = scored_run.trace()
    scored = await score_trace(scored_run.task, trace)
    calls = sum(run.calls for _, run in episode.runs)
    return Outcome(trace.last_reply, scored, calls, trace.num_turns)


def _scored_run(episode: Episode, task: Any) -> ChatRun:
    """The run that is scored: the last trainable run on the episode's own task (verifiers scores each trace on
    its own task; the seed task's trace is the policy's)."""
    own = [run for agent, run in episode.runs if agent.trainable and run.task.data.idx == task.data.idx]
    trainable = [run for agent, run in episode.runs if agent.trainable]
    runs = own or trainable
    if not runs:
        raise RuntimeError(f"verifiers environment {episode.env.env_id!r}: run() ran no trainable agent")
    return runs[-1]
