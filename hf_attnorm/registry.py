"""Name registries for normalizers, scales and presets (attention implementation names).

Every normalizer and scale registers itself where it is defined (one file each), so adding one is one new file:
the CLI listings, the generic tests and the transformers registration all read these registries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class AttnormError(ValueError):
    """Base error for bad settings, unknown names and inconsistent checkpoints."""


class UnknownNameError(AttnormError, KeyError):
    """An unknown normalizer, scale or preset name; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """An ordered name -> object mapping with helpful errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
        if not name or not name.replace("_", "").isalnum() or name != name.lower():
            raise AttnormError(f"{self.kind} name {name!r} must be lowercase letters, digits and underscores")
        if name in self._items:
            raise AttnormError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = obj
        return obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(self._items)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def items(self):
        return self._items.items()


@dataclasses.dataclass(frozen=True)
class Preset:
    """A registered attention-implementation name: a normalizer, a scale and fixed option values."""

    name: str
    description: str
    settings: dict[str, Any]


NORMALIZERS: Registry[Any] = Registry("normalizer")
SCALES: Registry[Any] = Registry("scale")
#: attention-implementation name -> Preset (normalizer + scale + fixed settings)
PRESETS: Registry[Any] = Registry("attention implementation")


def register_normalizer(cls: type[T]) -> type[T]:
    """Class decorator: instantiate and register a Normalizer subclass under ``cls.name``.

    Each normalizer name is also an attention implementation (a preset with the ``standard`` scale, unless the class
    sets ``default_scale``); extra presets (e.g. ``softmax1``) are declared in ``cls.presets``.
    """
    obj = cls()
    NORMALIZERS.add(cls.name, obj)
    PRESETS.add(
        cls.name,
        Preset(cls.name, cls.description, {"normalizer": cls.name, "scale": getattr(cls, "default_scale", "standard"),
                                            **getattr(cls, "default_settings", {})}),
    )
    for pname, (desc, settings) in getattr(cls, "presets", {}).items():
        PRESETS.add(pname, Preset(pname, desc, {"normalizer": cls.name, "scale": "standard", **settings}))
    return cls


def register_scale(cls: type[T]) -> type[T]:
    """Class decorator: instantiate and register a Scale subclass under ``cls.name``.

    Every scale except ``standard`` is also an attention implementation: softmax with that scale.
    """
    obj = cls()
    SCALES.add(cls.name, obj)
    if cls.name != "standard":
        PRESETS.add(
            cls.name,
            Preset(cls.name, f"softmax with the {cls.name} scale: {cls.description}",
                   {"normalizer": "softmax", "scale": cls.name, **getattr(cls, "preset_settings", {})}),
        )
    return cls


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


#: prefix under which an implementation name is written into config.json, so that loading without
#: ``import hf_attnorm`` fails with an error that names the package instead of silently running sdpa
CONFIG_PREFIX = "hf_attnorm:"
#: what follows the name in config.json: transformers quotes the whole value in the first line of the error it
#: raises when hf_attnorm is not imported ("Specified `attn_implementation="hf_attnorm:symax -- ..."` is not
#: supported"), so that line says what to do. No "/" (transformers would read it as a hub kernel).
LOAD_HINT = " -- to load this model, run import hf_attnorm first (Python package hf_attnorm)"


def saved_name(implementation: str) -> str:
    """The ``attn_implementation`` value written into config.json for ``implementation``."""
    return f"{CONFIG_PREFIX}{implementation}{LOAD_HINT}"


def canonical(name: object) -> object:
    """Strip the config.json prefix and load hint: ``"hf_attnorm:symax -- to load ..."`` (or ``"hf_attnorm:symax"``,
    as saved before the hint) -> ``"symax"``; anything else is returned as is."""
    if isinstance(name, str) and name.startswith(CONFIG_PREFIX):
        rest = name[len(CONFIG_PREFIX):].split(None, 1)
        return rest[0] if rest else ""
    return name


def is_ours(name: object) -> bool:
    """Whether ``name`` (an ``attn_implementation`` value, prefixed or not) is a registered hf_attnorm preset."""
    return isinstance(name, str) and canonical(name) in PRESETS
