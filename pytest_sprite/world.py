"""The in-rank view of a ranks test: who am I, on which device, and how to talk to the others.

A test child builds one :class:`World` after it has initialized its device and the default process
group; a test without the ``ranks`` marker gets a world of one with no process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    import torch

__all__ = ["World"]

T = TypeVar("T")

CollectSink = Callable[[str, int, "torch.Tensor"], None]


@dataclass(frozen=True, kw_only=True, eq=False)
class World:
    """Rank, size, device and process group of the current test, with the collectives tests need.

    Users receive a World from the ``world`` fixture; they do not construct one.
    """

    rank: int
    """This process's rank in the test's world, 0 .. size-1."""
    size: int
    """Number of ranks running this test."""
    local_rank: int
    """Rank among this test's processes on this node (LOCAL_RANK); the device is the agent's own."""
    local_size: int
    """Number of ranks of this test on this node."""
    local_devices: tuple[int, ...] = field(repr=False)
    """Device indices of this test's ranks on this node, in local-rank order (``local_devices[local_rank]`` is
    this rank's). Packed tests sit on any free agents, so a ``ranks(2)`` test may compute on devices 4 and 5
    while LOCAL_RANK says 0 and 1: pass ``devices=list(world.local_devices)`` to a Lightning Trainer (not
    ``devices=world.local_size``) so its ``parallel_devices[LOCAL_RANK]`` choice lands on this test's devices
    and not on a neighbour's. ``(0, ..., local_size-1)`` when the test runs alone (``--pack=off``).
    Left out of the repr: assertion rewriting prints the world, and a failure's text must not depend on
    where the test was packed."""
    node: int
    """Node index (rank // ranks per node)."""
    device: torch.device
    """Device this rank computes on: ``xpu:<i>``, ``cuda:<i>`` or ``cpu``, where ``i`` is its agent's device
    (``local_devices[local_rank]``), not LOCAL_RANK."""
    backend: str | None
    """Backend of the default process group (``gloo``, ``nccl``, ``xccl``), None in a world of one."""
    _sink: CollectSink = field(repr=False)
    _test_dir: Callable[[], Path] | None = field(default=None, repr=False)
    """The test's ``tmp_path`` (the same directory on every rank), made when first asked for."""

    @classmethod
    def alone(
        cls,
        device: torch.device,
        *,
        sink: CollectSink | None = None,
        test_dir: Callable[[], Path] | None = None,
    ) -> World:
        """The world of one process: a test without the ranks marker, or a recipe called outside a test."""
        return cls(
            rank=0,
            size=1,
            local_rank=0,
            local_size=1,
            local_devices=(0,),
            node=0,
            device=device,
            backend=None,
            _sink=sink if sink is not None else (lambda name, rank, tensor: None),
            _test_dir=test_dir,
        )

    @property
    def distributed(self) -> bool:
        """True when a default process group spans this test's ranks."""
        return self.backend is not None

    @property
    def group(self) -> Any:
        """The default process group (``torch.distributed.group.WORLD``), None in a world of one."""
        if not self.distributed:
            return None
        import torch.distributed as dist

        return dist.group.WORLD

    def barrier(self) -> None:
        """Wait until every rank of the test reaches this point."""
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """All-gather: every rank receives every rank's tensor, in rank order.

        Tensors may differ in shape between ranks; they must share dtype.
        """
        if not self.distributed:
            return [tensor.detach().clone()]
        import torch
        import torch.distributed as dist

        shapes = self.gather_object((tuple(tensor.shape), str(tensor.dtype)))
        dtypes = {dtype for _, dtype in shapes}
        if len(dtypes) != 1:
            per_rank = ", ".join(f"rank {r}: {d}" for r, (_, d) in enumerate(shapes))
            raise ValueError(f"world.gather needs one dtype on every rank, got {per_rank}")
        local = tensor.detach().contiguous().to(self.device)
        if len({shape for shape, _ in shapes}) == 1:
            out = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(out, local)
            return out
        flat = local.reshape(-1)
        longest = max(int(torch.Size(shape).numel()) for shape, _ in shapes)
        padded = torch.zeros(longest, dtype=local.dtype, device=self.device)
        padded[: flat.numel()] = flat
        out = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(out, padded)
        return [o[: torch.Size(s).numel()].reshape(s) for o, (s, _) in zip(out, shapes, strict=True)]

    def gather_object(self, obj: T) -> list[T]:
        """All-gather of a picklable object: every rank receives the list, in rank order.

        Plain CPU tensors inside ``obj`` travel as their bytes (a view arrives as a contiguous tensor of its
        own), the rest as pickle sends it: torch's own pickle writes and reads each tensor's storage through
        a nested ``torch.save``/``torch.load``, which made every rank of a 24-rank test spend seconds reading
        the others' records.
        """
        if not self.distributed:
            return [obj]
        import pickle

        import torch.distributed as dist

        from .plumbing import tensor_pickle

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, tensor_pickle.dumps(obj))
        return [pickle.loads(data) for data in out]

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank (its tensors travel as :meth:`gather_object` says)."""
        self._check_rank(src, "src")
        if not self.distributed:
            return obj
        import pickle

        import torch.distributed as dist

        from .plumbing import tensor_pickle

        box: list[Any] = [tensor_pickle.dumps(obj) if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        value: T = obj if self.rank == src else pickle.loads(box[0])
        return value

    def run_on_rank(self, rank: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on one rank only while the others wait; every rank gets its return value.

        An exception on that rank is re-raised on every rank, so no rank is left in a collective.
        """
        self._check_rank(rank, "rank")
        result: Any = None
        error: BaseException | None = None
        if self.rank == rank:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                error = exc
        ok, payload = self.broadcast_object(
            (error is None, result if error is None else f"{type(error).__name__}: {error}"), src=rank
        )
        if error is not None:
            raise error
        if not ok:
            raise RuntimeError(
                f"run_on_rank({rank}, {getattr(fn, '__name__', fn)!r}) failed there: {payload}"
            )
        return cast(T, payload)

    def collect(self, name: str, tensor: torch.Tensor) -> None:
        """Send this rank's ``tensor`` under ``name`` to the controller, kept with the test's result.

        Read it back after the test with :func:`pytest_sprite.collected` (for reports and for
        assertions that run after the ranks have ended).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"world.collect needs a non-empty str name, got {name!r}")
        self._sink(name, self.rank, tensor.detach().cpu().clone())

    def rank_path(self, *parts: str) -> Path:
        """A path in this rank's own directory of the test: ``tmp_path / f"rank{rank}" / *parts``.

        ``tmp_path`` is one directory shared by every rank of the test (a checkpoint rank 0 writes is
        there for rank 1 to read); this is for files only one rank writes, such as its shard or its
        log. The rank's directory is created, the path itself is not.
        """
        if self._test_dir is None:
            raise RuntimeError("world.rank_path needs the test's tmp_path, which this world was not given")
        for part in parts:
            if not isinstance(part, str) or not part or part in (".", "..") or "/" in part or "\\" in part:
                raise ValueError(
                    f"world.rank_path takes plain names (no separators, '.' or '..'), got {part!r}"
                )
        directory = self._test_dir() / f"rank{self.rank}"
        directory.mkdir(exist_ok=True)
        return directory.joinpath(*parts)

    def _check_rank(self, rank: int, what: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(
                f"{what}={rank!r} is outside this world of {self.size} (valid: 0..{self.size - 1})"
            )


_CURRENT: World | None = None


def _set_current(world: World | None) -> None:
    """Called by the test child once its process group is up."""
    global _CURRENT
    _CURRENT = world


def current_world() -> World | None:
    """The World of the ranks test running in this process, None outside a test child."""
    return _CURRENT
