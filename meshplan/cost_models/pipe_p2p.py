"""How a pipeline engine moves a stage's boundary tensors to its neighbour, and what that costs per hop.

``PP_P2PS`` (``EngineProfile.pp_p2p``):

- "nccl": torch.distributed.pipelining and Megatron-LM (its ``p2p_communication`` batches a
  stage's send and receive into one ``batch_isend_irecv``): the hop is one message each way, on the
  critical path between the two stages' actions; the send does not hold the sender's compute
  (``partition.schedule`` module docstring). Priced in ``planner.kind_free`` with Megatron-LM's
  scatter/gather where the profile has it.
- "deepspeed-grad-whole" / "deepspeed": DeepSpeed's ``PipelineEngine``
  (deepspeed/runtime/pipe/engine.py, schedule.py, p2p.py), which Megatron-DeepSpeed (MT-NLG, BLOOM)
  runs. Its ``TrainSchedule`` is a 1F1B order (each stage alternates forward and backward steps;
  ``schedule.py`` lines 186-245 at ddffbae0); at each step a stage exchanges with one neighbour,
  before computing, ``RecvActivation`` then ``SendGrad`` (forward step) or ``SendActivation`` then
  ``RecvGrad`` (backward step), each tensor one *blocking* call: ``p2p.send`` / ``p2p.recv`` force
  ``async_op = False`` and run ``dist.broadcast`` in a two-rank group (ddffbae0 p2p.py lines 31-55)
  or, from e2fdd254e (2021-09-29), ``dist.send`` / ``dist.recv`` (9b70ce56 p2p.py lines 48-83), whose
  NCCL kernels hold both ranks' streams until the bytes have crossed. With tensor parallelism
  (``is_pipe_partitioned = self.is_model_parallel``, engine.py line 113 at ddffbae0) the
  activation is sent as its 1/tp slice (``PartitionedTensor``) and re-gathered over the tp group
  by the receiver (``part_input.full()``, an all-gather, ``_exec_forward_pass``); the gradient:

  - "deepspeed-grad-whole" (65c2f974, 2020-09, to e2fdd254e): ``is_grad_partitioned = False``
    (engine.py line 114 at ddffbae0): every tp rank sends the whole gradient, and before receiving
    it the sender of the activation re-gathers its own partitioned output (``_exec_recv_grads``,
    ``part_output.full()``): 2 all-gathers per hop;
  - "deepspeed" (from e2fdd254e, 2021-09-29, "Big science related changes"):
    ``is_grad_partitioned = self.is_model_parallel`` (engine.py line 134 at 9b70ce56): the gradient
    goes as its 1/tp slice too, re-gathered by the receiver (``part_grad.full()``), which also
    re-gathers its own output (``part_output.full()``, ``_exec_backward_pass``): 3 all-gathers per hop.

  Since both tensors of a step's exchange are blocking calls in sequence on both ranks, each
  exchange holds both stages for the activation's and the gradient's transfer (and the all-gathers,
  which run on the compute stream); in a 1F1B steady state every stage takes part in two exchanges
  per microbatch. ``deepspeed_hop_s`` is that exchange's time; ``planner.kind_free`` gives it to the
  schedule simulator with ``sends_occupy`` (the hop held by the sending action), which reproduces a
  blocking exchange's steady state: 2 hops per microbatch on every inner stage, 1 on the end stages
  (``benchmarks/deepspeed_schedule_check.py`` simulates ``TrainSchedule``'s own step order as events:
  the priced form adds 4-7% more exchange seconds than it, 0.2-0.4% of the step, at 12 and 35
  stages: it charges the fill and drain's half exchanges whole).

No torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.cost_models.comm import collective_time_s, p2p_time_s

if TYPE_CHECKING:
    from meshplan.cost_models.hardware import ClusterSpec

#: how a pipeline engine moves boundary tensors (module docstring)
PP_P2PS: tuple[str, ...] = ("nccl", "deepspeed-grad-whole", "deepspeed")


def blocking(pp_p2p: str) -> bool:
    """Whether the engine's stage-to-stage exchange holds both ranks (DeepSpeed's PipelineEngine)."""
    if pp_p2p not in PP_P2PS:
        raise ValueError(f"pp_p2p must be one of {', '.join(PP_P2PS)}, got {pp_p2p!r}")
    return pp_p2p != "nccl"


def deepspeed_hop_s(nbytes: float, tp: int, cluster: ClusterSpec, *, crosses_nodes: bool, pp_p2p: str,
                    sequence_parallel: bool = False) -> float:
    """Seconds one DeepSpeed ``PipelineEngine`` exchange holds both stages: the activation of
    ``nbytes`` (the whole boundary tensor of one microbatch on one tp rank) and its gradient, sent
    one after the other, each as its 1/tp slice where the engine partitions it (tp > 1), plus the
    tp all-gathers that rebuild the partitioned tensors (module docstring). ``sequence_parallel``:
    the boundary tensor is already a 1/tp shard (not partitioned again). Unit: seconds."""
    if not blocking(pp_p2p):
        raise ValueError(f"deepspeed_hop_s prices DeepSpeed's exchange, not {pp_p2p!r}")
    if nbytes <= 0:
        return 0.0
    part = tp if tp > 1 and not sequence_parallel else 1
    grad_part = part if pp_p2p == "deepspeed" else 1
    gathers = 0 if part == 1 else (3 if pp_p2p == "deepspeed" else 2)
    send = p2p_time_s(nbytes / part, cluster, crosses_nodes=crosses_nodes)
    send += p2p_time_s(nbytes / grad_part, cluster, crosses_nodes=crosses_nodes)
    ag = collective_time_s("all_gather", nbytes, part, cluster, ranks_per_node=min(part, cluster.devices_per_node))
    return send + gathers * ag if gathers else send


__all__ = ["PP_P2PS", "blocking", "deepspeed_hop_s"]
