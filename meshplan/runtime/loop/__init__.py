"""The training loop: the torchrun entry (``train``), per-rank data and synthetic batches, the
optimizer step, NaN/inf guard, batch checks, held-out evaluation.
"""
