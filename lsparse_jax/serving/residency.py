"""Adaptive DHiSparse's optional residency: the control-plane policy (host-side bookkeeping).

Complete pages of a request's imported (prompt) history may sit in optional device pages that
all slots share (``CacheConfig.optional_pages`` per CSA layer), on top of the fixed hot cache:
  - resident-first admission: a new request is lent a device page for every complete prompt
    page; when too few are free, whole requests' optional pages are reclaimed in reclaim order
    (the longest-held first, i.e. admission order) until the deficit is covered or no lent page
    is left; it then gets as many as are free, its first pages first;
  - reclamation is a ready-map reset (the host copy of every lent page was written at
    admission, so nothing is lost);
  - refill: after pages come free (a request leaves), at most ``refill_pages`` pages per decode
    step go back to requests missing some, round-robin over slots.
Pages generated during decoding always follow hot-cache rules. The data-plane halves are
``serving.state.admit_paged`` (``ready``), ``reclaim`` and ``refill``.
"""

from __future__ import annotations

import numpy as np

from lsparse_jax.memory.host_pool import PageAllocator


class OptionalResidency:
    """Which optional device pages each slot holds, and the next reclaim/refill decisions."""

    def __init__(self, num_pages: int, pages_per_slot: int, refill_pages: int):
        self.pages = PageAllocator(num_pages)
        self.pages_per_slot = pages_per_slot
        self.refill_pages = refill_pages
        self.lent: dict[int, dict[int, int]] = {}  # slot -> {logical page: optional page}
        self.imported: dict[int, int] = {}  # slot -> complete prompt pages (refill targets)
        self.order: list[int] = []  # slots in admission order (reclaim order)
        self._cursor = 0  # round-robin position of the refill

    def in_use(self) -> int:
        return self.pages.num_pages - self.pages.free

    def admit(self, slot: int, full_pages: int) -> tuple[list[int], np.ndarray]:
        """A request with ``full_pages`` complete prompt pages enters ``slot``: returns (slots
        whose optional pages must be reclaimed first, in order; its ready row [max_pages])."""
        victims = []
        for other in self.order:
            if self.pages.free >= full_pages:
                break
            if self.lent.get(other):
                victims.append(other)
                self._take_back(other)
        grant = self.pages.allocate(min(full_pages, self.pages.free), what="optional pages")
        self.lent[slot] = dict(enumerate(grant))
        self.imported[slot] = full_pages
        self.order.append(slot)
        return victims, self.ready_row(slot)

    def release(self, slot: int) -> bool:
        """The request in ``slot`` ends; returns whether it held optional pages to reclaim."""
        held = bool(self.lent.get(slot))
        self._take_back(slot)
        self.lent.pop(slot, None)
        self.imported.pop(slot, None)
        self.order.remove(slot)
        return held

    def plan_refill(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """At most ``refill_pages`` free pages for slots missing some of their prompt pages,
        one page per slot per round, round-robin from where the last refill stopped:
        [(slot, logical [R], lent [R])], -1 padded to R = refill_pages (one compilation)."""
        budget = min(self.refill_pages, self.pages.free)
        slots = sorted(self.imported)
        new: dict[int, list[int]] = {}  # slot -> logical pages lent now, in order
        if slots:
            start = self._cursor % len(slots)
            queue = slots[start:] + slots[:start]
            while budget and (needy := [s for s in queue if self._missing(s) is not None]):
                for slot in needy[:budget]:
                    logical = self._missing(slot)
                    self.lent[slot][logical] = self.pages.allocate(1, what="optional pages")[0]
                    new.setdefault(slot, []).append(logical)
                    self._cursor = slots.index(slot) + 1
                budget -= len(needy[:budget])
        out = []
        for slot, pages in new.items():
            logical = np.full(self.refill_pages, -1, np.int32)
            lent = np.full(self.refill_pages, -1, np.int32)
            logical[:len(pages)] = pages
            lent[:len(pages)] = [self.lent[slot][p] for p in pages]
            out.append((slot, logical, lent))
        return out

    def _missing(self, slot: int) -> int | None:
        """The first prompt page of ``slot`` that holds no optional page, or None."""
        return next((p for p in range(self.imported[slot]) if p not in self.lent[slot]), None)

    def ready_row(self, slot: int) -> np.ndarray:
        row = np.full(self.pages_per_slot, -1, np.int32)
        for logical, page in self.lent.get(slot, {}).items():
            row[logical] = page
        return row

    def _take_back(self, slot: int) -> None:
        pages = list(self.lent.get(slot, {}).values())
        if pages:
            self.pages.release(pages)
        self.lent[slot] = {}
