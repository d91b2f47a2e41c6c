"""Test helpers shipped with shmpipe.

``shmpipe.testing.sources`` holds picklable sources (producers run them in
other processes, so they must be importable there) that the test suite, the
benchmarks, and third-party transport tests use.
"""
