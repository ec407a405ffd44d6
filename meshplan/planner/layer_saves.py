"""What a costed layer keeps beyond its traced saves: the bytes ``torch.autocast`` holds on fp32
parameters (weight copies, fp32 norm outputs cast again per reader, an eager MoE block's routed-token
and expert-weight copies), what torch's split backward keeps for the weight pass, and a layer's
model-state bytes under quantization (QAT, QLoRA). Split out of ``planner.costing`` (which had
grown past 800 lines): :class:`LayerSaves` is a mixin of ``costing.GraphCoster``, reading its
graph, placement, dtype, quantization and profile; ``out_shard`` / ``saved_shard`` say how TP
splits a node's output and its saved inputs. No torch import.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshplan.cost_models.memory import ONE_MM
from meshplan.cost_models.quant import nf4_bits_per_param, qat_work_bytes, qlora_mm_parts
from meshplan.cost_models.quant_nodes import node_quant_cost, node_targeted, quant_state_bytes
from meshplan.graph import GraphNode, expert_shape
from meshplan.planner.tp.graph import GraphTPSolution

__all__ = ["LayerSaves", "out_shard", "saved_shard"]


def out_shard(n: GraphNode, sol: GraphTPSolution) -> int:
    """How many ways TP splits ``n``'s output: tp when it leaves sharded (S, or Q with sequence
    parallelism), 1 when replicated or partial sums (a row-wise linear's local product)."""
    return sol.tp if sol.node_state.get(n.id, "R") in ("S", "Q") else 1


def saved_shard(n: GraphNode, sol: GraphTPSolution, sp_saves: str = "gathered") -> int:
    """What a node saves are its inputs: split by tp when they arrive sharded (S, P, Q). A linear
    whose input arrives sequence-sharded (Q) takes it all-gathered (Q -> R): under torch's TP it
    saves the gathered input (``memory.SP_SAVES`` "gathered"), under Megatron-LM the shard."""
    if sol.tp == 1:
        return 1
    if sol.node_shard.get(n.id, 1) > 1 and n.kind not in ("linear",):
        return sol.tp
    sharded = ("S", "P") if n.kind == "linear" and sp_saves == "gathered" else ("S", "Q", "P")
    for i in n.inputs:
        if sol.node_state.get(i, "R") in sharded:
            return sol.tp
    return 1


class LayerSaves:
    """The saved-bytes terms of ``costing.GraphCoster`` (module docstring); a mixin: the attributes
    it reads (``g``, ``quant``, ``sp_saves``, ``optimizer``, ``dtype``, ``_owner``,
    ``_fp32_under_autocast``, ``_autocast_dtype``) are the coster's."""

    g: Any
    quant: Any
    sp_saves: str
    optimizer: str
    dtype: str
    _owner: dict
    _tied_alias: dict
    _fp32_under_autocast: frozenset[int]
    _autocast_dtype: bool

    def _autocast_bytes(self, nodes: list[GraphNode], sol: GraphTPSolution, rc: str, scale: float,
                        elem: float, in_bytes: float) -> tuple[float, float, float]:
        """``autocast_kept_bytes`` of one layer (bytes per microbatch), of it the weight copies
        (1), and the weight copies recompute drops but autocast's cache holds to the end of the
        forward region (``LayerCost.autocast_cache_bytes``): under ``torch.autocast`` on
        fp32 parameters, (1) every linear casts its weight to the compute dtype in each forward and
        saves that copy for its input gradient (autocast's weight cache lives only inside one
        autocast region: one forward call of a stage), unless recompute drops the layer's saved
        tensors (full, op); (2) the embedding output, the residual stream and the norms stay fp32,
        so the norms' saved inputs (or, under full / op recompute, the kept block input) are fp32,
        not the compute dtype ``elem`` scales them to. Source: torch/amp autocast op lists (linear
        and matmul cast, embedding / add / rsqrt / mean run in fp32; only leaf tensors' casts are
        cached, so (3) every linear reading a norm's fp32 output saves its own bf16 copy); measured with
        torch.distributed._tools.MemTracker (benchmarks/bench_memory.py)."""
        elem_b = 2.0  # bf16 / fp16 copy bytes per parameter
        out = weights = 0.0
        copies = 0.0  # every linear's weight copy: autocast caches it until its region ends
        qat = 0.0  # QAT: the clamp's input in fp32 beyond its compute-dtype share (quant.qat_saved_bytes)
        for n in nodes:
            if n.kind not in ("linear", "matmul"):
                continue
            w_shard = sol.node_shard.get(n.id, 1)
            numel = float(n.param_numel)
            if self.quant.mode in ("qlora", "qat") and n.kind == "linear":
                qc = node_quant_cost(n, self.quant, shard=1)
                if qc is not None and qc.targeted and self.quant.mode == "qlora":
                    numel = qc.trainable_params  # the NF4 base takes no autocast copy: its adapters do
                elif qc is not None and qc.targeted:
                    # QAT: the fp32 weight is fake-quantized before the cast; the cast copy of that
                    # non-leaf result is never cached (per microbatch, in quant.qat_saved_bytes), the
                    # bias (a leaf) is; the quantizer runs on the fp32 weight and its clamp keeps it
                    numel -= qc.weight_params
                    qat += qc.weight_params / w_shard * (4.0 - elem_b)
                    if not numel:
                        continue
            if not numel:  # a tied head reads the embedding's weight: cast too (a traced head names the
                # weight by its own FQN, lm_head.weight: ``_tied_alias`` leads it to the owner's)
                numel = float(sum(self._owner[q][1] for q in (self._tied_alias.get(p, p) for p in n.shared_params)
                                  if q in self._owner))
            copies += numel / w_shard * elem_b
        if rc in ("none", "selective"):
            out = weights = copies
            out += qat
            # (3) autocast casts an fp32 input again in every op that reads it (only weights, leaf
            # tensors, are cached): q/k/v (gate/up) each save their own bf16 copy of the norm's output,
            # where the traced graph saves one; "fp32" from the dataflow (``_fp32_under_autocast``),
            # so a norm exported as elementwise ops (HF RMSNorm under torch.export) counts as one
            seen: set[int] = set()
            ids = {n.id for n in nodes}
            fp32 = self._fp32_under_autocast
            for n in nodes:
                if n.kind not in ("linear", "matmul"):
                    continue
                for i in n.inputs:
                    src = self.g.nodes[i]
                    if i not in ids or i not in fp32:
                        continue
                    if i in seen and not (self.sp_saves == "shard" and sol.node_state.get(i) == "Q"):
                        # (a sequence shard meshplan's runtime casts before its all-gather: one copy,
                        # runtime/apply/sp_saves.py)
                        out += src.out_bytes * scale * elem / saved_shard(n, sol, self.sp_saves)
                    seen.add(i)
            fp32_extra = 1.0 / elem - 1.0 if elem < 1.0 else 0.0
            for n in nodes:
                if n.kind == "norm" and n.saved_bytes:
                    out += n.saved_bytes * scale * elem * fp32_extra / saved_shard(n, sol, self.sp_saves)
        elif elem < 1.0:  # full / op recompute: the kept block input is the fp32 residual stream
            out += in_bytes * scale * (1.0 - elem) / (sol.tp if sol.sequence_parallel else 1)
        return out, weights, copies - weights

    def _moe_autocast_bytes(self, nodes: list[GraphNode], sol: GraphTPSolution, scale: float) -> tuple[float, float]:
        """(routed-token bytes, expert weight-copy bytes) per microbatch an eager MoE block keeps under
        ``torch.autocast`` on fp32 parameters beyond its traced saves scaled to the compute dtype, its
        input being the fp32 norm output (``_fp32_under_autocast``): each of the m − 1 input
        projections casts the routed token again (autocast caches only leaf tensors: the trace keeps
        one copy), the weighted expert output reaches ``index_add_`` in the fp32 accumulator's dtype
        (4 bytes where the trace scales to 2): (m − 1)·H·2 bytes per routed token; and every expert's
        weights are cast per forward (``w_gate[e]`` is a slice, not a leaf: never cached), E
        experts' ``expert_numel`` at 2 bytes. Measured with MemTracker on the zoo MoE
        (tests/test_memory_fake.py; saved tensors listed in BENCHMARKS "Wave 3 stop 6: MoE memory")."""
        tok = wcopy = 0.0
        fp32 = self._fp32_under_autocast
        for n in nodes:
            a = n.attrs
            if n.kind != "moe" or not a.get("hidden") or not a.get("expert_numel") or not n.inputs:
                continue
            if n.inputs[0] not in fp32:
                continue
            m, _ = expert_shape(int(a["hidden"]), float(a["expert_numel"]), float(a.get("expert_act_numel", 0)))
            routed = float(a.get("tokens", 0)) * float(a.get("top_k", 1)) * scale
            tok += routed * max(m - 1, 1) * int(a["hidden"]) * 2.0 / saved_shard(n, sol, self.sp_saves)
            if self.g.meta.get("moe_layout", "grouped") == "grouped":
                wcopy += float(a["expert_numel"]) * float(a.get("num_experts", 1)) * 2.0
        return tok, wcopy

    def _wgrad_bytes(self, nodes: list[GraphNode], sol: GraphTPSolution, scale: float, elem: float) -> float:
        """Bytes per microbatch torch's split backward keeps for the weight pass of one layer: the
        gradient of each weight-reading op's output (``stage_backward_input`` hooks every
        ``param_groups`` intermediate and stores its gradient until ``stage_backward_weight``):
        per linear / matmul with a weight tokens x out in the compute dtype, per norm with a weight
        its output size (fp32 under autocast, whose norms run in fp32). An embedding reads token
        ids, no stage input reaches it: the first stage runs its whole backward in the weight pass."""
        out = 0.0
        fp32 = self._fp32_under_autocast if self._autocast_dtype else frozenset()
        for n in nodes:
            if not n.trains_weight or n.kind == "embedding":
                continue
            if n.kind in ("linear", "matmul"):
                out += n.out_bytes * scale * elem / out_shard(n, sol)
            else:
                e = 1.0 if n.id in fp32 else elem
                out += n.out_bytes * scale * e / (sol.tp if sol.sequence_parallel else 1)
        return out

    def _op_mm_parts(self, n: GraphNode) -> tuple[tuple[float, bool], ...]:
        """The matmuls linear ``n`` issues under op recompute's count (``memory.op_sac_kept_bytes``):
        three for a QLoRA-targeted linear (``quant.qlora_mm_parts``), else one."""
        q = self.quant
        out_f = n.attrs.get("out_features")
        if q.mode == "qlora" and out_f and node_targeted(n, q):
            return qlora_mm_parts(int(out_f), q.lora_rank)
        return ONE_MM

    def _quant_states(
        self, layer: Any, nodes: list[GraphNode], sol: GraphTPSolution, scale: float, rc: str = "none"
    ) -> Any:
        """``layer`` (a ``costing.LayerCost``) with its model-state bytes, trainable count and QAT saved
        bytes under quantization (recompute ``rc`` "full" / "op": dropped with the layer's saves and
        rematerialized in its backward, ``transient_bytes``). QAT's fake quantization works in the
        parameter's dtype: the training dtype under FSDP2's mixed precision (``work_bytes``), fp32
        under autocast (``autocast_work_bytes``, its clamp's fp32 input in ``_autocast_bytes``)."""
        q = self.quant
        # the runtime keeps parameters and optimizer states fp32 on every path (dp_kinds.state_precision
        # "torch"); the training dtype sets the bytes of the compute copies (wb)
        precision = "fp32"
        wb = 4.0 if self.dtype == "fp32" else 2.0

        def shard_of(n: GraphNode) -> int:
            return sol.node_shard.get(n.id, 1) if n.kind in ("linear", "embedding", "matmul") else 1

        def style_of(n: GraphNode) -> str | None:
            return sol.styles.get(n.module_fqn or "")

        st = quant_state_bytes(nodes, q, shard_of=shard_of, style_of=style_of, optimizer=self.optimizer,
                               precision=precision)  # fmt: skip
        trainable = saved = work = cast_work = 0.0
        gathered = 0.0  # QLoRA: NF4 bases as stored, the rest in the training dtype (FSDP2's all-gather)
        nf4 = nf4_bits_per_param(q.group_size, bits=q.bits) / 8.0 if q.mode == "qlora" else 0.0
        for n in nodes:
            if not n.param_numel:
                continue
            qc = node_quant_cost(n, q, shard=shard_of(n), style=style_of(n), batch_scale=scale, dtype_bytes=wb,
                                 optimizer=self.optimizer)  # fmt: skip
            if qc is not None and qc.targeted:
                trainable += qc.trainable_params
                saved += qc.extra_saved_bytes
                work = max(work, qc.work_bytes)
                if q.mode == "qat" and self._autocast_dtype:  # the quantizer on the fp32 weight
                    cast_work = max(cast_work, qat_work_bytes(qc.weight_params, 4.0) - qc.work_bytes)
                if q.mode == "qlora":  # the NF4 base as stored, its bias and adapters in the training dtype
                    w = qc.weight_params
                    gathered += w * nf4 + (qc.frozen_params - w + qc.trainable_params) * wb
            else:
                gathered += n.param_numel / shard_of(n) * wb
                if q.mode != "qlora":
                    trainable += n.param_numel / shard_of(n)
        kept = rc in ("none", "selective")
        return replace(
            layer, act_bytes=layer.act_bytes + (saved if kept else 0.0), state_param_bytes=st.params,
            state_grad_bytes=st.grads, state_opt_bytes=st.optimizer, trainable_params=trainable, work_bytes=work,
            transient_bytes=layer.transient_bytes + (0.0 if kept else saved), autocast_work_bytes=cast_work,
            gather_bytes=gathered if q.mode == "qlora" else -1.0,
            # QLoRA trains the adapters alone: only their casts have a gradient to convert back to fp32
            autocast_gradcast_params=min(trainable, layer.autocast_cast_params) if q.mode == "qlora" else -1.0,
        )  # fmt: skip
