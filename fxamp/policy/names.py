"""Op names as users write them in `op_overrides`: "aten.softmax" (every overload),
"aten.softmax.int" (one), or an OpOverload / OpOverloadPacket object. Checked once, when a
config is built."""

from __future__ import annotations

from typing import Any

import torch

from fxamp._compat import OpOverload
from fxamp.errors import ConfigError

__all__ = ["override_key", "check_override_key", "names_of"]


def override_key(key: Any) -> str:
    """The string an op_overrides key is stored as: an OpOverload / OpOverloadPacket prints as
    "aten.softmax.int" / "aten.softmax"."""
    return key if isinstance(key, str) else str(key)


def check_override_key(key: str) -> None:
    """Raise ConfigError unless `key` names an ATen op or overload of this torch build."""
    parts = key.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    packet = getattr(torch.ops.aten, parts[0], None) if parts and parts[0] else None
    if packet is None or len(parts) > 2 or (len(parts) == 2 and not hasattr(packet, parts[1])):
        raise ConfigError(
            f"op_overrides key {key!r} is not an ATen op or overload "
            "(write it as 'aten.softmax' or 'aten.softmax.int')"
        )


def names_of(op: OpOverload) -> frozenset[str]:
    """Every spelling of `op` an op_overrides key may use."""
    packet = op.overloadpacket.__name__
    return frozenset({str(op), str(op.overloadpacket), packet, f"{packet}.{op._overloadname}"})
