import numpy as np
import pytest

from hisparse_jax.host_pages import HostPageAllocator


def test_allocate_free_and_exhaustion():
    pages = HostPageAllocator(num_pages=10, page_size=4)
    a = pages.allocate(9)  # 3 pages
    assert a == [0, 1, 2] and pages.num_free == 7
    b = pages.allocate(28)  # 7 pages: everything left
    assert len(b) == 7 and pages.num_free == 0
    assert pages.allocate(1) is None and pages.num_free == 0  # nothing taken on failure
    pages.free(a)
    assert pages.num_free == 3 and pages.allocate(12) == [0, 1, 2]


def test_bad_frees_are_refused():
    pages = HostPageAllocator(num_pages=4, page_size=2)
    taken = pages.allocate(4)
    pages.free(taken)
    with pytest.raises(ValueError, match="double free"):
        pages.free(taken[:1])
    with pytest.raises(ValueError):
        pages.free([7])


def test_page_table_row():
    pages = HostPageAllocator(num_pages=8, page_size=4)
    row = pages.page_table_row([5, 2], pages_per_request=4)
    np.testing.assert_array_equal(row, [5, 2, -1, -1])
    with pytest.raises(ValueError):
        pages.page_table_row([0, 1, 2], pages_per_request=2)
