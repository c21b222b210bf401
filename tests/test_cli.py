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


def test_every_command_says_what_it_does() -> None:
    for name, parser in _commands().items():
        assert parser.description and len(parser.description.split()) >= 8, name
        assert parser.description.split()[0] in " ".join(parser.format_help().split()), name


_MISUSES: dict[str, tuple[list[str], str]] = {
    "hf-config-missing": (
        ["plan", "--hf-config", "{tmp}/nope.json"],
        "plan --hf-config: expected a readable JSON file, received '{tmp}/nope.json' (No such",
    ),
    "hf-config-folder": (
        ["plan", "--hf-config", "{tmp}"],
        "plan --hf-config: expected a readable JSON file, received '{tmp}' (Is a directory)",
    ),
    "hf-config-not-json": (
        ["plan", "--hf-config", "{tmp}/bad.json"],
        "plan --hf-config: expected a JSON file, received '{tmp}/bad.json', which is not JSON",
    ),
    "hf-config-list": (
        ["plan", "--hf-config", "{tmp}/list.json"],
        "plan --hf-config: expected a JSON object (a config.json), received list",
    ),
    "profile-missing": (
        ["plan", "--profile", "{tmp}/nope.json", "--layers", "4"],
        "plan --profile: expected a readable JSON file, received '{tmp}/nope.json'",
    ),
    "profile-not-json": (
        ["plan", "--profile", "{tmp}/bad.json", "--layers", "4"],
        "plan --profile: expected a JSON file, received '{tmp}/bad.json', which is not JSON",
    ),
    "profile-rows-not-objects": (
        ["plan", "--profile", "{tmp}/list.json", "--layers", "4"],
        "plan --profile: expected rows that are JSON objects",
    ),
    "plan-microbatches-1e9": (
        ["plan", "--microbatches", "1000000000"],
        "Layout.microbatches: expected at most 65536 microbatches",
    ),
    "plan-choose-microbatches-1e9": (
        ["plan", "--choose", "--microbatches", "1000000000"],
        "Layout.microbatches: expected at most 65536 microbatches",
    ),
    "plan-out-is-a-file": (
        ["plan", "--out", "{tmp}/bad.json"],
        "plan --out: expected a folder that can be created and written, received "
        "'{tmp}/bad.json' (File exists); pass another folder",
    ),
    "layers-without-profile": (["plan", "--layers", "4"], "received --layers, which it would"),
    "choose-flags-without-choose": (
        ["plan", "--memory-budget", "1.5", "--quick", "--top-k", "2"],
        "plan: expected only flags this run uses (no --profile, no --choose), received "
        "--top-k --memory-budget --quick, which it would ignore",
    ),
    "static-share-without-choose": (
        ["plan", "--static-share", "0.5"],
        "received --static-share, which it would ignore",
    ),
    "sizes-without-profile": (
        ["plan", "--choose", "--hidden", "64"],
        "(no --profile, --choose), received --hidden, which it would ignore",
    ),
    "schedule-with-choose": (
        ["plan", "--choose", "--schedule", "1f1b"],
        "received --schedule, which it would ignore",
    ),
    "dp-with-choose": (
        ["plan", "--choose", "--dp", "4"],
        "(no --profile, --choose), received --dp, which it would ignore",
    ),
    "ep-with-profile-and-choose": (
        ["plan", "--choose", "--profile", "{tmp}/list.json", "--layers", "4", "--ep", "4"],
        "(--profile gives the costs, --choose), received --ep, which it would ignore",
    ),
    "machine-with-profile": (
        ["plan", "--profile", "{tmp}/list.json", "--layers", "4", "--machine", "h100"],
        "(--profile gives the costs, no --choose), received --machine, which it would ignore",
    ),
    "by-kind-without-choose": (
        [
            "plan",
            "--contention-by-kind",
            "combine.B=0.7",
            "--compute-contention-by-kind",
            "mlp.F=0",
        ],
        "(no --profile, no --choose), received --contention-by-kind "
        "--compute-contention-by-kind, which it would ignore",
    ),
    "by-kind-with-contention": (
        ["plan", "--choose", "--contention", "0.055", "--contention-by-kind", "combine.B=0.7"],
        "plan --choose: expected one contention model, received --contention 0.055 and "
        "--contention-by-kind; pass --contention 0 (its default) to use the coefficients per "
        "kind, or drop --contention-by-kind",
    ),
    "compute-by-kind-with-contention": (
        ["plan", "--choose", "--contention", "0.1", "--compute-contention-by-kind", "mlp.F=0"],
        "received --contention 0.1 and --compute-contention-by-kind; pass --contention 0",
    ),
    "by-kind-unknown-slot": (
        ["plan", "--choose", "--contention-by-kind", "combine.B=0.7", "mlp.F=0.1"],
        "plan --contention-by-kind: expected KIND among the communication kinds (dispatch.F, "
        "dispatch.B, combine.F, combine.B), received 'mlp.F=0.1'",
    ),
    "by-kind-unknown-direction": (
        ["plan", "--choose", "--contention-by-kind", "combine.W=0.1"],
        "plan --contention-by-kind: expected KIND among the communication kinds",
    ),
    "by-kind-not-a-number": (
        ["plan", "--choose", "--contention-by-kind", "combine.B=high"],
        "plan --contention-by-kind: expected a coefficient C that is a number, received "
        "'combine.B=high'",
    ),
    "by-kind-no-coefficient": (
        ["plan", "--choose", "--contention-by-kind", "combine.B"],
        "plan --contention-by-kind: expected KIND=C (e.g. combine.B=0.7), received 'combine.B'",
    ),
    "by-kind-negative": (
        ["plan", "--choose", "--contention-by-kind", "combine.B=-0.1"],
        "plan --contention-by-kind: expected a finite coefficient >= 0, received 'combine.B=-0.1'",
    ),
    "by-kind-twice": (
        ["plan", "--choose", "--contention-by-kind", "combine.B=0.7", "combine.B=0.6"],
        "plan --contention-by-kind: expected each kind once, received combine.B again in "
        "'combine.B=0.6'",
    ),
    "compute-by-kind-communication-kind": (
        ["plan", "--choose", "--compute-contention-by-kind", "mlp.B=0.1", "combine.B=0.1"],
        "plan --compute-contention-by-kind: expected KIND among the compute kinds (pre_process.F, ",
    ),
    "compute-by-kind-infinite": (
        ["plan", "--choose", "--compute-contention-by-kind", "mlp.R=inf"],
        "plan --compute-contention-by-kind: expected a finite coefficient >= 0, received "
        "'mlp.R=inf'",
    ),
    "demo-lr-nan": (
        ["demo", "--lr", "nan", "--out", "{tmp}/d"],
        "demo --lr: expected a finite learning rate >= 0, received nan",
    ),
    "demo-lr-negative": (["demo", "--lr", "-1", "--out", "{tmp}/d"], "received -1.0"),
    "demo-ep-0": (
        ["demo", "--ep", "0", "--out", "{tmp}/d"],
        "demo --ep: expected an expert-parallel size >= 1, received 0",
    ),
    "demo-out-is-a-file": (
        ["demo", "--out", "{tmp}/bad.json"],
        "demo --out: expected a folder that can be created, received '{tmp}/bad.json' (File",
    ),
}


@pytest.mark.parametrize("case", sorted(_MISUSES))
def test_a_misuse_is_one_line_and_exit_status_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong file, folder, number or flag combination is refused in one line before any
    work, never a traceback nor a run that ignores a flag."""
    (tmp_path / "bad.json").write_text('{"a":\n')
    (tmp_path / "list.json").write_text("[1, 2]\n")
    argv, expected = _MISUSES[case]
    with pytest.raises(SystemExit) as done:
        main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert done.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    command = argv[0]
    assert line.startswith(f"moe-overlap {command}: error: "), line
    assert expected.replace("{tmp}", str(tmp_path)) in line, line
    assert not captured.out, captured.out
