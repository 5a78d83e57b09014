from __future__ import annotations

from services.connectors.shm_alloc import ExtentAllocator, SlotAllocator


def test_extents_first_fit_and_coalesce():
    a = ExtentAllocator(1000)
    x, y, z = a.allocate(300), a.allocate(300), a.allocate(300)
    assert (x, y, z) == (0, 300, 600)
    assert a.allocate(200) is None
    a.release(y, 300)
    assert a.allocate(350) is None
    a.release(x, 300)
    assert a.allocate(550) == 0  # x and y coalesced
    a.release(0, 550)
    a.release(z, 300)
    assert a.free_bytes == 1000 and a.allocate(1000) == 0


def test_slots_are_reused():
    s = SlotAllocator(2)
    assert (s.allocate(), s.allocate(), s.allocate()) == (0, 1, None)
    s.release(1)
    assert s.allocate() == 1
