"""Command-line parameter parsing shared by the testbed's commands."""
from __future__ import annotations

import click


def int_list(ctx, param, value: str) -> list[int]:
    """click callback: '1,2,4' -> [1, 2, 4] (sorted, distinct, positive)."""
    try:
        items = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers") from None
    if not items or items[0] < 1:
        raise click.BadParameter("give at least one positive number")
    return items
