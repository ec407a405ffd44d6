"""Runtime: execute a Plan under torchrun on PyTorch's distributed engine.

Modules: ``dist`` (start-up, mesh), ``split`` (stage split), ``tp`` (DTensor TP),
``recompute`` (activation checkpointing), ``data_parallel`` (DDP / FSDP2 / manual),
``schedules`` (torch.distributed.pipelining), ``checkpoint`` (DCP), ``record`` (RunRecord),
``api`` (apply_plan, ParallelModel), ``train`` + ``launch`` (the torchrun entry behind
``meshplan run``), ``handplan`` (Plans made by hand, without the planner), ``quant`` (QAT /
QLoRA, owned by the quantization work). Never imports ``meshplan.planner``.
"""
