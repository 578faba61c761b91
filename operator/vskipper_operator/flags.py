"""`spec.serving.extraArgs`, decided by the parsers that will read them.

A server container runs `vskipper serve ARGS`: the operator's own flags, then extraArgs (images/runtime/entrypoint.py).
`vskipper serve` parses ARGS with its argparse parser (`vskipper.cli.build_parser`, abbreviations allowed: `--enter`
is `--enter-tokens`, `--arm-file` is `--arm-config`) and hands what it does not define, and everything after a bare
`--`, to SGLang 0.5.21's parser (`sglang.srt.server_args.prepare_server_args`, argparse with abbreviations:
`--tensor-parallel-size` is `--tp-size`, `--model` is `--model-path`) after its own `--model-path/--host/--port`;
the last value wins. So an exact-string guard is not enough: `check_extra_args` resolves each argument with those
parsers and refuses any that lands on a destination the operator sets (`SERVE_OWNED`, `SGLANG_OWNED`), any that
either parser would reject (ambiguous abbreviations, unknown flags, bad choices or numbers), naming the argument.

`vskipper serve`'s parser is imported (it imports no torch). SGLang is not installed where the operator runs, so its
parser is rebuilt from `sglang_flags.json`: every option's strings, destination, arity, numeric type and choices,
extracted from SGLang 0.5.21's own parser by `vskipper-operator sglang-flags` (tests/test_operator_flags.py checks
the table against the real parser, and the resolutions against it, where SGLang is installed).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vskipper.serveargs import SERVE_DESTS, SGLANG_BY_DEST, SGLANG_OWNED_DESTS
from vskipper_operator.crd import SpecError

TABLE = Path(__file__).with_name("sglang_flags.json")
SGLANG_VERSION = "0.5.21"
# Every flag `vskipper serve` defines is the operator's: extraArgs are for SGLang. SGLang destinations the operator
# (or `vskipper serve` for it) sets, or that could set them behind its back (a config file): `vskipper.serveargs`.
SERVE_OWNED = SERVE_DESTS
SGLANG_OWNED = SGLANG_OWNED_DESTS
_UNSET = object()


class _Refused(Exception):
    pass


def _raise(message: str):
    raise _Refused(message)


def _quiet(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Errors (and --help, which would print and exit) raise instead; nothing is required (arguments are checked
    a few at a time)."""
    parser.error = _raise  # type: ignore[method-assign]
    parser.print_help = lambda file=None: None  # type: ignore[method-assign]
    parser.exit = lambda status=0, message=None: _raise("it prints the help and exits")  # type: ignore[method-assign]
    for action in parser._actions:
        action.required = False
    return parser


@functools.cache
def serve_parser() -> argparse.ArgumentParser:
    """The `vskipper serve` subcommand's own parser."""
    from vskipper.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return _quiet(sub.choices["serve"])


def sglang_table() -> dict:
    """The table, from SGLang's real parser (needs SGLang installed; `vskipper-operator sglang-flags`)."""
    import sglang
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    options = []
    for action in parser._actions:
        choices = (sorted(action.choices, key=str) if action.choices is not None and not isinstance(action.choices, dict)
                   else None)  # a set: registration order varies
        options.append({"flags": list(action.option_strings), "dest": action.dest, "nargs": action.nargs,
                        "type": {int: "int", float: "float"}.get(action.type),
                        "choices": choices if choices and all(isinstance(c, (str, int)) for c in choices) else None})
    return {"sglang": sglang.__version__, "allow_abbrev": parser.allow_abbrev, "options": options}


@functools.cache
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang 0.5.21's server parser, rebuilt from the table."""
    table = json.loads(TABLE.read_text())
    parser = argparse.ArgumentParser(prog="sglang serve", add_help=False, allow_abbrev=table["allow_abbrev"])
    for option in table["options"]:
        kwargs: dict[str, Any] = {"dest": option["dest"]}
        if option["dest"] == "help":
            kwargs = {"action": "help"}
        elif option["nargs"] == 0:
            kwargs.update(action="store_const", const=True)
        else:
            if option["nargs"] is not None:
                kwargs["nargs"] = option["nargs"]
            if option["type"]:
                kwargs["type"] = {"int": int, "float": float}[option["type"]]
            if option["choices"] is not None:
                kwargs["choices"] = option["choices"]
        parser.add_argument(*option["flags"], **kwargs)
    return _quiet(parser)


def resolve(parser: argparse.ArgumentParser, args: Sequence[str]) -> tuple[set[str], list[str]]:
    """(destinations `args` set, the arguments the parser leaves over), as `parse_known_args` sees them."""
    namespace = argparse.Namespace(**{a.dest: _UNSET for a in parser._actions})
    namespace, rest = parser.parse_known_args(list(args), namespace)
    return {k for k, v in vars(namespace).items() if v is not _UNSET}, rest


def _flags(parser: argparse.ArgumentParser, dest: str) -> str:
    return "/".join(next(a.option_strings for a in parser._actions if a.dest == dest))


def check_extra_args(extra: Sequence[str], where: str = "spec.serving.extraArgs") -> None:
    """Refuse extraArgs that set what the operator owns or that the server's parsers would reject (see module)."""
    extra = list(extra)
    cut = extra.index("--") if "--" in extra else len(extra)
    to_sglang: list[str] = []
    for i, arg in enumerate(extra[:cut]):
        if not arg.startswith("-") or arg == "-":
            continue
        value = extra[i + 1:i + 2] if "=" not in arg and i + 1 < cut and not extra[i + 1].startswith("-") else []
        try:
            dests, _ = resolve(serve_parser(), [arg, *value])
        except _Refused as exc:
            raise SpecError(f"{where}[{i}]: `vskipper serve` refuses {arg!r}: {exc}") from None
        for dest in dests & SERVE_OWNED:
            raise SpecError(f"{where}[{i}]: {arg!r} is `vskipper serve`'s {_flags(serve_parser(), dest)}, which "
                            "the operator sets")
    try:
        _, to_sglang = resolve(serve_parser(), extra[:cut])
    except _Refused as exc:
        raise SpecError(f"{where}: `vskipper serve` refuses them: {exc}") from None
    to_sglang += extra[cut + 1:]
    for i, arg in enumerate(to_sglang):
        if not arg.startswith("-"):
            continue
        value = to_sglang[i + 1:i + 2] if "=" not in arg and i + 1 < len(to_sglang) and not to_sglang[i + 1].startswith("-") else []
        try:
            dests, _ = resolve(sglang_parser(), [arg, *value])
        except _Refused as exc:
            raise SpecError(f"{where}: SGLang {SGLANG_VERSION} refuses {arg!r}: {exc}") from None
        for dest in dests & SGLANG_OWNED:
            set_by = SGLANG_BY_DEST[dest].set_by if dest in SGLANG_BY_DEST else "the operator"
            raise SpecError(f"{where}: {arg!r} is SGLang's {_flags(sglang_parser(), dest)}, which the operator sets "
                            f"(from {set_by})")
    try:
        _, rest = resolve(sglang_parser(), to_sglang)
    except _Refused as exc:
        raise SpecError(f"{where}: SGLang {SGLANG_VERSION} refuses them: {exc}") from None
    if rest:
        raise SpecError(f"{where}: SGLang {SGLANG_VERSION} does not know {' '.join(rest)}")
