import copy
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import background_runs
import pytest
import torch

# Tests that train run on one thread (a busy two-core machine): palestra train then keeps torch's count rather than
# choosing one from the idle cores (and says nothing about it), in this process and in every one it starts. The
# tests of that choice clear the variable in the processes they start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU, Triton kernels run through Triton's interpreter. The flag is read when a kernel is
# decorated, so it must be set before anything imports palestra's Triton modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for a module: two intra-op threads on a busy two-core machine are far slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The tiny transformer the run tests train: small enough for a CPU test, big enough to move.
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 256, "init_std": 0.02, "seed": None}


@pytest.fixture(scope="session")
def raw_config() -> Callable[..., dict[str, Any]]:
    """``raw_config(output_dir="runs", name="r", sections=None, **train)``: a run's config as a fresh dict, what a
    config file holds, to edit, dump to YAML or validate.

    The run carries every kind of state a resume must restore: reinforce with replay and running normalisation, a
    layered (stateful) reward whose correctness layer unlocks on a moving average, a cosine schedule, 4 steps with a
    checkpoint every 2. The eager kernels: no native build in a subprocess. A jsonl log, not metrics.jsonl: no
    dashboard at the end. ``sections`` replaces whole sections (a test of another policy, optimiser or reward);
    the ``train`` keywords then update the train section."""

    def make(
        output_dir: str | Path = "runs", name: str = "r", sections: dict[str, Any] | None = None, **train: Any
    ) -> dict[str, Any]:
        raw: dict[str, Any] = {
            "run": {"name": name, "seed": 0, "output_dir": str(output_dir)},
            "environment": {"name": "arithmetic",
                            "options": {"difficulty": 1, "terms": 2, "operations": ["+"], "prompt": "{question} ="}},
            "reward": {"name": "layered",
                       "options": {"layers": [{"name": "format"}, {"name": "correctness", "unlock_at": 0.3}],
                                   "ema_decay": 0.9}},
            "policy": {"name": "tiny", "options": dict(TINY)},
            "optimizer": {"name": "reinforce",
                          "options": {"normalize": True, "replay_capacity": 2, "replay_rows": 4, "entropy_coef": 0.01}},
            "generator": {"name": "kv_cache"},
            "kernels": {"backend": "torch"},
            "loggers": [{"name": "jsonl", "options": {"filename": "log.jsonl"}}],
            "train": {"steps": 4, "batch_size": 4, "group_size": 4, "lr": 5e-3, "lr_schedule": "cosine",
                      "max_new_tokens": 6, "device": "cpu", "eval_size": 4, "eval_every": 0, "log_every": 1,
                      "save_every": 2, "keep_checkpoints": 2},
        }  # fmt: skip
        raw.update(copy.deepcopy(sections or {}))
        raw["train"].update(train)
        return raw

    return make


# A kernel test that builds or runs the C++/CUDA code, named so by its test id (cpp, cuda, native, sm90): marked
# `native`, so `pytest -m "not native"` runs where no compiler is at hand. The two all-native modules mark themselves.
_NATIVE = re.compile(r"cpp|cuda|native|sm90")


def pytest_collection_finish(session: pytest.Session) -> None:
    # The minutes-long learning runs start now, on the core the rest of the suite leaves free (background_runs.py).
    if not session.config.option.collectonly:
        background_runs.start(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    background_runs.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.as_posix()
        if ("/tests/kernels/" in path or "/bench/" in path) and _NATIVE.search(item.name):
            item.add_marker(pytest.mark.native)
        # The session's plugin installs (tests/core/plugin_installs.py: eight pip installs, 20-40 s once) and the
        # `python -m palestra` each such test starts: slow, so the fast tier runs without installing anything.
        if "sites" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
