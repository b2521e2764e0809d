import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import memory


@pytest.mark.parametrize("dtype", [jnp.uint32, jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("fill", [0, 0.0, float("nan"), 7])
def test_pinned_allocation_holds_the_fill_in_pinned_memory(dtype, fill):
    """Zero-filled pools come from numpy's zeros (no device compute, jax-ml/jax#25396); any other
    fill from the jit. Both land in pinned_host with the fill everywhere."""
    if fill == 7 and dtype == jnp.float8_e4m3fn:
        fill = 1.5
    if np.isnan(fill) and dtype == jnp.uint32:
        pytest.skip("no NaN in uint32")
    x = memory.allocate((3, 5, 4), dtype, fill, memory.PINNED_HOST)
    assert x.shape == (3, 5, 4) and x.dtype == dtype
    assert memory.memory_kind_of(x) == memory.PINNED_HOST
    values = np.asarray(x.astype(jnp.float32))
    expected = np.full(values.shape, np.float32(jnp.asarray(fill, dtype).astype(jnp.float32)))
    np.testing.assert_array_equal(values, expected)  # NaN equals NaN here


def test_device_allocation_stays_on_the_device():
    x = memory.allocate((2, 3), jnp.int32, 0, memory.DEVICE)
    assert memory.memory_kind_of(x) == memory.DEVICE
    np.testing.assert_array_equal(np.asarray(x), np.zeros((2, 3), np.int32))
