"""``python -m moe_overlap``: every command and every flag explains itself and its default;
``--version`` prints the package's version."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import moe_overlap
from moe_overlap.__main__ import _parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_lists_every_command_with_a_line() -> None:
    parser = _parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    described = {c.dest: c.help for c in sub._choices_actions}
    assert set(described) == set(_commands()) >= {"demo", "plan"}
    assert all(described.values()), described
    text = parser.format_help()
    for name, line in described.items():
        assert name in text and str(line)[:30] in " ".join(text.split()), name


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_flag_has_help_with_its_default(command: str) -> None:
    parser = _commands()[command]
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert flags, command
    missing = [
        a.option_strings[0]
        for a in flags
        if not a.help or "default" not in a.help or a.help == argparse.SUPPRESS
    ]
    assert not missing, f"{command}: flags without help naming their default: {missing}"
    text = " ".join(parser.format_help().split())  # %(default)s expanded without error
    for action in flags:
        if action.help is not None and "%(default)s" in action.help:
            shown = (
                action.default if not isinstance(action.default, list) else " ".join(action.default)
            )
            assert f"default: {shown}" in text, (action.option_strings, text)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"moe-overlap {moe_overlap.__version__}"


def test_a_refused_input_is_one_line_and_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--pp", "2", "--vpp", "2", "--schedule", "1f1b"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "moe-overlap plan: error: plan: 1f1b has 1 stage(s) per pipeline rank, received "
        "vpp=2; pass vpp=1"
    ]


def test_every_example_flag_has_help_with_its_default() -> None:
    """Each ``add_argument`` call in ``examples/*.py`` has a ``help=`` that names its default."""
    scripts = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))
    assert scripts
    seen = 0
    missing: list[str] = []
    for script in scripts:
        source = script.read_text()
        for node in ast.walk(ast.parse(source, filename=str(script))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
            ):
                continue
            seen += 1
            help_ = next((k.value for k in node.keywords if k.arg == "help"), None)
            text = "" if help_ is None else ast.get_source_segment(source, help_) or ""
            if "default" not in text:
                flag = ast.get_source_segment(source, node.args[0]) if node.args else "?"
                missing.append(f"{script.name}:{node.lineno} {flag}")
    assert seen, "no add_argument calls found in examples/*.py"
    assert not missing, f"example flags without help naming their default: {missing}"
