"""The operator's settings: one object, a flag winning over its environment variable, bad values named."""

from __future__ import annotations

import pytest

from vskipper_operator import cli, handlers
from vskipper_operator.settings import (
    ENV_API_BACKOFFS,
    ENV_METRICS_PORT,
    ENV_RESYNC_SECONDS,
    Settings,
    SettingsError,
)


def test_defaults_then_environment_then_flags():
    assert Settings.from_env({}) == Settings(60.0, (0.1, 0.3, 1.0, 3.0), 9090)
    env = {ENV_RESYNC_SECONDS: "5", ENV_API_BACKOFFS: "0.2, 1", ENV_METRICS_PORT: "9400"}
    assert Settings.from_env(env) == Settings(5.0, (0.2, 1.0), 9400)
    assert Settings.from_env(env, metrics_port=9500).metrics_port == 9500  # the flag wins
    assert Settings.from_env(env, metrics_port=0).metrics_port == 0  # 0 (off) is a value, not "not given"
    assert Settings.from_env(env, metrics_port=None).metrics_port == 9400  # a flag not given


@pytest.mark.parametrize(("env", "message"), [
    ({ENV_RESYNC_SECONDS: "soon"}, f"{ENV_RESYNC_SECONDS}: 'soon' is not a number"),
    ({ENV_RESYNC_SECONDS: "0"}, f"{ENV_RESYNC_SECONDS}: '0' must be a positive"),
    ({ENV_API_BACKOFFS: "0.1,,1"}, f"{ENV_API_BACKOFFS}: '' is not a number"),
    ({ENV_METRICS_PORT: "http"}, f"{ENV_METRICS_PORT}: 'http' is not a port number"),
    ({ENV_METRICS_PORT: "70000"}, f"{ENV_METRICS_PORT}: 70000 is not a port number"),
])
def test_bad_values_are_refused_naming_the_variable(env, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_metrics_port_flag_beats_the_environment_when_the_operator_runs(monkeypatch):
    """`vskipper-operator run --metrics-port` wins over $VSKIPPER_OPERATOR_METRICS_PORT (the variable only fills in
    when the flag is absent); kopf itself is not started here."""
    started = []
    monkeypatch.setattr(handlers.kopf, "run", lambda **kwargs: started.append(kwargs))
    monkeypatch.setattr(handlers, "_flags", {})
    monkeypatch.setenv(ENV_METRICS_PORT, "9090")
    assert cli.main(["run", "--metrics-port", "9400", "--namespace", "serving"]) == 0
    assert started and started[0]["namespaces"] == ["serving"]
    assert Settings.from_env(**handlers._flags).metrics_port == 9400
    monkeypatch.setattr(handlers, "_flags", {})
    assert cli.main(["run"]) == 0
    assert Settings.from_env(**handlers._flags).metrics_port == 9090


def test_a_bad_variable_stops_the_operator_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(handlers.kopf, "run", lambda **kwargs: pytest.fail("kopf started"))
    monkeypatch.setattr(handlers, "_flags", {})
    monkeypatch.setenv(ENV_API_BACKOFFS, "fast")
    assert cli.main(["run"]) == 2
    assert f"{ENV_API_BACKOFFS}: 'fast' is not a number" in capsys.readouterr().err
