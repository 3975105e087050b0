"""accelerate's `save_state` / `load_state` of a model whose parameters are views of fxamp's flat
buffers: the two pre-hooks fxamp's Accelerator registers (Note [Flat buffers in accelerate's
checkpoints])."""

from __future__ import annotations

import pathlib
from typing import Any

import torch

__all__ = ["save_views_as_tensors", "load_models_with_tied_views"]


def save_views_as_tensors(models: list[Any], weights: list[dict], output_dir: str) -> None:
    """`save_state`'s pre-hook: each state-dict view of a flat buffer saved as a tensor.

    Note [Flat buffers in accelerate's checkpoints]: fxamp's fused optimizer keeps the
    parameters as views of one flat buffer, and `model.state_dict()` is those views (Note [The
    state dict is the live weights]). accelerate's safetensors writer keeps one name per
    storage (it takes views of one storage for tied weights), so it would write one parameter
    of each buffer and drop the rest without an error; here every view that does not cover its
    storage is written as a copy of its own (one copy per view: tied weights stay one tensor,
    whose second name accelerate drops as it does in eager torch). Loading has the mirror
    problem: `safetensors.torch.load_model` refuses a tied pair of views that does not cover its
    storage, so `load_models_with_tied_views` reads such files with `load_file` and gives them
    to `load_state_dict`, where the file's one name of a tied pair loads both.
    """
    for state in weights:
        copies: dict[tuple, torch.Tensor] = {}
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and not _covers_storage(value):
                state[name] = copies.setdefault(_view(value), value.detach().clone())


def load_models_with_tied_views(models: list[Any], input_dir: str) -> None:
    """`load_state`'s pre-hook (Note [Flat buffers in accelerate's checkpoints]): the models
    loaded with `load_state_dict` where safetensors' `load_model` would refuse tied views; any
    missing key but a tied name is refused as `load_model` would. All models or none:
    accelerate names the files by their position in `models`."""
    files = [pathlib.Path(input_dir) / f"model{f'_{i}' if i else ''}.safetensors"
             for i in range(len(models))]
    if not any(_tied_views(m) for m in models) or not all(f.is_file() for f in files):
        return
    from safetensors.torch import load_file

    for model, path in zip(models, files):
        missing, unexpected = model.load_state_dict(load_file(path), strict=False)
        untied = set(missing) - _tied_views(model)
        if untied or unexpected:
            raise RuntimeError(f"{path}: missing {sorted(untied)}, unexpected {unexpected}")
    models.clear()


def _tied_views(model: Any) -> set[str]:
    """Names of state-dict entries that share their tensor with an earlier entry."""
    seen, tied = set(), set()
    for name, value in model.state_dict().items():
        if isinstance(value, torch.Tensor) and value.numel():
            if _view(value) in seen:
                tied.add(name)
            seen.add(_view(value))
    return tied


def _view(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()


def _covers_storage(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return (tensor.data_ptr() == storage.data_ptr()
            and tensor.numel() * tensor.element_size() == storage.nbytes())
