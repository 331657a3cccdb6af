"""The reporter plugin of the controlling pytest process (``sprite-reports``): one store, every form.

Registered by ``plugin.py`` in the process that logs the session's results: the controller, or
pytest-xdist's controller (never an xdist worker, a rank agent or a test child).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.glue.mutation_book import mutation_key
from pytest_sprite.glue.options import Settings
from pytest_sprite.glue.output_paths import not_written
from pytest_sprite.report.logged_results import ResultStore, is_profile_property

__all__ = ["SpriteReporter"]


class SpriteReporter:
    """Collects every logged report into a :class:`ResultStore` and writes the report forms from it."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.store = ResultStore(config)
        self.created = time.time()
        self.started = time.perf_counter()
        self.collected = 0
        self.written: list[tuple[str, Path]] = []
        self.not_written: list[str] = []
        self.collect_errors: list[dict[str, str]] = []
        """A line per file that could not be written at the session's end: said, never raised, so the
        summary and the exit status the tests earned survive a full disk."""
        if settings.report:  # refused before any test runs: it exists, is a folder, or cannot be written
            from pytest_sprite.glue.options import option_source
            from pytest_sprite.glue.output_paths import check_output_file
            from pytest_sprite.report.json_report import check_target

            option = option_source(config, "sprite_report")
            check_target(settings.report, overwrite=settings.report_overwrite, option=option)
            check_output_file(settings.report, option)
        if settings.plots:
            from pytest_sprite.report.plots import check_plots_available

            check_plots_available()

    # -- hooks (each hands off to a method) ---------------------------------------------------

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:  # kept for the JSON report: a session stopped by it has no test to carry it
            self.collect_errors.append(
                {"nodeid": report.nodeid, "outcome": "failed", "longrepr": report.longreprtext}
            )

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = len(session.items)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.take(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.write_files(int(exitstatus))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        self.summarize(terminalreporter)

    # -- work ----------------------------------------------------------------------------------

    def take(self, report: pytest.TestReport) -> None:
        """Store one report; on a teardown, hand junitxml the test's properties (it reads teardown's)."""
        entry = self.store.add(report)
        if entry.profile is not None:  # in the store now: JUnit's properties would show them as a dict's repr
            report.user_properties[:] = [p for p in report.user_properties if not is_profile_property(p)]
        if report.when == "teardown":
            from pytest_sprite.report.junit import junit_properties

            if entry.assertions:
                from pytest_sprite.report.kinds import load_report_tables

                load_report_tables(self.config)

            present = list(report.user_properties)  # a list: a property's value need not be hashable
            props = junit_properties(entry)
            book = self.config.stash.get(mutation_key, None)
            if book is not None:
                props += book.junit_properties(report.nodeid)
            report.user_properties.extend(p for p in props if p not in present)

    def write_files(self, exitstatus: int) -> None:
        entries = list(self.store.tests.values())
        if self.settings.report:
            from pytest_sprite.report.json_report import build_document, write_document

            controller = self.config.pluginmanager.get_plugin("sprite-controller")
            world = getattr(controller, "world_size", None) if controller is not None else None
            if not any(entry.ranks for entry in entries):
                world = None  # no ranks test ran: no world (the documented null), whatever markers were seen
            document = build_document(
                entries=entries,
                created=self.created,
                duration=time.perf_counter() - self.started,
                exitcode=exitstatus,
                root=str(self.config.rootpath),
                launcher=self.settings.launcher,
                world_size=world,
                device=self.settings.device,
                collected=self.collected,
            )
            if self.collect_errors:
                document["collectors"] = list(self.collect_errors)
            book = self.config.stash.get(mutation_key, None)
            document["mutation"] = book.to_json() if book is not None else {}
            self.config.hook.pytest_sprite_report(report=document, config=self.config)
            try:
                path = write_document(
                    document, self.settings.report, overwrite=self.settings.report_overwrite
                )
            except SpriteUsageError as exc:
                self.written.append((f"not written: {exc}", Path(self.settings.report)))
            except OSError as exc:  # checked at configure; the disk filled or the folder went meanwhile
                self.not_written.append(not_written("the JSON report", self.settings.report, exc))
            else:
                self.written.append(("JSON report", path))
        if self.settings.plots:
            from pytest_sprite.report.plots import write_plots

            try:
                plots = write_plots(entries, self.settings.plots)
            except OSError as exc:
                where = exc.filename or self.settings.plots
                self.not_written.append(not_written("a plot (and those after it)", where, exc))
            else:
                if plots:
                    self.written.append((f"{len(plots)} plots", Path(self.settings.plots)))

    def summarize(self, terminalreporter: Any) -> None:
        # Only assertions make tables: a session without one loads none of their code.
        if self.settings.summary != "no" and any(entry.assertions for entry in self.store.tests.values()):
            from pytest_sprite.report.kinds import load_report_tables
            from pytest_sprite.report.terminal import write_summary

            load_report_tables(self.config)

            short = self.config.get_verbosity() < 0
            write_summary(terminalreporter, self.store.tests.values(), short=short)
        if self.settings.profile:
            from pytest_sprite.report.profile import write_profile_table

            write_profile_table(
                terminalreporter, self.store.tests.values(), time.perf_counter() - self.started
            )
        book = self.config.stash.get(mutation_key, None)
        if book is not None:
            from pytest_sprite.report.mutation_table import write_mutation_table

            write_mutation_table(terminalreporter, book)
        for what, path in self.written:
            terminalreporter.write_line(f"sprite: {what}: {path}")
        for line in self.not_written:
            terminalreporter.write_line(f"sprite: {line}", yellow=True, bold=True)
