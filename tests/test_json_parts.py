"""`/generate`'s non-streamed body as the parts it was encoded in (server/json_parts.py): the
bytes are the JSON the parts make, no write is over WRITE_BYTES, Content-Length is their length."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from server.json_parts import WRITE_BYTES, JsonParts, pieces

VALUES = st.lists(st.recursive(st.none() | st.integers() | st.text(), lambda v: st.lists(v, max_size=3), max_leaves=6),
                  min_size=1, max_size=6)


def _length(response: JsonParts) -> int:
    return int(dict(response.raw_headers)[b"content-length"])


@given(VALUES, st.booleans())
def test_the_pieces_are_the_json_of_the_parts(values: list, array: bool) -> None:
    parts = [json.dumps(v).encode() for v in values]
    if not array:
        parts = parts[:1]
    body = b"".join(pieces(parts, array))
    assert json.loads(body) == (values if array else values[0])
    assert _length(JsonParts(parts, array)) == len(body)


def test_a_part_over_the_write_size_goes_in_slices() -> None:
    big = json.dumps({"routed_experts": "A" * (2 * WRITE_BYTES + 12345)}).encode()
    parts = [b'{"a":1}', big, b"[]"]
    out = list(pieces(parts, array=True))
    assert max(map(len, out)) == WRITE_BYTES and len(out) == 1 + 1 + 1 + 3 + 1 + 1 + 1  # [ a , big in 3 , [] ]
    assert json.loads(b"".join(out))[1] == json.loads(big)
    assert _length(JsonParts(parts, array=True)) == len(b"".join(out))
