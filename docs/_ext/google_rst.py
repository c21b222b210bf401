"""A docutils parser for the package's docstrings: Google-style sections over reST.

sphinx-autodoc2 parses each docstring with the docutils parser named in
``autodoc2_docstring_parser_regexes``. The package writes reST with Google-style
``Args:`` / ``Attributes:`` / ``Members:`` sections, so this parser first rewrites those
sections with Napoleon and then parses reST.

autodoc2 parses into a scratch document whose reporter is not Sphinx's, so docstring
errors would only be printed (and left as error boxes in the page). Here they are removed
from the page and re-emitted as Sphinx warnings, which ``sphinx-build -W`` turns into a
failed build. A known problem can be listed in ``google_rst_known_issues`` as
``(source file name, message fragment)``: it is then reported as info, and an entry that
no longer matches anything is itself a warning (so the list cannot go stale).
"""

from __future__ import annotations

from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Parser as RstParser
from sphinx.application import Sphinx
from sphinx.ext.napoleon import Config
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.util import logging

__all__ = ["Parser", "setup"]

LOGGER = logging.getLogger(__name__)

_NAPOLEON = Config(
    napoleon_use_param=True,
    napoleon_use_rtype=True,
    napoleon_use_ivar=True,
    napoleon_custom_sections=[("Members", "Attributes")],
)

_KNOWN: list[tuple[str, str]] = []
_MATCHED: set[tuple[str, str]] = set()
_PARSED_FILES: set[str] = set()


class Parser(RstParser):
    """reST, after Napoleon has rewritten the Google-style sections."""

    supported = ("google_rst",)

    def parse(self, inputstring: str, document: nodes.document) -> None:
        document.reporter.report_level = 5  # do not print; re-emitted below instead
        converted = str(GoogleDocstring(inputstring, _NAPOLEON))
        super().parse(converted, document)
        source, _ = document.reporter.get_source_and_line(0)
        _PARSED_FILES.add(Path(str(source)).name)
        for message in list(document.findall(nodes.system_message)):
            if message["level"] >= 2:
                _report(message, document)
            message.parent.remove(message)


def _report(message: nodes.system_message, document: nodes.document) -> None:
    source, line = document.reporter.get_source_and_line(message.get("line") or 0)
    text = message.astext()
    for known in _KNOWN:
        if Path(str(source)).name == known[0] and known[1] in text:
            _MATCHED.add(known)
            LOGGER.info("known docstring issue (%s:%s): %s", source, line, text)
            return
    LOGGER.warning(
        "docstring: %s", text, location=(source, line), type="autodoc2", subtype="docstring"
    )


def _check_known(app: Sphinx, env: object) -> None:
    for known in app.config.google_rst_known_issues:
        if known[0] in _PARSED_FILES and tuple(known) not in _MATCHED:
            LOGGER.warning(
                "google_rst_known_issues entry %r matched nothing: remove it from conf.py",
                known,
                type="autodoc2",
                subtype="docstring",
            )


def _load_known(app: Sphinx) -> None:
    _KNOWN[:] = [tuple(k) for k in app.config.google_rst_known_issues]


def setup(app: Sphinx) -> dict[str, object]:
    app.add_config_value("google_rst_known_issues", [], "env", types=[list])
    app.connect("builder-inited", _load_known)
    app.connect("env-check-consistency", _check_known)
    return {"parallel_read_safe": False, "parallel_write_safe": True}
