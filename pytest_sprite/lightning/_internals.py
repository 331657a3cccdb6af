"""Every reach of the code under test into a private name of Lightning or torch, in one file.

The strategies use public APIs except where none exists; each such use is here, says which private
name it touches and why, and which versions it is tested with (``tests/project/test_private_apis.py`` runs
them against the installed, newest releases). Each is gated: when the name is absent, a documented
fallback runs. The plugin keeps its own in ``pytest_sprite/plumbing/dependency_internals.py``; this package
never imports the plugin.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ddp_constructor_kwargs", "fsdp_param_groups", "no_split_modules"]


def ddp_constructor_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a Lightning ``DDPStrategy`` was given for ``DistributedDataParallel``.

    Lightning (2.6) keeps them in ``DDPStrategy._ddp_kwargs`` and passes them on in its own
    ``_setup_model``, which the XPU strategy overrides; there is no public reader. Fallback: none.
    """
    return dict(getattr(strategy, "_ddp_kwargs", None) or {})


def fsdp_param_groups(module: Any) -> list[Any]:
    """The FSDP2 parameter groups of one ``fully_shard`` module (each has ``fsdp_params``).

    torch keeps them on the module's private state: ``_get_fsdp_state()._fsdp_param_groups`` (a list,
    torch >= 2.10) or ``._fsdp_param_group`` (one, 2.6 - 2.9). No public API lists the parameters FSDP2
    manages. Fallback: no groups, so a strategy check that needs them refuses rather than guesses.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def no_split_modules(module: Any) -> tuple[str, ...]:
    """The block class names a Hugging Face model declares as its unsplittable units.

    ``PreTrainedModel._no_split_modules`` (transformers 4.45 - 5.x) is what accelerate and PEFT read;
    there is no public accessor. Fallback: none declared.
    """
    return tuple(getattr(module, "_no_split_modules", None) or ())
