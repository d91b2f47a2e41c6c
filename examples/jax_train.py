"""Train a small CNN with JAX, data-parallel over 4 devices, on batches from producer processes.

    python examples/jax_train.py --workers 2 --epochs 3

The JPEG workload of `shmpipe bench train`: each sample is a JPEG decoded
with Pillow, randomly cropped and flipped, and normalised, in the producer
processes of shmpipe.from_dataset, which collate the samples straight into
the shared-memory ring. pipe.to_jax(sharding=...) hands the training loop
each batch as jax.Arrays split along the batch axis over the devices
(NamedSharding(mesh, P("data"))): on the CPU backend each shard is a view
of the ring's memory (no copy); on accelerators a background thread puts
batches there ahead of the step. The parameters are replicated on every device, and
jax.jit partitions the step: each device computes the gradient of its share
of the batch, and XLA sums them (data parallelism without a line of
communication code).

Without accelerators, 4 CPU devices stand in for 4 accelerators
(XLA_FLAGS=--xla_force_host_platform_device_count=4, set below before jax is
imported). Where jax finds GPUs or TPUs the flag only adds host devices,
which this script does not use: it trains on jax.devices().

The task: which of 10 pictures (smooth colour fields, bench train's JPEGs)
a random crop comes from, so the loss falls within a few epochs. The
script checks that every sample of every epoch reached the step exactly
once (each sample carries its index).

Needs shmpipe, Pillow, jax and optax (flax is not needed: the model is plain
jax.lax): pip install "shmpipe[jax]" optax pillow
"""

import argparse
import os

# Before jax is imported: XLA reads its flags once.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=4"])
)

import jax  # noqa: E402 - after XLA_FLAGS
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shmpipe  # noqa: E402
from shmpipe.bench.train import Images, TrainConfig, make_jpegs  # noqa: E402

CLASSES = 10


class Samples:
    """Sample k: image k of bench train's stream (JPEG k % 10, its own
    random crop and flip), its label (which of the 10 JPEGs it is) and k.
    Defined in this script, it travels to the producers by value: they do
    not import this script (nor jax)."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, k):
        image, label = self.images[k]
        return {"image": image, "label": np.int32(label), "index": np.int32(k)}


def init_params(key, channels=(16, 32)):
    """Two 3x3 convolutions and a dense head, He-initialised."""
    k1, k2, k3 = jax.random.split(key, 3)
    c1, c2 = channels
    return {
        "conv1": (jax.random.normal(k1, (3, 3, 3, c1)) * np.sqrt(2 / 27), jnp.zeros(c1)),
        "conv2": (jax.random.normal(k2, (3, 3, c1, c2)) * np.sqrt(2 / (9 * c1)), jnp.zeros(c2)),
        "dense": (jax.random.normal(k3, (c2, CLASSES)) / np.sqrt(c2), jnp.zeros(CLASSES)),
    }


def logits(params, x):
    """x: (batch, height, width, 3) float32 -> (batch, CLASSES)."""
    for layer in ("conv1", "conv2"):
        w, b = params[layer]
        x = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = jax.nn.relu(x + b)
        # 2x2 max pooling
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    w, b = params["dense"]
    return x.mean(axis=(1, 2)) @ w + b


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="producer processes")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--images", type=int, default=512, help="samples per epoch")
    parser.add_argument("--batch-size", type=int, default=32, help="a multiple of the number of devices")
    parser.add_argument("--crop", type=int, default=32, help="side of the random crop, pixels")
    args = parser.parse_args()

    devices = jax.devices()
    if args.batch_size % len(devices) or args.images % args.batch_size:
        parser.error(f"--batch-size must divide --images, and {len(devices)} devices must divide --batch-size")
    # One mesh axis, "data": a batch's first axis is split over it, the
    # parameters (P(): no axis named) are whole on every device.
    mesh = Mesh(np.array(devices), ("data",))
    data = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    cfg = TrainConfig(images=args.images, batch_size=args.batch_size, crop=args.crop,
                      min_side=args.crop + 8, max_side=2 * args.crop, distinct=CLASSES)
    dataset = Samples(Images(make_jpegs(cfg), cfg))

    optimizer = optax.adam(3e-3)
    params = jax.device_put(init_params(jax.random.key(0)), replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(logits(p, batch["image"]), batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    epoch_loss = []
    seen = []  # per epoch, every sample index that reached the step
    with shmpipe.from_dataset(dataset, batch_size=args.batch_size, shuffle=True, seed=0,
                              num_workers=args.workers, timeout=60) as pipe:
        batches = pipe.to_jax(sharding=data)
        for _ in range(args.epochs):
            total, n, indices = 0.0, 0, []
            for batch in batches:  # each epoch is a new pass, in a new order
                params, opt_state, loss = step(params, opt_state, batch)
                indices.extend(np.asarray(batch["index"]).tolist())
                total, n = total + float(loss), n + 1
            epoch_loss.append(total / n)
            seen.append(indices)
        stats = pipe.stats()

    once = all(sorted(indices) == list(range(args.images)) for indices in seen)
    print(f"trained on {len(devices)} {devices[0].platform} devices, data-parallel: "
          f"loss {epoch_loss[0]:.3f} -> {epoch_loss[-1]:.3f}")
    print(f"every sample exactly once in each of {len(seen)} epochs of {args.images}: {'yes' if once else 'NO'}")
    print(stats)
    print(f"stall fraction: {stats.stall_fraction:.1%} of the time iterating was spent waiting for input")
    if not once:
        raise SystemExit("some sample was missing or repeated")


if __name__ == "__main__":
    main()
