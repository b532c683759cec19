"""The step watchdog and data timeouts: a hang becomes a fast exit with every thread's stack, naming the phase.

The hangs are real: a child interpreter sleeps inside a phase (or inside a slow environment during real
training) and must die with exit status 70 within a few seconds, its stack on stderr.
"""

from __future__ import annotations

import io
import re
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import plugin_installs
import pytest

from palestra.engine.watchdog import DataTimeout, StepWatchdog, call_with_timeout

MESSAGE = "palestra: step watchdog: phase '{phase}' of step {step} has run"


def run_script(code: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``code`` in a fresh interpreter on one thread; the result and the seconds it took."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    started = time.monotonic()
    result = plugin_installs.run_python([str(script)], [], tmp_path, timeout=120, OMP_NUM_THREADS="1")
    return result, time.monotonic() - started


@pytest.mark.slow
def test_a_hung_phase_exits_70_with_the_phase_and_every_stack(tmp_path: Path) -> None:
    result, seconds = run_script(
        """
        import threading, time
        from palestra.engine.watchdog import StepWatchdog

        def score_completions_slowly():
            time.sleep(60)

        def background_loader():
            time.sleep(60)

        threading.Thread(target=background_loader, daemon=True).start()
        watchdog = StepWatchdog(1.0).start()
        watchdog.set_step(7)
        with watchdog.phase("rollout"):
            pass
        with watchdog.phase("reward"):
            score_completions_slowly()
        print("not reached")
        """,
        tmp_path,
    )
    assert result.returncode == 70, result.stderr
    assert seconds < 15
    assert "not reached" not in result.stdout
    lines = result.stderr.splitlines()
    first = next(line for line in lines if line.startswith("palestra: step watchdog"))
    assert first.startswith(MESSAGE.format(phase="reward", step=7)) and "(> train.step_timeout_s=1)" in first
    assert first.endswith("; stacks follow")
    assert "in score_completions_slowly" in result.stderr  # the hung frame
    assert "in background_loader" in result.stderr  # and every other thread's


class RecordingWatchdog(StepWatchdog):
    """Records a firing instead of ending the process: a spurious firing must fail the test, not kill pytest."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(timeout_s, stream=io.StringIO())
        self.fired: list[str] = []

    def _fire(self, name: str, elapsed: float) -> None:
        self.fired.append(f"{name} after {elapsed:.2f} s")
        self._stop.set()


@pytest.mark.slow
def test_phases_shorter_than_the_timeout_never_fire() -> None:
    with RecordingWatchdog(0.5) as watchdog:
        for step in range(2):  # a step longer than the timeout, made of short phases and beats
            watchdog.set_step(step)
            with watchdog.phase("rollout"):
                for _ in range(6):
                    time.sleep(0.1)
                    watchdog.beat()
                with watchdog.phase("data"):  # nested: leaving it restarts the outer phase's clock
                    time.sleep(0.1)
                time.sleep(0.1)
            with watchdog.phase("update"):
                time.sleep(0.1)
        assert watchdog.current_phase is None
        time.sleep(0.6)  # idle between steps (no phase open) is not a hang either
    assert watchdog.fired == []
    with RecordingWatchdog(0.2) as watchdog, watchdog.phase("update"):  # and the same monitor does fire
        deadline = time.monotonic() + 10
        while not watchdog.fired and time.monotonic() < deadline:
            time.sleep(0.05)
    assert watchdog.fired and watchdog.fired[0].startswith("update after ")


def test_disabled_watchdog_starts_no_thread() -> None:
    before = threading.active_count()
    watchdog = StepWatchdog(None).start()
    with watchdog.phase("update"):
        assert watchdog.current_phase == "update"
        assert threading.active_count() == before
    watchdog.stop()
    with pytest.raises(ValueError, match=r"train\.step_timeout_s"):
        StepWatchdog(0)


def test_call_with_timeout_returns_raises_and_times_out() -> None:
    assert call_with_timeout(lambda: 41 + 1, 5, "environment.reset") == 42
    assert call_with_timeout(lambda: "no limit", None, "environment.reset") == "no limit"
    with pytest.raises(KeyError, match="from the call"):
        call_with_timeout(lambda: {}["from the call"], 5, "environment.step")
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(DataTimeout) as info:
        call_with_timeout(lambda: release.wait(30), 0.2, "environment.reset")
    release.set()
    assert time.monotonic() - started < 2
    message = str(info.value)
    assert isinstance(info.value, TimeoutError) and "\n" not in message
    assert message == "environment.reset did not return within 0.2 s (train.data_timeout_s=0.2)"


# ---- end to end: `palestra train` with a slow component -------------------------------------------------------
# The slow components are registered in-process (into the registry the plugin manager built) and the real
# command-line entry point runs the real Trainer: no mock of the loop, the watchdog or the timeouts.
SLOW_TRAIN = """
    import sys, time
    from palestra import cli
    from palestra.config import build_component
    from palestra.plugin_manager import get_registry
    from palestra.registry import Registration

    TRAINING_ROWS = 4  # train.batch_size=2 x train.group_size=2; the held-out evaluation uses 3 tasks

    class SlowArithmetic:
        def __init__(self):
            self.env = build_component("environment", {"name": "arithmetic"}, path="environment")

        def __getattr__(self, name):
            return getattr(self.env, name)

        def reset(self, batch_size, *, seed=None, group_size=1):
            if batch_size * group_size == TRAINING_ROWS:
                time.sleep(60)  # a data source that stopped answering
            return self.env.reset(batch_size, seed=seed, group_size=group_size)

    class SlowReward:
        max_score = 1.0

        def __init__(self):
            self.reward = build_component("reward", {"name": "format"}, path="reward")

        def __call__(self, prompts, completions, metadata):
            if len(completions) == TRAINING_ROWS:
                wait_for_the_reward_server()
            return self.reward(prompts, completions, metadata)

    def wait_for_the_reward_server():
        time.sleep(60)

    registry = get_registry()
    slow = (("environment", "slow_arithmetic", SlowArithmetic), ("reward", "slow_reward", SlowReward))
    for kind, name, factory in slow:
        registry.add(Registration(kind, name, factory, None, "deliberately slow", "test_watchdog", None))
    sys.exit(cli.main(["train", *sys.argv[1:]]))
"""


def slow_train(
    tmp_path: Path, environment: str, reward: str, *overrides: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    config = tmp_path / "slow.yaml"
    config.write_text(f"environment:\n  name: {environment}\nreward:\n  name: {reward}\n")
    script = tmp_path / "slow_train.py"
    script.write_text(textwrap.dedent(SLOW_TRAIN))
    args = [
        str(script),
        "--config",
        str(config),
        "train.batch_size=2",
        "train.group_size=2",
        "train.steps=2",
        "train.eval_size=3",
        "train.max_new_tokens=4",
        "kernels.backend=torch",
        f"run.output_dir={tmp_path / 'runs'}",
        *overrides,
    ]
    started = time.monotonic()
    result = plugin_installs.run_python(args, [], tmp_path, timeout=120, OMP_NUM_THREADS="1")
    return result, time.monotonic() - started


@pytest.mark.slow
def test_palestra_train_with_a_hung_reward_exits_70_naming_the_reward_phase(tmp_path: Path) -> None:
    result, seconds = slow_train(tmp_path, "arithmetic", "slow_reward", "train.step_timeout_s=2")
    assert result.returncode == 70, result.stderr[-2000:]
    assert seconds < 50  # start-up, one evaluation, then 2 s of waiting: not the 60 s the reward would hang
    message = [line for line in result.stderr.splitlines() if line.startswith("palestra: step watchdog:")]
    assert len(message) == 1 and message[0].startswith("palestra: step watchdog: phase 'reward' of step "), (
        result.stderr
    )
    assert "(> train.step_timeout_s=2); stacks follow" in message[0]
    assert "in wait_for_the_reward_server" in result.stderr  # the stuck stack, down from the step
    assert re.search(r"trainer\.py\", line \d+ in step\n", result.stderr), result.stderr


@pytest.mark.slow
def test_palestra_train_with_a_hung_environment_fails_on_the_data_timeout(tmp_path: Path) -> None:
    result, seconds = slow_train(tmp_path, "slow_arithmetic", "format", "train.data_timeout_s=1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert seconds < 50
    error = result.stderr.strip().splitlines()[-1]
    assert error == "palestra train: error: SlowArithmetic.reset did not return within 1 s (train.data_timeout_s=1)"
