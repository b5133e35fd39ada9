"""`/generate`'s non-streamed body as the pieces it was encoded in (server/json_parts.py): the
bytes are the JSON the answers make, every write but the last is WRITE_BYTES long, and
Content-Length is their length."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from server.json_parts import WRITE_BYTES, JsonParts, writes

VALUES = st.lists(st.recursive(st.none() | st.integers() | st.text(), lambda v: st.lists(v, max_size=3), max_leaves=6),
                  min_size=1, max_size=6)


def _length(response: JsonParts) -> int:
    return int(dict(response.raw_headers)[b"content-length"])


def _pieces(encoded: bytes, cuts: list[int]) -> list[bytes]:
    """`encoded` cut at the given offsets (empty pieces included)."""
    at = sorted(min(c, len(encoded)) for c in cuts)
    return [encoded[a:b] for a, b in zip([0, *at], [*at, len(encoded)], strict=True)]


@settings(deadline=None)  # a busy CI machine may stall one example; the property has no clock in it
@given(VALUES, st.booleans(), st.lists(st.integers(0, 200), max_size=5))
def test_the_writes_are_the_json_of_the_answers(values: list, array: bool, cuts: list[int]) -> None:
    answers = [_pieces(json.dumps(v).encode(), cuts) for v in values]
    if not array:
        answers = answers[:1]
    body = b"".join(writes(answers, array))
    assert json.loads(body) == (values if array else values[0])
    assert _length(JsonParts(answers, array)) == len(body)


def test_small_pieces_are_gathered_and_large_ones_cut_into_whole_writes() -> None:
    big = json.dumps({"routed_experts": "A" * (2 * WRITE_BYTES + 12345)}).encode()
    small = [b'{"a":', b"1", b"}"] * 1000  # 3,000 pieces of one answer's fields, and one large one
    answers = [small[:3], [big[:10], big[10:]], *[small[i : i + 3] for i in range(0, len(small), 3)]]
    out = list(writes(answers, array=True))
    assert [len(w) for w in out[:-1]] == [WRITE_BYTES] * (len(out) - 1) and 0 < len(out[-1]) <= WRITE_BYTES
    assert len(out) == -(-sum(map(len, out)) // WRITE_BYTES) == 3
    decoded = json.loads(b"".join(out))
    assert decoded[1] == json.loads(big) and decoded[0] == decoded[-1] == {"a": 1} and len(decoded) == 1002
    assert _length(JsonParts(answers, array=True)) == len(b"".join(out))
