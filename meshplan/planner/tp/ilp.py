"""Tensor-parallel placement ILP: which linear runs colwise / rowwise / replicate, per block type.

One ILP is built for one *segment* of the graph: one instance of a repeated block type (the
answer is reused for every instance) or the non-block parts (embedding, final norm, head)
together. The solver sees numbers only: per-node strategy costs and per-edge resharding costs.

Sharding states of an activation (on the TP group of ``t`` ranks)::

    R  replicated              every rank holds the whole tensor
    S  sharded on hidden/heads colwise output, attention heads (last or head dim split in t)
    P  partial sums            rowwise output before its reduction
    Q  sequence-sharded        sequence parallelism (Korthikanti et al. 2022) for norms/residual

Strategies ``k ∈ K(n)`` of a node and the transitions the runtime realizes: ``tp.strategies``.

Variables::

    x[n,k] ∈ {0,1}        node n runs strategy k
    w[u,a,b] ∈ [0,1]      u's output, produced in state a, is converted to state b for some
                          consumer (paid once however many consumers read it)
    X_out(u,a) = Σ_{k: out(k)=a} x[u,k],   X_in(v,b) = Σ_{k: in(k)=b} x[v,k]

Objective (seconds per microbatch, forward + backward)::

    min  Σ_n Σ_k x[n,k]·(T_fwd + T_bwd_in + T_bwd_w)(n, shard(k))
       + Σ_(u,a,b) w[u,a,b]·2·C(a→b, bytes(u))             backward comm mirrors forward
       + λ · Σ_n Σ_k x[n,k]·param_bytes(n)/shard_w(k)       small memory term

with ``C`` the cost model's collective time plus one kernel launch (``kernel_floor_s``, so a
single all-reduce beats an equal-volume reduce-scatter + all-gather pair): P→R all-reduce,
P→Q reduce-scatter, S→R and Q→R all-gather, R→S and R→Q a free local slice, a→a free. Only
transitions torch's TP styles express exist (RowwiseParallel's output all-reduce or sequence
reduce-scatter, ColwiseParallel's output gather, SequenceParallel's gather and slice); P
passes through views but not through a split (each piece would need its own reduction).

Constraint families (names ``<family>__<index>``, see ``meshplan.ilp``)::

    one_strategy   Σ_k x[n,k] = 1                                    ∀ n
    edge_allowed   X_out(u,a) + X_in(v,b) ≤ 1          ∀ edges u→v, pairs (a,b) with no transition
    reshard        w[u,a,b] ≥ X_out(u,a) + X_in(v,b) − 1   ∀ edges u→v, costly pairs (a,b)
    boundary_in    inputs from outside the segment arrive in the boundary state (R, or Q with
                   sequence parallelism): x[v,k] = 0 for k needing a state it cannot reach
    boundary_reshard  w[u,a,b] ≥ x[v,k] for an external u (fixed state a) and k needing b
    boundary_out   segment outputs leave in the boundary state: x[u,k] = 0 for other out(k)
    tied           an embedding and a linear sharing a weight shard it alike:
                   x[emb,rowwise] = x[lin,colwise]
    tp_group       coherent groups (``tp.groups``: attention q/k/v + output projection, MLP up
                   projections + down projection): g ∈ {0,1} per group, Σ_{k colwise} x[p,k] = g
                   for producers p, Σ_{k rowwise} x[c,k] = g for consumers c, g = 0 when the
                   group has a blocker; x[n,rowwise] = 0 for a linear that is no group's consumer;
                   with sequence parallelism g = 1 for a group inside a traced block that may be
                   sharded (the runtime's SP rule: no replicated linear inside a block)

Blocks chain because every block instance starts and ends in the same boundary state.
The rows depend on the segment, the TP degree and the layout flags only: they are built once per
key (``TPPlacementILP.build``, kept in the shared ``tp.groups.GraphIndex``) and each microbatch
bucket / dtype / cluster sets its own objective on them. No torch import.
"""

from __future__ import annotations

import time

import pulp

from meshplan.cost_models.compute import elem_scale
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import GraphNode, ModelGraph
from meshplan.planner.tp.groups import GraphIndex, TPGroup
from meshplan.planner.tp.strategies import TPStrategies
from meshplan.planner.tp.types import (
    MEM_WEIGHT_S_PER_BYTE,
    STATES,
    TRANSITIONS,
    Strategy,
    TPSolution,
    collective_passes,
    collective_time,
)

__all__ = ["MEM_WEIGHT_S_PER_BYTE", "STATES", "TRANSITIONS", "Strategy", "TPSolution", "TPPlacementILP",
           "solve_segment", "collective_time"]

_LE, _EQ, _GE = pulp.LpConstraintLE, pulp.LpConstraintEQ, pulp.LpConstraintGE

class TPPlacementILP(TPStrategies):
    """Builds and solves the placement ILP of one segment (a list of consecutive nodes)."""

    def __init__(
        self,
        graph: ModelGraph,
        node_ids: list[int],
        tp: int,
        cluster: ClusterSpec,
        *,
        sequence_parallel: bool = False,
        batch_scale: float = 1.0,
        dtype: str = "bf16",
        mem_weight_s_per_byte: float = MEM_WEIGHT_S_PER_BYTE,
        name: str = "tp",
        vocab_parallel: bool = False,
        moe_folding: bool = False,
        index: GraphIndex | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.g = graph
        self.ids = list(node_ids)
        self.idset = set(self.ids)
        self.tp = tp
        self.cluster = cluster
        self.sp = sequence_parallel
        self.batch_scale = batch_scale
        self.dtype = dtype
        self.lam = mem_weight_s_per_byte
        self.vocab_parallel = vocab_parallel
        self.moe_folding = moe_folding
        self.boundary = "Q" if sequence_parallel else "R"
        self.hidden = int(graph.meta.get("hidden") or 0)
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        self.x: dict[tuple[int, int], pulp.LpVariable] = {}
        self.w: dict[tuple[int, str, str], pulp.LpVariable] = {}
        self.strategies: dict[int, list[Strategy]] = {}
        if index is None or index.g is not graph:
            index = GraphIndex(graph)
        self.index = index
        self.readers: dict[int, list[int]] = index.readers  # read only
        self._in_bytes: dict[int, int] = index.in_bytes
        self._cost_cache: dict[tuple[int, int], float] = {}
        self._comm_cache: dict[tuple[str, float], float] = {}

    # ---- costs -----------------------------------------------------------------------------
    def node_cost_s(self, n: GraphNode, shard: int) -> float:
        key = (n.id, shard)
        if key not in self._cost_cache:
            from meshplan.cost_models.compute import node_time

            t = node_time(
                n, self.cluster, shard=shard, batch_scale=self.batch_scale, dtype=self.dtype,
                input_bytes=self._in_bytes.get(n.id, 0),
            )  # fmt: skip
            self._cost_cache[key] = t.total_s
        return self._cost_cache[key]

    def edge_bytes(self, src: int) -> float:
        """Bytes of ``src``'s output per microbatch in the training dtype."""
        n = self.g.nodes[src]
        return n.out_bytes * self.batch_scale * elem_scale(n.out_dtype, self.dtype)

    def passes(self, u: int, a: str, b: str) -> int:
        """Forward + backward count of the collective a→b on ``u``'s output (``collective_passes``)."""
        return collective_passes(self.g.nodes[u].kind, TRANSITIONS[(a, b)])

    def comm_cost_s(self, a: str, b: str, nbytes: float) -> float:
        kind = TRANSITIONS[(a, b)]
        if kind is None or self.tp == 1:
            return 0.0
        key = (kind, nbytes)
        if key not in self._comm_cache:
            self._comm_cache[key] = collective_time(kind, nbytes, self.tp, self.cluster)
        return self._comm_cache[key]

    # ---- model -----------------------------------------------------------------------------
    # Rows are made straight from (variable, coefficient) lists (``_row``), with the terms,
    # coefficients and constants pulp's operator arithmetic (``lpSum(...) == 1``, ``w >= X + X - 1``)
    # gives, in the same order: the same problem, made without the intermediate expressions
    # (``tests/test_tp_ilp.py`` compares it with the operator-built one).
    def _row(self, terms: list[tuple[pulp.LpVariable, int]], sense: int, constant: float, name: str) -> None:
        """Add the row ``Σ coef·var + constant  (sense)  0`` named ``name``."""
        e = pulp.LpAffineExpression(terms, constant=constant)
        if len(e) != len(terms):  # a variable twice: sum its coefficients as pulp's arithmetic does
            e = pulp.LpAffineExpression(constant=constant)
            for v, c in terms:
                e.addterm(v, c)
        self.prob.addConstraint(pulp.LpConstraint(e, sense, name))

    def add_variables(self) -> None:
        self._out_vars: dict[int, dict[str, list[pulp.LpVariable]]] = {}
        self._in_vars: dict[int, dict[str, list[pulp.LpVariable]]] = {}
        for nid in self.ids:
            n = self.g.nodes[nid]
            self.strategies[nid] = self.node_strategies(n)
            outs: dict[str, list[pulp.LpVariable]] = {}
            ins: dict[str, list[pulp.LpVariable]] = {}
            for k, s in enumerate(self.strategies[nid]):
                self.x[nid, k] = v = self.prob.add_variable(f"x_{nid}_{k}", cat="Binary")
                outs.setdefault(s.out_state, []).append(v)
                ins.setdefault(s.in_state, []).append(v)  # type: ignore[arg-type]
            self._out_vars[nid], self._in_vars[nid] = outs, ins

    def add_one_strategy(self) -> None:
        for i, nid in enumerate(self.ids):
            ks = range(len(self.strategies[nid]))
            self._row([(self.x[nid, k], 1) for k in ks], _EQ, -1.0, f"one_strategy__{i}")

    def _internal_edges(self) -> list[tuple[int, int, int]]:
        """(src, dst, slot) for every non-exempt input read inside the segment from inside it."""
        out = []
        for v in self.ids:
            n = self.g.nodes[v]
            for slot, u in enumerate(dict.fromkeys(n.inputs)):
                if u in self.idset and not self._exempt(n, u):
                    out.append((u, v, slot))
        return out

    def _reshard_var(self, u: int, a: str, b: str) -> pulp.LpVariable:
        key = (u, a, b)
        if key not in self.w:
            self.w[key] = self.prob.add_variable(f"w_{u}_{a}{b}", lowBound=0, upBound=1)
        return self.w[key]

    def add_edge_consistency(self) -> None:
        """Forbid impossible transitions on each edge (``X_out(u,a) + X_in(v,b) <= 1``); a costly
        one turns on w[u,a,b] (``w >= X_out(u,a) + X_in(v,b) - 1``), paid once per producer and
        target state however many consumers need it (one all-gather of the norm output serves
        q, k and v alike)."""
        ci = ri = 0
        for u, v, _slot in self._internal_edges():
            outs = sorted({s.out_state for s in self.strategies[u]})
            ins = sorted({s.in_state for s in self.strategies[v] if s.in_state is not None})
            for a in outs:
                xu = self._out_vars[u].get(a, [])
                for b in ins:
                    xv = self._in_vars[v].get(b, [])
                    if not self._runs(u, a, b, v):
                        self._row([(x, 1) for x in xu] + [(x, 1) for x in xv], _LE, -1.0, f"edge_allowed__{ci}")
                        ci += 1
                    elif TRANSITIONS[(a, b)] is not None:
                        w = self._reshard_var(u, a, b)
                        self._row([(w, 1)] + [(x, -1) for x in xu] + [(x, -1) for x in xv], _GE, 1.0,
                                  f"reshard__{ri}")  # fmt: skip
                        ri += 1

    def add_boundary_in(self) -> None:
        """External inputs arrive in a fixed state (R, or Q for the residual stream with SP);
        a consumer that needs another state pays the reshard once per producer and state."""
        ci = ri = 0
        for v in self.ids:
            n = self.g.nodes[v]
            for u in dict.fromkeys(n.inputs):
                if u in self.idset or self._exempt(n, u):
                    continue
                a = self._external_state(u)
                for k, s in enumerate(self.strategies[v]):
                    if s.in_state is None:
                        continue
                    if not self._runs(u, a, s.in_state, v):
                        self._row([(self.x[v, k], 1)], _EQ, 0, f"boundary_in__{ci}")
                        ci += 1
                    elif TRANSITIONS[(a, s.in_state)] is not None:
                        w = self._reshard_var(u, a, s.in_state)
                        self._row([(w, 1), (self.x[v, k], -1)], _GE, 0, f"boundary_reshard__{ri}")
                        ri += 1

    def add_boundary_out(self) -> None:
        """Outputs read outside the segment leave in the state the next segment expects (its
        collective is priced in the objective, ``set_objective``)."""
        ci = 0
        self._boundary_out: list[tuple[int, int, str, str]] = []  # (node, strategy, out state, exit state)
        for u in self.ids:
            n = self.g.nodes[u]
            outside = [r for r in self.readers.get(u, []) if r not in self.idset]
            if not outside or n.kind == "output":
                continue
            want = self._exit_state(n)
            for k, s in enumerate(self.strategies[u]):
                if (s.out_state, want) not in TRANSITIONS:
                    self._row([(self.x[u, k], 1)], _EQ, 0, f"boundary_out__{ci}")
                    ci += 1
                else:
                    self._boundary_out.append((u, k, s.out_state, want))

    def add_tied(self) -> None:
        """Tied embedding/linear pairs: vocab-parallel embedding iff colwise head."""
        groups: dict[str, list[int]] = {}
        canon = {name: grp[0] for grp in self.g.tied_params for name in grp}  # wte.weight = lm_head.weight
        for nid in self.ids:
            n = self.g.nodes[nid]
            for p in {canon.get(q, q) for q in set(n.param_names) | set(n.shared_params)}:
                groups.setdefault(p, []).append(nid)
        ci = 0
        for members in groups.values():
            embs = [m for m in members if self.g.nodes[m].kind == "embedding"]
            lins = [m for m in members if self.g.nodes[m].kind == "linear"]
            for e in embs:
                ke = [k for k, s in enumerate(self.strategies[e]) if s.style == "rowwise"]
                for li in lins:
                    kl = [k for k, s in enumerate(self.strategies[li]) if s.style == "colwise"]
                    kr = [k for k, s in enumerate(self.strategies[li]) if s.style == "rowwise"]
                    self._row([(self.x[e, k], 1) for k in ke] + [(self.x[li, k], -1) for k in kl], _EQ, 0.0,
                              f"tied__{ci}")  # fmt: skip
                    ci += 1
                    for k in kr:  # a rowwise head splits the other weight dim: never with a tie
                        self._row([(self.x[li, k], 1)], _EQ, 0, f"tied__{ci}")
                        ci += 1

    def add_groups(self) -> None:
        """Coherent groups (``tp.groups``): one binary g per group; producers colwise = g, consumers
        rowwise = g (a group with a blocker, or a member lacking the style, has g = 0); a linear
        may be rowwise only as a group's consumer."""
        self.groups: list[TPGroup] = self.index.groups(self.ids) if self.tp > 1 else []
        consumers = {c for grp in self.groups for c in grp.consumers}
        ci = 0
        for gi, grp in enumerate(self.groups):
            gv = self.prob.add_variable(f"g_{gi}", cat="Binary")
            members = [(p, "colwise") for p in grp.producers] + [(c, "rowwise") for c in grp.consumers]
            shardable = not grp.blocker
            for nid, style in members:
                ks = [k for k, s in enumerate(self.strategies[nid]) if s.style == style]
                if grp.blocker or not ks:
                    shardable = False
                    self._row([(gv, 1)], _EQ, 0, f"tp_group__{ci}")
                    ci += 1
                self._row([(self.x[nid, k], 1) for k in ks] + [(gv, -1)], _EQ, 0.0, f"tp_group__{ci}")
                ci += 1
            if shardable and self._sp_requires_sharded([m for m, _ in members]):
                self._row([(gv, 1)], _EQ, -1.0, f"tp_group__{ci}")  # g = 1
                ci += 1
        for nid in self.ids:
            if self.g.nodes[nid].kind != "linear" or nid in consumers:
                continue
            for k, s in enumerate(self.strategies[nid]):
                if s.style == "rowwise":
                    self._row([(self.x[nid, k], 1)], _EQ, 0, f"tp_group__{ci}")
                    ci += 1

    def _sp_requires_sharded(self, nids: list[int]) -> bool:
        """Under sequence parallelism, whether these linears lie inside one of the traced model's
        blocks (``meta["module_lists"]``): the runtime runs SP only with every linear inside a block
        colwise or rowwise (``execution_rules.sequence_parallel_blocker``; a replicated one would see
        only this rank's slice of the sequence), so such a group is sharded, never replicated."""
        blocks = tuple(f"{b}." for b in self.g.meta.get("module_lists") or ()) if self.sp else ()
        fqns = [self.g.nodes[n].module_fqn for n in nids]
        return bool(blocks) and all(f is not None and f.startswith(blocks) for f in fqns)

    def set_objective(self) -> None:
        """The objective for this ILP's costs (batch scale, dtype, cluster); replaces any earlier one."""
        bo_cost = {(u, k): self.passes(u, a, want) * self.comm_cost_s(a, want, self.edge_bytes(u))
                   for u, k, a, want in self._boundary_out}  # fmt: skip
        terms = []
        for nid in self.ids:
            n = self.g.nodes[nid]
            for k, s in enumerate(self.strategies[nid]):
                w_shard = s.shard if n.kind in ("linear", "embedding", "matmul") else 1
                c = self.node_cost_s(n, s.shard) + self.lam * n.param_bytes / w_shard
                c += bo_cost.get((nid, k), 0.0)
                if c != 0:  # pulp's ``0 * x`` adds no term either
                    terms.append((self.x[nid, k], c))
        for (u, a, b), var in self.w.items():
            c = self.passes(u, a, b) * self.comm_cost_s(a, b, self.edge_bytes(u))
            if c != 0:
                terms.append((var, c))
        self.prob.setObjective(pulp.LpAffineExpression(terms))

    def build(self) -> pulp.LpProblem:
        """The problem with this ILP's objective. Its rows depend on the segment, the TP degree and
        the layout flags only, never on costs: the first ILP of a key builds them and leaves them
        in the shared ``GraphIndex``; a later one (another microbatch bucket, dtype or cluster)
        takes them over and sets its own objective, the problem a fresh build would give."""
        key = (tuple(self.ids), self.tp, self.sp, self.vocab_parallel, self.moe_folding, self.prob.name)
        built = self.index.placements.get(key)
        if built is None:
            self.add_variables()
            self.add_one_strategy()
            self.add_edge_consistency()
            self.add_boundary_in()
            self.add_boundary_out()
            self.add_tied()
            self.add_groups()
            self.index.placements[key] = (self.prob, self.x, self.w, self.strategies, self.groups, self._boundary_out)
        else:
            self.prob, self.x, self.w, self.strategies, self.groups, self._boundary_out = built
        self.set_objective()
        return self.prob

    # ---- solve -----------------------------------------------------------------------------
    def solve(self, *, time_limit_s: float = 10.0) -> TPSolution:
        t0 = time.perf_counter()
        self.build()
        if self.tp == 1 or len(self.x) == len(self.ids):  # one strategy per node: nothing to choose
            choice = {nid: 0 for nid in self.ids}
            status, solver = "optimal", "trivial"
        else:
            from meshplan.ilp import solve

            res = solve(self.prob, time_limit_s=time_limit_s)
            status, solver = res.status, res.solver
            choice = {}
            for nid in self.ids:
                vals = [(self.x[nid, k].varValue or 0.0) for k in range(len(self.strategies[nid]))]
                choice[nid] = max(range(len(vals)), key=lambda k: vals[k])
        return self._extract(choice, status, solver, time.perf_counter() - t0)

    def _extract(self, choice: dict[int, int], status: str, solver: str, seconds: float) -> TPSolution:
        styles: dict[str, str] = {}
        shard: dict[int, int] = {}
        state: dict[int, str] = {}
        compute = 0.0
        comm_s = 0.0
        comm_bytes: dict[str, int] = {}
        events: list[tuple[int, str, float]] = []

        def add_comm(a: str, b: str, nbytes: float) -> None:
            nonlocal comm_s
            kind = TRANSITIONS[(a, b)]
            if kind is None or self.tp == 1:
                return
            events.append((nid, kind, nbytes))
            n_pass = self.passes(nid, a, b)
            comm_s += n_pass * self.comm_cost_s(a, b, nbytes)
            comm_bytes[kind] = comm_bytes.get(kind, 0) + int(n_pass * nbytes)

        needed: dict[tuple[int, str], str] = {}  # (producer, target state) -> its state, once
        for nid in self.ids:
            n = self.g.nodes[nid]
            s = self.strategies[nid][choice[nid]]
            shard[nid] = s.shard
            state[nid] = s.out_state
            compute += self.node_cost_s(n, s.shard)
            if s.style and n.module_fqn:
                styles[n.module_fqn] = s.style
            for u in dict.fromkeys(n.inputs):
                if self._exempt(n, u) or s.in_state is None:
                    continue
                a = self.strategies[u][choice[u]].out_state if u in self.idset else self._external_state(u)
                needed[u, s.in_state] = a
        gathered: set[str] = set()
        for (u, b), a in needed.items():
            nid = u
            add_comm(a, b, self.edge_bytes(u))
            if (a, b) == ("S", "R"):  # which colwise linear's output is gathered?
                src = self._sharded_source(u, state)
                if src is not None and self.g.nodes[src].module_fqn:
                    gathered.add(self.g.nodes[src].module_fqn)
        for nid in self.ids:
            n = self.g.nodes[nid]
            outside = [r for r in self.readers.get(nid, []) if r not in self.idset]
            if outside and n.kind != "output":
                add_comm(state[nid], self._exit_state(n), self.edge_bytes(nid))
        return TPSolution(
            tp=self.tp, sequence_parallel=self.sp, styles=styles, rel_styles={}, node_shard=shard,
            node_state=state, comm_s=comm_s, comm_bytes=comm_bytes, compute_s=compute,
            objective=compute + comm_s, status=status, seconds=seconds, solver=solver, comm_events=events,
            gathered=gathered,
        )  # fmt: skip

    def _sharded_source(self, nid: int, state: dict[int, str]) -> int | None:
        """The colwise linear an S tensor comes from, walking back through S-state views."""
        seen = 0
        while nid in self.idset and seen < 64:
            n = self.g.nodes[nid]
            if n.kind == "linear":
                return nid
            ins = [i for i in n.inputs if state.get(i) == "S"]
            if n.kind != "reshape" or not ins:
                return None
            nid, seen = ins[0], seen + 1
        return None


def solve_segment(
    graph: ModelGraph,
    node_ids: list[int],
    tp: int,
    cluster: ClusterSpec,
    *,
    sequence_parallel: bool = False,
    batch_scale: float = 1.0,
    dtype: str = "bf16",
    prefix: str | None = None,
    time_limit_s: float = 10.0,
    name: str = "tp",
    vocab_parallel: bool = False,
    moe_folding: bool = False,
    index: GraphIndex | None = None,
) -> TPSolution:
    """Solve the placement of one segment; ``prefix`` (a block instance, e.g. "blocks.0") makes
    ``rel_styles`` relative FQNs such as "attn.q_proj". ``vocab_parallel``: the engines' layout
    (the token embedding always vocab-parallel, a tied head with it; ``tp.strategies``);
    ``moe_folding``: Megatron-Core's MoE parallel folding (a MoE node on the sequence shard)."""
    ilp = TPPlacementILP(
        graph, node_ids, tp, cluster, sequence_parallel=sequence_parallel, batch_scale=batch_scale,
        dtype=dtype, name=name, vocab_parallel=vocab_parallel, moe_folding=moe_folding, index=index,
    )  # fmt: skip
    sol = ilp.solve(time_limit_s=time_limit_s)
    if prefix:
        cut = len(prefix) + 1
        sol.rel_styles = {k[cut:]: v for k, v in sol.styles.items() if k.startswith(prefix + ".")}
    return sol
