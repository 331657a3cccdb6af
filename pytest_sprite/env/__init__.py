"""The rank environment: every launcher's rank variables read in one place, and the device a rank uses.

The code under test (``pytest_sprite.lightning``) may import this package, and nothing else of the plugin
but ``errors``.
"""
