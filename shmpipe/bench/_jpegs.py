"""The JPEG dataset of the benchmarks that load a map-style dataset (bench
resume, bench nodes): files made once with Pillow, decoded where each
sample is fetched. At the top level of a module of its own: producer and
worker processes unpickle it, and import no more than it needs.

It imports nothing of shmpipe, as a user's dataset module does not: bench
resume's new processes load a copy of this file as a module of its own
before their clock starts, and shmpipe's import belongs inside the clock
(shmpipe/bench/_resume_fresh.py)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["JpegFolder", "fetched", "ids", "make_jpegs"]

_CLASSES = 10


def make_jpegs(folder: str, count: int, side: int, seed: int = 0, quality: int = 90) -> None:
    """`count` JPEG files 000000.jpg ... in `folder`, side x side RGB: smooth
    colour fields with a little noise (compressing like photographs, not
    like pure noise). The same files for the same arguments."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(count):
        coarse = rng.integers(0, 256, size=(side // 16 + 2, side // 16 + 2, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC), dtype=np.int16)
        img = np.clip(img + rng.integers(-12, 13, size=img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(os.path.join(folder, f"{i:06d}.jpg"), format="JPEG", quality=quality)


class JpegFolder:
    """A map-style dataset: sample i is file `folder`/i.jpg, decoded with
    Pillow where it is fetched (a loader's worker), as
    ``{"image": uint8 (side, side, 3), "label": i % 10, "index": i}``.
    With `log`, each fetch appends its index to that file (one line,
    O_APPEND: lines from several workers do not interleave), so a run can
    tell what it fetched."""

    def __init__(self, folder: str, count: int, log: str | None = None) -> None:
        self.folder = folder
        self.count = count
        self.log = log

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, Any]:
        from PIL import Image

        i = int(i)  # Grain's sampler gives NumPy integers
        if not 0 <= i < self.count:
            raise IndexError(i)
        with Image.open(os.path.join(self.folder, f"{i:06d}.jpg")) as im:
            # np.array, not np.asarray: Pillow's array is read-only, and
            # torch's collate warns on every read-only array it is given.
            pixels = np.array(im.convert("RGB"))
        if self.log is not None:
            _log_fetch(self.log, i)
        return {"image": pixels, "label": i % _CLASSES, "index": i}

    def logged(self, log: str) -> JpegFolder:
        return JpegFolder(self.folder, self.count, log)

    def __repr__(self) -> str:
        # Grain refuses a checkpoint whose data source's repr differs; each
        # run has a log of its own, so the log is left out.
        return f"JpegFolder({self.folder!r}, {self.count})"


def _log_fetch(path: str, index: int) -> None:
    """shmpipe.testing.datasets.log_fetch's one O_APPEND write per fetch (the
    lines of several processes never interleave), written out here so that
    the module imports nothing of shmpipe."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{index}\n".encode())
    finally:
        os.close(fd)


def fetched(log: str) -> list[int]:
    """The indices a JpegFolder with this log fetched, in order."""
    try:
        with open(log) as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def ids(batch: Any) -> list[int]:
    """The sample indices of a batch, whoever collated it (a torch tensor,
    a NumPy array, shmpipe's view of its slot)."""
    return [int(i) for i in np.asarray(batch["index"]).tolist()]
