"""Runtime: execute a Plan under torchrun on PyTorch's distributed engine.

Modules: ``dist`` (start-up, mesh), ``split`` (stage split), ``tp`` (DTensor TP),
``data_parallel`` (DDP / FSDP2 / manual), ``schedules`` (torch.distributed.pipelining),
``checkpoint`` (DCP), ``record`` (RunRecord), ``api`` (apply_plan, ParallelModel),
``train`` (the torchrun entry used by ``meshplan run``). Never imports ``meshplan.planner``.
"""
