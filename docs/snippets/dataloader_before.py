"""Before: a torch DataLoader over a map-style dataset, shuffled, with workers."""

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

SAMPLES = 64  # per epoch
_connection = None  # one per worker process


def worker_init_fn(worker_id):
    global _connection
    _connection = f"connection of worker {worker_id}"  # open a file, a database, ...


class Samples(Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, k):
        assert _connection is not None
        return np.full((8, 8, 3), k, dtype=np.float32), k % 10  # read, decode, augment, ...


if __name__ == "__main__":
    loader = DataLoader(
        Samples(), batch_size=8, shuffle=True, num_workers=2, worker_init_fn=worker_init_fn,
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
