"""Hand-built ModelGraphs for the planner tests (no torch, no tracer): an MLP and a GPT-shaped
decoder with the node kinds, shapes, FLOPs, parameter and saved bytes the tracer records."""

from __future__ import annotations

from meshplan.graph import BlockType, CutPoint, GraphNode, ModelGraph, live_tensors_after

E = 2  # bytes per element (bf16 traces)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[GraphNode] = []

    def add(
        self,
        kind: str,
        target: str,
        inputs: tuple[int, ...],
        shape: tuple[int, ...],
        *,
        fqn=None,
        scope="",
        block=None,
        params=0,
        flops=0,
        saved=0,
        dtype="bfloat16",
        attrs=None,
        pnames=(),
        shared=(),
    ) -> int:
        nid = len(self.nodes)
        numel = 1
        for d in shape:
            numel *= d
        eb = 8 if dtype == "int64" else E
        self.nodes.append(
            GraphNode(
                id=nid,
                name=f"n{nid}_{target}",
                op="call_module" if fqn else "call_function",
                kind=kind,
                target=target,
                module_fqn=fqn,
                scope=scope,
                block=block,
                inputs=inputs,
                out_shape=shape,
                out_dtype=dtype,
                out_bytes=numel * eb,
                param_names=tuple(pnames),
                param_numel=params,
                param_bytes=params * E,
                shared_params=tuple(shared),
                fwd_flops=flops,
                saved_bytes=saved,
                attrs=attrs or {},
            )
        )
        return nid

    def graph(self, name: str, batch: int, seq: int, blocks=(), meta=None, tied=()) -> ModelGraph:
        edges = [(i, n.id, self.nodes[i].out_bytes) for n in self.nodes for i in n.inputs]
        bounds = set()
        for bt in blocks:
            for a, b in bt.node_ranges:
                bounds.update({a - 1, b - 1})
        cuts = []
        for after in range(len(self.nodes) - 1):
            live = live_tensors_after(self.nodes, after)
            cuts.append(
                CutPoint(after, tuple(live), sum(self.nodes[i].out_bytes for i in live), after in bounds)
            )
        pc = sum(n.param_numel for n in self.nodes)
        return ModelGraph(
            name,
            "fx",
            batch,
            seq,
            self.nodes,
            edges,
            list(blocks),
            cuts,
            pc,
            pc * E,
            pc,
            [tuple(t) for t in tied],
            dict(meta or {}),
        )


def linear(b: _Builder, x: int, fin: int, fout: int, lead: tuple[int, ...], fqn: str, block=None) -> int:
    tokens = 1
    for d in lead:
        tokens *= d
    return b.add(
        "linear",
        "Linear",
        (x,),
        (*lead, fout),
        fqn=fqn,
        block=block,
        params=fin * fout + fout,
        flops=2 * tokens * fin * fout,
        saved=tokens * fin * E,
        attrs={"in_features": fin, "out_features": fout},
        pnames=(f"{fqn}.weight", f"{fqn}.bias"),
    )


def mlp_graph(
    batch: int = 8, seq: int = 2048, d: int = 4096, hidden: int = 16384, layers: int = 2
) -> ModelGraph:
    """Input [B, T, d] -> (Linear -> GELU) x (layers-1) -> Linear -> output; FQNs layers.0, layers.2, ..."""
    b = _Builder()
    lead = (batch, seq)
    x = b.add("input", "x", (), (*lead, d))
    dims = [d] + [hidden] * (layers - 1) + [d]
    for i in range(layers):
        x = linear(b, x, dims[i], dims[i + 1], lead, f"layers.{2 * i}")
        if i < layers - 1:
            n = batch * seq * dims[i + 1]
            x = b.add("activation", "gelu", (x,), (*lead, dims[i + 1]), flops=8 * n, saved=n * E)
    b.add("output", "output", (x,), (*lead, d))
    return b.graph("mlp", batch, seq, meta={"hidden": d})


def lone_linear_graph(batch: int = 8, seq: int = 1024, d: int = 768) -> ModelGraph:
    """input -> Linear(d, d) -> LayerNorm -> output."""
    b = _Builder()
    lead = (batch, seq)
    x = b.add("input", "x", (), (*lead, d))
    y = linear(b, x, d, d, lead, "proj")
    n = b.add(
        "norm",
        "LayerNorm",
        (y,),
        (*lead, d),
        fqn="ln",
        params=2 * d,
        flops=5 * batch * seq * d,
        saved=batch * seq * d * E,
    )
    b.add("output", "output", (n,), (*lead, d))
    return b.graph("lone", batch, seq, meta={"hidden": d})


def gpt_graph(
    layers: int = 4,
    h: int = 1024,
    heads: int = 16,
    seq: int = 1024,
    batch: int = 1,
    vocab: int = 32768,
    kv_heads: int | None = None,
    ffn: int | None = None,
    heavy: dict[int, float] | None = None,
) -> ModelGraph:
    """A GPT-shaped decoder: wte + wpe, ``layers`` blocks (ln_1, q/k/v, SDPA, o_proj, add, ln_2,
    fc_in, gelu, fc_out, add), ln_f, tied lm_head. ``heavy`` scales one block's FLOPs."""
    ffn = ffn or 4 * h
    kv_heads = kv_heads or heads
    b = _Builder()
    lead = (batch, seq)
    tok = batch * seq
    ids = b.add("input", "idx", (), lead, dtype="int64")
    pos = b.add("constant", "arange", (), (seq,), dtype="int64")
    we = b.add(
        "embedding",
        "Embedding",
        (ids,),
        (*lead, h),
        fqn="wte",
        params=vocab * h,
        pnames=("wte.weight",),
        attrs={"num_embeddings": vocab},
        saved=tok * 8,
    )
    pe = b.add(
        "embedding",
        "Embedding",
        (pos,),
        (seq, h),
        fqn="wpe",
        params=seq * h,
        pnames=("wpe.weight",),
        attrs={"num_embeddings": seq},
    )
    x = b.add("elementwise", "add", (we, pe), (*lead, h), flops=tok * h)
    ranges, insts = [], []
    hd = h // heads
    for i in range(layers):
        p = f"blocks.{i}"
        start = len(b.nodes)
        f = (heavy or {}).get(i, 1.0)
        ln1 = b.add(
            "norm",
            "LayerNorm",
            (x,),
            (*lead, h),
            fqn=f"{p}.ln_1",
            block=p,
            params=2 * h,
            flops=5 * tok * h,
            saved=tok * h * E,
            pnames=(f"{p}.ln_1.weight",),
        )
        qkv = []
        for nm, width in (("q_proj", h), ("k_proj", hd * kv_heads), ("v_proj", hd * kv_heads)):
            y = linear(b, ln1, h, width, lead, f"{p}.attn.{nm}", block=p)
            b.nodes[y].fwd_flops = int(b.nodes[y].fwd_flops * f)
            y = b.add("reshape", "view", (y,), (batch, seq, width // hd, hd), block=p)
            y = b.add("reshape", "transpose", (y,), (batch, width // hd, seq, hd), block=p)
            qkv.append(y)
        att = b.add(
            "attention",
            "scaled_dot_product_attention",
            tuple(qkv),
            (batch, heads, seq, hd),
            block=p,
            flops=int(4 * batch * seq * seq * h * f),
            saved=4 * tok * h * E,
        )
        y = b.add("reshape", "transpose", (att,), (batch, seq, heads, hd), block=p)
        y = b.add("reshape", "reshape", (y,), (*lead, h), block=p)
        o = linear(b, y, h, h, lead, f"{p}.attn.o_proj", block=p)
        x = b.add("elementwise", "add", (x, o), (*lead, h), block=p, flops=tok * h)
        ln2 = b.add(
            "norm",
            "LayerNorm",
            (x,),
            (*lead, h),
            fqn=f"{p}.ln_2",
            block=p,
            params=2 * h,
            flops=5 * tok * h,
            saved=tok * h * E,
            pnames=(f"{p}.ln_2.weight",),
        )
        u = linear(b, ln2, h, ffn, lead, f"{p}.mlp.fc_in", block=p)
        b.nodes[u].fwd_flops = int(b.nodes[u].fwd_flops * f)
        g = b.add("activation", "gelu", (u,), (*lead, ffn), block=p, flops=8 * tok * ffn, saved=tok * ffn * E)
        dn = linear(b, g, ffn, h, lead, f"{p}.mlp.fc_out", block=p)
        b.nodes[dn].fwd_flops = int(b.nodes[dn].fwd_flops * f)
        x = b.add("elementwise", "add", (x, dn), (*lead, h), block=p, flops=tok * h)
        ranges.append((start, len(b.nodes)))
        insts.append(p)
    lnf = b.add(
        "norm",
        "LayerNorm",
        (x,),
        (*lead, h),
        fqn="ln_f",
        params=2 * h,
        flops=5 * tok * h,
        saved=tok * h * E,
        pnames=("ln_f.weight",),
    )
    head = b.add(
        "linear",
        "Linear",
        (lnf,),
        (*lead, vocab),
        fqn="lm_head",
        flops=2 * tok * h * vocab,
        saved=tok * h * E,
        attrs={"in_features": h, "out_features": vocab},
        pnames=("wte.weight",),
        shared=("wte.weight",),
    )
    b.add("output", "output", (head,), (*lead, vocab))
    for i, (a, e) in enumerate(ranges):
        for nid in range(a, e):
            b.nodes[nid].block = insts[i]
    bt = BlockType("blk", "Block", tuple(insts), tuple(ranges)) if not heavy else None
    blocks = [bt] if bt else [BlockType(f"blk{i}", "Block", (insts[i],), (ranges[i],)) for i in range(layers)]
    meta = {
        "hidden": h,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "num_layers": layers,
        "vocab": vocab,
        "ffn_hidden": ffn,
        "head_dim": hd,
    }
    return b.graph(
        "gpt-fixture", batch, seq, blocks=blocks, meta=meta, tied=[("wte.weight", "lm_head.weight")]
    )


def fused_qkv_graph(batch: int = 4, seq: int = 2048, h: int = 4096, heads: int = 32) -> ModelGraph:
    """input -> Linear(h, 3h) "qkv" -> split(h) -> q, k, v -> SDPA -> Linear(h, h) "proj" -> output,
    the HF GPT-2 shape (fused c_attn) where a colwise qkv would hand each rank the wrong pieces."""
    b = _Builder()
    lead = (batch, seq)
    tok = batch * seq
    hd = h // heads
    x = b.add("input", "x", (), (*lead, h))
    qkv = linear(b, x, h, 3 * h, lead, "qkv")
    sp = b.add("reshape", "split", (qkv,), (*lead, h))
    parts = []
    for _ in range(3):
        g = b.add("reshape", "getitem", (sp,), (*lead, h))
        g = b.add("reshape", "view", (g,), (batch, seq, heads, hd))
        parts.append(b.add("reshape", "transpose", (g,), (batch, heads, seq, hd)))
    att = b.add("attention", "scaled_dot_product_attention", tuple(parts), (batch, heads, seq, hd),
                flops=4 * batch * seq * seq * h, saved=4 * tok * h * E)  # fmt: skip
    y = b.add("reshape", "transpose", (att,), (batch, seq, heads, hd))
    y = b.add("reshape", "reshape", (y,), (*lead, h))
    o = linear(b, y, h, h, lead, "proj")
    b.add("output", "output", (o,), (*lead, h))
    return b.graph("fused", batch, seq, meta={"hidden": h, "num_heads": heads, "num_kv_heads": heads})


def linear_node(tokens: int, fin: int, fout: int) -> GraphNode:
    """One bf16 linear node of ``tokens`` rows, ``fin`` -> ``fout`` features (kernel-level cost tests)."""
    return GraphNode(
        id=1, name="fc", op="call_module", kind="linear", target="Linear", module_fqn="fc", inputs=(0,),
        out_shape=(tokens, fout), out_dtype="bfloat16", out_bytes=tokens * fout * 2, param_numel=fin * fout,
        param_bytes=fin * fout * 2, fwd_flops=2 * tokens * fin * fout, attrs={"in_features": fin, "out_features": fout},
    )  # fmt: skip
