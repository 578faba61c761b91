"""`vskipper serve`'s launch flags, declared once (vskipper.serveargs), and what is built from them: the serve
parser, the operator's container args, the image entrypoint's variables, the launcher's command lines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from operator_fixtures import mixed_pool, resource

from vskipper.serveargs import (
    CONTAINER_ENV,
    SERVE_FLAGS,
    SGLANG_OPERATOR_FLAGS,
    operator_owned_strings,
    serve_argv,
)
from vskipper.sglang import spec as served
from vskipper.sglang.launch import serve_command
from vskipper_operator.flags import resolve, serve_parser, sglang_parser
from vskipper_operator.plan import Node, plan

ROOT = Path(__file__).resolve().parents[1]


def _entrypoint():
    loaded = importlib.util.spec_from_file_location("entrypoint", ROOT / "images" / "runtime" / "entrypoint.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def test_serve_argv_writes_flags_in_declaration_order():
    argv = serve_argv({"port": 8000, "model": "/m", "dry_run": True, "gpu_jit": False, "arm": None,
                       "enable_metrics": True, "dtype": "bfloat16"})
    assert argv == ["--model", "/m", "--port", "8000", "--dry-run", "--dtype", "bfloat16", "--enable-metrics"]


@pytest.mark.parametrize(("values", "message"), [
    ({"colour": "blue"}, "no serve or operator-set SGLang flag has the destination"),
    ({"model_path": "/m"}, "come from `vskipper serve`'s own flags"),
    ({"config": "/c.yaml"}, "come from `vskipper serve`'s own flags"),
])
def test_serve_argv_refuses_what_it_does_not_declare(values, message):
    with pytest.raises(ValueError, match=message):
        serve_argv(values)


def test_container_and_transport_variables_are_two_vocabularies():
    """The image's variables name what a person writes (an arm's name); the scheduler's name what `vskipper serve`
    resolved (the arm as JSON): no name means both."""
    transport = {served.ENV_ARM, served.ENV_ENTER, served.ENV_EXIT, served.ENV_STATE, served.ENV_PROFILE,
                 served.ENV_THRESHOLDS_SOURCE}
    assert CONTAINER_ENV == {"--model": "VSKIPPER_MODEL", "--arm": "VSKIPPER_ARM",
                             "--exit-tokens": "VSKIPPER_EXIT_TOKENS", "--enter-tokens": "VSKIPPER_ENTER_TOKENS"}
    assert not transport & set(CONTAINER_ENV.values())
    assert _entrypoint().ENV == CONTAINER_ENV


def test_planned_container_args_are_declared_flags_that_both_parsers_take():
    """Everything the operator plans before extraArgs is a declared flag: `vskipper serve` takes its own and leaves
    exactly the declared SGLang flags to SGLang's parser, which takes them all."""
    spec = resource(serving={"image": "vskipper:test", "memFractionStatic": 0.8, "attentionBackend": "fa3",
                             "prefixCache": False, "apiKeySecret": {"name": "key", "key": "token"}},
                    metrics={"enabled": True}, switch={"prefillFloorTokens": 2048})
    result = plan(spec, [Node.from_object(n) for n in mixed_pool()])
    servers = [o for o in result.objects if o["kind"] == "Deployment"]
    assert servers
    for deployment in servers:
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        dests, rest = resolve(serve_parser(), args)
        dests -= {"func"}  # the subcommand's default
        assert dests == {f.destination for f in SERVE_FLAGS if f.operator_sets}
        sglang_dests, left = resolve(sglang_parser(), rest)
        assert left == []
        declared = {f.dest for f in SGLANG_OPERATOR_FLAGS if f.spec_field}
        # no spec.serving.cudaGraphMaxBatchSize; the API key comes in the environment (serveargs.API_KEY_ENV)
        assert sglang_dests == declared - {"cuda_graph_max_bs_decode", "api_key"}
        assert set(a for a in args if a.startswith("--")) <= set(operator_owned_strings()) | {
            f.name for f in SGLANG_OPERATOR_FLAGS}


def test_launcher_command_parses_as_serve_would(tmp_path):
    cmd = serve_command(tmp_path / "m", 31000, tmp_path / "state.json", arm="hybrid", enter_tokens=20,
                        exit_tokens=10, platform="cpu", extra=("--max-running-requests", "4"))
    cut = cmd.index("--")
    dests, rest = resolve(serve_parser(), cmd[4:cut])
    dests -= {"func"}
    assert rest == [] and dests == {"model", "arm", "port", "state_file", "enter_tokens", "exit_tokens", "platform"}
    assert cmd[cut + 1:] == ["--dtype", "float32", "--max-running-requests", "4"]


def test_the_api_key_reaches_sglangs_parser_from_the_environment_and_is_masked_in_the_log():
    """`vskipper.sglang.server` adds the key of VSKIPPER_API_KEY to the arguments its own process parses (a flag
    given wins, and no variable adds nothing), and masks it in every log record of the process."""
    import logging

    from vskipper.serveargs import API_KEY_ENV
    from vskipper.sglang.server import mask_in_logs, with_api_key

    assert with_api_key(["--port", "1"], {API_KEY_ENV: "sk-1"}) == (["--port", "1", "--api-key", "sk-1"], "sk-1")
    assert with_api_key(["--api-key=mine"], {API_KEY_ENV: "sk-1"}) == (["--api-key=mine"], None)
    assert with_api_key(["--port", "1"], {API_KEY_ENV: ""}) == (["--port", "1"], None)
    factory = logging.getLogRecordFactory()
    try:
        mask_in_logs("sk-1")
        record = logging.getLogger("sglang.test").makeRecord("sglang.test", logging.INFO, __file__, 1,
                                                              "server_args=%s", ({"api_key": "sk-1"},), None)
        assert record.getMessage() == "server_args={'api_key': '***'}"
        plain = logging.getLogger("x").makeRecord("x", logging.INFO, __file__, 1, "port %d", (1,), None)
        assert plain.getMessage() == "port 1"
        # a record whose arguments do not fit its format is made as logging makes it, to fail where it reports
        logging.getLogger("x").makeRecord("x", logging.INFO, __file__, 1, "port %d", ("one",), None)
    finally:
        logging.setLogRecordFactory(factory)
