"""Hang detection: a step watchdog that dumps every thread's stack and exits, and timeouts around data calls.

A training process that hangs (a stuck collective after a rank died, a deadlocked data worker, a reward
server that never answers) burns accelerator hours and says nothing. :class:`StepWatchdog` turns a hang into
a fast, diagnosable failure: the trainer wraps each phase of a step in ``watchdog.phase(name)``; a daemon
monitor thread checks how long the current phase has run and, past ``train.step_timeout_s``, prints one line
naming the phase and the step, dumps the stack of every thread with :mod:`faulthandler` (the stuck frame is
visible there) and ends the process with ``os._exit(exit_code)``.

``os._exit`` rather than an exception on purpose: the hung thread is usually inside C code (a collective, a
socket read, a lock) where no Python exception can reach it, and a normal exit would wait for it forever.
Under torchrun the other ranks then see the dead rank and fail their own collectives (or their own watchdog
fires), so the whole job ends within the timeout instead of hanging.

:func:`call_with_timeout` bounds one call (an environment ``reset``/``step``, ``train.data_timeout_s``): it
runs the call in a daemon worker thread and raises :class:`DataTimeout` in the caller when it takes too long.
Python cannot kill a thread, so the stuck call keeps running in the background; the caller fails with a clear
error, and if the call never returns the process still exits normally (the worker is a daemon) or, while a
watchdog phase is open, the watchdog ends it.

:class:`StopSignals` is the polite end: SIGINT (Ctrl-C), SIGTERM (a scheduler, a spot pre-emption) and SIGHUP (a
closed terminal, a dropped ssh session) become a request that the trainer honours at the next step boundary, by
saving a checkpoint and raising :class:`Interrupted` (exit status 128 + the signal: 130, 143, 129).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

__all__ = ["DataTimeout", "Interrupted", "StepWatchdog", "StopSignals", "call_with_timeout"]

T = TypeVar("T")

PHASES = ("rollout", "reward", "update", "data", "checkpoint", "eval")


class DataTimeout(TimeoutError):
    """One data call (an environment reset or step) ran past ``train.data_timeout_s``; the message is one line."""

    palestra_user_error = True


class StepWatchdog:
    """Exit the process with every thread's stack when one phase of a training step runs past ``timeout_s``.

    ``timeout_s=None`` disables it: no thread is started and :meth:`phase` only records the name. Phases do not
    nest in a meaningful way: the innermost open phase is the one reported, and leaving it restores the outer
    one (its clock restarts, so a long step made of several short phases never fires).
    """

    def __init__(self, timeout_s: float | None, *, exit_code: int = 70, stream: IO[str] | None = None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"train.step_timeout_s: must be > 0 or None, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self.stream = stream if stream is not None else sys.stderr
        self.step = 0
        self._lock = threading.Lock()
        self._phases: list[str] = []
        self._since: float | None = None  # when the current phase started (or last beat); None: nothing open
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> StepWatchdog:
        """Start the monitor thread (a no-op when disabled or already running)."""
        if self.timeout_s is None or self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._monitor, name="palestra-step-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the monitor thread; open phases are forgotten."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self._lock:
            self._phases.clear()
            self._since = None

    def __enter__(self) -> StepWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what the trainer tells it ---------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        self.step = int(step)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (rollout, reward, update, data, checkpoint, eval)."""
        with self._lock:
            self._phases.append(name)
            self._since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                if self._phases and self._phases[-1] == name:
                    self._phases.pop()
                elif name in self._phases:
                    self._phases.remove(name)
                self._since = time.monotonic() if self._phases else None

    def beat(self) -> None:
        """Progress inside a long phase (a generation step, a micro-batch): restart the current phase's clock."""
        with self._lock:
            if self._phases:
                self._since = time.monotonic()

    @property
    def current_phase(self) -> str | None:
        with self._lock:
            return self._phases[-1] if self._phases else None

    # ---- the monitor -----------------------------------------------------------------------------------
    def _monitor(self) -> None:
        assert self.timeout_s is not None
        period = min(1.0, max(0.01, self.timeout_s / 10))
        while not self._stop.wait(period):
            with self._lock:
                since, name = self._since, (self._phases[-1] if self._phases else None)
            if since is None or name is None:
                continue
            elapsed = time.monotonic() - since
            if elapsed > self.timeout_s:
                self._fire(name, elapsed)

    def _fire(self, name: str, elapsed: float) -> None:
        """Report and end the process; never returns."""
        try:
            self.stream.write(
                f"palestra: step watchdog: phase '{name}' of step {self.step} has run {elapsed:.1f} s "
                f"(> train.step_timeout_s={self.timeout_s:g}); stacks follow\n"
            )
            self.stream.flush()
            faulthandler.dump_traceback(file=self.stream, all_threads=True)
            self.stream.flush()
        except Exception:  # noqa: BLE001 - a closed or odd stream must not stop the exit
            with contextlib.suppress(Exception):
                if sys.__stderr__ is not None:  # None under pythonw and some embedders: nowhere to write
                    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        finally:
            os._exit(self.exit_code)


def call_with_timeout(fn: Callable[[], T], timeout_s: float | None, what: str) -> T:
    """``fn()``, or :class:`DataTimeout` if it has not returned after ``timeout_s`` seconds (``None``: no limit).

    The call runs in a daemon worker thread so that the caller can give up on it; the worker cannot be
    killed and finishes (or hangs) in the background. Exceptions from ``fn`` are re-raised in the caller.
    Thread-local state (torch's grad mode, autocast) is the worker's own: meant for data calls, not model code.
    """
    if timeout_s is None:
        return fn()
    done = threading.Event()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller, traceback included
            box["error"] = e
        finally:
            done.set()

    worker = threading.Thread(target=work, name=f"palestra-data:{what}", daemon=True)
    worker.start()
    if not done.wait(timeout_s):
        raise DataTimeout(f"{what} did not return within {timeout_s:g} s (train.data_timeout_s={timeout_s:g})")
    # Wait for the worker to be gone, not just done: a daemon thread still winding down when the interpreter
    # exits is ended with pthread_exit, which aborts the process ("terminate called without an active
    # exception") if it is inside C++ at that moment.
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


# ---- stopping on a signal ----------------------------------------------------------------------------------
class Interrupted(BaseException):
    """The run stopped on SIGINT, SIGTERM or SIGHUP; the process should exit with :attr:`exit_code` (128 + the
    signal).

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` in a component (a reward wrapper that
    reports a plugin's errors) turns it into something else. :meth:`line` is what the command prints.
    """

    def __init__(
        self,
        signum: int,
        *,
        saved_step: int | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        at_once: bool = False,
    ) -> None:
        super().__init__(signum)
        self.signum, self.saved_step, self.run_dir, self.at_once = signum, saved_step, run_dir, at_once

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        name = signal.Signals(self.signum).name
        resume = f"resume with palestra train --resume {self.run_dir}"
        if not self.at_once:
            return f"stopped by {name}: saved step {self.saved_step}; {resume}"
        if self.saved_step is None:
            return f"stopped at once by a second {name}: no checkpoint was saved"
        return f"stopped at once by a second {name}: nothing saved after step {self.saved_step}; {resume}"

    def __str__(self) -> str:
        return self.line()


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP as a request to stop at the next step boundary; a context manager that installs
    the handlers.

    The first signal only sets :attr:`received` (a handler may run anywhere in the main thread, in the middle of a
    step or a checkpoint write, so it does nothing else); the trainer checks it between steps, saves and raises
    :class:`Interrupted`. A second signal raises :class:`Interrupted` at once (``at_once``): whoever sent it wants the
    process gone now. While :attr:`immediate` is set (``palestra train`` starting up: nothing to save yet, and
    building the models may take minutes) the first signal raises at once too. Handlers can only be installed from
    the main thread; elsewhere this does nothing. A signal the process was started ignoring (SIG_IGN: a background
    job, nohup) stays ignored.

    Blocks nest: ``palestra train`` holds the handlers for the whole command (start-up, training, and the last phase
    that writes the table, the dashboard and the export), and the trainer's own block inside it changes nothing, so
    a signal in any phase is seen by whoever checks :attr:`received` last.
    """

    # SIGHUP too: a closed terminal or a dropped ssh session is a request to stop, not a reason to lose the steps
    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: int | None = None
        self.immediate = False
        self._previous: dict[int, Any] = {}
        self._depth = 0

    def __enter__(self) -> StopSignals:
        self._depth += 1
        if self._depth > 1:  # an outer block installed them: a signal it saw must not be forgotten
            return self
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:
                continue
            self._previous[sig] = previous if previous is not None else signal.SIG_DFL
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if not first or self.immediate:
            raise Interrupted(signum, at_once=True)
