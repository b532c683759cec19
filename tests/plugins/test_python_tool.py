"""The ``python`` tool and its sandbox: every hostile program runs in a real child process, is contained, and is
answered with one line, while the test process (standing in for the trainer) keeps its limits, memory and files."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import textwrap
import threading
import tracemalloc
import uuid
import warnings

import pytest

from palestra.config import build_component
from palestra.plugins.tools import python as python_plugin
from palestra.tools import sandbox as sandbox_module
from palestra.tools.sandbox import _UID_BASE, _UID_SLOTS, SandboxLimits, run_sandboxed, sandbox_support

SUPPORT = sandbox_support()
_LIMITS = [resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_FSIZE]


def needs(feature: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not SUPPORT.get(feature), reason=f"this OS does not give the sandbox {feature}")


def peak_python_memory(fn):
    """What ``fn`` returns, and the peak of the memory Python allocated while it ran (bytes)."""
    tracemalloc.start()
    try:
        value = fn()
        return value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def sandbox_processes() -> list[int]:
    """Processes still running under a sandbox uid (none may outlive a run)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and _UID_BASE <= os.stat(f"/proc/{entry}").st_uid < _UID_BASE + _UID_SLOTS:
                pids.append(int(entry))
        except FileNotFoundError:
            continue
    return pids


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    """The test process as the trainer: its rlimits and open files before the run, checked unchanged after, and no
    sandbox process left behind. The sandbox's host folders go under tmp_path, so their removal can be checked."""
    host_tmp = tmp_path / "host-tmp"
    host_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(host_tmp))
    limits = {r: resource.getrlimit(r) for r in _LIMITS}
    fds = sorted(os.listdir("/proc/self/fd"))
    yield host_tmp
    assert {r: resource.getrlimit(r) for r in _LIMITS} == limits
    # no descriptor opened that stays open (others may close meanwhile: the suite's background runs own some)
    assert set(os.listdir("/proc/self/fd")) <= set(fds), "a pipe of the run was left open"
    assert sandbox_processes() == []
    assert list(host_tmp.iterdir()) == [], "the run's temporary folder was not removed"


def one_tool(**options) -> object:
    return build_component("tool", {"name": "python", "options": options}, path="tools.tools[0]")


def test_a_normal_computation_answers_and_its_folder_is_removed(trainer, monkeypatch):
    made = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    result = run_sandboxed("print(2**100)\nopen('scratch.txt', 'w').write('x')")
    assert (result.stdout, result.stderr, result.exit_code, result.summary) == (f"{2**100}\n", "", 0, "ok")
    assert len(made) == 1 and made[0].startswith(str(trainer)) and not os.path.exists(made[0])
    assert one_tool().fn(code="print(2**100)") == str(2**100)


def test_the_tool_schema_is_one_code_string():
    tool = one_tool()
    assert tool.name == "python"
    assert tool.parameters["required"] == ["code"] and tool.argument_error({"code": 1}) is not None
    assert tool.timeout_s > SandboxLimits().wall_s  # the sandbox's own kill comes before the loop's timeout


def test_an_error_in_the_code_is_its_traceback_and_one_line(trainer):
    answer = one_tool().fn(code="print('before')\n1/0")
    lines = answer.splitlines()
    assert lines[0] == "before" and "Traceback" in answer
    assert lines[-1] == "exit code 1: ZeroDivisionError: division by zero"


@pytest.mark.slow
def test_a_loop_forever_is_killed_at_its_cpu_limit(trainer):
    result = run_sandboxed("while True: pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert result.summary == "killed: CPU time limit (1 s)" and not result.timed_out


@pytest.mark.slow
def test_a_loop_that_ignores_sigxcpu_is_still_killed(trainer):
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    result = run_sandboxed(code, SandboxLimits(cpu_s=1, wall_s=30))
    assert result.summary == "killed: CPU time limit (1 s)" and result.signal == 9


def test_a_sleep_forever_is_killed_at_the_wall_clock(trainer):
    answer = one_tool(wall_s=1).fn(code="import time\nprint('started', flush=True)\ntime.sleep(3600)")
    assert answer == "started\nkilled: wall-clock timeout (1 s)"


def test_allocating_10_gb_is_a_memory_error_and_the_trainer_does_not_grow(trainer):
    tool = one_tool()
    answer, peak = peak_python_memory(lambda: tool.fn(code="x = bytearray(10 * 2**30)\nprint('allocated')"))
    assert answer.splitlines()[-1] == "MemoryError: memory limit (512 MB)" and "allocated" not in answer
    assert peak < 1 << 20


@needs("rlimit_nproc")
def test_processes_stop_at_the_limit(trainer):
    code = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)"
    )
    result = run_sandboxed(code, SandboxLimits(max_processes=8, wall_s=20))
    assert result.stdout == "7 11\n"  # itself and 7 children; EAGAIN. The sleepers die with the run (the fixture).


@needs("rlimit_nproc")
def test_a_fork_bomb_is_contained(trainer):
    answer = one_tool(wall_s=20).fn(code="import os\nwhile True: os.fork()")
    assert answer.splitlines()[-1] == "BlockingIOError: process limit (16 processes)"


@pytest.mark.slow
@needs("rlimit_nproc")
def test_a_fork_bomb_that_catches_its_errors_ends_at_the_wall_clock(trainer):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_sandboxed(code, SandboxLimits(wall_s=2, cpu_s=10))
    assert result.summary == "killed: wall-clock timeout (2 s)"  # and the fixture finds no process left


def test_writes_outside_its_folder_change_nothing_on_the_host(trainer, tmp_path):
    tag = uuid.uuid4().hex  # names no earlier run can have left
    refused = [str(tmp_path / "outside.txt"), f"/etc/palestra-sandbox-test-{tag}", f"/root/palestra-sandbox-test-{tag}"]
    shared = [
        f"{d}/palestra-sandbox-test-{tag}" for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock") if os.path.isdir(d)
    ]
    code = textwrap.dedent(f"""
        for path in {[*refused, *shared]!r}:
            try:
                open(path, "w").write("escaped")
                print("wrote", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
    """)
    try:
        result = run_sandboxed(code)
        assert result.summary == "ok", result.stderr
        for path in refused:
            assert f"refused {path}" in result.stdout  # each refused with an error the model reads
        assert not any(os.path.exists(p) for p in refused)
        if SUPPORT["private_tmp"]:  # without one, the host's world-writable folders take them (the documented limit)
            assert all(
                f"wrote {p}" in result.stdout for p in shared
            )  # a private tmpfs took each, and went with the run
            assert not any(os.path.exists(p) for p in shared)
    finally:
        for path in [*refused, *shared]:  # a failing sandbox must not leave its escape behind
            if os.path.exists(path):
                os.remove(path)


def test_filling_the_disk_stops_at_its_limit(trainer):
    code = "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)"
    result = run_sandboxed(code, SandboxLimits(disk_mb=8))
    assert result.summary == "OSError: disk limit (8 MB)"  # the private tmpfs is full, or the file-size rlimit hit


@needs("network_namespace")
def test_a_socket_cannot_reach_the_trainers_host(trainer):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        answer = one_tool().fn(code=code)
        assert answer.splitlines()[-1] == "exit code 1: OSError: [Errno 101] Network is unreachable"
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected


def test_the_trainers_environment_is_invisible(trainer, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("PALESTRA_TEST_SECRET", secret)
    code = textwrap.dedent(f"""
        import os
        print(sorted(os.environ))
        found = []
        for pid in [{os.getpid()}, os.getppid()] + os.listdir("/proc"):
            try:
                found.append(open(f"/proc/{{pid}}/environ", "rb").read())
            except OSError:
                pass
        print({secret.encode()!r} in b"".join(found), len(found))
    """)
    result = run_sandboxed(code)
    assert result.summary == "ok", result.stderr
    names, verdict = result.stdout.splitlines()
    assert names == str(sorted(["HOME", "LANG", "LC_ALL", "PATH", "PYTHONIOENCODING"]))
    assert verdict.startswith("False ")  # no /proc/*/environ it can read holds the secret


def test_printing_100_mb_is_truncated_and_the_trainer_stays_small(trainer):
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\nprint('end', file=sys.stderr)"
    result, peak = peak_python_memory(lambda: run_sandboxed(code, SandboxLimits(max_output_chars=1000)))
    assert result.summary == "ok" and result.stderr == "end\n"
    assert result.stdout == "x" * 1000 + "\n[... output truncated: 99999000 more bytes not shown]"
    assert peak < 1 << 20  # bytes: of the 100 MB, only the kept start and one read at a time were held


def test_the_sandbox_cannot_import_the_trainers_packages(trainer):
    answer = one_tool().fn(code="import palestra")
    assert answer.splitlines()[-1] == "exit code 1: ModuleNotFoundError: No module named 'palestra'"


def test_sandbox_support_says_what_this_os_gives():
    keys = {"user_switch", "rlimit_nproc", "network_namespace", "pid_namespace", "private_tmp", "private_proc"}
    assert keys <= SUPPORT.keys() and all(isinstance(SUPPORT[k], bool) for k in keys)
    assert isinstance(SUPPORT["missing"], list)
    assert SUPPORT["user_switch"] == (os.geteuid() == 0)


def test_what_the_sandbox_lacks_is_said_once(monkeypatch):
    # The OS here may lack nothing; what it reports is replaced so that the one warning can be seen.
    monkeypatch.setattr(python_plugin, "_warned", False)
    monkeypatch.setattr(python_plugin, "sandbox_support", lambda: {"missing": ["no network namespace (...)"]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_tool()
        one_tool()
    lines = [str(w.message) for w in caught if issubclass(w.category, python_plugin.SandboxWarning)]
    assert lines == ["python tool: the sandbox on this OS has no network namespace (...)"]


def test_bad_limits_are_one_line():
    with pytest.raises(Exception, match=r"tools\.tools\[0\]\.options\.cpu_s"):
        one_tool(cpu_s=0)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) to ask the OS independently")
def test_sandbox_support_claims_what_the_os_allows():
    # Asked independently of the sandbox's own code, so a sandbox that stops using a namespace the OS allows
    # fails here instead of skipping the tests that need it.
    allowed = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"], capture_output=True)
    if allowed.returncode != 0:
        pytest.skip(f"this OS refuses new namespaces: {allowed.stderr.decode().strip()}")
    assert SUPPORT["network_namespace"] and SUPPORT["pid_namespace"] and SUPPORT["private_tmp"]
    assert SUPPORT["private_proc"] and SUPPORT["missing"] == ([] if os.geteuid() == 0 else SUPPORT["missing"])


def test_an_interpreter_the_sandbox_cannot_run_fails_at_start_up(tmp_path):
    missing = tmp_path / "no-such-python"
    with pytest.raises(Exception, match=r"^tools\.tools\[0\]: building tool 'python' .*no Python interpreter") as e:
        one_tool(interpreter=str(missing))
    assert "\n" not in str(e.value) and str(missing) in str(e.value)


def test_runs_at_once_each_get_their_own_uid(trainer):
    results: list[object] = [None] * 4

    def one(i: int) -> None:
        results[i] = run_sandboxed(f"import os\nprint({i}, os.getuid())")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = [r.stdout.split() for r in results]  # type: ignore[union-attr]
    assert [int(i) for i, _ in lines] == [0, 1, 2, 3]
    if SUPPORT["user_switch"]:
        assert len({uid for _, uid in lines}) == 4 and os.getuid() not in {int(uid) for _, uid in lines}


_NOBODY_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import sandbox
limits = sandbox.SandboxLimits(wall_s=20)
answers = [sandbox.run_sandboxed(code, limits).summary for code in sys.argv[2:]]
print(json.dumps({"support": sandbox.sandbox_support(), "answers": answers, "uid": __import__("os").getuid()}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start the test's own unprivileged trainer")
def test_a_trainer_that_is_not_root_is_contained_too(tmp_path):
    # The sandbox module is standard library only, so an unprivileged system python3 can run it as the trainer:
    # the path a non-root user takes (a user namespace instead of a uid switch).
    python = "/usr/bin/python3"
    if not (os.path.exists(python) and sandbox_module._other_may_run(python)):
        pytest.skip("no python3 an unprivileged user may run")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        codes = [
            "print(2**100)",
            "import os\nwhile True: os.fork()",
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
        ]
        # the unprivileged trainer imports the sandbox from a copy it may read: the checkout may sit in a folder
        # only root can enter (a clean clone under a 0700 mktemp folder, in CI)
        folder = tempfile.mkdtemp(prefix="palestra-sandbox-copy-")
        os.chmod(folder, 0o755)
        shutil.copy(sandbox_module.__file__, os.path.join(folder, "sandbox.py"))
        os.chmod(os.path.join(folder, "sandbox.py"), 0o644)
        done = subprocess.run(
            [python, "-I", "-c", _NOBODY_SCRIPT, folder, *codes],
            capture_output=True,
            text=True,
            user=65534,
            group=65534,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"},
            timeout=120,
        )
        shutil.rmtree(folder)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["uid"] == 65534 and report["answers"][0] == "ok"
    if report["support"]["user_namespace"]:
        assert report["answers"][1] == "BlockingIOError: process limit (16 processes)"
        assert report["answers"][2] == "exit code 1: OSError: [Errno 101] Network is unreachable"
        assert report["support"]["missing"] == [
            "no separate uid (the code runs as the trainer's user and can read its files)"
        ]
