"""``DeviceInit``: a meta-built model's initial values computed on each rank's device, for its
shard only, equal for every sharding layout (``meshplan run --init device``).

``InitTape.replay`` (``--init host-exact``) gives every tensor the host build's values, but only by
running the whole construction on the CPU on every rank: O(whole model) per rank, minutes at 70B.
This module runs the same recorded ops (the constructor's own init: ``reset_parameters``, the
model's ``_init_weights``, a factory's scaled init...) on the rank's device, restricted to the box
of each tensor the rank holds (a DTensor shard's rows/columns, an expert slice, a pipeline stage's
whole tensors), so its cost follows the shard.

Random ops cannot draw from one stream and stay layout-free: torch's DTensor RNG
(``torch.distributed.tensor._random.OffsetBasedRNGTracker``, what torchtitan's device init runs
under) gives each shard an offset into one Philox stream, which does not make a shard equal the
slice of a whole-tensor draw (pytorch/pytorch#168058, open: Shard(0) != Shard(1) != 1 GPU;
torchtitan keeps a "seed checkpoint" for that), and it refuses CPU meshes. Here each random op is
drawn per tile instead: a tensor's index space is cut into tiles whose shape depends on the
tensor's global shape only (``tile_shape``), and tile ``i`` of the op recorded at position ``p`` of
the tape is drawn with a generator seeded from (the build's random state, ``p``, ``i``). A rank
draws only the tiles its box touches and keeps their intersection with it, so a value depends on
(seed, op, element) alone: dp2 FSDP2, tp2 and one rank give the same tensors bit for bit on one
device type. They are not the CPU host build's values (another stream), and a CUDA draw differs
from a CPU one; a whole-tensor op the construction runs before a full overwrite is skipped (its
values are never read).

What cannot be cut into boxes (an op that reads another shape, broadcasts, or is not elementwise:
rotary tables from ``arange``/``outer``, ``orthogonal_``'s QR, a weight copied from another) is
"fallback": computed whole by ``InitTape.replay(only_needed=True)`` on the CPU, the same on every
rank (layout-free too), and cut to the shard as before. Buffers are usually that, and small.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from meshplan.models.init_tape import InitTape, Ref, TapeOp

Box = list[tuple[int, int]]  # [lo, hi) per dimension of a tensor's global shape

_TILE = 65536  # elements per random tile (at most); a matrix's last dimension's tile at most 1024 wide
_LAST = 1024
_RANDOM_INPLACE = {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "log_normal_", "cauchy_",
                   "geometric_"}  # fmt: skip
_RANDOM_FACTORY = {"randn", "rand", "randint", "normal"}
_FACTORY = {"empty", "empty_strided", "zeros", "ones", "full"} | _RANDOM_FACTORY
_ELEMENTWISE = {"fill_", "zero_", "copy_", "_to_copy", "clone", "fill"}


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The random tiles of a tensor of global ``shape``: a matrix's last dimension cut at most 1024
    wide, the dimensions before it as many as fit in 65536 elements (64 rows of a 1024+ wide
    matrix, a whole small conv kernel; a vector in runs of 65536). A function of the shape alone, so
    every layout cuts alike; narrow enough for FSDP2's row shards and TP's column shards of large
    matrices to draw little outside their box, large enough that the per-tile cost (a generator
    seeded, a kernel launched: ~20-60 us measured on a CPU) stays seconds at 70B."""
    out: list[int] = []
    budget = _TILE
    for i, d in enumerate(reversed(shape)):
        t = min(d, _LAST) if i == 0 and len(shape) > 1 else min(d, max(1, budget))
        out.append(max(t, 1))
        budget //= max(t, 1)
    return tuple(reversed(out))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def _seed(base: int, op_index: int, tile: int) -> int:
    h = hashlib.blake2b(f"{base}:{op_index}:{tile}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class DeviceInit:
    """The tape's finals split into those computed per box on a device (``local``) and those
    computed whole (``fallback``); see the module docstring."""

    def __init__(self, tape: InitTape, finals: dict[str, Ref], seed: int | None = None) -> None:
        self.tape, self.finals = tape, finals
        state = tape.rng_state if tape.rng_state is not None else torch.zeros(1, dtype=torch.uint8)
        self.seed = seed if seed is not None else int.from_bytes(
            hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest(), "little")
        self._plans: dict[int, list[int] | None] = {}
        self.local: set[str] = set()
        self.fallback: set[str] = set()
        for fqn, r in finals.items():
            (self.local if self._plan(r) is not None else self.fallback).add(fqn)

    # -- analysis ------------------------------------------------------------------------------
    def _plan(self, final: Ref) -> list[int] | None:
        """Indices of the ops that make ``final`` (its last overwrite on), if every one can run on a
        box of its shape; None if not (fallback)."""
        if final.key in self._plans:
            return self._plans[final.key]
        plan: list[int] | None = None
        shape = final.size
        if (final.covers(self.tape.nbytes[final.key]) and final.stride == _contiguous_strides(shape)
                and not self.tape.broken):
            want, keep = {final.key}, []
            for i in range(len(self.tape.ops) - 1, -1, -1):
                op = self.tape.ops[i]
                if not (op.writes & want):
                    continue
                keep.append(i)
                want = (want - (op.full - op.reads)) | op.reads
            if not want and all(self._boxable(self.tape.ops[i], shape) for i in keep):
                plan = keep[::-1]
        self._plans[final.key] = plan
        return plan

    def _whole(self, r: Ref, shape: tuple[int, ...]) -> bool:
        return (r.size == shape and r.offset == 0 and r.stride == _contiguous_strides(shape)
                and r.covers(self.tape.nbytes[r.key]))

    def _boxable(self, op: TapeOp, shape: tuple[int, ...]) -> bool:
        if not isinstance(op.func, torch._ops.OpOverload):
            return False
        name = op.func._schema.name.split("::")[-1]
        refs = [a for a in tree_flatten(op.args)[0] if isinstance(a, Ref)]
        consts = [a for a in tree_flatten(op.args)[0] if isinstance(a, torch.Tensor)]
        if any(c.numel() != 1 for c in consts):
            return False
        outs = [r for _, r in op.outs]
        if name in _FACTORY:
            i = _size_arg(op) if not refs and len(outs) == 1 and self._whole(outs[0], shape) else None
            if i is None:
                return False
            numbers = sum(isinstance(a, int | float) for a in op.args[0][:i])
            return {"normal": numbers == 2, "randint": numbers in (1, 2)}.get(name, numbers == 0)
        if name in _RANDOM_INPLACE:
            return len(refs) == 1 and self._whole(refs[0], shape) and not outs
        pointwise = torch.Tag.pointwise in op.func.tags or name in _ELEMENTWISE
        if not pointwise:
            return False
        if all(self._whole(r, shape) for r in refs + outs):
            return True
        # an in-place op with scalar arguments on a part of the tensor (a padding row zeroed)
        return (len(refs) == 1 and not outs and torch.Tag.inplace in op.func.tags
                and _view_box(refs[0], shape) is not None)

    # -- execution -----------------------------------------------------------------------------
    def compute(self, fqn: str, box: Box, device: torch.device) -> torch.Tensor:
        """``fqn``'s values on ``box`` of its global shape, on ``device`` (``fqn`` in ``local``)."""
        final = self.finals[fqn]
        plan = self._plan(final)
        assert plan is not None, fqn
        shape = final.size
        bshape = tuple(hi - lo for lo, hi in box)
        env: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for i in plan:
                self._run(i, self.tape.ops[i], shape, box, bshape, env, device)
        return env[final.key]

    def compute_fallback(self, sink: Callable[[str, torch.Tensor], None], only: set[str] | None = None) -> int:
        """The whole values (on the CPU) of the fallback finals, or of the finals ``only``, from the
        CPU replay of what they depend on; ``sink(fqn, full)``; returns the replay's peak bytes."""
        want = {f: self.finals[f] for f in (self.fallback if only is None else only)}
        if not want:
            return 0
        return self.tape.replay(want, sink, only_needed=True)

    def _run(self, index: int, op: TapeOp, shape: tuple[int, ...], box: Box, bshape: tuple[int, ...],
             env: dict[int, torch.Tensor], device: torch.device) -> None:
        name = op.func._schema.name.split("::")[-1]
        args, kwargs = op.args
        if name in _FACTORY:
            key = op.outs[0][1].key
            if name in _RANDOM_FACTORY:
                dtype = op.outs[0][1].dtype  # what the factory made (randint: int64 by default)
                env[key] = self._tiles(index, shape, box, bshape, device, dtype,
                                       lambda t, g: _draw_factory(op, name, t, g))
            else:
                args2, kwargs2 = _with_size(op, bshape, device), _on(kwargs, device)
                if name == "empty_strided":
                    args2[1] = list(_contiguous_strides(bshape))
                env[key] = op.func(*args2, **kwargs2)
            return
        refs = [a for a in tree_flatten(args)[0] if isinstance(a, Ref)]
        if name in _RANDOM_INPLACE:
            r = refs[0]
            scalars = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args[1:]]
            env[r.key] = self._tiles(index, shape, box, bshape, device, r.dtype,
                                     lambda t, g: op.func(t, *scalars, **{**kwargs, "generator": g}))
            return
        if len(refs) == 1 and not op.outs and not self._whole(refs[0], shape):  # a part of the tensor
            vbox = _view_box(refs[0], shape)
            assert vbox is not None
            inter = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(vbox, box)]
            if any(a >= b for a, b in inter):
                return
            t = env[refs[0].key][tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, box))]
            rest = tree_map(lambda a: a.to(device) if isinstance(a, torch.Tensor) else a, (args[1:], kwargs))
            op.func(t, *rest[0], **rest[1])
            return

        def fetch(a: Any) -> Any:
            if isinstance(a, Ref):
                if a.key not in env:  # overwritten whole without being read (checked by _plan)
                    env[a.key] = torch.empty(bshape, dtype=a.dtype, device=device)
                return env[a.key]
            if isinstance(a, torch.Tensor):
                return a.to(device)
            if isinstance(a, torch.device) and a.type == "meta":
                return device
            return a

        a2, k2 = tree_map(fetch, (args, kwargs))
        out = op.func(*a2, **k2)
        flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for j, r in op.outs:
            env[r.key] = flat[j]

    def _tiles(self, index: int, shape: tuple[int, ...], box: Box, bshape: tuple[int, ...],
               device: torch.device, dtype: torch.dtype,
               draw: Callable[[torch.Tensor, torch.Generator], Any]) -> torch.Tensor:
        """The box of a random op's result, drawn tile by tile (see the module docstring)."""
        out = torch.empty(bshape, dtype=dtype, device=device)
        tshape = tile_shape(shape)
        grid = [-(-s // t) for s, t in zip(shape, tshape)]
        ranges = [range(lo // t, -(-hi // t)) if hi > lo else range(0) for (lo, hi), t in zip(box, tshape)]
        gen = torch.Generator(device=device)
        for idx in itertools.product(*ranges):
            linear = 0
            for i, g in zip(idx, grid):
                linear = linear * g + i
            tb = [(i * t, min((i + 1) * t, s)) for i, t, s in zip(idx, tshape, shape)]
            gen.manual_seed(_seed(self.seed, index, linear))
            inter = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(tb, box)]
            dest = out[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, box))]
            if inter == tb and dest.is_contiguous():  # the whole tile, a dense run of the box: drawn in place
                draw(dest, gen)
                continue
            tile = torch.empty(tuple(b - a for a, b in tb), dtype=dtype, device=device)
            draw(tile, gen)
            dest.copy_(tile[tuple(slice(a - ta, b - ta) for (a, b), (ta, _) in zip(inter, tb))])
        return out


def _draw_factory(op: TapeOp, name: str, t: torch.Tensor, g: torch.Generator) -> None:
    """A random factory's draw into the tile ``t`` by its in-place twin (the factories' overloads
    without a generator cannot take one)."""
    args, i = op.args[0], _size_arg(op)
    before = [a for a in args[:i] if isinstance(a, int | float)]
    if name == "randn":
        t.normal_(0.0, 1.0, generator=g)
    elif name == "rand":
        t.uniform_(0.0, 1.0, generator=g)
    elif name == "randint":  # randint(high, size) / randint.low(low, high, size)
        low, high = (0, before[0]) if len(before) == 1 else before[:2]
        t.random_(low, high, generator=g)
    else:  # normal.float_float(mean, std, size)
        t.normal_(before[0], before[1], generator=g)


def _size_arg(op: TapeOp) -> int | None:
    """Position of a factory's size argument (``randint(high, size)`` has it second)."""
    args = op.args[0]
    want = list(op.outs[0][1].size) if op.outs else None
    for i, a in enumerate(args):
        if isinstance(a, list | tuple) and list(a) == want and all(isinstance(x, int) for x in a):
            return i
    return None


def _with_size(op: TapeOp, size: tuple[int, ...], device: torch.device) -> list[Any]:
    args = list(op.args[0])
    i = _size_arg(op)
    assert i is not None
    args[i] = list(size)
    return [device if isinstance(a, torch.device) and a.type == "meta" else a for a in args]


def _on(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (device if isinstance(v, torch.device) and v.type == "meta" else v) for k, v in kwargs.items()}


def _view_box(r: Ref, shape: tuple[int, ...]) -> Box | None:
    """The box of the global tensor (contiguous, ``shape``) that the view ``r`` is, if it is one
    (each view dimension a run of one base dimension: ``weight[i]``, ``weight[:, a:b]``)."""
    base = _contiguous_strides(shape)
    start, rem = [], r.offset
    for s in base:
        start.append(rem // s)
        rem %= s
    box = [(c, c + 1) for c in start]
    used: set[int] = set()
    for size, stride in zip(r.size, r.stride):
        if size == 1:
            continue
        dims = [d for d, s in enumerate(base) if s == stride and shape[d] > 1 and d not in used]
        if not dims:
            return None
        d = dims[0]
        used.add(d)
        box[d] = (start[d], start[d] + size)
    if any(hi > s for (_, hi), s in zip(box, shape)):
        return None
    return box
