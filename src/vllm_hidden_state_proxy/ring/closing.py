"""``with`` for the ring's objects that hold files: the block's end calls ``close()``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar

_Closing = TypeVar("_Closing", bound="ClosesOnExit")


class ClosesOnExit(ABC):
    """``with obj as same_obj: ...`` closes ``obj`` however the block ends."""

    @abstractmethod
    def close(self) -> None:
        """Release what the object holds; safe to call more than once."""

    def __enter__(self: _Closing) -> _Closing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
