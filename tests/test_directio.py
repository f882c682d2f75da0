"""storage.fs.directio.Recycler: buffers reused, never a wait."""
from __future__ import annotations

from storage.fs.directio import ALIGN, Recycler


def test_a_buffer_given_back_is_the_next_one_taken_and_take_never_waits() -> None:
    with Recycler(5000) as r:
        assert r.size % ALIGN == 0 and r.size >= 5000
        a, b = r.take(), r.take()  # none free: each maps a new one (no wait, whatever is held)
        assert a is not b and r.mapped == 2
        a.view[:3] = b"abc"
        r.give(a)
        c = r.take()
        assert c is a and bytes(c.view[:3]) == b"abc" and r.mapped == 2  # reused, not mapped again
        r.give(b)
        r.give(c)
        for _ in range(10):  # a steady take/give maps nothing more
            r.give(r.take())
        assert r.mapped == 2
    assert r.mapped == 0  # closed: every buffer unmapped
