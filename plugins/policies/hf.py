"""The ``hf`` policy: a local HuggingFace ``transformers`` causal LM and its tokenizer as a :class:`CausalLMPolicy`.

Everything is read from local folders (``local_files_only``): nothing is ever downloaded. Every problem a
config can cause (a missing folder, a model that is not a causal LM, a tokenizer that does not fit the model,
an unsupported dtype) is a one-line :class:`palestra.config.ConfigError` naming the option, raised while the
policy is built and before any compute.

The model runs through its own trunk (``model.get_decoder()``: embeddings, layers, final norm) with the
positions and padding mask :class:`CausalLMPolicy` computes, so a left-padded row scores exactly like the
same row unpadded, and through its own output head (``model.get_output_embeddings()``), which the fused
log-prob kernel consumes. The KV cache is transformers' own ``DynamicCache``.

Loading this plugin imports neither torch nor transformers: :class:`HFPolicy` is defined on first use
(``palestra config`` and ``palestra plugins`` stay fast).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from palestra import hookimpl
from palestra.config import ConfigError, OptionError, check_options

if TYPE_CHECKING:
    import torch
    from palestra.types import Observation

WHERE = "policy.options"  # where the options sit in a config; errors name keys below it


@dataclass
class HFOptions:
    path: str  # a local folder holding a transformers causal LM (config.json, weights) and, by default, its tokenizer
    tokenizer_path: str | None = None  # a folder holding the tokenizer; null: the model's folder
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: the dtype the checkpoint was saved in
    chat_template: Literal["auto", "on", "off"] = "auto"  # auto: apply the tokenizer's template when it has one
    trust_remote_code: bool = False  # run modelling code shipped inside the folder (only for folders you trust)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (transformers' own switch)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"

    def __post_init__(self) -> None:
        if not self.path.strip():
            raise OptionError("path", "must name a local folder holding a transformers causal LM, got ''")
        if self.tokenizer_path is not None and not self.tokenizer_path.strip():
            raise OptionError("tokenizer_path", "must name a local folder holding a tokenizer (or be null), got ''")


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


def _check_folder(key: str, folder: str, *, what: str, needs: str | None = None) -> Path:
    p = Path(folder).expanduser()
    if not p.exists():
        raise ConfigError(f"{WHERE}.{key}: {folder!r} does not exist; name a local folder holding {what} (nothing is downloaded)")
    if not p.is_dir():
        raise ConfigError(f"{WHERE}.{key}: {folder!r} is not a folder; name a local folder holding {what}")
    if needs is not None and not (p / needs).is_file():
        raise ConfigError(f"{WHERE}.{key}: {folder!r} holds no {needs}, so it is not a saved {what}")
    return p


def _vocab_rows(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    return int(rows) if isinstance(rows, int) else None


def _resolve_dtype(choice: str, config: Any) -> torch.dtype:
    import torch

    if choice == "auto":
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
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

        The wrapped model is ``self.model`` (a ``PreTrainedModel``); the adapted tokenizer is
        ``self.tokenizer`` (its transformers tokenizer is ``self.tokenizer.hf``). Built in training mode,
        like any fresh ``torch.nn.Module``; the trainer switches modes.
        """

        def __init__(self, **options: Any) -> None:
            super().__init__()
            self.options: HFOptions = check_options(HFOptions, options, where=WHERE)
            o = self.options
            model_dir = str(_check_folder("path", o.path, what="a transformers causal LM", needs="config.json"))
            tok_key = "tokenizer_path" if o.tokenizer_path is not None else "path"
            tok_dir = model_dir
            if o.tokenizer_path is not None:
                tok_dir = str(_check_folder("tokenizer_path", o.tokenizer_path, what="a transformers tokenizer"))

            import transformers

            common = {"local_files_only": True, "trust_remote_code": o.trust_remote_code}
            try:
                config = transformers.AutoConfig.from_pretrained(model_dir, **common)
            except Exception as e:  # noqa: BLE001  (unknown model type, untrusted remote code, bad json, ...)
                raise ConfigError(f"{WHERE}.path: cannot read the model config in {model_dir!r}: {_first_line(e)}") from None
            self._check_causal(config, model_dir)
            dtype = _resolve_dtype(o.dtype, config)

            try:
                hf_tok = transformers.AutoTokenizer.from_pretrained(tok_dir, **common)
            except Exception as e:  # noqa: BLE001  (a folder can fail to load in many ways; all are config errors)
                raise ConfigError(f"{WHERE}.{tok_key}: cannot load a tokenizer from {tok_dir!r}: {_first_line(e)}") from None
            eos_fallback = getattr(config, "eos_token_id", None)
            if isinstance(eos_fallback, (list, tuple)):
                eos_fallback = eos_fallback[0] if eos_fallback else None
            try:
                self.tokenizer = HFTokenizer(hf_tok, eos_token_id=eos_fallback)
            except ValueError as e:
                raise ConfigError(f"{WHERE}.{tok_key}: the tokenizer at {tok_dir!r}: {e}") from None
            paths = {"model_dir": model_dir, "tok_dir": tok_dir, "tok_key": tok_key}
            rows = _vocab_rows(config)
            if rows is not None:  # before loading any weights: a mismatch should not cost a 10 GB read
                _check_tokenizer_fits(self.tokenizer, rows, **paths)
            self._use_chat = self._chat_choice(o.chat_template, tok_key, tok_dir)

            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    model_dir, attn_implementation=o.attn_implementation, **{_dtype_kwarg(): dtype}, **common
                )
            except Exception as e:  # noqa: BLE001  (a folder can fail to load in many ways; all are config errors)
                key = "attn_implementation" if "attn" in str(e).lower() else "path"
                raise ConfigError(f"{WHERE}.{key}: cannot load the model from {model_dir!r}: {_first_line(e)}") from None
            _check_tokenizer_fits(self.tokenizer, model.get_input_embeddings().num_embeddings, **paths)
            if o.gradient_checkpointing:
                self._enable_checkpointing(model, model_dir)
            model.train()  # like any fresh module; from_pretrained hands back eval mode
            self.model = model
            self._decoder = model.get_decoder()
            params = inspect.signature(self._decoder.forward).parameters
            # transformers 5 renamed the cache argument ``past_key_values`` -> ``cache``
            self._cache_arg = "cache" if "cache" in params else "past_key_values"

        # -- construction checks --
        @staticmethod
        def _check_causal(config: Any, model_dir: str) -> None:
            from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

            remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
            if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote:
                archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
                raise ConfigError(
                    f"{WHERE}.path: {model_dir!r} holds a {config.model_type!r} model ({archs}), which is not a "
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
                self._enable_checkpointing(self.model, self.options.path)
            elif hasattr(self.model, "activation_checkpointing_disable"):  # transformers >= 5.x name
                if self.model.is_activation_checkpointing:
                    self.model.activation_checkpointing_disable()
            elif self.model.is_gradient_checkpointing:
                self.model.gradient_checkpointing_disable()
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
            return self.model.get_output_embeddings()

        def layer_groups(self) -> dict[str, list[str]]:
            """embedding: the input embeddings; decoder: the decoder's final norm, the output head (and value
            head); encoder: every other child of the decoder (the layers, rotary tables, ...)."""
            names = {id(m): n for n, m in self.named_modules(remove_duplicate=False) if n.startswith("model.")}
            embed = self.model.get_input_embeddings()
            final_norm = next((getattr(self._decoder, a) for a in ("norm", "final_layernorm", "ln_f")
                               if isinstance(getattr(self._decoder, a, None), torch.nn.Module)), None)
            decoder = [names[id(m)] for m in (final_norm, self.model.get_output_embeddings()) if m is not None]
            decoder += ["value_head"] if self.value_head is not None else []
            encoder = [names[id(m)] for m in self._decoder.children() if m is not embed and m is not final_norm]
            return {"embedding": [names[id(embed)]], "encoder": encoder, "decoder": decoder}

        @property
        def hidden_size(self) -> int:
            return int(self._text_config().hidden_size)

        def keep_untied(self) -> None:
            self.model.config.tie_word_embeddings = False  # transformers' tie_weights() reads it

        def model_dims(self) -> dict[str, int]:
            text = self._text_config()
            heads = int(getattr(text, "num_attention_heads", 1) or 1)
            return {"layers": int(text.num_hidden_layers), "hidden": int(text.hidden_size), "heads": heads, "vocab": len(self.tokenizer)}

        def _text_config(self) -> Any:
            """The language model's config (a multimodal config nests it)."""
            config = self.model.config
            return config.get_text_config() if hasattr(config, "get_text_config") else config

        def encode_prompt(self, observation: Observation) -> list[int]:
            """The chat template over ``observation.messages`` when enabled and present; the prompt text otherwise."""
            if self._use_chat and observation.messages:
                text = self.tokenizer.apply_chat_template([m.as_dict() for m in observation.messages])
                return self.tokenizer.encode(text)
            return self.tokenizer.encode(observation.prompt)

        # -- export --
        def save_pretrained(self, folder: str | Path) -> None:
            """Write the model and tokenizer in transformers' format (loadable again as ``policy: hf``)."""
            self.model.save_pretrained(folder)
            self.tokenizer.hf.save_pretrained(folder)

    HFPolicy.__qualname__ = "HFPolicy"  # pickle and reprs find it as palestra.plugins.policies.hf.HFPolicy
    HFPolicy.__module__ = __name__
    return HFPolicy


def build_hf_policy(**options: Any) -> Any:
    """The registered factory: ``HFPolicy(**options)``."""
    return _policy_class()(**options)


def __getattr__(name: str) -> Any:
    if name == "HFPolicy":
        return _policy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def register_policies(register: Any) -> None:
    register(
        "hf",
        build_hf_policy,
        options=HFOptions,
        description="a local HuggingFace transformers causal LM and its tokenizer (never downloads)",
    )
