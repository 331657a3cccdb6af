"""The controller's reports of a session: terminal tables, ``--sprite-report`` JSON, JUnit properties, plots.

Controller side only: rank agents, test children and pytest-xdist workers never load the reporter.
"""
