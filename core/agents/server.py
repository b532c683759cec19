"""The rollout endpoint: the policy under training served on loopback as an OpenAI-compatible API.

A FastAPI app served by uvicorn on its own asyncio loop, in a background thread, bound to ``127.0.0.1`` on a port the
system picks (read back from the socket). The agents' coroutines run on the same loop. Routes: ``GET /v1/models``,
``POST /v1/chat/completions`` and ``POST /v1/completions``. Nothing samples here: a request is parked as its
episode's pending turn, the trainer's thread reads it as the episode's next observation
(:class:`palestra.agents.bridge.AgentEnvironment`), samples it with the rollout's own sampler, and the answer goes
back as the response.

Every request needs the run's random API key (``Authorization: Bearer``), a ``Host`` header naming the loopback
address (a page in a browser cannot reach it through DNS rebinding), and its episode's key (the
``X-Palestra-Episode`` header, or the ``user`` field). A refusal is an HTTP error in the OpenAI shape, one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import secrets
import socket
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from palestra.agents.records import Given, RequestError, chat_response, completion_response, read_messages

if TYPE_CHECKING:
    from palestra.agents.api import AgentResult, AgentTask

__all__ = ["EPISODE_HEADER", "AgentServer", "Pending", "Row"]

EPISODE_HEADER = "X-Palestra-Episode"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
START_TIMEOUT_S = 30.0


@dataclass
class Pending:
    """A request waiting for the policy: what the observation is made of, and the future its answer resolves."""

    kind: str  # "chat" | "completion"
    future: asyncio.Future[Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str = ""
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Row:
    """One agent episode. ``status``: ``running`` (the agent's own code runs), ``pending`` (a request waits for the
    policy) or ``done``. Changed under the server's condition, by the loop's thread and the trainer's."""

    key: str
    index: int
    task: AgentTask
    max_turns: int
    parser: Any
    status: str = "running"
    request: Pending | None = None
    requests: int = 0
    given: list[Given] = field(default_factory=list)
    result: AgentResult | None = None
    error: str | None = None
    timed_out: bool = False
    over_turns: bool = False
    ended_by_trainer: bool = False
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    deadline: float = 0.0
    handle: concurrent.futures.Future[Any] | None = None
    slots: asyncio.Semaphore | None = None
    holds_slot: bool = False
    reported: bool = False  # the trainer has been told it ended


class AgentServer:
    """The endpoint (see the module docstring); :meth:`start` it, :meth:`stop` it (both idempotent)."""

    def __init__(self, model: str = "palestra-policy") -> None:
        self.model = model
        self.api_key = secrets.token_urlsafe(32)
        self.cond = threading.Condition()
        self.rows: dict[str, Row] = {}
        self.retired: set[str] = set()  # keys of rollouts that ended: their requests get 410
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._sock: socket.socket | None = None
        self._start_lock = threading.Lock()
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- lifetime ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind 127.0.0.1 on a free port and serve in a background thread; return once it accepts connections."""
        with self._start_lock:
            if self._thread is not None:
                return
            if self._stopped:
                raise RuntimeError("the agent endpoint was stopped; a new run starts a new one")
            import uvicorn

            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.bind(("127.0.0.1", 0))
            self.port = self._sock.getsockname()[1]
            # log_config=None: uvicorn leaves the process's logging as it is; the app answers every error itself
            config = uvicorn.Config(
                self.app(), log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=2
            )
            self._server = uvicorn.Server(config)
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._serve, name="palestra-agent-endpoint", daemon=True)
            self._thread.start()
            until = time.monotonic() + START_TIMEOUT_S
            while not self._server.started and self._thread.is_alive() and time.monotonic() < until:
                time.sleep(0.005)
            if not self._server.started:
                self.stop()
                raise RuntimeError(f"the agent endpoint did not start on 127.0.0.1:{self.port}")

    def _serve(self) -> None:
        loop = self.loop
        assert loop is not None and self._sock is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
            # what is left (agents still running when the run ended) is cancelled, then the loop closes
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def stop(self) -> None:
        """Refuse what is pending (410), cancel the agents, stop serving, join the thread and close the socket."""
        with self._start_lock:
            self._stopped = True
            if self._thread is None:
                return
            with self.cond:
                rows = list(self.rows.values())
                self.retired.update(self.rows)
                self.rows.clear()
            for row in rows:
                self.end(row, RequestError(410, "the rollout is closed (the run ended)", "rollout_closed"))
            self._server.should_exit = True
            self._thread.join(timeout=30)
            if self._sock is not None:
                self._sock.close()
            self._thread = None

    # ---- the trainer's side ----------------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        assert self.loop is not None, "start() the endpoint first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def open(self, rows: list[Row]) -> None:
        with self.cond:
            self.rows.update({row.key: row for row in rows})

    def retire(self, rows: list[Row]) -> None:
        """The rollout of ``rows`` is over: their keys get 410 from now on, and any agent still running is cancelled."""
        for row in rows:
            self.end(row, RequestError(410, "the rollout of this episode is closed", "rollout_closed"))
        with self.cond:
            for row in rows:
                self.rows.pop(row.key, None)
                self.retired.add(row.key)

    def answer(self, row: Row, given: Given, timeout_s: float) -> None:
        """Answer ``row``'s pending request with ``given``; the agent then has ``timeout_s`` to ask again or finish."""
        with self.cond:
            pending, row.request = row.request, None
            if pending is None:  # the agent finished meanwhile, without waiting for this answer
                return
            row.given.append(given)
            row.status, row.deadline = "running", time.monotonic() + timeout_s
        self._resolve(pending.future, given)

    def end(self, row: Row, why: RequestError, **flags: bool) -> None:
        """End ``row`` now (timed out, ended by the trainer, or its rollout closed): its pending request gets ``why``,
        its agent is cancelled. A row already done keeps what it has."""
        with self.cond:
            pending, row.request = row.request, None
            if row.status != "done":
                row.status, row.ended = "done", time.monotonic()
                for name, value in flags.items():
                    setattr(row, name, value)
            self.cond.notify_all()
        if pending is not None:
            self._resolve(pending.future, why)
        if row.handle is not None:
            row.handle.cancel()

    def finish(self, row: Row, result: AgentResult | None = None, error: str | None = None) -> None:
        """Called on the loop when ``row``'s agent returned (``result``) or raised (``error``)."""
        with self.cond:
            pending, row.request = row.request, None
            if row.status != "done":
                row.status, row.ended, row.result, row.error = "done", time.monotonic(), result, error
            self.cond.notify_all()
        if pending is not None and not pending.future.done():  # a request it never waited for
            pending.future.set_exception(RequestError(409, "the episode's agent already finished", "episode_finished"))

    def _resolve(self, future: asyncio.Future[Any], value: Any) -> None:
        def settle() -> None:
            if future.done():
                return
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between: nobody waits any more
                loop.call_soon_threadsafe(settle)

    # ---- the app -------------------------------------------------------------------------------------------
    def app(self) -> Any:
        """The FastAPI app; its routes are plain Starlette routes (each handler reads its own request), so that a
        malformed body is this endpoint's own one-line error rather than a validation dump."""
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        def route(handler: Any) -> Any:
            async def endpoint(request: Any) -> JSONResponse:
                try:
                    self._check_caller(request)
                    return JSONResponse(await handler(request))
                except RequestError as e:
                    return JSONResponse(e.body(), status_code=e.status)
                except Exception as e:  # noqa: BLE001 - one line to the agent, never a traceback in the trainer's output
                    error = RequestError(500, f"the endpoint failed: {type(e).__name__}: {e}", "server_error")
                    return JSONResponse(error.body(), status_code=500)

            return endpoint

        app.add_route("/v1/models", route(self._models), methods=["GET"])
        app.add_route("/v1/chat/completions", route(self._chat), methods=["POST"])
        app.add_route("/v1/completions", route(self._completion), methods=["POST"])
        return app

    def _check_caller(self, request: Any) -> None:
        host = (request.headers.get("host") or "").rsplit(":", 1)
        if host[0] not in LOOPBACK_HOSTS or (len(host) == 2 and host[1] != str(self.port)):
            raise RequestError(403, "the endpoint answers requests to 127.0.0.1 or localhost only", "bad_host")
        auth = request.headers.get("authorization") or ""
        if not secrets.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
            raise RequestError(401, "a missing or wrong API key (use the client the agent was given)", "bad_api_key")

    async def _models(self, request: Any) -> dict[str, Any]:
        del request
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "palestra"}]}

    async def _body(self, request: Any) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not JSON ({e})", "bad_json") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object", "bad_json")
        if body.get("model") != self.model:
            raise RequestError(
                404,
                f"model {body.get('model')!r} does not exist; this endpoint serves {self.model!r}",
                "model_not_found",
            )
        if body.get("n", 1) not in (1, None):
            raise RequestError(400, f"n={body.get('n')!r}: one choice per request (n=1); send n requests instead", "n")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not served; ask without streaming", "stream")
        return body

    def _row(self, request: Any, body: Mapping[str, Any]) -> Row:
        key = request.headers.get(EPISODE_HEADER.lower()) or body.get("user")
        if not isinstance(key, str) or not key:
            raise RequestError(
                400, f"no episode key: send the {EPISODE_HEADER} header or the 'user' field", "no_episode"
            )
        with self.cond:
            row = self.rows.get(key)
        if row is None:
            if key in self.retired:
                raise RequestError(410, "the rollout of this episode is closed", "rollout_closed")
            raise RequestError(404, "no episode has this key", "unknown_episode")
        return row

    async def _chat(self, request: Any) -> dict[str, Any]:
        body = await self._body(request)
        row = self._row(request, body)
        messages = read_messages(body.get("messages"))
        tools = _read_tools(body.get("tools"))
        pending = self._park(row, "chat", body, messages=messages, tools=tools)
        given = await self._wait(row, pending)
        return chat_response(given, self.model, row.key, row.requests)

    async def _completion(self, request: Any) -> dict[str, Any]:
        body = await self._body(request)
        row = self._row(request, body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string (one prompt per request)", "bad_prompt")
        pending = self._park(row, "completion", body, prompt=prompt)
        given = await self._wait(row, pending)
        return completion_response(given.sampled, self.model)

    def _park(self, row: Row, kind: str, body: Mapping[str, Any], **fields: Any) -> Pending:
        """Make the request ``row``'s pending turn (the trainer samples it next), after the episode's limits."""
        cap = _read_cap(body)
        stop = _read_stop(body.get("stop"))
        assert self.loop is not None
        with self.cond:
            if row.status == "done":
                raise RequestError(
                    409, "this episode has ended (timed out, finished or ended by the trainer)", "episode_finished"
                )
            if row.status == "pending":
                raise RequestError(
                    409, "this episode already has a request waiting; send one request at a time", "busy"
                )
            if row.requests >= row.max_turns:
                row.over_turns = True
                raise RequestError(
                    400,
                    f"this episode has used its {row.max_turns} requests (agent.max_turns); return the answer",
                    "max_turns",
                )
            pending = Pending(kind, self.loop.create_future(), max_tokens=cap, stop=stop, **fields)
            row.request, row.status = pending, "pending"
            row.requests += 1
            self.cond.notify_all()
        return pending

    async def _wait(self, row: Row, pending: Pending) -> Given:
        """The policy's answer to ``pending``; the episode's concurrency slot is given up meanwhile."""
        if row.slots is not None and row.holds_slot:
            row.holds_slot = False
            row.slots.release()
        given = await pending.future
        if row.slots is not None:
            await row.slots.acquire()
            row.holds_slot = True
        return given


def _read_tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) and isinstance(t["function"].get("name"), str)
        for t in value
    ):
        raise RequestError(
            400, "'tools' must be a list of {'type': 'function', 'function': {'name': ...}}", "bad_tools"
        )
    return [dict(t) for t in value] or None


def _read_cap(body: Mapping[str, Any]) -> int | None:
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise RequestError(400, f"max_tokens must be a positive integer, got {cap!r}", "bad_max_tokens")
    return cap


def _read_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", "bad_stop")
    return list(stops)
