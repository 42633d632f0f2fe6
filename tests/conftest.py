import pytest


def _cuda_available() -> bool:
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


CUDA = _cuda_available()


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
