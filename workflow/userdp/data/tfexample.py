"""Decode (and encode) `tf.train.Example` protos without TensorFlow.

The message classes come from a descriptor built in code that mirrors
tensorflow/core/example/{feature,example}.proto (same package, message names
and field numbers), so the wire format is exactly TensorFlow's:

    message BytesList { repeated bytes value = 1; }
    message FloatList { repeated float value = 1 [packed = true]; }
    message Int64List { repeated int64 value = 1 [packed = true]; }
    message Feature { oneof kind { BytesList bytes_list = 1;
                                   FloatList float_list = 2;
                                   Int64List int64_list = 3; } }
    message Features { map<string, Feature> feature = 1; }
    message Example { Features features = 1; }

Building the descriptor in code (rather than shipping generated _pb2 files)
keeps us independent of the protoc version; the `protobuf` runtime (upb)
parses a small Example in about a microsecond.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

__all__ = ["DecodeError", "example_class", "parse_example", "make_example", "bytes_feature"]

_PACKAGE = "tensorflow"


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="userdp/tensorflow_example.proto", package=_PACKAGE, syntax="proto3"
    )

    def message(name: str, fields: list[tuple[str, int, int, int, str | None]]) -> descriptor_pb2.DescriptorProto:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
        return m

    message("BytesList", [("value", 1, F.TYPE_BYTES, F.LABEL_REPEATED, None)])
    # proto3 packs repeated scalars by default, as TF's [packed = true].
    message("FloatList", [("value", 1, F.TYPE_FLOAT, F.LABEL_REPEATED, None)])
    message("Int64List", [("value", 1, F.TYPE_INT64, F.LABEL_REPEATED, None)])
    feature = message(
        "Feature",
        [
            ("bytes_list", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, f".{_PACKAGE}.BytesList"),
            ("float_list", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, f".{_PACKAGE}.FloatList"),
            ("int64_list", 3, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, f".{_PACKAGE}.Int64List"),
        ],
    )
    feature.oneof_decl.add(name="kind")
    for f in feature.field:
        f.oneof_index = 0
    features = message(
        "Features",
        [("feature", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, f".{_PACKAGE}.Features.FeatureEntry")],
    )
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(
        name="value", number=2, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=f".{_PACKAGE}.Feature"
    )
    message("Example", [("features", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, f".{_PACKAGE}.Features")])
    return fdp


@lru_cache(maxsize=1)
def example_class() -> type:
    """The `tensorflow.Example` message class (in a private descriptor pool)."""
    pool = descriptor_pool.DescriptorPool()  # private: never clashes with a real TF install
    pool.Add(_file_descriptor())
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.Example"))


def parse_example(blob: bytes) -> dict[str, list[Any]]:
    """Decode a serialized Example to {feature name: list of values}.

    Bytes features give `bytes`, int64 features `int`, float features `float`;
    a feature with no kind set gives []. Raises DecodeError on corrupt bytes.
    """
    ex = example_class().FromString(blob)
    out: dict[str, list[Any]] = {}
    for key, feat in ex.features.feature.items():
        kind = feat.WhichOneof("kind")
        out[key] = list(getattr(feat, kind).value) if kind else []
    return out


def bytes_feature(ex: Any, name: str) -> bytes | None:
    """First value of bytes feature `name` of a parsed Example, or None if absent/empty."""
    feats = ex.features.feature
    if name not in feats:
        return None
    values = feats[name].bytes_list.value
    return values[0] if values else None


def make_example(features: dict[str, Any]) -> bytes:
    """Serialize {name: value(s)} as an Example (bytes/str -> BytesList, int -> Int64List, float -> FloatList).

    Used by test fixtures and tools that write the TFF format.
    """
    ex = example_class()()
    for name, value in features.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        feat = ex.features.feature[name]
        if all(isinstance(v, (bytes, str)) for v in values):
            feat.bytes_list.value.extend(v.encode("utf-8") if isinstance(v, str) else v for v in values)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            feat.int64_list.value.extend(values)
        elif all(isinstance(v, (int, float)) for v in values):
            feat.float_list.value.extend(float(v) for v in values)
        else:
            raise TypeError(f"feature {name!r}: values must be all bytes/str, all int or all float")
    return ex.SerializeToString(deterministic=True)
