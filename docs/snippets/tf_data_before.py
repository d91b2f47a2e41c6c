"""Before: tf.data from_generator feeding model.fit."""

import keras
import numpy as np
import tensorflow as tf

IMAGES = 256  # per epoch


def samples():
    for k in range(IMAGES):
        yield np.full((8, 8, 3), k % 10, dtype=np.float32), k % 10  # decode, augment, ...


if __name__ == "__main__":
    signature = (tf.TensorSpec((8, 8, 3), tf.float32), tf.TensorSpec((), tf.int64))
    dataset = tf.data.Dataset.from_generator(samples, output_signature=signature)
    dataset = dataset.batch(32).prefetch(tf.data.AUTOTUNE)

    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(dataset, epochs=2, verbose=0, shuffle=False)  # (a dataset: Keras does not shuffle it)

    images, checksum = 0, 0.0
    for image, label in dataset:  # one more pass, to show what the model was fed
        images += int(label.shape[0])
        checksum += float(tf.reduce_sum(image)) + float(tf.reduce_sum(label))
    print(f"epochs: {len(history.history['loss'])}, images per epoch: {images}, checksum: {checksum:.0f}")
