"""The lora_qwen recipe without ranks: seeded model and rows, sharding arithmetic, the single arm,
real weights through --qwen-path, artifacts, run() argument errors, and the xpu_mesh fixture."""

from __future__ import annotations

import contextlib
import json
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
import lightning.pytorch  # noqa: F401
import torch
from hypothesis import given
from hypothesis import strategies as st

from pytest_sprite import (
    ArtifactExistsError,
    LoraQwen,
    SpriteUsageError,
    assert_parity,
    faults,
    load_arm_record,
)
from pytest_sprite.planted_faults import FAULTS, Fault, Planter, PlantSite, plant
from pytest_sprite.recipes._model import build_lora_qwen, make_rows
from pytest_sprite.recipes.artifacts import ArtifactDir
from pytest_sprite.recipes.constants import TINY_QWEN2
from pytest_sprite.recipes.fit_kit import shard_batches

pytestmark = pytest.mark.cpu


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_model_is_seeded_identical_and_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    first, ident = build_lora_qwen(seed=0)
    second, ident2 = build_lora_qwen(seed=0)
    assert torch.equal(state, torch.random.get_rng_state())
    a, b = params(first), params(second)
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert ident == ident2 and ident.startswith("tiny-qwen2:")


def test_recipe_shape_matches_the_seed() -> None:
    model, _ = build_lora_qwen(seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    layers = TINY_QWEN2["num_hidden_layers"]
    # Per layer: lora_A and lora_B on q/k/v/o; plus the head's weight and bias (194 on Qwen2.5-0.5B).
    assert len(trainable) == layers * 4 * 2 + 2
    assert trainable[-2:] == ["head.weight", "head.bias"]
    # Per layer 12 frozen tensors, plus embeddings and the final norm (290 on Qwen2.5-0.5B).
    assert len(frozen) == layers * 12 + 2
    q_proj = model.backbone.base_model.model.layers[0].self_attn.q_proj
    assert q_proj.r["default"] == 8 and q_proj.scaling["default"] == 16 / 8
    assert model.head.out_features == 2 and model.head.in_features == TINY_QWEN2["hidden_size"]


def test_lora_b_is_a_seeded_normal_draw_independent_of_the_run_seed() -> None:
    seed0, seed5 = params(build_lora_qwen(seed=0)[0]), params(build_lora_qwen(seed=5)[0])
    lora_b = [n for n in seed0 if ".lora_B." in n]
    values = torch.cat([seed0[n].reshape(-1) for n in lora_b])
    assert bool((values != 0).all()), "lora_B must not start at PEFT's zeros"
    assert float(values.std()) == pytest.approx(0.01, rel=0.1)
    assert all(torch.equal(seed0[n], seed5[n]) for n in lora_b)
    assert not all(torch.equal(seed0[n], seed5[n]) for n in seed0 if ".lora_A." in n)


def test_rows_are_seeded_int64_with_binary_labels() -> None:
    rows = make_rows(seed=0, rows=64, seq_len=8, vocab_size=256)
    again = make_rows(seed=0, rows=64, seq_len=8, vocab_size=256)
    assert rows.input_ids.dtype == rows.labels.dtype == torch.int64
    assert rows.input_ids.shape == (64, 8)
    assert set(rows.labels.tolist()) == {0, 1}
    assert torch.equal(rows.input_ids, again.input_ids) and rows.digest == again.digest
    assert make_rows(seed=1, rows=64, seq_len=8, vocab_size=256).digest != rows.digest
    assert rows[3]["row"] == 3 and torch.equal(rows[3]["input_ids"], rows.input_ids[3])


@given(
    world=st.integers(1, 8),
    accumulate=st.integers(1, 3),
    per_micro=st.integers(1, 3),
    steps=st.integers(1, 4),
)
def test_every_step_trains_its_global_batch_once_across_ranks(
    world: int, accumulate: int, per_micro: int, steps: int
) -> None:
    batch = world * accumulate * per_micro
    shards = [
        shard_batches(total_rows=steps * batch, num_replicas=world, rank=r, micro_batch=per_micro)
        for r in range(world)
    ]
    for step in range(steps):
        seen = [i for s in shards for mb in s[step * accumulate : (step + 1) * accumulate] for i in mb]
        assert sorted(seen) == list(range(step * batch, (step + 1) * batch))


def test_shard_batches_refuses_a_rank_outside_the_replicas() -> None:
    with pytest.raises(SpriteUsageError, match=r"num_replicas=2, rank=2; rank must lie in 0..num_replicas-1"):
        shard_batches(total_rows=8, num_replicas=2, rank=2, micro_batch=2)


def loss_factor(fault: str | None, *, rank: int, world_size: int, accumulate: int) -> float:
    """What the planter a ddp arm gets for ``fault`` does to a loss of 1 on this rank."""
    site = PlantSite(arm="ddp", rank=rank, world_size=world_size, accumulate=accumulate)
    return float(plant(fault, site).loss(torch.tensor(1.0), site))


def test_loss_faults_scale_the_loss_as_catalogued() -> None:
    assert loss_factor(None, rank=3, world_size=4, accumulate=1) == 1.0
    assert [loss_factor("missing-rank", rank=r, world_size=4, accumulate=1) for r in range(4)] == [1, 1, 1, 0]
    assert loss_factor("wrong-scale", rank=0, world_size=4, accumulate=1) == 4.0
    assert loss_factor("accumulate-sum", rank=0, world_size=4, accumulate=2) == 2.0


class _EveryHook(Planter):
    """A planter that acts at every hook an arm calls, to prove the arm calls each at its point."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def unsynchronized(self, candidates: Sequence[str], site: PlantSite) -> tuple[str, ...]:
        self._count("unsynchronized")
        return ()

    def forward_context(self, site: PlantSite, device_type: str) -> contextlib.AbstractContextManager[Any]:
        self._count("forward_context")
        return contextlib.nullcontext()

    def loss(self, loss: torch.Tensor, site: PlantSite) -> torch.Tensor:
        self._count("loss")
        return loss

    def gradients(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], site: PlantSite) -> None:
        self._count("gradients")
        for _, p in named_parameters:
            assert p.grad is not None
            p.grad.mul_(2.0)

    def skip_step(self, step: int, steps: int, site: PlantSite) -> bool:
        self._count("skip_step")
        return True

    def after_restore(self, trainer: Any, site: PlantSite) -> None:
        self._count("after_restore")


ARM_HOOKS = frozenset(h for h in faults._HOOKS if h != "after_restore")
"""Every Planter hook an arm calls (``after_restore`` is the checkpoint resume role's)."""


@pytest.mark.parametrize(
    ("arm", "kwargs", "calls"),
    [
        # Two micro-batches per step: forward and loss per micro-batch, gradients and the step once per step.
        ("single", {"accumulate": 2}, {"forward_context": 4, "loss": 4, "gradients": 2, "skip_step": 2}),
        (
            "ref",
            {"precision": "bf16-mixed"},
            {"forward_context": 2, "loss": 2, "gradients": 2, "skip_step": 2},
        ),
        # manual optimization: one forward and loss per emulated shard (one in a world of one)
        (
            "split",
            {"precision": "bf16-mixed"},
            {"forward_context": 2, "loss": 2, "gradients": 2, "skip_step": 2},
        ),
    ],
    ids=["fp32-single", "bf16-ref", "bf16-split"],
)
def test_every_arm_calls_every_planter_hook_at_its_point(
    lora_qwen: LoraQwen,
    monkeypatch: pytest.MonkeyPatch,
    arm: str,
    kwargs: dict[str, Any],
    calls: dict[str, int],
) -> None:
    """One arm runner for both precisions: each hook fires, as often as its point comes, in every arm."""
    planter = _EveryHook()
    assert set(planter.hooks()) == set(faults._HOOKS), "the recording planter must override every hook"
    fault = Fault(name="every-hook", description="test", arms=(arm,), by=("pre_norm",), planter=planter)
    monkeypatch.setitem(FAULTS, fault.name, fault)
    planted = lora_qwen.run(arm, steps=2, fault=fault.name, **kwargs)
    # which trainables gradient sync leaves out: once, before the strategy wraps the model
    assert planter.calls == {"unsynchronized": 1, **calls}
    assert set(planter.calls) == ARM_HOOKS
    if arm == "single":  # gradients doubled before the pre-clip norm is taken
        clean = lora_qwen.run(arm, steps=2, **kwargs)
        assert planted.pre_clip_norms[0][0] == pytest.approx(2 * clean.pre_clip_norms[0][0], rel=1e-6)
        assert planted.label == "single (accumulate 2, fault every-hook)"
        first, last = planted.initial_trainable, planted.final_trainable
    else:
        first, last = planted.initial_trainable, planted.steps[-1].params
    assert all(torch.equal(first[n], last[n]) for n in first), "every update skipped"


def test_single_arm_in_a_world_of_one(lora_qwen: LoraQwen) -> None:
    ref = lora_qwen.run("single", steps=3)
    assert (ref.world_size, ref.device_type, ref.precision, ref.accumulate) == (1, "cpu", "32-true", 1)
    assert ref.rows_seen == (((0, 1),), ((2, 3),), ((4, 5),))
    clip = ref.recipe.clip
    assert all(pre > clip for (pre,) in ref.pre_clip_norms), "the clip must be active at every step"
    assert all(post == pytest.approx(clip, rel=1e-4) for (post,) in ref.post_clip_norms)
    # lora_B starts nonzero, so every trainable tensor moves, lora_A included.
    assert all(not torch.equal(ref.initial_trainable[n], ref.final_trainable[n]) for n in ref.trainable_names)
    assert ref.frozen_final == (ref.frozen_initial,)
    # Accumulation on one device matches the full batch too.
    assert_parity(ref, lora_qwen.run("single", steps=3, accumulate=2))


@pytest.mark.parametrize(
    ("arm", "kwargs", "message"),
    [
        ("dp", {}, "unknown arm 'dp'; arms: single, ddp, fsdp"),
        ("ddp", {}, "arm 'ddp' needs the ranks of a test marked @pytest.mark.ranks(n)"),
        ("single", {"steps": 0}, "steps must be a positive int, got 0"),
        ("single", {"accumulate": 1.5}, "accumulate must be a positive int, got 1.5"),
        ("single", {"clip": 0}, "clip must be a positive number, got 0"),
        (
            "single",
            {"global_batch": 3, "accumulate": 2},
            "global_batch=3 must be a positive multiple of ranks x accumulate = 1 x 2 = 2 for arm 'single'",
        ),
        ("single", {"fault": "missing_rank"}, "unknown fault 'missing_rank'; known faults: missing-rank, "),
        ("single", {"fault": "missing-rank"}, "fault 'missing-rank' applies to arms ddp, fsdp, not 'single'"),
        (
            "single",
            {"fault": "perturbed-weight"},
            "fault 'perturbed-weight' applies to arms resume, not 'single'",
        ),
        (
            "single",
            {"fault": "scale-grad"},
            "fault 'scale-grad' applies to arms ddp, not 'single'",
        ),
        (
            "ref",
            {"precision": "32-true"},
            "arm 'ref' is a BF16 arm of criterion v2 and runs precision='bf16-mixed'",
        ),
        ("ref32", {"precision": "16-mixed"}, "arm 'ref32' is criterion v2's FP32 reference"),
        ("split", {"precision": "bf16-mixed", "accumulate": 2}, "the BF16 arms take no accumulate= (got 2)"),
        (
            "ref",
            {"precision": "bf16-mixed", "fault": "missing-rank"},
            "fault 'missing-rank' applies to arms ddp, fsdp, not 'ref'",
        ),
        (
            "fsdp",
            {"precision": "bf16-mixed"},
            "arm 'fsdp' needs the ranks of a test marked @pytest.mark.ranks(n) with n >= 2",
        ),
        (
            "split_premul",
            {"precision": "bf16-mixed", "strategy": object()},
            "strategy= applies to the ddp and fsdp arms, not 'split_premul'",
        ),
        (
            "ddp",
            {"fault": "accumulate-sum"},
            "fault 'accumulate-sum' needs accumulate >= 2 (got accumulate=1)",
        ),
    ],
)
def test_run_refuses_bad_arguments_before_training(
    world: Any, arm: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpriteUsageError) as exc:
        LoraQwen(world=world).run(arm, **kwargs)
    assert message in str(exc.value)


def test_qwen_path_loads_real_weights_through_the_same_code(tmp_path: Path, world: Any) -> None:
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(123)
    saved = Qwen2Model(Qwen2Config(**{**TINY_QWEN2, "num_hidden_layers": 1, "vocab_size": 128}))
    saved.save_pretrained(tmp_path / "qwen")
    recipe = LoraQwen(world=world, qwen_path=tmp_path / "qwen")
    model = recipe.build_model()
    base = dict(model.backbone.get_base_model().named_parameters())
    for name, tensor in saved.named_parameters():
        for target in ("q_proj", "k_proj", "v_proj", "o_proj"):  # PEFT moves wrapped layers under base_layer
            name = name.replace(f".{target}.", f".{target}.base_layer.")
        assert torch.equal(base[name], tensor), name
    assert recipe.model_id.startswith(str((tmp_path / "qwen").resolve()) + ":")
    record = recipe.run("single", steps=2)
    assert record.recipe.model == recipe.model_id
    assert len(record.frozen_names) == 1 * 12 + 2
    assert max(record.rows_seen[0][0]) < 4 and int(recipe.rows(steps=2, global_batch=2).input_ids.max()) < 128


def test_qwen_path_that_is_not_a_model_is_refused(tmp_path: Path, world: Any) -> None:
    with pytest.raises(
        SpriteUsageError, match=r"is not a model directory \(no config.json\); pass a directory"
    ):
        LoraQwen(world=world, qwen_path=tmp_path).build_model()


def test_artifacts_are_written_once_and_judged_again_offline(tmp_path: Path, world: Any) -> None:
    nodeid = "tests/test_x.py::test_y[ranks2]"
    recipe = LoraQwen(world=world, artifacts=ArtifactDir.for_test(tmp_path, nodeid))
    ref = recipe.run("single", steps=2)
    acc = recipe.run("single", steps=2, accumulate=2)
    test_dir = tmp_path / "tests_test_x.py__test_y_ranks2"
    assert sorted(p.name for p in test_dir.iterdir()) == ["01-single", "02-single-acc2"]
    summary = json.loads((test_dir / "01-single" / "record.json").read_text())
    assert summary["arm"] == "single" and summary["recipe"]["steps"] == 2
    loaded = load_arm_record(test_dir / "01-single")
    assert loaded.summary() == ref.summary()
    assert assert_parity(loaded, load_arm_record(test_dir / "02-single-acc2" / "record.pt")).to_dict() == (
        assert_parity(ref, acc).to_dict()
    )
    again = LoraQwen(world=world, artifacts=ArtifactDir.for_test(tmp_path, nodeid))
    with pytest.raises(ArtifactExistsError) as exc:
        again.run("single", steps=2)
    assert str(exc.value) == (
        f"--sprite-artifacts: {test_dir / '01-single'} already exists, and an arm never overwrites a result; "
        "pass a fresh --sprite-artifacts directory or remove the old one"
    )


def test_load_arm_record_refuses_a_missing_record(tmp_path: Path) -> None:
    with pytest.raises(SpriteUsageError, match=r"no arm record at .*record.pt; pass an arm directory"):
        load_arm_record(tmp_path)


def test_fixture_reads_qwen_path_and_artifacts_options(pytester: pytest.Pytester, tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2Model

    Qwen2Model(Qwen2Config(**{**TINY_QWEN2, "num_hidden_layers": 1})).save_pretrained(tmp_path / "qwen")
    pytester.makepyfile(
        textwrap.dedent(
            f"""
            from pathlib import Path

            def test_options(lora_qwen):
                assert Path(lora_qwen.qwen_path) == Path({str(tmp_path / "qwen")!r})
                assert lora_qwen.artifacts.root == Path({str(tmp_path / "art")!r})
                assert lora_qwen.artifacts.test.endswith("_options.py__test_options")
            """
        )
    )
    args = ["-p", "no:cacheprovider"]
    flags = ["--qwen-path", str(tmp_path / "qwen"), "--sprite-artifacts", str(tmp_path / "art")]
    pytester.runpytest_inprocess(*args, *flags).assert_outcomes(passed=1)


def test_fixture_reads_qwen_path_from_the_environment(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPRITE_QWEN_PATH", "/models/qwen2.5-0.5b")
    pytester.makepyfile(
        """
        def test_env(lora_qwen):
            assert str(lora_qwen.qwen_path) == "/models/qwen2.5-0.5b"
            assert lora_qwen.artifacts is None
        """
    )
    monkeypatch.delenv("SPRITE_ARTIFACTS", raising=False)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_xpu_mesh_without_ranks_is_a_private_one_rank_mesh(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        import torch.distributed as dist

        def test_mesh(xpu_mesh):
            assert xpu_mesh.device_type == "cpu"
            assert xpu_mesh.mesh_dim_names == ("data_parallel",)
            assert xpu_mesh.size() == 1
            x = torch.ones(2)
            dist.all_reduce(x, group=xpu_mesh.get_group())
            assert x.tolist() == [1.0, 1.0]

        def test_process_group_is_gone_afterwards():
            assert not dist.is_initialized()
        """
    )
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_fixture_reads_qwen_path_and_artifacts_from_the_ini(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPRITE_QWEN_PATH", raising=False)
    monkeypatch.delenv("SPRITE_ARTIFACTS", raising=False)
    pytester.makeini("[pytest]\nqwen_path = /models/from-ini\nsprite_artifacts = /tmp/sprite-ini\n")
    pytester.makepyfile(
        """
        from pathlib import Path

        def test_ini(lora_qwen):
            assert str(lora_qwen.qwen_path) == "/models/from-ini"
            assert lora_qwen.artifacts.root == Path("/tmp/sprite-ini")
        """
    )
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_bf16_single_device_arms_record_every_step(world: Any, tmp_path: Path) -> None:
    """In a world of one the split arms hold one shard: they reproduce ref bit for bit, and ref32 is FP32."""
    from pytest_sprite import Bf16ArmRecord

    recipe = LoraQwen(world=world, artifacts=ArtifactDir.for_test(tmp_path, "t"))
    arms = {
        a: recipe.run(a, precision="bf16-mixed", steps=2) for a in ("ref32", "ref", "split", "split_premul")
    }
    sites = recipe.build_model().linear_sites()
    assert len(sites) == 2 * 15 + 1  # per layer q/k/v/o, their LoRA A and B, the MLP's three; the head
    for name, rec in arms.items():
        assert (
            isinstance(rec, Bf16ArmRecord) and rec.world_size == 1 and rec.shards == 1 and len(rec.steps) == 2
        )
        assert rec.precision == ("32-true" if name == "ref32" else "bf16-mixed") and not rec.tf32
        for step in rec.steps:
            (rank,) = step.ranks
            assert {c.site for c in rank.linear} == set(sites) and len(rank.linear) == len(sites)
            want = "torch.float32" if name == "ref32" else "torch.bfloat16"
            assert {(c.output_dtype, c.param_dtype, c.autocast) for c in rank.linear} == {
                (want, "torch.float32", name != "ref32")
            }
            assert rank.pre_clip_norm > rec.recipe.clip
            assert rank.post_clip_norm == pytest.approx(rec.recipe.clip, rel=1e-4)
            assert set(rank.grad_dtypes.values()) == {"torch.float32"} and rank.grad_nonfinite == ()
        assert arms["ref32"].steps[0].rows == ((0, 1),) and rec.steps[1].rows == ((2, 3),)
    for name in ("split", "split_premul"):  # one shard, unscaled: the same forward and backward as ref
        for mine, ref in zip(arms[name].steps, arms["ref"].steps, strict=True):
            assert all(torch.equal(mine.grads[n], ref.grads[n]) for n in ref.grads)
            assert all(torch.equal(mine.params[n], ref.params[n]) for n in ref.params)
    assert not torch.equal(
        arms["ref"].steps[0].grads["head.weight"], arms["ref32"].steps[0].grads["head.weight"]
    )
    loaded = load_arm_record(tmp_path / "t" / "03-split")
    assert isinstance(loaded, Bf16ArmRecord) and loaded.summary() == arms["split"].summary()
    grads = arms["split"].steps[1].grads
    assert all(torch.equal(loaded.steps[1].grads[n], grads[n]) for n in grads)
    assert loaded.steps[1].ranks == arms["split"].steps[1].ranks


def test_a_process_forked_after_the_spare_takes_it_and_its_maker_copies() -> None:
    """The copy kept ahead is the first model of each process forked after it, never its maker's."""
    import os

    from pytest_sprite.recipes import _model

    _model.keep_spare_lora_qwen(seed=5)
    spare = _model._SPARE[(5, None)][1]
    mine = _model.fresh_lora_qwen(seed=5)
    assert mine is not spare and (5, None) not in _model._SPARE  # the maker copies; the spare is gone here
    _model.keep_spare_lora_qwen(seed=5)
    spare = _model._SPARE[(5, None)][1]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process forked after it: its first model is the spare, its second a copy
        first, second = _model.fresh_lora_qwen(seed=5), _model.fresh_lora_qwen(seed=5)
        os.write(write, bytes([first is spare, second is not spare]))
        os._exit(0)
    os.close(write)
    got = os.read(read, 2)
    os.waitpid(pid, 0)
    assert got == bytes([1, 1])
    built, _ = build_lora_qwen(seed=5)
    for (name, a), (_, b) in zip(built.state_dict().items(), spare.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_fresh_lora_qwen_is_the_built_model_and_a_copy_each_time() -> None:
    """Sub-world roles and crash-matrix runs copy the model built once per process instead of building it."""
    from pytest_sprite.recipes._model import fresh_lora_qwen

    built, _ = build_lora_qwen(seed=3)
    state = torch.random.get_rng_state()
    first, second = fresh_lora_qwen(seed=3), fresh_lora_qwen(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG untouched, as by a build
    for (name, a), (_, b), (_, c) in zip(
        built.state_dict().items(), first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b) and torch.equal(a, c), name
    p = next(p for p in first.parameters() if p.requires_grad)
    with torch.no_grad():
        p.add_(1.0)
    assert not torch.equal(
        p, next(p for p in second.parameters() if p.requires_grad)
    )  # copies, not one model
    other = fresh_lora_qwen(seed=4)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(second.state_dict().values(), other.state_dict().values(), strict=True)
    )
