"""Built-in environment ``openenv``: any `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment server as a
batched, multi-turn Palestra environment; and the ``env_reward`` reward, which scores an episode by the rewards the
server gave.

Needs the optional package: ``pip install "palestra[openenv]"``. Importing this module does not import openenv;
building the environment does.

**The server.** One of ``url`` (a server already running), ``package`` (``module:app``, an ASGI app that is served
with uvicorn on a free loopback port, imported from ``app_dir`` when given) or ``command`` (an argv that starts the
server; ``{port}`` in it is replaced by a free loopback port and the server is reached at ``127.0.0.1`` on it, or
``url`` says where it listens). A server the environment starts runs in its own process group with the trainer as
its parent-death signal (Linux), so it is stopped when the environment is closed or garbage collected, when the
trainer exits, and also when the trainer is killed outright; a ``command`` should ``exec`` the server (no shell
wrapped around it), since only the direct child gets that signal. Building the environment waits until the server
answers ``/health`` (``start_timeout_s``; ``url``: ``retries + 1`` tries) and fails with one line naming the URL or
the command otherwise, and checks ``action_field``, ``action`` and the ``prompt`` fields against the server's
``/schema`` when it publishes one.

**Episodes.** Each batch row is one OpenEnv session (a WebSocket connection, kept across batches), all driven
concurrently on one event loop. ``reset`` resets every session with its task seed (``reset_args`` are passed too):
the rows of a group share the seed, so a group plays one game when the server's ``reset`` takes a seed (a server
whose ``reset`` ignores it gives every row its own game, which the contract's "groups share a task" rule catches).
The model's reply goes into the action's ``action_field`` (the other fields from ``action``); the episode ends when
the server says ``done`` or after ``max_turns`` turns.

**Prompts.** ``prompt`` is a ``str.format`` template over the observation's fields (``{feedback}``), ``{turn}`` and
``{observation}`` (every field as a ``name: value`` line). ``system`` starts the prompt (a system message for chat
templates). With ``history`` the prompt keeps the whole episode: each turn appends the model's reply, a newline and
the new observation's text, so a turn's prompt continues the last one (what one-sequence trajectories need), and the
chat messages alternate user and assistant.

**Rewards.** Every step's reward is added up (``reward: sum``) or the last one kept (``reward: last``) in the
episode's ``metadata["openenv"]`` (``reward``, ``rewards`` per step, ``done``: the server ended the episode,
``skipped``, ``reason``, ``turns``, ``retries``); the ``env_reward`` reward reads it, so a config scores with it alone
or as a weighted term next to others.

**Faults.** Every request has ``timeout_s``. A failed request (refused, reset, timed out, the server gone) is
retried up to ``retries`` times, each on a new session that replays the episode (a reset with the same seed and the
actions so far; the replayed observation must match the one the model saw, or the episode is not retried); a server
the environment started that has exited is started again first (at most ``max_restarts`` times per environment).
When the tries are spent, the episode ends there, marked ``skipped`` (``env_reward`` scores it ``skipped``, 0 by
default), with one warning line per call naming the server and the metric ``openenv/skipped`` (episodes skipped in
the step); training goes on. A server's error answer (an action it rejects, an exception in its ``step``) is not
retried: the episode is skipped with the server's message. The environment's ``endpoint`` names the server, so a
stalled call that outlives ``train.data_timeout_s`` (or the step watchdog) says which server it was waiting on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from palestra import hookimpl
from palestra.config import OptionError, check_options, format_fields, option
from palestra.plugins.envs._episodes import check_actions, draw_tasks
from palestra.registry import MissingDependency, Requires
from palestra.types import DEFAULT_AGENT, Message, Observation, StepResult

__all__ = ["EnvReward", "OpenEnvEnvironment", "OpenEnvError", "OpenEnvOptions", "OpenEnvUnreachable", "OpenEnvWarning"]

INSTALL_HINT = 'pip install "palestra[openenv]"'
KEY = "openenv"  # the episode metadata entry this environment writes and env_reward reads
BUILT_IN_FIELDS = ("observation", "turn")
_PR_SET_PDEATHSIG = 1
_STDERR_LINES = 20  # the tail of a started server's stderr kept for error messages
T = TypeVar("T")


class OpenEnvUnreachable(ConnectionError):
    """No OpenEnv server answers where the options say (when the environment is built). One line."""

    palestra_user_error = True


class OpenEnvError(RuntimeError):
    """A problem no retry fixes (a template field the server's observations lack, too few sessions). One line."""

    palestra_user_error = True


class OpenEnvWarning(UserWarning):
    """Skipped episodes and restarted servers (``palestra: warning: openenv: ...``)."""


def import_openenv() -> Any:
    """openenv's generic (dictionary) client class, or a one-line :class:`MissingDependency`."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as e:
        raise MissingDependency("the openenv environment", "openenv", INSTALL_HINT, cause=e) from None
    return GenericEnvClient


# ---- options ---------------------------------------------------------------------------------------------------
@dataclass
class OpenEnvOptions:
    url: str | None = None  # a running server (http://host:port); with command: where the started server listens
    command: list[str] | None = option(None, runs_code=True)  # noqa: RUF009 - argv starting the server; "{port}": a free port
    package: str | None = option(None, runs_code=True)
    app_dir: str | None = option(None, runs_code=True)
    server_env: dict[str, str] = option(default_factory=dict, runs_code=True)  # noqa: RUF009 - environment vars
    prompt: str = "{observation}"  # str.format over the observation's fields, {turn} and {observation}
    system: str | None = None  # text the prompt starts with (a system message for chat templates)
    history: bool = False  # each prompt holds the whole episode so far (replies and observations)
    action_field: str = "message"  # the action field the model's reply goes into
    action: dict[str, Any] = field(default_factory=dict)  # the action's other fields
    reset_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of every reset (with the seed)
    reward: Literal["sum", "last"] = "sum"  # the episode's reward: the steps' rewards added up, or the last one
    max_turns: int = option(8, ge=1)  # turns per episode; then the episode is cut (not done by the server)
    max_new_tokens: int | None = option(None, ge=1)  # each turn's token cap; None: train.max_new_tokens
    stop: list[str] = field(default_factory=list)  # extra stop strings for every turn
    timeout_s: float = option(30.0, gt=0)  # one request (connect, reset, step)
    retries: int = option(2, ge=0)  # more tries of a failed request, each on a new session replaying the episode
    start_timeout_s: float = option(60.0, gt=0)  # a started server must answer /health within this
    max_restarts: int = option(3, ge=0)  # times a started server that exited is started again

    def __post_init__(self) -> None:
        self._check_server()
        if not self.action_field.strip():
            raise OptionError("action_field", "must name the action field the model's reply goes into")
        if self.action_field in self.action:
            raise OptionError(f"action.{self.action_field}", "is the action_field: the model's reply fills it")
        format_fields("prompt", self.prompt)
        if any(not s for s in self.stop):
            raise OptionError("stop", "stop strings must not be empty")

    def _check_server(self) -> None:
        given = [k for k in ("url", "command", "package") if getattr(self, k) is not None]
        if not given:
            raise OptionError("url", "give url (a running server), command (start one) or package (module:app)")
        if "package" in given and len(given) > 1:
            raise OptionError(
                "package", f"give package alone, not with {' and '.join(g for g in given if g != 'package')}"
            )
        if self.url is not None:
            problem = _url_problem(self.url)
            if problem:
                raise OptionError("url", problem)
        if self.command is not None:
            if not self.command or not all(isinstance(a, str) and a for a in self.command):
                raise OptionError("command", "must be a non-empty list of non-empty strings (the server's argv)")
            has_port = any("{port}" in a for a in self.command)
            if self.url is None and not has_port:
                raise OptionError(
                    "command", "needs {port} in an argument (a free loopback port) or url (where it listens)"
                )
            if self.url is not None and has_port:
                raise OptionError("command", "has {port} but url is given too: give one of them")
        if self.package is not None and (":" not in self.package or not all(self.package.split(":", 1))):
            raise OptionError("package", f"must be module:app (an ASGI app uvicorn serves), got {self.package!r}")
        if self.app_dir is not None and self.package is None:
            raise OptionError("app_dir", "is where package is imported from; give package too")


def _url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be http://host:port (the server's base URL), got {url!r}"
    try:
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        return f"has a bad port: {url!r}"
    return None


# ---- the event loop every session runs on -----------------------------------------------------------------------
class _Loop:
    """An asyncio loop in a daemon thread that lives as long as the environment: the sessions' WebSockets belong to
    it, and a started server is spawned from it (a parent-death signal fires when the *thread* that forked exits, so
    the short-lived threads ``train.data_timeout_s`` runs calls in must not be the parent)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run in the loop's thread."""

        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())

    def close(self) -> None:
        if threading.current_thread() is self.thread:  # collected by the loop itself: stop it, nothing to join
            self.loop.stop()
            return
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()  # closed here, not by the loop's __del__ at some later collection


# ---- a server the environment starts ----------------------------------------------------------------------------
class _Server:
    """A child process serving OpenEnv at ``url``, in its own process group, stopped with the environment."""

    def __init__(self, argv: list[str], url: str, env: Mapping[str, str], label: str) -> None:
        self.argv, self.url, self.env, self.label = argv, url, dict(env), label
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self.restarts = 0
        self._drainer: threading.Thread | None = None

    def start(self) -> None:
        """Spawn the server (call from the loop's thread); a command that cannot run is one line."""
        self.stderr.clear()
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: stopping it stops whatever it started
                preexec_fn=_die_with_parent,
            )
        except OSError as e:
            raise OpenEnvUnreachable(f"the OpenEnv server {self.label} could not start: {_one_line(e)}") from None
        self._drainer = threading.Thread(
            target=self._drain, args=(self.proc,), name="palestra-openenv-stderr", daemon=True
        )
        self._drainer.start()

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:  # keeps the pipe empty, so a chatty server never blocks on it
            text = line.decode(errors="replace").strip()
            if text:
                self.stderr.append(text)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def why_dead(self) -> str:
        code = self.exit_code()
        if self._drainer is not None:
            self._drainer.join(1.0)  # the last lines it wrote before it exited
        tail = f" (stderr: {self.stderr[-1]})" if self.stderr else ""
        return f"exited with code {code}{tail}"

    def stop(self) -> None:
        """SIGTERM to the group, then SIGKILL after 5 s."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent (thread) dies, so a killed trainer leaves no server behind."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # http(s) only: the url option is checked
        return json.loads(response.read().decode() or "null")


def _wait_healthy(url: str, server: _Server | None, *, timeout_s: float, tries: int, deadline_s: float) -> None:
    """Return once ``url``/health answers; else :class:`OpenEnvUnreachable` naming the URL or the command."""
    deadline = time.monotonic() + deadline_s
    last: BaseException | None = None
    attempt = 0
    while True:
        attempt += 1
        if server is not None and server.exit_code() is not None:
            raise OpenEnvUnreachable(
                f"the OpenEnv server {server.label} did not answer at {url}/health: it {server.why_dead()}"
            )
        try:
            _get_json(f"{url}/health", min(timeout_s, max(0.1, deadline - time.monotonic())))
            return
        except (OSError, ValueError) as e:
            last = e
        if (server is None and attempt >= tries) or time.monotonic() >= deadline:
            break
        time.sleep(0.1 if server is not None else min(2.0, 0.25 * 2**attempt))
    if server is not None:
        raise OpenEnvUnreachable(
            f"the OpenEnv server {server.label} did not answer at {url}/health within {deadline_s:g} s "
            f"(start_timeout_s; last: {_one_line(last)})"
        )
    tries_text = "1 try" if attempt == 1 else f"{attempt} tries"
    raise OpenEnvUnreachable(f"no OpenEnv server answers at {url}/health ({tries_text}, last: {_one_line(last)})")


def _one_line(e: BaseException | None, limit: int = 200) -> str:
    if e is None:
        return "no answer"
    if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException):
        e = e.reason
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    name = "TimeoutError" if isinstance(e, (asyncio.TimeoutError, TimeoutError)) else type(e).__name__
    return f"{name}: {text}" if text else name


# ---- one episode ------------------------------------------------------------------------------------------------
@dataclass
class _Row:
    index: int
    seed: int
    meta: dict[str, Any]  # the episode's metadata; meta[KEY] is filled in as the episode goes
    turn: int = 0
    done: bool = False
    actions: list[dict[str, Any]] = field(default_factory=list)  # every action sent, to replay on a new session
    seen: dict[str, Any] | None = None  # the observation fields the model saw last (a replay must give them again)
    transcript: str = ""  # the episode's text so far (history)
    messages: list[Message] = field(default_factory=list)
    observation: Observation | None = None
    doomed: str | None = None  # the episode could not start: skipped at its first step, for this reason


@dataclass
class _Failure:
    reason: str


class _Refused(Exception):
    """The server answered with an error (a rejected action, an exception in its step): retrying will not help."""


class OpenEnvEnvironment:
    """An OpenEnv server's environment as batched, multi-turn episodes. See the module docstring and
    :class:`palestra.types.Environment`."""

    agent_ids: tuple[str, ...] = (DEFAULT_AGENT,)

    def __init__(self, **options: Any) -> None:
        self.options: OpenEnvOptions = check_options(OpenEnvOptions, options, where="openenv")
        self._client_cls = import_openenv()
        o = self.options
        self.max_turns = o.max_turns
        self._rng = random.Random()
        self._rows: list[_Row] = []
        self._clients: list[Any] = []  # one session per row, kept across batches
        self._server: _Server | None = None
        self._restart_lock: asyncio.Lock | None = None
        self.url = self._server_url()
        self.endpoint = f"OpenEnv server {self.url}"  # names the server in timeouts and the watchdog's line
        self._loop = _Loop(f"palestra-openenv:{self.url}")
        self._finalizer = weakref.finalize(self, _shut_down, self._loop, self._clients, self._server)
        try:
            self._start()
            self._check_schema()
        except BaseException:
            self.close()
            raise

    # ---- the server -------------------------------------------------------------------------------------------
    def _server_url(self) -> str:
        o = self.options
        if o.command is None and o.package is None:
            assert o.url is not None
            return o.url.rstrip("/")
        port = str(_free_port())  # unused when url says where a command's server listens
        if o.package is not None:
            argv = [sys.executable, "-m", "uvicorn", o.package, "--host", "127.0.0.1", "--port", port]
            argv += ["--no-access-log", "--log-level", "warning"]
            argv += ["--app-dir", os.path.abspath(o.app_dir)] if o.app_dir else []
            label = f"package {o.package!r}"
        else:
            assert o.command is not None
            argv = [a.replace("{port}", port) for a in o.command]
            label = f"command {' '.join(argv)!r}"
        url = o.url.rstrip("/") if o.url is not None else f"http://127.0.0.1:{port}"
        self._server = _Server(argv, url, o.server_env, label)
        return self._server.url

    def _start(self) -> None:
        o = self.options
        if self._server is not None:
            self._loop.call(self._server.start)
        _wait_healthy(self.url, self._server, timeout_s=o.timeout_s, tries=o.retries + 1, deadline_s=o.start_timeout_s)

    def _check_schema(self) -> set[str] | None:
        """The observation's field names from ``/schema`` (None: not published), with the options checked against
        the schema: a wrong ``action_field`` or template field is one line at build time, not a skipped batch (an
        OpenEnvError, which the config layer prefixes with where the environment is built)."""
        try:
            schema = _get_json(f"{self.url}/schema", self.options.timeout_s)
            action = dict(schema["action"]["properties"])
            fields = set(schema["observation"]["properties"]) - {"done", "reward", "metadata"}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        o = self.options
        for key in (o.action_field, *o.action):
            if key not in action:
                where = "action_field" if key == o.action_field else f"action.{key}"
                raise OpenEnvError(
                    f"{where}: the server's action has no field {key!r}; its fields: {', '.join(action)}"
                )
        self._check_template(fields)
        return fields

    def _check_template(self, fields: set[str]) -> None:
        for name in format_fields("prompt", self.options.prompt):
            if name.split(".")[0].split("[")[0] not in fields | set(BUILT_IN_FIELDS):
                known = ", ".join(sorted(fields | set(BUILT_IN_FIELDS)))
                raise OpenEnvError(f"prompt: unknown field {{{name}}}; the server's observations have {known}")

    def close(self) -> None:
        """End every session and stop a server the environment started (also done when it is garbage collected)."""
        self._finalizer()

    # ---- protocol -------------------------------------------------------------------------------------------
    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        seeds = draw_tasks(lambda rng: rng.getrandbits(31), self._rng, batch_size, seed, group_size, "openenv")
        self._rows = [_Row(i, s, self._metadata(s)) for i, s in enumerate(seeds)]
        self._loop.run(self._resize(len(seeds)))
        results = self._loop.run(self._all(self._rows, [None] * len(seeds)))
        for start in range(0, len(seeds), group_size):
            self._start_group(self._rows[start : start + group_size], results[start : start + group_size])
        self._warn([r for r in self._rows if r.doomed], "reset")
        return [r.observation for r in self._rows]  # type: ignore[misc]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        live = [not r.done for r in self._rows]
        check_actions("openenv", actions, live)
        o = self.options
        payloads = [
            None if a is None or r.doomed else {**o.action, o.action_field: a} for r, a in zip(self._rows, actions)
        ]
        todo = [r for r, p in zip(self._rows, payloads) if p is not None]
        results = dict(zip((r.index for r in todo), self._loop.run(self._all(todo, [payloads[r.index] for r in todo]))))
        out: list[Observation | None] = []
        info: list[dict[str, dict[str, Any]]] = []
        skipped: list[_Row] = []
        for row, running, action in zip(self._rows, live, actions):
            if not running:
                out.append(None)
                info.append({})
                continue
            result = results.get(row.index, _Failure(row.doomed or "the episode could not start"))
            if isinstance(result, _Failure):
                self._skip(row, result.reason)
                skipped.append(row)
                info.append({DEFAULT_AGENT: {"skipped": True, "reason": result.reason}})
            else:
                assert action is not None
                info.append({DEFAULT_AGENT: self._advance(row, action, payloads[row.index] or {}, result)})
            out.append(row.observation)
        self._warn(skipped, "step")
        return StepResult(observations=out, done=[o is None for o in out], info=info)

    def rollout_metrics(self, episodes: Sequence[Any]) -> dict[str, float]:
        """``openenv/skipped`` (episodes skipped) and ``openenv/retries`` (requests tried again) over ``episodes``."""
        entries = [e.metadata.get(KEY) for e in episodes]
        entries = [e for e in entries if isinstance(e, Mapping)]
        return {
            "openenv/skipped": float(sum(bool(e.get("skipped")) for e in entries)),
            "openenv/retries": float(sum(int(e.get("retries", 0)) for e in entries)),
        }

    # ---- episodes -------------------------------------------------------------------------------------------
    def _metadata(self, seed: int) -> dict[str, Any]:
        entry = {"reward": 0.0, "rewards": [], "done": False, "skipped": False, "reason": None, "turns": 0}
        return {"seed": seed, KEY: {**entry, "retries": 0}}

    def _start_group(self, rows: list[_Row], results: list[dict[str, Any] | _Failure]) -> None:
        """First observations of one group. A row whose session failed takes a group-mate's (same seed, same game)
        and replays on a new session at its first step; a group none of whose rows started is skipped."""
        started = next((r for r in results if not isinstance(r, _Failure)), None)
        for row, result in zip(rows, results):
            if started is None:
                assert isinstance(result, _Failure)
                row.doomed = result.reason
                row.observation = self._placeholder(row)
                continue
            if isinstance(result, _Failure):
                result = started
            row.seen = dict(result["observation"])
            row.observation = self._observe(row, row.seen, None)

    def _placeholder(self, row: _Row) -> Observation:
        text = "(the OpenEnv server did not start this episode; it is skipped)"
        return Observation(prompt=text, messages=[Message("user", text)], metadata=row.meta, turn=0)

    def _advance(self, row: _Row, reply: str, payload: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        """Record one answered step of ``row``; its next observation unless the episode ended."""
        row.actions.append(payload)
        row.turn += 1
        reward = float(result.get("reward") or 0.0)
        entry = row.meta[KEY]
        entry["rewards"].append(reward)
        entry["reward"] = float(sum(entry["rewards"])) if self.options.reward == "sum" else reward
        entry["turns"] = row.turn
        fields = dict(result.get("observation") or {})
        server_done = bool(result.get("done"))
        if server_done or row.turn >= self.max_turns:
            row.done, entry["done"], row.observation = True, server_done, None
        else:
            row.seen = fields
            row.observation = self._observe(row, fields, reply)
        return {"reward": reward, "done": server_done, "observation": fields}

    def _skip(self, row: _Row, reason: str) -> None:
        row.done, row.observation = True, None
        row.meta[KEY].update(skipped=True, reason=reason, turns=row.turn)

    def _warn(self, rows: list[_Row], call: str) -> None:
        if rows:
            warnings.warn(
                f"openenv: {len(rows)} of {len(self._rows)} episodes skipped at {call} (rows "
                f"{', '.join(str(r.index) for r in rows[:8])}{', ...' if len(rows) > 8 else ''}): {self.endpoint}: "
                f"{rows[0].doomed or rows[0].meta[KEY]['reason']}",
                OpenEnvWarning,
                stacklevel=3,
            )

    def _observe(self, row: _Row, fields: Mapping[str, Any], reply: str | None) -> Observation:
        o = self.options
        text = self._render(fields, row.turn)
        if o.history and reply is not None:
            row.transcript += reply + "\n" + text
            row.messages += [Message("assistant", reply), Message("user", text)]
        else:
            row.transcript = text
            row.messages = [Message("user", text)]
        system = [Message("system", o.system)] if o.system else []
        return Observation(
            prompt=(o.system + "\n" if o.system else "") + row.transcript,
            messages=system + list(row.messages),
            metadata=row.meta,
            stop=list(o.stop) or None,
            turn=row.turn,
            max_new_tokens=o.max_new_tokens,
        )

    def _render(self, fields: Mapping[str, Any], turn: int) -> str:
        values = {k: _text(v) for k, v in fields.items()}
        values["observation"] = "\n".join(f"{k}: {_text(v)}" for k, v in fields.items() if v is not None)
        values["turn"] = str(turn)
        try:
            return self.options.prompt.format(**values)
        except (KeyError, IndexError, AttributeError) as e:
            raise OpenEnvError(
                f"openenv: prompt: the field {e} is not in the server's observation (fields: "
                f"{', '.join(sorted(values))})"
            ) from None

    # ---- sessions (on the loop) ------------------------------------------------------------------------------
    async def _all(self, rows: Sequence[_Row], actions: Sequence[dict[str, Any] | None]) -> list[Any]:
        return list(await asyncio.gather(*(self._call(r, a) for r, a in zip(rows, actions))))

    async def _resize(self, n: int) -> None:
        while len(self._clients) > n:
            await _drop(self._clients.pop())
        self._clients.extend([None] * (n - len(self._clients)))

    async def _call(self, row: _Row, action: dict[str, Any] | None) -> dict[str, Any] | _Failure:
        """Reset (``action`` None) or step ``row``'s session, with retries on new sessions that replay the episode."""
        o = self.options
        last: BaseException | None = None
        for attempt in range(o.retries + 1):
            try:
                if attempt or self._clients[row.index] is None:
                    result = await self._replay(row)
                    if action is None:
                        return result
                elif action is None:
                    return await self._request(self._clients[row.index], "reset", self._reset_data(row))
                return await self._request(self._clients[row.index], "step", action)
            except _Refused as e:
                return _Failure(f"the server refused {'the reset' if action is None else 'the action'}: {e}")
            except OpenEnvError:
                raise
            except Exception as e:  # noqa: BLE001 - a connection refused, reset or timed out: try a new session
                last = e
                row.meta[KEY]["retries"] += attempt < o.retries
                await _drop(self._clients[row.index])
                self._clients[row.index] = None
                if attempt < o.retries:
                    await self._recover()
                    await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        what = "reset" if action is None else "step"
        return _Failure(f"{what} failed {o.retries + 1} times (timeout_s={o.timeout_s:g}); last: {_one_line(last)}")

    async def _replay(self, row: _Row) -> dict[str, Any]:
        """A new session for ``row``, reset with its seed and given its actions so far; the last answer."""
        client = self._client_cls(
            base_url=self.url, connect_timeout_s=self.options.timeout_s, message_timeout_s=self.options.timeout_s
        )
        self._clients[row.index] = client
        await asyncio.wait_for(client.connect(), self.options.timeout_s)
        result = await self._request(client, "reset", self._reset_data(row))
        for action in row.actions:
            result = await self._request(client, "step", action)
        if row.seen is not None and dict(result["observation"]) != row.seen:
            raise _Refused(
                "a new session replaying the episode saw another observation (the server is not "
                "deterministic given the seed and the actions), so the episode cannot go on"
            )
        return result

    def _reset_data(self, row: _Row) -> dict[str, Any]:
        return {**self.options.reset_args, "seed": row.seed}

    async def _request(self, client: Any, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        call = client.reset(**data) if kind == "reset" else client.step(data)
        try:
            result = await asyncio.wait_for(call, self.options.timeout_s)
        except RuntimeError as e:
            text = str(e)
            if not text.startswith("Server error:"):
                raise
            if "CAPACITY_REACHED" in text:
                raise OpenEnvError(
                    f"openenv: {self.endpoint} refused a session ({text}): it serves fewer sessions at once than the "
                    f"batch has rows ({len(self._clients)}); raise its max_concurrent_envs or lower "
                    "train.batch_size x train.group_size"
                ) from None
            raise _Refused(text) from None
        return {"observation": result.observation or {}, "reward": result.reward, "done": result.done}

    async def _recover(self) -> None:
        """Start a server this environment started again if it has exited (once for every row that noticed)."""
        server = self._server
        if server is None:
            return
        if self._restart_lock is None:
            self._restart_lock = asyncio.Lock()
        # every row takes the lock, so a row that failed while another restarts the server waits until it answers
        async with self._restart_lock:
            if server.exit_code() is None or server.restarts >= self.options.max_restarts:
                return
            why = server.why_dead()
            server.restarts += 1
            server.start()
            warnings.warn(
                f"openenv: the OpenEnv server {server.label} {why}; started it again "
                f"({server.restarts} of max_restarts={self.options.max_restarts})",
                OpenEnvWarning,
                stacklevel=2,
            )
            o = self.options
            with contextlib.suppress(OpenEnvUnreachable):  # still down: the rows' tries say so
                await asyncio.to_thread(
                    _wait_healthy, self.url, server, timeout_s=o.timeout_s, tries=1, deadline_s=o.start_timeout_s
                )


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    return json.dumps(value, sort_keys=True, default=str)


async def _drop(client: Any) -> None:
    """Close a session without waiting on a server that no longer answers."""
    if client is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 1.0)


async def _drop_all(clients: list[Any]) -> None:
    await asyncio.gather(*(_drop(c) for c in clients))
    clients[:] = [None] * len(clients)


def _shut_down(loop: _Loop, clients: list[Any], server: _Server | None) -> None:
    """Close the sessions, the loop and a server the environment started (the finalizer: it must not hold the
    environment, or it would never be collected)."""
    if threading.current_thread() is not loop.thread:  # (the loop's own thread cannot wait on the loop)
        with contextlib.suppress(Exception):  # a loop already gone at interpreter exit: nothing left to close
            loop.run(_drop_all(clients), timeout=5)
    loop.close()
    if server is not None:
        server.stop()


# ---- the reward ---------------------------------------------------------------------------------------------
@dataclass
class EnvRewardOptions:
    key: str = KEY  # the metadata entry holding the environment's reward (a dict with "reward")
    skipped: float = 0.0  # the score of an episode the environment skipped (its server failed)


class EnvReward:
    """The reward the environment itself gave the episode (``metadata[key]["reward"]``: for ``openenv``, the server's
    step rewards summed or the last one). Components: ``skipped`` and ``done`` (the environment ended the episode,
    rather than ``max_turns``), 0/1 per row."""

    def __init__(self, **options: Any) -> None:
        self.options: EnvRewardOptions = check_options(EnvRewardOptions, options, where="env_reward")

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Any:
        import torch

        from palestra.types import RewardOutput

        key = self.options.key
        scores, skipped, done = [], [], []
        for m in metadata:
            entry = m.get(key)
            if not isinstance(entry, Mapping) or "reward" not in entry:
                raise ValueError(
                    f"the row's metadata has no {key!r} entry with a reward: env_reward scores episodes of an "
                    "environment that reports its own reward (openenv)"
                )
            skip = bool(entry.get("skipped"))
            scores.append(self.options.skipped if skip else float(entry["reward"]))
            skipped.append(float(skip))
            done.append(float(bool(entry.get("done"))))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
        return RewardOutput(as_tensor(scores), {"skipped": as_tensor(skipped), "done": as_tensor(done)})


@hookimpl
def register_environments(register: Any) -> None:
    register(
        "openenv",
        Requires(OpenEnvEnvironment, module="openenv", install=INSTALL_HINT),
        options=OpenEnvOptions,
        description=f"an OpenEnv environment server (url, command or package), one session per row ({INSTALL_HINT})",
    )


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "env_reward",
        EnvReward,
        options=EnvRewardOptions,
        description="the reward the environment gave the episode (openenv: the server's rewards, summed or last)",
    )
