"""fxamp's op policy, in one place: the vocabulary (`CastPolicy`), the op tables as data
(`tables`), op names as users write them (`names`) and how one node's policy is chosen
(`rules`: overrides, the batch_norm rule, a user's `NodePolicy`, the preset table).

`fxamp.policy.rules` reads an AmpConfig, so it is imported from its module, not from here:
fxamp.config itself uses this package to check policies and op names when a config is built.
"""

from fxamp.policy.tables import (BANNED_ALTERNATIVES, ONE_DTYPE_OPS, PRESETS, preset_table,
                                 resolve_op_name, unresolved_names)
from fxamp.policy.vocabulary import LOW_DTYPES, OVERRIDE_CHOICES, CastPolicy, NodePolicy

__all__ = ["CastPolicy", "NodePolicy", "OVERRIDE_CHOICES", "LOW_DTYPES", "PRESETS",
           "preset_table", "resolve_op_name", "unresolved_names", "BANNED_ALTERNATIVES",
           "ONE_DTYPE_OPS"]
