"""What each pass of a pipeline does, and where a run stands: the
consumer's side of epochs, samplers and checkpoints.

A *schedule* turns "begin a pass" into one PassWork per producer (the
epoch, its seeds, what to skip, a dataset's plan), and turns "so many of
each worker's batches were delivered" into a checkpoint state: small, JSON,
versioned, naming what it belongs to. Loading a state makes the next pass
begin where the saved run stood.

- IteratorSchedule (from_iterators): each worker's source is called again
  per pass; a resumed pass skips, per worker, the batches already
  delivered (resume by count: they are made again, not published).
- DatasetSchedule (from_dataset): the consumer draws each epoch's batches
  of indices (the sampler, the shuffle) and deals them round-robin to the
  workers, so the batches and their order depend on neither the number of
  workers nor timing. A resumed epoch deals only the batches not yet
  delivered: no sample before the position is fetched again, and the
  number of workers may differ from the saved run's. In a job of several
  nodes (shmpipe/_nodes.py) each node's schedule keeps the node's share of
  the epoch, and its state is still the job's position: a layout of
  another number of nodes or ranks resumes from it.

Producers run the other half (shmpipe/_sources.py). The state is read in
the consumer from a file the user keeps; it is checked field by field
(shmpipe/_state_fields.py) and a state that does not fit this pipeline is
refused with the field named, never run as something else.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from shmpipe._epochs import Drawn, EpochDraws, declared_len, indices_of, read_whole, subplan
from shmpipe._nodes import ONE_NODE, NodeLayout
from shmpipe._producer_context import PassWork, seed_for
from shmpipe._sources import DatasetPlan
from shmpipe._state_fields import STATE_FORMAT, STATE_VERSION, StateFields, shown
from shmpipe.errors import ShmpipeValueError, ShmpipeWarning, users_stacklevel

__all__ = ["DatasetSchedule", "IteratorSchedule", "Schedule", "start_problem"]

class Progress(NamedTuple):
    """How far the consumer got in the pass in progress: per worker, how
    many of its batches of the pass were delivered; the worker whose turn
    is next in an ordered pass (None unordered, or at the end); whether
    the pass ended (every batch delivered); and the iterators' own states.

    (A NamedTuple, which a fresh process defines in a fifth of a frozen
    dataclass's time: docs/design.md, "A fresh pipeline's first batches".)
    """

    delivered: Sequence[int]
    next_turn: int | None
    finished: bool
    #: per worker, its source's iterator's state after its last batch
    #: delivered this pass (None where it has no state_dict, or delivered none)
    iterator_states: Sequence[Any] = ()
    #: batches of the pass the consumer made itself (DatasetSchedule.hand_over):
    #: the first ones of its share, delivered before any producer's
    made_here: int = 0


class Schedule(abc.ABC):
    """The passes of one pipeline: their work, and the checkpoint state."""

    #: The state's "kind": what made the pipeline.
    kind: ClassVar[str]
    #: Whether the first pass may begin as the producers start, before it is
    #: iterated (from_iterators prefetches; a dataset waits, since a state
    #: loaded before the first pass would make the fetched samples waste).
    begins_early: ClassVar[bool]

    def __init__(self, num_workers: int, seed: int, seed_given: bool) -> None:
        self.num_workers = num_workers
        self.seed = seed
        self.seed_given = seed_given
        #: The epoch the next pass begun serves.
        self.next_epoch = 0
        #: The epoch of the pass begun last (None before the first).
        self.epoch: int | None = None
        #: In an ordered pass, the worker whose turn comes first.
        self.first_turn = 0
        #: Batches of the pass begun last that no rank of the job gets (the
        #: schedule dropped them: an incomplete last round of a job of
        #: several nodes). A group's leader adds its own.
        self.dropped = 0
        self._works: list[PassWork] = []  # the pass begun last's

    def batch_sizes_vary(self, local_rank: int | None = None) -> bool:
        """Whether the schedule knows that the batches a pass gives this
        node (with `local_rank`, that rank of it) may differ in size: a
        dataset's partial last batch, a batch_sampler's batches. False
        where only the batches can tell (from_iterators)."""
        return False

    def short_batch(self, local_rank: int | None = None) -> int | None:
        """The rows of the one short batch of an epoch that batch_sizes_vary
        gives this node (rank), where the arguments fix it and the default
        collate makes the batches (each array's first axis is the batch's
        samples); None otherwise."""
        return None

    def fingerprint(self) -> dict[str, Any]:
        """What every rank of a group must agree on about the batches (a
        seed chosen by the user; a drawn one comes from rank 0)."""
        return {"kind": self.kind, "seed": self.seed if self.seed_given else None}

    def adopt_seed(self, seed: int) -> None:
        """Rank 0's seed, for a rank that was given none (its own was drawn
        at random): the batches are rank 0's pipeline's."""
        if not self.seed_given:
            self.seed = seed

    def begin(self, pass_no: int) -> list[PassWork]:
        """The work of each producer for the next pass (numbered `pass_no`
        on the channel), which serves epoch `next_epoch`. Where it raises
        (a sampler that fails), the schedule is as it was."""
        epoch = self.next_epoch
        works = self._work(pass_no, epoch)
        self.epoch, self.next_epoch, self._works = epoch, epoch + 1, works
        return works

    @abc.abstractmethod
    def _work(self, pass_no: int, epoch: int) -> list[PassWork]: ...

    def resumed(self, worker: int, next_wseq: int) -> PassWork:
        """The work of the pass begun last for a producer that replaces
        `worker`'s, which published that pass's batches up to `next_wseq`
        (max_restarts): the same work, going on from there."""
        return self._go_on(self._works[worker], worker, next_wseq)

    @abc.abstractmethod
    def _go_on(self, work: PassWork, worker: int, next_wseq: int) -> PassWork: ...

    def _seed(self, epoch: int, worker: int) -> int:
        return seed_for(self.seed, epoch, worker)

    def state(self, progress: Progress | None) -> dict[str, Any]:
        """The checkpoint: where a new pipeline given it should begin.
        `progress` is that of the pass begun last (begun ahead of its
        iteration: nothing delivered yet); None when none was begun since
        the pipeline was made or a state loaded."""
        head = {"format": STATE_FORMAT, "version": STATE_VERSION, "kind": self.kind}
        if progress is None:
            return head | self._pending()
        if progress.finished:
            return head | self._fresh(self.next_epoch)
        assert self.epoch is not None  # a pass is in progress
        return head | self._within(self.epoch, progress)

    @abc.abstractmethod
    def _fresh(self, epoch: int) -> dict[str, Any]:
        """The state at the start of `epoch`."""

    @abc.abstractmethod
    def _pending(self) -> dict[str, Any]:
        """The state before the next pass began (a fresh one, or one loaded)."""

    @abc.abstractmethod
    def _within(self, epoch: int, progress: Progress) -> dict[str, Any]:
        """The state within the pass in progress."""

    def load(self, state: Any) -> None:
        """Makes the next pass begin where `state` says. Everything is
        checked first: a state refused leaves the schedule as it was."""
        fields = StateFields(state, self.kind)
        seed = fields.integer("seed", 0, (1 << 63) - 1)
        if self.seed_given and seed != self.seed:
            raise ShmpipeValueError(
                f"the state's seed is {seed}, this pipeline's is {self.seed}: the saved run's batches came "
                "from its seed; pass seed=None (the state's is used) or the same seed"
            )
        self._load(fields, seed)
        self.seed = seed
        self.epoch = None

    def saved(self) -> dict[str, Any]:
        """What load() and begin() may change, to put back with restore()
        where a step after them fails (a group's rank 0 loads its position,
        then its leader's pipeline). They assign attributes and never change
        one in place, so a shallow copy is whole (but for a dataset's draws,
        which are kept: what a sampler drew, it drew)."""
        return dict(vars(self))

    def restore(self, saved: dict[str, Any]) -> None:
        vars(self).clear()
        vars(self).update(saved)

    @abc.abstractmethod
    def _load(self, fields: StateFields, seed: int) -> None:
        """Checks the rest of the state (the pipeline's batches come from
        `seed`, the state's) and keeps it for the next pass; raises, with
        nothing changed, where it does not fit."""


class IteratorSchedule(Schedule):
    """from_iterators: each source is called again each pass. A resumed
    pass goes on from each source's iterator's own state where it has one
    (state_dict/load_state_dict: the state after the last batch delivered),
    else by count (the delivered batches are made again, not published)."""

    kind = "from_iterators"
    begins_early = True

    def __init__(self, num_workers: int, seed: int, seed_given: bool) -> None:
        super().__init__(num_workers, seed, seed_given)
        none: list[Any] = [None] * num_workers
        # Loaded, for the next pass: per worker, the batches delivered before
        # and its iterator's state after the last of them (or None).
        self._loaded: tuple[list[int], list[Any]] | None = None
        self._turn = 0  # loaded: whose turn comes first
        # The pass in progress began after these (the loaded position's).
        self._before: tuple[list[int], list[Any]] = ([0] * num_workers, none)

    def _work(self, pass_no: int, epoch: int) -> list[PassWork]:
        fresh: tuple[list[int], list[Any]] = ([0] * self.num_workers, [None] * self.num_workers)
        (counts, states), self._loaded = self._loaded or fresh, None
        self._before = (counts, states)
        self.first_turn, self._turn = self._turn, 0
        work = []
        for w in range(self.num_workers):
            if states[w] is not None:  # from the iterator's own state: nothing is made again
                work.append(PassWork(pass_no, epoch, self._seed(epoch, w), plan={"iterator_state": states[w]}))
            else:
                work.append(PassWork(pass_no, epoch, self._seed(epoch, w), skip=counts[w]))
        return work

    def _go_on(self, work: PassWork, worker: int, next_wseq: int) -> PassWork:
        # The source is called again (from the loaded iterator state, if
        # any): the batches published before are made again and not
        # published, after those a resume skipped.
        return dataclasses.replace(work, skip=work.skip + next_wseq, first_wseq=next_wseq)

    def _fields(self, epoch: int, delivered: Sequence[int], states: Sequence[Any], turn: int) -> dict[str, Any]:
        return {
            "sources": self.num_workers,
            "seed": self.seed,
            "epoch": epoch,
            "delivered": [int(d) for d in delivered],
            "iterator_states": list(states),
            "next_turn": turn,
        }

    def _fresh(self, epoch: int) -> dict[str, Any]:
        return self._fields(epoch, [0] * self.num_workers, [None] * self.num_workers, 0)

    def _pending(self) -> dict[str, Any]:
        if self._loaded is None:
            return self._fresh(self.next_epoch)
        counts, states = self._loaded
        return self._fields(self.next_epoch, counts, states, self._turn)

    def _within(self, epoch: int, progress: Progress) -> dict[str, Any]:
        counts, states = self._before
        delivered = [c + d for c, d in zip(counts, progress.delivered, strict=True)]
        # A worker that delivered nothing since the pass began is where the
        # pass began it: its loaded state (or None).
        after = [
            mine if d else loaded
            for d, loaded, mine in zip(progress.delivered, states, progress.iterator_states, strict=True)
        ]
        return self._fields(epoch, delivered, after, progress.next_turn or 0)

    def _load(self, fields: StateFields, seed: int) -> None:
        sources = fields.integer("sources", 1, 1 << 20)
        if sources != self.num_workers:
            raise ShmpipeValueError(
                f"the state is of a pipeline of {sources} sources, this one has {self.num_workers}: "
                "from_iterators resumes each source where it was, so their number must be the same"
            )
        epoch = fields.integer("epoch", 0, 1 << 62)
        delivered = fields.integers("delivered", sources, 0, 1 << 62)
        states = fields.value("iterator_states")
        if not isinstance(states, list) or len(states) != sources:
            raise ShmpipeValueError(f"malformed state: 'iterator_states' must be a list of {sources} (null or a state)")
        turn = fields.integer("next_turn", 0, sources - 1)
        fields.done()
        self.next_epoch = epoch
        self._loaded = (delivered, list(states))
        self._turn = turn


class DatasetSchedule(Schedule):
    """from_dataset: the consumer draws each epoch's batches of indices and
    deals them round-robin (global batch b to worker b % num_workers); a
    resumed epoch deals those not yet delivered."""

    kind = "from_dataset"
    begins_early = False

    def __init__(
        self,
        num_workers: int,
        seed: int,
        seed_given: bool,
        *,
        length: int,
        batch_size: int | None,
        shuffle: bool,
        drop_last: bool,
        sampler: Iterable[int] | None,
        batch_sampler: Iterable[Sequence[int]] | None,
        layout: NodeLayout = ONE_NODE,
        ordered: bool = True,
        draws: EpochDraws | None = None,
        default_collate: bool = False,
    ) -> None:
        super().__init__(num_workers, seed, seed_given)
        #: Whether the default collate makes the batches (short_batch).
        self.default_collate = default_collate
        #: Which share of each epoch this node's pipeline fetches.
        self.layout = layout
        #: Whether the node's batches are delivered in the order dealt: a
        #: node's own state (several nodes, one rank) is told from a count.
        self.ordered = ordered
        self.length = length
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        #: Loaded, for the next pass: its epoch's batches (drawn and checked
        #: against the state when it was loaded: the sampler is drawn once an
        #: epoch), their digest, and which of them were done.
        self._loaded: tuple[tuple[np.ndarray, np.ndarray], str, np.ndarray] | None = None
        self._says_empty_epochs = True  # (one_reader() says it instead)
        self._said_no_batches = False  # an epoch of the user's sampler with none: said once
        #: The epochs drawn in this process (_drawn): shared with one_reader()'s.
        self._draws = EpochDraws() if draws is None else draws
        self._draws.share(self)
        # the pass in progress: its epoch's batches, which were done before
        # it began, and which global batches each worker has, in order
        self._drawn_now = Drawn((np.zeros(0, np.int64), np.zeros(1, np.int64)), "")
        self._done = np.zeros(0, bool)
        self._left = np.zeros(0, np.int64)  # the epoch's batches not done before it began, in dealing order
        self._mine = np.zeros(0, np.int64)  # of those, this node's, in the order its ranks take them
        self._dealt: list[np.ndarray] = []

    def fingerprint(self) -> dict[str, Any]:
        return super().fingerprint() | {
            "length": self.length,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "sampler": self.sampler_name,
            "num_nodes": self.layout.num_nodes,
            "node_rank": self.layout.node_rank,
        }

    def one_reader(self, share_draws: bool) -> DatasetSchedule:
        """The same batches, this node's share of them, as one sequence
        (one worker): what a rank of a group keeps to know where the job
        stands from its own count (state_after_rounds)."""
        # In rank 0's process this schedule runs beside its reader: the
        # reader says what both would (an epoch that goes to no rank).
        self._says_empty_epochs = False
        return DatasetSchedule(
            1,
            self.seed,
            self.seed_given,
            length=self.length,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            sampler=self.sampler,
            batch_sampler=self.batch_sampler,
            layout=self.layout,
            ordered=self.ordered,
            # In a group's rank 0 the leader's pipeline runs this schedule: one
            # draw for both. (Elsewhere this one never begins: shared, no draw
            # would ever be dropped.)
            draws=self._draws if share_draws else None,
        )

    @property
    def remaining(self) -> int:
        """Batches of the pass begun last that were not done before it
        began (on every node)."""
        return len(self._left)

    def batch_sizes_vary(self, local_rank: int | None = None) -> bool:
        if self.batch_sampler is not None:
            return True
        if self.drop_last:
            return False
        assert self.batch_size is not None
        if self.sampler is None:
            partial = self.length % self.batch_size != 0
        else:  # a sampler may give any number of indices; one with a usable length says
            declared = declared_len(self.sampler)
            partial = declared is None or declared % self.batch_size != 0
        if not partial or self.layout.world == 1:
            return partial
        # The partial batch is the epoch's last, so the last of the batches
        # left to deal (after a resume too): in rounds of W, only the last
        # rank of the last node can get it (where the last round is whole;
        # an incomplete one goes to no rank).
        last = self.layout.node_rank == self.layout.num_nodes - 1
        return last and (local_rank is None or local_rank == self.layout.ranks_per_node - 1)

    def short_batch(self, local_rank: int | None = None) -> int | None:
        # Only the dataset's own length fixes it (a sampler's may change with
        # its epoch), and where W ranks deal the epoch, only an epoch of whole
        # rounds gives the last rank the short batch (batch_sizes_vary says
        # "may": after a resume on another layout, an epoch may end either way).
        if self.batch_sampler is not None or self.sampler is not None or not self.default_collate:
            return None
        if not self.batch_sizes_vary(local_rank):
            return None
        assert self.batch_size is not None
        if -(-self.length // self.batch_size) % self.layout.world:
            return None
        return self.length % self.batch_size

    @property
    def sampler_name(self) -> str:
        chosen = self.batch_sampler if self.batch_sampler is not None else self.sampler
        return "shuffle" if chosen is None and self.shuffle else "sequential" if chosen is None else _name(chosen)

    # -- an epoch's batches ---------------------------------------------------

    def epoch_plan(self, epoch: int, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(indices, bounds): epoch `epoch`'s batches, batch b being
        indices[bounds[b]:bounds[b + 1]]. The same for the same arguments
        and epoch, whatever the number of workers. `seed`: the shuffle's
        (this pipeline's by default)."""
        if self.batch_sampler is not None:
            _set_epoch(self.batch_sampler, epoch)
            batches = [indices_of(b, f"batch_sampler's batch {i}") for i, b in enumerate(read_whole(
                self.batch_sampler, "batch_sampler", self.length, batches=True))]
            lengths = np.fromiter((len(b) for b in batches), np.int64, len(batches))
            if np.any(lengths == 0):
                raise ShmpipeValueError(f"batch_sampler gave an empty batch (batch {int(np.argmin(lengths))})")
            indices = np.concatenate(batches) if batches else np.zeros(0, np.int64)
            bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        else:
            if self.sampler is not None:
                _set_epoch(self.sampler, epoch)
                order = indices_of(read_whole(self.sampler, "sampler", self.length), "sampler")
            elif self.shuffle:
                seed = self.seed if seed is None else seed
                rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(epoch,)))
                order = rng.permutation(self.length).astype(np.int64, copy=False)  # (int64 already: no copy)
            else:
                order = np.arange(self.length, dtype=np.int64)
            size = self.batch_size
            assert size is not None  # check_dataset_arguments: a batch size without batch_sampler
            count = len(order) // size if self.drop_last else math.ceil(len(order) / size)
            indices = order[: count * size] if self.drop_last else order
            bounds = np.minimum(np.arange(count + 1, dtype=np.int64) * size, len(indices))
        if len(indices) and (indices.min() < 0 or indices.max() >= self.length):
            bad = int(indices[(indices < 0) | (indices >= self.length)][0])
            raise ShmpipeValueError(f"the sampler gave index {bad}, outside the dataset's {self.length} samples")
        return indices, bounds

    # -- passes -----------------------------------------------------------------

    def _work(self, pass_no: int, epoch: int) -> list[PassWork]:
        if self._loaded is not None:  # epoch `epoch`'s, checked against the state when loaded
            plan, digest, done = self._loaded
            drawn = Drawn(plan, digest)
        else:
            drawn = self._drawn(epoch)
            done = np.zeros(len(drawn.plan[1]) - 1, bool)
        self._loaded = None
        self._draws.began(self, epoch)
        self._drawn_now, self._done = drawn, done
        self._left = np.flatnonzero(~done)
        self._mine, self.dropped = self.layout.share(self._left)
        if self._says_empty_epochs and len(done) == 0:
            self._say_no_batches(epoch)
        if self._says_empty_epochs and not done.any() and 0 < len(done) < self.layout.world:
            warnings.warn(
                f"an epoch of {len(done)} batch{'es' if len(done) > 1 else ''} goes to no rank: the job's "
                f"{self.layout.world} ranks ({_count(self.layout.num_nodes, 'node')} of "
                f"{_count(self.layout.ranks_per_node, 'rank')}) take complete rounds only, one batch each; make "
                "the batches smaller, or the job",
                ShmpipeWarning,
                stacklevel=users_stacklevel(),
            )
        self.first_turn = 0
        return self._deal(pass_no, epoch, 0)

    def _say_no_batches(self, epoch: int) -> None:
        """An epoch of no batches from the user's sampler (an empty dataset
        is said at construction): its loop would end at once, silently, as
        the DataLoader's does. Said once a pipeline, as a sampler may give
        none in some epochs only."""
        if self._said_no_batches or (self.sampler is None and self.batch_sampler is None):
            return
        self._said_no_batches = True
        if self.batch_sampler is not None:
            why = "its batch_sampler gave no batch"
        elif self.drop_last:
            why = f"its sampler gave fewer indices than a batch of {self.batch_size}, and drop_last=True"
        else:
            why = "its sampler gave no index"
        warnings.warn(f"epoch {epoch} of this pipeline has no batches: {why}", ShmpipeWarning,
                      stacklevel=users_stacklevel())

    def _deal(self, pass_no: int, epoch: int, made_here: int) -> list[PassWork]:
        """The producers' work: this node's batches after the first
        `made_here`, round-robin from worker 0."""
        rest = self._mine[made_here:]
        self._dealt = [rest[w :: self.num_workers] for w in range(self.num_workers)]
        return [PassWork(pass_no, epoch, self._seed(epoch, w), plan=self._plan_for(self._dealt[w], epoch))
                for w in range(self.num_workers)]

    # -- the consumer's own first batches (shmpipe/_first_batches.py) ---------------

    @property
    def share(self) -> int:
        """This node's batches in the pass begun last."""
        return len(self._mine)

    def plan_of(self, k: int) -> DatasetPlan:
        """The plan of the k-th batch of this node's share of the pass begun
        last, alone: what the consumer fetches when it makes it itself."""
        assert self.epoch is not None  # a pass was begun
        return self._plan_for(self._mine[k : k + 1], self.epoch)

    def hand_over(self, pass_no: int, made_here: int) -> list[PassWork]:
        """The pass begun last, dealt again now that the consumer makes its
        first `made_here` batches itself (it made or is making them; the
        producers had no work of this pass yet): the producers' work is the
        rest, round-robin from worker 0, so the order the node's ranks take
        its batches in is unchanged."""
        assert self.epoch is not None and 0 <= made_here <= len(self._mine)
        self._works = self._deal(pass_no, self.epoch, made_here)
        return self._works

    def _plan_for(self, numbers: np.ndarray, epoch: int) -> DatasetPlan:
        indices, bounds = subplan(*self._drawn_now.plan, numbers)
        return DatasetPlan(indices, bounds, numbers, self.seed, epoch)

    def _seed(self, epoch: int, worker: int) -> int:
        # Worker w of node n > 0 draws its own seeds: the workers of two
        # nodes must not make the same random augmentations. Node 0's are
        # a single node's.
        return seed_for(self.seed, epoch, worker, self.layout.node_rank)

    def _go_on(self, work: PassWork, worker: int, next_wseq: int) -> PassWork:
        # Only the batches it had not published: nothing is fetched twice.
        plan = self._plan_for(self._dealt[worker][next_wseq:], work.epoch)
        return dataclasses.replace(work, plan=plan, first_wseq=next_wseq)

    # -- the state ----------------------------------------------------------------

    def _fields(self, epoch: int, digest: str | None, done: np.ndarray | None) -> dict[str, Any]:
        """The state at `epoch`, `done` its batches out of the epoch drawn
        as `digest`. Where none is out (or the epoch is not drawn: None),
        it names the epoch alone ('plan' and 'batches' null), and the pass
        draws it as it begins, as in a run that took no state: drawn for
        the state, the sampler ran early, so what the program changed in it
        between epochs (a curriculum, weights, a global RNG it draws from)
        came an epoch late in runs that took states, and one that could
        not draw yet failed the checkpoint."""
        below, extra = 0, []
        if done is None or not done.any():
            digest, batches = None, None
        else:
            missing = np.flatnonzero(~done)
            below = int(missing[0]) if len(missing) else len(done)
            extra = (np.flatnonzero(done[below:]) + below).tolist()
            batches = len(done)
        return {
            "length": self.length,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "sampler": self.sampler_name,
            "seed": self.seed,
            "epoch": epoch,
            "batches": batches,
            "plan": digest,
            "done_below": below,
            "done": extra,
        }

    def _fresh(self, epoch: int) -> dict[str, Any]:
        return self._fields(epoch, None, None)

    def _drawn(self, epoch: int) -> Drawn:
        """Epoch `epoch`'s batches and their digest, drawn once (_draw), by
        the begin() of its pass (a state of an epoch none of whose batches
        is done names the epoch alone: _fields)."""
        return self._draw(epoch, self.seed)

    def _draw(self, epoch: int, seed: int) -> Drawn:
        """Epoch `epoch`'s batches of shuffle seed `seed`, drawn once for this
        pipeline and, in a group's rank 0, its count (shmpipe/_epochs.py)."""
        shuffled = self.sampler is None and self.batch_sampler is None and self.shuffle
        return self._draws.get((epoch, seed if shuffled else None), lambda: self.epoch_plan(epoch, seed))

    def start_point(self) -> str:
        """Where the pass begun last began, named: its epoch, its batches,
        and which of them were done before it (a loaded state's). Every
        rank of a group must begin each pass where rank 0's pipeline does,
        having loaded the same state or none: the leader compares theirs
        (shmpipe/_group)."""
        done = self._done
        which = hashlib.blake2b(np.packbits(done).tobytes(), digest_size=4).hexdigest()
        # (the seed too: a state of another run may name the same position)
        where = f"epoch {self.epoch}, seed {self.seed}, {int(done.sum())} of {len(done)} batches done ({which})"
        return f"{where}{_ORDER}{self._drawn_now.digest}"

    def _pending(self) -> dict[str, Any]:
        if self._loaded is None:
            return self._fresh(self.next_epoch)
        _, digest, done = self._loaded
        return self._fields(self.next_epoch, digest, done)

    def _within(self, epoch: int, progress: Progress) -> dict[str, Any]:
        done = self._done.copy()
        if self.layout.world == 1:
            done[self._mine[: progress.made_here]] = True
            for dealt, count in zip(self._dealt, progress.delivered, strict=True):
                done[dealt[:count]] = True
        else:
            # One node of several: the job's position, from this node's
            # count. Every rank of the job takes one batch a round, so after
            # this node's one rank took n, the first n rounds are out on
            # every node. (A group's ranks count for themselves: RankPipeline.)
            if not self.ordered and (any(progress.delivered) or progress.made_here):
                raise ShmpipeValueError(
                    "the position of a job of several nodes is saved with ordered=True only: this node alone "
                    "cannot tell which batches an unordered job handed out"
                )
            taken = progress.made_here + sum(progress.delivered)
            return self._after_rounds(epoch, taken // self.layout.ranks_per_node)
        # Its last batch is out: a resumed run begins the next epoch, not this
        # one's empty end. (An epoch of no batches is where it began until
        # its pass ends: the epoch alone, as a state of it loaded says.)
        if len(done) and done.all():
            return self._fresh(epoch + 1)
        return self._fields(epoch, self._drawn_now.digest, done)

    def state_after_rounds(self, rounds: int) -> dict[str, Any]:
        """The checkpoint once `rounds` rounds of the pass begun last are
        out: every rank of every node took `rounds` batches of it, so the
        first rounds * W batches left when it began are out. What a rank
        tells from its own count, whatever the layout."""
        assert self.epoch is not None  # a pass was begun
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "kind": self.kind} | self._after_rounds(
            self.epoch, rounds
        )

    def _after_rounds(self, epoch: int, rounds: int) -> dict[str, Any]:
        taken = rounds * self.layout.world
        if rounds and len(self._left) - taken < self.layout.world:
            # Its last round is out: a resumed run begins the next epoch, not
            # this one's remainder (dropped, as it would have been). Before
            # any round (a pass begun, nothing of it out: just after a load,
            # fewer than a round left for this layout), the position is where
            # the pass began, as a rank of a group that has begun none says:
            # another layout may still deal that remainder.
            return self._fresh(epoch + 1)
        done = self._done.copy()
        done[self._left[:taken]] = True
        return self._fields(epoch, self._drawn_now.digest, done)

    def _load(self, fields: StateFields, seed: int) -> None:
        for name, mine in (("length", self.length), ("batch_size", self.batch_size), ("drop_last", self.drop_last)):
            theirs = fields.value(name)
            # As JSON gives it back: 2.0 or True is not 2 (whatever int
            # subclass the pipeline was given).
            want = type(None) if mine is None else bool if isinstance(mine, bool) else int
            if type(theirs) is not want or theirs != mine:
                raise ShmpipeValueError(
                    f"the state's {name} is {shown(theirs)}, this pipeline's is {mine!r}: it belongs to another "
                    "dataset or loader"
                )
        sampler = fields.text("sampler")
        if sampler != self.sampler_name:
            raise ShmpipeValueError(
                f"the state's sampler is {sampler!r}, this pipeline's is {self.sampler_name!r}: it belongs to "
                "another loader"
            )
        epoch = fields.integer("epoch", 0, 1 << 62)
        if fields.value("plan") is None:  # the epoch alone (_fields): its pass draws it
            if fields.value("batches") is not None:
                raise ShmpipeValueError("malformed state: 'batches' must be null where 'plan' is")
            fields.integer("done_below", 0, 0)  # none of it done (each names its field where it is not so)
            fields.integers("done", 0, 0, 0)
            fields.done()
            self.next_epoch = epoch
            self._loaded = None
            return
        batches = fields.integer("batches", 0, 1 << 62)
        digest = fields.text("plan")
        below = fields.integer("done_below", 0, batches)
        extra = fields.integers("done", None, below + 1, batches - 1)
        if any(b >= a for a, b in zip(extra[1:], extra, strict=False)):
            raise ShmpipeValueError("malformed state: 'done' must be increasing")
        fields.done()
        # The epoch's batches as this pipeline draws them, before anything
        # is sized from the state's count: a state of another order, or a
        # count that is not the epoch's (2**62 would size the mask below),
        # is refused here, with the schedule as it was.
        drawn = self._draw(epoch, seed)
        if drawn.digest != digest or len(drawn.plan[1]) - 1 != batches:
            raise ShmpipeValueError(
                f"the state's epoch {epoch} had other batches than this pipeline draws for it "
                f"(sampler {self.sampler_name!r}): a sampler of your own must give the same indices for "
                "the same epoch (seed it, or give it set_epoch) to resume exactly"
            )
        done = np.zeros(batches, bool)
        done[:below] = True
        done[extra] = True
        self.next_epoch = epoch
        self._loaded = (drawn.plan, digest, done)


#: Between a start point's position and its epoch's order (start_point).
_ORDER = "; order "


def start_problem(theirs: str | None, ours: str) -> tuple[bool, str] | None:
    """What is wrong with a rank's start point against rank 0's pipeline's
    (DatasetSchedule.start_point): None where they agree; (True, why) where
    the rank counts from another position (it loaded another state, or
    none); (False, why) where only the epoch's order differs: its sampler
    drew other indices (seeded per rank), and the batches, rank 0's draw,
    are right, but that rank's states name the order it drew (helper 54:
    only that rank can resume from them; and several nodes would each deal
    their own draw)."""
    if theirs == ours:
        return None
    where, _, order = (theirs or "").partition(_ORDER)
    our_where, _, our_order = ours.partition(_ORDER)
    if where != our_where:
        return True, (
            f"begins at {theirs!r:.160}, rank 0's pipeline at {ours!r}: every rank must load the same state "
            "before its first pass, or none"
        )
    return False, (
        f"drew another order for {where.partition(',')[0]} than rank 0 ({order:.20} vs {our_order}): the batches "
        "dealt are rank 0's draw, but this rank's state_dict() names its own order, which only it can resume "
        "from (each rank loading its own state), and nodes would each deal their own draw; have the sampler "
        "draw the same indices on every rank (seed it alike, or give it set_epoch)"
    )


# -- helpers ----------------------------------------------------------------------


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _set_epoch(sampler: Any, epoch: int) -> None:
    """A sampler with set_epoch (torch's DistributedSampler, and others by
    that convention) is told the epoch before it is drawn."""
    set_epoch: Callable[[int], Any] | None = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"
