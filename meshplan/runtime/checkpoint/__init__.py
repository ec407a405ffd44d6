"""Checkpoints: DCP save/load (``dcp``), the checkpoint directory's files (``files``), and
pretrained weights read into this rank's shards (``pretrained``: HF safetensors or a DCP checkpoint).
"""
