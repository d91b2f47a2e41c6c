"""After: shmpipe producers make the batches; model.fit reads them in place."""

import keras
import numpy as np
import tensorflow as tf

import shmpipe

IMAGES = 256  # per epoch
BATCH = 32


def make_batches():
    info = shmpipe.get_worker_info()
    for b in range(info.id, IMAGES // BATCH, info.num_workers):  # this worker's batches
        ks = range(b * BATCH, (b + 1) * BATCH)
        image = np.stack([np.full((8, 8, 3), k % 10, dtype=np.float32) for k in ks])  # decode, augment, ...
        yield image, np.array([k % 10 for k in ks])


if __name__ == "__main__":
    with shmpipe.from_iterators([make_batches] * 2) as pipe:
        dataset = pipe.to_tf_dataset(batches_per_pass=IMAGES // BATCH)  # each epoch is a new pass

        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(dataset, epochs=2, verbose=0, shuffle=False)  # (a dataset: Keras does not shuffle it)

        images, checksum = 0, 0.0
        for image, label in dataset:  # one more pass, to show what the model was fed
            images += int(label.shape[0])
            checksum += float(tf.reduce_sum(image)) + float(tf.reduce_sum(label))
    print(f"epochs: {len(history.history['loss'])}, images per epoch: {images}, checksum: {checksum:.0f}")
