"""After: the same generator, in shmpipe producer processes."""

import time

import numpy as np

import shmpipe


def data_generator():
    for i in range(4):
        time.sleep(0.05)  # fetch from disk or network
        sample = np.full((4, 1000, 3), i, dtype=np.float32)
        target = np.full((4, 1), i, dtype=np.float32)
        yield sample, target


if __name__ == "__main__":
    total = 0.0
    count = 0
    with shmpipe.from_iterators([data_generator] * 2) as batches:
        for sample, target in batches:
            total += float(sample.sum() + target.sum())  # the training step
            count += 1
    print(f"batches: {count}, checksum: {total:.0f}")
