"""Getting started: four producers, a training loop, the pipeline's stats."""

import numpy as np

import shmpipe


def make_batches():  # runs in a producer process
    info = shmpipe.get_worker_info()  # .id, .num_workers, .seed, .epoch
    rng = np.random.default_rng(info.seed)
    for i in range(25):
        image = rng.random((32, 64, 64, 3), dtype=np.float32)  # load and augment, in parallel
        yield {"image": image, "label": np.arange(32) + i}


def train_step(batch):
    return float(batch["image"].mean())


if __name__ == "__main__":
    with shmpipe.from_iterators([make_batches] * 4, capacity=8) as pipe:
        for batch in pipe:  # read-only views into shared memory
            train_step(batch)
    stats = pipe.stats()
    print(f"batches: {stats.batches}")
    print(stats)
