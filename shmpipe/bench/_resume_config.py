"""bench resume's settings: ResumeConfig (a module of its own, so that the
restarts section and the measuring both read it, one way)."""

from __future__ import annotations

from dataclasses import dataclass

from shmpipe.errors import ShmpipeValueError

__all__ = ["ResumeConfig"]


@dataclass(frozen=True)
class ResumeConfig:
    images: int = 2000  # JPEG files, the epoch
    side: int = 224  # each is side x side RGB
    batch_size: int = 32
    workers: int = 2  # shmpipe producers, DataLoader / StatefulDataLoader / Grain workers
    at: tuple[float, ...] = (0.1, 0.5, 0.9)  # where in the epoch the checkpoints are taken
    repeat: int = 3  # rounds; the table shows the median
    seed: int = 0  # the JPEGs' pixels and every loader's shuffle
    quality: int = 90  # JPEG quality
    timeout_s: float = 300.0  # the most one batch may take (shmpipe's and the DataLoaders' timeout)
    kills: int = 3  # SIGKILLs of shmpipe's producers per epoch in the restarts section (0: no section)

    def check(self) -> None:
        if self.batch_size < 1 or self.workers < 1 or self.repeat < 1:
            raise ShmpipeValueError("batch_size, workers and repeat must be at least 1")
        if self.kills < 0:
            raise ShmpipeValueError(f"kills must not be negative, not {self.kills}")
        if self.images < 2 * self.batch_size:
            raise ShmpipeValueError(f"images ({self.images}) must be at least two batches ({2 * self.batch_size})")
        if not 8 <= self.side <= 4096:
            raise ShmpipeValueError(f"side must be 8 to 4096 pixels, not {self.side}")
        if not self.at or any(not 0 < f < 1 for f in self.at):
            raise ShmpipeValueError(f"checkpoints are at fractions of an epoch, strictly between 0 and 1: {self.at}")

    @property
    def batches(self) -> int:
        return -(-self.images // self.batch_size)

    def positions(self) -> list[tuple[str, int]]:
        """(label, k) per checkpoint: taken after k batches of the epoch
        (at least 1, at most all but one, so a resumed loader has a batch
        to give)."""
        out = []
        for f in self.at:
            k = min(self.batches - 1, max(1, round(f * self.batches)))
            out.append((f"{f:.0%}", k))
        return out
