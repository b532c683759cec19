"""The first hour on a shared machine: OpenMP threads that wait passively, a thread count taken from the free cores,
an ETA from the recent steps' median, and a line while the native kernels build (issue 27)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palestra.config import build_component
from palestra.scale import cpu_threads
from palestra.scale.cpu_threads import apply_threads, choose_threads

CONFIG = {"run": {"name": "demo", "seed": 0}, "train": {"steps": 100}}


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}, timeout=120, check=False
    )


def test_importing_palestra_makes_torch_openmp_wait_passively() -> None:
    # OMP_DISPLAY_ENV makes the OpenMP runtime print the settings it read when torch loaded it: the proof that
    # the policy was set early enough, not merely present in os.environ.
    done = _python("import palestra, torch; torch.ones(100000).sum()", OMP_DISPLAY_ENV="TRUE")
    assert done.returncode == 0, done.stderr
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in done.stderr, done.stderr


def test_a_wait_policy_the_user_set_is_kept() -> None:
    done = _python("import palestra, torch; torch.ones(100000).sum()", OMP_DISPLAY_ENV="TRUE", OMP_WAIT_POLICY="ACTIVE")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in done.stderr, done.stderr


def test_the_thread_count_the_user_gives_wins() -> None:
    assert choose_threads(3, 2, environ={}) == cpu_threads.ThreadChoice(3, "train.threads")
    chosen = choose_threads(None, 2, environ={"OMP_NUM_THREADS": "1"})
    assert (chosen.threads, chosen.source, chosen.line) == (2, "OMP_NUM_THREADS", "")


@pytest.mark.parametrize(("idle", "default", "want"), [(2.0, 2, 2), (1.1, 2, 1), (0.2, 2, 1), (7.9, 4, 4), (2.8, 8, 3)])
def test_free_cores_decide_the_thread_count(
    monkeypatch: pytest.MonkeyPatch, idle: float, default: int, want: int
) -> None:
    monkeypatch.setattr(cpu_threads, "_cpu_ids", lambda: list(range(8)))
    monkeypatch.setattr(cpu_threads, "idle_cores", lambda cpus: idle)
    chosen = choose_threads(None, default, environ={})
    assert (chosen.threads, chosen.source) == (want, "free cores")
    assert chosen.line.startswith(f"palestra: {want} CPU thread") and "train.threads or OMP_NUM_THREADS" in chosen.line


def test_idle_cores_sees_a_busy_core() -> None:
    # A real busy loop pinned to one of this process's cores: the look at /proc/stat must count it as busy.
    if not Path("/proc/stat").is_file():
        pytest.skip("no /proc/stat on this system")
    cpus = sorted(os.sched_getaffinity(0))
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(spin.pid, {cpus[0]})
        time.sleep(0.3)
        idle = cpu_threads.idle_cores([cpus[0]], window_s=0.5)
    finally:
        spin.kill()
        spin.wait()
    assert 0.0 <= idle < 0.5, idle


def test_apply_threads_sets_torch() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        apply_threads(cpu_threads.ThreadChoice(1, "train.threads"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_eta_follows_recent_steps_not_a_slow_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Step 1 takes 40 s (a kernel build), every later step 0.1 s: a running mean would still say 4 s a step at
    # step 10 (an ETA of six minutes for 90 steps); the median says 0.1 s, nine seconds.
    clock = iter([0.0, 40.0, *(40.0 + 0.1 * i for i in range(1, 200))])
    monkeypatch.setattr("palestra.plugins.loggers.console.time.monotonic", lambda: next(clock))
    log = build_component("logger", {"name": "console", "options": {"every": 10}}, path="loggers[0]")
    log.open(tmp_path / "demo", CONFIG)
    for step in range(11):
        log.log({"reward/mean": 0.5}, step=step)
    log.close()
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("step 10/100 (10%) 0.1s/step eta 9s"), line


@pytest.mark.parametrize(
    ("flags", "kind"),
    [
        ("flags : fpu avx512f avx512_bf16 amx_bf16 amx_tile", "amx"),
        ("flags : fpu avx512f avx512_bf16", "avx512_bf16"),
        ("flags : fpu avx2 fma", "emulated"),
    ],
)
def test_the_cpu_kind_follows_its_flags(monkeypatch: pytest.MonkeyPatch, flags: str, kind: str) -> None:
    from palestra.cli.doctor import BF16_ON_CPU, cpu_check
    from palestra.kernels import build

    monkeypatch.setattr(build, "_cpu_flags", lambda: flags)
    check = cpu_check()
    assert (check.name, check.data["bf16"]) == ("cpu", kind)
    assert BF16_ON_CPU[kind] in check.detail


def test_doctor_names_this_machines_cpu_kind() -> None:
    import json

    done = subprocess.run(
        [sys.executable, "-m", "palestra", "doctor", "--json", "--skip", "kernels,utilisation,data,training"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    cpu = next(c for c in json.loads(done.stdout)["checks"] if c["name"] == "cpu")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    want = "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "emulated"
    assert cpu["data"]["bf16"] == want


@pytest.mark.slow
@pytest.mark.native
def test_a_kernel_build_says_when_it_starts_and_how_long_it_took(tmp_path: Path) -> None:
    # A real ninja build of a one-line library under the CPU library's name (seconds, where the real kernels take a
    # minute), in a fresh cache folder.
    source = tmp_path / "csrc" / "probe.cpp"
    source.parent.mkdir()
    source.write_text('extern "C" int palestra_probe() { return 1; }\n')
    load = (
        "import pathlib, palestra.kernels.build as b\n"
        f"b.csrc_dir = lambda: pathlib.Path({str(source.parent)!r})\n"
        "lib = b.NativeLibrary('palestra_cpu', ('probe.cpp',))\n"
        "lib.load(); lib.load()\n"
    )
    env = {**os.environ, "PALESTRA_CACHE_DIR": str(tmp_path / "cache")}
    runs = [
        subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=600, env=env, check=False)
        for _ in range(2)
    ]
    assert runs[0].returncode == 0, runs[0].stderr[-2000:]
    lines = [line for line in runs[0].stderr.splitlines() if line.startswith("palestra:")]
    assert lines[0] == "palestra: building the C++ kernels (palestra_cpu; first run only)...", lines
    assert lines[1].startswith("palestra: built the C++ kernels in ") and str(tmp_path / "cache") in lines[1], lines
    assert len(lines) == 2, lines  # once per process: nothing on the second load
    assert runs[1].returncode == 0 and "palestra:" not in runs[1].stderr, runs[1].stderr  # cached: silent


def dashboard_records(steps: int = 60) -> list[dict[str, float]]:
    return [
        {
            "step": s,
            "reward/mean": s / steps,
            "reward/ema": s / (2 * steps),
            "policy/clip_frac": 0.0,
            "policy/ratio": 1.0 + 1e-7 * (s % 3),  # "1e-7+1" on an axis: it says 1
            "lr": 1e-5,
            "train/skipped": 0.0,
            "perf/step_s": 41.0 if s == 1 else 0.1 + 0.001 * (s % 5),  # the first step built the kernels
            "diag/logit_norm": 5000.0 if s == 30 else 10.0 + 0.01 * s,
        }
        for s in range(1, steps + 1)
    ]


def test_constant_panels_fold_into_one_box() -> None:
    from palestra.cli.dashboard import plan_panels

    panels = plan_panels(dashboard_records())
    assert [p.title for p in panels] == ["reward", "diag", "perf", "constants"]
    assert panels[-1].text == ["clip fraction: 0", "learning rate: 1e-05", "policy/ratio: 1", "train/skipped: 0"]


def test_perf_and_diagnostics_fit_the_bulk_and_mark_outliers_and_legends_stay_outside() -> None:
    from palestra.cli.dashboard import build_figure, plan_panels

    fig = build_figure(plan_panels(dashboard_records()), title="run")
    fig.canvas.draw()
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    low, high = axes["perf"].get_ylim()
    assert high < 1.0 and low > 0.0, (low, high)  # fitted to the 0.1 s steps, not the 41 s first one
    assert any("off the axis (41 at step 1" in t.get_text() for t in axes["perf"].texts)
    assert axes["diag"].get_ylim()[1] < 100 and any("5e+03 at step 30" in t.get_text() for t in axes["diag"].texts)
    reward = axes["reward"]
    box, legend = reward.get_window_extent(), reward.get_legend().get_window_extent()
    assert legend.x0 >= box.x1  # beside the curves, not over them
    assert reward.get_ylim()[1] >= 1.0  # the reward keeps its whole range
    assert "clip fraction: 0" in axes["constants"].texts[0].get_text()


def test_a_resumed_run_takes_the_thread_count_its_checkpoint_recorded() -> None:
    chosen = choose_threads(None, 2, saved=1, environ={})
    assert (chosen.threads, chosen.source) == (1, "checkpoint") and "keeps a resume bitwise" in chosen.line
    assert choose_threads(2, 2, saved=1, environ={}).threads == 2  # train.threads still wins
    assert choose_threads(None, 2, saved=1, environ={"OMP_NUM_THREADS": "2"}).source == "OMP_NUM_THREADS"


@pytest.mark.slow
def test_palestra_train_says_its_thread_choice_once_and_records_it(tmp_path: Path) -> None:
    from train_processes import clean_env

    from palestra.engine.checkpoint import load_checkpoint

    env = {k: v for k, v in clean_env().items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    args = [sys.executable, "-m", "palestra", "train", "train.steps=2", "train.eval_size=2", "run.output_dir=runs"]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "CPU thread" in line]
    assert len(said) == 1 and said[0].startswith("palestra: ") and "set train.threads" in said[0], done.stderr
    threads = int(said[0].split()[1])
    state = load_checkpoint(next((tmp_path / "runs").glob("*/checkpoint.pt")))
    assert state["threads"] == threads
    pinned = subprocess.run(
        [*args, "run.name=pinned", "train.threads=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert pinned.returncode == 0 and "CPU thread" not in pinned.stderr, pinned.stderr[-2000:]
    assert load_checkpoint(tmp_path / "runs" / "pinned" / "checkpoint.pt")["threads"] == 1


def test_only_a_few_far_outliers_are_taken_off_the_axis() -> None:
    from palestra.cli.dashboard import robust_range

    assert robust_range([0.1] * 99 + [41.0]) == (0.1, 0.1)  # the first step's kernel build
    assert robust_range([0.0, 1.0, 2.0] * 100 + [1.0] * 300) is None  # discrete levels are data, not outliers
    heavy = [0.2 + 0.01 * (i % 7) for i in range(900)] + [5.0 + i for i in range(100)]
    assert robust_range(heavy) is None  # a tenth of the values far out: a heavy tail, drawn whole


def test_loading_a_gguf_draws_no_bars_into_a_log(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # transformers' own switch leaves the GGUF reader's plain tqdm bar ("Converting and de-quantizing GGUF
    # tensors...") on: a log got one per load until the loader silenced that module's bar too
    pytest.importorskip("gguf")
    import tiny_gguf

    from palestra.config import build_component

    gguf_path, _ = tiny_gguf.build_llama_gguf(tmp_path / "f32")
    capfd.readouterr()
    options = {"path": str(gguf_path.parent), "gguf_file": tiny_gguf.GGUF_NAME}
    build_component("policy", {"name": "hf", "options": options}, path="policy")
    err = capfd.readouterr().err
    assert "Converting and de-quantizing" not in err and "Loading weights" not in err, err[-500:]
