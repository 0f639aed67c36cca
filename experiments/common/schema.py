"""The markers of a config schema: a key without a default, a key whose default is None."""

from __future__ import annotations


class Required:
    """Marks a key without a default; ``kind`` is the type its value must have."""

    def __init__(self, kind: type) -> None:
        self.kind = kind


class Unset:
    """Marks a key whose default is None (its meaning is documented with the key) and whose
    value, when given, must have type ``kind``."""

    def __init__(self, kind: type) -> None:
        self.kind = kind


NAME, NUMBER, COUNT = Required(str), Required(float), Required(int)
