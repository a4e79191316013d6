"""docs/configuration.md, rendered from the settings classes (tandem/config.py) and the flags that feed them
(tandem_tools/cli.py), so that the page cannot drift from the code:

    python -m tandem_tools.configdoc > docs/configuration.md

tests/test_docs.py renders it again and fails when the committed page differs.
"""

from __future__ import annotations

import argparse
import sys

from pydantic_core import PydanticUndefined

from tandem import config
from tandem_tools.cli import build_parser

REGENERATE = "python -m tandem_tools.configdoc > docs/configuration.md"

# The service commands and the settings class each reads its flags and TANDEM_* variables into.
COMMANDS: list[tuple[str, type]] = [
    ("serve", config.ServeSettings),
    ("target", config.TargetSettings),
    ("draft", config.DraftSettings),
    ("coordinator", config.CoordinatorSettings),
]

HEADER = f"""# Configuration

<!-- Generated from tandem/config.py and tandem_tools/cli.py: do not edit by hand.
     Regenerate with: {REGENERATE} -->

Every setting of a service comes from a flag or from a `TANDEM_<COMMAND>_<SETTING>` environment variable; a
flag wins over the variable, and both are validated at start-up (the error names the flag, the variable and
the value). `tandem serve` starts the three services as child processes and passes its own settings on;
each service also runs alone (`tandem target`, `tandem draft`, `tandem coordinator`), as the compose files
and the Kubernetes manifests run them ([serving](serving.md)).

Flags marked *(no flag)* are read from the environment only: most are `tandem serve`'s own, set for each child
(on a CPU host it splits the CPUs, the target on the first half and the draft and the coordinator on the rest, and
hands each its CPUs and torch threads). Flags whose variable is "-" are options of the command itself, not
settings. What is neither is a named constant beside the reason for its value: `tandem/defaults.py` (the
acceptance gate's prior cost of a draft, target-only decode steps, the health-check interval, the start-up wait,
q's top-N, overlap of sampled generations off) and `tandem/transports/endpoints.py` (the feature ring, steps in
flight, the fast path's timeout). The tools (`generate`, `bench`, `load`, `profile`, `train-draft`, `demo`,
`make-tiny`) take flags only: `tandem COMMAND --help` lists them.

Variables outside the settings:

| variable | what |
|---|---|
| `TANDEM_COMPILE` | `1`: compile the native target's forward, each token bucket on its first use, and the draft's calls for a lone session before it reports ready; `background`: both serve eagerly while a thread compiles them; `0`: eager. Unset: the target is compiled on a GPU and eager on a CPU, the draft eager |
| `TANDEM_CACHE` | where the built-in demos are built and kept (default `~/.cache/tandem`) |
| `TANDEM_VLLM_PYTHON` | the Python of a venv with vLLM, for `tandem bench --peer vllm` (default `~/.cache/tandem/vllm-venv/bin/python`) |
"""


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(field, action: argparse.Action | None) -> str:
    if field is None:
        default = action.default if action is not None else None
        return "-" if default in (None, False, argparse.SUPPRESS) else f"`{default}`"
    if field.is_required():
        return "required"
    default = field.default
    if default is PydanticUndefined or default is None:
        return "unset"
    if isinstance(default, bool):
        return "`on`" if default else "`off`"
    if isinstance(default, (tuple, list, set, frozenset)) and not default:
        return "none"
    return f"`{default}`"


def command_table(parser: argparse.ArgumentParser, settings: type) -> list[str]:
    prefix = settings.model_config.get("env_prefix", "")
    fields = settings.model_fields
    rows, seen = [], set()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flag = max(action.option_strings, key=len)
        field = fields.get(action.dest)
        seen.add(action.dest)
        variable = f"`{prefix}{action.dest.upper()}`" if field is not None else "-"
        help_text = action.help or (field.description if field is not None else "") or ""
        if action.choices and list(action.choices) != ["on", "off"]:
            help_text = f"{help_text} (one of: {', '.join(map(str, action.choices))})".lstrip()
        rows.append(f"| `{flag}` | {variable} | {_default(field, action)} | {_cell(help_text)} |")
    for name, field in fields.items():
        if name in seen:
            continue
        if name == "announce_file":  # `serve` passes it to its children; nobody sets it by hand
            continue
        rows.append(f"| *(no flag)* | `{prefix}{name.upper()}` | {_default(field, None)} | "
                    f"{_cell(field.description or '')} |")
    head = ["| flag | variable | default | what |", "|---|---|---|---|"]
    return head + rows


def render() -> str:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    out = [HEADER]
    for name, settings in COMMANDS:
        sub = commands[name]
        out.append(f"## `tandem {name}`\n")
        out.append(f"{sub.description or _summary(parser, name)} Settings: `tandem.config.{settings.__name__}`.\n")
        out.extend(command_table(sub, settings))
        out.append("")
    return "\n".join(out)


def _summary(parser: argparse.ArgumentParser, name: str) -> str:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for choice in sub._choices_actions:
        if choice.dest == name:
            text = choice.help or ""
            return text[:1].upper() + text[1:] + "."
    return ""


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
