"""One typed configuration tree: loading (YAML or TOML), ``key=value`` overrides, validation, component building.

A config is plain data checked against dataclasses. Sections (``run``, ``train``, ``kernels``) are dataclasses
(:mod:`.schema`); component nodes (``environment``, ``reward``, ``policy``, ``optimizer``, ``generator``,
``loggers``) are ``{name: <registered name>, options: {...}}`` whose options are checked against the dataclass
the component's plugin registered (``register(name, factory, options=Options)``). Nested component nodes (the
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

The modules: :mod:`.schema` (the tree and the default run), :mod:`.validation` (plain data -> typed tree),
:mod:`.loading` (files and overrides), :mod:`.building` (a node -> its component), :mod:`.errors`, and
:mod:`.preflight` (what this machine must provide for a valid config: device, back end, folders, memory;
imported by the commands that train, since it needs torch).
"""

from palestra.errors import ComponentBuildError, ConfigError, OptionError

from .building import RunComponents, build_component, build_run
from .loading import _set_path as _set_path  # re-exported: palestra.cli.train applies its overrides with it
from .loading import load_config, parse_override, read_config_file, validate_config
from .schema import (
    SPEC_TYPES,
    AgentsConfig,
    ComponentSpec,
    Config,
    DistributedConfig,
    EnvironmentSpec,
    GeneratorSpec,
    KernelsConfig,
    LoggerSpec,
    OptimizerSpec,
    PolicySpec,
    RewardSpec,
    RunConfig,
    ToolParserSpec,
    ToolsConfig,
    ToolSpec,
    TrainConfig,
    option,
)
from .validation import check_options, default_registry, format_fields, to_plain

__all__ = [
    "SPEC_TYPES",
    "AgentsConfig",
    "ComponentBuildError",
    "ComponentSpec",
    "Config",
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
    "RunComponents",
    "RunConfig",
    "ToolParserSpec",
    "ToolSpec",
    "ToolsConfig",
    "TrainConfig",
    "build_component",
    "build_run",
    "check_options",
    "default_registry",
    "format_fields",
    "load_config",
    "option",
    "parse_override",
    "read_config_file",
    "to_plain",
    "validate_config",
]
