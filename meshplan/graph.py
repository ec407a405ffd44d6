"""ModelGraph: what tracing saw, as plain torch-free data.

Owns the data types that flow from ``meshplan.trace`` to the cost models and the planner:
``GraphNode`` (one fx node, annotated), ``BlockType`` (a repeated structure such as GPT-2's
transformer block, with its instances), ``CutPoint`` (a place where the node order may be cut
into pipeline stages, with every live tensor that crosses it) and ``ModelGraph`` itself.

No torch import here (a test enforces it): a graph can be built, saved and planned on a machine
without torch, and no fx.Node survives into it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # networkx costs ~0.3 s to import; only to_networkx needs it
    import networkx as nx

#: Node kinds used by the tracer, the cost models and the planner.
NODE_KINDS = (
    "input",  # placeholder
    "output",  # graph output
    "embedding",  # nn.Embedding lookup
    "linear",  # nn.Linear / HF Conv1D / F.linear (has attrs in_features, out_features)
    "attention",  # scaled-dot-product attention core (no weights)
    "matmul",  # other matmul / bmm without weights
    "norm",  # LayerNorm / RMSNorm
    "activation",  # gelu / silu / relu / softmax ...
    "elementwise",  # add / mul / dropout ...
    "reshape",  # view / transpose / split / getitem / contiguous ...: moves no data, forwards sharding
    "loss",  # cross entropy and friends
    "constant",  # get_attr buffers (rotary tables, masks)
    "moe",  # a mixture-of-experts block captured whole (router + experts; attrs num_experts, top_k, ...)
    "other",
)


@dataclass
class GraphNode:
    """One node of the traced graph, annotated for costing.

    Sizes are per *traced* batch (``ModelGraph.batch_size`` sequences of ``seq_len``).
    """

    id: int  # position in topological order, 0-based
    name: str  # fx node name, unique, stable across re-tracing the same model
    op: str  # fx op: placeholder | call_module | call_function | call_method | get_attr | output
    kind: str  # one of NODE_KINDS
    target: str  # module class name or function/op name, for people and structural hashing
    module_fqn: str | None = None  # owning leaf module, e.g. "blocks.0.attn.q_proj"
    scope: str = ""  # innermost module whose forward produced the node, e.g. "blocks.0.attn"
    block: str | None = None  # repeated-block instance prefix it belongs to, e.g. "blocks.0"
    inputs: tuple[int, ...] = ()  # ids of the nodes whose outputs this node reads
    out_shape: tuple[int, ...] | None = None  # first tensor output's shape
    out_dtype: str | None = None  # e.g. "float32", "bfloat16", "int64"
    out_bytes: int = 0  # bytes of all tensor outputs
    out_tensor: bool = True  # the output is exactly one tensor (a pipeline stage can send it)
    param_names: tuple[str, ...] = ()  # parameters this node reads (FQNs as in named_parameters)
    param_numel: int = 0  # parameters counted at this node (a tied parameter only at first use)
    param_bytes: int = 0  # bytes of those parameters
    shared_params: tuple[str, ...] = ()  # params read here that are tied/shared with another node
    frozen_param_numel: int = 0  # of param_numel, those with requires_grad False
    frozen_params: tuple[str, ...] = ()  # of param_names, those with requires_grad False (at every use)
    fwd_flops: int = 0  # forward FLOPs (FlopCounterMode convention: 2 per multiply-add)
    saved_bytes: int = 0  # bytes this node saves for backward (inputs it needs in autograd)
    attrs: dict[str, Any] = field(default_factory=dict)  # in_features, out_features, num_heads, ...

    @property
    def is_compute(self) -> bool:
        return self.kind not in ("input", "output", "constant", "reshape")

    @property
    def trains_weight(self) -> bool:
        """Whether the backward computes a weight gradient at this node: it reads a parameter that
        requires grad, whichever node counts it. A node counting parameters trains one when they are
        not all frozen; one counting none that reads parameters counted at another node (a tied LM
        head reads the embedding's weight; a module called a second time reads its own) when one of
        them is not in ``frozen_params``: torch computes dW = dYᵀ·X at every use and sums the uses."""
        if self.param_numel:
            return self.param_numel > self.frozen_param_numel
        return any(p not in self.frozen_params for p in self.param_names)


@dataclass
class BlockType:
    """A repeated structure: one block type × len(instances).

    ``instances`` are module prefixes (e.g. ``"blocks.0"``) in order;
    ``node_ranges`` the [start, end) id range of each instance, contiguous in topological order.
    """

    type_id: str  # structural hash
    module_class: str  # e.g. "Block", "GPT2Block"
    instances: tuple[str, ...]
    node_ranges: tuple[tuple[int, int], ...]

    @property
    def count(self) -> int:
        return len(self.instances)


@dataclass
class CutPoint:
    """A candidate pipeline cut after node ``after`` (cut between ids after and after+1).

    ``crossing`` lists every node whose output is produced at or before ``after`` and read
    after it (residual stream, masks, rotary tables, ...), ``crossing_bytes`` their total bytes:
    what a pipeline stage sends the next. Model inputs are not in it: every stage reads the
    inputs its nodes consume from the batch by keyword (the runtime's ``split.StagePiece.reads``).
    ``at_block_boundary`` is true where the cut falls between two repeated-block instances
    (or between the pre-block part and the first block / the last block and the head).
    """

    after: int
    crossing: tuple[int, ...]
    crossing_bytes: int
    at_block_boundary: bool = False


@dataclass
class ModelGraph:
    """The annotated graph of one model at one traced input size."""

    model_name: str
    capture: str  # "fx" or "export"
    batch_size: int  # sequences in the traced input
    seq_len: int  # tokens per sequence (1 for non-sequence models)
    nodes: list[GraphNode]
    edges: list[tuple[int, int, int]]  # (src id, dst id, tensor bytes)
    blocks: list[BlockType] = field(default_factory=list)
    cut_points: list[CutPoint] = field(default_factory=list)
    param_count: int = 0  # exact, tied parameters once
    param_bytes: int = 0
    trainable_param_count: int = 0
    tied_params: list[tuple[str, ...]] = field(default_factory=list)  # groups of FQNs sharing storage
    meta: dict[str, Any] = field(default_factory=dict)  # hidden, num_heads, num_kv_heads, vocab, ...

    # ---- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[GraphNode]:
        return iter(self.nodes)

    def node(self, node_id: int) -> GraphNode:
        return self.nodes[node_id]

    def by_name(self, name: str) -> GraphNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in graph of {self.model_name}")

    def nodes_of_kind(self, *kinds: str) -> list[GraphNode]:
        return [n for n in self.nodes if n.kind in kinds]

    def nodes_in(self, start: int, end: int) -> list[GraphNode]:
        return self.nodes[start:end]

    @property
    def total_fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def fwd_flops_per_token(self) -> float:
        return self.total_fwd_flops / max(1, self.tokens)

    def successors(self, node_id: int) -> list[int]:
        return [d for s, d, _ in self.edges if s == node_id]

    def to_networkx(self) -> nx.DiGraph:
        """A networkx DiGraph: nodes keyed by id with every GraphNode field as attributes,
        edges with ``bytes``."""
        import networkx as nx

        g = nx.DiGraph(model_name=self.model_name, capture=self.capture)
        for n in self.nodes:
            g.add_node(n.id, **asdict(n))
        for s, d, b in self.edges:
            g.add_edge(s, d, bytes=b)
        return g

    def block_of(self, node_id: int) -> tuple[BlockType, int] | None:
        """(block type, instance index) holding ``node_id``, or None."""
        for bt in self.blocks:
            for i, (a, b) in enumerate(bt.node_ranges):
                if a <= node_id < b:
                    return bt, i
        return None

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelGraph:
        d = dict(d)
        d["nodes"] = [_node_from_dict(n) for n in d["nodes"]]
        d["edges"] = [tuple(e) for e in d["edges"]]
        d["blocks"] = [
            BlockType(
                type_id=b["type_id"],
                module_class=b["module_class"],
                instances=tuple(b["instances"]),
                node_ranges=tuple(tuple(r) for r in b["node_ranges"]),
            )
            for b in d.get("blocks", [])
        ]
        d["cut_points"] = [
            CutPoint(
                after=c["after"],
                crossing=tuple(c["crossing"]),
                crossing_bytes=c["crossing_bytes"],
                at_block_boundary=c.get("at_block_boundary", False),
            )
            for c in d.get("cut_points", [])
        ]
        d["tied_params"] = [tuple(t) for t in d.get("tied_params", [])]
        return cls(**d)

    def to_json(self) -> str:
        """``json.dumps(self.to_dict())``, without ``asdict``'s deep copy of every node (5x faster
        on an 80-layer graph; the text is the same)."""
        return json.dumps(self, default=_fields_of)

    @classmethod
    def from_json(cls, s: str) -> ModelGraph:
        return cls.from_dict(json.loads(s))


def _fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass as the dict ``asdict`` gives one level down (json encodes the rest)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in fields(obj)}
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def _node_from_dict(d: dict[str, Any]) -> GraphNode:
    d = dict(d)
    for k in ("inputs", "param_names", "shared_params", "frozen_params"):
        d[k] = tuple(d.get(k, ()))
    if d.get("out_shape") is not None:
        d["out_shape"] = tuple(d["out_shape"])
    return GraphNode(**d)


def live_tensors_after(nodes: Iterable[GraphNode], after: int) -> list[int]:
    """Ids of nodes produced at or before ``after`` and read by a node after it."""
    live = set()
    for n in nodes:
        if n.id > after:
            live.update(i for i in n.inputs if i <= after)
    return sorted(live)


def expert_shape(hidden: int, expert_numel: float, expert_act_numel: float) -> tuple[int, float]:
    """(m, F) of a MoE node's experts (its attrs ``hidden``, ``expert_numel``, ``expert_act_numel``):
    an expert's weight matrices and their inner width, from ``expert_numel = m·H·F`` and
    ``expert_act_numel = m·(H + F)``; (1, expert_numel / H) when they do not fit that form. Here,
    below both the tracer (``tracing.moe.moe_saved_bytes``) and the cost models
    (``cost_models.moe_kernels``, ``cost_models.engine_saves``) that read it."""
    if hidden <= 0 or expert_numel <= 0:
        raise ValueError(f"hidden and expert_numel must be > 0, got {hidden!r}, {expert_numel!r}")
    m = round((expert_act_numel - expert_numel / hidden) / hidden) if expert_act_numel else 0
    if m < 1 or abs(m * hidden + expert_numel / hidden - expert_act_numel) > 0.01 * expert_act_numel:
        return 1, expert_numel / hidden
    return m, expert_numel / (m * hidden)


def expert_saved_numel(hidden: int, expert_numel: float, expert_act_numel: float) -> float:
    """Elements one routed token keeps for backward inside an eager MoE block's experts (the block
    as written: the zoo's ``GroupedExperts``, HF Mixtral / Qwen-MoE experts; meshplan's runtime runs
    the user's block), with ``(m, F) = graph.expert_shape(...)`` (m weight matrices ``H × F``):

    - ``H``: the routed token (``x[tok]``), kept once by every input projection that reads it;
    - ``(m − 1)·F``: each input projection's output (the activation's input; a gated unit's ``up``,
      the product's operand);
    - ``F`` more for a gated unit (m ≥ 3): the activation's output, the product's other operand;
    - ``F``: the down projection's input;
    - ``2·H``: the expert's output, kept by its product with the routing weight (the weight needs
      its gradient), and that product, kept by ``index_add_`` (its derivative formula reads
      ``source``; torch ``tools/autograd/derivatives.yaml``).

    Gated (SwiGLU): ``3H + 4F``; a plain MLP: ``3H + 2F``. Checked against ``saved_tensors_hooks``
    on the zoo block (``tests/test_moe_capture.py``). Here beside ``expert_shape`` for the tracer
    (``tracing.moe.moe_saved_bytes``) and the cost models; what an engine's fused kernels keep
    instead is ``cost_models.engine_saves.moe_saved_delta``. A node that does not fit the m-matrix form keeps
    its matrices' inputs and outputs (``expert_act_numel``)."""
    if not hidden or not expert_numel:
        return float(expert_act_numel)
    m, f = expert_shape(hidden, expert_numel, expert_act_numel)
    if m < 2:
        return float(expert_act_numel)
    return hidden + (m - 1) * f + (f if m >= 3 else 0.0) + f + 2 * hidden
