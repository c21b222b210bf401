"""The package as a user installs it: the sdist and the wheel build offline (hatchling, the
build backend, called directly; the wheel built from the unpacked sdist, as ``python -m
build`` does), and the wheel, installed into a fresh virtual environment that holds only
its declared requirements (torch and typing-extensions, with what they require: linked from
this environment, never downloaded; no tqdm, no matplotlib), imports, answers ``--help``
and ``--version`` and runs a one-step demo and a plan."""

from __future__ import annotations

import email.message
import email.parser
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import moe_overlap

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"debug", "demo", "transformers", "torchtitan", "megatron", "dev", "docs"}
URL = "https://github.com/moe-overlap/moe-overlap"


def _run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _build(hook: str, source: Path, out: Path) -> Path:
    """Call hatchling's PEP 517 ``hook`` in ``source``; the file it wrote into ``out``."""
    code = f"import sys, hatchling.build as b; print(b.{hook}(sys.argv[1]))"
    name = _run([sys.executable, "-c", code, str(out)], cwd=source).strip().splitlines()[-1]
    return out / name


def _metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    (name,) = (n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return email.parser.Parser().parsestr(wheel.read(name).decode())


def _closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``requirements`` need, with everything they require
    (markers evaluated for this interpreter, no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        dist = importlib.metadata.distribution(name)
        assert req.specifier.contains(dist.version, prereleases=True), (req, dist.version)
        found[name] = dist
        todo += [Requirement(r) for r in dist.requires or []]
    return list(found.values())


def _link(dists: list[importlib.metadata.Distribution], site: Path) -> None:
    """Make ``dists`` importable and installed (their metadata too) in ``site``: a symlink
    per top-level entry their RECORD lists (scripts outside site-packages left out)."""
    for dist in dists:
        assert dist.files is not None, f"{dist.metadata['Name']}: no RECORD"
        for top in {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}:
            target = Path(str(dist.locate_file(top)))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)


def test_extras_by_purpose_and_dev_pins_them_all() -> None:
    """Each extra names what one purpose needs; ``dev`` (the test suite's) pins every
    package of the others (but docs) at a version they accept."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    tomllib: Any = importlib.import_module("tomllib")  # the checkers target 3.10
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    assert set(extras) == EXTRAS
    assert [Requirement(r).name for r in project["dependencies"]] == ["torch", "typing-extensions"]
    dev = {canonicalize_name(r.name): r for r in map(Requirement, extras["dev"])}
    for extra in EXTRAS - {"dev", "docs"}:
        for req in map(Requirement, extras[extra]):
            pin = dev.get(canonicalize_name(req.name))
            assert pin is not None, f"dev extra: no pin of {req.name} (extra {extra})"
            (spec,) = pin.specifier
            assert spec.operator == "==" and req.specifier.contains(spec.version), (req, pin)


@pytest.mark.slow
def test_built_wheel_installs_alone_and_runs(tmp_path: Path) -> None:
    if importlib.util.find_spec("hatchling") is None:
        pytest.skip("needs hatchling, the build backend (in the dev extra)")
    version = moe_overlap.__version__
    dist = tmp_path / "dist"
    dist.mkdir()

    # 1. The sdist, then the wheel from the unpacked sdist: a file the sdist leaves out
    # that the wheel needs fails here.
    sdist = _build("build_sdist", ROOT, dist)
    assert sdist.name == f"moe_overlap-{version}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        for needed in ("LICENSE", "README.md", "pyproject.toml", "src/moe_overlap/py.typed"):
            assert needed in names, needed
        # the sources of the repository's checks: type checking needs the stubs
        assert "stubs/megatron/core/__init__.pyi" in names and "tests/conftest.py" in names
        tar.extractall(tmp_path / "unpacked", filter="data")
    wheel_path = _build("build_wheel", tmp_path / "unpacked" / sdist.name[: -len(".tar.gz")], dist)
    assert wheel_path.name == f"moe_overlap-{version}-py3-none-any.whl"

    # 2. What the wheel holds: every module, the PEP 561 marker, the license, the metadata.
    with zipfile.ZipFile(wheel_path) as wheel:
        files = set(wheel.namelist())
        meta = _metadata(wheel)
    sources = {
        p.relative_to(ROOT / "src").as_posix()
        for p in (ROOT / "src" / "moe_overlap").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert sources <= files, sorted(sources - files)
    assert "moe_overlap/py.typed" in files
    assert f"moe_overlap-{version}.dist-info/licenses/LICENSE" in files
    # stubs/ types Megatron-Core for typing_tests/; the package never imports Megatron.
    assert not [f for f in files if f.endswith(("ruff.toml", ".pyi")) or f.startswith("megatron")]
    assert meta["Version"] == version and meta["License-Expression"] == "Apache-2.0"
    assert set(meta.get_all("Provides-Extra") or []) == EXTRAS
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert set(urls) == {"Homepage", "Repository", "Documentation", "Issues"}
    assert all(u.startswith(URL) for u in urls.values()), urls
    requires = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert sorted(Requirement(r).name for r in requires) == ["torch", "typing-extensions"]

    # 3. A fresh environment holding the wheel's requirements alone (linked from this one).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1")
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            cwd=tmp_path,
            env=env,
        ).strip()
    )
    _link(_closure(requires), site)
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    _run([*pip, "install", "--no-deps", "--no-index", str(wheel_path)], cwd=tmp_path, env=env)
    _run([*pip, "check"], cwd=tmp_path, env=env)  # every requirement met, nothing missing

    # 4. The user's commands, from a folder without the sources (independent of each other:
    # two at a time). The probe, ``--help`` and ``--version`` share one interpreter (each
    # would import torch again): the installed ``moe-overlap`` script run as its own file
    # once per option, its exit status and output printed as a JSON line each.
    script = str(venv / "bin" / "moe-overlap")
    probe = f"""
import contextlib, importlib.util as u, io, json, runpy, sys
import moe_overlap as m
print(m.__file__, m.__version__, u.find_spec('tqdm'), u.find_spec('matplotlib'))
for option in ('--help', '--version'):
    sys.argv, out, code = [{script!r}, option], io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(sys.argv[0], run_name='__main__')
        except SystemExit as e:
            code = e.code
    print(json.dumps([code, out.getvalue()]))
"""
    commands = {
        "probe": [str(python), "-c", probe],
        "demo": [script, "demo", "--steps", "1", "--microbatches", "1", "--out", "demo_out"],
        "plan": [
            str(python),
            "-m",
            "moe_overlap",
            "plan",
            "--microbatches",
            "2",
            "--out",
            "plan_out",
        ],
    }
    with ThreadPoolExecutor(2) as pool:
        ran = {k: pool.submit(_run, argv, cwd=tmp_path, env=env) for k, argv in commands.items()}
        outputs = {k: done.result() for k, done in ran.items()}
    probed, *answers = outputs["probe"].splitlines()
    where, got, tqdm, matplotlib = probed.split()
    assert Path(where).is_relative_to(site) and got == version
    assert (tqdm, matplotlib) == ("None", "None")  # the extras' packages are not there
    (help_code, outputs["help"]), (version_code, outputs["version"]) = map(json.loads, answers)
    assert help_code in (0, None) and version_code in (0, None), (help_code, version_code)
    text = outputs["help"]
    assert "demo" in text and "plan" in text
    assert outputs["version"].strip() == f"moe-overlap {version}"
    out = outputs["demo"]
    assert "all steps bit-identical: True" in out
    assert "no PNG" in out and "pip install 'moe-overlap[demo]'" in out, out
    assert sorted(p.name for p in (tmp_path / "demo_out").iterdir()) == ["timeline.json"]
    out = outputs["plan"]
    assert "combined_1f1b vs serial" in out
    assert "no Gantt PNG" in out and "pip install 'moe-overlap[demo]'" in out, out
    assert (tmp_path / "plan_out" / "plan.json").is_file()
