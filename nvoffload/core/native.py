"""The compiled core's modules, or one line saying that it is not built and how to build it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["native_module"]


def native_module(name: str) -> ModuleType:
    """The extension module ``name`` (``nvoffload.io._aio``, ``nvoffload.optim._adam``).

    Raises:
        ImportError: it is not built (a source checkout without ``pip install -e .``) or does not load here;
            the message says how to build it, in place of Python's misleading "circular import".
    """
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"nvoffload's native core is not built ({name}: {e}); build it with `pip install -e .` in the"
            " source checkout (needs a C++17 compiler) or install the nvoffload wheel"
        ) from None
