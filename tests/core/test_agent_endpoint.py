"""The rollout endpoint (palestra.agents.server) and the agent environment (palestra.agents.bridge) with a scripted
"policy": real agents on a real uvicorn server on 127.0.0.1, spoken to with the official `openai` client and httpx.
Every route, every refusal, the limits (turns, timeout, concurrency), agents that raise or disconnect, and the server
gone (port closed, thread ended) after close()."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from palestra.agents import AgentResult, AgentTask
from palestra.agents.bridge import AgentEnvironment
from palestra.agents.metrics import agent_metrics
from palestra.agents.server import EPISODE_HEADER, AgentServer
from palestra.engine.rollout import run_episodes
from palestra.multiagent.credit import reward_rows
from palestra.plugins.envs.arithmetic import ArithmeticEnv
from palestra.plugins.tools.parsers import HermesParser
from palestra.types import Episode, Observation

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ADD_SPEC = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def endpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "palestra-agent-endpoint"]


@pytest.fixture
def bridge() -> Iterator[Callable[..., AgentEnvironment]]:
    """``bridge(agent, **limits)``: an agent environment over arithmetic tasks, closed at the end of the test."""
    made: list[AgentEnvironment] = []

    def make(agent: Any, **limits: Any) -> AgentEnvironment:
        limits = {"max_turns": 3, "request_timeout_s": 10.0, **limits}
        env = AgentEnvironment(
            ArithmeticEnv(difficulty=1, terms=2, prompt="{question} ="), agent, AgentServer(), HermesParser(), **limits
        )
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()
    assert not endpoint_threads()


def play(env: AgentEnvironment, respond: Callable[[Observation], str], batch: int = 2) -> list[Episode]:
    """Episodes of ``env`` with ``respond`` as the policy (one text per observation)."""
    return run_episodes(env, lambda obs: [respond(o) for o in obs], batch)


class ToolAgent:
    """Asks with a tool, runs the call it gets back (adds), sends the result, returns the next reply's content."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> AgentResult:
        messages: list[dict[str, Any]] = list(task.messages)
        for _ in range(3):
            reply = await client.chat.completions.create(model=task.model, messages=messages, tools=[ADD_SPEC])
            self.seen.append(reply)
            message = reply.choices[0].message
            if not message.tool_calls:
                return AgentResult(message.content or "", metadata={"asked": len(self.seen)}, reward=0.5)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
        return AgentResult("")


def scripted(obs: Observation) -> str:
    """A call on the first turn, the answer after the tool's result."""
    return CALL if obs.turn == 0 else "<answer>5</answer>"


def test_an_agent_with_tool_calls_plays_through_the_openai_client(bridge: Callable[..., AgentEnvironment]) -> None:
    agent = ToolAgent()
    env = bridge(agent)
    episodes = play(env, scripted)
    assert [len(ep.turns) for ep in episodes] == [2, 2]
    first = agent.seen[0]
    assert first.object == "chat.completion" and first.model == "palestra-policy"
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    last = episodes[0].turns[1]
    # the echoed assistant message is the exact sampled text; the tool result follows; the tools were offered
    assert [(m.role, m.content) for m in last.observation.messages[-2:]] == [("assistant", CALL), ("tool", "5")]
    assert last.observation.tools == [ADD_SPEC] and "add" in (last.observation.tool_prompt or "")
    assert (
        last.observation.prompt
        == episodes[0].turns[0].observation.prompt + CALL + "\n<tool_response>\n5\n</tool_response>\n"
    )
    assert last.info["agent_answer"] == "<answer>5</answer>" and last.info["agent_requests"] == 2
    _, completions, metadata = reward_rows(episodes)
    assert completions == ["<answer>5</answer>"] * 2 and metadata[0]["asked"] >= 2
    metrics = agent_metrics(episodes)
    assert metrics["agents/requests_per_episode"] == 2.0 and metrics["agents/error_rate"] == 0.0


class EditingAgent(ToolAgent):
    """Rewrites the assistant message it was answered before sending it back."""

    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> AgentResult:
        first = await client.chat.completions.create(model=task.model, messages=list(task.messages), tools=[ADD_SPEC])
        echoed = {"role": "assistant", "content": "I will add 2 and 3."}
        history = [*task.messages, echoed, {"role": "tool", "tool_call_id": "x", "content": "5"}]
        self.seen.append(first)
        last = await client.chat.completions.create(model=task.model, messages=history, tools=[ADD_SPEC])
        return last.choices[0].message.content or ""


def test_an_edited_history_is_kept_as_the_agent_wrote_it(bridge: Callable[..., AgentEnvironment]) -> None:
    episodes = play(bridge(EditingAgent()), scripted, batch=1)
    second = episodes[0].turns[1].observation
    assert (second.messages or [])[-2].content == "I will add 2 and 3."
    assert not second.prompt.startswith(episodes[0].turns[0].observation.prompt + CALL)


class CompletionAgent:
    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        models = await client.models.list()
        assert [m.id for m in models.data] == [task.model]
        out = await client.completions.create(model=task.model, prompt=task.prompt, max_tokens=3, stop=["\n"])
        assert out.object == "text_completion"
        return out.choices[0].text


def test_the_completions_route_and_the_models_route(bridge: Callable[..., AgentEnvironment]) -> None:
    seen: list[Observation] = []

    def respond(obs: Observation) -> str:
        seen.append(obs)
        return " 7"

    episodes = play(bridge(CompletionAgent()), respond)
    assert [ep.last.info["agent_answer"] for ep in episodes] == [" 7", " 7"]
    # the environment's own stop strings stay; the request's are added
    assert seen[0].messages is None and seen[0].max_new_tokens == 3 and seen[0].stop == ["</answer>", "\n"]
    assert seen[0].prompt.endswith(" =")


class Prober:
    """Sends every kind of bad request, records (status, message), then asks once properly and answers."""

    def __init__(self, server: AgentServer) -> None:
        self.server = server
        self.seen: dict[str, tuple[int, str]] = {}

    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        key = client.default_headers[EPISODE_HEADER]
        url = f"{self.server.url}/chat/completions"
        auth = {"Authorization": f"Bearer {self.server.api_key}", EPISODE_HEADER: str(key)}
        good = {"model": task.model, "messages": list(task.messages)}
        async with httpx.AsyncClient(timeout=10) as http:

            async def probe(name: str, body: Any = None, headers: Any = None, raw: bytes | None = None) -> None:
                r = await http.post(url, headers=auth if headers is None else headers, content=raw or json.dumps(body))
                self.seen[name] = (r.status_code, r.json()["error"]["message"])

            await probe("json", raw=b"{not json")
            await probe("messages", {"model": task.model})
            await probe("role", {**good, "messages": [{"role": "robot", "content": "x"}]})
            await probe("model", {**good, "model": "gpt-4o"})
            await probe("n", {**good, "n": 2})
            await probe("stream", {**good, "stream": True})
            await probe("key", good, headers={"Authorization": "Bearer wrong", EPISODE_HEADER: str(key)})
            await probe("host", good, headers={**auth, "Host": "evil.example:80"})
            await probe("no_episode", good, headers={"Authorization": auth["Authorization"]})
            await probe("unknown_episode", good, headers={**auth, EPISODE_HEADER: "nope"})
            await probe("max_tokens", {**good, "max_tokens": 0})
        try:  # the official client raises its own typed errors on the same answers
            await client.chat.completions.create(model="gpt-4o", messages=list(task.messages))
        except openai.NotFoundError as e:
            self.seen["client_404"] = (e.status_code, e.message)
        reply = await client.chat.completions.create(model=task.model, messages=list(task.messages))
        return reply.choices[0].message.content or ""


def test_bad_requests_get_one_http_error_each(bridge: Callable[..., AgentEnvironment]) -> None:
    env = bridge(None)
    env.agent = prober = Prober(env.server)  # it needs the server's address and key
    episodes = play(env, lambda obs: "42", batch=1)
    assert episodes[0].last.info["agent_answer"] == "42"
    seen = prober.seen
    assert seen["json"][0] == 400 and seen["json"][1].startswith("the request body is not JSON")
    assert seen["messages"] == (400, "'messages' must be a non-empty list of messages")
    assert seen["role"][0] == 400 and seen["role"][1].startswith("messages[0].role: expected one of")
    assert seen["model"] == (404, "model 'gpt-4o' does not exist; this endpoint serves 'palestra-policy'")
    assert seen["n"] == (400, "n=2: one choice per request (n=1); send n requests instead")
    assert seen["stream"][0] == 400
    assert seen["key"] == (401, "a missing or wrong API key (use the client the agent was given)")
    assert seen["host"] == (403, "the endpoint answers requests to 127.0.0.1 or localhost only")
    assert seen["no_episode"][0] == 400 and seen["unknown_episode"] == (404, "no episode has this key")
    assert seen["max_tokens"][0] == 400
    assert seen["client_404"][0] == 404


class Keeper:
    """Answers at once."""

    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        reply = await client.chat.completions.create(model=task.model, messages=list(task.messages))
        return reply.choices[0].message.content or ""


def test_requests_after_the_episode_or_the_rollout_closed_are_refused(bridge: Callable[..., AgentEnvironment]) -> None:
    env = bridge(Keeper())
    play(env, lambda obs: "1", batch=1)
    row = env._rows[0]
    headers = {"Authorization": f"Bearer {env.server.api_key}", EPISODE_HEADER: row.key}
    body = {"model": "palestra-policy", "messages": [{"role": "user", "content": "again"}]}
    finished = httpx.post(f"{env.server.url}/chat/completions", headers=headers, json=body, timeout=10)
    assert finished.status_code == 409 and "has ended" in finished.json()["error"]["message"]
    env.reset(1)  # the next rollout retires the last one's keys
    closed = httpx.post(f"{env.server.url}/chat/completions", headers=headers, json=body, timeout=10)
    assert closed.status_code == 410 and closed.json()["error"]["message"] == "the rollout of this episode is closed"


class Chatty:
    """Never stops asking."""

    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        messages = list(task.messages)
        try:
            while True:
                reply = await client.chat.completions.create(model=task.model, messages=messages)
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "more"},
                ]
        except openai.BadRequestError as e:
            return f"stopped: {e.body['message']}"  # type: ignore[index]


def test_a_request_past_max_turns_is_refused_and_the_episode_ends_truncated(
    bridge: Callable[..., AgentEnvironment],
) -> None:
    episodes = play(bridge(Chatty(), max_turns=2), lambda obs: "x", batch=1)
    info = episodes[0].last.info
    assert len(episodes[0].turns) == 2 and info["agent_truncated"] and not info["answered"]
    assert info["agent_answer"] == "stopped: this episode has used its 2 requests (agent.max_turns); return the answer"


class Sleeper:
    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        if task.index == 0:
            await asyncio.sleep(3600)
        reply = await client.chat.completions.create(model=task.model, messages=list(task.messages))
        return reply.choices[0].message.content or ""


class Raiser:
    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        if task.index == 1:
            raise ValueError("the agent broke\nsecond line")
        reply = await client.chat.completions.create(model=task.model, messages=list(task.messages))
        return reply.choices[0].message.content or ""


def test_a_silent_agent_times_out_and_a_raising_one_is_one_warning(bridge: Callable[..., AgentEnvironment]) -> None:
    episodes = play(bridge(Sleeper(), request_timeout_s=0.3), lambda obs: "9")
    assert [ep.last.info["agent_timeout"] for ep in episodes] == [True, False]
    assert [ep.last.info["agent_answer"] for ep in episodes] == ["", "9"]
    assert agent_metrics(episodes)["agents/timeout_rate"] == 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        episodes = play(bridge(Raiser(), agent_name="raiser"), lambda obs: "9")
    assert [str(w.message) for w in caught] == [
        "agent 'raiser' raised ValueError: the agent broke (episode 1); the episode ends with the answer ''"
    ]
    assert [ep.last.info["agent_error"] for ep in episodes] == [None, "ValueError: the agent broke"]
    assert agent_metrics(episodes)["agents/error_rate"] == 0.5
    assert reward_rows(episodes)[1][1] == ""


class Hangup:
    """Gives up on its request (a client-side timeout: the connection is dropped), then fails."""

    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        fast = client.with_options(timeout=0.2)
        await fast.chat.completions.create(model=task.model, messages=list(task.messages))
        return "unreachable"


def test_a_client_that_disconnects_ends_its_row_and_nothing_breaks(bridge: Callable[..., AgentEnvironment]) -> None:
    env = bridge(Hangup())

    def slow(obs: Observation) -> str:
        time.sleep(0.5)  # the sampler is slower than the agent's patience
        return "late"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        episodes = play(env, slow, batch=1)
    assert episodes[0].last.info["agent_error"].startswith("APITimeoutError")
    assert len(caught) == 1 and env.server.running
    assert [len(ep.turns) for ep in play(bridge(Keeper()), lambda obs: "1", batch=1)] == [1]


class Counting:
    """Measures how many agents run their own code at once."""

    def __init__(self) -> None:
        self.now = self.most = 0

    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        for _ in range(2):
            self.now += 1
            self.most = max(self.most, self.now)
            await asyncio.sleep(0.05)
            self.now -= 1
            await client.chat.completions.create(model=task.model, messages=list(task.messages))
        return "done"


@pytest.mark.parametrize("cap, most", [(1, 1), (None, 4)])
def test_max_concurrency_caps_the_agents_running_their_own_code(
    bridge: Callable[..., AgentEnvironment], cap: int | None, most: int
) -> None:
    agent = Counting()
    episodes = play(bridge(agent, max_concurrency=cap), lambda obs: "1", batch=4)
    assert [ep.last.info["agent_answer"] for ep in episodes] == ["done"] * 4
    assert agent.most == most


def test_close_stops_the_server_port_and_thread() -> None:
    env = AgentEnvironment(ArithmeticEnv(), Keeper(), AgentServer(), HermesParser(), max_turns=2, request_timeout_s=5)
    play(env, lambda obs: "1", batch=1)
    port = env.server.port
    assert endpoint_threads()
    env.close()
    assert not endpoint_threads()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    env.close()  # twice: nothing more to do


def test_the_server_binds_the_loopback_address_only() -> None:
    server = AgentServer()
    server.start()
    try:
        assert server._sock is not None and server._sock.getsockname()[0] == "127.0.0.1"
        ok = httpx.get(f"{server.url}/models", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "palestra-policy"
        assert httpx.get(f"{server.url}/models", timeout=10).status_code == 401
    finally:
        server.stop()
