"""The saved view file, checked with the standard library only: `python -m fxamp view FILE`
refuses a bad FILE in one line before anything imports torch or Model Explorer.

The file is Model Explorer's graph collection JSON (`{"label": ..., "graphs": [...]}`) with
fxamp's overlays under the extra key "fxamp": `{"version": FORMAT_VERSION, "overlays": [...]}`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fxamp.errors import ConfigError

__all__ = ["FORMAT_VERSION", "read_view", "check_writable"]

FORMAT_VERSION = 1
_WRITE_ONE = "write one with fxamp.explain(...).save(path) or `python -m fxamp explain --save`"


def _parse(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except IsADirectoryError:
        raise ConfigError(f"cannot read {path!r}: it is a directory, not a saved view") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a saved fxamp view: not text (a binary file?); "
                          f"{_WRITE_ONE}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not a saved fxamp view: not JSON ({e}); "
                          f"{_WRITE_ONE}") from None


def _check_version(path: str, part: Any) -> None:
    version = part.get("version") if isinstance(part, dict) else None
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ConfigError(f"{path} was saved by a newer fxamp (view format {version}; this one "
                          f"reads {FORMAT_VERSION}): upgrade fxamp, or save it again with this "
                          "one")
    if version != FORMAT_VERSION:
        raise ConfigError(f"{path} is not a saved fxamp view: it has no "
                          f"'fxamp': {{'version': {FORMAT_VERSION}}} entry; {_WRITE_ONE}")


def _is_list_of(value: Any, keys: tuple[str, ...]) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, dict) and all(k in v for k in keys) for v in value)


def read_view(path: str) -> dict[str, Any]:
    """The parsed JSON of a view `GraphView.save` wrote, its keys checked; ConfigError, in one
    line that names the problem, for anything else."""
    data = _parse(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a saved fxamp view: its JSON is a "
                          f"{type(data).__name__}, not an object; {_WRITE_ONE}")
    _check_version(path, data.get("fxamp"))
    missing = [key for key, ok in [
        ("label", isinstance(data.get("label"), str)),
        ("graphs", _is_list_of(data.get("graphs"), ("id", "nodes")) and data["graphs"]),
        ("fxamp.overlays", _is_list_of(data["fxamp"].get("overlays"), ("name", "nodeData")))]
        if not ok]
    if missing:
        raise ConfigError(f"{path} is not a complete fxamp view: {', '.join(missing)} missing "
                          f"or malformed (a truncated or hand-edited file?); {_WRITE_ONE}")
    return data


def check_writable(path: str) -> str:
    """The absolute form of `path` if a view can be written there; ConfigError otherwise, so
    that `--save` fails before the model runs."""
    full = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise ConfigError(f"cannot save the view to {path!r}: it is a directory; name a file "
                          "in it, such as view.json")
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot save the view to {path!r}: there is no directory "
                          f"{folder!r}; create it first, or save elsewhere")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot save the view to {path!r}: {folder!r} is not writable; "
                          "save elsewhere")
    return full
