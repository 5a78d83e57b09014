"""First-fit allocation of byte extents and slots inside one pool (producer-side bookkeeping only)."""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Free extents kept sorted by offset; neighbours coalesce on release."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []

    def allocate(self, size: int) -> int | None:
        """Offset of a free extent of `size` bytes, or None if no free extent is large enough."""
        if size == 0:
            return 0
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, length - size)
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        if size == 0:
            return
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] == offset + size:
            size += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            del self._free[i]
        self._free.insert(i, (offset, size))

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)


class SlotAllocator:
    """Indexes of free slot headers; the lowest free index is reused first."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, index: int) -> None:
        self._free.append(index)
