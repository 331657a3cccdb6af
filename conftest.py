"""Repository-level test configuration: pytester for testing the plugin from the outside."""

pytest_plugins = ["pytester"]
