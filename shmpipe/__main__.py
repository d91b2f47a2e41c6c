"""The shmpipe command line: ``shmpipe clean`` (and ``python -m shmpipe``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    clean = sub.add_parser(
        "clean",
        help="remove shared-memory segments left by shmpipe processes that died",
        description="Removes this user's shmpipe segments in /dev/shm whose owning process "
        "has died. A segment whose owner is alive is never touched.",
    )
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")

    args = parser.parse_args(argv)
    if args.command == "clean":
        from shmpipe import clean as do_clean

        removed = do_clean(dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        for name in removed:
            print(f"{verb} {name}")
        print(f"{verb} {len(removed)} segment(s)")
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
