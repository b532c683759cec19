"""Scale: torchrun (DDP, FSDP2), mixed precision, micro-batching with token budgets, CPU offload."""
