"""Built-in policy ``tiny``: a small decoder-only transformer with a character-level tokenizer.

Trained from a random init, it is what ``palestra train`` runs by default on 2 CPU cores. This module holds
the options and the registration only, so that listing plugins does not import torch; the model itself is
:class:`palestra.plugins.policies._tiny_model.TinyTransformerPolicy`, also importable from here
(``from palestra.plugins.policies.tiny import TinyTransformerPolicy`` loads it on first use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from palestra import hookimpl
from palestra.config import OptionError, option
from palestra.plugins.policies.char_tokenizer import check_vocabulary

if TYPE_CHECKING:
    from palestra.plugins.policies._tiny_model import TinyTransformerPolicy

# Digits, the operators and what arithmetic prompts put between them. Anything else in a prompt becomes <unk>
# (or is dropped with unknown="drop"); the answer tags are atoms.
DEFAULT_ALPHABET = "0123456789+-*= ?"


@dataclass
class TinyOptions:
    d_model: int = option(64, ge=8)  # width of the residual stream
    n_layers: int = option(2, ge=1)
    n_heads: int = option(4, ge=1)  # must divide d_model, leaving an even head size (RoPE rotates pairs)
    d_ff: int = option(256, ge=1)  # hidden width of the SwiGLU MLP
    max_len: int = option(256, ge=2)  # longest sequence (prompt + completion) the policy accepts
    tie_embeddings: bool = True  # the output head reuses the token embedding matrix
    init_std: float = option(0.02, gt=0)  # std of the normal init of every weight matrix
    rope_base: float = option(10000.0, gt=1)  # RoPE frequency base
    alphabet: str = DEFAULT_ALPHABET  # characters that are single tokens
    atoms: list[str] = field(default_factory=lambda: ["<answer>", "</answer>"])  # multi-character single tokens
    unknown: Literal["unk", "drop"] = "unk"  # characters outside the alphabet: <unk> tokens, or dropped
    seed: int | None = (
        None  # seeds the initial weights; None draws them from torch's global RNG (seeded by the trainer)
    )
    gradient_checkpointing: bool = False  # recompute each block in the backward pass (training only) to save memory

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise OptionError("n_heads", f"must divide d_model={self.d_model}, got n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise OptionError(
                "n_heads",
                f"d_model / n_heads = {self.d_model // self.n_heads} must be even (RoPE rotates pairs of dimensions); "
                f"got d_model={self.d_model}, n_heads={self.n_heads}",
            )
        problem = check_vocabulary(self.alphabet, self.atoms, self.unknown)
        if problem is not None:
            raise OptionError(*problem)


def __getattr__(name: str) -> Any:
    # The model class is loaded (with torch) on first use; see the module docstring.
    if name == "TinyTransformerPolicy":
        from palestra.plugins.policies._tiny_model import TinyTransformerPolicy

        return TinyTransformerPolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_tiny_policy(**options: Any) -> TinyTransformerPolicy:
    """The registered factory: a :class:`TinyTransformerPolicy` with these (validated) options."""
    from palestra.plugins.policies._tiny_model import TinyTransformerPolicy

    return TinyTransformerPolicy(**options)


@hookimpl
def register_policies(register: Any) -> None:
    register(
        "tiny",
        build_tiny_policy,
        options=TinyOptions,
        description=(
            "a small decoder-only transformer (RoPE, RMSNorm, SwiGLU) with a character tokenizer, trained from scratch"
        ),
    )


__all__ = ["DEFAULT_ALPHABET", "TinyOptions", "TinyTransformerPolicy", "build_tiny_policy"]
