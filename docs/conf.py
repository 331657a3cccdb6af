"""Sphinx configuration: MyST Markdown pages, the furo theme, the public API from docstrings.

Build: ``sphinx-build -W -b html docs docs/_build/html`` (``-W``: every warning is an error, so a broken link
or a reference to a name that moved fails the build). ``tests/project/test_docs.py`` runs it.
"""

from __future__ import annotations

project = "pytest-sprite"
author = "pytest-sprite contributors"
copyright = "pytest-sprite contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The public API is the top-level package's __all__ (the subpackages are being reorganized and are not a
# second surface): autodoc documents pytest_sprite itself, whose members it reads from __all__.
autodoc_member_order = "groupwise"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "undoc-members": True}

html_theme = "furo"
html_title = "pytest-sprite"
html_static_path: list[str] = []


def _escape_bars(app, what, name, obj, options, lines):
    """Docstrings here are plain text: ``|du - du_ref|`` is a norm, not a reST substitution reference."""
    import re

    for i, line in enumerate(lines):
        parts = re.split(r"(``.*?``)", line)
        lines[i] = "".join(p if p.startswith("``") else p.replace("|", r"\|") for p in parts)


def setup(app):
    app.connect("autodoc-process-docstring", _escape_bars)
