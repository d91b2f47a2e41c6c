"""What a pipeline's wait that finds nothing says: the end of its timeout's
message, and the warning to a consumer that holds so many slots that the
batch it waits for may never come."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from shmpipe.errors import ShmpipeWarning, users_stacklevel
from shmpipe.transport import ConsumerEnd, Launcher

__all__ = ["STALL_WARNING_NS", "STARTING", "describe_wait", "warn_if_held_up_by_consumer"]

#: After this long without a batch, a consumer that holds too many slots is
#: told so (once per pass): the batch it waits for may never come.
STALL_WARNING_NS = 10_000_000_000
#: A timeout's message while the producers start in the background.
STARTING = ": the producers are still starting (shmpipe's fork server too)"


def describe_wait(channel: ConsumerEnd | None, launcher: Launcher, restarts: Sequence[str] = ()) -> str:
    """What the wait is stuck on, punctuation included: the channel's word
    (none yet: no first batch), then the producers' side's, then the deaths
    replaced so far (`restarts`, max_restarts): a source that dies at the
    same batch every time is replaced until max_restarts runs out, and the
    wait shows only producers starting."""
    why = "no producer has delivered a first batch yet" if channel is None else channel.describe_wait()
    replaced = f"; {len(restarts)} producer death(s) replaced so far, the last: {restarts[-1]}" if restarts else ""
    return (f": {why}" if why else "") + launcher.describe_stall() + replaced


def warn_if_held_up_by_consumer(channel: ConsumerEnd | None, limit: int, capacity: int, waited_ns: int) -> bool:
    """Where this process holds more than `limit` of the `capacity` slots,
    the batch it waits for may never come: says so (without a timeout it
    would wait forever, silently, unless another thread lets go of
    batches). Returns whether it warned."""
    held = channel.held() if channel is not None else None
    if channel is None or held is None or held <= limit:
        return False
    warnings.warn(
        f"no batch for {waited_ns / 1e9:.0f} s, and this process holds {held} of the "
        f"{capacity} slots (at most {limit} leave the producers room to deliver what "
        f"it waits for): {channel.describe_wait()}. Unless another thread lets go of "
        "batches this waits forever; pass timeout= to get an error instead.",
        ShmpipeWarning,
        stacklevel=users_stacklevel(),  # the caller's next() or for loop
    )
    return True
