"""Cost models: pure functions of shapes and a ClusterSpec (no torch, except ``profile.py``).

- ``hardware``: ClusterSpec, presets, JSON profiles.
- ``compute``: roofline time of a node, forward and backward (input-grad B / weight-grad W).
- ``memory``: model states (ZeRO), activations (Korthikanti and graph based), in-flight microbatches.
- ``comm``: alpha-beta ring model of collectives, which mesh axes cross nodes.
- ``formulas``: model-level published formulas (parameters, FLOPs per iteration/token, MFU, bubble).
- ``profile``: ``meshplan profile`` measures the local machine into a ClusterSpec (imports torch).

Submodules are imported explicitly (``from meshplan.cost_models.compute import node_time``).
"""
