"""Run code a model wrote in a contained child process, never in the trainer's (the ``python`` tool; docs/tools.md).

:func:`run_sandboxed` starts ``python -I -S`` on this file (standard library only) as a small supervisor in a new
session. Where the OS allows, the supervisor enters new mount, network and PID namespaces (a non-root trainer first
enters a user namespace) and mounts private tmpfs folders (``disk_mb`` each) on the world-writable ``/tmp``,
``/var/tmp``, ``/dev/shm`` and ``/run/lock``; the working folder is ``/tmp/work`` inside (else a fresh host temp
folder). It forks the namespace's init, which mounts a private ``/proc`` and forks the model's process. That process
sets its rlimits (CPU time, address space, processes, file size, no core), drops to an unused uid of its own when
the trainer is root (RLIMIT_NPROC does not bind root; another uid cannot read the trainer's 0600 files or its
``/proc/<pid>/environ``), and execs ``python -I -S``: isolated mode and no ``site``, so only the standard library
(no site-packages, none of the trainer's packages) and a minimal PATH/HOME/LANG environment. The trainer reads
stdout and stderr as they fill, keeps at most ``max_output_chars`` of each and counts the rest, and at the
wall-clock limit kills the process group and every process of the run's uid; init's death ends the PID namespace
and everything in it. :func:`sandbox_support` says what this OS gave, so a tool can say once what it lacks.
Limits: the code can read world-readable files of the host; without a mount namespace it can write into the host's
world-writable folders; without a network namespace it has the host's network.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SandboxError", "SandboxLimits", "SandboxResult", "child_interpreter", "run_sandboxed", "sandbox_support"]

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
_PR_SET_PDEATHSIG = 1
# A block of uids no account uses: each sandbox run as root gets its own, so RLIMIT_NPROC counts only its own
# processes and two runs at once cannot signal or read each other.
_UID_BASE, _UID_SLOTS = 1_900_000_000, 1 << 20
_PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # the world-writable folders of a usual Linux
_CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"
_DISK_FULL = re.compile(r"OSError: \[Errno (27|28)\]")  # EFBIG (the file-size rlimit), ENOSPC (a full tmpfs)
# The model's program runs as main.py in its working folder, opened by a relative path: `python main.py` would make
# it absolute, which fails when a folder above is closed to the sandbox uid (a 0700 TMPDIR without a private /tmp).
_LOADER = (
    "import sys; sys.argv[:] = ['main.py']; g = {'__name__': '__main__', '__file__': 'main.py', "
    "'__builtins__': __builtins__}; del sys; exec(compile(open('main.py', 'rb').read(), 'main.py', 'exec'), g)"
)


class SandboxError(RuntimeError):
    """The sandbox cannot start at all (no interpreter the sandbox user may run, bad limits). One line."""

    palestra_user_error = True


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock limit; past it every process of the run is killed
    cpu_s: int = 5  # RLIMIT_CPU of each process (SIGXCPU, then SIGKILL one second later)
    memory_mb: int = 512  # RLIMIT_AS (address space) of each process
    max_output_chars: int = 4000  # kept of stdout, and of stderr; the rest is read and counted, not stored
    max_processes: int = 16  # RLIMIT_NPROC: processes of the run's own uid (root), or this many more (non-root)
    network: bool = False  # True keeps the host's network (no network namespace)
    disk_mb: int = 64  # size of each private tmpfs, and RLIMIT_FSIZE of one file
    interpreter: str | None = None  # the child's Python; None: this one, or a system python3 the sandbox uid may run

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_output_chars", "max_processes", "disk_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise SandboxError(f"sandbox limit {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when a signal ended the model's process (or the run timed out)
    signal: int | None  # the signal that ended it, if one did
    timed_out: bool
    summary: str  # "ok", or one line saying what went wrong ("killed: CPU time limit (5 s)")
    isolation: dict[str, bool] = field(default_factory=dict)  # what this run got (see sandbox_support)

    @property
    def ok(self) -> bool:
        return self.summary == "ok"


# ---- the trainer's side -----------------------------------------------------------------------------------------
def run_sandboxed(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temporary folder, contained by ``limits``; the folder is deleted after."""
    limits = limits or SandboxLimits()
    uid = _sandbox_uid() if os.geteuid() == 0 else None
    try:
        python = _child_interpreter(limits, uid)
    except SandboxError:
        _release_uid(uid)
        raise
    workdir = tempfile.mkdtemp(prefix="palestra-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
        return _supervise(limits, uid, python, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        _release_uid(uid)


_support: dict[str, Any] | None = None
_support_lock = threading.Lock()


def sandbox_support() -> dict[str, Any]:
    """What this OS lets the sandbox do, found once by running an empty program in it: ``user_switch`` (its own
    unprivileged uid), ``rlimit_nproc`` (a process limit that holds), ``network_namespace``, ``pid_namespace``,
    ``private_tmp``, ``private_proc``; ``missing`` lists, in words, what is not contained here."""
    global _support
    with _support_lock:
        if _support is None:
            got = run_sandboxed("", SandboxLimits(wall_s=30)).isolation
            _support = {**got, "missing": _missing(got)}
        return dict(_support)


def _missing(got: dict[str, bool]) -> list[str]:
    words = {
        "network_namespace": "no network namespace (the code can reach the network)",
        "user_switch": "no separate uid (the code runs as the trainer's user and can read its files)",
        "rlimit_nproc": "no process limit that holds (fork bombs are stopped only by the wall-clock kill)",
        "pid_namespace": "no PID namespace (the code sees the host's processes)",
        "private_tmp": "no private /tmp (the code can write into the host's world-writable folders)",
    }
    return [text for key, text in words.items() if not got.get(key)]


_uids_in_use: set[int] = set()
_uid_lock = threading.Lock()


def _sandbox_uid() -> int:
    """A uid of the block that no process runs under now (several trainer processes draw from the same block),
    and that no other run of this process holds; released by :func:`_release_uid`."""
    draw = random.SystemRandom()
    with _uid_lock:
        for _ in range(100):
            uid = _UID_BASE + draw.randrange(_UID_SLOTS)
            if uid not in _uids_in_use and _count_processes(uid) == 0:
                _uids_in_use.add(uid)
                return uid
    raise SandboxError("sandbox: found no free sandbox uid in 100 draws")


def _release_uid(uid: int | None) -> None:
    if uid is None:
        return
    with _uid_lock:
        _uids_in_use.discard(uid)


def _other_may_run(path: str) -> bool:
    """Whether a user that is neither the owner nor in the group may execute ``path`` (every folder above it
    searchable, the file readable and executable by others)."""
    try:
        real = os.path.realpath(path)
        if not os.stat(real).st_mode & stat.S_IROTH or not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        folder = os.path.dirname(real)
        while True:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
            if folder == os.path.dirname(folder):
                return True
            folder = os.path.dirname(folder)
    except OSError:
        return False


def child_interpreter(limits: SandboxLimits) -> str:
    """The Python the sandbox will run the code with (a tool checks it at start-up); SandboxError when none fits."""
    return _child_interpreter(limits, _UID_BASE if os.geteuid() == 0 else None)


def _child_interpreter(limits: SandboxLimits, uid: int | None) -> str:
    if limits.interpreter is not None:
        candidates = [limits.interpreter]
    else:
        candidates = [sys.executable, "/usr/bin/python3", shutil.which("python3") or "/usr/local/bin/python3"]
    for path in candidates:
        if os.path.isfile(path) and (uid is None or _other_may_run(path)):
            return os.path.realpath(path)
    raise SandboxError(
        f"sandbox: no Python interpreter that the sandbox user{'' if uid is None else ' (another uid)'} may run "
        f"among {', '.join(candidates)}; set the python tool's 'interpreter' option to a world-readable python3"
    )


def _child_env() -> dict[str, str]:
    return {"PATH": _CHILD_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}


def _supervise(limits: SandboxLimits, uid: int | None, python: str, workdir: str) -> SandboxResult:
    status_r, status_w = os.pipe()
    plan = {
        "uid": uid,
        "python": python,
        "status_fd": status_w,
        "limits": {
            "cpu_s": int(limits.cpu_s),
            "memory_mb": int(limits.memory_mb),
            "max_processes": int(limits.max_processes),
            "disk_mb": int(limits.disk_mb),
            "network": bool(limits.network),
        },
        "env": _child_env(),
    }
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(plan)],
            cwd=workdir,
            env={"PATH": _CHILD_PATH, "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
        )
    finally:
        os.close(status_w)
    assert proc.stdout is not None and proc.stderr is not None
    streams = {
        "out": _Capture(proc.stdout.fileno(), limits.max_output_chars),
        "err": _Capture(proc.stderr.fileno(), limits.max_output_chars),
        "status": _Capture(status_r, 1 << 16),
    }
    try:
        timed_out = _pump(proc, streams, limits.wall_s, uid)
    finally:
        _kill_all(proc, uid)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        os.close(status_r)
    return _result(limits, streams, timed_out)


class _Capture:
    """One pipe read as it fills: the first ``max_chars`` characters (at most 4 bytes each) are kept, every byte
    after is read and counted, so a child printing gigabytes neither blocks nor grows the trainer's memory."""

    def __init__(self, fd: int, max_chars: int) -> None:
        self.fd, self.max_chars = fd, max_chars
        self.kept = bytearray()
        self.total = 0
        self.open = True

    def read(self) -> None:
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            self.open = False
            return
        self.total += len(chunk)
        room = 4 * self.max_chars - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]

    def text(self) -> str:
        text = self.kept.decode("utf-8", errors="replace")
        if len(text) <= self.max_chars and self.total == len(self.kept):
            return text
        cut = self.total - len(text[: self.max_chars].encode("utf-8", errors="replace"))
        return text[: self.max_chars] + f"\n[... output truncated: {max(cut, 0)} more bytes not shown]"


def _pump(proc: subprocess.Popen[bytes], streams: dict[str, _Capture], wall_s: float, uid: int | None) -> bool:
    """Read every pipe until all close; True when the wall-clock limit came first (everything is then killed).
    Once the supervisor has exited, leftover processes holding a pipe open are killed rather than waited for."""
    deadline = time.monotonic() + wall_s
    selector = selectors.DefaultSelector()
    for capture in streams.values():
        selector.register(capture.fd, selectors.EVENT_READ, capture)
    try:
        while any(c.open for c in streams.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            for key, _ in selector.select(timeout=min(left, 0.2)):
                capture = key.data
                capture.read()
                if not capture.open:
                    selector.unregister(capture.fd)
            if proc.poll() is not None and not streams["status"].open:
                _kill_all(proc, uid)  # the model's process is done; anything it left behind goes now
        return False
    finally:
        selector.close()


def _kill_all(proc: subprocess.Popen[bytes], uid: int | None) -> None:
    """SIGKILL the run's process group and, when it has a uid of its own, every process of that uid (a process
    that left the group with setsid). A PID namespace makes this a backstop: its init's death kills the rest."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if uid is None:
        return
    # SIGKILLed processes take a moment to go (and a fork in flight can add one after a sweep): sweep until none
    # is left, so that none outlives the run, bounded in case one is stuck in the kernel.
    give_up = time.monotonic() + 5.0
    while _kill_uid(uid) and time.monotonic() < give_up:
        time.sleep(0.005)


def _kill_uid(uid: int) -> int:
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        except (FileNotFoundError, ProcessLookupError):
            continue
    return killed


def _result(limits: SandboxLimits, streams: dict[str, _Capture], timed_out: bool) -> SandboxResult:
    status: dict[str, Any] = {}
    isolation: dict[str, bool] = {}
    for line in streams["status"].kept.decode("utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        isolation.update(entry.get("isolation") or {})
        status.update({k: v for k, v in entry.items() if k != "isolation"})
    stdout, stderr = streams["out"].text(), streams["err"].text()
    exit_code, sig = status.get("exit"), status.get("signal")
    summary = _summary(limits, stderr, timed_out, exit_code, sig, float(status.get("cpu_s", 0.0)))
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=None if timed_out else exit_code,
        signal=sig,
        timed_out=timed_out,
        summary=summary,
        isolation={"private_proc": False, **{k: bool(v) for k, v in isolation.items()}},
    )


def _summary(
    limits: SandboxLimits, stderr: str, timed_out: bool, exit_code: int | None, sig: int | None, cpu_s: float
) -> str:
    if timed_out:
        return f"killed: wall-clock timeout ({limits.wall_s:g} s)"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s):
        return f"killed: CPU time limit ({limits.cpu_s:g} s)"
    if sig == signal.SIGXFSZ:
        return f"killed: file size limit ({limits.disk_mb:g} MB)"
    if sig is not None:
        return f"killed: signal {signal.Signals(sig).name}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if exit_code and last.startswith("MemoryError"):
        return f"MemoryError: memory limit ({limits.memory_mb:g} MB)"
    # a fork bomb's processes fail together and their tracebacks interleave: the refused fork may be on any line
    if exit_code and any(x.startswith("BlockingIOError") and "Resource temporarily unavailable" in x for x in lines):
        return f"BlockingIOError: process limit ({limits.max_processes} processes)"
    if exit_code and _DISK_FULL.match(last):
        return f"OSError: disk limit ({limits.disk_mb:g} MB)"  # the file-size rlimit, or the private tmpfs full
    if exit_code == 0:
        return "ok"
    if exit_code is None:
        return "failed: the sandbox did not report how the code ended"
    return f"exit code {exit_code}" + (f": {last[:200]}" if last else "")


# ---- the child's side: runs as `python -I -S sandbox.py PLAN`, standard library only ---------------------------
def _unshare(libc: Any, flags: int) -> bool:
    return sys.platform == "linux" and bool(libc.unshare(flags) == 0)


def _enter_namespaces(libc: Any, plan: dict[str, Any]) -> dict[str, bool]:
    """New mount, network and PID namespaces, each where the OS allows it; a non-root trainer needs a user
    namespace first (mapping its uid to root inside, which is still the same unprivileged user outside)."""
    got = {"user_namespace": False, "mount_namespace": False, "network_namespace": False, "pid_namespace": False}
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        if not _unshare(libc, _CLONE_NEWUSER):
            return got
        got["user_namespace"] = True
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    wanted = {"mount_namespace": _CLONE_NEWNS, "pid_namespace": _CLONE_NEWPID}
    if not plan["limits"]["network"]:
        wanted["network_namespace"] = _CLONE_NEWNET
    for key, flag in wanted.items():
        got[key] = _unshare(libc, flag)
    return got


def _mount(libc: Any, source: str, target: str, fstype: str | None, flags: int, data: str | None) -> bool:
    if sys.platform != "linux":
        return False
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731 - ctypes wants bytes or NULL
    return bool(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0)


def _private_tmp(libc: Any, plan: dict[str, Any], code: bytes) -> bool:
    """Private tmpfs on the world-writable folders, and the working folder /tmp/work inside, owned by the sandbox
    uid; False (the host's folders stay visible) when mounts are not allowed."""
    if not _mount(libc, "none", "/", None, _MS_REC | _MS_PRIVATE, None):
        return False
    size = f"size={plan['limits']['disk_mb']}m,mode=1777"
    for folder in _PRIVATE_TMP:
        if os.path.isdir(folder) and not _mount(libc, "tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, size):
            return False
    os.mkdir("/tmp/work", 0o700)
    with open("/tmp/work/main.py", "wb") as f:
        f.write(code)
    if plan["uid"] is not None:
        os.chown("/tmp/work", plan["uid"], plan["uid"])
    os.chdir("/tmp/work")
    return True


def _count_processes(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except FileNotFoundError:
            continue
    return count


def _die_with_parent(libc: Any) -> None:
    if sys.platform == "linux":
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _set_limit(which: int, soft: int, hard: int) -> None:
    """Set a limit, capped at the hard limit the process already has (a non-root process cannot raise it)."""
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def _limit_and_exec(libc: Any, plan: dict[str, Any]) -> None:
    """In the model's process: rlimits, then the unprivileged uid, then exec. Never returns."""
    limits, uid = plan["limits"], plan["uid"]
    memory = limits["memory_mb"] << 20
    nproc = limits["max_processes"] + plan["already_running"]
    _set_limit(resource.RLIMIT_CORE, 0, 0)
    _set_limit(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)  # SIGXCPU, then SIGKILL a second later
    _set_limit(resource.RLIMIT_AS, memory, memory)
    _set_limit(resource.RLIMIT_FSIZE, limits["disk_mb"] << 20, limits["disk_mb"] << 20)
    _set_limit(resource.RLIMIT_NPROC, nproc, nproc)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _die_with_parent(libc)  # after setuid, which clears it
    os.close(plan["status_fd"])
    env = {**plan["env"], "HOME": os.getcwd()}  # its working folder, private or not
    try:
        os.execve(plan["python"], [plan["python"], "-I", "-S", "-c", _LOADER], env)
    except OSError as e:
        os.write(2, f"sandbox: cannot start {plan['python']}: {e}\n".encode())
    os._exit(126)


def _init(libc: Any, plan: dict[str, Any], got: dict[str, bool]) -> None:
    """The first process of the new PID namespace (the kernel drops default-action signals such as SIGXCPU sent to
    a namespace's init, so the model's code runs in a child of it): a private /proc, then fork the model's process,
    wait for it and report how it ended (exit code or signal, CPU seconds, the isolation the run got) as one JSON
    line on the status pipe. Its exit ends the namespace, and with it every process the model left behind."""
    _die_with_parent(libc)
    got["private_proc"] = (
        got["pid_namespace"]
        and got["mount_namespace"]
        and _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    )
    pid = os.fork()
    if pid == 0:
        _limit_and_exec(libc, plan)
    _, status, usage = os.wait4(pid, 0)
    report: dict[str, Any] = {"cpu_s": usage.ru_utime + usage.ru_stime, "isolation": got}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["exit"] = os.WEXITSTATUS(status)
    os.write(plan["status_fd"], (json.dumps(report) + "\n").encode())
    os._exit(0)


def _child_main(plan: dict[str, Any]) -> None:
    """The supervisor: namespaces and private folders, then the namespace's init (which runs the model's process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("main.py", "rb") as f:
        code = f.read()
    was_root = os.geteuid() == 0
    # Without a uid of its own the limit counts every process of the trainer's user, so it is set above their count.
    plan["already_running"] = 0 if plan["uid"] is not None else _count_processes(os.getuid())
    got = _enter_namespaces(libc, plan)
    got["private_tmp"] = got["mount_namespace"] and _private_tmp(libc, plan, code)
    got["user_switch"] = plan["uid"] is not None
    got["rlimit_nproc"] = plan["uid"] is not None or not was_root  # RLIMIT_NPROC does not bind root
    os.write(plan["status_fd"], (json.dumps({"isolation": got}) + "\n").encode())  # known even if the run is killed
    pid = os.fork()
    if pid == 0:
        _init(libc, plan, got)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
