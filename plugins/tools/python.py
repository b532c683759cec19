"""Built-in tool ``python``: runs the code a model writes in a sandboxed child process (palestra.tools.sandbox).

The model sees stdout, then stderr if any, then one line saying what went wrong when the run was killed or failed
("killed: CPU time limit (5 s)"). The code runs under ``python -I -S``: the standard library only, no
site-packages. At start-up the tool says once (a :class:`SandboxWarning`) what isolation this OS does not give.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any

from palestra import hookimpl
from palestra.config import option
from palestra.tools import Tool
from palestra.tools.sandbox import SandboxLimits, SandboxResult, child_interpreter, run_sandboxed, sandbox_support

_DESCRIPTION = (
    "Run a Python 3 program (standard library only) and get what it prints. Each call starts a fresh process in an "
    "empty folder with no network; print the values you need."
)


class SandboxWarning(UserWarning):
    """The sandbox lacks some isolation on this OS (said once per process)."""


@dataclass
class PythonToolOptions:
    wall_s: float = option(10.0, gt=0, le=600)  # wall-clock limit of one call
    cpu_s: int = option(5, ge=1, le=600)  # CPU seconds of each process
    memory_mb: int = option(512, ge=64)  # address space of each process
    max_output_chars: int = option(4000, ge=1)  # kept of stdout, and of stderr
    max_processes: int = option(16, ge=1, le=4096)  # processes the code may run at once
    network: bool = False  # True: no network namespace (the code may use the host's network)
    disk_mb: int = option(64, ge=1)  # size of the private /tmp, and the largest file the code may write
    interpreter: str | None = None  # the child's python; None: this one, or a python3 the sandbox user may run


_warned = False
_warn_lock = threading.Lock()


def _warn_once_about_isolation() -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    missing = sandbox_support()["missing"]
    if missing:
        warnings.warn("python tool: the sandbox on this OS has " + "; ".join(missing), SandboxWarning, stacklevel=3)


def answer_text(result: SandboxResult) -> str:
    """What the model reads: stdout, then stderr, then the summary line when the run did not end cleanly."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append(result.stderr.rstrip("\n"))
    if not result.ok:
        parts.append(result.summary)
    return "\n".join(parts) if parts else "(no output)"


def python_tool(**options: Any) -> Tool:
    limits = SandboxLimits(**options)
    child_interpreter(limits)  # a Python the sandbox cannot run fails here, at start-up, not at the first call
    _warn_once_about_isolation()

    def run(code: str) -> str:
        return answer_text(run_sandboxed(code, limits))

    return Tool(
        name="python",
        description=_DESCRIPTION,
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; its printed output is returned"}},
            "required": ["code"],
        },
        fn=run,
        # The sandbox enforces wall_s itself; the loop's own timeout only backs it up (start-up and clean-up).
        timeout_s=limits.wall_s + 10.0,
    )


@hookimpl
def register_tools(register: Any) -> None:
    register(
        "python",
        python_tool,
        options=PythonToolOptions,
        description="runs the model's Python code in a sandboxed child process (rlimits, no network, temp folder)",
    )
