"""PyTorch's own memory accounting of meshplan's runtime, under fake tensors on one CPU process.

``measure(build, plan, rank=, example_inputs=, batch=)`` applies ``plan`` with meshplan's runtime
(``meshplan.runtime.apply.api.apply_plan``) to a model built under ``FakeTensorMode`` (nothing is
allocated), on a fake process group (``torch.testing._internal.distributed.fake_pg``: one process
stands in for rank ``rank`` of the plan's whole mesh), runs two training steps under
``torch.distributed._tools.mem_tracker.MemTracker`` and returns the peak of the live tensor
storages it saw (parameters, gradients, optimizer states, activations, temporaries; each rounded
up to PyTorch's 512-byte allocation unit, as the CUDA caching allocator does) beside meshplan's
predicted peak for that rank (``plan.predicted.peak_mem_bytes`` of its pipeline rank).

What had to be bridged (the runtime itself is unchanged; each bridge only lets a step run on
fake tensors and changes no allocation of the step):
- ``init_device_mesh`` and every sub-mesh (``DeviceMesh.__init__`` / ``_unflatten``, ``_MeshLayout.remap_to_tensor``) build rank tensors with real tensors (``tolist()``), so it runs with
  fake mode suspended, as does the EP/CP group layout (``epcp.build_groups``: rows of the mesh);
- ``Module.to("cpu")`` of already-CPU fake modules (the model, each stage piece) is a no-op, as it
  is for real CPU tensors (FakeTensor parameters cannot be swapped in place);
- DTensor's sharding propagation runs each op on fake arguments in the active fake mode: it gets
  a fake mode of its own, which MemTracker does not count (as in eager, where it is the only one);
- the step's global loss (``ParallelModel._global_loss``) and the pipelining warm-up vote read
  scalar values (``.item()``), which fake tensors do not have: the loss is returned as 0 and the
  vote's outcome is set directly (STATIC: every stage is built with its input/output metadata,
  taken from running the stage chain on fake tensors, as ``split.check_stage_chain`` does);
- sequence parallelism inside pipeline stages: the stage chain runs before TP, on whole sequences; the
  runtime then inserts the SP boundaries (``tp.insert_sequence_boundaries``) and splits again, and a
  value crossing a stage boundary inside the SP region is this rank's sequence shard: its metadata
  gets dim 1 divided by tp (``_seq_shard_meta``), as the real stages infer it on their first step;
- DTensor caches sharding propagation and redistribution plans per process, with the meshes of an
  earlier ``measure``: they are cleared before each (``_clear_dtensor_caches``);
- MemTracker's module tracker hooks each module's inputs' and outputs' gradients
  (``register_multi_grad_hook``) with a closure that holds their autograd nodes: a reference
  cycle through C++ (node -> hook -> closure -> node) that Python's gc cannot free, which keeps
  each graph's nodes alive after its backward, and through them (``AccumulateGrad``) the leaf a
  later pipeline stage receives: under the tracker every microbatch's received input would stay
  alive (without it, it is freed after its backward). Those hooks only feed the per-module
  statistics, unused here; the global peak is taken per op, so they are not registered.

- DDP (ddp, zero1): ``_verify_param_shape_across_processes`` (a collective over parameter storage)
  is skipped, the runtime's counting all-reduce hook returns its bucket in a completed future (the
  fake group's future carries no value; the all-reduce is in place), and the reducer's bucket
  rebuild after the first iteration is skipped (``_NoRebuild``: it reads the broadcast bucket
  indices; the rebuilt buckets hold the same parameters). The Reducer's buckets are allocated by
  its C++ code through the dispatcher, so MemTracker counts them.

MoE (the router's top-k decides sizes: ``torch.where`` per expert, the per-expert counts, which the
expert-parallel exchange all-to-alls and reads with ``.tolist()``; fake tensors have no values):
``BalancedRouting``, a dispatch mode between the fake mode and the tracker used only here, fixes the
top-k indices to a balanced assignment (token i -> experts (i·k + s) mod E) held as a real "shadow",
and runs only the ops on those integer tensors on their shadows, giving the value-sized outputs
their shadows' sizes; the counts' all-to-all receives what it sends (every rank routes alike). The
activations, expert inputs and outputs, all-to-all buffers, weights and gradients are the runtime's
own ops on fake tensors, sized as with a router that sends each expert N·k/E tokens, which is also
what the cost model prices (routing imbalance is a time term). On the zoo MoE at one rank the tracked
peak equals the one with real CPU tensors and real routing (``tests/test_memory_fake.py``).

MemTracker hooks every parameter's gradient; QLoRA's frozen quantized base takes no hook, so the
tracker only tracks its storage (``_StepTracker``). ``UNSUPPORTED`` names paths that cannot run here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.plan import Plan

UNSUPPORTED: dict[str, str] = {}


@dataclass(frozen=True)
class MemCheck:
    """One rank's predicted and fake-tensor-measured peak (bytes) and the measured categories."""

    predicted_bytes: int
    measured_bytes: int
    categories: dict[str, int]
    pp_rank: int
    predicted_breakdown: dict[str, int]

    @property
    def rel_error(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


class _NoHandle:
    def remove(self) -> None:
        pass


class _StepTracker(MemTracker):
    """MemTracker over several microbatch forwards of one module (the base refuses a root module
    called twice; per-module statistics are not used here, only the global peak)."""

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # the root called again (the next microbatch): track it anew
            del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
        # a frozen parameter (QLoRA's quantized base) gets no gradient and cannot take a gradient
        # hook: mark it hooked (a no-op handle pair) so the base only tracks its storage
        for p in module.parameters():
            if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                self._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        if module is None or module in self.memory_tracking:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        if module is None or module in self.memory_tracking:
            super()._post_bw_hook(module, args)


class _NoRebuild:
    """DDP's reducer without the bucket rebuild after the first iteration (it broadcasts the new
    bucket indices, reading their data): the rebuilt buckets reorder the same parameters, the same
    bytes in all. Everything else is the reducer's own."""

    def __init__(self, reducer: Any) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _descendants(gm: torch.fx.GraphModule, target: str) -> set[str]:
    """Names of the nodes of ``gm`` computed from its ``call_module`` node of ``target`` (itself included)."""
    todo = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == target]
    seen: set[str] = set()
    while todo:
        n = todo.pop()
        if n.name not in seen:
            seen.add(n.name)
            todo.extend(n.users)
    return seen


def _seq_shard_meta(v: torch.Tensor, tp: int) -> torch.Tensor:
    """A stand-in for ``v``'s sequence shard (dim 1 split over ``tp``, as ``tp.SeqShard``)."""
    shape = list(v.shape)
    shape[1] //= tp
    return torch.empty(shape, dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad)


@contextlib.contextmanager
def _bridges(mb_dtype: torch.dtype) -> Iterator[None]:
    """The runtime's few scalar reads and the mesh's real-tensor construction, bridged (module doc)."""
    from torch.distributed.pipelining import schedules as tsched
    from torch.distributed.pipelining._utils import InferenceMode

    import meshplan.runtime.apply.schedules as rsched
    import meshplan.runtime.apply.split as rsplit
    import meshplan.runtime.launch.dist as rdist
    from meshplan.calls import split_inputs
    from meshplan.runtime.apply.parallel_model import ParallelModel

    io: dict[int, tuple] = {}
    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    real_mesh, real_chain, real_stage = rdist.init_device_mesh, rsplit.check_stage_chain, rsched.pipeline_stage
    real_split = rsplit.split_stages

    def mesh(*a: Any, **k: Any) -> Any:
        with unset_fake_temporarily():
            return real_mesh(*a, **k)

    def record(pieces: Any, example_inputs: Any) -> None:
        vals: tuple = split_inputs(example_inputs)[1]
        for p in pieces:
            io[p.index] = tuple(v.detach().requires_grad_(v.requires_grad) for v in vals)
            out = p.module(*vals)
            vals = out if isinstance(out, tuple) else (out,)
        io[len(pieces)] = vals

    def chain(pieces: Any, example_inputs: Any) -> None:
        record(pieces, example_inputs)
        real_chain(pieces, example_inputs)

    def resplit(gm: Any, ordered: Any) -> Any:
        pieces = real_split(gm, ordered)
        if io and hasattr(gm, "_sp_shard"):  # sequence parallel: a boundary inside it carries the shard
            between = _descendants(gm, "_sp_shard") - _descendants(gm, "_sp_gather")
            tp = gm._sp_shard.mesh.size()
            for p in pieces[:-1]:
                io[p.index + 1] = tuple(_seq_shard_meta(v, tp) if name in between else v
                                        for name, v in zip(p.outputs, io[p.index + 1]))
        return pieces

    def sent(vals: tuple) -> tuple:  # stage sends travel in the training dtype (runtime.precision)
        return tuple(v.detach().to(mb_dtype).requires_grad_(v.requires_grad) if v.is_floating_point() else v
                     for v in vals)

    def stage(mod: Any, i: int, n: int, device: Any, group: Any = None) -> Any:
        ins = io[i] if i == 0 else sent(io[i])
        outs = sent(io[i + 1]) if i < n - 1 else io[i + 1]
        return real_stage(mod, i, n, device, group, input_args=ins, output_args=outs)

    def warm(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        for s in stages:
            s._inference_mode = InferenceMode.STATIC

    # DTensor derives output shapes by running each op on fake arguments in the active fake mode;
    # MemTracker skips ops of any other fake mode (its check for that nested propagation), so
    # propagation gets a fake mode of its own instead of the one the model runs in
    import torch.distributed.tensor._sharding_prop as sprop

    prop_mode = FakeTensorMode(allow_non_fake_inputs=True)
    patch(sprop, "detect_fake_mode", lambda *a: prop_mode)
    patch(rdist, "init_device_mesh", mesh)
    real_to = torch.nn.Module.to

    def to(self: torch.nn.Module, *a: Any, **k: Any) -> torch.nn.Module:  # cpu -> cpu: nothing moves
        dev = a[0] if a else k.get("device")
        if isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu" and len(a) <= 1 and \
                set(k) <= {"device"}:
            return self
        return real_to(self, *a, **k)

    patch(torch.nn.Module, "to", to)
    from torch.distributed._mesh_layout import _MeshLayout

    real_remap = _MeshLayout.remap_to_tensor

    def remap(self: Any, *a: Any, **k: Any) -> Any:  # sub-meshes (HSDP, FSDP x TP) index real rank tensors
        with unset_fake_temporarily():
            return real_remap(self, *a, **k)

    patch(_MeshLayout, "remap_to_tensor", remap)
    from torch.distributed.device_mesh import DeviceMesh

    real_init = DeviceMesh.__init__

    def mesh_init(self: Any, *a: Any, **k: Any) -> None:  # coordinates: nonzero() of the rank tensor
        with unset_fake_temporarily():
            real_init(self, *a, **k)

    patch(DeviceMesh, "__init__", mesh_init)
    real_unflatten = DeviceMesh._unflatten

    def unflatten(self: Any, *a: Any, **k: Any) -> Any:  # HSDP's (replicate, shard) mesh and its groups
        with unset_fake_temporarily():
            return real_unflatten(self, *a, **k)

    patch(DeviceMesh, "_unflatten", unflatten)
    patch(rsplit, "check_stage_chain", chain)
    patch(rsplit, "split_stages", resplit)  # re-split after the sequence-parallel boundaries (steps.apply_split)
    patch(rsched, "pipeline_stage", stage)  # the runtime's one place that builds a PipelineStage
    import meshplan.runtime.apply.epcp as repcp

    real_groups = repcp.build_groups

    def groups(*a: Any, **k: Any) -> Any:  # EP/CP groups: rows of the mesh's real rank tensor
        with unset_fake_temporarily():
            return real_groups(*a, **k)

    patch(repcp, "build_groups", groups)
    import torch.distributed._tools.mod_tracker as mtrack

    patch(mtrack, "register_multi_grad_hook", lambda *a, **k: None)  # see the module doc
    patch(ParallelModel, "_global_loss", lambda self, loss: (0.0, False))
    # DDP (ddp, zero1): its shape check reads parameter storage, the fake group's all-reduce future
    # carries no value, and its second iteration's bucket rebuild reads the bucket indices' data
    import torch.nn.parallel.distributed as tddp

    import meshplan.runtime.apply.data_parallel as rdp

    patch(tddp, "_verify_param_shape_across_processes", lambda *a, **k: None)

    # in place, as the all-reduce: the bucket itself (no annotations: DDP checks them against its
    # classes, and this module's ``from __future__ import annotations`` would make them strings)
    def allreduce(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        state.add(bucket.buffer())
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    patch(rdp, "_counting_allreduce_hook", allreduce)
    real_ddp_init = tddp.DistributedDataParallel.__init__

    def ddp_init(self: Any, *a: Any, **k: Any) -> None:
        real_ddp_init(self, *a, **k)
        self.reducer = _NoRebuild(self.reducer)

    patch(tddp.DistributedDataParallel, "__init__", ddp_init)
    for cls in list(vars(tsched).values()):
        if isinstance(cls, type) and "_warmup_p2p" in vars(cls):
            patch(cls, "_warmup_p2p", warm)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


_DYNAMIC = ("nonzero", "nonzero_numpy", "bincount", "repeat_interleave")  # outputs sized by values
_FACTORIES = ("arange", "scalar_tensor")


class BalancedRouting(TorchDispatchMode):
    """A MoE router's top-k under fake tensors, fixed to a balanced assignment (module doc, "MoE").

    Every ``aten.topk`` output's indices get a real "shadow": token i picks experts
    ``(i·k + s) mod E``, s < k (E the top-k's input width), so each expert receives ``N·k/E``
    tokens when E divides N·k. An op whose tensor inputs all have shadows (the routing's integer
    tensors: ``== e``, ``argsort``, ``// k``, views) is also run on the shadows, its fake output
    gets the real result as its shadow, and where the output's size is set by values (``nonzero``
    behind ``torch.where``, ``bincount``, ``repeat_interleave``) the fake output takes the shadow's
    size; ``.item()`` / ``.tolist()`` read the shadow. Integer factories (``arange``, ``torch.tensor``)
    are shadowed too. An all-to-all of a shadowed tensor (the per-expert counts) receives what it
    sends: every rank routes the same balanced way, so each expert gets the same count from every
    rank. Every other op (everything that allocates the activations, weights and buffers) runs on
    fake tensors unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.shadow: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.topk_calls = 0

    def __enter__(self) -> BalancedRouting:
        self._tolist = torch.Tensor.tolist
        mode = self

        def tolist(t: torch.Tensor) -> Any:
            if t in mode.shadow:
                with unset_fake_temporarily():
                    return mode.shadow[t].tolist()
            return mode._tolist(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]  # C++ reads the data pointer, no dispatch
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _real(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x in self.shadow:
                return self.shadow[x]
            if isinstance(x, FakeTensor):
                raise KeyError(x)
        return x

    def _shadow_all(self, out: Any, real: Any) -> None:
        for f, r in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                self.shadow[f] = r

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat, spec = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten.topk.default:
            vals, idx = func(*args, **kwargs)
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            assert dim in (-1, args[0].dim() - 1), "a router's top-k runs over its last (expert) dimension"
            e, k = args[0].shape[-1], idx.shape[-1]
            with unset_fake_temporarily():
                self.shadow[idx] = ((torch.arange(idx.numel() // k)[:, None] * k + torch.arange(k)) % e).reshape(idx.shape)
            self.topk_calls += 1
            return vals, idx
        if name == "_local_scalar_dense" and tensors[0] in self.shadow:
            with unset_fake_temporarily():
                return self.shadow[tensors[0]].item()
        if name in ("lift_fresh", "lift_fresh_copy") and not isinstance(tensors[0], FakeTensor):
            out = func(*args, **kwargs)
            with unset_fake_temporarily():
                self.shadow[out] = tensors[0].clone()
            return out
        if "alltoall" in name and len(tensors) >= 2 and tensors[1] in self.shadow:
            out = func(*args, **kwargs)  # the fake group's work; what arrives: what was sent (class doc)
            with unset_fake_temporarily():
                self.shadow[tensors[0]] = self.shadow[tensors[1]].clone()
            return out
        dynamic = name in _DYNAMIC
        if not (dynamic or (tensors and all(t in self.shadow for t in tensors))
                or (not tensors and name in _FACTORIES and not kwargs.get("dtype", torch.int64).is_floating_point)):
            return func(*args, **kwargs)
        try:
            real_flat = [self._real(x) for x in flat]
        except KeyError:  # a value-sized op on data the routing does not decide
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            ra, rk = tree_unflatten(real_flat, spec)
            real = func(*ra, **rk)
        out = (tree_map(lambda r: torch.empty(r.shape, dtype=r.dtype) if isinstance(r, torch.Tensor) else r, real)
               if dynamic else func(*args, **kwargs))
        self._shadow_all(out, real)
        return out


def _clear_dtensor_caches() -> None:
    """DTensor's sharding propagation (Python and C++ fast path) and redistribution plans, cached per
    process, hold the meshes of an earlier ``measure``: equal by layout, but their process-group names
    are the destroyed group's, which a rank that builds other groups than the last cannot resolve
    (torch's own tests clear them between process groups: ``debug._clear_sharding_prop_cache``)."""
    from torch.distributed.tensor import _redistribute as redist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    redist._gen_transform_infos.cache_clear()
    redist._planner_cache.clear()


def _fused(factory: Callable) -> Callable:
    """The runtime's AdamW as it runs on CUDA (``runtime/optim.make_optimizer``: fused there,
    foreach on CPU, whose step holds one more parameter-sized temporary): the fake device is cpu,
    so the fused kind is asked for here (torch has fused AdamW on CPU too)."""

    def make(params: list) -> torch.optim.Optimizer:
        opt = factory(params)
        for g in opt.param_groups:
            g["foreach"], g["fused"] = None, True
        return opt

    return make


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def measure(
    build: Callable[[], torch.nn.Module], plan: Plan, *, rank: int = 0, seq_len: int, vocab: int,
    steps: int = 2, fake: bool = True,
) -> MemCheck:
    """Peak live bytes of ``rank`` over ``steps`` training steps of ``plan`` (fake tensors), and
    the plan's prediction for that rank's pipeline stage. ``build()`` makes the fp32 model.
    ``fake=False`` runs real CPU tensors under the same tracker (and the same bridges; one rank: the
    fake process group moves no data); the model must then be small. A MoE model's routing runs
    under fake tensors through ``BalancedRouting`` (module doc)."""
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.optim import make_optimizer
    from meshplan.runtime.apply.precision import resolve_precision

    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_dtensor_caches()
    old_ws = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(plan.world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    prec = resolve_precision(plan.dtype, "plan")
    mb_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec, torch.float32)
    B, T = plan.global_batch_size, seq_len
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
        routing = BalancedRouting() if fake else contextlib.nullcontext()
        with _bridges(mb_dtype), mode, routing:  # fake: real mesh rank tensors allowed in
            model = build()
            pm = apply_plan(model, plan, loss_fn=lm_loss,
                            optimizer_factory=_fused(make_optimizer("adamw", 1e-4)),
                            example_inputs=(torch.zeros(1, T, dtype=torch.long),))
            x = torch.zeros(B, T, dtype=torch.long)
            y = torch.zeros(B, T, dtype=torch.long)
            tracker = _StepTracker()
            ms = pm.master  # 16-bit weights: the fp32 masters and main gradients exist before the steps
            tracker.track_external(*pm.runners, pm.optimizer if ms is None else ms.optim,
                                   *([] if ms is None else [*ms.masters.values(), *ms.main.values()]))
            with tracker:
                for _ in range(steps):
                    pm.step(x, y)
            snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
            pp_rank = pm.env.coord("pp")
    finally:
        dist.destroy_process_group()
        if old_ws is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = old_ws
    cats = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    return MemCheck(predicted_bytes=int(plan.predicted.peak_mem_bytes[pp_rank]), measured_bytes=cats["Total"],
                    categories=cats, pp_rank=pp_rank,
                    predicted_breakdown=dict(plan.predicted.mem_breakdown))
