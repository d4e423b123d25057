"""The command-line reference (docs/cli.md), generated from the typer commands' own help and options.

`python -m quantdiff.cli.reference > docs/cli.md` writes it; tests/test_readme.py checks that the file equals what
this prints, so the reference cannot drift from `quantdiff COMMAND --help`.
"""

from __future__ import annotations

from typing import Any

PREAMBLE = """# Command-line reference

Every command and option as `quantdiff COMMAND --help` gives them, generated from the commands themselves
(`python -m quantdiff.cli.reference > docs/cli.md`; a test fails when this page and the code disagree).
The habits every command shares — `MODEL` names, `--quiet`, `--json`, `--force`, errors — are in
[the README](../README.md#habits-every-command-shares); the JSON each `--json` writes is in
[statistics.md](statistics.md#json-outputs).
"""


def _cell(text: str) -> str:
    """Text inside a markdown table cell: pipes escaped, lines joined."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _names(param: Any) -> str:
    if param.param_type_name == "argument":
        return f"`{param.name.upper()}{'...' if param.nargs == -1 else ''}`"
    return ", ".join(f"`{opt}`" for opt in [*param.opts, *param.secondary_opts])


def _default(param: Any) -> str:
    if param.required:
        return "required"
    if param.default is None or param.default is False or param.default == []:
        return ""
    return f"`{param.default}`"


def command_section(name: str, command: Any) -> str:
    """One command: usage, its help paragraphs, and a table of its arguments and options."""
    ctx = command.make_context(name, [], resilient_parsing=True)
    arguments = " ".join(f"{p.name.upper()}{'...' if p.nargs == -1 else ''}" for p in command.params if p.param_type_name == "argument")
    rows = [
        f"| {_names(p)} | {_cell(p.display_type(ctx).strip('<>')) if not getattr(p, 'is_flag', False) else 'flag'} | {_default(p)} | {_cell(p.help or '')} |"
        for p in command.params
    ]
    return "\n".join([
        f"## `quantdiff {name}`", "", "```text", f"quantdiff {name} [OPTIONS] {arguments}".rstrip(), "```", "",
        command.help.strip(), "", "| argument or option | type | default | what it does |", "|---|---|---|---|", *rows, "",
    ])


def reference_markdown() -> str:
    """The whole page: the preamble, the root help, then every command in the order `quantdiff --help` lists them."""
    import typer

    from quantdiff.cli.app import build_app

    group = typer.main.get_command(build_app())
    contents = " · ".join(f"[{name}](#quantdiff-{name})" for name in group.commands)
    sections = [command_section(name, command) for name, command in group.commands.items()]
    return "\n".join([PREAMBLE, group.help.strip(), "", contents, "", *sections])


if __name__ == "__main__":
    print(reference_markdown(), end="")
