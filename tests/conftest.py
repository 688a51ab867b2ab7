import mlx.core as mx
import pytest


@pytest.fixture(autouse=True)
def _cpu_float32():
    """Tests run on CPU in float32 so exactness checks are tight."""
    mx.set_default_device(mx.cpu)
    yield
