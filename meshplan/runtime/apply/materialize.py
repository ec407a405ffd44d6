"""Materializing a meta-built model: only this rank's shard of each tensor, on its device.

``apply_plan`` applies a plan to a model built on the meta device (``meshplan.models.load_model(
spec, device="meta", tape=tape)``): TP, FSDP2, EP and the stage split shard tensors that have no
values yet. ``materialize`` then allocates what this rank holds (``nn.Module.to_empty``) and fills it:

* from the model's own construction (``InitTape.replay``: the constructor's ops re-run on CPU one
  tensor at a time from the seed it was built with; each full tensor is cut to this rank's shard
  as it is finished and dropped), so every value equals the host-built model's for the same seed;
* or, ``init="device"``, on the rank's device for its shard only (``models.device_init``: the same
  ops, random ones drawn per tile; equal for every layout, not the host build's values);
* or from ``init_from`` (pretrained weights: ``runtime.weights.pretrained.load_pretrained``).

A shard is found from the tensor itself: a DTensor (TP, FSDP2) by its mesh and placements
(``distribute_tensor`` with no broadcast: every rank has the same full value), an expert slice by
the rows ``expert_parallel`` kept (``EPCPState.expert_rows``), an HF Conv1D weight that TP turned
into a Linear transposed first. ``to_empty`` makes new Parameter objects (as for torchtitan's
FSDP2 models), so the weights a model ties are tied again (``retie``) before any tensor is filled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshplan.models.init_tape import InitTape, Ref, TapeError

if TYPE_CHECKING:
    from meshplan.models.device_init import DeviceInit

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
Progress = Callable[[int, int], None]


def user_fqn(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def local_tensors(roots: Iterable[nn.Module]) -> dict[str, list[torch.Tensor]]:
    """User FQN -> the tensors this rank holds under it (parameters and buffers of the roots)."""
    out: dict[str, list[torch.Tensor]] = {}
    for r in roots:
        named = list(r.named_parameters(remove_duplicate=False)) + list(r.named_buffers(remove_duplicate=False))
        for name, t in named:
            lst = out.setdefault(user_fqn(name), [])
            if not any(t is u for u in lst):
                lst.append(t)
    return out


def meta_leftovers(modules: Iterable[nn.Module]) -> list[str]:
    """Tensors still on the meta device after ``to_empty`` (plain tensor attributes, not parameters or buffers)."""
    bad = []
    for m in modules:
        for name, sub in m.named_modules():
            for k, v in vars(sub).items():
                if isinstance(v, torch.Tensor) and v.is_meta and not k.startswith("_"):
                    bad.append(f"{name}.{k}" if name else k)
    return bad


def retarget_graph(gm: nn.Module, device: torch.device) -> int:
    """A graph captured from the meta-built model (pp > 1) names the meta device where its ops
    create or move tensors (``arange(..., device=meta)`` for positions, ``to.device(inv_freq, meta,
    float32)`` in HF Llama's rotary embedding): point those at ``device`` (torch.export's assertions of
    the meta device are dropped for every stage graph by ``drop_metadata_asserts`` in ``apply_split``).
    Returns the number of nodes changed."""
    if not isinstance(gm, torch.fx.GraphModule):
        return 0
    meta = torch.device("meta")
    n = 0
    for node in list(gm.graph.nodes):
        kw = dict(node.kwargs)
        if kw.get("device") in (meta, "meta"):
            kw["device"] = device
            node.kwargs = kw
            n += 1
        if any(a in (meta, "meta") for a in node.args if isinstance(a, torch.device | str)):  # to.device(x, meta, ...)
            node.args = tuple(device if isinstance(a, torch.device | str) and a in (meta, "meta") else a
                              for a in node.args)
            n += 1
    if n:
        gm.recompile()
    return n


def drop_metadata_asserts(gm: nn.Module) -> int:
    """Erase torch.export's ``_assert_tensor_metadata`` checks from a stage graph: they pin the device and
    dtype the capture saw (the meta device, fp32), while a stage runs on the rank's device and receives
    its inputs in the plan's send precision (bf16 under autocast). Returns the number erased."""
    if not isinstance(gm, torch.fx.GraphModule):
        return 0
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
            n += 1
    if n:
        gm.recompile()
    return n


def retie(roots: Iterable[nn.Module], tied: Iterable[tuple[str, ...]]) -> int:
    """Make each group of user FQNs that named one Parameter name one again (``to_empty`` gives each
    module its own new Parameter); returns how many names were re-pointed."""
    owners: dict[str, list[tuple[nn.Module, str, torch.Tensor]]] = {}
    for r in roots:
        for mname, mod in r.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if p is not None:
                    owners.setdefault(user_fqn(f"{mname}.{pname}" if mname else pname), []).append((mod, pname, p))
    n = 0
    for group in tied:
        held = [o for f in group for o in owners.get(f, [])]
        if not held:
            continue
        keep = held[0][2]
        for mod, pname, p in held[1:]:
            if p is not keep:
                mod._parameters[pname] = keep  # type: ignore[assignment]
                n += 1
    return n


def write_shard(t: torch.Tensor, full: torch.Tensor, *, transposed: bool = False,
                rows: tuple[int, int] | None = None) -> None:
    """Copy this rank's part of ``full`` (the whole tensor, on CPU) into ``t``."""
    full = full.t() if transposed else full
    with torch.no_grad():
        if isinstance(t, DTensor):
            local = distribute_tensor(full.to(t.device), t.device_mesh, t.placements, src_data_rank=None).to_local()
            t.to_local().copy_(local)
            return
        if rows is not None:
            full = full[rows[0]:rows[1]]
        if tuple(full.shape) != tuple(t.shape):
            raise TapeError(f"a full tensor of shape {tuple(full.shape)} does not fit the local {tuple(t.shape)}")
        t.copy_(full)


def _targets(finals: dict[str, Ref], roots: list[nn.Module], buffers_only: bool = False,
             only: set[str] | None = None) -> dict[str, list[torch.Tensor]]:
    targets = local_tensors(roots)
    if only is not None:
        targets = {f: ts for f, ts in targets.items() if f in only}
    if buffers_only:
        params = {user_fqn(n) for r in roots for n, _ in r.named_parameters(remove_duplicate=False)}
        targets = {f: ts for f, ts in targets.items() if f not in params}
    unknown = sorted(f for f in targets if f not in finals)
    if unknown:
        raise TapeError(f"tensors the constructor did not make cannot be initialised from it: {unknown[:4]}")
    return targets


def fill_from_tape(tape: InitTape, finals: dict[str, Ref], roots: list[nn.Module], transposed: set[str],
                   rows: dict[str, tuple[int, int]], *, buffers_only: bool = False,
                   progress: Progress | None = None, only: set[str] | None = None) -> tuple[int, int]:
    """Replay ``tape`` into this rank's tensors; returns (tensors filled, the replay's peak bytes).
    Raises ``TapeError`` when a tensor of the roots is not one the constructor made.
    ``buffers_only``: fill only the buffers (pretrained weights fill the parameters next);
    ``only``: fill only these user FQNs (the others have values already);
    ``progress(done, total)`` after each tensor filled."""
    targets = _targets(finals, roots, buffers_only, only)
    filled: set[str] = set()

    def sink(fqn: str, full: torch.Tensor) -> None:
        for t in targets.get(fqn, []):
            write_shard(t, full, transposed=fqn in transposed, rows=rows.get(fqn))
            filled.add(fqn)
        if progress is not None:
            progress(len(filled), len(targets))

    peak = tape.replay({f: r for f, r in finals.items() if f in targets}, sink, only_needed=buffers_only)
    return len(filled), peak


def shard_box(t: torch.Tensor, shape: tuple[int, ...], *, transposed: bool = False,
              rows: tuple[int, int] | None = None) -> list[tuple[int, int]] | None:
    """The box (``[lo, hi)`` per dimension) of the global tensor of ``shape`` that this rank's ``t``
    holds: a DTensor's shard (``compute_local_shape_and_global_offset``, as DCP finds it), an expert
    slice's rows, else the whole; None when the local tensor is not such a box."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        lshape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(lshape) != tuple(t.to_local().shape):
            return None
        box = [(o, o + n) for o, n in zip(off, lshape)]
    else:
        box = [(0, n) for n in t.shape]
        if rows is not None and box:
            box[0] = rows
    if transposed:
        if len(box) != 2:
            return None
        box = box[::-1]
    if len(box) != len(shape) or any(lo < 0 or hi > n or lo > hi for (lo, hi), n in zip(box, shape)):
        return None
    return box


def fill_box(di: DeviceInit, fqn: str, t: torch.Tensor, box: list[tuple[int, int]], *, transposed: bool) -> None:
    """Compute ``fqn`` on ``box`` (``shard_box`` of ``t``) on ``t``'s device and copy it into ``t``'s local part."""
    local = t.to_local() if isinstance(t, DTensor) else t
    value = di.compute(fqn, box, local.device)
    with torch.no_grad():
        local.copy_(value.t() if transposed else value)


def fill_one(di: DeviceInit, fqn: str, t: torch.Tensor, *, transposed: bool = False,
             rows: tuple[int, int] | None = None) -> bool:
    """``--init device`` for one tensor: its shard computed on its device, or (not boxable) its whole value
    from the CPU replay of what it needs, cut. Returns whether it was computed on the device."""
    box = shard_box(t, di.finals[fqn].size, transposed=transposed, rows=rows)
    if fqn in di.local and box is not None:
        fill_box(di, fqn, t, box, transposed=transposed)
        return True
    di.compute_fallback(lambda f, full: write_shard(t, full, transposed=transposed, rows=rows), only={fqn})
    return False


def fill_on_device(tape: InitTape, finals: dict[str, Ref], roots: list[nn.Module], transposed: set[str],
                   rows: dict[str, tuple[int, int]], *, progress: Progress | None = None,
                   only: set[str] | None = None) -> tuple[int, int, int]:
    """``--init device``: this rank's tensors computed for their shard on their device
    (``models.device_init``), those that cannot be cut into boxes from the CPU replay of what they
    need. ``only``: these user FQNs only. Returns (tensors filled on the device, tensors filled from the
    CPU replay, its peak bytes)."""
    from meshplan.models.device_init import DeviceInit

    targets = _targets(finals, roots, only=only)
    di = DeviceInit(tape, {f: finals[f] for f in targets})
    done: set[int] = set()
    whole: set[str] = set()
    n_dev = 0
    with torch.no_grad():
        for i, (fqn, ts) in enumerate(targets.items()):
            for t in ts:
                if id(t) in done:
                    continue
                box = shard_box(t, finals[fqn].size, transposed=fqn in transposed, rows=rows.get(fqn))
                if fqn not in di.local or box is None:
                    whole.add(fqn)
                    continue
                fill_box(di, fqn, t, box, transposed=fqn in transposed)
                done.add(id(t))
                n_dev += 1
            if progress is not None:
                progress(i + 1, len(targets))

    def sink(fqn: str, full: torch.Tensor) -> None:
        for t in targets.get(fqn, []):
            if id(t) not in done:
                write_shard(t, full, transposed=fqn in transposed, rows=rows.get(fqn))

    peak = di.compute_fallback(sink, only=whole)
    return n_dev, len(whole), peak
