"""``palestra doctor`` as a real command: the JSON report on a healthy setup, and a broken gradient flow caught.

Both runs are fresh interpreters on one thread. The first builds the cpp back end (a warm shared cache makes
that a load; a cold one costs the same one build the kernel tests would pay).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import plugin_installs
import pytest

SMALL = ["train.batch_size=2", "train.group_size=2", "train.max_new_tokens=4"]


def doctor(args: list[str], cwd: Path) -> tuple[int, dict]:
    result = plugin_installs.run_palestra(["doctor", "--json", *args], [], cwd, OMP_NUM_THREADS="1")
    assert result.stdout.strip(), result.stderr
    return result.returncode, json.loads(result.stdout)


def by_name(report: dict, section: str) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"] if c["section"] == section}


@pytest.mark.slow
def test_doctor_reports_toolchain_kernels_data_and_gradient_flow(tmp_path: Path) -> None:
    code, report = doctor(SMALL, tmp_path)
    assert code == 0 and report["status"] == "ok", report["failed"]
    assert set(report) == {"status", "counts", "failed", "checks"}
    for check in report["checks"]:
        assert set(check) == {"section", "name", "status", "detail", "data"}
        assert check["status"] in ("ok", "failed", "skipped") and "\n" not in check["detail"]

    versions = by_name(report, "versions")
    assert {"python", "torch", "cuda", "triton", "ninja", "compiler", "nvcc"} <= set(versions)
    assert versions["torch"]["status"] == "ok" and versions["compiler"]["status"] == "ok"
    assert re.search(r"C\+\+ kernels use the (avx512|avx2|portable) loops", versions["compiler"]["detail"])

    kernels = by_name(report, "kernels")
    ops = ["logprob_entropy", "gae", "discounted_returns", "group_advantages", "rloo_advantages", "normalize_rewards"]
    for op in ops:
        for backend in ("torch", "cpp"):  # the reference itself, and the C++ build
            check = kernels[f"{op}/{backend}"]
            assert check["status"] == "ok", check
            assert check["data"]["max_error"] < 1e-4

    utilisation = by_name(report, "utilisation")
    assert utilisation["cpu"]["status"] == "ok" and 0 <= utilisation["cpu"]["data"]["machine_cpu_percent"] <= 100

    data = by_name(report, "data")
    env = data["environment arithmetic"]
    assert env["status"] == "ok" and env["data"]["episodes"] == 4 and env["data"]["reset_s"] >= 0
    assert data["reward layered"]["data"]["rows"] == 4

    training = by_name(report, "training")
    assert training["step"]["status"] == "ok"
    groups = {c["data"]["group"]: c for name, c in training.items() if name.startswith("grads/")}
    assert set(groups) == {"embed", "blocks.0", "blocks.1", "norm"}  # the tiny policy's layers
    for check in groups.values():
        norm = check["data"]["grad_norm"]
        assert check["status"] == "ok" and math.isfinite(norm) and norm > 0 and check["data"]["flags"] == []
    assert sum(c["data"]["params"] for c in groups.values()) == 132_800


@pytest.mark.slow
def test_doctor_flags_zero_gradients_from_a_constant_reward(tmp_path: Path) -> None:
    """A reward no completion can earn: every advantage is 0, and without an entropy bonus no gradient flows."""
    config = tmp_path / "never.yaml"
    config.write_text("reward:\n  name: format\n  options:\n    pattern: '^never matches$'\n")
    args = ["--config", str(config), "--skip", "versions,kernels,utilisation", *SMALL]
    args += ["optimizer.options.entropy_coef=0", "kernels.backend=torch"]  # no native build needed here
    code, report = doctor(args, tmp_path)
    assert code == 1 and report["status"] == "failed"
    training = by_name(report, "training")
    assert training["step"]["status"] == "ok"  # the step ran; what it learnt from is the problem
    grads = [c for name, c in training.items() if name.startswith("grads/")]
    assert grads and all(c["status"] == "failed" and c["data"]["flags"] == ["zero gradients"] for c in grads)
    flow = training["gradient flow"]
    assert flow["status"] == "failed"
    assert "all advantages are 0 (every reward in the batch is equal, reward 0)" in flow["detail"]
    assert "training/gradient flow" in report["failed"]
    assert by_name(report, "data")["reward format"]["status"] == "ok"
