"""state_dict / load_state_dict for the fused optimizers, in torch.optim's layout.

`opt.state[p]` holds views into the flat buffers ("step", the rule's states such as "exp_avg",
and "master_param" for 16-bit parameters), so the state dict is torch.optim's format plus the
masters: torch.save writes each flat buffer once, `torch.load(..., weights_only=True)` reads it
back, and a torch.optim state dict of the same parameters loads too. Loading copies into the
live buffers, so the flat views and the compiled step stay valid.

Note [State appears when a parameter is stepped]: torch.optim has no state for a parameter
until a step() reaches it with a gradient (or a state dict loads one), and tools rely on it: a
state dict taken before training is empty, so accelerate's checkpointing tests compare it with
the one a fresh optimizer loads. The flat buffers exist from the start (zeroed); `held_state`
holds every parameter's entry of views, and `opt.state` gets a parameter's entry when a step
is taken with its gradient or a state dict holds one. DCP, which loads in place into what the
state dict holds, gets every entry (`state_dict(opt, every=True)`, fxamp.distributed).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol, Sequence

import torch

from fxamp import validation
from fxamp.errors import ConfigError
from fxamp.optim import param_checks
from fxamp.optim.buffers.bucket import Bucket, refresh_master
from fxamp.optim.buffers.state_buffers import BucketState
from fxamp.optim.functional.algorithms import Algorithm
from fxamp.optim.functional.codecs import BLOCK


__all__ = ["expose_state", "publish_stepped", "state_dict", "load_state_dict", "SCALE_SHARDS",
           "scale_shards", "check_scale_shards", "keeps_codes"]

log = logging.getLogger(__name__)
_CODES = {torch.int8, torch.uint8}
# The state dict's entry naming the sharding its 8-bit block scales describe (Note [Block
# scales of sharded parameters] in docs/design.md): the ranks of the sharded parameters' mesh.
SCALE_SHARDS = "block_scale_shards"


class Checkpointable(Protocol):
    """The public interface of a fused optimizer that its checkpoints are made from."""

    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]  # torch.optim's: the stepped parameters' entries
    held_state: dict[torch.Tensor, dict[str, Any]]  # every parameter's (expose_state)
    algorithm: Algorithm  # its `state_keys` name the states

    @property
    def buckets(self) -> Sequence[Bucket]: ...

    @property
    def bucket_states(self) -> Sequence[BucketState]: ...

    @property
    def step_counts(self) -> torch.Tensor: ...


def expose_state(opt: "Checkpointable") -> None:
    """Build `opt.held_state[p]`, per-parameter views of the flat state buffers, for every
    parameter; those already in `opt.state` get their new entry there too (Note [State
    appears when a parameter is stepped])."""
    opt.held_state = {}
    for bucket, held in zip(opt.buckets, opt.bucket_states):
        per_key = _state_views(bucket, held, opt.algorithm.state_keys)
        if bucket.master is not None:
            per_key.append(("master_param", bucket.views(bucket.master)))
        if held.correction is not None:
            per_key.append(("master_correction", bucket.views(held.correction)))
        for i, p in enumerate(bucket.params):
            entry: dict[str, Any] = {"step": opt.step_counts[bucket.group_index]}
            entry.update((k, views[i]) for k, views in per_key)
            opt.held_state[p] = entry
    for p in list(opt.state):
        if p in opt.held_state:
            opt.state[p] = opt.held_state[p]


def publish_stepped(opt: "Checkpointable") -> None:
    """Give `opt.state` the entry of each parameter the step just taken had a gradient for."""
    if len(opt.state) == len(opt.held_state):
        return
    for bucket in opt.buckets:
        for p, got in zip(bucket.params, bucket.received):
            if got and p not in opt.state:
                opt.state[p] = opt.held_state[p]


def _state_views(bucket: Bucket, held: BucketState,
                 keys: Sequence[str]) -> list[tuple[str, list]]:
    """Per-parameter views of each state: int8 codes shaped like the parameter, and their
    bf16 block scales under "<key>_scale" (Note [8-bit moments] in docs/design.md: a block never
    straddles two parameters; Note [Block scales of sharded parameters] in docs/design.md)."""
    out = []
    for key, bufs in zip(keys, held.states):
        out.append((key, bucket.views(bufs[0])))
        if len(bufs) == 2:
            out.append((f"{key}_scale", [bucket.block_view(bufs[1], BLOCK, i)
                                         for i in range(len(bucket.params))]))
    return out


def _param_ids(opt: "Checkpointable") -> dict[int, int]:
    # torch.optim numbers parameters in param_groups order.
    ids: dict[int, int] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            ids.setdefault(id(p), len(ids))
    return ids


def scale_shards(opt: "Checkpointable") -> Optional[int]:
    """The number of ranks over which this optimizer's 8-bit block scales are sharded, or None
    when it keeps none of a sharded parameter."""
    sizes = {b.params[0].device_mesh.size() for b, held in zip(opt.buckets, opt.bucket_states)
             if b.sharded and _has_codes(held)}
    return max(sizes) if sizes else None


def check_scale_shards(opt: "Checkpointable", saved: Optional[int]) -> None:
    """Refuse 8-bit state whose block scales describe another sharding than this optimizer's."""
    here = scale_shards(opt)
    if (saved or 1) == (here or 1):  # unsharded state and one rank's shards are alike
        return
    raise ConfigError(
        f"the checkpoint's 8-bit optimizer state was saved with block scales over "
        f"{saved or 1} rank(s), and this {type(opt).__name__} shards its parameters over "
        f"{here or 1}: a block scale belongs to one sharding's blocks, so loading it here would "
        "decode the moments with the wrong scales (Note [Block scales of sharded parameters]). "
        f"Load it with {saved or 1} rank(s)")


def state_dict(opt: "Checkpointable", every: bool = False) -> dict[str, Any]:
    """torch.optim's layout: the entries of `opt.state` (of every parameter with `every`)."""
    ids = _param_ids(opt)
    groups = []
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [ids[id(p)] for p in group["params"]]
        groups.append(packed)
    # One "step" per parameter, as torch.optim keeps it: a shared one would be incremented once
    # per parameter by a torch optimizer that loads this dict.
    entries = opt.held_state if every else opt.state
    state = {ids[id(p)]: {**entry, "step": entry["step"].clone()}
             for p, entry in sorted(entries.items(), key=lambda item: ids[id(item[0])])}
    out = {"state": state, "param_groups": groups}
    shards = scale_shards(opt)
    if shards is not None:
        out[SCALE_SHARDS] = shards
    return out


def load_state_dict(opt: "Checkpointable", sd: dict[str, Any]) -> None:
    """Check the whole dict against `opt` first, then copy it in (nothing changes on a refusal)."""
    if not isinstance(sd, dict) or "param_groups" not in sd or "state" not in sd:
        keys = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
        raise ConfigError(f"not an optimizer state dict: {keys}; expected 'state' and "
                          "'param_groups'")
    _check_groups(opt, sd["param_groups"])
    if SCALE_SHARDS in sd or _holds_codes(sd["state"]):
        check_scale_shards(opt, sd.get(SCALE_SHARDS))
    params = [p for group in opt.param_groups for p in group["params"]]
    # The saved groups' "params" name the state's keys, in our parameters' order (torch.optim's
    # rule: indices in fxamp's and torch's dicts, fully qualified names in those of
    # torch.distributed.checkpoint.state_dict's get_optimizer_state_dict)
    saved_ids = [k for group in sd["param_groups"] for k in group["params"]]
    keys = dict(zip(saved_ids, range(len(params))))
    entries = _checked_entries(opt, sd["state"], params, keys)
    for group, saved in zip(opt.param_groups, sd["param_groups"]):
        group.update((k, v) for k, v in saved.items() if k != "params")
    saw_step = loaded = False
    with torch.no_grad():
        for live, entry, param in entries:
            saw_step |= "step" in entry
            loaded |= _load_entry(live, entry, param)
        if loaded and not saw_step:
            # torch's SGD keeps no step; a loaded momentum buffer means the first step is past.
            opt.step_counts.clamp_(min=1)
        # A parameter the dict has no state for starts from its weights, as torch's would.
        given = {id(param) for _, _, param in entries}
        for param, live in opt.held_state.items():
            if id(param) not in given and "master_param" in live:
                refresh_master(live["master_param"], param.detach())
    for _, _, param in entries:
        opt.state[param] = opt.held_state[param]
    for bucket in opt.buckets:
        bucket.mark_params_synced()
    log.debug("%s: loaded state for %d parameters", type(opt).__name__, len(sd["state"]))


def _holds_codes(state: Any) -> bool:
    entries = state.values() if isinstance(state, dict) else ()
    return any(isinstance(v, torch.Tensor) and v.dtype in _CODES
               for entry in entries if isinstance(entry, dict) for v in entry.values())


def keeps_codes(opt: "Checkpointable") -> bool:
    """Whether the optimizer keeps any 8-bit state (whose scales describe one sharding)."""
    return any(_has_codes(held) for held in opt.bucket_states)


def _has_codes(held: BucketState) -> bool:
    return any(len(bufs) == 2 for bufs in held.states)  # codes and scales (codecs.new_state)


def _checked_entries(opt: "Checkpointable", state: Any, params: list,
                     keys: dict[Any, int]) -> list[tuple]:
    """(live state, saved entry, parameter) per saved entry, every index, shape and step
    checked; entries of frozen parameters (not flattened, no state) are left out."""
    if not isinstance(state, dict):
        raise ConfigError(f"the state dict's 'state' is a {type(state).__name__}, not a dict")
    out = []
    for index, entry in state.items():
        position = keys.get(index)
        if position is None and str(index).isdigit():
            position = keys.get(int(index))
        if position is None:
            raise ConfigError(f"state entry {index!r} names no parameter: this "
                              f"{type(opt).__name__} has {len(params)} (indices 0..."
                              f"{len(params) - 1}); is the state dict from another model?")
        param = params[position]
        live = opt.held_state.get(param)
        if live is not None:
            _check_entry(live, entry, param, position)
            out.append((live, entry, param))
    return out


def _check_entry(live: dict[str, Any], entry: Any, param: torch.Tensor, index: int) -> None:
    if not isinstance(entry, dict):
        raise ConfigError(f"state entry {index} is a {type(entry).__name__}, not a dict")
    for key, value in entry.items():
        if key == "step":
            step = value.item() if isinstance(value, torch.Tensor) else value
            validation.non_negative(step, f"state[{index}]['step']")
        elif key in live and isinstance(value, torch.Tensor) and \
                {value.dtype, live[key].dtype} & _CODES and value.dtype != live[key].dtype:
            raise ConfigError(
                f"state {key!r} of parameter {index} is {value.dtype} in the state dict but "
                f"{live[key].dtype} here: the checkpoint was saved with another state_format "
                "(8-bit moments are saved as codes and scales); build the optimizer with the "
                "checkpoint's state_format to load it")
        elif key in live and (not isinstance(value, torch.Tensor)
                              or tuple(value.shape) != tuple(live[key].shape)):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(f"state {key!r} of parameter {index} has shape {shape} in the "
                              f"state dict but the parameter has shape {tuple(param.shape)}; is "
                              "the state dict from another model?")


def _load_entry(live: dict[str, Any], entry: dict[str, Any], param: torch.Tensor) -> bool:
    for key, value in entry.items():
        if key == "step":
            live["step"].copy_(torch.as_tensor(value, dtype=torch.float32))
        elif key in live:
            live[key].copy_(value)
        else:
            log.warning("ignoring state %r: this optimizer keeps no such state", key)
    if "master_param" in live and "master_param" not in entry:
        live["master_param"].copy_(param.float())
    return any(k != "step" for k in entry)


def _check_groups(opt: "Checkpointable", saved_groups: Any) -> None:
    owner = type(opt).__name__
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(opt.param_groups):
        count = len(saved_groups) if isinstance(saved_groups, (list, tuple)) else "no list of"
        raise ConfigError(f"the state dict has {count} param groups, this {owner} has "
                          f"{len(opt.param_groups)}")
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise ConfigError(f"param group {i} of the state dict is not a dict with a 'params' "
                              "list")
        if len(group["params"]) != len(saved["params"]):
            raise ConfigError(f"param group {i} of the state dict has {len(saved['params'])} "
                              f"parameters, this optimizer's has {len(group['params'])}")
        merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}
        param_checks.check_hyperparameters(merged, i, f"{owner}.load_state_dict")
