"""The one response framing of the fast transport and the acceptors' owner
(``_asgi.header_lines``, ``body_parts``): chunks for an HTTP/1.1 body without a length, the
connection's end for an HTTP/1.0 one, no body for 204, 304 and HEAD answers."""

from __future__ import annotations

import pytest
from moegemm.server._asgi import body_parts, header_lines

START = {"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]}
SIZED = {**START, "headers": [(b"content-length", b"3")]}


@pytest.mark.parametrize(("message", "http10", "bodiless", "chunked", "ends"), [
    (START, False, False, True, False),   # 1.1, no length: chunked
    (START, True, False, False, True),    # 1.0, no length: ends with the connection
    (SIZED, False, False, False, False),  # a length: as it is
    (SIZED, True, False, False, False),
    (START, False, True, False, False),   # HEAD: no body
    ({**START, "status": 204}, False, False, False, False),
    ({**START, "status": 304}, True, False, False, False),
])
def test_a_body_is_framed_by_its_length_its_version_and_its_kind(message, http10, bodiless,
                                                                 chunked, ends):
    lines, got_chunked, got_ends = header_lines(message, http10=http10, bodiless=bodiless)
    assert (got_chunked, got_ends) == (chunked, ends)
    assert (b"transfer-encoding: chunked\r\n" in lines) == chunked
    assert b"".join(lines).startswith(b"x-a: 1\r\n" if message is not SIZED else b"content-length: 3")


def test_body_parts_chunk_only_where_asked():
    more = {"type": "http.response.body", "body": b"abc", "more_body": True}
    last = {"type": "http.response.body", "body": b"", "more_body": False}
    assert b"".join(body_parts(more, True) + body_parts(last, True)) == b"3\r\nabc\r\n0\r\n\r\n"
    assert body_parts(more, False) == [b"abc"] and body_parts(last, False) == []
