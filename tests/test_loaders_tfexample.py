"""tf.train.Example decoding without TensorFlow, checked against hand-built wire bytes."""

from __future__ import annotations

import struct

import pytest

from userdp.data.tfexample import DecodeError, make_example, parse_example


# An encoder written from the protobuf wire-format spec, independent of the
# module under test, so that field numbers and wire types are really checked.
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:  # length-delimited (wire type 2)
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _example(features: dict[str, bytes]) -> bytes:
    entries = b"".join(_ld(1, _ld(1, k.encode()) + _ld(2, v)) for k, v in features.items())
    return _ld(1, entries)  # Example.features = 1 -> Features.feature (map) = 1


def test_decodes_hand_encoded_example():
    bytes_list = _ld(1, _ld(1, b"how do i sort ?") + _ld(1, b"second"))  # Feature.bytes_list = 1
    int64_list = _ld(3, _ld(1, _varint(42) + _varint(7)))  # Feature.int64_list = 3, packed
    float_list = _ld(2, _ld(1, struct.pack("<ff", 0.5, -2.0)))  # Feature.float_list = 2, packed
    blob = _example({"tokens": bytes_list, "score": int64_list, "w": float_list, "empty": b""})
    got = parse_example(blob)
    assert got == {"tokens": [b"how do i sort ?", b"second"], "score": [42, 7], "w": [0.5, -2.0], "empty": []}


def test_make_example_matches_wire_format_and_round_trips():
    blob = make_example({"tokens": "a b", "score": 3})
    assert parse_example(blob) == {"tokens": [b"a b"], "score": [3]}
    # Same message, hand-encoded (map entries in key order; make_example is deterministic).
    expected = _example({"score": _ld(3, _ld(1, _varint(3))), "tokens": _ld(1, _ld(1, b"a b"))})
    assert blob == expected


def test_corrupt_bytes_raise_decode_error():
    with pytest.raises(DecodeError):
        parse_example(b"\x0a\xff\xff\xff\xff\x0f")
