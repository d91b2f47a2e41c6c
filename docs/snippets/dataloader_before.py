"""Before: a torch DataLoader with workers that shard an IterableDataset."""

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

SAMPLES = 64  # per epoch
_connection = None  # one per worker process


def worker_init_fn(worker_id):
    global _connection
    _connection = f"connection of worker {worker_id}"  # open a file, a database, ...


class Samples(IterableDataset):
    def __iter__(self):
        info = get_worker_info()  # .id, .num_workers, .seed
        assert _connection is not None
        for k in range(info.id, SAMPLES, info.num_workers):  # this worker's share
            yield np.full((8, 8, 3), k, dtype=np.float32), k % 10  # decode, augment, ...


if __name__ == "__main__":
    loader = DataLoader(
        Samples(), batch_size=8, num_workers=2, worker_init_fn=worker_init_fn,
        persistent_workers=True, pin_memory=torch.cuda.is_available(),
    )
    count = images = 0
    checksum = 0.0
    for _epoch in range(2):
        for image, label in loader:  # tensors
            checksum += float(image.sum() + label.sum())  # the training step
            count += 1
            images += len(label)
    print(f"epochs: 2, batches: {count}, images: {images}, checksum: {checksum:.0f}")
