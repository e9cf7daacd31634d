"""Command-line plumbing shared by the scripts: the usage error, the entry point, list arguments."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UsageError(ValueError):
    """A bad command-line argument (reported as a clean error, not a traceback)."""


def run_cli(main: Callable[[], int | None]) -> None:
    """Entry point of the scripts: bad arguments exit with status 2 and a one-line error."""
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _parse_list(s: str, name: str, cast, kind: str) -> list:
    try:
        vals = [cast(x) for x in s.split(",") if x.strip() != ""]
    except ValueError as e:
        raise UsageError(f"{name} must be a comma-separated list of {kind}, got {s!r}") from e
    if not vals:
        raise UsageError(f"{name} is empty")
    return vals


def parse_float_list(s: str, name: str) -> list[float]:
    return _parse_list(s, name, float, "numbers")


def parse_int_list(s: str, name: str) -> list[int]:
    return _parse_list(s, name, int, "integers")
