"""``--compile``: ``torch.compile`` per repeated block, as torchtitan does (off by default).

At pp = 1 every child of every ``nn.ModuleList`` (the repeated blocks) is compiled in place with
``nn.Module.compile()`` (FQNs and state dicts unchanged; one compiled graph reused by every block
of the same shape). A pipeline stage is one flat fx GraphModule whose blocks are not separate
calls, so there the whole stage module is compiled. Applied after TP, recompute and precision
wrapping and before data parallelism (FSDP2 / DDP wrap the compiled modules), the order
torchtitan uses. The first step pays the compilation (about 24 s on this project's CPU machine).
"""

from __future__ import annotations

from torch import nn


def apply_compile(modules: list[nn.Module], *, pipelined: bool) -> int:
    """Compile the blocks of ``modules`` (each whole module when ``pipelined``); returns how many."""
    n = 0
    for m in modules:
        targets = [m] if pipelined else [c for sub in m.modules() if isinstance(sub, nn.ModuleList) for c in sub]
        if not targets:
            targets = [m]
        for t in targets:
            t.compile()
            n += 1
    return n
