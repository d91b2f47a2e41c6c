"""Whose batch an ordered pass takes next: the workers in turn, round-robin
from the worker the schedule names (a resumed pass may begin at any), each
at its own next batch number, skipping those whose part of the pass is over.
Used by both of the pipeline's ways of taking a batch (the channel's fast
path and get()); an unordered pass has no turns (it takes anyone's oldest
batch: worker -1)."""

from __future__ import annotations

__all__ = ["Turns"]


class Turns:
    """The turns of one ordered pass of `num_workers` workers, beginning
    with worker `first`."""

    __slots__ = ("order", "turn", "wseq")

    def __init__(self, num_workers: int, first: int = 0) -> None:
        self.order = list(range(num_workers))  # the workers not yet done
        self.turn = first  # index into order (a resumed pass may begin at any worker)
        self.wseq = [0] * num_workers  # the next batch number of each worker

    def next(self) -> tuple[int, int] | None:
        """(worker, its batch number) whose turn it is; None when every
        worker's part is over."""
        if not self.order:
            return None
        worker = self.order[self.turn]
        return worker, self.wseq[worker]

    def took(self) -> None:
        """The batch next() named was delivered."""
        worker = self.order[self.turn]
        self.wseq[worker] += 1
        self.turn = (self.turn + 1) % len(self.order)

    def retire(self) -> None:
        """The worker whose turn it is has nothing more this pass."""
        del self.order[self.turn]
        if self.turn == len(self.order):
            self.turn = 0
