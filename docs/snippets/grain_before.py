"""Before: Grain's DataLoader feeding a jitted JAX step."""

import grain.python as grain
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags


class Images:  # a map-style data source: __len__ and __getitem__
    def __len__(self):
        return 64

    def __getitem__(self, k):
        return {"image": np.full((8, 8), k, np.float32), "label": np.int32(k % 10)}


class Scale(grain.MapTransform):
    def map(self, sample):
        return {"image": sample["image"] * 2, "label": sample["label"]}


@jax.jit
def step(total, image, label):
    return total + (image.sum(axis=(1, 2)) * label).sum()


def main():
    flags.FLAGS.mark_as_parsed()  # Grain reads an absl flag; only absl.app.run parses them
    sampler = grain.IndexSampler(num_records=64, shard_options=grain.NoSharding(), shuffle=True, num_epochs=1, seed=1)
    loader = grain.DataLoader(
        data_source=Images(),
        sampler=sampler,
        operations=[Scale(), grain.Batch(batch_size=8, drop_remainder=True)],
        worker_count=2,
    )
    total, batches = jnp.zeros((), jnp.float32), 0
    for _epoch in range(2):
        for batch in loader:  # NumPy batches, copied to the device in the step
            total = step(total, jnp.asarray(batch["image"]), jnp.asarray(batch["label"]))
            batches += 1
    print(f"epochs: 2, batches: {batches}, checksum: {int(total)}")


if __name__ == "__main__":
    main()
