"""Typed JSON for the contract's frozen dataclasses: every key checked against its field's type.

`to_json(obj)` turns a dataclass (nested dataclasses, tuples, dicts) into plain JSON values;
`from_json(cls, data)` builds one back and raises ContractError naming the first key that is
missing, unknown or of the wrong type ("model_spec.num_layers: expected int, got str"). A field
declared with `added(default)` may be absent: documents written before it existed meant the
default, so adding one does not make every engine built before it unreadable. Field
types are read from the annotations, so a field is declared once and validated everywhere.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from llmc.errors import LlmcError


ADDED = "llmc.added"  # field metadata: the key may be absent from older documents


def added(default: Any) -> Any:
    """A dataclass field added to a contract document after its schema: absent means `default`."""
    return dataclasses.field(default=default, metadata={ADDED: True})


class ContractError(ValueError):
    """A contract document (manifest, tuning file) that does not match its declared shape."""


def to_json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    return obj


def from_json(cls: type, data: Any, where: str = "") -> Any:
    """`cls` built from `data`; ContractError names the first key that does not fit."""
    return _value(cls, data, where or cls.__name__)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _got(data: Any) -> str:
    return "null" if data is None else type(data).__name__


def _dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ContractError(f"{where}: expected an object, got {_got(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ContractError(f"{where}: unknown key {unknown[0]!r}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        if name not in data:
            if f.metadata.get(ADDED):  # a document from before the field: it meant the default
                continue
            raise ContractError(f"{where}: missing key {name!r}")
        values[name] = _value(hints[name], data[name], f"{where}.{name}")
    try:
        return cls(**values)
    except ContractError:
        raise
    except (TypeError, ValueError, LlmcError) as exc:  # the dataclass's own checks (__post_init__)
        raise ContractError(f"{where}: {exc}") from None


def _value(tp: Any, data: Any, where: str) -> Any:
    if tp is Any:
        return data
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, data, where)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _value(options[0], data, where)
        for option in options:
            try:
                return _value(option, data, where)
            except ContractError:
                continue
        raise ContractError(f"{where}: expected {' or '.join(map(_type_name, args))}, got {_got(data)}")
    if origin is Literal:
        if data not in args or isinstance(data, bool) != isinstance(args[0], bool):
            raise ContractError(f"{where}: expected one of {', '.join(map(repr, args))}, got {data!r}")
        return data
    if origin is tuple:
        if not isinstance(data, list):
            raise ContractError(f"{where}: expected a list, got {_got(data)}")
        return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
    if origin is dict:
        if not isinstance(data, dict):
            raise ContractError(f"{where}: expected an object, got {_got(data)}")
        return {k: _value(args[1], v, f"{where}.{k}") for k, v in data.items()}
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise ContractError(f"{where}: expected a number, got {_got(data)}")
        return float(data)
    if tp in (int, str, bool):
        if type(data) is not tp:  # exact: a bool is not an int here, nor 1.0 an int
            raise ContractError(f"{where}: expected {tp.__name__}, got {_got(data)}")
        return data
    raise TypeError(f"{where}: the contract codec does not handle {tp!r}")  # a contract bug
