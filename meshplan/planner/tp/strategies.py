"""Strategies of one node in the TP placement ILP (``tp.ilp``) and the transitions the runtime realizes.

Strategies ``k ∈ K(n)`` of a node ``n`` (each fixes the state every input must arrive in and the
state of its output; ``shard(k)`` divides its work)::

    linear       colwise R→S (t) · rowwise S→P (t) · replicate R→R (1)
    embedding    rowwise (vocab-parallel) R→P (t) · replicate R→R (1); a tied token embedding and
                 its head are sharded alike or not at all (``tp.ilp.add_tied``: embedding rowwise iff
                 head colwise, one Shard(0) Parameter as ``runtime/tp.retie`` runs it); under the engines' layout (``vocab_parallel``: Megatron's VocabParallelEmbedding,
                 torchtitan's RowwiseParallel tok_embeddings) the token embedding is rowwise only;
                 an Embedding subclass with its own forward (``own_forward``: OPT's learned
                 positions, which compute their indices) replicate only
    attention    heads S→S (t; needs t | heads, t | kv_heads, no per-head mask/bias input) · R→R (1)
    matmul       S→S (t) · R→R (1)
    reshape      s→s for s ∈ {R, S, P, Q}; a split/chunk that cuts the sharded feature dim (a
                 fused qkv [B, T, 3h] split along h) keeps neither S nor P
    elementwise  s→s for s ∈ {R, S, Q} (all full-size inputs alike; broadcast inputs exempt);
                 not S on the residual stream [B, T, hidden] (torch's styles keep it whole or,
                 with sequence parallelism, sequence-sharded)
    activation   s→s for s ∈ {R, S, Q}
    norm         R→R (1) · Q→Q (t, sequence parallel)
    moe          R→R (1: meshplan's runtime replicates the MoE block over tp); under an engine's MoE
                 parallel folding (``moe_folding``, Megatron-Core ETP 1 with sequence parallelism)
                 Q→Q (t) only: each rank routes and computes its sequence shard's tokens
    output       R→R · S→S when it returns an LM head's logits (vocab-parallel loss)
    others       R→R (loss, other, input, constant)

A transition in ``tp.types.TRANSITIONS`` is used on an edge u→v only where torch's TP styles
perform it (``TPStrategies._runs``): R→S only into a rowwise linear (it slices its whole input),
S→R only out of a colwise linear, through views (its output gathered). No torch import.
"""

from __future__ import annotations

from meshplan.graph import GraphNode, ModelGraph
from meshplan.planner.tp.types import SPLIT_TARGETS, TRANSITIONS, Strategy, shape_numel


class TPStrategies:
    """Strategy enumeration and edge rules; ``TPPlacementILP`` builds the ILP on them."""

    g: ModelGraph
    tp: int
    sp: bool
    hidden: int
    boundary: str
    idset: set[int]
    vocab_parallel: bool = False  # the engines' layout: the token embedding always vocab-parallel
    moe_folding: bool = False  # Megatron-Core's MoE parallel folding: a MoE block on the sequence shard

    def _heads_ok(self) -> bool:
        heads = int(self.g.meta.get("num_heads") or 0)
        kv = int(self.g.meta.get("num_kv_heads") or heads)
        return heads > 0 and heads % self.tp == 0 and kv % self.tp == 0

    def _head_bias(self, n: GraphNode) -> bool:
        """An attention mask/bias with one slice per head (T5's relative position bias [1, heads, q, k]):
        sharding the heads would need that input sliced too, which torch's TP styles do not do."""
        heads = int(n.attrs.get("num_heads") or 0)
        for i in n.inputs[3:]:
            shape = self.g.nodes[i].out_shape
            if heads > 1 and shape and len(shape) >= 3 and shape[-3] == heads:
                return True
        return False

    def _seq_ok(self) -> bool:
        """Q (sequence-sharded) states exist only with sequence parallelism on."""
        return self.sp and self.g.seq_len % self.tp == 0 and self.g.seq_len > 1

    def node_strategies(self, n: GraphNode) -> list[Strategy]:
        t = self.tp
        rep = Strategy("replicate", "R", "R", 1, "replicate" if n.kind in ("linear", "embedding") else None)
        if t == 1:
            return [rep]
        k = n.kind
        seq_ok = self._seq_ok()
        if k == "linear":
            out: list[Strategy] = [rep]
            fin, fout = n.attrs.get("in_features"), n.attrs.get("out_features")
            if fout is None or fout % t == 0:
                out.append(Strategy("colwise", "R", "S", t, "colwise"))
            if fin is None or fin % t == 0:
                out.append(Strategy("rowwise", "S", "P", t, "rowwise"))
            return out
        if k == "embedding":
            vocab = n.attrs.get("num_embeddings")
            # an Embedding subclass computing its own indices (OPT's learned positions) stays whole:
            # torch's RowwiseParallel shards the lookup of the module's first input, not of those
            ok = (vocab is None or vocab % t == 0) and not n.attrs.get("own_forward")
            row = Strategy("rowwise", "R", "P", t, "rowwise")
            if ok and self.vocab_parallel and vocab and vocab == int(self.g.meta.get("vocab") or 0):
                return [row]
            return [rep] + ([row] if ok else [])
        if k == "matmul":
            return [rep, Strategy("heads", "S", "S", t)]
        if k == "attention":
            return [rep] + ([Strategy("heads", "S", "S", t)] if self._heads_ok() and not self._head_bias(n) else [])
        if k == "reshape":
            states = ["R"] + (["Q"] if seq_ok else [])
            if self._keeps_shard(n):  # a split of a partial-sum tensor would need per-piece reductions
                states[1:1] = ["S", "P"]
            return [Strategy(f"pass-{s}", s, s, 1) for s in states]
        if k in ("elementwise", "activation"):
            out = [Strategy("pass-R", "R", "R", 1)]
            if not self._is_stream(n):  # the residual stream is never hidden-sharded (torch styles)
                out.append(Strategy("pass-S", "S", "S", t))
            if seq_ok:
                out.append(Strategy("pass-Q", "Q", "Q", t))
            return out
        if k == "norm":
            return [rep] + ([Strategy("seq", "Q", "Q", t)] if seq_ok else [])
        if k == "moe" and self.moe_folding and seq_ok:  # folded: no gather around it, 1/t of its tokens
            return [Strategy("seq", "Q", "Q", t)]
        if k == "output" and self._vocab_logits(n):  # loss_parallel: logits stay vocab-sharded
            return [rep, Strategy("vocab", "S", "S", 1)]
        return [rep]

    def _vocab_logits(self, n: GraphNode) -> bool:
        """The graph returns an untied LM head's output directly (a linear of ``vocab`` features,
        t | vocab): the runtime computes the loss on the vocab-sharded logits
        (``runtime/apply/loss_parallel.py``, torch ``loss_parallel``; Megatron's vocab-parallel
        cross-entropy) instead of gathering them; a tied head too (sharded with its embedding,
        ``runtime/tp.retie``)."""
        vocab = int(self.g.meta.get("vocab") or 0)
        if len(n.inputs) != 1 or not vocab or vocab % self.tp:
            return False
        src = self.g.nodes[n.inputs[0]]
        return src.kind == "linear" and src.attrs.get("out_features") == vocab

    def _keeps_shard(self, n: GraphNode) -> bool:
        """A view/transpose keeps S; a split/chunk keeps it only when it does not cut the
        sharded feature dim: it splits another dim (last dim unchanged) or inside the head
        dim of an already head-separated (rank ≥ 4) tensor. Splitting a fused qkv output
        [B, T, 3h] along h would hand each rank the wrong pieces."""
        if not any(s in n.target.lower() for s in SPLIT_TARGETS):
            return True
        src = next((self.g.nodes[i] for i in n.inputs if self.g.nodes[i].out_shape), None)
        if src is None or not n.out_shape:
            return False
        return src.out_shape[-1] == n.out_shape[-1] or len(src.out_shape) >= 4

    def _exempt(self, n: GraphNode, src: int) -> bool:
        """Inputs that need no state agreement: buffers, ids, broadcast operands."""
        p = self.g.nodes[src]
        if p.kind in ("constant",) or (p.kind == "input" and n.kind == "embedding"):
            return True
        if not p.out_shape or not p.out_bytes or not n.out_shape:  # shapes, sizes, ints: metadata
            return True
        if n.kind == "attention" and src in n.inputs[3:]:  # a mask broadcast over heads (per-head: no heads strategy)
            return True
        if n.kind in ("elementwise", "activation") and p.out_shape:
            # a broadcast operand (rotary table, mask, scale) next to a full-size one; a lone
            # input that grows (repeat_interleave of kv heads, expand) is not exempt
            sizes = [shape_numel(self.g.nodes[i].out_shape) for i in n.inputs if self.g.nodes[i].out_shape]
            return len(sizes) > 1 and shape_numel(p.out_shape) < max(sizes)
        return False

    def _external_state(self, src: int) -> str:
        """State in which a tensor produced outside the segment arrives."""
        p = self.g.nodes[src]
        return self.boundary if self._is_stream(p) else "R"

    def _is_stream(self, p: GraphNode) -> bool:
        """Residual-stream-shaped tensor (batch, seq, hidden): what flows between blocks."""
        if p.kind in ("input", "constant") or not p.out_shape or len(p.out_shape) < 2:
            return False
        return not self.hidden or p.out_shape[-1] == self.hidden


    def _runs(self, u: int, a: str, b: str, v: int) -> bool:
        """Whether the runtime realizes a→b on the edge u→v: besides ``TRANSITIONS``, a replicated
        tensor is sliced to S only by a rowwise linear taking a whole input, and an S tensor is
        gathered only as a colwise linear's output (through views)."""
        if (a, b) not in TRANSITIONS:
            return False
        if (a, b) == ("R", "S"):
            return self.g.nodes[v].kind == "linear"
        if (a, b) == ("S", "R"):
            return self._view_of_linear(u)
        return True

    def _view_of_linear(self, u: int) -> bool:
        """``u`` is a linear or a chain of views of one (what ``ColwiseParallel`` can gather)."""
        for _ in range(64):
            n = self.g.nodes[u]
            if n.kind == "linear":
                return True
            data = [i for i in n.inputs if self.g.nodes[i].out_shape and self.g.nodes[i].out_bytes]
            if n.kind != "reshape" or len(data) != 1:
                return False
            u = data[0]
        return False

    def _exit_state(self, n: GraphNode) -> str:
        return self.boundary if self._is_stream(n) else "R"
