"""The ``mcp`` tool: a real MCP server (tests/fixtures/mcp_server.py) started through the tool factory over stdio.

Each fault is one line: a server that fails to start, one that dies mid-episode, one that answers slowly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import palestra

pytest.importorskip("mcp")

from palestra.config import ComponentBuildError, ConfigError, build_component, validate_config
from palestra.config.untrusted import untrusted
from palestra.plugins.tools.mcp import McpServerError, McpToolError, build_mcp_tools, result_text
from palestra.tools import Tool

SERVER = str(Path(__file__).resolve().parents[1] / "fixtures" / "mcp_server.py")
COMMAND = [sys.executable, SERVER]
# Long enough for a loaded machine to answer a quick call; the slow call sleeps far past it.
TIMEOUT_S = 4.0


def _tools(**options) -> dict[str, Tool]:
    return {t.name: t for t in build_mcp_tools(command=COMMAND, **options)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone too: its parent just has not reaped it
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z"


@pytest.fixture(scope="module")
def tools():
    built = _tools(timeout_s=TIMEOUT_S)
    yield built
    built["add"].fn.close()


def test_tools_are_listed_with_their_schemas_and_answer(tools):
    assert set(tools) == {"add", "echo", "slow", "fail", "env_keys", "pid", "die"}
    add = tools["add"]
    assert add.description == "Add two integers."
    assert add.parameters["type"] == "object" and add.parameters["required"] == ["a", "b"]
    assert add.argument_error({"a": 1, "b": "x"}) is not None  # the server's schema checks the model's arguments
    assert add.fn(a=2, b=40) == "42"
    assert tools["echo"].fn(text="héllo\nworld") == "héllo\nworld"
    assert add.spec()["function"]["name"] == "add"


def test_a_tool_error_result_raises_its_text(tools):
    with pytest.raises(McpToolError, match="fail"):
        tools["fail"].fn(message="boom")
    assert tools["add"].fn(a=1, b=1) == "2"  # the server goes on


def test_the_server_gets_a_minimal_environment_plus_env(monkeypatch):
    monkeypatch.setenv("PALESTRA_TEST_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    built = _tools(env={"MY_SETTING": "1"})
    try:
        seen = set(built["env_keys"].fn().split("\n"))
    finally:
        built["add"].fn.close()
    assert "MY_SETTING" in seen and "PATH" in seen
    assert "PALESTRA_TEST_SECRET" not in seen and "AWS_SECRET_ACCESS_KEY" not in seen
    assert seen <= {"MY_SETTING", "PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR"} | {
        "LOGNAME", "SHELL", "TERM", "USER"}  # fmt: skip


def test_tools_and_prefix_pick_and_rename():
    built = build_mcp_tools(command=COMMAND, tools=["add"], prefix="calc_")
    try:
        assert [t.name for t in built] == ["calc_add"]
        assert built[0].fn(a=3, b=4) == "7"  # called by its name on the server
    finally:
        built[0].fn.close()


def test_a_tool_the_server_does_not_offer_is_one_line():
    with pytest.raises(McpServerError) as info:
        build_mcp_tools(command=COMMAND, tools=["add", "multiply"])
    message = str(info.value)
    assert "offers no tool 'multiply'" in message and "add, echo" in message and "\n" not in message


def test_a_slow_answer_times_out_in_one_line_and_the_next_call_works(tools):
    with pytest.raises(TimeoutError) as info:
        tools["slow"].fn(seconds=300)
    message = str(info.value)
    assert "'slow'" in message and "timeout_s=4 s" in message and "\n" not in message
    assert tools["add"].fn(a=5, b=6) == "11"
    assert tools["slow"].timeout_s > TIMEOUT_S  # the loop's own timeout leaves room for this message


def test_a_server_that_dies_mid_episode_is_restarted_once():
    built = _tools()
    try:
        first_pid = int(built["pid"].fn())
        with pytest.raises(McpServerError) as info:
            built["die"].fn()
        message = str(info.value)
        assert "exited during the call to 'die'" in message and SERVER in message and "\n" not in message
        assert "dying on request" in message  # the server's last stderr line
        assert built["add"].fn(a=1, b=2) == "3"  # started again
        assert int(built["pid"].fn()) != first_pid
        with pytest.raises(McpServerError, match="exited during the call"):
            built["die"].fn()
        with pytest.raises(McpServerError) as info:
            built["add"].fn(a=1, b=2)
        assert "exited and was already restarted once" in str(info.value) and "\n" not in str(info.value)
    finally:
        built["add"].fn.close()


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["/nonexistent/mcp-server"], "FileNotFoundError"),
        ([sys.executable, SERVER, "--exit"], "refusing to start (--exit)"),
    ],
    ids=["bad-command", "exits-at-once"],
)
def test_a_server_that_fails_to_start_fails_the_build_in_one_line(command, expected):
    with pytest.raises(ComponentBuildError) as info:
        build_component("tool", {"name": "mcp", "options": {"command": command}}, path="tools.tools[0]")
    message = str(info.value)
    assert message.startswith("tools.tools[0]: building tool 'mcp'")
    assert "failed to start" in message and command[-1] in message and expected in message
    assert "\n" not in message


def test_a_server_that_never_answers_fails_the_build_after_startup_timeout(tmp_path):
    silent = tmp_path / "silent.py"
    silent.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(McpServerError) as info:
        build_mcp_tools(command=[sys.executable, str(silent)], startup_timeout_s=1)
    assert "did not answer within startup_timeout_s=1 s" in str(info.value) and str(silent) in str(info.value)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"command": []}, "command"),
        ({"command": ["python", ""]}, "command"),
        ({"command": ["x"], "timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_options_name_the_key(options, key):
    with pytest.raises(ConfigError) as info:
        build_component("tool", {"name": "mcp", "options": options}, path="tools.tools[0]")
    assert f"tools.tools[0].options.{key}" in str(info.value) and "\n" not in str(info.value)


def test_the_server_stops_when_closed():
    built = _tools()
    pid = int(built["pid"].fn())
    built["add"].fn.close()
    assert _gone(pid)
    with pytest.raises(McpServerError, match="was closed"):  # a closed server is not started again by a call
        built["add"].fn(a=1, b=2)


def test_the_server_stops_when_the_trainer_exits_without_closing_it():
    script = textwrap.dedent(f"""
        from palestra.plugins.tools.mcp import build_mcp_tools
        tools = {{t.name: t for t in build_mcp_tools(command={COMMAND!r})}}
        print(tools["pid"].fn(), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert _gone(int(out.stdout.strip()))


def test_a_resumed_config_does_not_run_the_saved_command_unless_passed_again(tmp_path):
    raw = {
        "environment": {"name": "arithmetic"},
        "tools": {"tools": [{"name": "mcp", "options": {"command": ["sh", "-c", "evil"], "env": {"LD_PRELOAD": "x"}}}]},
    }
    config = validate_config(raw)
    keys = {claim.key for claim in untrusted(config, tmp_path)}
    assert {"tools.tools[0].options.command", "tools.tools[0].options.env"} <= keys


def test_result_text_joins_text_and_falls_back_to_structured_content():
    assert result_text({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == "a\nb"
    assert json.loads(result_text({"content": [], "structuredContent": {"x": [1, 2]}})) == {"x": [1, 2]}
    assert result_text({"content": [{"type": "image", "mimeType": "image/png", "data": ""}]}) == "[image image/png]"


def test_without_the_mcp_package_the_build_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # how Python marks a module unimportable
    with pytest.raises((ConfigError, palestra.MissingDependency)) as info:
        build_component("tool", {"name": "mcp", "options": {"command": COMMAND}}, path="tools.tools[0]")
    message = str(info.value)
    assert "'mcp'" in message and 'pip install "palestra[mcp]"' in message and "\n" not in message
