"""Weights on disk, read without a ParallelModel (below ``apply``, which reads initial weights):
``pretrained`` (``--init-from``: HF safetensors or a DCP / meshplan checkpoint read into this rank's
shards; ``check_pretrained`` for the launcher), ``files`` (a meshplan checkpoint directory's files:
step names, manifest, checksums, newest complete, pruning; no torch) and ``verify`` (every file's
checksum, ranks splitting the files). Saving and resuming a ParallelModel is ``runtime/checkpoint``,
above ``apply``.
"""
