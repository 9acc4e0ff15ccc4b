"""User code named on the command line or in a recipe (`path/file.py:NAME` or `package.module:NAME`): environments,
agents and reward functions are loaded by one rule, with one-line errors."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from rlx.errors import UserError


def load_object(
    spec: str,
    option: str,
    expected: str = "path/file.py:NAME or package.module:NAME",
    kind: str = "env",
    need_callable: bool = True,
) -> Any:
    """The callable `NAME` of `path/file.py:NAME` or `package.module:NAME` (user code: environments, agents, reward
    functions; any object without `need_callable`); a UserError starting with `option spec` otherwise, `expected`
    saying what the option takes. A file is imported as module `rlx_user_<kind>_<stem>`."""
    module_name, _, attr = spec.rpartition(":")
    where = f"{option} {spec!r}"
    if not module_name or not attr:
        raise UserError(f"{where}: expected {expected}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UserError(f"{where}: no such file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"rlx_user_{kind}_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise UserError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise UserError(f"{where}: cannot import module {module_name!r} ({e})") from None
    if not hasattr(module, attr):
        raise UserError(f"{where}: {module_name} has no attribute {attr!r}")
    value = getattr(module, attr)
    if need_callable and not callable(value):
        raise UserError(f"{where}: {module_name}.{attr} is not callable")
    return value
