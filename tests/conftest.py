import os
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
