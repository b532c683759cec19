"""The ``openenv`` environment against a real OpenEnv server on 127.0.0.1 (the example's guess-the-number game, with
faults to inject: tests/plugins/openenv_game/faulty_guess.py), and the ``env_reward`` reward.

Every server here is a real uvicorn process the test (or the environment) starts; every fault is real: a closed port,
a command that exits, a process killed mid-episode, a step that sleeps past the request timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from train_processes import error_line, palestra, start, write_config

from palestra.config import ConfigError, build_component, load_config
from palestra.plugin_manager import get_registry
from palestra.plugins.envs import openenv as oe
from palestra.registry import MissingDependency, Registration
from palestra.testing import check_environment
from palestra.types import Environment, Episode, Observation

pytest.importorskip("openenv.core", reason='needs openenv-core: pip install "palestra[openenv]"')

ROOT = Path(__file__).resolve().parents[2]
GAME_DIR = ROOT / "tests" / "plugins" / "openenv_game"
EXAMPLE = ROOT / "examples" / "openenv_guess_number.yaml"
GAME = {"action_field": "guess", "prompt": "{history}?", "max_turns": 4, "timeout_s": 10}


@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    """The environment and the reward in the registry (they are once the ``openenv`` entry point is installed)."""
    registry = get_registry()
    added: list[tuple[str, str]] = []
    for kind, hook in (("environment", oe.register_environments), ("reward", oe.register_rewards)):

        def register(name: str, factory: Any, options: Any = None, description: str = "", kind: str = kind) -> None:
            if name not in registry.names(kind):
                registry.add(Registration(kind, name, factory, options, description, "openenv", "palestra"))
                added.append((kind, name))

        hook(register=register)
    yield
    for key in added:
        registry._items.pop(key, None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def serve(**knobs: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The faulty game served by uvicorn on a free loopback port (``knobs``: its GUESS_* environment variables)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "faulty_guess:app",
            "--app-dir",
            str(GAME_DIR),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        env={**os.environ, **knobs},
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serve() as (url, _):
        yield url


def env(**options: Any) -> Any:
    return build_component("environment", {"name": "openenv", "options": options}, path="environment")


def env_reward(**options: Any) -> Any:
    return build_component("reward", {"name": "env_reward", "options": options}, path="reward")


def binary_search(observations: list[Observation | None], bounds: dict[int, list[int]]) -> list[str | None]:
    """Each live row's next guess by bisection over what its history says (``bounds``: row -> [low, high])."""
    out: list[str | None] = []
    for row, o in enumerate(observations):
        if o is None:
            out.append(None)
            continue
        low, high = bounds.setdefault(row, [0, 9])
        history = o.prompt.rstrip("?")
        if history:
            last, sign = int(history[-2]), history[-1]
            low, high = (last + 1, high) if sign == "+" else (low, last - 1)
            bounds[row] = [low, high]
        out.append(str((low + high) // 2))
    return out


def play(e: Any, observations: list[Observation], policy: Any) -> list[Any]:
    """Step until every row is done; every step's result."""
    current: list[Observation | None] = list(observations)
    results = []
    for _ in range(e.max_turns):
        if all(o is None for o in current):
            break
        result = e.step(policy(current))
        results.append(result)
        current = list(result.observations)
    return results


# ---- options ------------------------------------------------------------------------------------------------------
def test_importing_the_plugin_does_not_import_openenv() -> None:
    code = (
        "import sys; import palestra.plugins.envs.openenv; from palestra.plugin_manager import get_registry; "
        "get_registry(); print('openenv' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_without_the_package_building_it_is_a_one_line_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)  # importing it now raises ImportError
    with pytest.raises(MissingDependency) as missing:
        oe.import_openenv()
    assert 'pip install "palestra[openenv]"' in str(missing.value) and "\n" not in str(missing.value)


def test_options_are_one_line_errors_naming_the_key() -> None:
    cases = {
        "url: give url (a running server), command (start one) or package": {},
        "url: must be http://host:port": {"url": "ftp://x"},
        "command: needs {port} in an argument": {"command": ["python", "-m", "server"]},
        "package: must be module:app": {"package": "server"},
        "package: give package alone, not with url": {"package": "a:b", "url": "http://127.0.0.1:1"},
        "action.guess: is the action_field": {
            "url": "http://127.0.0.1:1",
            "action_field": "guess",
            "action": {"guess": 1},
        },
        "prompt: is not a format string": {"url": "http://127.0.0.1:1", "prompt": "{oops"},
    }
    for expected, options in cases.items():
        with pytest.raises(ConfigError) as e:
            env(**options)
        assert str(e.value).startswith(f"environment.options.{expected}"), str(e.value)
        assert "\n" not in str(e.value)


def test_the_schema_checks_the_action_field_and_the_prompt(server: str) -> None:
    with pytest.raises(ConfigError) as e:
        env(url=server)
    assert str(e.value) == (
        "environment: building environment 'openenv' (plugin 'openenv', distribution 'palestra') failed: OpenEnvError: "
        "action_field: the server's action has no field 'message'; its fields: metadata, guess"
    )
    with pytest.raises(
        ConfigError, match=r"OpenEnvError: prompt: unknown field \{histroy\}; the server's observations"
    ):
        env(url=server, action_field="guess", prompt="{histroy}")


# ---- episodes -----------------------------------------------------------------------------------------------------
def test_prompts_actions_and_rewards_flow_and_groups_share_a_game(server: str) -> None:
    e = env(url=server, **GAME)
    assert isinstance(e, Environment) and e.endpoint == f"OpenEnv server {server}"
    obs = e.reset(3, seed=7, group_size=2)
    assert [o.prompt for o in obs] == ["?"] * 6 and [o.messages[-1].content for o in obs] == ["?"] * 6
    seeds = [o.metadata["seed"] for o in obs]
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and len(set(seeds)) == 3
    bounds: dict[int, list[int]] = {}
    current: list[Observation | None] = list(e.reset(3, seed=7, group_size=2))
    histories: list[list[str]] = [[] for _ in current]
    while any(o is not None for o in current):
        result = e.step(binary_search(current, bounds))
        for row, info in enumerate(result.info):
            if info:
                histories[row].append(info["assistant"]["observation"]["history"])
        current = list(result.observations)
    # the rows of a group play one game (one secret), so the same guesses get the same answers
    assert histories[0] == histories[1] and histories[2] == histories[3] and histories[4] == histories[5]
    entries = [row.meta["openenv"] for row in e._rows]
    assert all(m["reward"] == 1.0 and m["done"] and not m["skipped"] for m in entries)  # bisection always wins
    assert all(m["rewards"][-1] == 1.0 and sum(m["rewards"]) == 1.0 for m in entries)
    scored = env_reward()(["p"] * 6, ["c"] * 6, [row.meta for row in e._rows])
    assert scored.scores.tolist() == [1.0] * 6 and scored.components["skipped"].tolist() == [0.0] * 6


def test_a_losing_episode_and_max_turns(server: str) -> None:
    e = env(url=server, **{**GAME, "max_turns": 2})
    e.reset(1, seed=3)
    first = e.step(["x"])  # no number: the server says so
    assert first.info[0]["assistant"]["observation"]["feedback"] == "invalid"
    assert first.observations[0] is not None and first.observations[0].turn == 1
    second = e.step(["x"])
    assert second.done == [True] and e._rows[0].meta["openenv"]["done"] is False  # cut by max_turns, not the server
    assert e._rows[0].meta["openenv"]["turns"] == 2 and e._rows[0].meta["openenv"]["reward"] == 0.0
    lost = env(url=server, **GAME)
    lost.reset(1, seed=3)
    for _ in range(4):
        result = lost.step(["x"])
    assert result.done == [True] and lost._rows[0].meta["openenv"]["done"]  # the server ended it: four tries used


def test_history_keeps_the_episode_in_the_prompt_and_messages(server: str) -> None:
    e = env(url=server, **{**GAME, "prompt": "{feedback}", "history": True, "system": "Guess 0-9."})
    obs = e.reset(1, seed=5)
    assert obs[0].prompt == "Guess 0-9.\nstart"
    nxt = e.step(["x"]).observations[0]
    assert nxt is not None and nxt.prompt == "Guess 0-9.\nstartx\ninvalid"
    assert [(m.role, m.content) for m in nxt.messages] == [
        ("system", "Guess 0-9."),
        ("user", "start"),
        ("assistant", "x"),
        ("user", "invalid"),
    ]


def test_the_contract_kit_passes(server: str) -> None:
    check_environment("openenv", {"url": server, **GAME}, reward="env_reward")


# ---- faults -------------------------------------------------------------------------------------------------------
def test_a_slow_server_times_out_and_the_episode_is_skipped_with_a_metric() -> None:
    with serve(GUESS_SLOW_S="3") as (url, _):
        e = env(url=url, **{**GAME, "timeout_s": 0.5, "retries": 1})
        e.reset(2, seed=1)
        with pytest.warns(oe.OpenEnvWarning) as caught:
            result = e.step(["5", "5"])
    assert result.done == [True, True] and result.observations == [None, None]
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and lines[0].startswith(
        f"openenv: 2 of 2 episodes skipped at step (rows 0, 1): OpenEnv server {url}: "
        "step failed 2 times (timeout_s=0.5); last: TimeoutError"
    )
    meta = [row.meta for row in e._rows]
    assert all(m["openenv"]["skipped"] and m["openenv"]["retries"] == 1 for m in meta)
    episodes = [Episode(metadata=m) for m in meta]
    assert e.rollout_metrics(episodes) == {"openenv/skipped": 2.0, "openenv/retries": 2.0}
    scored = env_reward(skipped=-1.0)(["p", "p"], ["c", "c"], meta)
    assert scored.scores.tolist() == [-1.0, -1.0] and scored.components["skipped"].tolist() == [1.0, 1.0]


def test_a_server_that_dies_is_named_and_its_episodes_skipped() -> None:
    with serve() as (url, proc):
        e = env(url=url, **{**GAME, "timeout_s": 2, "retries": 1})
        e.reset(2, seed=1, group_size=2)
        e.step(["5"] * 4)
        proc.kill()
        proc.wait()
        with pytest.warns(
            oe.OpenEnvWarning, match=rf"4 of 4 episodes skipped at step .*OpenEnv server {url}: step failed 2 times"
        ):
            result = e.step(["3"] * 4)
    assert result.done == [True] * 4
    assert all(row.meta["openenv"]["skipped"] and row.meta["openenv"]["turns"] == 1 for row in e._rows)


@pytest.mark.slow
def test_a_started_server_that_dies_mid_episode_is_restarted_and_nothing_is_lost(tmp_path: Path) -> None:
    options = {**GAME, "package": "faulty_guess:app", "app_dir": str(GAME_DIR)}
    clean = env(**options)
    first: dict[int, list[int]] = {}
    reference = [r.info for r in play(clean, clean.reset(2, seed=11, group_size=2), lambda c: binary_search(c, first))]
    clean.close()
    marker = tmp_path / "died"
    e = env(**options, server_env={"GUESS_DIE_AFTER": "6", "GUESS_DIE_MARKER": str(marker)})
    bounds: dict[int, list[int]] = {}
    with pytest.warns(
        oe.OpenEnvWarning,
        match=r"openenv: the OpenEnv server package 'faulty_guess:app' exited with code 1( \(stderr: .*\))?; "
        r"started it again \(1 of max_restarts=3\)",
    ):
        infos = [r.info for r in play(e, e.reset(2, seed=11, group_size=2), lambda c: binary_search(c, bounds))]
    assert marker.exists()  # it did die, on the 6th step it served (the second turn of the batch)
    assert infos == reference  # every episode played on, replayed on the new server: the same games, the same rewards
    assert not any(row.meta["openenv"]["skipped"] for row in e._rows)
    assert sum(row.meta["openenv"]["retries"] for row in e._rows) >= 1
    e.close()


def test_not_reachable_at_start_is_one_line_naming_the_url_or_the_command(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(ConfigError) as e:
        env(url=f"http://127.0.0.1:{port}", **{**GAME, "retries": 1})
    assert f"no OpenEnv server answers at http://127.0.0.1:{port}/health (2 tries, last: ConnectionRefusedError" in str(
        e.value
    )
    failing = [sys.executable, "-c", "import sys; print('bad flag', file=sys.stderr); sys.exit(3)", "{port}"]
    with pytest.raises(ConfigError) as e:
        env(command=failing, **GAME)
    assert "did not answer at http://127.0.0.1:" in str(e.value)
    assert str(e.value).endswith("/health: it exited with code 3 (stderr: bad flag)")
    assert "\n" not in str(e.value)


# ---- training runs (real processes) -----------------------------------------------------------------------------
def tiny_config(tmp_path: Path, environment: dict[str, Any], **train: Any) -> Path:
    return write_config(
        tmp_path,
        {
            "run": {"name": "run", "seed": 0, "output_dir": str(tmp_path / "runs")},
            # history: each prompt continues the last one, so an episode trains as one sequence (equal GRPO groups)
            "environment": {"name": "openenv", "options": {**environment, "history": True}},
            "reward": {"name": "env_reward"},
            "policy": {
                "name": "tiny",
                "options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_len": 32},
            },
            "optimizer": {"name": "grpo", "options": {"beta": 0.0}},
            "loggers": [{"name": "jsonl"}],
            "train": {
                "steps": 2,
                "batch_size": 2,
                "group_size": 2,
                "max_new_tokens": 1,
                "eval_size": 2,
                "trajectory": "sequence",
                **train,
            },
        },
    )


def pid_gone(pid: int, within_s: float = 15) -> bool:
    """Whether process ``pid`` ends within ``within_s`` (a zombie nobody reaps counts as ended: it runs nothing)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_short_train_run_then_no_server_is_left(tmp_path: Path) -> None:
    pid_file = tmp_path / "server.pid"
    options = {
        **GAME,
        "package": "faulty_guess:app",
        "app_dir": str(GAME_DIR),
        "server_env": {"GUESS_PID_FILE": str(pid_file)},
    }
    result = palestra(["--config", str(tiny_config(tmp_path, options))], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    stepped = [r for r in rows if "openenv/skipped" in r]
    assert stepped and all(r["openenv/skipped"] == 0.0 for r in stepped)
    assert pid_gone(int(pid_file.read_text()))


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_server(tmp_path: Path) -> None:
    pid_file = tmp_path / "server.pid"
    options = {
        **GAME,
        "package": "faulty_guess:app",
        "app_dir": str(GAME_DIR),
        "server_env": {"GUESS_PID_FILE": str(pid_file)},
    }
    proc = start(["--config", str(tiny_config(tmp_path, options, steps=100000))], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        server_pid = int(pid_file.read_text())
        proc.kill()  # SIGKILL: no handler, no atexit; only the parent-death signal stops the server
        proc.communicate()
        assert pid_gone(server_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
def test_unreachable_at_start_fails_palestra_train_with_exit_2(tmp_path: Path) -> None:
    port = free_port()
    config = tiny_config(tmp_path, {"url": f"http://127.0.0.1:{port}", **GAME, "retries": 0})
    result = palestra(["--config", str(config)], cwd=ROOT)
    assert result.returncode == 2
    line = error_line(result)
    assert line.startswith("palestra train: error: environment: building environment 'openenv'")
    assert f"no OpenEnv server answers at http://127.0.0.1:{port}/health (1 try, last: ConnectionRefusedError" in line
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_data_timeout_names_the_stalled_server(tmp_path: Path) -> None:
    with serve(GUESS_SLOW_S="30") as (url, _):
        config = tiny_config(tmp_path, {"url": url, **GAME, "timeout_s": 60}, data_timeout_s=2)
        result = palestra(["--config", str(config)], cwd=ROOT)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == (
        f"palestra train: error: OpenEnvEnvironment.step (OpenEnv server {url}) did not return within 2 s "
        "(train.data_timeout_s=2)"
    )


@pytest.mark.slow
def test_the_watchdog_names_the_stalled_server(tmp_path: Path) -> None:
    with serve(GUESS_SLOW_S="30") as (url, _):
        config = tiny_config(tmp_path, {"url": url, **GAME, "timeout_s": 60}, step_timeout_s=3, data_timeout_s=None)
        result = palestra(["--config", str(config)], cwd=ROOT)
    assert result.returncode == 70, result.stderr[-3000:]
    assert f"palestra: step watchdog: phase 'data: OpenEnv server {url}' of step 0 has run" in result.stderr


def test_the_example_config_validates() -> None:
    config = load_config(EXAMPLE)
    assert config.environment.name == "openenv" and config.reward.name == "env_reward"
    assert config.environment.options.package == "guess_number:app"
