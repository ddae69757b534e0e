"""Host-side allocator of KV blocks (and of recurrent-state slots).

* Id 0 is reserved (the null block / null slot): never allocated, never freed.
* Free ids form a LIFO stack, so a just-freed id is the next one handed out
  and stale-memory bugs surface at once.
* Every allocation records its ids as "to zero": :meth:`BlockPool.take_ids_to_zero`
  hands each out once, and the runner zeroes them (one ``zero_blocks`` launch)
  before the step that first uses them (vLLM's ``new_block_ids_to_zero``; kvjax
  zeroes every fresh block, not only for hybrid models: PRs 35219, 43990, 56524).
  An id freed before it is handed out is dropped from that list (a request
  preempted in the step that allocated it): a step zeroes only ids still held.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvjax.constants import NULL_BLOCK_ID
from kvjax.host.buckets import check_size


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more ids than are free."""


class BlockPool:
    """LIFO allocator of ids ``1 .. num_blocks-1`` (id 0 is reserved).

    Args:
      num_blocks: ids in the cache, including the reserved id 0 (>= 2).
      kind: what the ids name, for error messages ("KV block", "recurrent slot").
    """

    def __init__(self, num_blocks: int, kind: str = "KV block"):
        self.num_blocks = check_size("num_blocks", num_blocks, 2, f"id {NULL_BLOCK_ID} is reserved")
        self.kind = kind
        # Highest id on top of the stack first: pops 1, 2, 3, ... on a fresh pool.
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK_ID, -1))
        self._is_free = [False] + [True] * (num_blocks - 1)
        self._to_zero: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` ids; they are recorded to be zeroed before first use."""
        n = check_size("n", n, 0)
        if n > len(self._free):
            raise OutOfBlocksError(
                f"cannot allocate {n} {self.kind}s: only {len(self._free)} of "
                f"{self.num_blocks - 1} are free"
            )
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        self._to_zero.extend(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return ids to the pool (checked: no id 0, no unknown id, no double free)."""
        ids = list(ids)
        seen = set()
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool):
                raise ValueError(f"{self.kind} ids must be ints, got {i!r}")
            if i == NULL_BLOCK_ID:
                raise ValueError(
                    f"cannot free {self.kind} {NULL_BLOCK_ID}: it is the reserved null id"
                )
            if not 0 < i < self.num_blocks:
                raise ValueError(
                    f"cannot free unknown {self.kind} {i}: ids are 1..{self.num_blocks - 1}"
                )
            if self._is_free[i] or i in seen:
                raise ValueError(f"double free of {self.kind} {i}")
            seen.add(i)
        for i in ids:
            self._is_free[i] = True
            self._free.append(i)
        if self._to_zero:  # freed before handed out for zeroing: nothing will read them, and
            # the allocation that reuses one records it again
            self._to_zero = [i for i in self._to_zero if i not in seen]

    def take_ids_to_zero(self) -> list[int]:
        """The ids allocated since the last call and still held (each handed out once), in order."""
        out, self._to_zero = self._to_zero, []
        return out

    def is_free(self, i: int) -> bool:
        return self._is_free[i]

    def check(self) -> None:
        """The free stack has no repeats, excludes id 0 and matches the flags."""
        if len(set(self._free)) != len(self._free):
            raise AssertionError(f"{self.kind} free list repeats ids")
        if NULL_BLOCK_ID in self._free:
            raise AssertionError(f"{self.kind} free list holds the null id")
        if sorted(self._free) != [i for i in range(self.num_blocks) if self._is_free[i]]:
            raise AssertionError(f"{self.kind} free list and flags disagree")
