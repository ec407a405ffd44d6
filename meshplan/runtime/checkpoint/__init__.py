"""Checkpoints of a ParallelModel (above ``apply``): DCP save/load (``dcp``, with zero1's state views)
and a save that failed for want of disk space (``space``). The checkpoint directory's files and
their checksums, and pretrained weights, are ``runtime/weights`` (below ``apply``).
"""
