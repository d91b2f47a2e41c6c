"""After: shmpipe.from_dataset and to_jax() feeding the same step."""

import jax
import jax.numpy as jnp
import numpy as np

import shmpipe


class Images:  # the same data source; the per-sample transform moves into it
    def __len__(self):
        return 64

    def __getitem__(self, k):
        return {"image": np.full((8, 8), k, np.float32) * 2, "label": np.int32(k % 10)}


@jax.jit
def step(total, image, label):
    return total + (image.sum(axis=(1, 2)) * label).sum()


def main():
    pipe = shmpipe.from_dataset(Images(), batch_size=8, shuffle=True, drop_last=True, num_workers=2, seed=1)
    total, batches = jnp.zeros((), jnp.float32), 0
    with pipe:
        for _epoch in range(2):
            for batch in pipe.to_jax():  # jax.Arrays over the ring's memory: no copy on the CPU
                total = step(total, batch["image"], batch["label"])
                batches += 1
    print(f"epochs: 2, batches: {batches}, checksum: {int(total)}")


if __name__ == "__main__":
    main()
