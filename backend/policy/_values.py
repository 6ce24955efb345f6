"""Cheap pickling for the policy's frozen value classes.

An observation crosses to the policy process as a pickle: at 1,024 ranks that is about
80,000 small objects. A slotted dataclass pickles through ``dataclasses.fields()`` once
per object (about 200 ms of the backend's GIL for one observation); ``Compact`` pickles
each object as its class and a tuple of its fields, in field order.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, ClassVar

__all__ = ["Compact"]


class Compact:
    """Base of a ``@dataclass(frozen=True, slots=True)`` class: pickles as ``(cls, fields)``."""

    __slots__ = ()
    _getters: ClassVar[dict[type, Any]] = {}

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        cls = type(self)
        get = Compact._getters.get(cls)
        if get is None:
            slots: tuple[str, ...] = cls.__slots__
            names = tuple(n for n in slots if n != "__weakref__")  # field order
            one = attrgetter(names[0]) if len(names) == 1 else None
            get = Compact._getters[cls] = (lambda o: (one(o),)) if one else attrgetter(*names)
        return cls, get(self)
