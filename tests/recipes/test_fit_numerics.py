"""A fit turns cuDNN's TF32 off even where torch's test utilities have locked plain assignment to its flags."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cpu


def test_cudnn_tf32_goes_off_and_back_after_torch_locks_the_global_flags() -> None:
    # torch.testing._internal.common_utils calls disable_global_flags() at import: a session that collects a
    # MultiProcessTestCase file runs every later fit in a process where `cudnn.allow_tf32 = False` raises.
    code = textwrap.dedent(
        """
        import torch
        from pytest_sprite.recipes.fit_kit import _cudnn_tf32_off

        for locked in (False, True):
            if locked:
                torch.backends.disable_global_flags()
            before = torch.backends.cudnn.allow_tf32
            with _cudnn_tf32_off():
                assert torch.backends.cudnn.allow_tf32 is False, locked
            assert torch.backends.cudnn.allow_tf32 == before, locked
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
