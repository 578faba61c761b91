#!/usr/bin/env python3
"""Runtime image entrypoint, the one way a vSkipper server starts in a container: resolve the launch flags, then
exec `vskipper serve FLAGS`.

The operator plans its server containers with no `command`, so Kubernetes runs this entrypoint with the planned
`args` (the `vskipper serve` flags, each GPU class with its own `--exit-tokens/--enter-tokens`; operator/README.md).
Outside the operator (docker run, a plain Deployment) the same values may come from the environment; a flag
always wins over its variable. Which flags have a variable is declared with the flags themselves
(`vskipper.serveargs.CONTAINER_ENV`: --model VSKIPPER_MODEL, --arm VSKIPPER_ARM, --exit-tokens
VSKIPPER_EXIT_TOKENS, --enter-tokens VSKIPPER_ENTER_TOKENS). These variables name what a person writes; what
`vskipper serve` hands its scheduler travels under other names (`VSKIPPER_SERVED_*`).

Thresholds follow the mode switch's own rule (vskipper.switch.ModeSwitch): non-negative integers, given together,
enter >= exit. A bad value stops the container before SGLang loads a model, with a message naming the flag and
its variable. Whether an arm needs thresholds at all is `vskipper serve`'s call (only a switched decode does).
Every other flag (`--dry-run`, SGLang's own) passes through unchanged. `--print-command` prints the resolved
command as JSON instead of running it. It imports only the standard library and `vskipper.serveargs` (pure).
"""

from __future__ import annotations

import json
import os
import re
import sys

from vskipper.serveargs import CONTAINER_ENV as ENV

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


def _thresholds(args: list[str]) -> None:
    values = {}
    for flag in THRESHOLDS:
        raw = _flag_value(args, flag)
        if raw is None:
            continue
        try:
            values[flag] = int(raw)
        except ValueError:
            raise EntrypointError(f"{flag} ({ENV[flag]}): {raw!r} is not an integer") from None
        if values[flag] < 0:
            raise EntrypointError(f"{flag} ({ENV[flag]}): {values[flag]} must be non-negative")
    if len(values) == 1:
        missing = next(f for f in THRESHOLDS if f not in values)
        raise EntrypointError(f"{missing} ({ENV[missing]}) is missing: the exit and enter thresholds go together")
    if values and values["--enter-tokens"] < values["--exit-tokens"]:
        raise EntrypointError(f"--enter-tokens ({values['--enter-tokens']}) must be at least --exit-tokens "
                              f"({values['--exit-tokens']}): the switch's hysteresis band")


def resolve(argv: list[str], env: dict[str, str]) -> list[str]:
    """The `vskipper serve ...` argv for this container: the flags as given plus values taken from the environment."""
    args = list(argv)
    for flag, var in ENV.items():
        if _flag_value(args, flag) is None and env.get(var, "") != "":
            args += [flag, env[var]]
    if _flag_value(args, "--model") is None:
        raise EntrypointError("--model (VSKIPPER_MODEL) is required: the checkpoint path")
    _thresholds(args)
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
    shown = [re.sub(r"^(--api-key=).*", r"\1***", a) if not (i and command[i - 1] == "--api-key") else "***"
             for i, a in enumerate(command)]  # a key given as a flag stays out of the container's log
    print(f"vskipper runtime on {product}: {' '.join(shown)}", file=sys.stderr, flush=True)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
