"""Service configuration (flags over TANDEM_* variables, validated at start-up) and admission."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from tandem.config import (
    NO_FLAG,
    ConfigError,
    CoordinatorSettings,
    DraftSettings,
    ServeSettings,
    TargetSettings,
    load_settings,
)
from tandem.service import Abort, Admission
from tandem_tools import cli


def test_environment_variables_configure_a_service(tiny_dir, monkeypatch):
    monkeypatch.setenv("TANDEM_TARGET_MODEL", str(tiny_dir / "target"))
    monkeypatch.setenv("TANDEM_TARGET_PORT", "6000")
    settings = load_settings(TargetSettings)
    assert (settings.model, settings.port, settings.host) == (tiny_dir / "target", 6000, "127.0.0.1")


def test_a_variable_that_names_no_setting_is_warned_about(tiny_dir, monkeypatch, caplog):
    """TANDEM_COORDINATOR_SPEC_DRAFT_COST was a setting once: set today, the coordinator says it ignores it."""
    monkeypatch.setenv("TANDEM_COORDINATOR_SPEC_DRAFT_COST", "0")
    monkeypatch.setenv("TANDEM_COORDINATOR_SPEC_TOKEN_BUDGET", "0")
    with caplog.at_level("WARNING", logger="tandem"):
        settings = load_settings(CoordinatorSettings, target_addr="127.0.0.1:1")
    assert settings.spec_token_budget == 0
    assert [r.getMessage() for r in caplog.records] == [
        "TANDEM_COORDINATOR_SPEC_DRAFT_COST is not a setting of this service: ignored"]


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
        # no flag (tandem serve sets it for its children): the message names the variable alone
        (TargetSettings, {"cpus": "0-4095"}, ["TANDEM_TARGET_CPUS: ", "4095", "not available"]),
        (CoordinatorSettings, {"target_addr": "h:1", "cpus": "1-0"}, ["TANDEM_COORDINATOR_CPUS: ", "'1-0'"]),
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


SERVICE_COMMANDS = {"serve": ServeSettings, "target": TargetSettings, "draft": DraftSettings,
                    "coordinator": CoordinatorSettings}
MAX_SERVICE_FLAGS = 35  # what a user can hold in their head; the rest are constants (tandem/defaults.py)


def service_parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in SERVICE_COMMANDS}


def test_the_services_take_at_most_35_distinct_flags_each_in_help_and_the_docs():
    flags: set[str] = set()
    docs = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    for name, parser in service_parsers().items():
        shown = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = max(action.option_strings, key=len)
            assert action.help not in (None, argparse.SUPPRESS), f"tandem {name} {flag}: no help"
            assert flag in shown and f"| `{flag}` |" in docs, f"tandem {name} {flag}: not in --help or the docs"
            flags.add(flag)
    assert len(flags) <= MAX_SERVICE_FLAGS, f"{len(flags)} distinct service flags: {sorted(flags)}"


def test_every_setting_has_a_flag_or_is_named_as_having_none():
    """config.NO_FLAG is what the error messages and the docs treat as read from the environment only."""
    for name, parser in service_parsers().items():
        settings = SERVICE_COMMANDS[name]
        dests = {action.dest for action in parser._actions}
        assert set(settings.model_fields) - dests == set(settings.model_fields) & NO_FLAG, name


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
