"""Bad input refused up front, in one line naming the culprit: pure checks in the schema (``train.device``
syntax, ``run.seed`` range, reported by ``palestra config show`` too) and checks against this machine in
:func:`palestra.config.preflight.preflight` (the device exists, ``run.output_dir`` is writable, the batch
fits in memory, a forced kernel back end runs, ``PALESTRA_CACHE_DIR`` is writable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import palestra.kernels  # noqa: F401  (registers every op, so a forced back end is checked for each)
from palestra.config import ConfigError, load_config
from palestra.config import preflight as preflight_module
from palestra.config.preflight import preflight, rollout_bytes_floor
from palestra.kernels import build, dispatch
from palestra.scale import micro_batching

CHOICES = "auto, cpu, cuda, cuda:<n> (a GPU index such as cuda:0) or mps"


def refused(overrides: list[str], **kwargs) -> str:
    """The one-line message preflight refuses a (valid) config with."""
    config = load_config(overrides=overrides)
    with pytest.raises(ConfigError) as caught:
        preflight(config, **kwargs)
    msg = str(caught.value)
    assert "\n" not in msg
    return msg


def invalid(overrides: list[str]) -> str:
    """The one-line message validation refuses a config with."""
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=overrides)
    msg = str(caught.value)
    assert "\n" not in msg
    return msg


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing forced from outside, a writable kernel cache of the test's own, one process."""
    monkeypatch.delenv("PALESTRA_KERNELS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("PALESTRA_CACHE_DIR", str(tmp_path / "kernel-cache"))
    monkeypatch.chdir(tmp_path)  # run.output_dir 'runs' is relative


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


# ---- 1. train.device -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "device, expected",
    [
        ("gpu", f"train.device: expected {CHOICES}, got 'gpu'; did you mean 'cuda'?"),
        ("cuda:x", f"train.device: expected {CHOICES}, got 'cuda:x'"),
        ("cuda:01", f"train.device: expected {CHOICES}, got 'cuda:01'"),
        ("CPU", f"train.device: expected {CHOICES}, got 'CPU'"),
        ("cuda:-1", f"train.device: expected {CHOICES}, got 'cuda:-1'"),
    ],
)
def test_device_syntax_is_a_validation_error(device: str, expected: str) -> None:
    assert invalid([f"train.device={device}"]) == expected


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"])
def test_device_syntax_accepts_the_documented_forms(device: str) -> None:
    assert load_config(overrides=[f"train.device={device}"]).train.device == device


def test_config_show_reports_a_bad_device() -> None:
    exe = Path(sys.executable).parent / "palestra"
    done = subprocess.run([str(exe), "config", "show", "train.device=gpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"palestra config: error: train.device: expected {CHOICES}, got 'gpu'; did you mean 'cuda'?\n"


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert refused([f"train.device={device}"]) == (
        f"train.device: {device!r} needs a CUDA GPU, but CUDA is not "
        "available (this torch is a CPU-only build); use auto or cpu"
    )


def test_cuda_index_beyond_the_visible_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert (
        refused(["train.device=cuda:2"])
        == "train.device: 'cuda:2' is not a visible GPU; this machine has 2 (cuda:0 to cuda:1)"
    )


def test_mps_without_mps_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert refused(["train.device=mps"]) == (
        "train.device: 'mps' needs Apple's Metal GPU, which this machine or torch build lacks; use auto or cpu"
    )


def test_the_default_config_passes_preflight() -> None:
    preflight(load_config())
    preflight(load_config(overrides=["train.device=cpu", "kernels.backend=torch"]))


# ---- 2. kernels.backend and PALESTRA_KERNELS -----------------------------------------------------------
def test_cuda_back_end_on_a_cpu_run_is_refused() -> None:
    assert refused(["train.device=cpu", "kernels.backend=cuda"]) == (
        "kernels.backend: the cuda back end runs on CUDA tensors, "
        "but the run is on cpu (train.device='cpu'); use auto or torch"
    )


def test_cuda_back_end_on_a_machine_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert refused(["kernels.backend=cuda"]) == (
        "kernels.backend: the cuda back end runs on CUDA tensors, but the run is on cpu "
        "(train.device='auto', which found no CUDA GPU); use auto or torch"
    )


def test_triton_back_end_without_a_gpu_or_its_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = dispatch.triton_available(torch.device("cpu"))
    assert reason  # this machine's CPU run: no GPU, no interpreter (or no triton at all)
    assert refused(["train.device=cpu", "kernels.backend=triton"]) == (
        f"kernels.backend: the triton back end cannot run here: {reason}; use auto or torch"
    )


def test_cpp_back_end_whose_build_fails_is_refused_naming_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    error = build.KernelBuildError(
        "advantages", "palestra_cpu build failed: cpu/advantages.cpp:3:1: error: expected ';'"
    )

    def broken_build() -> None:
        raise error

    monkeypatch.setattr(build.CPU_LIBRARY, "load", broken_build)
    assert refused(["train.device=cpu", "kernels.backend=cpp"]) == (
        "kernels.backend: the cpp back end cannot run here: palestra kernel 'advantages': "
        "palestra_cpu build failed: cpu/advantages.cpp:3:1: error: expected ';'"
    )


def test_auto_does_not_build_kernels_in_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build() -> None:
        raise AssertionError("preflight built a native library for kernels.backend=auto")

    monkeypatch.setattr(build.CPU_LIBRARY, "load", no_build)
    monkeypatch.setattr(build.CUDA_LIBRARY, "load", no_build)
    preflight(load_config(overrides=["train.device=cpu"]))


@pytest.mark.parametrize("value", ["gpu", "fast"])
def test_unknown_palestra_kernels_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("PALESTRA_KERNELS", value)
    assert (
        refused([])
        == f"PALESTRA_KERNELS={value!r}: not a back end; use one of auto, torch, cpp, cuda, triton (or unset it)"
    )


def test_unavailable_palestra_kernels_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALESTRA_KERNELS", "cuda")
    assert refused(["train.device=cpu"]) == (
        "PALESTRA_KERNELS='cuda': the cuda back end runs on CUDA tensors, but the run is on cpu (train.device='cpu'); "
        "use auto or torch"
    )


def test_kernels_backend_in_the_config_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALESTRA_KERNELS", "cuda")  # ignored by the run: set_backend("torch") takes precedence
    preflight(load_config(overrides=["train.device=cpu", "kernels.backend=torch"]))


# ---- 3. run.output_dir ---------------------------------------------------------------------------------
def test_output_dir_that_is_a_file_is_refused(a_file: Path) -> None:
    assert refused([f"run.output_dir={a_file}"]) == f"run.output_dir: '{a_file}' is a file, not a folder"


def test_output_dir_under_a_file_is_refused(a_file: Path) -> None:
    assert refused([f"run.output_dir={a_file}/runs"]) == (
        f"run.output_dir: '{a_file}/runs' cannot be created: '{a_file}' is a file"
    )


@pytest.mark.parametrize("path, fs", [("/proc/self/runs", "/proc"), ("/sys/runs", "/sys"), ("/proc", "/proc")])
def test_output_dir_under_a_kernel_file_system_is_refused(path: str, fs: str) -> None:
    assert refused([f"run.output_dir={path}"]) == (
        f"run.output_dir: '{path}' is under {fs}, the kernel's own file system; choose a folder on a disk"
    )


def test_output_dir_through_a_link_into_proc_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "looks-harmless"
    link.symlink_to("/proc/self")
    assert refused([f"run.output_dir={link}/runs"]) == (
        f"run.output_dir: '{link}/runs' is under /proc, the kernel's own file system; choose a folder on a disk"
    )


def test_unwritable_output_dir_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.geteuid() == 0:  # permission bits do not stop root: answer as access(2) does for anyone else
            real_access = os.access
            monkeypatch.setattr(
                preflight_module.os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode)
            )
        assert refused([f"run.output_dir={locked}"]) == f"run.output_dir: '{locked}' is not writable by this user"
        assert refused([f"run.output_dir={locked}/runs"]) == (
            f"run.output_dir: '{locked}/runs' is not writable by this "
            f"user (its nearest existing folder '{locked}' is not writable)"
        )
    finally:
        locked.chmod(0o755)


def test_run_folder_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "arithmetic").write_text("")
    assert (
        refused([]) == "run.name: the run folder 'runs/arithmetic' is a file; choose another run.name or move the file"
    )


def test_preflight_creates_no_folder(tmp_path: Path) -> None:
    preflight(load_config(overrides=[f"run.output_dir={tmp_path}/new/runs", "kernels.backend=torch"]))
    assert not (tmp_path / "new").exists()


def test_resume_checks_the_run_folder_instead(tmp_path: Path, a_file: Path) -> None:
    config = load_config(overrides=["run.output_dir=/proc/old"])
    preflight(config, run_dir=tmp_path)  # the saved output_dir is not where a resumed run writes
    with pytest.raises(ConfigError, match=rf"^--resume '{a_file}': '{a_file}' is a file, not a folder$"):
        preflight(config, run_dir=a_file)


# ---- 4. a batch that cannot fit in memory --------------------------------------------------------------
def test_rollout_floor_counts_the_token_tensors() -> None:
    # per row: one prompt token (int64 id + bool mask) and 64 completion tokens (int64 id + bool mask + f32 log-prob)
    assert rollout_bytes_floor(rows=10, max_new_tokens=64) == 10 * (9 + 64 * 13)


def test_a_batch_beyond_memory_is_refused_with_an_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(micro_batching, "free_memory_bytes", lambda device: 16 * 10**9)
    overrides = ["train.device=cpu", "train.batch_size=1000000000", "train.group_size=4", "train.max_new_tokens=64"]
    assert refused(overrides) == (
        "train.batch_size: 1000000000 tasks x train.group_size 4 = 4000000000 rows need at least 3.4 TB for the "
        "rollout's token tensors alone (1 prompt token + train.max_new_tokens 64 per row), more than the 16.0 GB "
        "free on cpu; lower train.batch_size or train.group_size"
    )
    # auto_micro_batch sizes the update's micro-batches; the rollout still samples every row at once
    assert refused([*overrides, "train.auto_micro_batch=true"]).endswith(
        "lower train.batch_size or train.group_size; train.auto_micro_batch splits the update, not the rollout"
    )


def test_a_batch_beyond_this_machines_memory_is_refused() -> None:
    msg = refused(["train.device=cpu", "train.batch_size=1000000000"])
    assert msg.startswith(
        "train.batch_size: 1000000000 tasks x train.group_size 8 = 8000000000 rows need at least 696.0 GB"
    )
    assert msg.endswith("free on cpu; lower train.batch_size or train.group_size")


def test_under_torchrun_the_estimate_is_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(micro_batching, "free_memory_bytes", lambda device: 10**9)
    msg = refused(["train.device=cpu", "train.batch_size=400000000", "train.group_size=1", "train.max_new_tokens=1"])
    assert msg.startswith(
        "train.batch_size: 400000000 tasks x train.group_size 1 "
        "= 100000000 rows per rank (4 ranks) need at least 2.2 GB"
    )


# ---- 5. run.seed ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed, expected",
    [
        ("-1", "run.seed: must be >= 0, got -1"),
        (str(2**63), f"run.seed: must be <= {2**63 - 1}, got {2**63}"),
        (str(2**64), f"run.seed: must be <= {2**63 - 1}, got {2**64}"),
    ],
)
def test_seed_out_of_range_is_a_validation_error(seed: str, expected: str) -> None:
    assert invalid([f"run.seed={seed}"]) == expected


def test_the_largest_seed_is_accepted_and_seeds_torch() -> None:
    config = load_config(overrides=[f"run.seed={2**63 - 1}"])
    torch.manual_seed(config.run.seed)
    torch.manual_seed(0)


# ---- 6. PALESTRA_CACHE_DIR -----------------------------------------------------------------------------
def test_unwritable_cache_with_a_forced_native_back_end_is_refused(
    monkeypatch: pytest.MonkeyPatch, a_file: Path
) -> None:
    monkeypatch.setenv("PALESTRA_CACHE_DIR", str(a_file / "cache"))
    problem = f"PALESTRA_CACHE_DIR='{a_file}/cache': not a writable folder (Not a directory)"
    assert refused(["train.device=cpu", "kernels.backend=cpp"]) == (
        f"{problem}; kernels.backend=cpp builds its kernels there "
        "(fix it, or use kernels.backend=auto to fall back to torch)"
    )
    monkeypatch.setenv("PALESTRA_KERNELS", "cpp")
    assert refused(["train.device=cpu"]) == (
        f"{problem}; PALESTRA_KERNELS=cpp builds its kernels there "
        "(fix it, or use kernels.backend=auto to fall back to torch)"
    )


def test_unset_cache_variable_names_the_default_folder(monkeypatch: pytest.MonkeyPatch, a_file: Path) -> None:
    monkeypatch.delenv("PALESTRA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(a_file))
    assert build.cache_dir_problem() == (
        f"the kernel cache '{a_file}/palestra/extensions' (set "
        "PALESTRA_CACHE_DIR to move it): not a writable folder (Not a directory)"
    )


def test_unwritable_cache_under_auto_warns_once_in_preflight(monkeypatch: pytest.MonkeyPatch, a_file: Path) -> None:
    monkeypatch.setenv("PALESTRA_CACHE_DIR", str(a_file / "cache"))
    config = load_config(overrides=["train.device=cpu"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preflight(config)
        preflight(config)
    assert [str(w.message) for w in caught] == [
        f"PALESTRA_CACHE_DIR='{a_file}/cache': not a writable folder "
        "(Not a directory); the native kernels fall back to torch"
    ]
    assert caught[0].category is dispatch.KernelFallbackWarning
    assert caught[0].category.__module__.startswith("palestra.")  # printed as one 'palestra: warning:' line


FALLBACK_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    from palestra.cli import _format_warning
    import palestra.kernels as K
    from palestra.config import load_config
    from palestra.config.preflight import preflight

    r, v, m = torch.randn(2, 5), torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool)
    logits, ids = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if sys.argv[1] == "preflight":
            preflight(load_config(overrides=["train.device=cpu"]))
        got = [K.gae(r, v, m, 0.9, 0.8)[0], K.logprob_entropy(logits, ids)[0], K.group_advantages(torch.randn(8), 4)]
    K.set_backend("torch")
    ref = [K.gae(r, v, m, 0.9, 0.8)[0], K.logprob_entropy(logits, ids)[0], K.group_advantages(torch.randn(8), 4)]
    print(json.dumps({
        "lines": [_format_warning(w.message, w.category, w.filename, w.lineno) for w in caught],
        "same": [bool(torch.allclose(a, b)) for a, b in zip(got[:2], ref[:2])],
    }))
    """
)


@pytest.mark.parametrize("start", ["preflight", "first-call"])
def test_unwritable_cache_under_auto_falls_back_to_torch_with_one_warning(
    tmp_path: Path, a_file: Path, start: str
) -> None:
    env = {**os.environ, "PALESTRA_CACHE_DIR": str(a_file / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("PALESTRA_KERNELS", None)
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT, start], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    problem = f"PALESTRA_CACHE_DIR='{a_file}/cache': not a writable folder (Not a directory)"
    assert result["lines"] == [f"palestra: warning: {problem}; the native kernels fall back to torch\n"]
    assert result["same"] == [True, True]


# ---- through the command line: exit status 2, one line, nothing built -----------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the cuda cases are about a machine without CUDA")
@pytest.mark.parametrize(
    "override, starts",
    [
        ("train.device=cuda", "palestra train: error: train.device: 'cuda' needs a CUDA GPU"),
        ("train.device=gpu", "palestra train: error: train.device: expected auto, cpu, cuda"),
        ("kernels.backend=cuda", "palestra train: error: kernels.backend: the cuda back end runs on CUDA tensors"),
        ("run.output_dir=/proc/self/runs", "palestra train: error: run.output_dir: '/proc/self/runs' is under /proc"),
        ("run.output_dir=a-file", "palestra train: error: run.output_dir: 'a-file' is a file, not a folder"),
        ("train.batch_size=1000000000", "palestra train: error: train.batch_size: 1000000000 tasks x train.group_size"),
        ("run.seed=-1", "palestra train: error: run.seed: must be >= 0, got -1"),
    ],
)
def test_palestra_train_refuses_up_front_with_exit_2_and_one_line(
    override: str, starts: str, a_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from palestra import cli

    assert cli.main(["train", override]) == 2
    _out, err = capsys.readouterr()
    assert err.startswith(starts) and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()  # refused before anything was built or written
