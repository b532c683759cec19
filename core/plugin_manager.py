"""Palestra's plugin manager: finds the plugins, loads them, and builds the component registry from them.

Every plugin, built-in or not, is a module named by an entry point in the ``palestra`` group::

    [project.entry-points.palestra]
    example = "palestra_example"

The built-ins are the palestra distribution's own entry points (pyproject.toml declares one per module under
:data:`BUILTIN_PACKAGE`), so they are found and registered exactly the way third-party plugins are, from the
installed metadata alone: an editable install, ``pip install .`` and ``pip install --target`` all work the same.
They load first, in module order (so grouped by kind). What differs is failure:

* a built-in that is missing or fails (import or registration) means the install is broken: hard error;
* a third-party distribution whose plugin fails to import, or raises inside a ``register_*`` hook, is
  disabled with ONE :class:`PalestraPluginWarning` naming the distribution and the error, and recorded as a
  :class:`~palestra.registry.BrokenPlugin`, so that asking the registry for something it might have provided
  later says why it is missing. Everything else keeps working.
* a plugin implementing a hook that does not exist (usually a misspelling, ``register_reward``) is a hard
  error naming the plugin, its distribution and the hook: otherwise the hook would silently never run.
* a third-party plugin that calls ``sys.exit()`` while loading or in a ``register_*`` hook is disabled the same way
  (the warning says it called ``sys.exit(N)``): a plugin does not decide that palestra exits;
* what a third-party plugin prints while it loads or registers goes to stderr, so stdout keeps the command's answer
  (``palestra plugins --json``, ``palestra config show``); one that takes more than :data:`SLOW_PLUGIN_S` seconds
  to import or to register is named on stderr (once), and waited for.
* a plugin declaring the plugin API versions it supports (``PALESTRA_PLUGIN_API = ">=2.0,<3"`` in its module)
  that exclude :data:`palestra.hookspecs.PLUGIN_API` is disabled with one warning naming it and both versions.

Environment variables, read when the manager is first built (call :func:`reset` to re-read them):

* ``PALESTRA_LOAD_PLUGINS=a,b`` loads only the named third-party distributions (``""``: none). The built-ins
  are always loaded.
* ``PALESTRA_TRACE_PLUGINS=1`` writes every plugin load and every hook call (with the plugins it reaches) to stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from palestra import hookspecs
from palestra.registry import KINDS, BrokenPlugin, Registration, Registry

ENTRY_POINT_GROUP = "palestra"
DISTRIBUTION = "palestra"  # the distribution whose entry points are the built-ins
LOAD_PLUGINS_ENV = "PALESTRA_LOAD_PLUGINS"
TRACE_PLUGINS_ENV = "PALESTRA_TRACE_PLUGINS"

BUILTIN_PACKAGE = "palestra.plugins"  # where every built-in plugin module lives
# A third-party plugin still importing (or registering) after this many seconds is named on stderr: a plugin that
# reaches the network or builds a cache at import would otherwise look like palestra hanging.
SLOW_PLUGIN_S = 5.0


class PalestraPluginWarning(UserWarning):
    """A third-party plugin was disabled because it failed; the message names its distribution and the error."""


class PluginError(RuntimeError):
    """The set of plugins cannot be used as installed. The message is one line naming the plugin and distribution."""

    palestra_user_error = True


class BuiltinPluginError(PluginError):
    """A built-in plugin is missing or failed: palestra itself is broken, so the full traceback matters."""

    palestra_user_error = False


@dataclass(frozen=True)
class PluginInfo:
    """One loaded (or failed) plugin, as ``palestra plugins`` shows it."""

    name: str  # its name in the plugin manager (the entry point's name)
    module: str  # where the plugin object lives (the entry point's value)
    distribution: str | None
    version: str | None
    builtin: bool
    hooks: tuple[str, ...]  # the hooks it implements
    error: str | None = None  # why it is disabled; None when it works
    api: str | None = None  # the plugin API versions it declares it supports (a specifier), None: undeclared


@dataclass
class _State:
    manager: pluggy.PluginManager
    plugins: list[PluginInfo]  # load order; includes the failed ones
    broken: list[BrokenPlugin]
    registry: Registry | None = None
    building: bool = False  # set while the register_* hooks run


_lock = threading.RLock()
_state: _State | None = None


# ---- public API --------------------------------------------------------------------------------------
def get_plugin_manager() -> pluggy.PluginManager:
    """The plugin manager with the built-ins and the installed plugins loaded and checked (cached)."""
    return _get_state().manager


def get_registry() -> Registry:
    """Every registered component, built by calling each plugin's ``register_*`` hooks (cached)."""
    with _lock:
        state = _get_state()
        if state.registry is None:
            if state.building:  # a register_* hook asked for the registry it is helping to build
                raise RuntimeError(
                    "get_registry() was called from inside a register_* hook, while the registry is being built"
                )
            state.building = True
            try:
                state.registry = _build_registry(state)
            finally:
                state.building = False
        return state.registry


def plugin_infos() -> list[PluginInfo]:
    """Every plugin in load order, built-ins first, including the ones disabled because they failed."""
    with _lock:
        get_registry()  # a plugin can also fail while registering
        return list(_get_state().plugins)


def reset() -> None:
    """Forget the loaded plugins and the registry; the next call loads them again (and re-reads the environment)."""
    global _state
    with _lock:
        _state = None


# ---- loading -----------------------------------------------------------------------------------------
_loading = False


def _get_state() -> _State:
    global _state, _loading
    with _lock:
        if _state is None:
            if _loading:  # a plugin module asked for the manager while being imported by it
                raise RuntimeError(
                    "the plugin manager was asked for while it is loading plugins (at a plugin's import time)"
                )
            _loading = True
            try:
                _state = _Loader().load()
            finally:
                _loading = False
        return _state


class _Loader:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.broken: list[BrokenPlugin] = []
        self.dist_names = _DistributionNames()
        if _env_flag(TRACE_PLUGINS_ENV):
            _enable_tracing(self.pm)
        self.trace = self.pm.trace.root.get("palestra")

    def load(self) -> _State:
        self._load_builtins()
        self._load_third_party(_requested_distributions())
        self._check_pending()
        theirs = {p.name: p for p in self.plugins if not p.builtin and p.error is None}
        if theirs:  # without third-party plugins, hook calls stay exactly as they were
            _watch_lifecycle_hooks(self.pm, theirs)
        return _State(manager=self.pm, plugins=self.plugins, broken=self.broken)

    def _load_builtins(self) -> None:
        try:
            dist = metadata.distribution(DISTRIBUTION)
        except metadata.PackageNotFoundError:
            raise BuiltinPluginError(
                f"the {DISTRIBUTION!r} distribution is not installed, so its built-in plugins cannot be found; "
                "install it (pip install -e .)"
            ) from None
        for ep in _builtin_entry_points(dist):
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as e:
                raise BuiltinPluginError(
                    f"built-in plugin {ep.name!r} ({ep.value}) failed to "
                    f"load: {_one_line(e)}; the palestra install is broken"
                ) from e
            self._loaded(plugin, ep.name, ep.value, dist, builtin=True)

    def _load_third_party(self, requested: set[str] | None) -> None:
        by_dist = _third_party_entry_points(self.dist_names)
        if requested is not None:
            for name in sorted(requested - by_dist.keys()):
                warnings.warn(
                    f"{LOAD_PLUGINS_ENV} names {name!r}, which is not an installed distribution with "
                    f"{ENTRY_POINT_GROUP!r} entry points",
                    PalestraPluginWarning,
                    stacklevel=2,
                )
        for key in sorted(by_dist):
            if requested is not None and key not in requested:
                continue
            dist, eps = by_dist[key]
            self._load_distribution(dist, eps)

    def _load_distribution(self, dist: metadata.Distribution, eps: list[metadata.EntryPoint]) -> None:
        """Load every plugin of one distribution, or none of them: a half-loaded distribution is not usable."""
        registered: list[tuple[str, Any, metadata.EntryPoint]] = []
        module = eps[0].value
        try:
            for ep in eps:
                module = ep.value
                with _plugin_code(self.dist_names.name(dist), ep.value, "loading"):
                    plugin = ep.load()
                _check_api(plugin, ep.name)
                name = ep.name if self.pm.get_plugin(ep.name) is None else f"{self.dist_names.name(dist)}:{ep.name}"
                self.pm.register(plugin, name=name)
                registered.append((name, plugin, ep))
        except IncompatiblePlugin as e:
            for name, _, _ in registered:
                self.pm.unregister(name=name)
            self._disable(", ".join(ep.name for ep in eps), eps[0].value, dist, str(e), api=e.declared)
            return
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a failing third-party plugin is disabled, not fatal
            for name, _, _ in registered:
                self.pm.unregister(name=name)
            error = f"{_plugin_failure(e, module)} (while loading)"
            self._disable(", ".join(ep.name for ep in eps), eps[0].value, dist, error)
            return
        for name, plugin, ep in registered:
            self._loaded(plugin, name, ep.value, dist, builtin=False)

    def _loaded(self, plugin: object, name: str, module: str, dist: metadata.Distribution, *, builtin: bool) -> None:
        hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(self.pm.get_plugin(name)) or ()))
        dist_name, version = self.dist_names.name(dist), self.dist_names.version(dist)
        api = _declared_api(plugin)
        self.plugins.append(
            PluginInfo(
                name=name, module=module, distribution=dist_name, version=version, builtin=builtin, hooks=hooks, api=api
            )
        )
        self.trace("loaded", "built-in" if builtin else "third-party", "plugin", repr(name), "from", dist_name, version)

    def _disable(
        self, name: str, module: str, dist: metadata.Distribution, error: str, *, api: str | None = None
    ) -> None:
        dist_name, version = self.dist_names.name(dist), self.dist_names.version(dist)
        _warn_broken(dist_name, error)
        self.broken.append(BrokenPlugin(plugin=name, distribution=dist_name, error=error))
        self.plugins.append(
            PluginInfo(
                name=name,
                module=module,
                distribution=dist_name,
                version=version,
                builtin=False,
                hooks=(),
                error=error,
                api=api,
            )
        )

    def _check_pending(self) -> None:
        """Fail on hooks no spec knows: pluggy would otherwise never call them, silently."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            name = self.pm.get_name(e.plugin) or repr(e.plugin)
            info = next((p for p in self.plugins if p.name == name), None)
            unknown = [h.name for h in self.pm.get_hookcallers(e.plugin) or () if not h.has_spec()]
            specs = [n for n in dir(hookspecs) if n.startswith(("register_", "on_"))]
            parts = []
            for hook in unknown:
                close = difflib.get_close_matches(hook, specs, n=1)
                parts.append(f"{hook!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            who = f"plugin {name!r}" + (f" (distribution {info.distribution!r})" if info and info.distribution else "")
            cls = BuiltinPluginError if info is not None and info.builtin else PluginError
            raise cls(
                f"{who} implements unknown hook {', '.join(parts)}; the hooks are defined in palestra.hookspecs"
            ) from e


class _DistributionNames:
    """A distribution's name and version, read once per distribution.

    ``Distribution.name`` and ``.version`` parse the METADATA file again on every access (about 0.4 ms each);
    asked per entry point and per plugin, that was ~30 ms of the ~180 ms ``palestra plugins`` takes.
    """

    def __init__(self) -> None:
        # id(dist) -> (dist, name, version); the dist is kept so that its id is not reused while cached
        self._seen: dict[int, tuple[metadata.Distribution, str, str | None]] = {}

    def _read(self, dist: metadata.Distribution) -> tuple[metadata.Distribution, str, str | None]:
        known = self._seen.get(id(dist))
        if known is None:
            md = dist.metadata
            known = self._seen[id(dist)] = (dist, md["Name"], md["Version"])
        return known

    def name(self, dist: metadata.Distribution) -> str:
        return self._read(dist)[1]

    def version(self, dist: metadata.Distribution) -> str | None:
        return self._read(dist)[2]


def _builtin_entry_points(dist: metadata.Distribution) -> list[metadata.EntryPoint]:
    """The palestra distribution's ``palestra`` entry points, in module order; each must name a module under
    :data:`BUILTIN_PACKAGE`, and there must be some: otherwise the installed metadata is not palestra's own."""
    eps = sorted(dist.entry_points.select(group=ENTRY_POINT_GROUP), key=lambda ep: ep.value)
    stray = [f"{ep.name} = {ep.value}" for ep in eps if not ep.value.startswith(BUILTIN_PACKAGE + ".")]
    if stray or not eps:
        found = f"entry points outside {BUILTIN_PACKAGE}: {', '.join(stray)}" if stray else "no entry points"
        raise BuiltinPluginError(
            f"the installed {DISTRIBUTION!r} metadata declares {found} in the {ENTRY_POINT_GROUP!r} group; "
            "reinstall palestra (pip install -e .)"
        )
    return eps


def _third_party_entry_points(
    names: _DistributionNames | None = None,
) -> dict[str, tuple[metadata.Distribution, list[metadata.EntryPoint]]]:
    """Entry points of the ``palestra`` group, grouped by normalised distribution name, palestra itself left out."""
    names = names or _DistributionNames()
    by_dist: dict[str, tuple[metadata.Distribution, list[metadata.EntryPoint]]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        if dist is None:  # only for hand-made EntryPoint objects; installed ones always know their distribution
            continue
        key = _normalise(names.name(dist))
        if key == DISTRIBUTION:
            continue
        by_dist.setdefault(key, (dist, []))[1].append(ep)
    for _, eps in by_dist.values():
        eps.sort(key=lambda ep: ep.name)
    return by_dist


def _requested_distributions() -> set[str] | None:
    """The distributions PALESTRA_LOAD_PLUGINS allows (normalised), or None when it is not set (all of them)."""
    raw = os.environ.get(LOAD_PLUGINS_ENV)
    if raw is None:
        return None
    return {_normalise(part.strip()) for part in raw.split(",") if part.strip()}


# ---- plugin API versions -----------------------------------------------------------------------------
class IncompatiblePlugin(Exception):
    """A plugin declares plugin API versions that exclude this palestra's (or a specifier that cannot be read)."""

    def __init__(self, message: str, declared: str | None) -> None:
        super().__init__(message)
        self.declared = declared


def _declared_api(plugin: object) -> str | None:
    """The plugin API specifier a plugin module declares (``PALESTRA_PLUGIN_API``), or None."""
    declared = getattr(plugin, hookspecs.PLUGIN_API_ATTRIBUTE, None)  # a declaration, like pluggy's hookimpl markers
    return None if declared is None else str(declared)


def _current_range() -> str:
    """The specifier a plugin written for this palestra declares: this major version of the plugin API."""
    major = int(hookspecs.PLUGIN_API.split(".")[0])
    return f">={major}.0,<{major + 1}"


def _check_api(plugin: object, name: str) -> None:
    """Raise :class:`IncompatiblePlugin` when the plugin's declared API range excludes :data:`hookspecs.PLUGIN_API`."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    declared = _declared_api(plugin)
    if declared is None:
        return
    try:
        supported = SpecifierSet(declared)
    except InvalidSpecifier:
        raise IncompatiblePlugin(
            f"plugin {name!r} declares {hookspecs.PLUGIN_API_ATTRIBUTE} "
            f"= {declared!r}, which is not a version specifier "
            f"(write e.g. {_current_range()!r})",
            declared,
        ) from None
    if not supported.contains(hookspecs.PLUGIN_API, prereleases=True):
        raise IncompatiblePlugin(
            f"plugin {name!r} supports plugin API {declared}, but this palestra provides plugin API "
            f"{hookspecs.PLUGIN_API}; install a version of the plugin built for {hookspecs.PLUGIN_API}",
            declared,
        )


# ---- registration ------------------------------------------------------------------------------------
def _build_registry(state: _State) -> Registry:
    """Call the registration hooks one plugin at a time, so a failure is attributed to (and contained in) its plugin."""
    pm = state.manager
    registry = Registry(broken=list(state.broken))
    trace = pm.trace.root.get("palestra")
    for index, info in enumerate(list(state.plugins)):
        if info.error is not None:
            continue
        plugin = pm.get_plugin(info.name)
        others = [p for p in pm.get_plugins() if p is not plugin]
        staged: list[Registration] = []
        hook_name = ""
        try:
            for kind, hook_name in KINDS.items():
                if hook_name not in info.hooks:
                    continue
                trace("calling", hook_name, "of plugin", repr(info.name))
                register = _Register(kind, info, staged)
                try:
                    with _plugin_code(info.distribution or info.name, info.module, hook_name, watch=not info.builtin):
                        pm.subset_hook_caller(hook_name, remove_plugins=others)(register=register)
                finally:
                    register.closed = True
        except (Exception, SystemExit) as e:  # SystemExit too: a plugin does not decide that palestra exits
            error = f"{_plugin_failure(e, info.module)} (in {hook_name})"
            if info.builtin:
                raise BuiltinPluginError(
                    f"built-in plugin {info.name!r} failed: {error}; the palestra install is broken"
                ) from e
            _warn_broken(info.distribution or info.name, error)
            broken = BrokenPlugin(plugin=info.name, distribution=info.distribution, error=error)
            state.broken.append(broken)
            registry.broken.append(broken)
            state.plugins[index] = dataclasses.replace(info, error=error)
            pm.unregister(name=info.name)  # disabled entirely: its lifecycle hooks must not run either
            continue
        for reg in staged:  # a name registered twice is a hard error naming both plugins
            registry.add(reg)
    return registry


_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class _Register:
    """The ``register`` callback handed to one plugin's ``register_<kind>s`` hook; it checks what it is given."""

    def __init__(self, kind: str, info: PluginInfo, staged: list[Registration]) -> None:
        self.kind, self.info, self.staged = kind, info, staged
        self.closed = False

    def __repr__(self) -> str:  # shown by PALESTRA_TRACE_PLUGINS
        return f"<register {self.kind} for plugin {self.info.name!r}>"

    def __call__(
        self, name: str, factory: Callable[..., Any], *, options: type | None = None, description: str = ""
    ) -> None:
        where = f"plugin {self.info.name!r} registering {self.kind} {name!r}"
        if self.closed:
            raise RuntimeError(f"{where}: register() was called after {KINDS[self.kind]} returned")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}: the name must be a non-empty string of letters, digits, '_', '-' or '.'")
        if not callable(factory):
            raise TypeError(f"{where}: factory must be callable, got {type(factory).__name__}")
        if options is not None and not (isinstance(options, type) and dataclasses.is_dataclass(options)):
            raise TypeError(f"{where}: options must be a dataclass type or None, got {options!r}")
        if not isinstance(description, str):
            raise TypeError(f"{where}: description must be a string, got {type(description).__name__}")
        self.staged.append(
            Registration(
                kind=self.kind,
                name=name,
                factory=factory,
                options=options,
                description=description,
                plugin=self.info.name,
                distribution=self.info.distribution,
            )
        )


# ---- helpers -----------------------------------------------------------------------------------------
def _warn_broken(distribution: str, error: str) -> None:
    warnings.warn(
        f"plugin distribution {distribution!r} failed and is disabled: {error}",
        PalestraPluginWarning,
        stacklevel=3,
    )


@contextlib.contextmanager
def _plugin_code(distribution: str, module: str, doing: str, *, watch: bool = True) -> Iterator[None]:
    """Around a plugin's own code (its import, a registration hook): what it prints goes to stderr, since stdout
    carries the command's answer (JSON, YAML); and if it is still running after :data:`SLOW_PLUGIN_S` seconds,
    one line on stderr names it. It is not interrupted: a slow plugin may be doing real work."""
    if not watch:
        yield
        return
    timer = threading.Timer(SLOW_PLUGIN_S, _say_slow, (f"plugin {distribution!r} (module {module})", doing))
    timer.daemon = True  # a plugin that never returns must not also keep the process alive through its timer
    timer.start()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        timer.cancel()


def _watch_lifecycle_hooks(pm: pluggy.PluginManager, theirs: dict[str, PluginInfo]) -> None:
    """The ``on_*`` hooks (called by the trainer) that reach a third-party plugin get what registration gets: one
    that runs past :data:`SLOW_PLUGIN_S` is named on stderr, and a ``sys.exit()`` in one becomes a one-line
    :class:`PluginError` naming it, so the run stops the way any failed hook stops it, not silently."""
    local = threading.local()  # per thread, a stack of timers: a hook may call another hook

    def timers() -> list[threading.Timer | None]:
        if not hasattr(local, "timers"):
            local.timers = []
        stack: list[threading.Timer | None] = local.timers
        return stack

    def before(hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
        reached = [theirs[i.plugin_name] for i in impls if i.plugin_name in theirs]
        timer = None
        if reached and hook_name.startswith("on_"):  # which of them is running is not known: all are named
            who = ("plugin " if len(reached) == 1 else "plugins ") + ", ".join(_named(p) for p in reached)
            timer = threading.Timer(SLOW_PLUGIN_S, _say_slow, (who, hook_name))
            timer.daemon = True
            timer.start()
        timers().append(timer)

    def after(
        outcome: pluggy.Result[Any], hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]
    ) -> None:
        timer = timers().pop()
        if timer is not None:
            timer.cancel()
        if isinstance(outcome.exception, SystemExit) and hook_name.startswith("on_"):
            culprit = _raising_plugin(outcome.exception, impls)
            info = theirs.get(culprit.plugin_name) if culprit else None
            who = f"plugin {_named(info)}" if info else "a plugin"
            outcome.force_exception(
                PluginError(f"{who} called {_exit_call(outcome.exception)} in {hook_name}; the run stops here")
            )

    pm.add_hookcall_monitoring(before, after)


def _raising_plugin(error: BaseException, impls: Sequence[pluggy.HookImpl]) -> pluggy.HookImpl | None:
    """The hook implementation whose code is on the traceback of ``error`` (the innermost one)."""
    codes = {getattr(i.function, "__code__", None): i for i in impls}
    found = None
    tb = error.__traceback__
    while tb is not None:
        found = codes.get(tb.tb_frame.f_code, found)
        tb = tb.tb_next
    return found


def _named(info: PluginInfo) -> str:
    return f"{info.distribution or info.name!r} (module {info.module})"


def _say_slow(who: str, doing: str) -> None:
    what = "loading" if doing == "loading" else f"running {doing} of"
    print(f"palestra: still {what} {who} after {SLOW_PLUGIN_S:g} s", file=sys.stderr, flush=True)


def _plugin_failure(e: BaseException, module: str) -> str:
    """What went wrong in a plugin, in one line; ``sys.exit(N)`` is named as the call it was."""
    if isinstance(e, SystemExit):
        return f"module {module} called {_exit_call(e)}"
    return _one_line(e)


def _exit_call(e: SystemExit) -> str:
    return f"sys.exit({'' if e.code is None else repr(e.code)})"


def _enable_tracing(pm: pluggy.PluginManager) -> None:
    """Write plugin loads and every hook call, with the plugins it reaches and what they return, to stderr."""
    pm.trace.root.setwriter(lambda text: sys.stderr.write(text))  # looked up per call, so redirected stderr works
    hooktrace = pm.trace.root.get("hook")

    def before(hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
        hooktrace.root.indent += 1
        hooktrace("call", hook_name, "->", [impl.plugin_name for impl in impls], kwargs)

    def after(
        outcome: pluggy.Result[Any], hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]
    ) -> None:
        if outcome.exception is None:
            hooktrace("finish", hook_name, "-->", outcome.get_result())
        else:
            hooktrace("raised", hook_name, "-->", _one_line(outcome.exception))
        hooktrace.root.indent -= 1

    pm.add_hookcall_monitoring(before, after)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _normalise(name: str) -> str:
    """PEP 503 name normalisation, so PALESTRA_LOAD_PLUGINS=Palestra_Example matches palestra-example."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
