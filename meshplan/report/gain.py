"""A claimed gain over a tuned configuration, split into the parts that give it (all predicted).

``split_gain(tuned, same, own, best)`` takes four Plans costed by the same model on the same
cluster, batch and precision:

- ``tuned``: the authors' (or user's) configuration, under their engine's conventions;
- ``same``: the best plan with the authors' own mechanisms (recompute kind, data-parallel kind,
  schedule family, sequence parallelism, stage-split rule) and engine conventions, degrees and
  microbatch free: what **planning** the degrees and microbatch gives;
- ``own``: the best plan with every mechanism the search has (a newer schedule, another recompute
  kind, sequence parallelism, a sharded optimizer / ZeRO / FSDP), still under the authors' engine
  conventions: what the **mechanisms the authors lacked** give;
- ``best``: the plan claimed (e.g. under meshplan's runtime conventions: flash attention, its
  kernels and state layout): what the **engine conventions** give (1.0x when ``own`` is it).

The parts multiply to the claimed gain, ``tuned.step / best.step``. Each part names the
configuration changes and the step terms that carry it: the seconds each term of the step
(``Prediction``: compute, recompute, exposed TP / DP / EP / CP communication, pipeline bubble
with its sends, optimizer step) loses from one plan to the next, which sum exactly to the step's
change, and the peak memory per device before and after with the memory parts that moved
(``mem_breakdown``). A claimed gain above ``SCRUTINY_GAIN`` over a tuned configuration needs
scrutiny: a cost model that is right within a few percent on the tuned runs rarely finds that much
on a configuration its authors tuned, so the terms that carry it are where to look first.
``GainSplit.note()`` is the one line a Plan's notes record (``meshplan explain`` prints it).
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.plan import Plan
from meshplan.report.text import fmt_bytes

#: a claimed gain over a tuned configuration above this needs scrutiny (Mist measured 1.28x over
#: Megatron-LM's own tuned configurations on real runs: more than 1.3x is more than anyone measured)
SCRUTINY_GAIN = 1.3
#: the prefix of the Plan note a gain split records (``report.explain`` prints it flagged)
NOTE_PREFIX = "gain over "
#: between the pieces of that note
NOTE_SEP = " | "


def step_terms(p: Plan) -> dict[str, float]:
    """The predicted step of ``p`` as the terms it is the sum of, in seconds: compute (forward +
    backward, without the recompute), recompute, exposed communication by kind (TP, EP with the
    expert-weight read it saves, CP), the pipeline bubble (idle time and the stage-to-stage sends on
    the busiest pipeline rank), exposed DP communication and the optimizer step."""
    pr = p.predicted
    return {
        "compute": pr.compute_s - pr.recompute_s,
        "recompute": pr.recompute_s,
        "TP comm": pr.tp_comm_s,
        "EP comm": pr.ep_comm_s + pr.ep_expert_read_s,
        "CP comm": pr.cp_comm_s,
        "bubble+sends": pr.bubble_s,
        "DP comm": pr.dp_comm_s,
        "optimizer": pr.optimizer_s,
    }


def _changes(a: Plan, b: Plan) -> tuple[str, ...]:
    pairs = (("tp", a.tp, b.tp), ("pp", a.pp, b.pp), ("dp", a.dp, b.dp), ("cp", a.cp, b.cp), ("ep", a.ep, b.ep),
             ("microbatch", a.micro_batch_size, b.micro_batch_size), ("recompute", a.recompute, b.recompute),
             ("dp_kind", a.dp_kind, b.dp_kind), ("schedule", a.schedule, b.schedule),
             ("virtual_stages", a.virtual_stages, b.virtual_stages),
             ("sequence_parallel", a.sequence_parallel, b.sequence_parallel))  # fmt: skip
    return tuple(f"{k} {x}→{y}" for k, x, y in pairs if x != y)


@dataclass(frozen=True)
class GainPart:
    """One factor of a claimed gain: ``before.step / after.step`` (predicted) with what carries it."""

    name: str
    gain: float
    changes: tuple[str, ...]  # configuration changes, e.g. ("tp 8→4", "recompute full→none")
    saved_s: dict[str, float]  # term -> seconds it loses (negative: it grows); sums to the step's change
    peak_before: int  # bytes, the fullest device
    peak_after: int
    memory_moves: dict[str, int]  # mem_breakdown part -> bytes it grows (negative: shrinks)

    @property
    def carriers(self) -> list[tuple[str, float]]:
        """The terms that carry the part: those losing time, largest first, with their share of the
        step's net change (shares above 100 % where other terms grow)."""
        net = sum(self.saved_s.values())
        if abs(net) < 1e-12:
            return []
        return [(k, v / net) for k, v in sorted(self.saved_s.items(), key=lambda kv: -kv[1] * (1 if net > 0 else -1))
                if v * net > 0 and abs(v) >= 0.05 * abs(net)]  # fmt: skip

    def text(self) -> str:
        """``planning 1.12x (tp 8→4, ...): bubble+sends −3.1 s (61%), compute −1.2 s (24%); memory 40.4→52.0 GiB (...)``."""
        terms = ", ".join(f"{k} {_signed_s(-self.saved_s[k])} ({100 * share:.0f}%)" for k, share in self.carriers)
        mem = f"peak {fmt_bytes(self.peak_before)}→{fmt_bytes(self.peak_after)}"
        big = 0.02 * max(self.peak_before, self.peak_after, 1)  # parts that move by 2 % of the peak or more
        moves = [f"{k} {'+' if v > 0 else '−'}{fmt_bytes(abs(v))}" for k, v in
                 sorted(self.memory_moves.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= big][:3]  # fmt: skip
        if moves:
            mem += f" ({', '.join(moves)})"
        what = ", ".join(self.changes) or "same configuration"
        return f"{self.name} {self.gain:.2f}x ({what}): {terms or 'no term moves by 5%'}; memory {mem}"


def _signed_s(s: float) -> str:
    sign = "+" if s > 0 else "−"
    return f"{sign}{abs(s):.3g} s" if abs(s) >= 1 else f"{sign}{1e3 * abs(s):.3g} ms"


def gain_part(name: str, before: Plan, after: Plan) -> GainPart:
    """The factor ``before.step / after.step`` with the terms and memory that move between them."""
    tb, ta = step_terms(before), step_terms(after)
    mb, ma = before.predicted.mem_breakdown, after.predicted.mem_breakdown
    moves = {k: int(ma.get(k, 0)) - int(mb.get(k, 0)) for k in dict.fromkeys([*mb, *ma])}
    return GainPart(
        name=name, gain=before.predicted.step_s / after.predicted.step_s, changes=_changes(before, after),
        saved_s={k: tb[k] - ta[k] for k in tb}, peak_before=max(before.predicted.peak_mem_bytes or (0,)),
        peak_after=max(after.predicted.peak_mem_bytes or (0,)), memory_moves={k: v for k, v in moves.items() if v},
    )  # fmt: skip


@dataclass(frozen=True)
class GainSplit:
    """A claimed gain (``total``, predicted) and its parts, which multiply to it."""

    baseline: str  # what the gain is over, e.g. "the authors' megatron-lm-2021 configuration dp4 tp8 pp12 ..."
    total: float
    parts: tuple[GainPart, ...]

    @property
    def needs_scrutiny(self) -> bool:
        return self.total > SCRUTINY_GAIN

    def part(self, name: str) -> GainPart | None:
        return next((p for p in self.parts if p.name == name), None)

    def lines(self) -> list[str]:
        """The split, one line per part, then the scrutiny flag where the claim is above 1.3x."""
        out = [f"predicted gain over {self.baseline}: {self.total:.2f}x = "
               + " x ".join(f"{p.gain:.2f}x {p.name}" for p in self.parts)]  # fmt: skip
        out += [f"  {p.text()}" for p in self.parts]
        if self.needs_scrutiny:
            out.append(f"  NEEDS SCRUTINY: {self.total:.2f}x over a tuned configuration is above {SCRUTINY_GAIN}x; "
                       f"carried by {self.carried_by()}")  # fmt: skip
        return out

    def carried_by(self) -> str:
        """The terms carrying the whole gain (summed over the parts), largest first."""
        tot: dict[str, float] = {}
        for p in self.parts:
            for k, v in p.saved_s.items():
                tot[k] = tot.get(k, 0.0) + v
        whole = GainPart("all", self.total, (), tot, 0, 0, {})
        return ", ".join(f"{k} ({100 * s:.0f}% of the time saved)" for k, s in whole.carriers) or "no single term"

    def note(self) -> str:
        """The Plan note (one line, its pieces apart by ``NOTE_SEP``): ``gain over ...: 1.58x predicted
        | planning ... | mechanisms ... | engine ... | NEEDS SCRUTINY ...`` (``explain_gain`` lays it out)."""
        pieces = [f"{NOTE_PREFIX}{self.baseline}: {self.total:.2f}x predicted = "
                  + " x ".join(f"{p.gain:.2f}x {p.name}" for p in self.parts)]  # fmt: skip
        pieces += [p.text() for p in self.parts]
        if self.needs_scrutiny:
            pieces.append(f"NEEDS SCRUTINY: above {SCRUTINY_GAIN}x over a tuned configuration; carried by "
                          f"{self.carried_by()}")  # fmt: skip
        return NOTE_SEP.join(pieces)

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "total": self.total, "needs_scrutiny": self.needs_scrutiny,
                "parts": [{"name": p.name, "gain": p.gain, "changes": list(p.changes), "saved_s": dict(p.saved_s),
                           "carriers": [k for k, _ in p.carriers], "peak_before": p.peak_before,
                           "peak_after": p.peak_after} for p in self.parts]}  # fmt: skip


#: the names of the three parts, in the order they multiply
PLANNING = "planning (degrees, microbatch)"
MECHANISMS = "mechanisms the tuned configuration lacked"
ENGINE = "engine conventions"


def split_gain(baseline: str, tuned: Plan, same: Plan, own: Plan, best: Plan) -> GainSplit:
    """The claimed gain ``tuned.step / best.step`` as planning x mechanisms x engine conventions
    (see the module docstring for the four plans). A part's factor is below 1.0 where the search's
    plan of that step is predicted slower than the previous one (e.g. an engine's conventions that
    cost more than the authors'); the product is the claim either way."""
    parts = (gain_part(PLANNING, tuned, same), gain_part(MECHANISMS, same, own), gain_part(ENGINE, own, best))
    return GainSplit(baseline=baseline, total=tuned.predicted.step_s / best.predicted.step_s, parts=parts)


def explain_gain(notes: tuple[str, ...] | list[str]) -> list[str]:
    """The lines ``meshplan explain`` prints for a plan's gain notes: the claim, one line per part,
    and the scrutiny flag on a line of its own."""
    out = []
    for n in notes:
        if n.startswith(NOTE_PREFIX):
            head, *rest = n.split(NOTE_SEP)
            out.append(f"- {head}")
            out += [f"  {'!! ' if r.startswith('NEEDS SCRUTINY') else ''}{r}" for r in rest]
    return out


def with_gain_note(plan: Plan, split: GainSplit) -> Plan:
    """``plan`` with ``split.note()`` in its notes (replacing an earlier gain note)."""
    import dataclasses

    notes = tuple(n for n in plan.notes if not n.startswith(NOTE_PREFIX)) + (split.note(),)
    return dataclasses.replace(plan, notes=notes)
