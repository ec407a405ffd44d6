"""Which linears' outputs are split into heads in a way a column shard would silently break.

Under tensor parallelism a colwise q/k/v projection returns this rank's slice of the features
``[B, T, F/t]``. A head split written as ``view(B, T, -1, head_dim)`` then gives ``F/(t·head_dim)``
local heads, as torch's TP styles expect; one written as ``view(B, -1, num_heads, head_dim)``
(OPT) gives ``[B, T/t, num_heads, head_dim]``: the sequence folded into the heads, with no error.

``fold_views(root, inputs, prefix)`` runs the model forward on fake tensors once per *kind* of
linear (parent module class, attribute name, weight shape: every layer's ``self_attn.q_proj`` is
one kind, probed at its first instance), with that linear's output narrowed to half its features,
and watches the first view/reshape that splits the narrowed last dim: if it keeps the leading dims
(batch, sequence) the kind is safe, otherwise every linear of that kind is reported. The forward
stops at that view or at the end of the linear's parent module (where heads are split), so a
probe costs the forward up to the first instance. Linears directly under the model (heads) are
not probed. Returns the user FQNs of the linears to keep replicated; the planner reads them from
``ModelGraph.meta["tp_fold_views"]`` (``planner/tp/groups.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten, torch.unflatten}


class _Stop(Exception):
    def __init__(self, folded: bool) -> None:
        super().__init__("probe done")
        self.folded = folded


class _Watch(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.lead: tuple[int, ...] | None = None  # leading dims of the narrowed output
        self.width = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.lead is not None and func in _VIEWS and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            if (isinstance(out, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[:-1]) == self.lead
                    and x.shape[-1] == self.width and out.shape[-1] != x.shape[-1]):
                raise _Stop(tuple(out.shape[: len(self.lead)]) != self.lead)
        return out


def _narrow_hook(watch: _Watch) -> Any:
    def hook(_m: nn.Module, _a: Any, out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or out.dim() < 3 or out.shape[-1] % 2:
            raise _Stop(False)
        half = out[..., : out.shape[-1] // 2].contiguous()  # a shard is a contiguous local tensor
        watch.lead, watch.width = tuple(half.shape[:-1]), int(half.shape[-1])
        return half

    return hook


def _end_hook(_m: nn.Module, _a: Any, _out: Any) -> None:
    raise _Stop(False)


class _Reached(Exception):
    """The probe reached a block copy whose tensors were not faked: run it again with them."""


def _reached_hook(_m: nn.Module, _a: Any) -> None:
    raise _Reached()


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def fold_views(root: nn.Module, inputs: Sequence[Any], prefix: str = "", skip: Sequence[str] = (),
               meta: bool = False) -> list[str]:
    """User FQNs of linears whose head split folds the sequence on a column shard (see above).

    ``skip``: FQNs of repeated-block copies (``tracing.reuse``) whose tensors need not be faked: a
    probe stops inside the first instance of its kind, before any copy runs; a probe that reaches
    a copy is run again with everything faked. ``meta``: probe on meta tensors (an fx capture,
    as ``annotate.propagate`` runs it, without importing torch._dynamo) instead of fake CPU ones."""
    import logging

    out: list[str] = []
    flog = logging.getLogger("torch._subclasses.fake_tensor")  # probes end in shape errors: keep them quiet
    level = flog.level
    flog.setLevel(logging.CRITICAL)
    try:
        _probe_all(root, prefix, out, inputs, tuple(skip), meta)
    finally:
        flog.setLevel(level)
    return out


def _signature(parent: nn.Module | None, name: str, lin: nn.Module) -> tuple[str, str, tuple[int, ...]] | None:
    """(parent class, attribute name, weight shape): linears alike in these fold alike. None for a
    linear directly under the root (a head: its output is the model's, never split into heads)."""
    if "." not in name or parent is None:
        return None
    attr = name.rsplit(".", 1)[1]
    w = getattr(lin, "weight", None)
    return type(parent).__qualname__, attr, tuple(w.shape) if w is not None else ()


def _probe_all(root: nn.Module, prefix: str, out: list[str], inputs: Sequence[Any], skip: tuple[str, ...],
               meta: bool) -> None:
    from meshplan.tracing.annotate import fake_maker

    to_fake, mode = fake_maker(keep_device=False) if meta else fake_maker(device="cpu")

    args = [to_fake(x) if isinstance(x, torch.Tensor) else x for x in tree_leaves(tuple(inputs))]
    by_sig: dict[tuple, list[str]] = {}
    first: dict[tuple, tuple[str, nn.Module]] = {}
    mods: dict[str, nn.Module] = {}  # every module by name: a linear's parent, without a path walk each
    for name, lin in root.named_modules():
        mods[name] = lin
        if not name.startswith(prefix) or not _is_linear(lin):
            continue
        user = name[len(prefix):]
        sig = _signature(mods.get(name.rsplit(".", 1)[0]) if "." in user else None, user, lin)
        if sig is None:
            continue
        by_sig.setdefault(sig, []).append(user)
        first.setdefault(sig, (name, lin))
    skipped = [root.get_submodule(p) for p in skip]
    for sig, (name, lin) in first.items():
        end = root.get_submodule(name.rsplit(".", 1)[0])  # the parent: where heads are split
        if _probe(root, lin, end, args, to_fake, mode, skip, skipped):
            out += by_sig[sig]


def _probe(root: nn.Module, lin: nn.Module, end: nn.Module, args: list[Any], to_fake: Any, mode: Any,
           skip: tuple[str, ...], skipped: list[nn.Module]) -> bool:
    """One probe: does ``lin``'s narrowed output get folded into the sequence? (see above)"""
    from meshplan.tracing.annotate import fake_state

    watch = _Watch()
    hooks = [lin.register_forward_hook(_narrow_hook(watch)), end.register_forward_hook(_end_hook)]
    hooks += [m.register_forward_pre_hook(_reached_hook) for m in skipped]
    reached = False
    try:
        with fake_state(root, to_fake, skip), torch.no_grad(), mode, watch:
            root(*args)
    except _Stop as stop:
        return stop.folded
    except _Reached:
        reached = True
    except Exception:  # noqa: BLE001 - a probe that cannot run proves nothing either way
        return False
    finally:
        for h in hooks:
            h.remove()
    # rerun with everything faked only once this probe's hooks are gone: a rerun inside the
    # handler met the copies' pre-hooks again and recursed until Python's limit (returning False)
    return _probe(root, lin, end, args, to_fake, mode, (), []) if reached else False
