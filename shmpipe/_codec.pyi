"""Type stubs for shmpipe._codec (Cython): batches to payloads and back."""

from typing import Any

import numpy as np

def encoded_size(batch: Any) -> int: ...
def encode(batch: Any) -> np.ndarray: ...
def encode_into(batch: Any, buf: np.ndarray) -> int: ...
def decode(buf: np.ndarray, *, writeable: bool = False) -> Any: ...
def _aligned_empty(n: int) -> np.ndarray:
    """n uninitialised bytes (uint8) starting on a 64-byte boundary."""
    ...

# Shared with the Arrow transport, which names dtypes the same way.
def _dtype_spec(dt: np.dtype) -> bytes | None:
    """The bytes that name dtype `dt` in a payload, or None if it cannot travel."""
    ...

def _dtype_from_spec(spec: bytes) -> np.dtype:
    """The dtype `spec` names, looked up in a closed table (NumPy's own
    dtypes, and extension dtypes of modules this process has imported);
    CorruptSegmentError for any other name, or one that holds objects."""
    ...
