"""BF16 parity, criterion v2: the lightning-sprite procedure's rule, exactly.

Scored (ddp and fsdp against split, step 0 only): pre-clip global norm relative error at most 1e-3 on every
rank; each trainable tensor's gradient L2 difference at most ``1e-3 * reference_norm + 1e-12 * sqrt(numel)``;
the step-0 update of all trainables relative L2 at most 1e-3; each tensor's step-0 update as for gradients
plus ``2 * eps_fp32 * norm(initial_tensor)`` for endpoint quantization. Gate: split_premul must pass the same
checks against split, else the run cannot separate implementation error from rounding and the verdict is void.
Invariants hold on every arm and step. Verdict: fail if any invariant fails; otherwise void if the gate fails;
otherwise pass only if ddp and fsdp pass every scored check. Void is never a pass: the assertion raises.
Diagnostics (all five steps, five-step updates, BF16 against FP32) are reported, never scored.

One module per concern: ``results`` (limits, figures, tables), ``invariants``, ``scoring`` (scored checks
and diagnostics), ``verdict`` (refusals and the assertion) and ``table`` (the terminal's rows).
"""

from __future__ import annotations

from pytest_sprite.assertions.criterion import results
from pytest_sprite.assertions.criterion.results import *  # noqa: F403
from pytest_sprite.assertions.criterion.scoring import tensor_gap
from pytest_sprite.assertions.criterion.verdict import assert_criterion_v2

__all__ = ["assert_criterion_v2", "tensor_gap"]
__all__ += results.__all__
