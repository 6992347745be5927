"""A JSON value checked against a type hint, for the bottom layer's readers: the run directory's event records
(common.events) and the manifest's config (common.config). One message shape for every wrong field: what it is,
what it holds, what was expected."""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Union


class TypeMismatch(ValueError):
    """A value of the wrong type or value for its field (the message names the field)."""


def optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def check_fields(obj: Any, where: str) -> None:
    """Every field of a dataclass instance against its annotation (numbers finite), in place: TypeMismatch naming
    the first wrong one as `where.field`."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        setattr(obj, f.name, checked(f"{where}.{f.name}", getattr(obj, f.name), hints[f.name], finite=True))


def checked(where: str, value: Any, hint: Any, finite: bool = False, minimum: float | None = None,
            maximum: float | None = None) -> Any:
    """`value` if it holds `hint` (an int for a float is read as a float, an integral float as an int; a list's
    members and a dict's values against the hint's argument, where it gives one), else TypeMismatch naming
    `where`."""
    if hasattr(value, "item") and callable(value.item):  # a numpy or torch scalar from a writer
        value = value.item()
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None and optional(hint):
            return None
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return checked(where, value, options[0], finite, minimum, maximum)
    base = origin or hint
    if base in (float, int):
        number = _check_float(where, value, finite) if base is float else _check_int(where, value)
        if minimum is not None and number < minimum:
            raise TypeMismatch(f"{where} is {value!r}, expected at least {minimum}")
        if maximum is not None and number > maximum:
            raise TypeMismatch(f"{where} is {value!r}, beyond any real run (at most {maximum:.3g})")
        return number
    expected = _EXPECTED.get(base)
    if expected is not None and not isinstance(value, base):
        raise TypeMismatch(f"{where} is {value!r}, expected {expected}")
    args = typing.get_args(hint)
    if base is list and args and args[0] is not Any:
        return [checked(f"{where}[{i}]", v, args[0], finite) for i, v in enumerate(value)]
    if base is dict and len(args) == 2 and args[1] is not Any:
        return {k: checked(f"{where}[{k!r}]", v, args[1], finite) for k, v in value.items()}
    return value


# What a field of each plain type must hold, in the words of the error (JSON's names).
_EXPECTED = {bool: "true or false", str: "a string", dict: "an object", list: "a list"}


def _check_float(where: str, value: Any, finite: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeMismatch(f"{where} is {value!r}, expected a number")
    if finite and not math.isfinite(value):
        raise TypeMismatch(f"{where} is {value!r}, expected a finite number")
    return float(value)


def _check_int(where: str, value: Any) -> int:
    """An integer; a float with an integral value reads as one."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeMismatch(f"{where} is {value!r}, expected an integer")
    return value
