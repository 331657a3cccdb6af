"""Rank side: agents that fork one child per ranks test, and the child that runs it.

Nothing here imports the controller side (``pytest_sprite.launch``).
"""
