"""A small name -> object registry that refuses duplicates and names the valid choices on a miss."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from compress.core.errors import RecipeError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects; ``what`` names the kind of thing in error messages."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.what} '{name}' is already registered")
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def deco(item: T) -> T:
            return self.add(name, item)

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RecipeError(f"unknown {self.what} '{name}'; {did_you_mean(name, list(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
