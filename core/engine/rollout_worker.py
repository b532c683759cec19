"""Asynchronous rollouts: a generation worker process that samples ``train.async.lag`` steps ahead of the learner.

The schedule is fixed, not "whatever arrived": step ``t`` trains on the batch sampled with the weights of version
``max(0, t - lag)`` (version ``v``: the weights after ``v`` steps), so a seed gives the same run every time. While
the learner updates on batch ``t``, the worker samples batch ``t + lag`` with version ``t``, published at the end of
step ``t - 1``.

Weights travel through shared memory, never through a file: a :class:`WeightRing` of ``lag + 1`` slots holds the
trainable tensors (a LoRA run's adapters, every weight otherwise) of the newest ``lag + 1`` versions, version ``v`` in
slot ``v % (lag + 1)``. The learner overwrites a slot only once the batch that was sampled from it has arrived, so the
two processes need no lock: the pipe's order is the synchronisation. The frozen rest (a LoRA base) goes once, when
the worker starts.

A checkpoint at step ``s`` keeps versions ``s - lag .. s - 1`` (:meth:`RolloutWorker.versions_state`): a resumed run
publishes them again and regenerates the batches that were in flight from their seeds, so it continues bitwise.

The worker is part of the run's fault story: it ignores the terminal's signals (the learner stops at a step boundary,
saves, and then ends it), dies with the learner (``PR_SET_PDEATHSIG`` and a parent check), and when it dies or fails
the learner says so in one line (:class:`RolloutWorkerError`) and saves; a worker that hangs leaves the learner
waiting in the watchdog phase ``rollout worker (pid N)``, which ``train.step_timeout_s`` names.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from palestra.errors import ConfigError
from palestra.types import Stateful

if TYPE_CHECKING:
    from palestra.config import Config
    from palestra.engine.rollout import Rollout, RolloutRecipe
    from palestra.scale.distributed import DistributedContext

__all__ = ["Delivered", "Request", "RolloutWorker", "RolloutWorkerError", "WeightRing", "check_async"]

_POLL_S = 0.2  # how often a waiting side checks that the other is still alive


class RolloutWorkerError(RuntimeError):
    """The rollout worker died, failed or did not start: one line, naming it and the step."""

    palestra_user_error = True


def check_async(config: Config, env: Any, dist: DistributedContext) -> None:
    """What ``train.async`` cannot run with, found once the run is built (the config's own conflicts are
    :func:`palestra.config.building.check_async_section`'s), refused in one line with the reason."""
    if dist.fsdp:
        raise ConfigError(
            "train.async: distributed.strategy=fsdp shards the weights that the rollout worker needs whole; use ddp"
        )
    if isinstance(env, Stateful):
        raise ConfigError(
            f"train.async: environment {config.environment.name!r} keeps state across steps (state_dict): in the "
            "worker it would run train.async.lag steps ahead of the learner's checkpoints; set train.async=null"
        )


# ---- weights in shared memory ----------------------------------------------------------------------------
class WeightRing:
    """The trainable weights of the newest ``slots`` versions, in shared memory (see the module docstring)."""

    def __init__(self, like: Mapping[str, torch.Tensor], slots: int) -> None:
        self.slots = [
            {name: torch.empty(t.shape, dtype=t.dtype).share_memory_() for name, t in like.items()}
            for _ in range(slots)
        ]
        self.versions = torch.full((slots,), -1, dtype=torch.int64).share_memory_()  # the version each slot holds

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy ``weights`` into version ``version``'s slot."""
        i = version % len(self.slots)
        with torch.no_grad():
            for name, t in self.slots[i].items():
                t.copy_(weights[name].detach())
        self.versions[i] = version

    def read(self, version: int) -> dict[str, torch.Tensor]:
        """Version ``version``'s tensors (the shared slot itself: copy what must outlive the next publish)."""
        i = version % len(self.slots)
        held = int(self.versions[i])
        if held != version:
            raise RolloutWorkerError(f"rollout worker: weights of version {version} wanted, the ring holds {held}")
        return self.slots[i]


def trainable(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights an update changes (a LoRA policy's adapters; every weight otherwise), by name."""
    return {name: p for name, p in policy.named_parameters() if p.requires_grad}


# ---- messages ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """Sample step ``step``'s batch (``refill``: its n-th extra rollout) with the weights of ``version``."""

    step: int
    refill: int
    version: int
    task_seed: int
    sampling_seed: int

    @property
    def what(self) -> str:
        """What this request asks for, as an error message says it: "step 3's batch", "step 3's refill 1"."""
        return _what(self.step, self.refill)


def _what(step: int, refill: int) -> str:
    return f"step {step + 1}'s " + (f"refill {refill}" if refill else "batch")


@dataclass
class Delivered:
    """A sampled batch: its rollout, the version it was sampled with, the worker's sampling time and how long the
    worker had waited for this request."""

    rollout: Rollout
    version: int
    generate_s: float
    waited_s: float


def _send(conn: Connection, message: Any) -> None:
    # Our own child's messages, pickled by us: the pipe carries nothing a user wrote to disk.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())  # the other end is this run's own process


# ---- the learner's side --------------------------------------------------------------------------------
class RolloutWorker:
    """The learner's handle on its generation worker: starts it, publishes weights, requests and receives batches.

    ``policy``: the learner's policy; its weights now are version ``version``. ``earlier``: the weights of the
    versions before it that batches still to come were sampled with (a resumed run's, from its checkpoint).
    """

    def __init__(
        self,
        config: Config,
        *,
        policy: torch.nn.Module,
        version: int,
        earlier: Mapping[int, Mapping[str, torch.Tensor]],
        recipe: RolloutRecipe,
        device: torch.device,
    ) -> None:
        section = config.train.async_
        assert section is not None and section.lag >= 1
        self.lag = section.lag
        names = trainable(policy)
        self.ring = WeightRing(names, self.lag + 1)
        for v, weights in sorted(earlier.items()):
            self.ring.publish(v, weights)
        self.ring.publish(version, names)
        self._trainable = names
        # The frozen rest and the starting point, once; the worker copies it into its own model and lets it go.
        start = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in policy.state_dict().items()}
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads (OpenMP, the watchdog)
        here, there = ctx.Pipe()
        job = _Job(config, recipe, str(device), section.threads, os.getpid())
        self.process = ctx.Process(
            target=_serve, args=(job, start, self.ring, there), name="palestra-rollout-worker", daemon=False
        )
        self.process.start()
        there.close()
        self.conn = here
        self._arrived: dict[tuple[int, int], Delivered] = {}
        try:
            self._expect("ready", section.start_timeout_s, "while it started")
        except BaseException:
            self.close()  # one that never got ready (a model that would not load, a timeout) must not linger
            raise

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    @property
    def phase(self) -> str:
        """The watchdog phase the learner waits in."""
        return f"rollout worker (pid {self.pid})"

    def version_for(self, step: int) -> int:
        """The weights step ``step``'s batch is sampled with."""
        return max(0, step - self.lag)

    def publish(self, version: int) -> None:
        """The learner's weights now are version ``version``: into its slot (whose batch has arrived)."""
        self.ring.publish(version, self._trainable)

    def request(self, step: int, refill: int, task_seed: int, sampling_seed: int) -> None:
        request = Request(step, refill, self.version_for(step), task_seed, sampling_seed)
        try:
            _send(self.conn, request)
        except OSError:  # the worker has ended (it failed on an earlier request): its last message says why
            asked = f"before {request.what} was asked"
            while (message := self._next(asked, wait_s=5.0)) is not None:  # raises at its error or its exit
                if message[0] == "rollout":
                    self._arrived[(message[1], message[2])] = message[3]
            raise RolloutWorkerError(f"rollout worker (pid {self.pid}) closed its pipe {asked}") from None

    def receive(self, step: int, refill: int = 0) -> Delivered:
        """Step ``step``'s batch (its ``refill``-th extra rollout), waiting for it."""
        key = (step, refill)
        while key not in self._arrived:
            message = self._next(f"while it sampled {_what(step, refill)}")
            if message[0] != "rollout":
                raise RolloutWorkerError(f"rollout worker (pid {self.pid}): unexpected message {message[0]!r}")
            _, got_step, got_refill, delivered = message
            self._arrived[(got_step, got_refill)] = delivered
        return self._arrived.pop(key)

    def versions_state(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        """What a checkpoint at step ``step`` keeps: versions ``step - lag .. step - 1`` (copies)."""
        return {
            str(v): {k: t.clone() for k, t in self.ring.read(v).items()} for v in range(max(0, step - self.lag), step)
        }

    def close(self) -> None:
        """End the worker: ask, and kill one still sampling after a moment (it reads requests only between
        batches, ignores SIGTERM, and writes nothing anyone reads afterwards)."""
        with contextlib.suppress(OSError, ValueError):
            _send(self.conn, None)
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        with contextlib.suppress(OSError):
            self.conn.close()

    def _expect(self, kind: str, timeout_s: float, doing: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() > deadline:
                raise RolloutWorkerError(
                    f"rollout worker (pid {self.pid}) did not start within train.async.start_timeout_s={timeout_s:g}"
                )
            message = self._next(doing, wait_s=_POLL_S * 5)
            if message is not None and message[0] == kind:
                return message

    def _next(self, doing: str, wait_s: float | None = None) -> Any:
        """The worker's next message; raises when it fails or dies. ``wait_s``: give up after that (None: never)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            if self.conn.poll(_POLL_S):
                try:
                    message = _receive(self.conn)
                except (EOFError, OSError):
                    message = None
                if message is not None and message[0] == "error":  # it says what it was doing
                    raise RolloutWorkerError(f"rollout worker (pid {self.pid}) failed {message[2]}: {message[1]}")
                if message is not None:
                    return message
            if not self.process.is_alive():
                self.process.join(timeout=1)
                raise RolloutWorkerError(
                    f"rollout worker (pid {self.pid}) died {doing} ({_exit_text(self.process.exitcode)})"
                )
            if deadline is not None and time.monotonic() > deadline:
                return None


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


# ---- the worker's side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Job:
    """What the worker needs besides the weights: the run's config and its sampling settings."""

    config: Config
    recipe: RolloutRecipe
    device: str
    threads: int
    parent: int


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the learner dies, however it dies (best effort elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve(job: _Job, start: Mapping[str, torch.Tensor], ring: WeightRing, conn: Connection) -> None:
    """The worker process: build the sampling side, then answer requests in order until told to stop."""
    # The learner owns the run's end: it stops at a step boundary on these signals, saves, then ends the worker.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent()
    doing = "while it started"
    try:
        torch.set_num_threads(job.threads)
        sampler = _WorkerSampler(job, start)
        del start
        _send(conn, ("ready", os.getpid()))
        for request, waited in _requests(conn, job.parent):
            doing = f"while it sampled {request.what}"
            delivered = sampler.sample(request, ring, waited)
            _send(conn, ("rollout", request.step, request.refill, delivered))
    except BaseException as e:  # noqa: BLE001 - whatever it is, the learner says it in one line (and the step)
        with contextlib.suppress(OSError, ValueError):
            _send(conn, ("error", f"{type(e).__name__}: {e}".splitlines()[0][:500], doing))
        os._exit(1)


def _requests(conn: Connection, parent: int) -> Iterator[tuple[Request, float]]:
    """The learner's requests, each with how long the worker waited for it; ends at the learner's ``None`` or death."""
    idle = time.perf_counter()
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:  # the learner is gone (no PR_SET_PDEATHSIG here): nothing to sample for
                return
            continue
        request = _receive(conn)
        if request is None:
            return
        waited = time.perf_counter() - idle
        yield request, waited
        idle = time.perf_counter()


class _WorkerSampler:
    """The worker's copy of the run's sampling side, with the learner's weights loaded version by version."""

    def __init__(self, job: _Job, start: Mapping[str, torch.Tensor]) -> None:
        from palestra.config.building import build_sampling_side
        from palestra.context import TrainContext
        from palestra.engine.checked_environment import CheckedEnvironment
        from palestra.engine.watchdog import StepWatchdog

        config = job.config
        self.job, self.device = job, torch.device(job.device)
        env, self.generator, self.policy = build_sampling_side(config, self.device)
        self.policy.load_state_dict(start)
        self.policy.eval().requires_grad_(False)
        self.weights = dict(self.policy.named_parameters())
        # data calls timed as in the learner; a hang shows as the learner's wait (its watchdog names the worker)
        self.env = CheckedEnvironment(
            env, name=config.environment.name, timeout_s=config.train.data_timeout_s, watchdog=StepWatchdog(None)
        )
        self.context = TrainContext(train=config.train, device=self.device, precision=config.train.precision)
        self.loaded = -1

    def sample(self, request: Request, ring: WeightRing, waited: float) -> Delivered:
        if request.version != self.loaded:
            with torch.no_grad():
                for name, t in ring.read(request.version).items():
                    self.weights[name].copy_(t)
            self.loaded = request.version
        gen = torch.Generator(device=self.device).manual_seed(request.sampling_seed)
        started = time.perf_counter()
        with torch.no_grad(), self.context.autocast():
            ro = self.job.recipe.collect(self.env, self.policy, self.generator, seed=request.task_seed, rng=gen)
        return Delivered(ro, request.version, time.perf_counter() - started, waited)
