"""The config tree's shape: sections as dataclasses, component nodes as :class:`ComponentSpec`, and
:func:`option` for a field's bounds. The built-in default run lives here too (``Config()``)."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar, Literal

from palestra.errors import OptionError
from palestra.registry import KINDS, Registry


# ---- declaring options -------------------------------------------------------------------------------
def option(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    path: str | None = None,
    runs_code: bool = False,
    key: str | None = None,
) -> Any:
    """A dataclass field with bounds checked at validation (``None`` values skip the bounds).

    ``path`` declares a file or folder option and what a relative value is relative to: ``"cwd"`` (the working
    directory), ``"run"`` (the run folder) or the name of another path option of the same dataclass (a file in
    that folder). ``runs_code`` declares an option that, set, runs code shipped with its data (transformers'
    ``trust_remote_code``). A config read back from a checkpoint uses neither kind of value when it reaches
    outside the run folder unless the user passes it again (:mod:`palestra.config.untrusted`). ``key``: the name
    the option has in a config when it is not the field's (``train.async``: ``async`` is a Python keyword)."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    metadata = {"bounds": bounds, "path": path, "runs_code": runs_code, "key": key}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


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
        from .building import build_component  # building validates through this module's classes

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


@dataclass
class ToolSpec(ComponentSpec):
    KIND: ClassVar[str] = "tool"


@dataclass
class ToolParserSpec(ComponentSpec):
    KIND: ClassVar[str] = "tool_parser"


@dataclass
class AgentSpec(ComponentSpec):
    """The ``agent:`` section (docs/environments.md): agent code that plays the environment's tasks through the rollout
    endpoint, an OpenAI-compatible API the policy under training serves on 127.0.0.1. Its requests are the episode's
    turns, sampled by the rollout like any other."""

    KIND: ClassVar[str] = "agent"

    max_turns: int = option(4, ge=1)  # requests per episode; one more is refused and the episode ends truncated
    max_concurrency: int | None = option(None, ge=1)  # agents running their own code at once; None: every row
    request_timeout_s: float = option(60.0, gt=0)  # an agent silent this long (no request, no answer) ends its episode
    max_tokens: int | None = option(None, ge=1)  # the episode's whole token sequence, as tools.max_tokens; None: no cap
    tool_parser: ToolParserSpec = field(default_factory=lambda: ToolParserSpec("hermes"))  # tool_calls in responses
    host: str = "127.0.0.1"  # the endpoint binds to the loopback address only

    def __post_init__(self) -> None:
        if self.host not in ("127.0.0.1", "localhost"):
            raise OptionError(
                "host",
                "the rollout endpoint binds to 127.0.0.1 only (it serves the policy to local agents); "
                f"got {self.host!r}",
            )


SPEC_TYPES: dict[str, type[ComponentSpec]] = {
    cls.KIND: cls
    for cls in (
        EnvironmentSpec,
        RewardSpec,
        OptimizerSpec,
        PolicySpec,
        LoggerSpec,
        GeneratorSpec,
        ToolSpec,
        ToolParserSpec,
        AgentSpec,
    )
}
assert set(SPEC_TYPES) == set(KINDS), "every component kind needs a spec type"


# ---- the config tree ---------------------------------------------------------------------------------
@dataclass
class RunConfig:
    name: str = "arithmetic"
    # 0 .. 2**63-1, a signed 64-bit integer: inside what torch.manual_seed accepts (it fails past 2**64-1) and
    # as wide as the seeds the run derives from it (derive_seed draws 63 bits).
    seed: int = option(0, ge=0, le=2**63 - 1)
    output_dir: str = "runs"  # checkpoints and logs go to <output_dir>/<name>

    def __post_init__(self) -> None:
        if why := _not_one_component(self.name):
            raise OptionError(
                "name", f"{why}, got {self.name[:80]!r}; a run name is one folder name inside run.output_dir"
            )


# The longest file name ext4, xfs, btrfs and tmpfs take (NAME_MAX), in bytes of the name's encoding.
NAME_MAX_BYTES = 255


def _not_one_component(name: str) -> str | None:
    """Why ``name`` is not a single folder name (None when it is): the run folder must stay inside output_dir."""
    if not name.strip():
        return "is empty"
    if name in (".", ".."):
        return "names the output folder or its parent"
    if "/" in name or "\\" in name or "\0" in name:
        return "holds a path separator or NUL"
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX_BYTES:
        return f"is longer than a file name may be ({NAME_MAX_BYTES} bytes)"
    return None


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
class ToolsConfig:
    """Tools around the environment (docs/tools.md): each episode becomes a tool-use loop. The model's turn either
    calls tools (read by ``parser``), whose results come back as ``tool`` messages for its next turn, or answers; the
    environment and the reward see the answer. An episode ends at the answer, after ``max_tool_calls`` calls
    (unanswered), or when its token sequence reaches ``max_tokens`` (unanswered)."""

    tools: list[ToolSpec] = field(default_factory=list)
    parser: ToolParserSpec = field(default_factory=lambda: ToolParserSpec("hermes"))
    max_tool_calls: int = option(4, ge=0)  # calls per episode; one more and the episode ends unanswered
    max_tokens: int | None = option(None, ge=1)  # the episode's whole sequence (prompt, turns, results); None: no cap
    max_result_chars: int = option(2000, ge=16)  # a tool's result is cut to this many characters (said in the text)
    system_prompt: str | None = None  # put before the tools' description (a task instruction); None: none

    def __post_init__(self) -> None:
        if not self.tools:
            raise OptionError("tools", "lists no tool; name at least one (palestra plugins lists the tools)")


@dataclass
class KernelsConfig:
    backend: Literal["auto", "torch", "cpp", "cuda", "triton"] = "auto"  # auto: chosen per device


@dataclass
class AsyncConfig:
    """Asynchronous rollouts (docs/scale.md): a generation worker process samples step t+lag's batch with the weights
    of step t while the learner updates on batch t. ``lag`` 0 is the synchronous loop (no worker)."""

    lag: int = option(1, ge=0)  # steps between the weights a batch is sampled with and the step that trains on it
    threads: int = option(1, ge=1)  # the worker's CPU threads (the learner's come from train.threads)
    start_timeout_s: float = option(600.0, gt=0)  # building the worker's copy of the run (a model load) may take this


# train.device: what torch.device accepts and the trainer places a run on (``cuda:01`` is not a torch device).
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:(0|[1-9][0-9]*))?")
DEVICE_CHOICES = "auto, cpu, cuda, cuda:<n> (a GPU index such as cuda:0) or mps"


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
    max_new_tokens: int = option(64, ge=1)  # per turn
    # A multi-turn episode of one agent trains as one token sequence (its turns and the messages between them, the
    # loss on the agent's own tokens) or as one row per turn; auto: one sequence where the policy's prompts extend
    # each other (a prefix-preserving chat template) and one agent acts, per-turn rows otherwise (said at start-up)
    trajectory: Literal["auto", "sequence", "per_turn"] = "auto"
    temperature: float = option(1.0, ge=0)
    top_p: float = option(1.0, gt=0, le=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # CPU threads for torch; null: OMP_NUM_THREADS if set, else the cores found idle when the run starts (printed)
    threads: int | None = option(None, ge=1)
    device: str = "auto"  # auto: cuda if available, else cpu; cuda, cuda:<n>, mps (whether they exist: preflight)
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
    # When training ends, write the policy as a transformers folder: what `palestra export` writes (docs/export.md).
    export: bool = False
    export_dir: str | None = option(None, path="cwd")  # where; null: <run directory>/export
    export_merge_lora: bool = True  # a LoRA policy: adapters merged into the weights, or (false) base + peft adapter
    # Rollouts generated in a worker process, `lag` steps ahead of the learner (docs/scale.md); null: synchronous
    async_: AsyncConfig | None = option(None, key="async")  # noqa: RUF009 - option() returns a dataclass field

    def __post_init__(self) -> None:
        if self.export_dir is not None and not self.export_dir.strip():
            raise OptionError(
                "export_dir", f"must name a folder (or be null for <run directory>/export), got {self.export_dir!r}"
            )
        if self.export_dir is not None and not self.export:
            raise OptionError(
                "export_dir",
                f"is {self.export_dir!r} but train.export is false, so nothing would be "
                "written there; set train.export=true (or drop export_dir)",
            )
        if not (isinstance(self.device, str) and DEVICE_PATTERN.fullmatch(self.device)):
            hint = "; did you mean 'cuda'?" if str(self.device).lower() in ("gpu", "cuda:", "nvidia") else ""
            raise OptionError("device", f"expected {DEVICE_CHOICES}, got {self.device!r}{hint}")
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
    tools: ToolsConfig | None = None  # None: no tool-use loop around the environment
    agent: AgentSpec | None = None  # None: no agent code around the environment (no rollout endpoint)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, scalars) with every default filled in; what ``palestra config show`` prints."""
        from .validation import to_plain

        return to_plain(self)
