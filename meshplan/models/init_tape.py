"""``InitTape``: build a model on the meta device, then give each of its tensors the values the
host-built model would have had, one tensor at a time.

``load_model(spec, device="meta", tape=tape)`` builds under ``tape.recording()``: a
``TorchDispatchMode`` that writes down every aten op that creates or changes a meta tensor (the
empty allocations, ``normal_``/``uniform_``/``fill_`` of ``reset_parameters`` or of a model's own
init, the arithmetic that makes rotary tables and masks), in construction order, with the CPU
random state at the start. View ops are not recorded: a tensor is known by its storage and its
(offset, size, stride) on it.

``tape.replay(sink)`` runs the recorded ops on CPU from that random state, so every random op draws
exactly the numbers it drew when the model was built on the host. Values nobody reads again are
dropped at once: an op that overwrites a whole tensor without reading it (``normal_``, ``fill_``,
``empty``...) ends the life of what was there, so a weight initialised twice (a module's
``reset_parameters``, then the model's own init) is allocated twice, briefly, and never kept
between. When a parameter's or buffer's storage has seen its last op, ``sink(fqn, value)`` gets the
full tensor (the caller keeps its shard) and the storage is freed. Host peak: the largest tensor
alive at once (one weight and its temporaries), never the whole model.

A seed the constructor (or the builder function around it) sets itself, ``torch.manual_seed`` /
``torch.set_rng_state`` / ``torch.seed``, is recorded too, at its place among the ops: replay sets
the same CPU random state there, so the draws after it are the host build's whatever the process's
random state was when the build began (a builder that seeds 0 built twice in one process gets the
same weights twice).

What replay cannot reproduce is refused (``TapeError``) rather than guessed: an op that reads a meta
tensor made outside the recording, a seed set by other means (the initial seed changed with no
seeding call recorded), a parameter or buffer no recorded op produced.

Hugging Face models skip their weight init when built on the meta device
(``PreTrainedModel.init_weights`` asks ``get_torch_context_manager_or_global_device``); while
recording, that check answers "not meta", so their init runs, and is recorded, where and in the
order it runs on the host.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# ops that write every element of their (first) argument without reading it
_OVERWRITES = {
    "normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_", "log_normal_",
    "cauchy_", "geometric_", "copy_",
}  # fmt: skip


class TapeError(RuntimeError):
    """The construction cannot be replayed exactly (see the module docstring)."""


@dataclass(frozen=True)
class Ref:
    """A meta tensor as a view of a storage: what replay rebuilds on the CPU copy of that storage."""

    key: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def covers(self, nbytes: int) -> bool:
        n = 1
        for d in self.size:
            n *= d
        return self.offset == 0 and n * self.dtype.itemsize == nbytes and _dense(self.size, self.stride)


def _dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expect = 1
    for d, s in sorted(zip(size, stride), key=lambda x: x[1]):
        if d != 1 and s != expect:
            return False
        expect *= d
    return True


@dataclass
class TapeOp:
    """One recorded aten op (or a seeding call): what it reads, writes and overwrites whole, by storage."""

    func: Any
    args: Any  # (args, kwargs) with meta tensors as Ref
    outs: list[tuple[int, Ref]]  # (position among the op's tensor outputs, Ref) of new storages
    reads: set[int]  # storages whose value the op reads
    writes: set[int]  # storages it writes (outputs included)
    full: set[int]  # storages it overwrites whole, without reading them


@dataclass
class InitTape:
    """One model construction's aten ops on meta tensors, and the CPU random state it began with."""

    ops: list[TapeOp] = field(default_factory=list)
    rng_state: torch.Tensor | None = None
    nbytes: dict[int, int] = field(default_factory=dict)
    broken: str = ""
    _keep: list[torch.Tensor] = field(default_factory=list)  # keeps recorded storages (their keys) alive

    @contextmanager
    def recording(self, resume: bool = False) -> Iterator[None]:
        """Record the construction that runs inside (under ``torch.device("meta")``); ``resume``
        appends to what an earlier recording wrote (the random state stays the first one's)."""
        if not resume:
            self.rng_state = torch.get_rng_state()
        seed = torch.initial_seed()
        seeded: list[bool] = []
        with _hf_init_on_meta(), _recording_seeds(self, seeded), _Recorder(self):
            yield
        if torch.initial_seed() != seed and not seeded:
            self.broken = self.broken or "the constructor sets the random seed by a call the tape does not record"

    def ref(self, t: torch.Tensor) -> Ref:
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.nbytes:
            self.nbytes[key] = st.nbytes()
            self._keep.append(t)
        return Ref(key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def refs_of(self, named: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Ref]:
        """FQN -> Ref of a model's parameters/buffers (``named_parameters(remove_duplicate=False)``...)."""
        return {n: self.ref(t) for n, t in named if t.is_meta}

    def replay(self, finals: dict[str, Ref], sink: Callable[[str, torch.Tensor], None], *,
               only_needed: bool = False) -> int:
        """Run the tape on CPU; ``sink(fqn, full_value)`` once per entry of ``finals`` (see the
        docstring). Returns the most bytes of tape values alive at once (the replay's own peak).
        ``only_needed``: run only the ops ``finals`` depend on (e.g. the buffers, when pretrained
        weights fill the parameters); the random stream then does not follow the host build's."""
        if self.broken:
            raise TapeError(self.broken)
        by_key: dict[int, list[str]] = {}
        for fqn, r in finals.items():
            by_key.setdefault(r.key, []).append(fqn)
        ops = self.ops
        if only_needed:
            want, keep = set(by_key), []
            for op in reversed(ops):
                if op.writes & want:
                    keep.append(op)
                    want |= op.reads
            ops = keep[::-1]
        touches: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            for k in op.reads | op.writes:
                touches.setdefault(k, []).append(i)
        missing = sorted(f for k, fs in by_key.items() if k not in touches for f in fs)
        if missing:
            raise TapeError(f"no recorded op made {missing[:4]} (a tensor made outside the constructor?)")
        dead_after: dict[int, list[int]] = {}  # op index -> storages no later op reads
        for k, idx in touches.items():
            for a, b in zip(idx, idx[1:] + [None]):
                if b is None or (k in ops[b].full and k not in ops[b].reads):
                    dead_after.setdefault(a, []).append(k)
        live: dict[int, torch.UntypedStorage] = {}
        peak = 0
        saved = torch.get_rng_state()
        torch.set_rng_state(self.rng_state)
        try:
            with torch.no_grad():
                for i, op in enumerate(ops):
                    out = _run(op, live, self.nbytes)
                    flat, _ = tree_flatten(out)
                    outs = [t for t in flat if isinstance(t, torch.Tensor)]
                    for j, r in op.outs:
                        live.setdefault(r.key, outs[j].untyped_storage())
                    peak = max(peak, sum(st.nbytes() for st in live.values()))
                    for k in dead_after.get(i, []):
                        if k in by_key and touches[k][-1] == i:
                            for fqn in by_key[k]:
                                sink(fqn, _view(live[k], finals[fqn]))
                        live.pop(k, None)
        except Exception:
            torch.set_rng_state(saved)
            raise
        return peak


@contextmanager
def _recording_seeds(tape: InitTape, seeded: list[bool]) -> Iterator[None]:
    """While recording, every call that reseeds the CPU generator (``torch.manual_seed``,
    ``torch.seed``, ``torch.set_rng_state``, also through ``torch.random``) runs, then appends an op
    that sets the CPU random state it left, so replay follows it at the same place. A state read
    inside the build (``get_rng_state``, as ``fork_rng`` does) and set back is not replayable: meta
    tensors draw nothing, so it is not the state the host build read; the tape is marked broken."""
    import torch.random as trandom

    read_inside: list[torch.Tensor] = []
    get0, set0, seed0, manual0 = trandom.get_rng_state, trandom.set_rng_state, trandom.seed, trandom.manual_seed

    def record() -> None:
        state = get0()
        tape.ops.append(TapeOp(functools.partial(set0, state), ((), {}), [], set(), set(), set()))
        seeded.append(True)

    def seeding(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            record()
            return out

        return call

    def get_state() -> torch.Tensor:
        state = get0()
        read_inside.append(state)
        return state

    def set_state(new_state: torch.Tensor) -> None:
        if any(new_state.shape == r.shape and torch.equal(new_state, r) for r in read_inside):
            tape.broken = tape.broken or ("the constructor sets back a random state it read during the build "
                                          "(torch.random.fork_rng / get_rng_state): meta tensors draw nothing")
        set0(new_state)
        record()

    patches = {"manual_seed": seeding(manual0), "seed": seeding(seed0),
               "set_rng_state": set_state, "get_rng_state": get_state}
    with contextlib.ExitStack() as stack:
        for mod in (torch, trandom):
            for name, fn in patches.items():
                stack.enter_context(mock.patch.object(mod, name, fn))
        yield


@contextmanager
def _hf_init_on_meta() -> Iterator[None]:
    mu = sys.modules.get("transformers.modeling_utils")
    if mu is None or not hasattr(mu, "get_torch_context_manager_or_global_device"):
        yield
        return
    with mock.patch.object(mu, "get_torch_context_manager_or_global_device", lambda: None):
        yield


def _view(st: torch.UntypedStorage, r: Ref) -> torch.Tensor:
    return torch.empty(0, dtype=r.dtype).set_(st, r.offset, r.size, r.stride)


def _run(op: TapeOp, live: dict[int, torch.UntypedStorage], nbytes: dict[int, int]) -> Any:
    def fetch(a: Any) -> Any:
        if isinstance(a, Ref):
            st = live.get(a.key)
            if st is None:
                if a.key not in op.full:
                    raise TapeError(f"{op.func} reads a tensor the tape never made")
                st = live[a.key] = torch.UntypedStorage(nbytes[a.key])
            return _view(st, a)
        if isinstance(a, torch.device) and a.type == "meta":
            return torch.device("cpu")
        return a

    args, kwargs = tree_map(fetch, op.args)
    return op.func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: InitTape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.tape.broken or func.is_view:
            return out
        tape = self.tape
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        schema = func._schema.arguments
        written = {i for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write}
        reads: set[int] = set()
        writes: set[int] = set()
        full: set[int] = set()
        known = set(tape.nbytes)

        def enc(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and a.is_meta:
                if a.untyped_storage()._cdata not in known:
                    tape.broken = tape.broken or f"{func} reads a meta tensor made outside the recording"
                return tape.ref(a)
            if isinstance(a, torch.Tensor):
                return a.detach().clone()  # a real tensor: a constant of the tape
            return a

        enc_args = [tree_map(enc, a) for a in args]
        enc_kwargs = {k: tree_map(enc, v) for k, v in kwargs.items()}
        name = func._schema.name.split("::")[-1]
        for i, a in enumerate(enc_args):
            for r in tree_flatten(a)[0]:
                if not isinstance(r, Ref):
                    continue
                if i in written:
                    writes.add(r.key)
                    if i == 0 and name in _OVERWRITES and r.covers(tape.nbytes[r.key]):
                        full.add(r.key)
                        continue
                reads.add(r.key)
        for v in enc_kwargs.values():
            reads |= {r.key for r in tree_flatten(v)[0] if isinstance(r, Ref)}
        in_keys = reads | writes
        new = [(j, tape.ref(t)) for j, t in enumerate(flat_out)
               if t.is_meta and t.untyped_storage()._cdata not in in_keys]
        if not new and not writes:
            return out  # neither makes nor changes a meta tensor (e.g. a size query)
        for _, r in new:
            writes.add(r.key)
            full.add(r.key)
        tape.ops.append(TapeOp(func, (enc_args, enc_kwargs), new, reads, writes, full))
        return out
