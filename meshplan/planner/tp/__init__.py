"""Tensor-parallel placement: the ILP that picks a TP style per node (``ilp``), the strategies of a
node and the transitions the runtime realizes (``strategies``), coherent groups (``groups``),
the graph-wide solve (``graph``) and their shared types (``types``). No torch import."""
