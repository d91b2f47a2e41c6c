"""shmpipe's benchmarks, importable so the command line and the scripts in
benchmarks/ share one implementation."""
