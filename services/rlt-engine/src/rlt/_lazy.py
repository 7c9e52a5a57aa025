"""Package attributes that load their module on first use (PEP 562), so that importing a
package (`rlt`, `rlt.engine`) imports no torch until a name that needs it is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: dict, modules: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package` (its globals): name -> the module that defines it."""

    def __getattr__(name: str):
        if name not in modules:
            raise AttributeError(f"module {package['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(modules[name]), name)
        package[name] = value
        return value

    return __getattr__
