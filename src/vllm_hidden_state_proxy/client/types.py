"""The client module's shared words: array and option types, and its errors."""

from __future__ import annotations

from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from vllm_hidden_state_proxy.request_fields import RequestFieldError

#: A vector ``(hidden_size,)`` or a matrix ``(rows, hidden_size)``, always float32.
Array: TypeAlias = npt.NDArray[np.float32]
Pooling: TypeAlias = Literal["last", "mean", "last_answer", "all_prompt", "all_answer"]
Format: TypeAlias = Literal["float", "base64"]
Dtype: TypeAlias = Literal["float32", "float16", "bfloat16"]


class HiddenStateRequestError(RequestFieldError):
    """The request's fields would be refused by the proxy (400); ``param`` names the field."""


class HiddenStateDecodeError(ValueError):
    """The answer does not hold what it should (a missing field, bad base64, a wrong shape)."""


class HiddenStateServerError(RuntimeError):
    """The server answered with an error instead of hidden states."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message if status is None else f"{status}: {message}")
        self.message = message
        self.status = status
