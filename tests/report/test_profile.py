"""``--sprite-profile``: each ranks test's time by phase, in the terminal and the JSON report, for a user's own
Lightning fit (in the test and in a sub-world) and for the shipped recipe's parity arms."""

from __future__ import annotations

import json

import pytest
from sprite_testing import run_pytest

from pytest_sprite.report.json_report import load_schema

pytestmark = pytest.mark.cpu

TESTS = """
    import lightning.pytorch as pl
    import pytest
    import torch

    from pytest_sprite import assert_parity, run_subworld


    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    def fit(world, root):
        rows = torch.utils.data.TensorDataset(torch.randn(64, 4))
        pl.Trainer(
            accelerator="cpu", devices=world.size, strategy="ddp", max_steps=6, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root,
        ).fit(Net(), torch.utils.data.DataLoader(rows, batch_size=4))


    @pytest.mark.ranks(2)
    def test_own_fit(world, tmp_path):
        fit(world, tmp_path)


    @pytest.mark.ranks(2)
    def test_subworld_fit(world, tmp_path):
        run_subworld(fit, args=(str(tmp_path),)).values()


    @pytest.mark.ranks(2)
    def test_parity(lora_qwen):
        assert_parity(lora_qwen.run("single"), lora_qwen.run("ddp"))


    @pytest.mark.ranks(2)
    def test_no_fit(world, record_property):
        record_property("owner", "training team")


    @pytest.mark.ranks(2)
    def test_odd_property(world, request):
        request.node.user_properties.append("not a pair")  # the store reads past it


    def test_plain():
        pass
"""


def test_the_report_and_the_terminal_split_each_ranks_test_into_its_phases(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jsonschema

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("COLUMNS", "200")
    pytester.makepyfile(test_profiled=TESTS)
    result = run_pytest(
        pytester,
        "--sprite-profile",
        "--sprite-report=report.json",
        "--ranks=2",
        "--junitxml=junit.xml",
        "-k",
        "not test_odd_property",
        timeout=600,
    )
    result.assert_outcomes(passed=5)
    document = json.loads((pytester.path / "report.json").read_text())
    jsonschema.validate(document, load_schema())
    tests = {t["nodeid"].split("::")[-1]: t for t in document["tests"]}
    own, subworld, parity = (
        tests[n]["profile"] for n in ("test_own_fit", "test_subworld_fit", "test_parity")
    )
    for profile in (own, subworld, parity):
        assert profile["steps"] > 0 and profile["fit setup"] > 0
    assert "fork" not in own and subworld["fork"] > 0 and subworld["join"] > 0
    assert parity["trainer"] > 0 and parity["probe"] > 0 and parity["records"] > 0 and parity["judging"] > 0
    for name in ("test_own_fit", "test_subworld_fit", "test_parity", "test_no_fit"):
        test = tests[name]
        assert sum(test["profile"].values()) == pytest.approx(test["duration"], abs=0.01)
    assert set(tests["test_no_fit"]["profile"]) == {"rest"}
    assert "profile" not in tests["test_plain"]  # not a ranks test: nothing measured it
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="owner" value="training team"' in junit and "sprite.profile" not in junit
    result.stdout.fnmatch_lines(
        [
            "*= sprite profile: seconds by phase (rank 0) =*",
            "test *wall s*fork*join*sub-world other*trainer*fit setup*steps*teardown*probe*records*judging*rest*"
            "outside steps",
            "test_profiled.py::test_own_fit *%",
            "all profiled tests *%",
            "sprite: profile: 4 ranks tests, * s; the fits' steps * s, outside them *% of the wall time",
            "sprite: profile: the session * s of wall time (its start, collection and agents are in no test); "
            "the fits' steps * s, outside them *%",
        ]
    )


def test_without_the_option_nothing_is_measured(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    pytester.makepyfile(test_profiled=TESTS)
    result = run_pytest(
        pytester,
        "--sprite-report=report.json",
        "--ranks=2",
        "-k",
        "own_fit or subworld or test_odd_property",
        timeout=600,
    )
    result.assert_outcomes(passed=3)
    assert "sprite profile" not in result.stdout.str()
    tests = json.loads((pytester.path / "report.json").read_text())["tests"]
    assert all("profile" not in t for t in tests)
