"""Planning: tensor-parallel placement ILP (``tp.ilp``, ``tp.graph``), per-layer cost tables
(``costing``), the joint DP/TP/PP search (``search``, ``search_types``), input checks
(``validate``) and the public entry points ``autoparallel`` / ``estimate`` (``api``). No torch."""
