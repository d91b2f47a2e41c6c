"""After: the same work in shmpipe producers; batches arrive as torch tensors."""

import functools

import numpy as np
import torch

import shmpipe

SAMPLES = 64  # per epoch


@functools.cache  # once per producer process: worker_init_fn's job
def connection(worker_id):
    return f"connection of worker {worker_id}"  # open a file, a database, ...


def make_batches():
    info = shmpipe.get_worker_info()  # .id, .num_workers, .seed, .epoch
    connection(info.id)
    mine = list(range(info.id, SAMPLES, info.num_workers))  # this worker's share
    for i in range(0, len(mine), 8):  # a producer makes whole batches
        ks = mine[i : i + 8]
        image = np.stack([np.full((8, 8, 3), k, dtype=np.float32) for k in ks])  # decode, augment, ...
        yield image, np.array([k % 10 for k in ks])


if __name__ == "__main__":
    count = images = 0
    checksum = 0.0
    with shmpipe.from_iterators([make_batches] * 2) as pipe:  # producers live until close: persistent
        if torch.cuda.is_available():
            batches = pipe.to_torch(device="cuda", pin_memory=True)  # one copy, straight to the GPU
        else:
            batches = pipe.to_torch()  # views of the shared memory, no copy
        for _epoch in range(2):
            for image, label in batches:  # each iteration of `batches` is a new pass
                checksum += float(image.sum() + label.sum())  # the training step
                count += 1
                images += len(label)
    print(f"epochs: 2, batches: {count}, images: {images}, checksum: {checksum:.0f}")
