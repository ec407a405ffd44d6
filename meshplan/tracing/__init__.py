"""Internals of ``meshplan.trace``: capture (fx / export), fake-tensor annotation, node
classification, ModelGraph assembly, and block / cut-point detection. Public API: ``meshplan.trace``."""
