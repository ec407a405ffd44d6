"""Process groups of expert and context parallelism (their gradient reduction: ``runtime.apply.epcp``).

Ranks are laid out by the Plan's mesh (``("pp", "dp", "cp", "tp")``, outermost first). For a
fixed pp and tp coordinate, the dp x cp ranks form one *dc row* (dp-major, cp-minor, like
torchtitan's flattened ``dp_shard_cp``). Expert parallelism borrows its ranks from that row:
the ``ep`` group of a rank is its block of ``ep`` consecutive row positions, and its expert
*replica* group joins the ranks at the same position of every block (they hold the same
experts). Every rank computes the loss of its own tokens (its batch slice, its sequence shard);
the step's loss is the mean over the dc row, so

* a dense (non-expert) gradient is the mean over the dc row: ``all_reduce(SUM, dc) / dc``;
* an expert weight already received, through the all-to-all's backward, the gradient of every
  token its ep group routed to it, so it is summed over its replica group only (the ranks that
  hold a copy) and divided by the same ``dc``: ``all_reduce(SUM, replica) / dc``.

Every ``new_group`` call is made by every rank in one order (torch requires it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from meshplan.runtime.launch.dist import RuntimeEnv


@dataclass
class DCGroups:
    dc_size: int
    dc_group: dist.ProcessGroup | None  # None when dp x cp == 1
    ep: int
    ep_rank: int  # position inside the ep group
    ep_group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup | None  # ranks holding the same experts; None when dc == ep


def dc_rows(env: RuntimeEnv) -> list[list[int]]:
    """Global ranks of every dc row (dp-major, cp-minor), the same list on every rank."""
    names = list(env.mesh.mesh_dim_names or ())
    t = env.mesh.mesh
    dims = [names.index(a) for a in ("dp", "cp") if a in names]
    other = [i for i in range(t.dim()) if i not in dims]
    size = 1
    for d in dims:
        size *= t.shape[d]
    rows = t.permute(*other, *dims).reshape(-1, size)
    return [[int(x) for x in r] for r in rows]


def build_groups(env: RuntimeEnv, ep: int) -> DCGroups:
    rows = dc_rows(env)
    dc = len(rows[0])
    if ep < 1 or dc % ep:
        raise ValueError(f"ep={ep} must divide dp x cp = {dc}")
    mine: DCGroups | None = None
    out = DCGroups(dc, None, ep, 0, None, None)
    for row in rows:
        g_dc = dist.new_group(row) if dc > 1 else None
        eps = [dist.new_group(row[b : b + ep]) if ep > 1 else None for b in range(0, dc, ep)]
        reps = [dist.new_group(row[j::ep]) if dc > ep else None for j in range(ep)]
        if env.rank in row:
            pos = row.index(env.rank)
            mine = DCGroups(dc, g_dc, ep, pos % ep, eps[pos // ep], reps[pos % ep])
    return mine or out
