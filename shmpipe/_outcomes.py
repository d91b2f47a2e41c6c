"""What a take from a channel returns when it is not a batch: END, AGAIN,
FAULT (see shmpipe.transport, which re-exports them for transports).

A leaf module, below the transport contract and the ring engine alike, so
the compiled engine can return them without importing the contract.
"""

from __future__ import annotations

__all__ = ["AGAIN", "END", "FAULT"]


class _Sentinel:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"shmpipe.transport.{self.name}"

    def __reduce__(self) -> str:
        return self.name  # a module global: unpickles as the same object


#: The pass, or that worker's part of it, is over.
END = _Sentinel("END")
#: Nothing within the wait; ask again.
AGAIN = _Sentinel("AGAIN")
#: After a halt, nothing more will come.
FAULT = _Sentinel("FAULT")
