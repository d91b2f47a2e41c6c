"""Before: Ray's parallel iterators (ray.util.iter), one of the recipes `shmpipe bench feed` compares."""

import time

import numpy as np
import ray
import ray.util.iter


def data_generator():
    for i in range(4):
        time.sleep(0.05)  # fetch from disk or network
        sample = np.full((4, 1000, 3), i, dtype=np.float32)
        target = np.full((4, 1), i, dtype=np.float32)
        yield sample, target


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    batches = ray.util.iter.from_iterators([data_generator] * 2).gather_async()
    total = 0.0
    count = 0
    for sample, target in batches:
        total += float(sample.sum() + target.sum())  # the training step
        count += 1
    ray.shutdown()
    print(f"batches: {count}, checksum: {total:.0f}")
