from array import array

class ReadyCounter:
    def __init__(
        self,
        tally: array[int],
        batches: int,
        nbytes: int,
        workers: int,
        nworkers: int,
        hist: int,
        buckets: int,
        sub: int,
        wait_count: int,
        wait_total: int,
        wait_max: int,
    ) -> None: ...
    def count(self, wait_ns: int, nbytes: int, worker: int) -> None: ...
