"""Which abort re-sends count as misses (:meth:`sidecar.abort_queue.Resend.judge`), as a pure
function of what the request's response showed at each re-send: the body pieces read from it
so far and whether something it sent waited unread. Two misses of a request the engine surely
knew mark the engine as having several API-server processes (:data:`sidecar.abort.MULTI_RESENDS`),
so a re-send must count only where the response shows it changed nothing. No sockets: the
sockets' side (:attr:`sidecar.confirm.Confirmation.unread`) is tests/test_read_pacer.py's."""

from __future__ import annotations

import pytest

from sidecar.abort import MULTI_RESENDS
from sidecar.abort_queue import Resend


def misses(seen: list[tuple[int, bool]]) -> int:
    """The misses counted over re-sends that each saw ``(pieces, unread)``."""
    resend = Resend(("chatcmpl-a",), "a", until=1.0, due=0.0, gap=0.01, confirming=True)
    for pieces, unread in seen:
        resend.judge(pieces, unread)
    return resend.misses


@pytest.mark.parametrize(("seen", "expected", "why"), [
    ([(0, False), (0, False)], 2, "nothing unread at either: both changed nothing"),
    ([(0, True), (0, True)], 0, "the end waited unread at both (a busy loop): not decided"),
    ([(3, True), (3, False)], 1, "the first's unread bytes still not read: only the second"),
    ([(0, True), (1, False)], 2, "a piece read since the first, no verdict: a token, a miss"),
    ([(0, True), (1, True)], 1, "the first decided by the piece read; the second undecided"),
    ([(0, True), (0, True), (2, False)], 3, "two undecided, then decided by the pieces read"),
    ([(0, True), (1, True), (1, True)], 1, "the first decided; the next two undecided"),
])
def test_a_resend_counts_as_a_miss_only_where_the_response_shows_it(
        seen: list[tuple[int, bool]], expected: int, why: str) -> None:
    assert misses(seen) == expected, f"{why}: expected {expected} misses over {seen}"


def test_a_one_process_engine_whose_end_waits_unread_is_never_marked() -> None:
    """The storm's case: the end (one piece) waits unread at every re-send; then it is read,
    and the verdict ends the re-sends. However many re-sends went out, none is a miss."""
    assert misses([(0, True)] * 6) < MULTI_RESENDS
