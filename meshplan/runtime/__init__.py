"""Runtime: execute a Plan under torchrun on PyTorch's distributed engine.

Folders by concern: ``apply`` (``apply.api.apply_plan`` -> ``ParallelModel``: stage split, TP, EP/CP,
quantization, recompute, precision, data parallel, schedules; ``apply.handplan`` Plans made by hand,
without the planner), ``loop`` (the torchrun entry ``loop.train`` behind ``meshplan run``, data,
optimizer), ``record`` (RunRecord, phases, progress), ``checkpoint`` (DCP checkpoints and their
files), ``launch`` (torchrun command, Slurm, supervision, each rank's process-group start-up).
Never imports ``meshplan.planner``.
"""
