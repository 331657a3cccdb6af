"""The pytest glue: options, markers, the shared tmp_path, results kept with items, pytest internals.

Imported by the plugin and by test children; nothing here imports torch at import time.
"""
