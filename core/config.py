"""One typed configuration tree: loading (YAML or TOML), ``key=value`` overrides, validation, component building.

A config is plain data checked against dataclasses. Sections (``run``, ``train``, ``kernels``) are dataclasses
here; component nodes (``environment``, ``reward``, ``policy``, ``optimizer``, ``generator``, ``loggers``)
are ``{name: <registered name>, options: {...}}`` whose options are checked against the dataclass the
component's plugin registered (``register(name, factory, options=Options)``). Nested component nodes (the
layers of a ``layered`` reward) are fields typed as a :class:`ComponentSpec` subclass, checked the same way.

Every problem is a :class:`ConfigError` whose message is one line starting with the full dotted path of
the culprit::

    train.lr: expected a float, got 'fast'
    reward.options.layers[1].unlock_at: must be <= 1, got 2.0
    trian: unknown key; did you mean 'train'?

Field constraints: annotate with a type (``int``, ``float``, ``str``, ``bool``, ``Literal[...]``,
``X | None``, ``list[X]``, ``dict[str, X]``, a dataclass, a ComponentSpec subclass) and use
:func:`option` for bounds; a dataclass's ``__post_init__`` may raise :class:`OptionError` for checks
across fields.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import math
import numbers
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

from .registry import KINDS, Registration, Registry, RegistryError

__all__ = [
    "ComponentSpec",
    "Config",
    "AgentsConfig",
    "ConfigError",
    "DistributedConfig",
    "EnvironmentSpec",
    "GeneratorSpec",
    "KernelsConfig",
    "LoggerSpec",
    "OptimizerSpec",
    "OptionError",
    "PolicySpec",
    "RewardSpec",
    "RunConfig",
    "TrainConfig",
    "build_component",
    "check_options",
    "default_registry",
    "load_config",
    "option",
    "parse_override",
    "to_plain",
    "validate_config",
]


# ---- errors ------------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A configuration problem. The message is one line that starts with the dotted path of the culprit."""

    palestra_user_error = True

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # one line, whatever went into it


class OptionError(ConfigError):
    """Raised by an options dataclass's ``__post_init__``: ``key`` is relative to the dataclass (``"layers[0].weight"``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key, self.message = key, " ".join(str(message).split())
        super().__init__(f"{key}: {self.message}")


# ---- declaring options -------------------------------------------------------------------------------
def option(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with bounds checked at validation (``None`` values skip the bounds)."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={"bounds": bounds})
    return field(default=default, metadata={"bounds": bounds})


@dataclass
class ComponentSpec:
    """A config node naming a registered component: ``{name: ..., options: {...}}``.

    Before validation ``options`` is a mapping; after it, an instance of the options dataclass the
    component registered (``None`` when it takes none) and ``path`` is where the node sits in the config.
    Subclasses fix the kind and may add fields of their own (a weighted-sum term adds ``weight``).
    """

    KIND: ClassVar[str] = ""

    name: str
    options: Any = field(default_factory=dict)
    path: str = field(default="", init=False, repr=False, compare=False)

    def build(self, *, registry: Registry | None = None) -> Any:
        """Build the component this node describes (see :func:`build_component`)."""
        return build_component(self.KIND, self, path=self.path or self.KIND, registry=registry)


@dataclass
class EnvironmentSpec(ComponentSpec):
    KIND: ClassVar[str] = "environment"


@dataclass
class RewardSpec(ComponentSpec):
    KIND: ClassVar[str] = "reward"


@dataclass
class OptimizerSpec(ComponentSpec):
    KIND: ClassVar[str] = "optimizer"


@dataclass
class PolicySpec(ComponentSpec):
    KIND: ClassVar[str] = "policy"


@dataclass
class LoggerSpec(ComponentSpec):
    KIND: ClassVar[str] = "logger"


@dataclass
class GeneratorSpec(ComponentSpec):
    KIND: ClassVar[str] = "generator"


SPEC_TYPES: dict[str, type[ComponentSpec]] = {
    cls.KIND: cls for cls in (EnvironmentSpec, RewardSpec, OptimizerSpec, PolicySpec, LoggerSpec, GeneratorSpec)
}
assert set(SPEC_TYPES) == set(KINDS), "every component kind needs a spec type"


# ---- the config tree ---------------------------------------------------------------------------------
@dataclass
class RunConfig:
    name: str = "arithmetic"
    seed: int = option(0, ge=0)
    output_dir: str = "runs"  # checkpoints and logs go to <output_dir>/<name>


@dataclass
class DistributedConfig:
    """Multi-process training under torchrun (ignored in a single process)."""

    strategy: Literal["ddp", "fsdp"] = "ddp"  # fsdp: FSDP2 fully_shard, parameters sharded across ranks
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: float = option(600.0, gt=0)  # a collective waiting longer (a dead rank) fails every rank


@dataclass
class AgentsConfig:
    """Multi-agent training: which policy layers the agents share, and how rewards are credited.

    Layer names are the policy's layer groups (the tiny and HF policies: ``embedding``, ``encoder``,
    ``decoder``). Every group is in exactly one list; all shared or all independent are special cases.
    """

    shared_layers: list[str] = field(default_factory=lambda: ["embedding", "encoder", "decoder"])
    independent_layers: list[str] = field(default_factory=list)
    update_frequency: int = option(1, ge=1)  # the shared layers take one optimiser step every N updates
    credit: Literal["team", "role"] = "team"  # team: the episode's reward for every agent; role: each agent's own


@dataclass
class KernelsConfig:
    backend: Literal["auto", "torch", "cpp", "cuda", "triton"] = "auto"  # auto: chosen per device


@dataclass
class TrainConfig:
    """The training loop's knobs. ``batch_size`` tasks per step, each answered ``group_size`` times."""

    steps: int = option(200, ge=1)
    batch_size: int = option(8, ge=1)  # tasks (prompts) per step
    group_size: int = option(4, ge=1)  # completions per task (GRPO's G)
    lr: float = option(1e-5, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = option(0, ge=0)
    weight_decay: float = option(0.0, ge=0)
    max_grad_norm: float | None = option(1.0, gt=0)  # None: no clipping
    grad_accum: int = option(1, ge=1)  # micro-batches per optimiser step
    updates_per_batch: int = option(1, ge=1)  # passes over each rollout (TRL num_iterations, PPO epochs)
    max_new_tokens: int = option(64, ge=1)
    temperature: float = option(1.0, ge=0)
    top_p: float = option(1.0, gt=0, le=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"  # auto: cuda if available, else cpu
    log_every: int = option(1, ge=1)
    eval_every: int = option(0, ge=0)  # held-out evaluation every N steps (0: only before and after training)
    eval_size: int = option(64, ge=1)  # held-out tasks per evaluation (greedy decoding, every reward layer counted)
    reward_ema: float = option(0.9, ge=0, lt=1)  # decay of the logged reward moving average (reward/ema)
    track_update_ratio: bool = True  # log ||Δθ||/||θ|| (grad/update_ratio); costs one copy of the weights per step
    save_every: int = option(0, ge=0)  # checkpoint every N steps; 0: only at the end
    keep_checkpoints: int = option(3, ge=1)  # the newest K step checkpoints are kept
    # Mixed precision (torch.amp autocast): compute in bf16/fp16 while weights stay in `dtype`; fp16 adds dynamic
    # loss scaling. Log-probs and losses are fp32 whatever this is.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    gradient_checkpointing: bool = False  # recompute each transformer block's activations in the backward pass
    token_budget: int | None = option(None, ge=1)  # micro-batches of at most this many tokens (prompt + completion)
    auto_micro_batch: bool = False  # size micro-batches from free memory; halve them on out-of-memory
    offload_reference: bool = False  # keep the frozen reference policy in CPU memory
    offload_optimizer: bool = False  # keep optimiser state (and an fp32 master copy) in CPU memory
    # Resilience: a step (rollout, reward, update or data) longer than this dumps every thread's stack and exits.
    step_timeout_s: float | None = option(None, gt=0)
    data_timeout_s: float | None = option(120.0, gt=0)  # one environment reset/step longer than this fails the run
    max_bad_steps: int = option(3, ge=1)  # non-finite loss or reward: skip the step; this many in a row abort

    def __post_init__(self) -> None:
        rows = self.batch_size * self.group_size
        if rows % self.grad_accum:
            raise OptionError(
                "grad_accum", f"must divide batch_size * group_size = {rows} (rows per step), got {self.grad_accum}"
            )


def _default_environment() -> EnvironmentSpec:
    # Sums of two operands in 0..4: 25 facts a ~130k-parameter model learns from random weights by RL alone
    # in a few minutes on 2 CPU cores (all 100 one-digit sums stay at chance level in that budget). A short
    # prompt: the built-in policy reads characters, so every prompt character costs compute.
    return EnvironmentSpec("arithmetic", {"difficulty": 1, "max_operand": 4, "prompt": "{question} ="})


def _default_reward() -> RewardSpec:
    # The built-in curriculum: reward the answer format first; correctness joins once the format is learnt.
    return RewardSpec(
        "layered",
        {
            "layers": [
                # format: the whole completion is one <answer> tag holding a number. Anchored, so that text
                # around the tag earns nothing: otherwise the entropy bonus is spent on filler around a
                # collapsed answer instead of keeping the answer digits diverse.
                {"name": "format", "options": {"pattern": "^<answer>-?[0-9]+</answer>$"}},
                {"name": "correctness", "unlock_at": 0.5},
            ]
        },
    )


def _default_train() -> TrainConfig:
    # Sized for the built-in task and policy (a ~130k-parameter model from random weights, answers of a few
    # tokens): a learning rate far above what a pretrained LLM wants. A config file's own `train` section
    # starts from the TrainConfig defaults instead.
    return TrainConfig(steps=2000, batch_size=16, group_size=8, lr=1e-3, max_new_tokens=6)


@dataclass
class Config:
    """The whole configuration. ``Config()`` (all defaults) describes the built-in task."""

    run: RunConfig = field(default_factory=RunConfig)
    environment: EnvironmentSpec = field(default_factory=_default_environment)
    reward: RewardSpec = field(default_factory=_default_reward)
    policy: PolicySpec = field(default_factory=lambda: PolicySpec("tiny"))
    optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec("grpo", {"entropy_coef": 0.05}))
    generator: GeneratorSpec = field(default_factory=lambda: GeneratorSpec("kv_cache"))
    loggers: list[LoggerSpec] = field(default_factory=lambda: [LoggerSpec("console"), LoggerSpec("jsonl")])
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    train: TrainConfig = field(default_factory=_default_train)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    agents: AgentsConfig | None = None  # None: one policy for every agent (the single-agent case)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, scalars) with every default filled in; what ``palestra config show`` prints."""
        return to_plain(self)


# ---- the registry used for validation and building ---------------------------------------------------
_ACTIVE_REGISTRY: contextvars.ContextVar[Registry | None] = contextvars.ContextVar("palestra_registry", default=None)


def default_registry() -> Registry:
    """The registry of the installed plugins (built by the plugin manager, cached there)."""
    from .plugin_manager import get_registry

    return get_registry()


def _registry() -> Registry:
    return _ACTIVE_REGISTRY.get() or default_registry()


# ---- loading -----------------------------------------------------------------------------------------
def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, registry: Registry | None = None
) -> Config:
    """Read a YAML or TOML file (the built-in default when ``path`` is None), apply ``key=value`` overrides, validate."""
    raw = to_plain(Config())
    if path is not None:
        raw.update(read_config_file(path))  # sections the file names replace the defaults wholesale
    for text in overrides:
        keys, value = parse_override(text)
        _set_path(raw, keys, value)
    return validate_config(raw, registry=registry)


def validate_config(raw: Mapping[str, Any], *, registry: Registry | None = None) -> Config:
    """Check plain config data against :class:`Config` and every component's options; return the typed tree."""
    token = _ACTIVE_REGISTRY.set(registry or _ACTIVE_REGISTRY.get() or default_registry())
    try:
        return _convert(raw, Config, "")
    finally:
        _ACTIVE_REGISTRY.reset(token)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's top-level mapping; ``.yaml``/``.yml`` or ``.toml``."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"config file {str(p)!r}: unknown format {suffix or '(no suffix)'!r}; use .yaml, .yml or .toml")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
    if suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError:
                raise ConfigError(f"config file {str(p)!r}: reading TOML needs Python 3.11+ or the tomli package") from None
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections ({', '.join(f.name for f in dataclasses.fields(Config))}), "
            f"got {_kind_of(data)}"
        )
    return dict(data)


# ---- overrides ---------------------------------------------------------------------------------------
_KEY = r"[A-Za-z_][A-Za-z0-9_\-]*"
_OVERRIDE_KEY = re.compile(rf"^{_KEY}(\[\d+\])*(\.{_KEY}(\[\d+\])*)*$")


@dataclass(frozen=True)
class _Override:
    """An override's value: parsed as a YAML scalar, but the literal text is kept for fields typed ``str``."""

    text: str
    parsed: Any


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``"train.lr=3e-4"`` -> (["train", "lr"], value). Values are YAML (scalars, ``[a, b]`` lists, ``{k: v}``)."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value (for example train.lr=3e-4)")
    if not _OVERRIDE_KEY.match(key):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted key (for example reward.options.layers[1].weight)")
    keys: list[str | int] = []
    for part in key.split("."):
        name, *indices = re.split(r"\[", part)
        keys.append(name)
        keys.extend(int(i.rstrip("]")) for i in indices)
    try:
        parsed = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: cannot parse the value: {getattr(e, 'problem', None) or e}") from None
    value = parsed if isinstance(parsed, (list, dict)) else _Override(value_text.strip(), parsed)
    return keys, value


def _set_path(raw: dict[str, Any], keys: list[str | int], value: Any) -> None:
    node: Any = raw
    for depth, key in enumerate(keys[:-1]):
        where = _format_path(keys[: depth + 1])
        nxt = keys[depth + 1]
        if isinstance(key, int):
            if not isinstance(node, list):
                raise ConfigError(f"{where}: {_format_path(keys[:depth])} is not a list, so it cannot be indexed")
            if key >= len(node):
                raise ConfigError(f"{where}: index out of range (the list has {len(node)} items)")
            child = node[key]
        else:
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {_format_path(keys[:depth])} is not a mapping")
            child = node.get(key)
            if child is None:
                if isinstance(nxt, int):
                    raise ConfigError(f"{_format_path(keys[: depth + 2])}: {where} is not a list in this config")
                child = node[key] = {}
        if isinstance(nxt, int) and not isinstance(child, list):
            raise ConfigError(f"{_format_path(keys[: depth + 2])}: {where} is {_kind_of(child)}, not a list")
        if isinstance(nxt, str) and not isinstance(child, dict):
            raise ConfigError(f"{_format_path(keys[: depth + 2])}: {where} is {_kind_of(child)}, not a mapping")
        node = child
    last = keys[-1]
    if isinstance(last, int):
        if last >= len(node):
            raise ConfigError(f"{_format_path(keys)}: index out of range (the list has {len(node)} items)")
        node[last] = value
    else:
        node[last] = value


def _format_path(keys: Sequence[str | int]) -> str:
    out = ""
    for key in keys:
        out = f"{out}[{key}]" if isinstance(key, int) else _join(out, key)
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---- validation --------------------------------------------------------------------------------------
def check_options(cls: type, values: Mapping[str, Any], *, where: str) -> Any:
    """Validate ``values`` against the dataclass ``cls`` the way configs are (used when building in Python)."""
    return _convert(dict(values), cls, where)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the type ``tp`` and return it converted (dataclasses built); ConfigError otherwise."""
    if isinstance(value, _Override):
        value = value.text if _wants_text(tp) else value.parsed
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return _convert_union(value, tp, path)
    if origin is Literal:
        return _convert_literal(value, typing.get_args(tp), path)
    if origin in (list, tuple, Sequence):
        return _convert_list(value, tp, path)
    if origin in (dict, Mapping) or tp is dict:
        return _convert_dict(value, tp, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(value, tp, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected a boolean (true or false), got {_show(value)}")
    if tp is int:
        number = _number(value)
        if number is None or (isinstance(number, float) and not number.is_integer()):
            raise ConfigError(f"{path}: expected an integer, got {_show(value)}")
        return int(number)
    if tp is float:
        number = _number(value)
        if number is None:
            raise ConfigError(f"{path}: expected a float, got {_show(value)}")
        if not math.isfinite(number):
            raise ConfigError(f"{path}: expected a finite float, got {_show(value)}")
        return float(number)
    if tp is str:
        if isinstance(value, str):
            return value
        hint = " (quote it)" if isinstance(value, (int, float)) else ""
        raise ConfigError(f"{path}: expected a string, got {_show(value)}{hint}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{path}: expected {tp.__name__}, got {_show(value)}")
    raise ConfigError(f"{path}: cannot check values of type {tp!r} (an options dataclass uses an unsupported annotation)")


def _wants_text(tp: Any) -> bool:
    """Should an override's literal text be used (rather than its YAML reading) for a field typed ``tp``?"""
    if tp is str:
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return len(args) == 1 and _wants_text(args[0])
    return False


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            return float(value.strip()) if value.strip() else None
        except ValueError:
            return None
    return None


def _convert_union(value: Any, tp: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if value is None or (isinstance(value, str) and value in ("null", "~", "None") and type(None) in args):
        if type(None) in args:
            return None
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:
        return _convert(value, members[0], path)
    for member in members:
        try:
            return _convert(value, member, path)
        except ConfigError:
            continue
    raise ConfigError(f"{path}: expected {' or '.join(_describe(m) for m in args)}, got {_show(value)}")


def _convert_literal(value: Any, choices: tuple[Any, ...], path: str) -> Any:
    for choice in choices:
        if value == choice and type(value) is type(choice):
            return choice
    msg = f"{path}: expected one of {', '.join(repr(c) for c in choices)}, got {_show(value)}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
    raise ConfigError(msg)


def _convert_list(value: Any, tp: Any, path: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list, got {_show(value)}")
    args = typing.get_args(tp)
    item_tp = args[0] if args else Any
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item_tp = args[0]
    return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]


def _convert_dict(value: Any, tp: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
    args = typing.get_args(tp)
    value_tp = args[1] if len(args) == 2 else Any
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise ConfigError(f"{path}: keys must be strings, got {_show(k)}")
        out[k] = _convert(v, value_tp, _join(path, k))
    return out


def _init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _convert_dataclass(value: Any, cls: type, path: str) -> Any:
    if isinstance(value, cls):  # already checked (built in Python, or by an outer validation)
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {_show(value)}")
    flds = _init_fields(cls)
    names = [f.name for f in flds]
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{path or 'config'}: keys must be strings, got {_show(key)}")
        if key not in names:
            raise ConfigError(f"{_join(path, key)}: unknown key{_suggest(key, names)}")
    hints = _hints(cls)
    is_spec = issubclass(cls, ComponentSpec)
    kwargs: dict[str, Any] = {}
    for f in flds:
        fpath = _join(path, f.name)
        if is_spec and f.name == "options":
            continue  # checked below, against the options the named component registered
        if f.name in value:
            v = value[f.name]
        elif f.default is not MISSING:
            v = to_plain(f.default)
        elif f.default_factory is not MISSING:
            v = to_plain(f.default_factory())
        else:
            raise ConfigError(f"{fpath}: missing required key")
        kwargs[f.name] = _check_bounds(_convert(v, hints[f.name], fpath), f, fpath)
    if is_spec:
        kwargs["options"] = _convert_component_options(cls, kwargs["name"], value.get("options"), path)
    try:
        obj = cls(**kwargs)
    except OptionError as e:
        raise ConfigError(f"{_join(path, e.key) if not e.key.startswith('[') else path + e.key}: {e.message}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None
    if is_spec:
        obj.path = path
    return obj


def _convert_component_options(cls: type[ComponentSpec], name: str, options: Any, path: str) -> Any:
    kind = cls.KIND
    reg = _lookup(_registry(), kind, name, path)
    opath = _join(path, "options")
    if reg.options is None:
        if options and not (dataclasses.is_dataclass(options)):
            keys = list(options) if isinstance(options, Mapping) else options
            raise ConfigError(f"{opath}: {kind} {name!r} takes no options, got {_show(keys)}")
        return None
    if isinstance(options, reg.options):
        return options
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{opath}: expected a mapping of options for {kind} {name!r}, got {_show(options)}")
    return _convert(options, reg.options, opath)


def _lookup(registry: Registry, kind: str, name: str, path: str) -> Registration:
    if not name:
        known = ", ".join(registry.names(kind)) or "none are installed"
        raise ConfigError(f"{_join(path, 'name')}: is empty; name a registered {kind} ({known})")
    try:
        return registry.get(kind, name)
    except RegistryError as e:
        extra = "" if registry.names(kind) else f"; the installed plugins register no {kind}"
        raise ConfigError(f"{_join(path, 'name')}: {e}{extra}") from None


def _check_bounds(value: Any, f: dataclasses.Field[Any], path: str) -> Any:
    bounds = f.metadata.get("bounds") if f.metadata else None
    if not bounds or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    checks = {"ge": (lambda a, b: a >= b, ">="), "gt": (lambda a, b: a > b, ">"), "le": (lambda a, b: a <= b, "<="), "lt": (lambda a, b: a < b, "<")}
    for key, bound in bounds.items():
        ok, sign = checks[key]
        if not ok(value, bound):
            raise ConfigError(f"{path}: must be {sign} {bound}, got {value!r}")
    return value


def _suggest(key: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known keys: {', '.join(names)})" if names else " (no keys are allowed here)"


def _describe(tp: Any) -> str:
    names = {int: "an integer", float: "a float", str: "a string", bool: "a boolean", type(None): "null"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return "a list"
    if origin in (dict, Mapping) or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", repr(tp))


def _kind_of(value: Any) -> str:
    if isinstance(value, _Override):
        value = value.parsed
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"{value!r}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- plain data --------------------------------------------------------------------------------------
def to_plain(obj: Any) -> Any:
    """Dataclasses (config sections, specs, options) -> dicts; lists/tuples -> lists; scalars unchanged."""
    if isinstance(obj, _Override):
        return obj.parsed
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_plain(getattr(obj, f.name)) for f in _init_fields(type(obj))}
        if isinstance(obj, ComponentSpec) and out.get("options") is None:
            out["options"] = {}
        return out
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


# ---- building ----------------------------------------------------------------------------------------
class ComponentBuildError(ConfigError):
    """A component's factory raised while building it from its (valid) config node."""


def build_component(kind: str, spec: ComponentSpec | Mapping[str, Any], *, path: str, registry: Registry | None = None) -> Any:
    """Build the registered ``kind`` component that the config node ``spec`` names, with its validated options.

    ``spec`` is a validated :class:`ComponentSpec` (from :func:`load_config`) or plain ``{name, options}``
    data (validated here, errors naming ``path``). Rewards come back wrapped in
    :class:`palestra.rewards.CheckedReward`, so every call's output is checked. Components nested in the
    options (a combinator's terms) are built through the same registry.
    """
    if kind not in SPEC_TYPES:
        raise ConfigError(f"{path}: unknown component kind {kind!r}; the kinds are {', '.join(SPEC_TYPES)}")
    registry = registry or _ACTIVE_REGISTRY.get() or default_registry()
    token = _ACTIVE_REGISTRY.set(registry)
    try:
        if not (isinstance(spec, ComponentSpec) and spec.path and spec.KIND == kind):
            spec = _convert(to_plain(spec), SPEC_TYPES[kind], path)
        assert isinstance(spec, ComponentSpec)
        reg = _lookup(registry, kind, spec.name, path)
        opts = spec.options
        kwargs = {f.name: getattr(opts, f.name) for f in _init_fields(type(opts))} if opts is not None else {}
        try:
            component = reg.factory(**kwargs)
        except ConfigError:
            raise
        except Exception as e:
            who = f"plugin {reg.plugin!r}" + (f", distribution {reg.distribution!r}" if reg.distribution else "")
            raise ComponentBuildError(f"{path}: building {kind} {spec.name!r} ({who}) failed: {type(e).__name__}: {e}") from e
    finally:
        _ACTIVE_REGISTRY.reset(token)
    if kind == "reward":
        from .rewards import CheckedReward

        if not isinstance(component, CheckedReward):
            component = CheckedReward(component, name=spec.name, path=path)
    return component
