import os

import torch

# Without a GPU, Triton kernels run through Triton's interpreter. The flag is read when a kernel is
# decorated, so it must be set before anything imports palestra's Triton modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
