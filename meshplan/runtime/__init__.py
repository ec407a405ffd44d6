"""Runtime: execute a Plan under torchrun on PyTorch's distributed engine.

Folders by concern, lowest first (a folder imports only from folders listed before it;
``RUNTIME_LAYERS`` in tests/test_layering.py):

1. ``launch``: torchrun command, Slurm, supervision, each rank's process-group start-up, collectives.
2. ``record`` (RunRecord, phases, progress) and ``weights`` (weights on disk, read without a
   ParallelModel: ``--init-from`` pretrained weights, the checkpoint directory's files, checksums).
3. ``apply``: ``apply.api.apply_plan`` -> ``ParallelModel``: stage split, TP, EP/CP, quantization,
   recompute, precision, data parallel, schedules, the optimizer step (``apply.optim``);
   ``apply.handplan`` Plans made by hand, without the planner.
4. ``checkpoint``: DCP save/load of a ParallelModel (reshardable), a full disk's message.
5. ``loop``: the torchrun entry ``loop.train`` behind ``meshplan run``, data, evaluation, faults.

Never imports ``meshplan.planner``.
"""
