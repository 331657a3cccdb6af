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
myst_enable_extensions = ["colon_fence", "deflist"]

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


# The API page, grouped by task: each group names its how-to and its public names; the table's purpose column is
# each name's first docstring line and the entries below it are autodoc's, so the page stays generated. A public
# name in no group lands under "Everything else", so a new name is documented the day it is exported.
API_GROUPS = [
    ("Run a test on ranks", "Your first ranks test", "../tutorial/first-ranks-test.md",
     ["World", "data_parallel_mesh", "collected", "progress"]),
    ("Check FP32 parity", "Check FP32 parity", "../how-to/fp32-parity.md",
     ["assert_parity", "ParityResult", "ArmParity", "ParityError", "ParityRefused", "PARITY_CHECKS", "ArmRecord",
      "load_arm_record"]),
    ("Check BF16 parity with criterion v2", "Check BF16 parity with criterion v2", "../how-to/criterion-v2.md",
     ["assert_criterion_v2", "CriterionResult", "CriterionError", "CriterionRefused", "CRITERION_CHECKS",
      "Bf16ArmRecord"]),
    ("Check your own model", "Check your existing LightningModule", "../how-to/existing-lightningmodule.md",
     ["Recipe", "LoraQwen", "RecipeIdentity", "tensor_digest"]),
    ("Check a checkpoint resume", "Check a checkpoint resume", "../how-to/checkpoint-resume.md",
     ["assert_resume_bitexact", "ResumeResult", "ResumeError"]),
    ("Check crash consistency", "Check crash consistency", "../how-to/crash-consistency.md",
     ["assert_crash_consistent", "crash_fn", "crash_recipe", "crash_command", "crash_hf_trainer", "CrashMatrix",
      "CrashConsistencyError", "judge_crash_matrix", "note_save_complete", "note_resumed_from"]),
    ("Prove that a planted fault is caught", "The fault catalogue", "faults.md",
     ["expect_fault_rejected", "FAULTS", "Fault", "FaultRejection", "FaultNotRejected", "FailedCheck"]),
    ("Start fresh ranks inside a test", "Sub-worlds", "../how-to/sub-worlds.md",
     ["run_subworld", "SubworldResult", "SubworldError", "kill_point", "KillAt", "emit"]),
    ("Report your own assertions", "Reading the reports", "../how-to/reading-reports.md",
     ["record_assertion", "assertion_results", "AssertionFailure"]),
    ("Errors", "Limits and pitfalls", "../explanation/limits.md",
     ["SpriteError", "SpriteUsageError", "LaunchError", "RankEnvError", "ArtifactExistsError"]),
]  # fmt: skip


def _purpose(obj) -> str:
    import inspect

    doc = inspect.getdoc(obj) if not isinstance(obj, (tuple, dict)) else None
    first = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
    return first.replace("|", "\\|") or "-"


def api_page() -> str:
    """The grouped part of ``reference/api.md``: per task, a table of purposes and the autodoc entries."""
    import inspect

    import pytest_sprite

    constants = {
        "FAULTS": "The fault registry: each fault's name to its Fault entry (what it plants, where, what rejects it).",
        "PARITY_CHECKS": "The names of assert_parity's checks, in order.",
        "CRITERION_CHECKS": "The names of assert_criterion_v2's checks: invariants, scored checks and gate.",
    }
    grouped = [name for *_, names in API_GROUPS for name in names]
    out = []
    for title, label, link, names in API_GROUPS:
        out += [f"## {title}", "", f"How-to: [{label}]({link}).", ""]
        out += ["| Name | Purpose |", "| --- | --- |"]
        for name in names:
            obj = getattr(pytest_sprite, name)
            purpose = constants.get(name) or _purpose(obj)
            out.append(f"| [`{name}`](#pytest_sprite.{name}) | {purpose} |")
        out += ["", "```{eval-rst}"]
        for name in names:
            obj = getattr(pytest_sprite, name)
            if name in constants:
                out += [f".. py:data:: {name}", "   :module: pytest_sprite", "", f"   {constants[name]}", ""]
            elif inspect.isclass(obj):
                out += [f".. autoclass:: pytest_sprite.{name}", "   :members:", ""]
            else:
                out += [f".. autofunction:: pytest_sprite.{name}", ""]
        out += ["```", ""]
    rest = [n for n in pytest_sprite.__all__ if n not in grouped]
    out += ["## Everything else", ""]
    if rest:
        out += [
            "```{eval-rst}",
            ".. automodule:: pytest_sprite",
            "   :members: " + ", ".join(rest),
            "```",
            "",
        ]
    else:
        out += ["Every public name is in a group above.", ""]
    return "\n".join(out)


def _insert_api(app, docname, source):
    if docname == "reference/api":
        source[0] = source[0].replace("<!-- api-groups -->", api_page())


def setup(app):
    app.connect("autodoc-process-docstring", _escape_bars)
    app.connect("source-read", _insert_api)
