"""`palestra bench` and bench/gpu_check.py run end to end (small sizes; CPU back ends)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=900, **kw)


@pytest.mark.slow
def test_palestra_bench_quick_writes_results(tmp_path):
    out = tmp_path / "bench.json"
    done = _run([sys.executable, "-m", "palestra", "bench", "--quick", "--min-time", "0.01", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    ops = {r["op"] for r in rows}
    assert {"logprob_entropy", "gae", "normalize_rewards"} <= ops, ops
    ours = [r for r in rows if r["impl"] == "cpp"]
    assert ours and all(r["error"] is None and r["seconds"] > 0 for r in ours), ours
    # every one of our rows is compared with at least one baseline measured in the same run
    assert all(r["speedup_vs"] for r in ours), [r for r in ours if not r["speedup_vs"]]
    assert "speed-up vs baselines" in done.stdout


@pytest.mark.slow
def test_palestra_bench_csv_and_bad_arguments(tmp_path):
    done = _run([sys.executable, "-m", "palestra", "bench", "--quick", "--ops", "no_such_op"])
    assert done.returncode == 2 and "--ops" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = _run([sys.executable, "-m", "palestra", "bench", "--quick", "--out", str(tmp_path / "x.txt")])
    assert done.returncode == 2 and "--out" in done.stderr


@pytest.mark.slow
def test_gpu_check_smoke_on_cpu(tmp_path):
    """The GPU check script's checks, run on the cpp and Triton-interpreter back ends."""
    out = tmp_path / "check.json"
    done = _run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--no-timing", "--out", str(out)])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["failures"] == {"cpp": [], "triton": []}
    assert done.stdout.count(" ok ") >= 20
