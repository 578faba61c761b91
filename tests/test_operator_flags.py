"""extraArgs are judged by the parsers that will read them: `vskipper serve`'s own parser (imported) and SGLang
0.5.21's (rebuilt from operator/vskipper_operator/sglang_flags.json, which is checked here against SGLang's real
parser: SGLang is installed in the test environment, not in the operator image)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from vskipper.serveargs import SERVE_FLAGS, SGLANG_OPERATOR_FLAGS
from vskipper_operator import flags
from vskipper_operator.crd import OWNED_ARG_RE, OWNED_ARGS, SpecError
from vskipper_operator.flags import (
    SERVE_OWNED,
    SGLANG_OWNED,
    check_extra_args,
    resolve,
    serve_parser,
    sglang_parser,
)


@pytest.fixture(scope="module")
def real_sglang_parser():
    pytest.importorskip("sglang")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return flags._quiet(parser)


def test_committed_table_is_sglangs_own_parser(real_sglang_parser):
    committed = json.loads(flags.TABLE.read_text())
    assert committed == flags.sglang_table(), "sglang_flags.json is stale: vskipper-operator sglang-flags > it"
    assert committed["sglang"] == flags.SGLANG_VERSION


PROBES = ["--tensor-parallel-size", "--tensor-p", "--tp", "--tp-size=2", "--model", "--mod", "--model-path",
          "--po", "--port", "--ho", "--served", "--config", "--max-running-requests", "--max-running",
          "--d", "--attention-backend", "--enable-metrics", "--chunked-prefill-size=4096", "--colour", "-h"]


@pytest.mark.parametrize("arg", PROBES)
def test_rebuilt_parser_resolves_each_argument_as_sglangs_does(real_sglang_parser, arg):
    def outcome(parser):
        try:
            return resolve(parser, [arg] if "=" in arg or arg in ("--enable-metrics", "-h") else [arg, "1"])
        except flags._Refused:
            return "refused"
    assert outcome(sglang_parser()) == outcome(real_sglang_parser)


def test_owned_flags_list_is_what_the_parsers_resolve_to_owned_destinations():
    """The CEL rule's list (crd.OWNED_ARGS, from vskipper.serveargs) holds every option string of the destinations
    the operator sets (vskipper serve's model/arm/thresholds/prefill floor/host/port, SGLang's model path, name, TP
    size, dtype and API key), as the parsers themselves spell them."""
    named = {f.destination for f in SERVE_FLAGS if f.operator_sets}
    assert named == {"model", "arm", "arm_file", "enter_tokens", "exit_tokens", "prefill_floor_tokens", "host",
                     "port"}
    in_rule = {f.dest for f in SGLANG_OPERATOR_FLAGS if f.in_admission_rule}
    assert in_rule == {"model_path", "host", "port", "served_model_name", "tp_size", "dtype", "api_key"}
    strings = {o for a in serve_parser()._actions if a.dest in named for o in a.option_strings}
    strings |= {o for a in sglang_parser()._actions if a.dest in in_rule for o in a.option_strings}
    assert strings == set(OWNED_ARGS)
    assert named <= SERVE_OWNED and in_rule <= SGLANG_OWNED


def test_declared_sglang_flags_are_spelled_as_sglang_spells_them():
    """Each operator-set SGLang flag's option strings, type and arity are those of SGLang 0.5.21's parser."""
    actions = {a.dest: a for a in sglang_parser()._actions}
    for flag in SGLANG_OPERATOR_FLAGS:
        action = actions[flag.dest]
        assert tuple(action.option_strings) == flag.strings, flag.dest
        assert (action.nargs == 0) == (flag.type is None), flag.dest
        if flag.type in (int, float):
            assert action.type is flag.type, flag.dest


def test_serve_parser_is_built_from_the_declarations():
    """`vskipper serve`'s parser has exactly the declared flags, with their option strings, defaults and types."""
    actions = {a.dest: a for a in serve_parser()._actions if a.dest != "help"}
    assert set(actions) == {f.destination for f in SERVE_FLAGS} == SERVE_OWNED - {"help"}
    for flag in SERVE_FLAGS:
        action = actions[flag.destination]
        assert tuple(action.option_strings) == flag.strings
        assert (action.nargs == 0) == (flag.type is None)
        if flag.type is not None:
            assert action.default == flag.default and (action.type or str) is flag.type


def test_cel_pattern_refuses_no_flag_sglang_or_serve_would_leave_to_the_user():
    """The admission pattern (abbreviations of owned flags) matches no option string the user may pass."""
    free = [o for a in sglang_parser()._actions if a.dest not in SGLANG_OWNED for o in a.option_strings]
    assert len(free) > 400
    assert [o for o in free if re.search(OWNED_ARG_RE, o)] == []


@pytest.mark.parametrize(("extra", "owner"), [
    (["--enter", "0", "--exit", "0"], "--enter-tokens"),
    (["--po", "9999"], "--port"),
    (["--tensor-parallel-size", "4"], "--tp-size"),
    (["--model-path", "/other"], "--model-path"),
    (["--api-key", "sk-in-the-spec"], "--api-key"),
    (["--arm-file", "/x.json"], "--arm-config"),
    (["--mod", "/other"], "--model"),
    (["--served-model", "other"], "--served-model-name"),
    (["--tp=2"], "--tp-size"),
    (["--config", "/etc/more.yaml"], "--config"),
    (["--dry-run"], "--dry-run"),
    (["--platform", "cpu"], "--platform"),
    (["--max-running-requests", "8", "--", "--tensor-parallel", "2"], "--tp-size"),
    (["--dtype", "float16"], "spec.model.dtype"),
    (["--mem-fraction-static", "0.5"], "spec.serving.memFractionStatic"),
    (["--enable-metrics"], "spec.metrics.enabled"),
    (["--", "--disable-radix-cache"], "spec.serving.prefixCache"),
])
def test_owned_destinations_are_refused_through_abbreviations_and_aliases(extra, owner):
    with pytest.raises(SpecError, match=re.escape(owner)) as err:
        check_extra_args(extra)
    assert str(err.value).startswith("spec.serving.extraArgs")


@pytest.mark.parametrize(("extra", "why"), [
    (["--colour", "blue"], "does not know --colour"),
    (["--attention-backend", "magic"], "invalid choice"),
    (["--max-running-requests", "lots"], "invalid int value"),
    (["--e", "1"], "ambiguous option"),
    (["-h"], "prints the help"),
])
def test_arguments_the_server_would_reject_are_refused(extra, why):
    with pytest.raises(SpecError, match=why):
        check_extra_args(extra)


@pytest.mark.parametrize("extra", [
    [], ["--max-running-requests", "8"], ["--chunked-prefill-size=4096", "--enable-torch-compile"],
    ["--", "--max-running-requests", "8"], ["--schedule-policy", "lpm", "--log-level", "warning"],
])
def test_sglang_arguments_the_operator_does_not_own_pass(extra):
    check_extra_args(extra)


def test_the_refused_abbreviations_really_override_the_planned_flags():
    """Without the check `vskipper serve`'s own parser reads `--enter 0 --exit 0` after the planned thresholds
    as the thresholds, and `--po` as the port: what the operator refuses is what would have happened."""
    from vskipper.cli import build_parser

    planned = ["--model", "/m", "--arm", "hybrid", "--exit-tokens", "390000", "--enter-tokens", "490000",
               "--port", "30000"]
    args, _ = build_parser().parse_known_args(["serve", *planned, "--enter", "0", "--exit", "0", "--po", "9999"])
    assert (args.enter_tokens, args.exit_tokens, args.port) == (0, 0, 9999)
