"""Train one model with DistributedDataParallel, every rank fed by one shared pipeline.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/ddp_train.py --workers 2 --epochs 3

torchrun starts one process per rank (one per GPU, usually) and sets
LOCAL_RANK and LOCAL_WORLD_SIZE. Every rank makes the same call,
``shmpipe.from_iterators(..., group=...)``: rank 0 starts the producers (2
here, not 2 per rank), each batch goes to exactly one rank, and every rank
gets the same number of batches per epoch, so DDP's all-reduces stay in step.
The batches are views of the shared ring in every rank (no copy). On the CPU
it uses the gloo backend; with GPUs, nccl and ``cuda:{rank}``.
See docs/several-ranks.md.
"""

import argparse
import os

from keras_fit import CLASSES, SHAPE, SyntheticImages  # the same producer

import shmpipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="producer processes, for all ranks together")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=20, help="batches per worker per epoch")
    # Every local rank of one torchrun has the same parent (its agent): a name
    # for this run's pipeline that no other run on the node has.
    parser.add_argument("--group", default=f"ddp-example-{os.getppid()}")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{rank}" if cuda else None
    if cuda:
        torch.cuda.set_device(rank)

    torch.manual_seed(0)  # the same initial weights in every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(SHAPE[0] * SHAPE[1], 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    ).to(device or "cpu")
    ddp = DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)

    epoch_loss = []
    # The same line in every rank: rank and num_ranks come from torchrun's environment.
    with shmpipe.from_iterators([SyntheticImages(args.batches)] * args.workers, group=args.group, timeout=120) as pipe:
        batches = pipe.to_torch(device=device)
        for _ in range(args.epochs):
            total = torch.zeros(2)
            for images, labels in batches:  # each epoch is a new pass, in step across ranks
                loss = torch.nn.functional.cross_entropy(ddp(images), labels)
                opt.zero_grad()
                loss.backward()  # the gradients' all-reduce: every rank takes part in every step
                opt.step()
                total += torch.tensor([loss.item(), 1.0])
            dist.all_reduce(total)  # the mean loss over every rank's batches
            epoch_loss.append((total[0] / total[1]).item())
        stats = pipe.stats()
        group = pipe.group_stats() if rank == 0 else None
        dist.barrier()  # every rank is done with its batches before rank 0 stops the producers

    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(
        f"rank {rank}: {stats.batches} batches in {stats.passes} epochs, waited {stats.wait_total_s:.3f} s, "
        f"weights checksum {checksum:.6f}",
        flush=True,
    )
    if group is not None:
        print(f"trained on {device or 'cpu'} with {dist.get_world_size()} ranks: "
              f"loss {epoch_loss[0]:.3f} -> {epoch_loss[-1]:.3f}")
        print(f"batches per rank {list(group.batches_per_rank)}, remainder dropped {group.dropped_remainder}, "
              f"producer processes {len(pipe.pids)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
