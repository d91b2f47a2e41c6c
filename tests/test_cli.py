"""`shmpipe bench ...` and `shmpipe clean`: every option, at a tiny size
(the code paths, never the timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import shmpipe
from shmpipe import registry
from shmpipe.__main__ import main
from shmpipe.bench._report import parse_size
from shmpipe.transports.queue import QueueTransport

TINY_SEED = ["--workers", "2", "--batches", "2", "--shape", "2,100,3", "--fetch", "0.01", "--compute", "0.002", "--train", "0.002"]


def png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5000


def test_seed_every_option(tmp_path, capsys):
    out_json, out_png = tmp_path / "seed.json", tmp_path / "seed.png"
    recipes = ["generator", "tf.data", "mp.Queue", "shmpipe:shm", "shmpipe:shm+reserve", "shmpipe:arrow",
               "shmpipe:queue", "shmpipe:example-pipe"]
    rc = main(["bench", "seed", *TINY_SEED, "--recipes", *recipes, "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "2 producers, 2 batches each of (2, 100, 3)" in text and "fetch 0.01 s, compute 0.002 s, train step 0.002 s" in text
    data = json.loads(out_json.read_text())
    assert data["benchmark"] == "seed" and data["config"]["shape"] == [2, 100, 3]
    assert "python" in data["environment"] and "numpy" in data["environment"]
    got = {r["recipe"]: r for r in data["results"]}
    assert list(got) == recipes
    assert len(got["generator"]["waits_s"]) == 2 and len(got["tf.data"]["waits_s"]) == 2
    for name in recipes[2:]:
        assert len(got[name]["waits_s"]) == 4, name  # 2 producers x 2 batches
        assert got[name]["skipped"] is None
    for name in recipes:
        assert f"| {name} |" in text
    assert "speed-up vs tf.data" in text and "| tf.data | - |" in text
    assert png(out_png)


def test_seed_ray_recipes(tmp_path, capsys):
    rc = main(["bench", "seed", *TINY_SEED, "--recipes", "ray.util.iter", "shmpipe:ray", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    got = {r["recipe"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert len(got["ray.util.iter"]["waits_s"]) == 4 and len(got["shmpipe:ray"]["waits_s"]) == 4


class Missing(QueueTransport):
    requires = ("a_module_nobody_installed_xyz",)
    extra = "demo"


def test_seed_skips_what_cannot_run_here_and_refuses_unknown_recipes(capsys):
    registry.register_transport("missing-dep", Missing)
    try:
        rc = main(["bench", "seed", *TINY_SEED, "--recipes", "generator", "shmpipe:missing-dep"])
    finally:
        registry._registered.pop("missing-dep")
    assert rc == 0
    assert 'skipped: the \'missing-dep\' transport needs a_module_nobody_installed_xyz' in capsys.readouterr().out
    assert main(["bench", "seed", *TINY_SEED, "--recipes", "nope"]) == 2
    assert "unknown recipes ['nope']" in capsys.readouterr().err


def test_throughput_every_option(tmp_path, capsys):
    paths = ["memcpy", "mp.Queue", "shm ring", "shm reserve", "shm varying", "transport:arrow", "transport:queue", "transport:example-pipe"]
    rc = main([
        "bench", "throughput", "--sizes", "4KiB", "8KiB", "--seconds", "0.02", "--min-batches", "2", "--workers", "1",
        "--paths", *paths, "--json", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png"),
    ])
    assert rc == 0
    text = capsys.readouterr().out
    assert "1 producers" in text
    data = json.loads((tmp_path / "t.json").read_text())
    assert [(r["path"], r["nbytes"]) for r in data["results"]] == [(p, n) for n in (4096, 8192) for p in paths]
    assert all(r["batches"] >= 2 for r in data["results"])
    assert "| 8 KiB | transport:example-pipe |" in text
    assert png(tmp_path / "t.png")


def test_throughput_default_paths_cover_every_transport():
    from shmpipe.bench.throughput import default_paths

    paths = default_paths()
    assert paths[:5] == ["memcpy", "mp.Queue", "shm ring", "shm reserve", "shm varying"]
    assert {f"transport:{t}" for t in shmpipe.available_transports() if t != "shm"} <= set(paths)


def test_sizes_are_checked():
    assert parse_size("64KiB") == 65536 and parse_size("48MB") == 48_000_000 and parse_size("4096") == 4096
    with pytest.raises(SystemExit, match="4KiB to 256MB"):
        main(["bench", "throughput", "--sizes", "1KiB"])
    with pytest.raises(SystemExit, match="4KiB to 256MB"):
        main(["bench", "serialize", "--sizes", "1GB"])
    with pytest.raises(shmpipe.ShmpipeValueError, match="not a size"):
        parse_size("lots")


def test_serialize_every_option(tmp_path, capsys):
    from shmpipe.bench.serialize import PATHS

    rc = main(["bench", "serialize", "--sizes", "4KiB", "128KiB", "--paths", *PATHS, "--seconds", "0.01",
               "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")])
    assert rc == 0
    data = json.loads((tmp_path / "s.json").read_text())
    got = {(r["path"], r["nbytes"]): r for r in data["results"]}
    assert set(got) == {(p, n) for p in PATHS for n in (4096, 131072)}
    # which paths copy on decode, as measured: views for these, copies for those
    for p in ("pickle 5 oob", "arrow tensor", "arrow record batch", "ray put/get", "shmpipe"):
        assert got[p, 131072]["decode_copies"] == 0, p
    for p in ("pickle 4", "pickle 5", "numpy save"):
        assert got[p, 131072]["decode_copies"] == 1, p
    assert png(tmp_path / "s.png")
    assert "| 128 KiB | shmpipe |" in capsys.readouterr().out


def test_the_console_script(tmp_path):
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "shmpipe"), "bench", "seed", *TINY_SEED,
         "--recipes", "generator", "shmpipe:shm"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "| shmpipe:shm | 2 |" in out.stdout
