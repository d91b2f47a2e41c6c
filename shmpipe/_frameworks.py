"""The framework adapters as methods of a stream: ``to_torch``,
``to_tf_dataset`` and ``to_jax``.

A mixin above BatchStream, so that the adapters (shmpipe/_torch.py,
shmpipe/_tf.py, shmpipe/_jax.py) can be typed against BatchStream while the
stream's own methods import them: the imports go one way (this module ->
adapters -> _stream), and TensorFlow, torch and JAX load only when a method
is called.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from shmpipe._stream import BatchStream

if TYPE_CHECKING:  # the frameworks stay optional: never imported at run time here
    import jax
    import tensorflow as tf

    from shmpipe._jax import JaxBatches
    from shmpipe._torch import TorchBatches

__all__ = ["FrameworkStream", "require_framework"]

#: What to install for each framework a method needs: torch from PyPI is a
#: CUDA build of several GB, so the CPU wheel's index is named too.
_INSTALL = {
    "torch": "pip install torch (without a GPU, the CPU build: pip install torch --index-url "
             "https://download.pytorch.org/whl/cpu)",
    "jax": 'pip install "shmpipe[jax]" (jax[cpu] without an accelerator; jax[cuda12] for NVIDIA GPUs)',
    "tensorflow": 'pip install "shmpipe[tensorflow]" (tensorflow-cpu; tensorflow[and-cuda] for NVIDIA GPUs)',
}


def require_framework(module: str, method: str) -> None:
    """Raises a ModuleNotFoundError that says what to install where `method`
    needs `module` (torch, jax, tensorflow) and it is not installed here,
    before anything of the adapter is imported."""
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"{method} needs {module}, which is not installed here: {_INSTALL[module]}", name=module
        )


class FrameworkStream(BatchStream):
    """A BatchStream that hands its batches to TensorFlow, PyTorch and JAX."""

    def to_tf_dataset(
        self, output_signature: Any = None, *, device: str | None = None, batches_per_pass: int | None = None
    ) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of this pipeline's batches, without a copy.

        Each iteration of the dataset (each epoch of ``model.fit``) is a new
        pass of the sources. Elements keep the batches' nesting (lists become
        tuples: tf.data has none). ``element_spec`` comes from
        ``output_signature`` or from the first batches of a pass (one per
        worker, up to four), with None for dimensions that differ between
        them; those batches are the dataset's first elements. Tensors alias
        the shared memory where the transport's arrays are 64-byte aligned;
        a slot goes back when TensorFlow drops the tensor. With ``device``
        ("/gpu:0"), the last step copies elements to that device in the
        background (``tf.data.experimental.prefetch_to_device``). If you
        know how many batches a pass has, say so with ``batches_per_pass``:
        the dataset then has a known length (Keras 3 warns at the end of
        every epoch of a dataset of unknown length). See docs/tensorflow.md.
        """
        require_framework("tensorflow", "to_tf_dataset()")
        from shmpipe._tf import to_tf_dataset

        return to_tf_dataset(self, output_signature, device=device, batches_per_pass=batches_per_pass)

    def to_torch(self, device: Any = None, pin_memory: bool = False, non_blocking: bool = True) -> TorchBatches:
        """This pipeline's batches with torch tensors at the array leaves.

        On the host (``device=None`` or "cpu") the tensors are
        ``torch.from_numpy`` views of the shared memory: no copy. They may
        be written in place (``x.div_(255)``), as a DataLoader's may: the
        slot is the trainer's until the batch is let go, and memory this
        process maps read-only is viewed copy-on-write (docs/gpu.md). The
        batch's NumPy arrays stay read-only. With a CUDA ``device`` each
        array is copied once, and with ``non_blocking`` a batch's slot is
        kept until the CUDA event recorded after its copy has completed.
        ``pin_memory=True`` registers the ring with ``cudaHostRegister`` once
        so that copy is a direct DMA, and unregisters it when the pipeline
        closes (where there is no CUDA, or no CUDA ``device``, it does
        nothing and warns once). Returns an iterable; each iteration is a
        new pass. In a rank of a group, ``device=f"cuda:{rank}"``,
        typically. See docs/gpu.md.
        """
        require_framework("torch", "to_torch()")
        from shmpipe._torch import TorchBatches

        return TorchBatches(self, device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    def to_jax(
        self, sharding: jax.sharding.Sharding | None = None, prefetch: int = 2, device: jax.Device | str | None = None
    ) -> JaxBatches:
        """This pipeline's batches with ``jax.Array``s at the array leaves.

        Batches keep their structure; NumPy scalars become 0-d arrays, other
        leaves (Python numbers, strings) stay as they are. Returns an
        iterable; each iteration is a new pass.

        On the CPU backend each array *is* the shared memory where JAX
        allows it (a 64-byte aligned array of a dtype JAX keeps: no copy),
        and the batch's slot goes back once the last of its arrays is freed.
        JAX copies a 64-bit array without ``jax_enable_x64`` (it keeps
        int64 as int32) and an unaligned one; a copy of 1 MiB or more warns.

        On an accelerator a background thread puts ``prefetch`` batches on
        the device ahead of the step (``jax.device_put``, asynchronous) and
        lets a slot go back only once its copy is done; ``state_dict()``
        counts the batches the loop took, not those put ahead. A producer's
        error reaches ``next()`` as the pipeline raises it; the thread ends
        with the pass, at ``break`` and when the pipeline closes.

        Args:
            sharding: a ``jax.sharding.Sharding`` (``NamedSharding(mesh,
                P("data"))``) to split each array along its first axis over
                the sharding's devices. With several processes
                (``jax.distributed``) each process's batch is its share of
                the global array (``jax.make_array_from_process_local_data``).
            prefetch: batches put on the device ahead (an accelerator).
            device: one device (a ``jax.Device``, or ``"gpu"``, ``"cpu:0"``),
                instead of ``sharding``; by default JAX's default device.

        Raises:
            ShmpipeValueError: ``prefetch < 1``, both ``sharding`` and
                ``device``, a device JAX does not have; at the first batch,
                a leaf whose first axis the sharding cannot split evenly (the
                message names it: ``batch['image']``).
            BatchTypeError: at the first batch, a leaf JAX cannot hold
                (strings, objects), named by its path.

        See docs/jax.md.
        """
        require_framework("jax", "to_jax()")
        from shmpipe._jax import JaxBatches

        return JaxBatches(self, sharding=sharding, prefetch=prefetch, device=device)
