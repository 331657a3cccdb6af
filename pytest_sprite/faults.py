"""Deprecated name of :mod:`pytest_sprite.planted_faults` (the registry of planted training faults)."""

from pytest_sprite.plumbing.renamed_modules import alias_module

alias_module(__name__)
