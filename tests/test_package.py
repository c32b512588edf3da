import nvoffload
from nvoffload.io import _aio
from nvoffload.optim import _adam


def test_native_extensions_import():
    assert nvoffload.__version__
    assert "I/O" in _aio.__doc__
    assert "Adam" in _adam.__doc__
