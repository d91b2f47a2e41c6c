"""A run preempted in its second epoch and resumed from its checkpoint
delivers exactly the batches an uninterrupted run would."""

import os
import shutil
import tempfile

import numpy as np
import torch

import shmpipe

CHECKPOINT = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
EPOCHS = 3


class Images:  # a map-style dataset: a torch Dataset works as it is
    def __len__(self):
        return 100

    def __getitem__(self, k):
        return np.full((4, 4), k, dtype=np.float32), k % 10


def loader():
    return shmpipe.from_dataset(Images(), batch_size=8, shuffle=True, num_workers=2, seed=1)


def train(model, preempt_at=None):
    """Trains EPOCHS epochs from the last checkpoint; returns the sample sums seen."""
    seen = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with loader() as pipe:
        if os.path.exists(CHECKPOINT):
            checkpoint = torch.load(CHECKPOINT)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            pipe.load_state_dict(checkpoint["data"])  # before the first pass
        first_epoch = pipe.state_dict()["epoch"]
        for _epoch in range(first_epoch, EPOCHS):
            for image, label in pipe.to_torch():
                loss = (model(image.reshape(len(image), -1)).squeeze(1) - label.float()).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen.append(int(image.sum()))
                torch.save(  # every step here; every N steps in a real run
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": pipe.state_dict()},
                    CHECKPOINT,
                )
                if len(seen) == preempt_at:
                    return seen  # the job is killed here
    return seen


if __name__ == "__main__":
    try:
        torch.manual_seed(0)
        uninterrupted = train(torch.nn.Linear(16, 1))
        os.remove(CHECKPOINT)
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 1)
        before = train(model, preempt_at=20)
        after = train(torch.nn.Linear(16, 1))  # a new process in a real run: everything comes from the checkpoint
        same = before + after == uninterrupted
        print(f"batches: {len(uninterrupted)}, resumed after 20: {len(after)} more, same batches: {same}")
    finally:
        shutil.rmtree(os.path.dirname(CHECKPOINT))  # this example's folder; a real run keeps its checkpoints
