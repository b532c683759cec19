import os
import re
from collections.abc import Iterator

import pytest
import torch

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


# A kernel test that builds or runs the C++/CUDA code, named so by its test id (cpp, cuda, native, sm90): marked
# `native`, so `pytest -m "not native"` runs where no compiler is at hand. The two all-native modules mark themselves.
_NATIVE = re.compile(r"cpp|cuda|native|sm90")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.as_posix()
        if ("/tests/kernels/" in path or "/bench/" in path) and _NATIVE.search(item.name):
            item.add_marker(pytest.mark.native)
