"""``Recipe`` without ranks (issue 15): what a recipe is refused for, and the single arm in a plain test."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("lightning")
import lightning.pytorch  # noqa: F401
import torch
from own_models import MLP, FrozenMLP, mlp_loss, mlp_rows

import pytest_sprite
from pytest_sprite import LoraQwen, Recipe, SpriteUsageError, assert_parity
from pytest_sprite.recipes.recipe import default_shard, linear_sites

pytestmark = pytest.mark.cpu


def test_recipe_is_public_frozen_and_keyword_only() -> None:
    assert "Recipe" in pytest_sprite.__all__ and pytest_sprite.Recipe is Recipe
    with pytest.raises(TypeError):
        Recipe("mlp", FrozenMLP, mlp_rows, mlp_loss)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        MLP.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "name must be a non-empty str, got '' (str)"),
        (
            {"model": FrozenMLP()},
            "model must be a callable that builds an nn.Module (e.g. the module's class), got a built FrozenMLP "
            "instance; pass its class (model=FrozenMLP) or a function that builds one",
        ),
        ({"rows": [1, 2]}, "rows must be a callable rows(n) returning n rows, got [1, 2] (list)"),
        (
            {"loss": None},
            "loss must be a callable loss(model, batch) returning a scalar tensor, got None (NoneType)",
        ),
        ({"shard": "auto"}, "shard must be a callable shard(model, mesh) or None, got 'auto' (str)"),
        (
            {"linear_sites": "head"},
            "linear_sites must be a sequence of module names (e.g. ('fc1', 'head')) or None, got 'head' (str)",
        ),
        ({"backbone": ""}, "backbone must be a non-empty name or None, got '' (str)"),
        ({"seed": -1}, "seed must be a non-negative int, got -1 (int)"),
        ({"lr": 0}, "lr must be a positive number, got 0 (int)"),
    ],
)
def test_a_bad_recipe_is_refused_when_built_saying_what_was_given(
    kwargs: dict[str, Any], message: str
) -> None:
    fields: dict[str, Any] = {"name": "mlp", "model": FrozenMLP, "rows": mlp_rows, "loss": mlp_loss, **kwargs}
    with pytest.raises(SpriteUsageError) as exc:
        Recipe(**fields)
    assert str(exc.value).startswith("Recipe(...): ")
    assert message in str(exc.value)


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(SpriteUsageError) as exc:
        Recipe(name="x", model=1, rows=2, loss=3)  # type: ignore[arg-type]
    assert [p.split(" must")[0] for p in str(exc.value).removeprefix("Recipe(...): ").split("; ")] == [
        "model",
        "rows",
        "loss",
    ]


def _global_rng_rows(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows from the global RNG: a second call differs, so different arms would train different data."""
    xs, ys = torch.randn(n, 6), torch.randint(0, 3, (n,))
    return [(xs[i], ys[i]) for i in range(n)]


def test_rows_that_differ_on_a_second_call_are_refused() -> None:
    recipe = Recipe(name="unseeded", model=FrozenMLP, rows=_global_rng_rows, loss=mlp_loss)
    state = torch.random.get_rng_state()
    with pytest.raises(SpriteUsageError) as exc:
        recipe.run("single")
    assert re.fullmatch(
        r"recipe 'unseeded': rows\(10\) is not deterministic: a second call returned different rows "
        r"\(digest [0-9a-f]{12} then [0-9a-f]{12}\)\. Every arm and rank must train the same rows: draw them "
        r"from a seeded torch\.Generator \(torch\.Generator\(\)\.manual_seed\(7\)\), not from the global RNG",
        str(exc.value),
    )
    # Checking the rows left the test's own randomness where it was.
    assert torch.equal(torch.random.get_rng_state(), state)


def _short_rows(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return mlp_rows(n)[:-1]


def _per_row_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="none")


def _detached_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return mlp_loss(model, batch).detach()


def _not_a_module() -> Any:
    return lambda x: x


class _AllFrozen(FrozenMLP):
    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rows": _short_rows}, "recipe 'r': rows(10) returned 9 rows, not 10"),
        (
            {"loss": _per_row_loss},
            "recipe 'r': loss(model, batch) returned a tensor of shape (2,) and dtype torch.float32 for a batch "
            "of 2 rows; it must return a scalar floating-point tensor, the mean over the batch's rows",
        ),
        (
            {"loss": _detached_loss},
            "recipe 'r': loss(model, batch) returned a tensor that does not require grad",
        ),
        ({"model": _not_a_module}, "recipe 'r': model() must return a torch.nn.Module, got <function "),
        ({"model": _AllFrozen}, "recipe 'r': model() built a _AllFrozen without a trainable parameter"),
    ],
)
def test_a_recipe_that_breaks_its_contract_is_refused_when_it_runs(
    fields: dict[str, Any], message: str
) -> None:
    recipe = Recipe(**{"name": "r", "model": FrozenMLP, "rows": mlp_rows, "loss": mlp_loss, **fields})
    with pytest.raises(SpriteUsageError) as exc:
        recipe.run("single")
    assert message in str(exc.value)


def test_the_single_arm_runs_in_a_plain_test_without_the_world_fixture() -> None:
    ref = MLP.run("single", steps=3)
    assert (ref.world_size, ref.device_type, ref.recipe.global_batch) == (1, "cpu", 2)
    assert ref.rows_seen == (((0, 1),), ((2, 3),), ((4, 5),))
    assert ref.frozen_final == (ref.frozen_initial,)
    assert all(not torch.equal(ref.initial_trainable[n], ref.final_trainable[n]) for n in ref.trainable_names)
    # The same recipe built twice gives the same arm, bit for bit.
    again = MLP.run("single", steps=3)
    assert all(torch.equal(ref.final_trainable[n], again.final_trainable[n]) for n in ref.trainable_names)
    assert_parity(ref, MLP.run("single", steps=3, accumulate=2))


def test_distributed_arms_need_ranks() -> None:
    with pytest.raises(SpriteUsageError, match=r"arm 'fsdp' needs the ranks of a test marked"):
        MLP.run("fsdp")


def test_lora_qwen_is_one_recipe(world: Any) -> None:
    lora = LoraQwen(world=world)
    recipe = lora.recipe
    assert isinstance(recipe, Recipe) and recipe.name == "lora_qwen" and recipe.backbone == "backbone"
    model = recipe.model()
    sites = linear_sites(recipe, model)
    assert sites["head"] == "head"
    assert {k for k in sites.values()} == {"backbone", "lora_A", "lora_B", "head"}
    assert sites["backbone.base_model.model.layers.0.self_attn.q_proj.lora_A.default"] == "lora_A"
    batch = torch.utils.data.default_collate(list(recipe.rows(4)))
    assert batch["input_ids"].shape == (4, lora.seq_len) and batch["labels"].dtype == torch.int64


def test_default_linear_sites_are_every_linear_and_named_ones_must_exist() -> None:
    assert linear_sites(MLP, FrozenMLP()) == {"embed": "linear", "body.0": "linear", "head": "linear"}
    named = Recipe(name="m", model=FrozenMLP, rows=mlp_rows, loss=mlp_loss, linear_sites=("head", "fc9"))
    with pytest.raises(
        SpriteUsageError, match=r"linear_sites names modules its model lacks: fc9; its Linear"
    ):
        linear_sites(named, FrozenMLP())


def test_default_shard_is_a_callable_for_shard() -> None:
    recipe = Recipe(name="m", model=FrozenMLP, rows=mlp_rows, loss=mlp_loss, shard=default_shard)
    assert recipe.shard is default_shard


def test_the_resume_check_refuses_a_recipe_that_does_not_pickle() -> None:
    recipe = Recipe(name="lambdas", model=lambda: FrozenMLP(), rows=mlp_rows, loss=mlp_loss)
    with pytest.raises(SpriteUsageError) as exc:
        recipe.resume_roles(strategy="single")
    assert str(exc.value).startswith(
        "recipe 'lambdas': the resume check runs its roles in fresh processes, so the recipe must pickle, and it "
        "does not (AttributeError: Can't pickle local object "
    )
    assert str(exc.value).endswith(
        "define model, rows and loss as top-level functions or classes of a module, not lambdas or nested functions"
    )


@pytest.mark.slow  # several Lightning fits per crash point; the chaos tests cover the path in CI
def test_own_model_is_crash_consistent(tmp_path: Any) -> None:
    """The crash matrix on the recipe's own model: killed at file events of its saves, resumed, judged."""
    from pytest_sprite.save_crashes import assert_crash_consistent  # the keyword form

    matrix = assert_crash_consistent(MLP, strategy="single", out_dir=tmp_path / "chaos", max_points=3)
    assert matrix.target == "mlp single"
    assert matrix.rows and all(r.verdict in ("PASS", "LOST_WORK") for r in matrix.rows)
