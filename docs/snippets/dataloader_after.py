"""After: the same dataset and arguments; batches collated straight into shared memory."""

import functools

import numpy as np
import torch

import shmpipe

SAMPLES = 64  # per epoch


@functools.cache  # once per producer process: worker_init_fn's job
def connection(worker_id):
    return f"connection of worker {worker_id}"  # open a file, a database, ...


class Samples:  # any object with __len__ and __getitem__: a torch Dataset works as it is
    def __len__(self):
        return SAMPLES

    def __getitem__(self, k):
        info = shmpipe.get_worker_info()  # None where the trainer fetches (a fresh pipeline's first batches)
        connection(info.id if info is not None else -1)
        return np.full((8, 8, 3), k, dtype=np.float32), k % 10  # read, decode, augment, ...


if __name__ == "__main__":
    count = images = 0
    checksum = 0.0
    # Producers live until close (persistent); the batches and their order
    # depend on the seed and the epoch, not on num_workers.
    with shmpipe.from_dataset(Samples(), batch_size=8, shuffle=True, num_workers=2, seed=0) as pipe:
        if torch.cuda.is_available():
            batches = pipe.to_torch(device="cuda", pin_memory=True)  # one copy, straight to the GPU
        else:
            batches = pipe.to_torch()  # views of the shared memory, no copy
        for _epoch in range(2):
            for image, label in batches:  # each iteration of `batches` is a new epoch
                checksum += float(image.sum() + label.sum())  # the training step
                count += 1
                images += len(label)
        state = pipe.state_dict()  # save it with your checkpoint; load_state_dict() resumes here
    print(f"epochs: 2, batches: {count}, images: {images}, checksum: {checksum:.0f}")
