"""The one codec of every record: a frozen dataclass to plain containers and back, driven by its field types.

A record is stored with ``torch.save`` (tensors stay tensors) and summarized in JSON, so its stored form is
made of dicts, lists, numbers, strings, None and tensors only. The field annotations say how:

- a dataclass becomes a dict of its fields (``source``, where a record was read from, is not part of it);
  a field marked :data:`AS_ROWS` stores a sequence of dataclasses as lists of their field values;
- ``tuple[...]`` becomes a list, ``Mapping[...]`` a dict, each element encoded by its own type;
- ``Any`` is stored as it is (an optimizer's param groups and a scheduler's state, as captured);
- reading back converts each value to its annotated type (``int``, ``float``, ``bool``, tuples), and a
  missing field with a default takes the default.

Pure: torch is never imported (tensors pass through as values).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from pytest_sprite.errors import SpriteUsageError

__all__ = [
    "AS_ROWS",
    "RECORD_FORMAT",
    "check_stored",
    "decode",
    "encode",
    "finite_or_repr",
]

RECORD_FORMAT = 1
"""Format of every stored record (``format`` in its stored form)."""
AS_ROWS: Mapping[str, bool] = {"rows": True}
"""Field metadata: store a tuple of dataclasses as one list of field values each (compact, positional)."""
SKIPPED = ("source",)
"""Fields that say where a record lives, not what it is: never stored."""

T = TypeVar("T")


class _Torch:
    """Stands in for ``torch`` when annotations are resolved: a tensor is stored as it is."""

    Tensor = Any


def finite_or_repr(x: float) -> float | str:
    """The JSON rule of every figure: a finite float as it is, ``inf`` / ``-inf`` / ``nan`` as their repr."""
    return x if math.isfinite(x) else repr(x)


def check_stored(data: Mapping[str, Any], kind: str | None, what: str, remedy: str) -> None:
    """Refuse a stored record of another format or kind, naming both and what to do instead."""
    if data.get("format") != RECORD_FORMAT or (kind is not None and data.get("kind") != kind):
        raise SpriteUsageError(
            f"this is not {what} of format {RECORD_FORMAT} (format {data.get('format')!r}, kind "
            f"{data.get('kind')!r}); {remedy}"
        )


_HINTS: dict[type, dict[str, Any]] = {}


S = TypeVar("S", bound="Stored")


class Stored:
    """What every record class gets from the codec: ``to_dict()`` and ``from_dict()``.

    A record stored on its own (not only inside another) names its ``HEADER`` (``format``, ``kind``) and
    refuses, in :meth:`refuse_stored`, a stored form it cannot read.
    """

    HEADER: ClassVar[Mapping[str, Any]] = {}

    def to_dict(self) -> dict[str, Any]:
        """Plain containers and tensors only, loadable with ``torch.load(weights_only=True)``."""
        return encode(self, self.HEADER)

    @classmethod
    def from_dict(cls: type[S], data: Mapping[str, Any]) -> S:
        """Inverse of :meth:`to_dict`; refuses a record written in another format (or of another kind)."""
        cls.refuse_stored(data)
        return decode(cls, data)

    @classmethod
    def refuse_stored(cls, data: Mapping[str, Any]) -> None:
        """Raise :class:`~pytest_sprite.errors.SpriteUsageError` for a stored form this version cannot read."""


def _hints(cls: type) -> dict[str, Any]:
    """The resolved field types of a record class (``torch.Tensor`` as ``Any``), once per class."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, localns={"torch": _Torch})
    return _HINTS[cls]


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.name not in SKIPPED]


def encode(record: Any, header: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``record`` (a dataclass) as plain containers, after the ``header`` keys (``format``, ``kind``)."""
    hints = _hints(type(record))
    out: dict[str, Any] = dict(header or {})
    for f in _fields(type(record)):
        out[f.name] = _convert(hints[f.name], getattr(record, f.name), rows=bool(f.metadata.get("rows")))
    return out


def decode(cls: type[T], data: Mapping[str, Any]) -> T:
    """The ``cls`` record stored as ``data`` (the inverse of :func:`encode`; header keys are ignored)."""
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in _fields(cls):
        if f.name not in data:
            continue  # the field's default
        value = data[f.name]
        kwargs[f.name] = _convert(hints[f.name], value, rows=bool(f.metadata.get("rows")), reading=True)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, *, rows: bool = False, reading: bool = False) -> Any:
    """``value`` of type ``tp`` to its stored form, or (``reading``) back from it."""
    if value is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _convert(next(a for a in args if a is not type(None)), value, reading=reading)
    if dataclasses.is_dataclass(tp):
        return decode(tp, value) if reading else encode(value)  # type: ignore[arg-type]
    if origin is tuple:
        if rows:
            if reading:
                return tuple(_decode_row(args[0], row) for row in value)
            return [[getattr(v, f.name) for f in _fields(type(v))] for v in value]
        hints = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        items = [_convert(h, v, reading=reading) for h, v in zip(hints, value, strict=True)]
        return tuple(items) if reading else items
    if origin in (Mapping, dict, typing.Mapping):
        return {k: _convert(args[1], v, reading=reading) for k, v in value.items()}
    if reading and tp in (int, float, bool):
        return tp(value)
    return value


def _decode_row(cls: type[T], row: list[Any]) -> T:
    hints = _hints(cls)
    return cls(
        **{f.name: _convert(hints[f.name], v, reading=True) for f, v in zip(_fields(cls), row, strict=True)}
    )
