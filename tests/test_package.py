import subprocess
import sys
from pathlib import Path

import pytest

import nvoffload
from nvoffload.io import _aio
from nvoffload.optim import _adam


def test_native_extensions_import():
    assert nvoffload.__version__
    assert "I/O" in _aio.__doc__
    assert "Adam" in _adam.__doc__


BLOCKED_IMPORT = """
import importlib.abc, sys

class NotBuilt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == {name!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotBuilt())
import nvoffload  # imports nothing yet: the API is imported when first used
from nvoffload import initialize
"""


@pytest.mark.parametrize("name", ["nvoffload.io._aio", "nvoffload.optim._adam"])
def test_import_without_the_native_core_says_so_and_how_to_build_it(name):
    checkout = str(Path(nvoffload.__file__).parents[1])  # the package under test, whatever the working directory
    run = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT.format(name=name)], capture_output=True, text=True, cwd=checkout,
    )  # fmt: skip
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: nvoffload's native core is not built"), run.stderr
    assert name in last and "pip install -e ." in last and "circular" not in run.stderr
