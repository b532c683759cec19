"""Benchmark cases for the fused log-prob gather with entropy (used by ``palestra bench``,
bench/gpu_check.py and bench/test_bench_logprob_entropy.py).

``cases(device, quick)`` returns one dict per (op, size, implementation); ``fn`` runs one call. Two ops:

* ``logprob_entropy``: the forward pass (log-probs of the sampled tokens and the entropy).
* ``logprob_entropy_fwd_bwd``: forward, then the gradient of ``sum(g1 * logp + g2 * entropy)`` with
  respect to the logits (``torch.autograd.grad``, so no ``.grad`` accumulation is timed).

Baselines, measured in the same run:

* ``sum``: ``logits.sum(-1)``, one read pass over the logits (the floor for a one-pass forward);
* ``torch-eager``: ``log_softmax`` + ``gather`` + entropy ``-(p * log p).sum(-1)``, with autograd;
* ``trl``: TRL's ``selective_log_softmax`` + ``entropy_from_logits`` (``trl.trainer.utils``); on a GPU
  TRL routes both to its own fused Triton kernel. Raises ImportError when trl is not installed (the
  benchmark then reports or skips that row).

Sizes: CPU 4096 x 32768 fp32 (quick: 512 x 32768); GPU 8192 x 151936 bf16 (a Qwen-sized vocabulary;
quick: 1024 x 32768 bf16). ``bytes`` is what the op must move at least: the logits read once forward;
read twice and the gradient written once for forward + backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import palestra.kernels as K

OP_FWD = "logprob_entropy"
OP_FWD_BWD = "logprob_entropy_fwd_bwd"


def sizes(device: str, quick: bool) -> list[tuple[int, int, torch.dtype]]:
    if device == "cuda":
        return [(1024, 32768, torch.bfloat16)] if quick else [(8192, 151936, torch.bfloat16)]
    return [(512, 32768, torch.float32)] if quick else [(4096, 32768, torch.float32)]


def inputs(n_rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Random logits (scale 2, like a trained LM head's spread), tokens (none ignored, so that skipping
    ignored rows flatters nothing), and random upstream gradients for the backward pass."""
    # Generated on the device itself: the GPU size is 1.2 G logits, slow to draw on a CPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(n_rows, vocab, generator=gen, device=device) * 2.0).to(dtype)
    tokens = torch.randint(0, vocab, (n_rows,), generator=gen, device=device)
    g_logp = torch.randn(n_rows, generator=gen, device=device)
    g_ent = torch.randn(n_rows, generator=gen, device=device)
    return logits, tokens, g_logp, g_ent


# ---- the implementations, as (logits, tokens) -> (logp, entropy) -------------------------------------
def ours(backend: str) -> Callable:
    return lambda logits, tokens: K.logprob_entropy(logits, tokens, backend=backend)


def torch_eager(logits: torch.Tensor, tokens: torch.Tensor):
    """What an RL trainer writes without a fused kernel."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    keep = tokens != -100
    logp = log_p.gather(-1, torch.where(keep, tokens, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logp * keep, entropy * keep


def trl(logits: torch.Tensor, tokens: torch.Tensor):
    """TRL's helpers (imported on use; ImportError if trl is missing)."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    keep = tokens != -100
    logp = selective_log_softmax(logits, torch.where(keep, tokens, 0))
    return logp * keep, entropy_from_logits(logits) * keep


def forward_fn(impl: Callable, logits, tokens) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return impl(logits, tokens)

    return run


def fwd_bwd_fn(impl: Callable, logits, tokens, g_logp, g_ent) -> Callable[[], object]:
    leaf = logits.detach().requires_grad_(True)

    def run():
        logp, entropy = impl(leaf, tokens)
        return torch.autograd.grad((logp, entropy), leaf, (g_logp, g_ent))[0]

    return run


def cases(device: str, quick: bool) -> list[dict]:
    ours_backends = ["cuda", "triton"] if device == "cuda" else ["cpp"]
    out: list[dict] = []
    for n_rows, vocab, dtype in sizes(device, quick):
        logits, tokens, g_logp, g_ent = inputs(n_rows, vocab, dtype, device)
        size = f"{n_rows}x{vocab} {str(dtype).removeprefix('torch.')}"
        nbytes = logits.numel() * logits.element_size()
        fwd = [(b, ours(b), False) for b in ours_backends]
        fwd += [("sum", lambda x, t: x.sum(-1), True), ("torch-eager", torch_eager, True), ("trl", trl, True)]
        for impl, fn, baseline in fwd:
            out.append(
                {
                    "op": OP_FWD,
                    "size": size,
                    "impl": impl,
                    "fn": forward_fn(fn, logits, tokens),
                    "baseline": baseline,
                    "bytes": nbytes,
                }
            )
        bwd = [(b, ours(b), False) for b in ours_backends] + [("torch-eager", torch_eager, True), ("trl", trl, True)]
        for impl, fn, baseline in bwd:
            out.append(
                {
                    "op": OP_FWD_BWD,
                    "size": size,
                    "impl": impl,
                    "fn": fwd_bwd_fn(fn, logits, tokens, g_logp, g_ent),
                    "baseline": baseline,
                    "bytes": 3 * nbytes,
                }
            )
    return out
