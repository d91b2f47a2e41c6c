"""Train a small Keras model with model.fit on batches from producer processes.

    python examples/keras_fit.py --workers 2 --epochs 3

Each producer makes (images, labels) batches of a synthetic 10-class problem
in place, in shared memory (shmpipe.reserve), spending a few milliseconds of
CPU per batch as a decoder or augmenter would. The trainer sees a tf.data
dataset whose tensors alias those slots. The producers never import this
file (shmpipe ships SyntheticImages to them by value), so TensorFlow could
be imported at the top; it is imported inside main() only so that a source
that cannot travel by value (docs/concepts.md), whose producers then import
the script, would not bring TensorFlow into each of them.

Needs shmpipe and TensorFlow: `pip install ".[all]"` (or ".[tensorflow]")
from the root of a clone.
"""

import argparse
import time

import numpy as np

import shmpipe

CLASSES = 10
SHAPE = (16, 16, 1)


class SyntheticImages:
    """A producer: `batches` batches of (images, labels), filled in place."""

    def __init__(self, batches: int, batch_size: int = 32, work_ms: float = 2.0):
        self.batches, self.batch_size, self.work_ms = batches, batch_size, work_ms

    def __call__(self):
        info = shmpipe.get_worker_info()
        rng = np.random.default_rng(info.seed)
        prototypes = np.random.default_rng(0).standard_normal((CLASSES, *SHAPE)).astype(np.float32)
        template = (
            shmpipe.ArraySpec((self.batch_size, *SHAPE), np.float32),
            shmpipe.ArraySpec((self.batch_size,), np.int64),
        )
        for _ in range(self.batches):
            images, labels = batch = shmpipe.reserve(template)  # writable views of a free slot
            labels[:] = rng.integers(0, CLASSES, self.batch_size)
            np.add(prototypes[labels], 0.5 * rng.standard_normal(images.shape, dtype=np.float32), out=images)
            deadline = time.perf_counter() + self.work_ms / 1e3
            while time.perf_counter() < deadline:  # the decoding/augmenting we pretend to do
                pass
            yield batch  # published without a copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=20, help="batches per worker per epoch")
    args = parser.parse_args()

    try:
        import keras
    except ImportError:
        raise SystemExit('examples/keras_fit.py needs TensorFlow: pip install ".[all]" (or ".[tensorflow]")') from None

    sources = [SyntheticImages(args.batches)] * args.workers
    with shmpipe.from_iterators(sources, capacity=2 * args.workers + 6, timeout=60) as pipe:
        dataset = pipe.to_tf_dataset(batches_per_pass=args.workers * args.batches).prefetch(2)
        model = keras.Sequential(
            [
                keras.Input(SHAPE),
                keras.layers.Flatten(),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        history = model.fit(dataset, epochs=args.epochs, verbose=0, shuffle=False)
        stats = pipe.stats()
    loss, acc = history.history["loss"], history.history["accuracy"]
    print(f"loss {loss[0]:.3f} -> {loss[-1]:.3f}, accuracy {acc[0]:.2f} -> {acc[-1]:.2f}")
    print(stats)
    print(f"stall fraction: {stats.stall_fraction:.1%} of the time iterating was spent waiting for input")


if __name__ == "__main__":
    main()
