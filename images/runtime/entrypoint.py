#!/usr/bin/env python3
"""Runtime image entrypoint: resolve the switching thresholds, then exec `vskipper serve`.

The operator launches servers as `vskipper serve --model ... --exit-tokens N --enter-tokens N ...`
(operator/README.md). Outside the operator (docker run, a plain Deployment) the same values may come from the
environment; a flag always wins over its variable:

    --model          VSKIPPER_MODEL
    --arm            VSKIPPER_ARM
    --exit-tokens    VSKIPPER_EXIT_TOKENS
    --enter-tokens   VSKIPPER_ENTER_TOKENS

Thresholds must be positive integers with enter > exit (the switch's hysteresis); a bad value stops the
container with a message naming the flag and its variable. `--print-command` prints the resolved command as
JSON instead of running it. Standard library only: it runs before anything else is imported.
"""

from __future__ import annotations

import json
import os
import sys

ENV = {"--model": "VSKIPPER_MODEL", "--arm": "VSKIPPER_ARM", "--exit-tokens": "VSKIPPER_EXIT_TOKENS",
       "--enter-tokens": "VSKIPPER_ENTER_TOKENS"}
THRESHOLDS = ("--exit-tokens", "--enter-tokens")


class EntrypointError(ValueError):
    pass


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag:
            if i + 1 >= len(args):
                raise EntrypointError(f"{flag} needs a value")
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def resolve(argv: list[str], env: dict[str, str]) -> list[str]:
    """The `vskipper serve ...` argv for this container: flags as given plus values taken from the environment."""
    args = list(argv)
    if args and args[0] == "serve":
        args = args[1:]
    for flag, var in ENV.items():
        if _flag_value(args, flag) is None and env.get(var, "") != "":
            args += [flag, env[var]]
    if _flag_value(args, "--model") is None:
        raise EntrypointError("--model (VSKIPPER_MODEL) is required: the checkpoint path")
    values = {}
    for flag in THRESHOLDS:
        raw = _flag_value(args, flag)
        if raw is None:
            raise EntrypointError(f"{flag} ({ENV[flag]}) is required: resident KV tokens, set by the operator")
        try:
            values[flag] = int(raw)
        except ValueError:
            raise EntrypointError(f"{flag} ({ENV[flag]}): {raw!r} is not an integer") from None
        if values[flag] <= 0:
            raise EntrypointError(f"{flag} ({ENV[flag]}): {values[flag]} must be positive")
    if values["--enter-tokens"] <= values["--exit-tokens"]:
        raise EntrypointError(f"--enter-tokens ({values['--enter-tokens']}) must exceed --exit-tokens "
                              f"({values['--exit-tokens']}): the switch needs a hysteresis band")
    return ["vskipper", "serve", *args]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print_only = "--print-command" in argv
    argv = [a for a in argv if a != "--print-command"]
    try:
        command = resolve(argv, dict(os.environ))
    except EntrypointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if print_only:
        print(json.dumps(command))
        return 0
    product = os.environ.get("VSKIPPER_GPU_PRODUCT", "unknown GPU")
    print(f"vskipper runtime on {product}: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
