"""Deprecated name of :mod:`pytest_sprite.save_crashes` (crash consistency of checkpoint saves)."""

from pytest_sprite.plumbing.renamed_modules import alias_module

alias_module(__name__)
