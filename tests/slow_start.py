"""A dataset whose module takes SHMPIPE_TEST_SERVER_DELAY seconds to import
in shmpipe's fork server (a `python -c` process, which imports the modules
a pipeline's sources are made of before it forks a producer): a fresh
pipeline's producers start that much later, so the trainer's phase lasts as
long as a test needs (tests/test_first_batches.py). Imported anywhere else,
it costs nothing."""

import os
import sys
import time

from shmpipe.testing.datasets import Augmented

if sys.argv[:1] == ["-c"]:
    time.sleep(float(os.environ.get("SHMPIPE_TEST_SERVER_DELAY", "0")))


class SlowStart(Augmented):
    """Augmented, from this module (so the fork server imports it)."""
