"""The constants of a frozen TensorFlow graph (a `GraphDef` .pb file), read without TensorFlow.

A frozen graph keeps its weights as `Const` nodes whose `value` attribute holds a `TensorProto`.
The few message types needed to read them (`GraphDef`, `NodeDef`, `AttrValue`, `TensorProto`,
`TensorShapeProto`) are declared here with the field numbers of TensorFlow's own .proto files
(tensorflow/core/framework/{graph,node_def,attr_value,tensor,tensor_shape}.proto), and parsed
by `protobuf`; every other field of the file is skipped as unknown.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "torchserve_vision_tf_graph"
# TensorFlow's DataType numbers (types.proto) of the constants read here.
NUMPY_DTYPES = {1: np.float32, 3: np.int32, 9: np.int64}
VALUE_FIELDS = {1: "float_val", 3: "int_val", 9: "int64_val"}

Field = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = Field.LABEL_OPTIONAL, Field.LABEL_REPEATED
MESSAGES: dict[str, list[tuple[str, int, int, int, str | None]]] = {
    "Dim": [("size", 1, Field.TYPE_INT64, OPTIONAL, None), ("name", 2, Field.TYPE_STRING, OPTIONAL, None)],
    "TensorShapeProto": [("dim", 2, Field.TYPE_MESSAGE, REPEATED, "Dim"),
                         ("unknown_rank", 3, Field.TYPE_BOOL, OPTIONAL, None)],
    "TensorProto": [("dtype", 1, Field.TYPE_INT32, OPTIONAL, None),
                    ("tensor_shape", 2, Field.TYPE_MESSAGE, OPTIONAL, "TensorShapeProto"),
                    ("tensor_content", 4, Field.TYPE_BYTES, OPTIONAL, None),
                    ("float_val", 5, Field.TYPE_FLOAT, REPEATED, None),
                    ("int_val", 7, Field.TYPE_INT32, REPEATED, None),
                    ("int64_val", 10, Field.TYPE_INT64, REPEATED, None)],
    "AttrValue": [("s", 2, Field.TYPE_BYTES, OPTIONAL, None), ("i", 3, Field.TYPE_INT64, OPTIONAL, None),
                  ("f", 4, Field.TYPE_FLOAT, OPTIONAL, None), ("b", 5, Field.TYPE_BOOL, OPTIONAL, None),
                  ("type", 6, Field.TYPE_INT32, OPTIONAL, None),
                  ("tensor", 8, Field.TYPE_MESSAGE, OPTIONAL, "TensorProto")],
    "NodeDef": [("name", 1, Field.TYPE_STRING, OPTIONAL, None), ("op", 2, Field.TYPE_STRING, OPTIONAL, None),
                ("input", 3, Field.TYPE_STRING, REPEATED, None),
                ("attr", 5, Field.TYPE_MESSAGE, REPEATED, "NodeDef.AttrEntry")],
    "GraphDef": [("node", 1, Field.TYPE_MESSAGE, REPEATED, "NodeDef")],
}


class GraphError(ValueError):
    """The file is not a frozen graph, or a constant is not what the caller expects."""


@cache
def graph_message() -> Any:
    """The GraphDef message class, declared once (proto2: fields keep presence, so an attribute
    that is absent reads as absent)."""
    file = descriptor_pb2.FileDescriptorProto(name=f"{PACKAGE}.proto", package=PACKAGE, syntax="proto2")
    for name, fields in MESSAGES.items():
        message = file.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = message.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = f".{PACKAGE}.{type_name}"
        if name == "NodeDef":
            entry = message.nested_type.add(name="AttrEntry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=Field.TYPE_STRING, label=OPTIONAL)
            entry.field.add(name="value", number=2, type=Field.TYPE_MESSAGE, label=OPTIONAL,
                            type_name=f".{PACKAGE}.AttrValue")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.GraphDef"))


def read_graph(path: Path) -> Any:
    """The GraphDef of a .pb file; GraphError when it cannot be parsed as one."""
    graph = graph_message()()
    try:
        graph.ParseFromString(path.read_bytes())
    except Exception as error:  # noqa: BLE001 - protobuf raises DecodeError and others
        raise GraphError(f"{path} is not a TensorFlow GraphDef: {error}") from None
    if not graph.node:
        raise GraphError(f"{path} holds no graph nodes")
    return graph


def tensor_array(tensor: Any, name: str) -> np.ndarray:
    """A TensorProto's value as a numpy array of its shape (a single value fills the shape, as
    TensorFlow stores a constant splat)."""
    dtype = NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise GraphError(f"constant {name}: data type {tensor.dtype} is not read here")
    shape = tuple(int(dim.size) for dim in tensor.tensor_shape.dim)
    if tensor.tensor_content:
        values = np.frombuffer(tensor.tensor_content, dtype=np.dtype(dtype).newbyteorder("<"))
    else:
        values = np.asarray(getattr(tensor, VALUE_FIELDS[tensor.dtype]), dtype=dtype)
        if values.size == 1:
            values = np.full(shape, values[0], dtype=dtype)
    if values.size != int(np.prod(shape, dtype=np.int64)):
        raise GraphError(f"constant {name}: {values.size} values for shape {shape}")
    return values.astype(dtype).reshape(shape)


def graph_constants(path: Path, prefixes: tuple[str, ...] = ("",)) -> dict[str, np.ndarray]:
    """Every numeric `Const` node of the graph at `path` whose name starts with one of
    `prefixes`, by node name."""
    constants = {}
    for node in read_graph(path).node:
        if node.op == "Const" and node.name.startswith(prefixes) and "value" in node.attr:
            tensor = node.attr["value"].tensor
            if tensor.dtype in NUMPY_DTYPES:
                constants[node.name] = tensor_array(tensor, node.name)
    return constants


def node_attributes(path: Path, op: str) -> dict[str, dict[str, Any]]:
    """Each `op` node's scalar attributes (strings, integers, floats, booleans, types), by node
    name; an attribute of another kind (a list, a shape) reads as None."""
    return {node.name: {key: scalar_attribute(value) for key, value in node.attr.items()}
            for node in read_graph(path).node if node.op == op}


def scalar_attribute(value: Any) -> Any:
    """The one scalar an AttrValue holds, or None."""
    for field in ("s", "i", "f", "b", "type"):
        if value.HasField(field):
            return getattr(value, field)
    return None
