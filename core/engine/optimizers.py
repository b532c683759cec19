"""The learner's optimisers: one AdamW and one learning-rate schedule per parameter group, and their checkpoints.

:func:`build_optimizers` makes them (stepping CPU master copies under ``train.offload_optimizer``);
:func:`optimizer_states` / :func:`load_optimizer_states` save and restore them, FSDP2's full (unsharded) state
included; :func:`learner_state` / :func:`load_learner_state` are the learner's whole checkpoint entry (optimisers,
schedules, the shuffling generator, extra state, the fp16 scaler and the master weights), whose keys are kept
from one version to the next.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Optimizers",
    "build_optimizers",
    "learner_state",
    "load_learner_state",
    "load_optimizer_states",
    "optimizer_states",
]


@dataclass
class Optimizers:
    """What :func:`build_optimizers` makes: by group name, the optimisers, their schedules and the tensors each
    steps (the parameters, or their CPU master copies in ``master`` under ``train.offload_optimizer``)."""

    optimizers: dict[str, Any]
    schedulers: dict[str, Any]
    stepped: dict[str, list[Any]]
    master: Any = None  # palestra.scale.offload.CPUMasterWeights, or None


def build_optimizers(groups: Mapping[str, Any], train: Any) -> Optimizers:
    """One AdamW (``train.weight_decay``, the group's learning rate) and one ``train.lr_schedule`` per group."""
    import torch

    from palestra.rl.schedules import lr_factor
    from palestra.scale.offload import CPUMasterWeights

    master = None
    stepped = {name: list(g.params) for name, g in groups.items()}
    if train.offload_optimizer:
        master = CPUMasterWeights([p for g in groups.values() for p in g.params])
        copies = iter(master.master)
        stepped = {name: [next(copies) for _ in g.params] for name, g in groups.items()}
    factor = lr_factor(train.lr_schedule, train.warmup_steps, train.steps)
    optimizers = {
        name: torch.optim.AdamW(stepped[name], lr=g.lr, weight_decay=train.weight_decay) for name, g in groups.items()
    }
    schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, factor) for name, opt in optimizers.items()}
    return Optimizers(optimizers, schedulers, stepped, master)


def optimizer_states(optimizers: Mapping[str, Any], groups: Mapping[str, Any], fsdp: bool) -> dict[str, Any]:
    """Each optimiser's state dict; under FSDP2 the full (unsharded) state, gathered on every rank.

    An optimiser that has not stepped yet (MAPPO's shared layers inside their update window) is saved as it is:
    torch's FSDP helper would first give it a zero-learning-rate step to create its state, which moves AdamW's
    step count and so changes every later update of the run.
    """
    if not fsdp:
        return {name: opt.state_dict() for name, opt in optimizers.items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        name: get_optimizer_state_dict(groups[name].module, opt, options=full) if opt.state else opt.state_dict()
        for name, opt in optimizers.items()
    }


def load_optimizer_states(
    optimizers: Mapping[str, Any], groups: Mapping[str, Any], states: Mapping[str, Any], fsdp: bool
) -> None:
    """Restore :func:`optimizer_states` (FSDP2: every rank keeps its shard of the full state)."""
    if not fsdp:
        for name, opt in optimizers.items():
            opt.load_state_dict(states[name])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    for name, opt in optimizers.items():
        if states[name]["state"]:
            set_optimizer_state_dict(groups[name].module, opt, states[name], options=full)
        else:  # saved before its first step (see optimizer_states): only the learning rates and options
            opt.load_state_dict(states[name])


def learner_state(learner: Any) -> dict[str, Any]:
    """``learner``'s checkpoint entry: a single-group learner saves ``optimizer`` / ``scheduler``, one with several
    groups ``optimizers`` / ``schedulers`` by group name; then ``shuffle_generator``, ``extra`` (the replay buffer
    and the algorithm's own state), ``precision`` (fp16 only) and ``master`` (``train.offload_optimizer`` only)."""
    opt = learner.optimizer_set
    optimizers = optimizer_states(opt.optimizers, learner.groups, learner.context.fsdp)
    schedulers = {name: s.state_dict() for name, s in opt.schedulers.items()}
    if list(opt.optimizers) == ["policy"]:
        state: dict[str, Any] = {"optimizer": optimizers["policy"], "scheduler": schedulers["policy"]}
    else:
        state = {"optimizers": optimizers, "schedulers": schedulers}
    state["shuffle_generator"] = learner.shuffle_generator.get_state()
    extra = {"replay": learner.replay.state()} if learner.replay is not None else {}
    state["extra"] = {**extra, **learner.algorithm.extra_state()}
    if learner.precision.scaler is not None:
        state["precision"] = learner.precision.state_dict()
    if opt.master is not None:
        state["master"] = [m.clone() for m in opt.master.master]
    return state


def load_learner_state(learner: Any, state: Mapping[str, Any]) -> None:
    """Restore :func:`learner_state`. ``precision`` and ``master`` may be missing (a run saved in another precision
    or without offload): the scaler then starts fresh and the master copy is the policy's weights."""
    name, opt = learner.algorithm.name, learner.optimizer_set
    single = list(opt.optimizers) == ["policy"]
    want = ({"optimizer", "scheduler"} if single else {"optimizers", "schedulers"}) | {"shuffle_generator", "extra"}
    optional = {"precision", "master"}
    if not want <= set(state) <= want | optional:
        raise KeyError(
            f"{name}.load_state_dict: missing keys {sorted(want - set(state))}, "
            f"unexpected keys {sorted(set(state) - want - optional)}"
        )
    if single:
        optimizers, schedulers = {"policy": state["optimizer"]}, {"policy": state["scheduler"]}
    else:
        optimizers, schedulers = state["optimizers"], state["schedulers"]
        if set(optimizers) != set(opt.optimizers):
            raise KeyError(
                f"{name}.load_state_dict: optimisers {sorted(optimizers)} saved, {sorted(opt.optimizers)} "
                "here (the parameter groups differ: the agents, or an option such as per_agent_optimizer)"
            )
    load_optimizer_states(opt.optimizers, learner.groups, optimizers, learner.context.fsdp)
    for group, s in opt.schedulers.items():
        s.load_state_dict(schedulers[group])
    learner.shuffle_generator.set_state(state["shuffle_generator"])
    extra = dict(state["extra"])
    if learner.replay is not None:
        if "replay" not in extra:
            raise KeyError(
                f"{name}.load_state_dict: replay is on but the checkpoint has no replay buffer "
                f"(extra state keys {sorted(extra)})"
            )
        learner.replay.load(extra.pop("replay"))
    learner.algorithm.load_extra_state(extra)
    learner.precision.load_state_dict(state.get("precision"))
    if opt.master is not None:
        _load_master(opt.master, state.get("master"), learner.params)


def _load_master(master: Any, saved: Any, params: list[Any]) -> None:
    import torch

    if saved is None:
        master.load_from(params)
        return
    with torch.no_grad():
        for m, s in zip(master.master, saved):
            m.copy_(s)
