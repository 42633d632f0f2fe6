"""A stand-in for the few parts of msgspec that `hoplite_gpu.messages` uses, for
where msgspec is not installed: the pure scheduling core (`hoplite_gpu.directory`,
the simulators) builds typed messages with the standard library alone.

Messages made with it have the same fields, defaults, tags and equality as
msgspec Structs; nothing is validated and there is no codec, which only the
processes that talk over the network (and so have msgspec) need.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

_NOTHING = object()


class _Field:
    __slots__ = ("default", "name")

    def __init__(self, default: Any = _NOTHING, name: str | None = None) -> None:
        self.default, self.name = default, name


def field(*, default: Any = _NOTHING, name: str | None = None) -> Any:
    return _Field(default, name)


class Meta:
    """Constraints that msgspec checks on decode; nothing is decoded here."""

    def __init__(self, **constraints: Any) -> None:
        self.constraints = constraints


class Struct:
    """Keyword-only fields from the class annotations, in definition order."""

    __struct_fields__: tuple[str, ...] = ()
    __struct_defaults__: dict[str, Any] = {}
    __struct_config__ = SimpleNamespace(tag=None, tag_field=None)

    def __init_subclass__(cls, tag: str | None = None, tag_field: str | None = None,
                          **_options: Any) -> None:
        fields = list(cls.__struct_fields__)
        defaults = dict(cls.__struct_defaults__)
        for name in cls.__dict__.get("__annotations__", {}):
            value = cls.__dict__.get(name, _NOTHING)
            if isinstance(value, _Field):
                value = value.default
            if name not in fields:
                fields.append(name)
            if value is _NOTHING:
                defaults.pop(name, None)
            else:
                defaults[name] = value
                delattr(cls, name)  # (an instance's own value, never the class's)
        cls.__struct_fields__ = tuple(fields)
        cls.__struct_defaults__ = defaults
        parent = cls.__struct_config__
        cls.__struct_config__ = SimpleNamespace(tag=tag if tag is not None else None,
                                                tag_field=tag_field or parent.tag_field)

    def __init__(self, **values: Any) -> None:
        unknown = set(values) - set(self.__struct_fields__)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)[0]!r}")
        for name in self.__struct_fields__:
            if name in values:
                value = values[name]
            elif name in self.__struct_defaults__:
                value = self.__struct_defaults__[name]
                if type(value) in (list, dict, set):  # (each its own, as msgspec's)
                    value = type(value)(value)
            else:
                raise TypeError(f"{type(self).__name__} is missing field {name!r}")
            object.__setattr__(self, name, value)
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, f) == getattr(other, f) for f in self.__struct_fields__)

    __hash__ = None  # type: ignore[assignment]  (mutable, as msgspec's default Structs)

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__)
        return f"{type(self).__name__}({inner})"


def replace(struct: Struct, **changes: Any) -> Struct:
    return type(struct)(**{**{f: getattr(struct, f) for f in struct.__struct_fields__},
                           **changes})
