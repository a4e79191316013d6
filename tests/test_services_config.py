"""Service configuration (flags over TANDEM_* variables, validated at start-up) and admission."""

from __future__ import annotations

import grpc
import pytest

from tandem.config import ConfigError, CoordinatorSettings, ServeSettings, TargetSettings, load_settings
from tandem.service import Abort, Admission
from tandem_tools import cli


def test_environment_variables_configure_a_service(tiny_dir, monkeypatch):
    monkeypatch.setenv("TANDEM_TARGET_MODEL", str(tiny_dir / "target"))
    monkeypatch.setenv("TANDEM_TARGET_PORT", "6000")
    settings = load_settings(TargetSettings)
    assert (settings.model, settings.port, settings.host) == (tiny_dir / "target", 6000, "127.0.0.1")


def test_flags_override_environment_variables(tiny_dir, monkeypatch):
    monkeypatch.setenv("TANDEM_TARGET_PORT", "not a port")
    settings = load_settings(TargetSettings, model=str(tiny_dir / "target"), port=7000, device=None)
    assert settings.port == 7000 and settings.device == "cpu"


@pytest.mark.parametrize(
    ("cls", "flags", "named"),
    [
        (TargetSettings, {"model": "/nonexistent"}, ["--model", "TANDEM_TARGET_MODEL", "/nonexistent"]),
        (TargetSettings, {"device": "gpu0"}, ["--device", "TANDEM_TARGET_DEVICE", "'gpu0'"]),
        (TargetSettings, {"dtype": "fp8"}, ["--dtype", "'fp8'"]),
        (TargetSettings, {"port": 70000}, ["--port", "70000"]),
        (CoordinatorSettings, {"target_addr": "nohost"}, ["--target-addr", "TANDEM_COORDINATOR_TARGET_ADDR", "'nohost'"]),
        (ServeSettings, {"draft_device": "tpu"}, ["--draft-device", "TANDEM_SERVE_DRAFT_DEVICE", "'tpu'"]),
        (TargetSettings, {"cpus": "0-4095"}, ["--cpus", "TANDEM_TARGET_CPUS", "4095", "not available"]),
        (CoordinatorSettings, {"target_addr": "h:1", "cpus": "1-0"}, ["--cpus", "'1-0'"]),
    ],
)
def test_bad_settings_are_refused_naming_the_value(tiny_dir, cls, flags, named):
    if cls is TargetSettings:
        flags = {"model": str(tiny_dir / "target"), **flags}
    with pytest.raises(ConfigError) as info:
        load_settings(cls, **flags)
    for word in named:
        assert word in str(info.value)


def test_a_bad_environment_variable_stops_the_command(tiny_dir, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_TARGET_DTYPE", "float64")
    assert cli.main(["target", "--model", str(tiny_dir / "target")]) == 2
    err = capsys.readouterr().err
    assert "TANDEM_TARGET_DTYPE" in err and "float64" in err


def test_a_missing_required_setting_is_named(monkeypatch, capsys):
    monkeypatch.delenv("TANDEM_COORDINATOR_TARGET_ADDR", raising=False)
    assert cli.main(["coordinator"]) == 2
    assert "--target-addr / TANDEM_COORDINATOR_TARGET_ADDR: required" in capsys.readouterr().err


def test_admission_refuses_while_loading_at_the_limit_and_while_draining():
    admission = Admission(limit=1, what="test service")
    with pytest.raises(Abort) as info, admission.admit():
        pass
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "loading" in info.value.message
    admission.ready = True
    with admission.admit():
        with pytest.raises(Abort) as info, admission.admit():
            pass
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert admission.wait_idle(0.1)
    admission.draining = True
    with pytest.raises(Abort) as info, admission.admit():
        pass
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.message
