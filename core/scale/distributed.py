"""Multi-process training under torchrun: the process group, gradient averaging, FSDP2 sharding, reductions.

``torchrun --nproc_per_node=N -m palestra train ...`` starts N copies of the trainer; torchrun sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` and :meth:`DistributedContext.from_config`
turns them into a process group (gloo on CPU, NCCL on CUDA, ``distributed.backend``) whose collectives time out
after ``distributed.timeout_s``: a rank that dies makes the others fail instead of waiting forever. A single
process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) gets a trivial context: every method is a no-op or the identity.

Strategies (``distributed.strategy``):

* ``ddp``: every rank holds the whole model; after the backward pass :meth:`sync_gradients` averages the
  gradients over ranks (flattened into buckets, one all-reduce each), so every rank takes the same optimiser
  step and the weights stay identical. This is what ``DistributedDataParallel`` does, done explicitly because a
  policy is driven through ``score`` and ``decode_step`` rather than ``forward``, which is where DDP hooks in;
  it also keeps gradient accumulation free of ``no_sync`` bookkeeping (one all-reduce per optimiser step).
* ``fsdp``: FSDP2 :func:`torch.distributed.fsdp.fully_shard` on each transformer block and on the policy
  itself; parameters, gradients and optimiser state are sharded across ranks (DTensors). The policy's entry
  points (``score``, ``decode_step``, and a causal-LM policy's ``trunk``) are registered with torch's
  ``register_fsdp_forward_method``, so that FSDP's hooks gather the root parameters around each call.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DistributedContext", "find_blocks"]

# Metrics that are throughputs: summed over ranks (every other metric is averaged).
_SUMMED_PREFIXES = ("perf/tokens_per_s", "perf/gen_tokens_per_s")
_BUCKET_BYTES = 32 * 2**20


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (torchrun sets it)") from None


@dataclass
class DistributedContext:
    """Who this process is among the ranks of a torchrun job, and the collectives the trainer needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: no process group (a single process)
    strategy: str = "ddp"
    timeout_s: float = 600.0

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, device: str = "auto") -> DistributedContext:
        """Read torchrun's environment; join (or create) the process group when ``WORLD_SIZE > 1``.

        ``device`` is ``train.device``: ``auto`` picks ``cuda:<LOCAL_RANK>`` when CUDA is available, else the CPU.
        """
        import torch.distributed as dist

        d = config.distributed
        world = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        local_rank = _env_int("LOCAL_RANK", 0)
        want_cuda = device == "cuda" or device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if world <= 1:
            dev = torch.device(device if device != "auto" else ("cuda" if want_cuda else "cpu"))
            return cls(device=dev, strategy=d.strategy, timeout_s=d.timeout_s)
        if want_cuda:
            if device not in ("auto", "cuda"):
                raise ValueError(
                    f"train.device: under torchrun use 'auto' or 'cuda' (one GPU per rank), got {device!r}"
                )
            dev = torch.device("cuda", local_rank)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        backend = d.backend if d.backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
        if backend == "nccl" and dev.type != "cuda":
            raise ValueError("distributed.backend: nccl needs CUDA devices; use gloo (or auto) on the CPU")
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                timeout=datetime.timedelta(seconds=d.timeout_s),
                device_id=dev if dev.type == "cuda" else None,
            )
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            device=dev,
            backend=backend,
            strategy=d.strategy,
            timeout_s=d.timeout_s,
        )

    # ---- who am I ------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """True when there is a process group (more than one rank)."""
        return self.backend is not None and self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, plots and writes checkpoints."""
        return self.rank == 0

    @property
    def fsdp(self) -> bool:
        return self.enabled and self.strategy == "fsdp"

    def local_batch_size(self, batch_size: int) -> int:
        """This rank's share of ``train.batch_size`` tasks (it must divide evenly)."""
        if batch_size % self.world_size:
            raise ValueError(
                f"train.batch_size: {batch_size} tasks cannot be split evenly over {self.world_size} ranks; "
                f"use a multiple of {self.world_size}"
            )
        return batch_size // self.world_size

    def close(self) -> None:
        import torch.distributed as dist

        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives (identity in a single process) --------------------------------------------------
    def barrier(self) -> None:
        import torch.distributed as dist

        if self.enabled:
            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import torch.distributed as dist

        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        import torch.distributed as dist

        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_mean(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """Average float metrics over ranks (throughputs are summed); a key some rank lacks averages over the others."""
        if not self.enabled:
            return dict(metrics)
        gathered = self.all_gather_object({k: float(v) for k, v in metrics.items()})
        out: dict[str, float] = {}
        for key in dict.fromkeys(k for part in gathered for k in part):  # first-seen order
            values = [part[key] for part in gathered if key in part]
            total = sum(values)
            out[key] = total if key.startswith(_SUMMED_PREFIXES) else total / len(values)
        return out

    def merge_moments(self, moments: Any) -> Any:
        """Merge a :class:`palestra.kernels.RunningMoments` over ranks (exact Chan merge, identical on every rank)."""
        if self.enabled and moments is not None:
            moments.all_reduce()
        return moments

    def any_true(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one."""
        import torch.distributed as dist

        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ---- parameters and gradients --------------------------------------------------------------------
    def broadcast_module(self, module: torch.nn.Module, src: int = 0) -> None:
        """Copy rank ``src``'s parameters and buffers to every rank (identical starting weights)."""
        import torch.distributed as dist

        if not self.enabled:
            return
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                if _is_dtensor(t):
                    continue  # sharded by FSDP from already-identical full tensors
                dist.broadcast(t.data, src=src)

    def sync_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average the plain (non-DTensor) gradients over ranks in place; the trainer installs it as the
        algorithm's ``grad_sync``, called after the backward passes and before unscaling and clipping.

        A parameter without a gradient on some rank counts as a zero gradient there (every rank takes part in
        the same collectives whatever its micro-batches touched). FSDP's own gradients (DTensors) are already
        reduce-scattered and are skipped.
        """
        import torch.distributed as dist

        if not self.enabled:
            return
        plain = [p for p in params if not _is_dtensor(p)]
        if not plain:
            return
        grads: list[torch.Tensor] = []
        for p in plain:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        for bucket in _buckets(grads, _BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            offset = 0
            for g in bucket:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n

    @contextlib.contextmanager
    def gathered(self, policy: torch.nn.Module) -> Iterator[None]:
        """FSDP2: hold the whole policy unsharded for the block (generation); a no-op otherwise.

        Generation runs a different number of decode steps on each rank (rows finish at different lengths), so
        per-call all-gathers would not line up across ranks and would deadlock. Instead every rank gathers every
        module once, in lockstep, generates with no collectives, and reshards after. Peak memory during rollout
        is one full copy of the weights per rank (as in the RL frameworks that generate under FSDP).
        """
        if not self.fsdp:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in policy.modules() if isinstance(m, FSDPModule)]
        # The root keeps FSDP's own choice for it (no resharding after a forward: training all-gathers it again at
        # once), which is also what lets score's own call of trunk, both registered forward methods, run nested.
        blocks = [m for m in modules if m is not policy]
        for m in blocks:
            m.set_reshard_after_forward(False, recurse=False)
        for m in modules:
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
            for m in blocks:
                m.set_reshard_after_forward(True, recurse=False)

    def shard(self, policy: torch.nn.Module) -> torch.nn.Module:
        """FSDP2: ``fully_shard`` every transformer block, then the policy (the root); a no-op for ddp/one rank."""
        if not self.fsdp:
            return policy
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        blocks = find_blocks(policy)
        if not blocks:
            raise ValueError(
                f"distributed.strategy: fsdp found no transformer blocks (an nn.ModuleList of layers) in "
                f"{type(policy).__name__}; use ddp"
            )
        for block in blocks:
            fully_shard(block)
        fully_shard(policy)
        # FSDP2 makes the first module to run a forward the root of every state; the rollout and the learner call the
        # policy itself (a multi-agent policy routes rows to its views inside), so that is always the policy.
        for name in _forward_methods(policy):
            register_fsdp_forward_method(policy, name)
        # The blocks return views of their input's storage; nothing downstream modifies them in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return policy


def load_full_state_dict(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state dict into an FSDP2-sharded ``module``: each rank keeps its shard of every tensor.

    Why not ``set_model_state_dict``: a multi-agent policy shares modules between its agents' views, so one parameter
    has several names; torch's loader shards it under one name and then copies a plain tensor into the DTensor under
    the others ("mixed torch.Tensor and DTensor"). ``named_parameters`` lists every tensor once. Collective: every
    rank calls it with the same state.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name not in state:
                raise KeyError(f"the checkpoint has no {name!r}")
            full = state[name].to(dtype=tensor.dtype)
            if isinstance(tensor, DTensor):
                tensor.copy_(
                    distribute_tensor(full.to(tensor.device_mesh.device_type), tensor.device_mesh, tensor.placements)
                )
            else:
                tensor.copy_(full)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of same-dtype, same-device tensors of at most ``limit`` bytes (one tensor may exceed it)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out and out[-1][0].dtype == t.dtype and out[-1][0].device == t.device and size + nbytes <= limit:
            out[-1].append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the children of the largest ``nn.ModuleList`` whose children share one class."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best = list(module)
    return best


# ---- FSDP2 entry points ------------------------------------------------------------------------------
def _forward_methods(policy: torch.nn.Module) -> tuple[str, ...]:
    """The methods a policy is driven through instead of ``forward``: every policy's ``score`` (training) and
    ``decode_step`` (generation), and a causal-LM policy's ``trunk`` (the learner's hidden-state diagnostics).

    FSDP2 gathers a module's sharded parameters in a forward pre-hook and registers the backward hooks on the
    forward's outputs; ``register_fsdp_forward_method`` runs those hooks around these methods as well. A multi-agent
    policy has no trunk of its own: its views' trunks run inside its ``score`` and ``decode_step``.
    """
    from palestra.models.policy import CausalLMPolicy

    return ("score", "decode_step", "trunk") if isinstance(policy, CausalLMPolicy) else ("score", "decode_step")
