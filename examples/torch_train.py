"""Train a small PyTorch model on batches from producer processes.

    python examples/torch_train.py --workers 2 --epochs 3

The same synthetic 10-class problem as keras_fit.py. On the CPU the training
loop gets torch tensors that are views of the shared-memory slots
(pipe.to_torch()); where CUDA is available it trains on the GPU, and each
batch reaches it in one DMA from the page-locked ring
(pipe.to_torch(device="cuda", pin_memory=True)). The producers never
import this file (shmpipe ships the source by value); torch is imported
inside main() all the same, so that a source that cannot travel by value
(docs/concepts.md), whose producers import the script, would not bring
torch into each of them.

Needs shmpipe and torch. `pip install ".[all]"` does not bring torch: a
plain `pip install torch` from PyPI is a multi-GB CUDA build on Linux. For
the CPU build (about 200 MB):

    pip install torch --index-url https://download.pytorch.org/whl/cpu

On a GPU machine, `pip install ".[torch]"` (or PyTorch's own instructions
for your CUDA version).
"""

import argparse

from keras_fit import CLASSES, SHAPE, SyntheticImages  # the same producer

import shmpipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=20, help="batches per worker per epoch")
    args = parser.parse_args()

    try:
        import torch
    except ImportError:
        raise SystemExit(
            "examples/torch_train.py needs torch, which shmpipe[all] does not bring (a plain torch from PyPI is a "
            "multi-GB CUDA build). The CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu"
        ) from None

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else None
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(SHAPE[0] * SHAPE[1], 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    ).to(device or "cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    epoch_loss = []
    with shmpipe.from_iterators([SyntheticImages(args.batches)] * args.workers, timeout=60) as pipe:
        batches = pipe.to_torch(device=device, pin_memory=device is not None)
        for _ in range(args.epochs):
            total, n = 0.0, 0
            for images, labels in batches:  # each epoch is a new pass
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total, n = total + loss.item(), n + 1
            epoch_loss.append(total / n)
        stats = pipe.stats()
    print(f"trained on {device or 'cpu'}: loss {epoch_loss[0]:.3f} -> {epoch_loss[-1]:.3f}")
    print(stats)
    print(f"stall fraction: {stats.stall_fraction:.1%} of the time iterating was spent waiting for input")


if __name__ == "__main__":
    main()
