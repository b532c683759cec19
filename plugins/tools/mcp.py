"""The ``mcp`` tool source: the tools of any MCP server, reached over stdio (the ``palestra[mcp]`` extra).

The factory starts the server (``command``), lists its tools and returns one :class:`palestra.tools.Tool` per tool
(its name with ``prefix`` before it, its description, its ``inputSchema`` as the parameters). Calling one sends a
``tools/call`` to the server and returns the result's text (the text parts joined by newlines; the structured
content as JSON when there is no text). A result the server marks as an error raises :class:`McpToolError` with its
text, so the tool loop reports it to the model like any tool that raises.

The ``mcp`` client is asyncio: one event loop runs in a daemon thread and owns the session; a call submits a
coroutine to it and waits ``timeout_s`` (past it, the request is cancelled and the call raises ``TimeoutError``;
the next call works as before). The server gets a minimal environment (``PATH``, ``HOME``, the locale; the mcp
client adds ``LOGNAME``, ``SHELL``, ``TERM`` and ``USER``) plus ``env``: never the trainer's secrets. Its stderr
goes to a temporary file, whose last line the errors quote. A server that exits mid-episode makes that call raise
:class:`McpServerError` ("... exited ..."); the next call starts it again, once per server: after a second exit
every call says it exited. The server is shut down at interpreter exit (``atexit``), or earlier by calling
``close()`` on any of its tools' ``fn``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shlex
import tempfile
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin TimeoutError before Python 3.11
from dataclasses import dataclass
from typing import Any

from palestra import hookimpl
from palestra.config import OptionError, check_options, option
from palestra.registry import Requires
from palestra.tools import Tool

INSTALL_HINT = 'pip install "palestra[mcp]"'
# The trainer's variables a server gets without being asked: enough to find programs and read text, nothing secret.
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
# A tool's own timeout is this much longer than the server call's, so the call's own message (and its cancelling
# the request on the server) comes first.
LOOP_SLACK_S = 2.0
STOP_TIMEOUT_S = 10.0  # the mcp client's own shutdown waits 2 s for an exit, then terminates, then kills
RESTARTS = 1  # a server that exits is started again this many times, then every call says it exited


class McpServerError(RuntimeError):
    """The MCP server failed to start, or exited. One line naming its command."""

    palestra_user_error = True


class McpToolError(RuntimeError):
    """The server answered a call with an error result; the message is its text."""


@dataclass
class McpOptions:
    # The server's command line, and extra environment for it alone. Both run code (a command, LD_PRELOAD): a
    # config read back from a checkpoint uses them only when the user passes them again (palestra.config.untrusted).
    # (RUF009: option() returns a dataclasses.field, so the default is not shared.)
    command: list[str] = option(default_factory=list, runs_code=True)  # noqa: RUF009
    env: dict[str, str] = option(default_factory=dict, runs_code=True)  # noqa: RUF009
    startup_timeout_s: float = option(20.0, gt=0)  # to start, initialize and list the tools
    timeout_s: float = option(30.0, gt=0)  # per call
    tools: list[str] | None = None  # only these of the server's tools (their names on the server); None: all
    prefix: str = ""  # put before each tool's name (two servers offering the same name)

    def __post_init__(self) -> None:
        if not self.command or not all(isinstance(a, str) and a for a in self.command):
            raise OptionError(
                "command",
                f"must be the server's command line as a list, e.g. ['python', 'server.py'], got {self.command!r}",
            )
        bad = [k for k, v in self.env.items() if not (isinstance(k, str) and k and "=" not in k and isinstance(v, str))]
        if bad:
            raise OptionError("env", f"names variables as strings without '=' and gives string values; got {bad[0]!r}")
        if self.tools is not None and not all(isinstance(t, str) and t for t in self.tools):
            raise OptionError("tools", f"must be a list of the server's tool names, got {self.tools!r}")


def server_env(extra: Mapping[str, str]) -> dict[str, str]:
    """What the server's process sees: the few variables of :data:`PASSED_ENV` the trainer has, then ``extra``."""
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env.update(extra)
    return env


class _Connection:
    """One running server and its session, owned by a task of an event loop in a daemon thread."""

    def __init__(self, options: McpOptions, label: str) -> None:
        self.options, self.label = options, label
        self.stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # noqa: SIM115 - kept open
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"mcp {label}", daemon=True)
        self.thread.start()
        self.session: Any = None
        self.closed = False  # the session ended: the server exited or we stopped it
        self._stop: asyncio.Event | None = None
        self._owner: Future[None] | None = None
        self._done = threading.Event()  # the owning task has finished: the server is stopped and reaped

    def start(self) -> list[dict[str, Any]]:
        """Start the server and list its tools (as JSON dicts); :class:`McpServerError` when it cannot."""
        ready: Future[list[dict[str, Any]]] = Future()
        self._owner = asyncio.run_coroutine_threadsafe(self._own(ready), self.loop)
        try:
            return ready.result(timeout=self.options.startup_timeout_s)
        except FutureTimeout:
            self.close()
            raise McpServerError(
                f"MCP server {self.label} did not answer within startup_timeout_s={self.options.startup_timeout_s:g} s"
                f"{self._said()}"
            ) from None
        except Exception as e:  # noqa: BLE001 - spawning (OSError), the handshake, a server that exits at once
            self.close()
            raise McpServerError(f"MCP server {self.label} failed to start: {_reason(e)}{self._said()}") from None

    async def _own(self, ready: Future[list[dict[str, Any]]]) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        command, *args = self.options.command
        params = StdioServerParameters(command=command, args=args, env=server_env(self.options.env))
        self._stop = asyncio.Event()
        try:
            async with stdio_client(params, errlog=self.stderr) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                tools = await _list_tools(session)
                self.session = session
                ready.set_result(tools)
                await self._stop.wait()  # until close(): the session stays open for the calls
        except Exception as e:  # noqa: BLE001 - handed to start(), which names the command
            if not ready.done():
                ready.set_exception(e)
        except BaseException:  # cancelled by close() while starting: start() has given up already
            if not ready.done():
                ready.set_exception(RuntimeError("cancelled while starting"))
            raise
        finally:
            self.closed = True
            self._done.set()

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """The server's result for ``tools/call`` of ``name`` (a pydantic model), within ``timeout_s``."""
        future = asyncio.run_coroutine_threadsafe(self.session.call_tool(name, arguments), self.loop)
        try:
            return future.result(timeout=self.options.timeout_s)
        except FutureTimeout:
            future.cancel()  # the request is cancelled on the server too; the session stays usable
            raise TimeoutError(
                f"MCP tool {name!r} on server {self.label} gave no answer within timeout_s={self.options.timeout_s:g} s"
            ) from None

    def close(self) -> None:
        """Stop the server (the mcp client closes its stdin, then terminates it) and the loop; idempotent."""
        if self._owner is not None and not self._done.is_set():
            if self.session is not None and self._stop is not None:
                self.loop.call_soon_threadsafe(self._stop.set)  # the session ends as it should
            else:
                self._owner.cancel()  # still starting (a server that never answers): abandon the handshake
            self._done.wait(timeout=STOP_TIMEOUT_S)  # the mcp client's shutdown is shielded from the cancel
        self.closed = True
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=STOP_TIMEOUT_S)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()

    def _said(self) -> str:
        """``; it said: <its last stderr line>``, or nothing when it said nothing."""
        try:
            self.stderr.flush()
            self.stderr.seek(0)
            lines = [line.strip() for line in self.stderr.read().splitlines() if line.strip()]
        except (OSError, ValueError):
            return ""
        return f"; it said: {lines[-1][:200]}" if lines else ""


async def _list_tools(session: Any) -> list[dict[str, Any]]:
    """Every tool the server offers, following its pagination, as JSON (camelCase keys in mcp 1 and 2 alike)."""
    from mcp import types

    result = await session.list_tools()
    tools = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in result.tools]
    cursor = getattr(result, "next_cursor", None) or getattr(result, "nextCursor", None)
    while cursor:
        result = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
        tools += [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in result.tools]
        cursor = getattr(result, "next_cursor", None) or getattr(result, "nextCursor", None)
    return tools


def _reason(e: BaseException) -> str:
    """One line for an exception, unwrapping the exception groups anyio raises around the real error."""
    inner = getattr(e, "exceptions", None)  # an exception group (a builtin from Python 3.11, a backport before)
    while isinstance(inner, tuple) and len(inner) == 1 and isinstance(inner[0], BaseException):
        e = inner[0]
        inner = getattr(e, "exceptions", None)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def result_text(result: Mapping[str, Any]) -> str:
    """A ``tools/call`` result (JSON, camelCase) as text: its text parts joined, else its structured content as
    JSON; a part that is not text (an image, a resource without text) is named by its type."""
    parts = []
    for block in result.get("content") or []:
        if block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif isinstance(block.get("resource"), Mapping) and "text" in block["resource"]:
            parts.append(block["resource"]["text"])
        else:
            parts.append(f"[{block.get('type', 'content')} {block.get('mimeType', '')}]".replace(" ]", "]"))
    if parts:
        return "\n".join(parts)
    structured = result.get("structuredContent")
    return json.dumps(structured, ensure_ascii=False) if structured is not None else ""


class McpServer:
    """A server's connection, started again once when it exits (:data:`RESTARTS`); what its tools' ``fn`` call."""

    def __init__(self, options: McpOptions) -> None:
        self.options = options
        self.label = shlex.join(options.command)
        self.restarts_left = RESTARTS
        self.stopped = False  # close() was called: no call starts the server again
        self.connection = _Connection(options, self.label)
        self.tools = self.connection.start()
        self._lock = threading.Lock()  # one restart at a time, however many threads call
        atexit.register(self.close)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        connection = self._live_connection()
        try:
            result = connection.call(name, arguments)
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - a closed connection, whatever the mcp version calls it
            if connection.closed or not connection.thread.is_alive() or _connection_lost(e):
                connection.closed = True
                raise McpServerError(
                    f"MCP server {self.label} exited during the call to {name!r}{connection._said()}"
                ) from None
            raise McpServerError(f"MCP server {self.label}: the call to {name!r} failed: {_reason(e)}") from None
        data = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        if data.get("isError"):
            raise McpToolError(" ".join(result_text(data).split()) or f"the tool {name!r} failed")
        return result_text(data)

    def _live_connection(self) -> _Connection:
        with self._lock:
            connection = self.connection
            if not connection.closed:
                return connection
            if self.stopped:
                raise McpServerError(f"MCP server {self.label} was closed (its tools' close() was called)")
            if self.restarts_left <= 0:
                raise McpServerError(
                    f"MCP server {self.label} exited and was already restarted once{connection._said()}"
                )
            self.restarts_left -= 1
            connection.close()
            self.connection = _Connection(self.options, self.label)
            self.connection.start()  # McpServerError (one line) when it fails to start again
            return self.connection

    def close(self) -> None:
        self.stopped = True
        self.connection.close()
        atexit.unregister(self.close)


def _connection_lost(e: BaseException) -> bool:
    """The session ended under a call: the mcp client says "Connection closed" (mcp 1 and 2), anyio raises its
    closed or broken stream errors."""
    return "connection closed" in str(e).lower() or type(e).__name__ in ("ClosedResourceError", "BrokenResourceError")


class McpCall:
    """A tool's ``fn``: calls ``name`` on ``server`` with the model's arguments; ``close()`` stops the server."""

    def __init__(self, server: McpServer, name: str) -> None:
        self.server, self.name = server, name

    def __call__(self, **arguments: Any) -> str:
        return self.server.call(self.name, arguments)

    def close(self) -> None:
        self.server.close()


def build_mcp_tools(**options: Any) -> list[Tool]:
    """Start the server, list its tools and return them as palestra tools (``tools`` picks, ``prefix`` renames)."""
    opts: McpOptions = check_options(McpOptions, options, where="mcp")
    server = McpServer(opts)
    offered = {t["name"]: t for t in server.tools}
    wanted = list(offered) if opts.tools is None else opts.tools
    missing = [name for name in wanted if name not in offered]
    if missing:
        server.close()
        raise McpServerError(
            f"MCP server {server.label} offers no tool {missing[0]!r}; it offers: {', '.join(offered) or 'none'}"
        )
    try:
        return [
            Tool(
                name=opts.prefix + name,
                description=offered[name].get("description", ""),
                parameters=offered[name].get("inputSchema") or {"type": "object", "properties": {}},
                fn=McpCall(server, name),
                timeout_s=opts.timeout_s + LOOP_SLACK_S,
            )
            for name in wanted
        ]
    except Exception:
        server.close()
        raise


@hookimpl
def register_tools(register: Any) -> None:
    register(
        "mcp",
        Requires(build_mcp_tools, module="mcp", install=INSTALL_HINT),
        options=McpOptions,
        description="the tools of an MCP server, started over stdio from its command line",
    )
