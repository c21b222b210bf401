"""The documentation's code runs: every ```python block of README.md and docs/*.md.

Each page's ``python`` blocks run in order in one fresh module namespace, so a walkthrough
builds up across sections; a failing block's traceback names the page and its line. The
pages use tiny CPU sizes. There is no opt-out: a block that is not meant to run is fenced
``text``, ``console`` or ``bash``, never as Python, and
:func:`test_python_is_fenced_as_python` fails on a Python spelling that would be skipped
(``py``, ``python3``, ``pycon``, a bare fence, a MyST ``{code-block} python`` directive).

What a block prints is checked where the page shows it: a ```text block right after a
python block, introduced by a line ``It prints:`` or ``Output:``, must equal what that
block printed. Every python block of README.md shows its output.

The pages say what holds for a user: :func:`test_user_pages_have_no_process_words` fails
on words of the project's own process and on private module paths, outside the
contributor pages; :func:`test_figures_are_generated_from_the_results` fails when a
generated block of measured figures (``benchmarks/readme_table.py``) is stale or missing.

:func:`test_guide_is_the_typed_twin` keeps ``docs/integrate.md`` and
``typing_tests/_user_model.py`` (the same classes with annotations, checked by mypy and
pyright strict) identical up to annotations and docstrings.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests import forked

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDE = ROOT / "docs" / "integrate.md"
TWIN = ROOT / "typing_tests" / "_user_model.py"

# An opening or closing fence: backticks or tildes (code), colons (MyST directives).
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,}|:{3,})(?P<info>.*)$")
# Spellings of Python (or of a Python session) that this file would not run.
_PYTHON_ALIASES = {"py", "py3", "python3", "python2", "pycon", "ipython", "ipython3", "pytb"}
_CODE_DIRECTIVES = {"{code-block}", "{code}", "{sourcecode}", "{code-cell}"}
# The line that introduces a python block's printed output (a ```text block right after it).
_OUTPUT_LEADS = {"It prints:", "Output:"}


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, the line of its first code line, its info string, its code,
    and the non-blank lines between the previous block (at its level) and this one."""

    page: Path
    line: int
    info: str
    code: str
    before: tuple[str, ...] = field(default=(), compare=False)

    @property
    def lang(self) -> str:
        return self.info.split()[0] if self.info else ""

    def where(self) -> str:
        page = self.page.relative_to(ROOT) if ROOT in self.page.parents else self.page.name
        return f"{page}:{self.line - 1}"


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page, in order (CommonMark fence rules).

    The body of a MyST directive (``{note}``, ``{admonition}``, ...) is searched too, so a
    python block inside an admonition runs; code and example blocks are not searched.
    """
    return _blocks(page, page.read_text(encoding="utf-8").splitlines(), 0)


def _blocks(page: Path, lines: list[str], offset: int) -> list[Block]:
    blocks: list[Block] = []
    before: list[str] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            if lines[i].strip():
                before.append(lines[i].strip())
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (
                closing is not None
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        block = Block(page, offset + i + 2, opening["info"].strip(), "\n".join(body), tuple(before))
        before = []
        blocks.append(block)
        if block.lang.startswith("{") and block.lang not in _CODE_DIRECTIVES:
            blocks.extend(_blocks(page, body, offset + i + 1))
        i = j + 1
    return blocks


def python_blocks(page: Path) -> list[Block]:
    return [b for b in fenced_blocks(page) if b.lang == "python"]


def shown_output(blocks: list[Block], index: int) -> Block | None:
    """The output the page shows for ``blocks[index]``: the ```text block right after it,
    introduced by one of :data:`_OUTPUT_LEADS`."""
    if index + 1 >= len(blocks):
        return None
    nxt = blocks[index + 1]
    if nxt.lang == "text" and len(nxt.before) == 1 and nxt.before[0] in _OUTPUT_LEADS:
        return nxt
    return None


def outputs_of(page: Path) -> dict[int, Block]:
    """Each python block's line -> the output block the page shows for it."""
    blocks = fenced_blocks(page)
    found: dict[int, Block] = {}
    for i, block in enumerate(blocks):
        out = shown_output(blocks, i)
        if block.lang == "python" and out is not None:
            found[block.line] = out
    return found


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def run_page(page: Path) -> dict[str, object]:
    """Run the page's python blocks in order in one new module; return its namespace.

    A block whose output the page shows must print exactly that (trailing spaces aside).
    """
    name = f"_docs_{page.stem.lower()}"
    module = types.ModuleType(name)
    module.__file__ = str(page)
    expected = outputs_of(page)
    sys.modules[name] = module  # dataclasses and pickling look the module up
    try:
        for block in python_blocks(page):
            # Padding keeps line numbers: a traceback shows the page's own line.
            source = "\n" * (block.line - 1) + block.code + "\n"
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(source, str(page), "exec"), module.__dict__)
            shown = expected.get(block.line)
            if shown is not None:
                assert _lines(printed.getvalue()) == _lines(shown.code), (
                    f"{block.where()}: the block printed\n{printed.getvalue()}\nbut "
                    f"{shown.where()} shows\n{shown.code}"
                )
            else:
                sys.stdout.write(printed.getvalue())
    finally:
        del sys.modules[name]
    return module.__dict__


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_runs(page: Path) -> None:
    """The page's python blocks run top to bottom (their own asserts check the results)."""
    if page.name == "pipelining.md" and torch.__version__.startswith("2.11"):
        # Its DualPipeV example puts both stages on one gloo rank; torch 2.11's stage
        # set-up sends a warm-up tensor to the same rank, which gloo refuses (2.13 skips it).
        pytest.skip("torch 2.11 DualPipeV warm-up sends to the same rank, which gloo refuses")
    run_page(page)


def test_integration_pages_have_code() -> None:
    """The pages that show an integration still do (a rename would make the run vacuous)."""
    for page in (ROOT / "README.md", GUIDE, ROOT / "docs" / "index.md"):
        assert python_blocks(page), f"{page.relative_to(ROOT)}: no python block left"
    guide = "\n".join(b.code for b in python_blocks(GUIDE))
    for needed in ("combined_1f1b(model, microbatches)", "torch.equal"):
        assert needed in guide, f"docs/integrate.md: no {needed!r} in its code"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_is_fenced_as_python(page: Path) -> None:
    """Only ``python`` fences run: any other spelling of Python would silently be skipped."""
    wrong: list[str] = []
    for block in fenced_blocks(page):
        lang, args = block.lang, block.info.split()[1:]
        if lang == "":
            wrong.append(f"{block.where()}: a bare fence (Sphinx highlights it as Python)")
        elif lang.lower() in _PYTHON_ALIASES or (lang.lower() == "python" and lang != "python"):
            wrong.append(f"{block.where()}: ```{lang}")
        elif lang in _CODE_DIRECTIVES and args and args[0].lower() in {*_PYTHON_ALIASES, "python"}:
            wrong.append(f"{block.where()}: {block.info}")
    assert not wrong, (
        "fence code that runs as ```python and anything else as ```text / ```console / "
        "```bash; these blocks would not run: " + "; ".join(wrong)
    )


def test_fence_parser(tmp_path: Path) -> None:
    """The parser finds indented, tilde and admonition fences, skips examples, keeps lines."""
    page = tmp_path / "sample.md"
    page.write_text(
        "# t\n"
        "````markdown\n```python\nnot_run()\n```\n````\n"
        "- item\n\n  ```python\n  x = 1\n  ```\n"
        "~~~python\ny = x + 1\n~~~\n"
        "```{code-block} py\nz = 0\n```\n"
        ":::{note}\n```python\ny *= 3\n```\n:::\n",
        encoding="utf-8",
    )
    blocks = fenced_blocks(page)
    assert [(b.line, b.lang) for b in blocks] == [
        (3, "markdown"),
        (10, "python"),
        (13, "python"),
        (16, "{code-block}"),
        (19, "{note}"),
        (20, "python"),
    ]
    assert blocks[0].code == "```python\nnot_run()\n```"
    assert run_page(page)["y"] == 6


def test_shown_output_is_checked(tmp_path: Path) -> None:
    """A block's shown output is compared; a wrong one fails, naming both places."""
    page = tmp_path / "sample.md"
    page.write_text(
        "```python\nprint('a')\n```\n\nIt prints:\n\n```text\na\n```\n"
        "```python\nprint('b')\n```\n\nSome prose.\n\n```text\nnot an output\n```\n",
        encoding="utf-8",
    )
    assert list(outputs_of(page)) == [2]
    run_page(page)
    page.write_text("```python\nprint('a')\n```\nOutput:\n```text\nb\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match=r"sample.md:1: the block printed"):
        run_page(page)


def test_readme_examples_show_their_output() -> None:
    """Every python block of README.md shows what it prints (and run_page checks it)."""
    readme = ROOT / "README.md"
    shown = outputs_of(readme)
    missing = [b.where() for b in python_blocks(readme) if b.line not in shown]
    assert not missing, f"README.md python blocks without their output: {missing}"
    first = python_blocks(readme)[0]
    for needed in ("losses equal: True", "gradients bit-identical: True", "@comm"):
        assert needed in shown[first.line].code, (
            f"README's first example no longer shows {needed!r}"
        )


# --- words for users ----------------------------------------------------------------------------

#: Pages for the people changing the library, where its process and private paths belong.
CONTRIBUTOR_PAGES = {"contributing.md", "architecture.md", "changelog.md"}
#: Words of the project's own process, meaningless to a user (case-insensitive).
PROCESS_WORDS = [
    r"\bissue \d+",
    r"\bround \d+",
    r"\bsession\b",
    r"\bthe seed\b",
    r"\bdesign card\b",
    r"\bthe brief\b",
    r"\bper the brief\b",
    r"\blab notebook\b",
    r"\bthis project's\b",
    r"\b\d+-core CPU machine\b",
    r"\bthe device tool\b",
]
#: A private module of the package, by import path or file path.
PRIVATE_PATHS = [
    r"\bmoe_overlap(?:\.[a-z]\w*)*\._[a-z]\w*",
    r"\b(?:engine|core|blocks|models|adapters|integrations|plan|pipelining)\._[a-z]\w*",
    r"\bsrc/moe_overlap/(?:[\w/]*/)?_[a-z]\w*\.py\b",
]


def user_pages() -> list[Path]:
    return [p for p in PAGES if p.name not in CONTRIBUTOR_PAGES]


def findings(text: str, patterns: list[str]) -> list[str]:
    """``line: match`` for every match of ``patterns`` in ``text`` (a match inside a longer
    one counted once)."""
    found: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        spans = sorted(
            {m.span() for pattern in patterns for m in re.finditer(pattern, line, re.I)},
            key=lambda span: (span[0], -span[1]),
        )
        end = -1
        for start, stop in spans:
            if stop > end:
                found.append(f"{number}: {line[start:stop]!r}")
                end = stop
    return found


def test_finder_catches_the_words() -> None:
    text = "See issue 28 and the seed's nodes.\nmoe_overlap.engine._errors.X, blocks._wgrad\n"
    assert findings(text, PROCESS_WORDS) == ["1: 'issue 28'", "1: 'the seed'"]
    assert findings(text, PRIVATE_PATHS) == [
        "2: 'moe_overlap.engine._errors'",
        "2: 'blocks._wgrad'",
    ]
    assert findings("moe_overlap.engine.contracts, model._preprocess", PRIVATE_PATHS) == []


@pytest.mark.parametrize("page", user_pages(), ids=[p.name for p in user_pages()])
def test_user_pages_have_no_process_words(page: Path) -> None:
    """No words of the project's process and no private module path on a user's page."""
    text = page.read_text(encoding="utf-8")
    found = findings(text, PROCESS_WORDS) + findings(text, PRIVATE_PATHS)
    assert not found, (
        f"{page.relative_to(ROOT)} speaks to users; reword or move to a contributor page "
        f"({sorted(CONTRIBUTOR_PAGES)}): {found}"
    )


# --- measured figures -------------------------------------------------------------------------

#: The generated blocks each page must hold (``benchmarks/readme_table.py``; "" the headline).
FIGURES = {
    "README.md": {""},
    "benchmarks/README.md": {"", "choose", "ep"},
    "docs/performance.md": {""},
    "docs/concepts.md": {"fill-drain"},
    "docs/choosing.md": {"choose"},
    "docs/expert_parallel.md": {"ep"},
}


def _figures() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_readme_table", ROOT / "benchmarks" / "readme_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", sorted(FIGURES))
def test_figures_are_generated_from_the_results(page: str) -> None:
    """The page's measured figures are generated from the committed results, and current."""
    figures = _figures()
    path = ROOT / page
    text = path.read_text(encoding="utf-8")
    assert set(figures.blocks_in(text)) >= FIGURES[page], (
        f"{page}: expected the generated blocks {sorted(FIGURES[page])}, found "
        f"{figures.blocks_in(text)}"
    )
    assert figures.regenerate(path, text) == text, (
        f"{page} is stale against the results: python benchmarks/readme_table.py"
    )


def test_every_page_with_figures_is_listed() -> None:
    figures = _figures()
    with_blocks = {
        str(p.relative_to(ROOT)) for p in figures.PAGES if figures.blocks_in(p.read_text())
    }
    assert with_blocks == set(FIGURES)


# --- the expert-parallel example --------------------------------------------------------------


@pytest.mark.slow
def test_expert_parallel_example_runs_on_two_gloo_ranks() -> None:
    """``docs/expert_parallel.md``'s torchrun command prints what the page shows."""
    page = ROOT / "docs" / "expert_parallel.md"
    blocks = fenced_blocks(page)
    command = "torchrun --nproc-per-node 2 examples/train_ep.py"
    at = next(i for i, b in enumerate(blocks) if b.lang == "bash" and b.code.strip() == command)
    shown = shown_output(blocks, at)
    assert shown is not None, f"{page.name}: no output shown after {command!r}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = forked.run(  # torchrun and its ranks forked from zygotes (tests/forked.py)
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            "examples/train_ep.py",
        ],
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert _lines(done.stdout) == _lines(shown.code), done.stdout


# --- the guide and its type-checked twin ------------------------------------------------------


class _Untyped(ast.NodeTransformer):
    """Drop annotations and docstrings: what remains must be the same code."""

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = None
        node.body = _without_docstring(node.body)
        self.generic_visit(node)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        node.body = _without_docstring(node.body)
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.Assign | None:
        if node.value is None:
            return None
        return ast.Assign(targets=[node.target], value=node.value)


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return body[1:] or [ast.Pass()]
    return body


def _classes(source: str) -> dict[str, str]:
    tree = _Untyped().visit(ast.parse(source))
    return {n.name: ast.dump(n) for n in tree.body if isinstance(n, ast.ClassDef)}


def test_guide_is_the_typed_twin() -> None:
    """Every class of docs/integrate.md is in typing_tests/_user_model.py, equal but for types."""
    guide = _classes("\n".join(b.code for b in python_blocks(GUIDE)))
    twin = _classes(TWIN.read_text(encoding="utf-8"))
    assert {"UserConfig", "UserLayer", "UserModel"} <= set(guide)
    missing = sorted(set(guide) - set(twin))
    assert not missing, f"{TWIN.relative_to(ROOT)} lacks the guide's classes {missing}"
    differ = sorted(name for name in guide if guide[name] != twin[name])
    assert not differ, (
        f"docs/integrate.md and {TWIN.relative_to(ROOT)} differ beyond annotations and "
        f"docstrings in {differ}: change both"
    )


# --- docs/concepts.md lists the package's face, module by module -------------------------------

FACE_ROW = re.compile(r"^\| \{py:mod\}`(moe_overlap(?:\.\w+)?)` \| [^|]* \| (.*) \|$", re.M)


def face_rows(text: str) -> dict[str, set[str]]:
    """The modules the table of ``## Where the names live`` names, each with its names."""
    return {m.group(1): set(re.findall(r"`(\w+)`", m.group(2))) for m in FACE_ROW.finditer(text)}


def test_face_rows_are_read() -> None:
    text = "| {py:mod}`moe_overlap.x` | what | `A`, `b_c` |\n| {py:mod}`moe_overlap` | w | `D` |\n"
    assert face_rows(text) == {"moe_overlap.x": {"A", "b_c"}, "moe_overlap": {"D"}}


def test_concepts_lists_every_public_name_where_it_lives() -> None:
    import importlib

    rows = face_rows((ROOT / "docs" / "concepts.md").read_text(encoding="utf-8"))
    face = ["moe_overlap", "steps", "streams", "protocols", "microbatch", "inputs", "wgrad"]
    face += ["errors", "megatron"]
    modules = [m if m == "moe_overlap" else f"moe_overlap.{m}" for m in face]
    assert sorted(rows) == sorted(modules)
    for name in modules:
        assert rows[name] == set(importlib.import_module(name).__all__), name
