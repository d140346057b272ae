"""Plug-ins named by dotted path in the config (stage: rollout; docs/design.md section 1, STYLE 10).

``load_object("pkg.mod:attr", kind="reward function")`` imports ``pkg.mod`` and returns ``attr`` (which may itself
be dotted: ``pkg.mod:Class.method``); ``pkg.mod.attr`` (no colon) splits at the last dot. Every failure raises
:class:`PluginError` naming the kind, the path and what is wrong, and tells a module that does not exist apart
from a module that exists but failed to import (a missing dependency of the user's code).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

__all__ = ["PluginError", "load_object"]


class PluginError(ImportError):
    """A dotted path that does not name a usable object; the message says which path and why."""


def _split(path: str, kind: str) -> tuple[str, str]:
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    parts = (*module.split("."), *attr.split("."))
    if not module or not attr or ":" in attr or any(not part.isidentifier() for part in parts):
        raise PluginError(f"{kind} {path!r}: expected a dotted path like 'pkg.module:name' or 'pkg.module.name'")
    return module, attr


def load_object(path: str, *, kind: str = "plug-in", require_callable: bool = True) -> Any:
    """Import and return the object at ``path``.

    ``kind`` ("reward function", "agent function", ...) goes into error messages.
    """
    module_name, attr = _split(path.strip(), kind)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # e.name is the module that was missing: ours (or a parent package) vs a dependency of the user's code.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            msg = f"module {module_name!r} not found (is it installed / on PYTHONPATH?)"
            raise PluginError(f"{kind} {path!r}: {msg}") from e
        raise PluginError(f"{kind} {path!r}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # the user's module raised at import time
        raise PluginError(f"{kind} {path!r}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    obj: Any = module
    walked = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = difflib.get_close_matches(part, names, n=3)
            suggestion = f" (did you mean {', '.join(hint)}?)" if hint else ""
            raise PluginError(f"{kind} {path!r}: {walked!r} has no attribute {part!r}{suggestion}")
        obj = getattr(obj, part)
        walked = f"{walked}.{part}"
    if require_callable and not callable(obj):
        raise PluginError(f"{kind} {path!r}: {walked!r} is a {type(obj).__name__}, not callable")
    return obj
