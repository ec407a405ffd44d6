"""What a traced node *is*: its kind (``graph.NODE_KINDS``), its bytes saved for backward, its attrs.

One name table serves both captures: a torch.fx graph (``call_module`` leaves such as ``nn.Linear``,
``call_function`` on ``torch``/``F``/``operator`` callables, ``call_method`` on tensors) and a
torch.export graph (``aten`` overloads). Each target is normalised to a short op name
(``aten.linear.default`` -> ``linear``, ``operator.getitem`` -> ``getitem``) and looked up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

LEAF_MODULE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.GroupNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
)
_LEAF_NAME_SUFFIXES = ("RMSNorm", "LayerNorm", "Conv1D")


def is_leaf_class(cls: type) -> bool:
    """Modules kept whole as one node: Linear, HF Conv1D, Embedding and the norms."""
    if issubclass(cls, LEAF_MODULE_TYPES):
        return True
    return any(c.__name__.endswith(_LEAF_NAME_SUFFIXES) for c in cls.__mro__ if c is not nn.Module)


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def is_user_module(m: nn.Module) -> bool:
    """A module of the model's own code (a block candidate): not a leaf kind and not one of torch.nn's
    modules, its containers (Sequential, ModuleList, ModuleDict) aside."""
    cls = type(m)
    builtin = cls.__module__.startswith("torch.nn.modules") and not isinstance(m, _CONTAINERS)
    return not is_leaf_class(cls) and not builtin


_KIND_BY_OP: dict[str, str] = {}
for _kind, _names in {
    "linear": "linear addmm conv1d",
    "embedding": "embedding embedding_bag",
    "attention": (
        "scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu "
        "_scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention "
        "_scaled_dot_product_cudnn_attention _scaled_dot_product_attention_math flex_attention"
    ),
    "matmul": "matmul mm bmm baddbmm einsum",
    "moe": "moe_block",
    "norm": (
        "layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm native_group_norm batch_norm "
        "_native_batch_norm_legit_no_training"
    ),
    "activation": (
        "gelu silu relu relu_ tanh sigmoid softmax _softmax log_softmax _log_softmax softplus mish "
        "hardtanh leaky_relu elu gelu_ silu_"
    ),
    "loss": "cross_entropy nll_loss nll_loss_forward nll_loss2d_forward mse_loss binary_cross_entropy_with_logits",
    "reshape": (
        "view reshape _unsafe_view transpose permute t expand expand_as getitem split chunk unbind "
        "contiguous unsqueeze squeeze flatten unflatten slice select alias detach getattr size dim "
        "sym_size narrow view_as _reshape_alias lift_fresh_copy movedim swapaxes numel"
    ),
    "constant": "arange ones zeros full empty ones_like zeros_like full_like empty_like tensor scalar_tensor",
    "elementwise": (
        "add sub mul truediv div neg pow rsqrt sqrt exp log mean sum cat stack dropout native_dropout "
        "to type_as _to_copy float type clone masked_fill where tril triu cumsum repeat repeat_interleave "
        "iadd imul floordiv ne eq lt gt le ge rsub reciprocal abs clamp cos sin amax max min"
    ),
}.items():
    for _n in _names.split():
        _KIND_BY_OP[_n] = _kind

_ACTIVATION_MODULES = {
    "GELU", "ReLU", "SiLU", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "Mish", "LeakyReLU", "ELU",
    "NewGELUActivation", "GELUActivation", "FastGELUActivation", "QuickGELUActivation", "SiLUActivation",
    "PytorchGELUTanh", "GELUTanh", "Softplus",
}
_LOSS_SUFFIX = "Loss"


def op_name(target: Any) -> str:
    """Short op name of an fx target: 'linear', 'getitem', 'scaled_dot_product_attention', ..."""
    schema = getattr(target, "_schema", None)
    if schema is not None:  # aten OpOverload
        return str(schema.name).split("::")[-1]
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or type(target).__name__
    return name.strip("_") if name.startswith("__") else name


def module_kind(mod: nn.Module) -> str:
    cls = type(mod)
    name = cls.__name__
    if isinstance(mod, nn.Linear) or name == "Conv1D":
        return "linear"
    if isinstance(mod, nn.Embedding | nn.EmbeddingBag):
        return "embedding"
    if "Norm" in name:
        return "norm"
    if name in _ACTIVATION_MODULES:
        return "activation"
    if isinstance(mod, nn.Dropout):
        return "elementwise"
    if name.endswith(_LOSS_SUFFIX):
        return "loss"
    if isinstance(mod, nn.Identity | nn.Flatten | nn.Unflatten):
        return "reshape"
    return "other"


def function_kind(op: str, reads_params: bool) -> str:
    """Kind of a call_function/call_method node by its short op name."""
    kind = _KIND_BY_OP.get(op)
    if kind is None:
        kind = _KIND_BY_OP.get(op.rstrip("_"), "other")
    if kind == "matmul" and reads_params:
        return "linear"
    if kind == "linear" and not reads_params:
        return "matmul"
    return kind


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


_FREE_ELEMENTWISE = {"add", "sub", "neg", "cat", "stack", "iadd", "to", "_to_copy", "type_as", "float", "type",
                     "clone", "rsub", "repeat", "repeat_interleave", "where", "masked_fill", "tril", "triu"}


def saved_parts(kind: str, op: str, inputs: Sequence[TensorMeta | None], out: TensorMeta | None) -> list[tuple[int, int]]:
    """What a node keeps alive for its backward, as (input position, bytes) pairs; position -1 is
    memory the node itself creates (its output, row statistics, a dropout mask).

    linear: its input; matmul: both operands; attention: q, k, v, its output and the fp32
    log-sum-exp (one per query row); norm: its input plus fp32 row statistics (mean and rstd for
    LayerNorm, rstd for RMSNorm); activation: its input (softmax: its output); embedding: the
    indices; elementwise mul/div: each tensor operand whose partner needs a gradient (x·cos keeps
    cos, not x; a product with a Python scalar keeps nothing), add/sub/cat: nothing, dropout: a 1-byte mask,
    others (pow, rsqrt, exp, mean ...): their input; reshape/constant/input/output: nothing;
    loss: its input. The caller counts a tensor saved by several nodes once (q/k/v projections
    share one saved input) and skips inputs that are constants (buffers, model inputs).
    """
    acts = [(i, m) for i, m in enumerate(inputs) if m is not None]
    if kind in ("linear", "embedding", "loss", "moe"):
        return [(acts[0][0], acts[0][1].nbytes)] if acts else []
    if kind == "matmul":
        return [(i, m.nbytes) for i, m in acts[:2]]
    if kind == "attention":
        parts = [(i, m.nbytes) for i, m in acts[:3]]
        if out is not None:
            rows = _rows(acts[0][1]) if acts else 0
            parts += [(-1, out.nbytes), (-1, 4 * rows)]
        return parts
    if kind == "norm":
        if not acts:
            return []
        i, x = acts[0]
        nstats = 1 if "rms" in op.lower() else 2
        return [(i, x.nbytes), (-1, 4 * _rows(x) * nstats)]
    if kind == "activation":
        if "softmax" in op.lower() and out is not None:
            return [(-1, out.nbytes)]
        return [(acts[0][0], acts[0][1].nbytes)] if acts else []
    if kind == "elementwise":
        if "dropout" in op.lower():
            return [(-1, out.nbytes // max(1, _itemsize(out)))] if out else []
        if op in _FREE_ELEMENTWISE:
            return []
        if op in ("mul", "div", "truediv", "imul"):
            # the caller drops an operand whose partner is a constant (``mul_saved``)
            return [(i, m.nbytes) for i, m in acts[:2]] if len(acts) >= 2 else []
        return [(acts[0][0], acts[0][1].nbytes)] if acts else []
    return []


MUL_OPS = frozenset({"mul", "div", "truediv", "imul"})


def mul_saved(parts: list[tuple[int, int]], constant: Sequence[bool]) -> list[tuple[int, int]]:
    """Of a two-operand mul/div's ``parts``, those autograd really keeps: the gradient of one
    operand needs the other, so an operand is kept only when its partner is not a constant
    (``constant[j]`` for the operand at ``parts[j]``): x·cos keeps cos (a buffer, free), not x."""
    if len(parts) != 2:
        return parts
    return [parts[j] for j in (0, 1) if not constant[1 - j]]


def _rows(m: TensorMeta) -> int:
    rows = 1
    for d in m.shape[:-1]:
        rows *= d
    return rows


def _itemsize(m: TensorMeta) -> int:
    n = 1
    for d in m.shape:
        n *= d
    return m.nbytes // n if n else 1
