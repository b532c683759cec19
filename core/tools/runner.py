"""Running a model's tool calls: each call checked, run in a worker thread with the tool's timeout, and answered.

Whatever goes wrong becomes the text the model reads next (and an error kind for the metrics), never an exception
into the trainer: an unknown tool, arguments that do not fit the tool's schema, a tool that raises, a tool that runs
past ``tool.timeout_s``. ``"malformed"`` (a call the parser could not read) is the fifth kind, made by the episode.

Timeouts: a call runs in a daemon thread; past its timeout the model is told so and the thread is abandoned (Python
cannot stop a thread). It finishes in the background, or dies with the process; a tool that can hang for good
should bound its own work (the sandboxed ``python`` tool runs code in a child process it kills).

Printing: a tool's ``print`` must not flood the trainer's output, so while tools run ``sys.stdout`` and
``sys.stderr`` are replaced by a router: writes from a tool's worker thread go into that call's bounded buffer,
writes from any other thread to the real stream. What a call printed is appended to its result (the model sees
it, like a terminal), and the whole is cut to ``max_result_chars``. Only Python-level writes are routed: a tool
writing to file descriptor 1 directly (C code, a child process it does not capture) is not.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from palestra.tools.calls import ToolCall
from palestra.tools.tool import Tool

__all__ = ["ERROR_KINDS", "ToolResult", "ToolRunner", "truncate"]

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
"""Every kind of failed call: the tools/error_rate/<kind> metrics (always logged, so the keys are stable)."""


@dataclass(frozen=True)
class ToolResult:
    """One call's answer: ``content`` (what the model reads), ``error`` (one of :data:`ERROR_KINDS`, None when the
    call ran) and ``latency_s`` (wall-clock seconds, the timeout when it timed out)."""

    content: str
    error: str | None = None
    latency_s: float = 0.0


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a marker saying how many were cut (the model knows it lost some)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} more characters cut]"


class _Capture:
    """A bounded buffer of what one call printed: the first ``limit`` characters, and how many there were."""

    def __init__(self, limit: int) -> None:
        self.limit, self.kept, self.total = limit, 0, 0
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        self.total += len(text)
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))

    def text(self) -> str:
        kept = "".join(self.parts)
        return kept + (
            f"\n[... {self.total - self.kept} more printed characters cut]" if self.total > self.kept else ""
        )


_routing = threading.local()  # .capture: the _Capture of the call this thread runs (tool worker threads only)


class _RoutedStream:
    """``sys.stdout`` / ``sys.stderr`` while tools may run: a tool thread's writes go to its call's buffer, every
    other thread's to ``real`` (see the module docstring)."""

    def __init__(self, real: TextIO) -> None:
        self.real = real

    def write(self, text: str) -> int:
        capture = getattr(_routing, "capture", None)
        if capture is None:
            return self.real.write(text)
        capture.add(str(text))
        return len(text)

    def flush(self) -> None:
        if getattr(_routing, "capture", None) is None:
            self.real.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty, ...: the real stream's
        return getattr(self.real, name)


def route_tool_output() -> None:
    """Install the routers on ``sys.stdout`` and ``sys.stderr`` (again, when something replaced them since)."""
    if not isinstance(sys.stdout, _RoutedStream):
        sys.stdout = _RoutedStream(sys.stdout)
    if not isinstance(sys.stderr, _RoutedStream):
        sys.stderr = _RoutedStream(sys.stderr)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError) as e:  # a circular structure, a key json cannot take
        return f"<a result json cannot encode ({type(e).__name__}): {str(value)[:200]}>"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


class ToolRunner:
    """Runs calls to ``tools`` (by name); every answer is cut to ``max_result_chars`` (see the module docstring)."""

    def __init__(self, tools: Sequence[Tool], *, max_result_chars: int) -> None:
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            names = [t.name for t in tools]
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"ToolRunner: two tools are named {dup!r}")
        self.max_result_chars = max_result_chars

    def run(self, call: ToolCall) -> ToolResult:
        """Check and run ``call``; never raises for anything the call or the tool does."""
        tool = self.tools.get(call.name)
        if tool is None:
            listed = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(f"error: there is no tool {call.name!r}; the tools are: {listed}", "unknown_tool")
        wrong = tool.argument_error(call.arguments)
        if wrong is not None:
            return ToolResult(
                truncate(f"error: bad arguments for {call.name!r}: {wrong}", self.max_result_chars), "bad_arguments"
            )
        return self._run_in_thread(tool, call.arguments)

    def _run_in_thread(self, tool: Tool, arguments: dict[str, Any]) -> ToolResult:
        route_tool_output()
        capture = _Capture(self.max_result_chars)
        outcome: dict[str, Any] = {}

        def work() -> None:
            _routing.capture = capture
            try:
                outcome["value"] = tool.fn(**arguments)
            except BaseException as e:  # noqa: BLE001 - whatever the tool does is the model's answer, even SystemExit
                outcome["error"] = e

        start = time.perf_counter()
        worker = threading.Thread(target=work, name=f"palestra-tool-{tool.name}", daemon=True)
        worker.start()
        worker.join(tool.timeout_s)
        latency = time.perf_counter() - start
        if worker.is_alive():  # abandoned: see the module docstring
            return ToolResult(f"error: {tool.name!r} timed out after {tool.timeout_s:g} s", "timeout", latency)
        printed = capture.text()
        if "error" in outcome:
            text = f"error: {tool.name!r} raised {_first_line(outcome['error'])}"
            return ToolResult(self._with_printed(text, printed), "raised", latency)
        return ToolResult(self._with_printed(_as_text(outcome.get("value")), printed), None, latency)

    def _with_printed(self, text: str, printed: str) -> str:
        if printed:
            text = f"{text}\n[printed]\n{printed}"
        return truncate(text, self.max_result_chars)
