"""Applying a Plan to a model: checks, stage split, TP, EP/CP, quantization, recompute, precision,
data parallelism, schedules; ``api.apply_plan`` builds the ``ParallelModel`` one rank runs.
"""
