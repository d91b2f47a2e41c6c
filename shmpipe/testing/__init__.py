"""Test helpers shipped with shmpipe.

``shmpipe.testing.sources`` holds picklable sources (producers run them in
other processes, so they must be importable there) that the test suite, the
benchmarks, and third-party transport tests use.
"""

import sys

if "pytest" in sys.modules:
    # The conformance suite's asserts say what they compared (the lists of
    # batches seen, not a bare AssertionError): pytest rewrites a module's
    # asserts only where it is told before the module is imported, which
    # this package's import always comes before.
    sys.modules["pytest"].register_assert_rewrite("shmpipe.testing.conformance", "shmpipe.testing.assertions")
