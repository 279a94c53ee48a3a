"""Command-line conventions every kvswitch CLI (switchd, hostagent, testbed) shares: sizes such as
64KiB or 1GiB, finite numbers (click's own float types take nan and inf), a TOML config file
under the command line's options, and errors a user can fix printed as one line with a non-zero
exit."""
from __future__ import annotations

import math
import re
import sys
import tomllib
from pathlib import Path

import click

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?|B)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str | int) -> int:
    """'4096', '64KiB', '256MiB', '1G' -> bytes (binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise click.BadParameter(f"{text!r} is not a size like 4096, 64KiB or 1GiB")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()[:1]]


class SizeType(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)


class ChunkSizeType(click.ParamType):
    """A chunk size (kvproto.check_chunk_size): the one click type every CLI's --chunk-size uses."""
    name = "bytes"

    def convert(self, value, param, ctx):
        from .wire import check_chunk_size
        try:
            return check_chunk_size(int(value))
        except ValueError as exc:
            self.fail(str(exc) if str(value).strip().lstrip("-").isdigit() else
                      f"{value!r} is not a number of bytes", param, ctx)


CHUNK_SIZE = ChunkSizeType()


def chunk_option(default: int | None = None, **kw):
    """``--chunk-size``, the same in every command (``default`` None: the protocol's)."""
    from .wire import DEFAULT_CHUNK
    kw.setdefault("help", "Bytes per chunk (one datagram each; the switch's --chunk-size for "
                          "hits).")
    return click.option("--chunk-size", type=CHUNK_SIZE, show_default=True,
                        default=DEFAULT_CHUNK if default is None else default, **kw)


class _Finite:
    """Refuses nan and inf after the float type's own checks: nan passes every comparison a
    bound makes (``soak --minutes nan`` never ended) and inf is no length, rate or share."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


class FiniteFloat(_Finite, click.types.FloatParamType):
    """click's FLOAT, finite."""


class FloatRange(_Finite, click.FloatRange):
    """click.FloatRange, finite."""


FINITE = FiniteFloat()


def one_line_errors(prog: str, *errors: type[Exception]) -> type[click.Group]:
    """A click Group class that prints ``errors`` and MemoryError (exit 1) and click's own usage
    errors (exit 2) as one line, ``<prog>: error: <message>``."""

    class Group(click.Group):
        def invoke(self, ctx):
            try:
                return super().invoke(ctx)
            except errors as exc:
                click.echo(f"{prog}: error: {exc}", err=True)
                sys.exit(1)

        def main(self, *args, **kwargs):
            kwargs["standalone_mode"] = False
            try:
                super().main(*args, **kwargs)
            except click.exceptions.Exit as exc:
                sys.exit(exc.exit_code)
            except click.ClickException as exc:
                click.echo(f"{prog}: error: {exc.format_message()}", err=True)
                sys.exit(exc.exit_code)
            except click.exceptions.Abort:
                click.echo(f"{prog}: aborted", err=True)
                sys.exit(1)
            except MemoryError as exc:      # sizes this machine cannot hold: one line too
                why = f" ({exc})" if str(exc) else ""
                click.echo(f"{prog}: error: not enough memory for this run{why}", err=True)
                sys.exit(1)
            sys.exit(0)

    return Group


def load_config(path: str) -> dict:
    """A TOML config file; ClickException (one line) if it cannot be read."""
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.ClickException(f"cannot read config {path}: {exc}") from None


def with_config(ctx: click.Context, path: str | None, renamed: dict[str, str] | None = None,
                tables: tuple[str, ...] = ()) -> dict:
    """The command's values: the command line's, else the config file's (converted and checked
    by the options' own types), else the defaults. ``renamed``: config key -> parameter name;
    ``tables``: keys whose TOML table becomes the option's NAME=VALUE items (lists joined with
    commas). ``values["_from_config"]``: the parameters the file set."""
    values = dict(ctx.params)
    if not path:
        return values
    params = {p.name: p for p in ctx.command.params if p.name != "config"}
    for key, raw in load_config(path).items():
        name = (renamed or {}).get(key, key)
        if name not in params:
            raise click.ClickException(f"config {path}: unknown key {key!r}")
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            continue
        if key in tables:
            if not isinstance(raw, dict):
                raise click.ClickException(f"config {path}: {key} must be a table")
            raw = [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                   for k, v in raw.items()]
        elif params[name].multiple and not isinstance(raw, list):
            raise click.ClickException(f"config {path}: {key} must be a list")
        try:
            values[name] = params[name].type_cast_value(ctx, raw)
        except click.BadParameter as exc:
            raise click.ClickException(f"config {path}: {key}: {exc.message}") from None
        values.setdefault("_from_config", set()).add(name)
    return values
