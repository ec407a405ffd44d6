"""Costing the search's candidates in bound order and stopping early: ``BoundOrderCosting``, used by
``planner.search.Searcher.run``.

The search costs every candidate without simulation ("partial" evaluation: split, memory, DP, a
makespan bound) in order of its lower bound ``lb`` (``ConfigEvaluator.lower_bound``, minimum over the DP
kinds), then simulates the fitting ones in order of their partial step until the best simulated
step and the alternatives within ``ALT_MARGIN`` are known ("phase 2"). A candidate's partial step
is never below its ``lb`` and never above its simulated step (tests/test_search_prune.py), so once
the costing has reached a bound ``lb``, every fitting candidate whose partial step is below ``lb``
is *settled*: no candidate still to be costed can come before it in phase 2's order. Phase 2 runs
over the settled candidates as they appear, exactly as it would over the complete list, and
stops at the same candidate (its stopping test only gets truer further down the list).

A candidate still to be costed, at bound ``lb``, cannot change the result when all hold (else it is
costed as before):

* phase 2 has stopped (its winner, runners-up and stopping point are known);
* for each of its tp, pp, cp and ep degrees other than the winner's, three fitting candidates of
  that degree have partial steps below ``lb`` ("best with tp=4" alternatives are picked among the
  three lowest of the degree, ``finalize._per_degree``), and the same for its family (dp / tp /
  pp / tp+pp, ``finalize._per_family``) when it is not the winner's;
* a candidate that did not fit has a partial step below ``lb`` (the "best plan that did not fit"
  alternative is the one with the lowest partial step).

A candidate certainly out of memory is skipped when a misfit has a partial step below its bound,
no memory re-split could be spent on it, and its family's alternative (``finalize._per_family``)
cannot be it: the family has a fitting candidate, or (once something fits, so that the plan has
alternatives) a costed misfit of the family needs less memory than the candidate's floor.

A candidate that certainly does not fit (its memory floor, ``planner.memory_floor``, is over the
limit, and costing it spends no memory re-split) is *deferred* instead of costed when it cannot be
skipped yet (before anything fits, its family's fitting candidates are not known): it cannot enter
phase 2, so only the tests above read it, through the lowest partial step of a misfit; they cost
deferred candidates when that step decides them, so every decision is the one costing all of them
in bound order gives. Once the costing is done (and phase 2 has run to its end), a deferred
candidate is costed only if the skip test, now with every family's fitting candidates and the
winner known, still needs it (``BoundOrderCosting.finish``).

Comparisons keep a relative margin ``EPS`` so that rounding between the bound's and the
evaluation's sums can never reorder two candidates. The skipped candidates are counted
(``SearchResult.skipped``); a memory re-split (``ConfigEvaluator.memory_split``, at most
``MAX_MEMORY_RESCUES``) is only spent on candidates that are costed. No torch import.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from meshplan.planner.finalize import family
from meshplan.planner.search_types import Config, Evaluation, group

#: Relative margin of every "below the bound" comparison (rounding of differently ordered sums).
EPS = 1e-9
#: Candidates of a degree / family ``finalize`` picks that slot's alternative among.
SLOT_DEPTH = 3
AXES = ("tp", "pp", "cp", "ep")


def _no_costing(c: Config) -> None:
    raise RuntimeError("BoundOrderCosting.cost is not set: the search sets it before deferring candidates")


def slots(c: Config) -> list[tuple[str, object]]:
    """The alternative slots ``c`` can fill: one per degree axis and its family."""
    return [(axis, getattr(c, axis)) for axis in AXES] + [("family", family(c))]


class BoundOrderCosting:
    """Phase 2 run over settled candidates, and the test whether a candidate can be skipped (see the
    module docstring). ``simulate(ev)`` is the exact evaluation of a partial one; ``keep`` and
    ``margin`` are phase 2's stopping rule (``Searcher.keep``, ``ALT_MARGIN``)."""

    def __init__(self, simulate: Callable[[Evaluation], Evaluation], keep: int, margin: float,
                 exhaustive: bool) -> None:  # fmt: skip
        self.simulate = simulate
        self.keep = keep
        self.margin = margin
        self.exhaustive = exhaustive
        self.fitting: list[Evaluation] = []  # simulated, in phase 2's order
        self.stopped = False
        self._heap: list[tuple[float, str, int, Evaluation]] = []  # fitting partials not yet settled
        self._n = 0
        self._slots: dict[tuple[str, object], list[float]] = {}  # lowest partial steps of fitting ones, by slot
        self._winner_slots: list[tuple[str, object]] | None = None
        self._family_fits: dict[str, int] = {}  # fitting candidates costed, by family
        self._family_oom_mem: dict[str, float] = {}  # least memory of a costed misfit, by family
        self._oom_min = math.inf  # lowest partial step of a candidate that did not fit
        #: (bound, candidate, memory floor, limit) of certain misfits not costed yet, in bound order
        self._deferred: deque[tuple[float, Config, float, float]] = deque()
        #: costs a candidate (partial evaluation) and ``add``s it: set by the search before deferring
        self.cost: Callable[[Config], None] = _no_costing
        self.on_simulated: Callable[[int, Evaluation, float], None] | None = None

    def release(self) -> None:
        """Drop the search's callbacks once phase 2 is over (``Searcher.run``): ``cost`` closes over
        the ``Costed`` that holds this object, a reference cycle that kept the whole search (its
        evaluator, memos and evaluations: ~330k objects at 2,048 GPUs) alive until a cyclic-GC
        pass; without it they are freed when the search ends."""
        self.cost = _no_costing
        self.on_simulated = None

    # ---- what was costed -------------------------------------------------------------------
    def add(self, ev: Evaluation) -> None:
        """A costed candidate (partial evaluation)."""
        if not ev.fits:
            self._oom_min = min(self._oom_min, ev.step_s)
            fam = family(ev.config)
            self._family_oom_mem[fam] = min(self._family_oom_mem.get(fam, math.inf), ev.max_mem_bytes)
            return
        heapq.heappush(self._heap, (ev.step_s, ev.config.summary(), self._n, ev))
        self._family_fits[family(ev.config)] = self._family_fits.get(family(ev.config), 0) + 1
        self._n += 1
        for key in slots(ev.config):  # the SLOT_DEPTH lowest partial steps of each slot
            low = self._slots.setdefault(key, [])
            if len(low) < SLOT_DEPTH or ev.step_s < low[-1]:
                low.append(ev.step_s)
                low.sort()
                del low[SLOT_DEPTH:]

    def skip_out_of_memory(self, c: Config, lb: float, floor: float, mem_limit: float, rescue: bool) -> bool:
        """Whether ``c`` certainly does not fit (its memory lower bound ``floor`` is over ``mem_limit``)
        and costing it cannot change the result: a candidate that did not fit has a lower partial
        step (so ``c`` is not the best one that did not fit), its family's alternative is not ``c``
        (the family has a fitting candidate, or, once something fits, a candidate of the family
        that did not fit needs less memory than ``floor``: the family's alternative is then the
        misfit closest to fitting) and costing it would spend no memory re-split (``rescue`` False)."""
        if self.exhaustive or rescue or not floor > mem_limit * (1 + EPS):
            return False
        return self._family_skips(c, floor) and self._oom_below(lb)

    def _family_skips(self, c: Config, floor: float) -> bool:
        """Whether ``c``'s family's alternative cannot be ``c`` (floor: its memory lower bound, over
        the limit): the family has a fitting candidate, or something fits and a costed misfit of the
        family needs less memory than ``floor``."""
        fam = family(c)
        if self._family_fits.get(fam, 0):
            return True
        return bool(self._n) and floor > self._family_oom_mem.get(fam, math.inf) * (1 + EPS)

    # ---- certain misfits, costed when needed -----------------------------------------------------
    def defer(self, c: Config, lb: float, floor: float, mem_limit: float) -> None:
        """Keep ``c`` (bound ``lb``), which certainly does not fit (``floor`` over ``mem_limit``) and
        whose costing spends no memory re-split, for later instead of costing it now: it cannot enter
        phase 2, and the tests above cost deferred candidates (lowest bound first) whenever the
        lowest partial step of a misfit decides them, so they decide as if every one had been costed
        in bound order. ``finish`` costs those the skip test still needs once the costing is done."""
        self._deferred.append((lb, c, floor, mem_limit))

    @property
    def deferred(self) -> int:
        """Candidates deferred and not costed yet (they count as out of memory: they are)."""
        return len(self._deferred)

    def finish(self) -> int:
        """Once every other candidate is costed: run phase 2 to its end (deferred candidates cannot
        enter it), then cost the deferred candidates the skip test cannot skip, now that every
        family's fitting candidates and phase 2's winner are known; returns how many were skipped.

        When some family other than the winner's has no fitting candidate but a costed misfit, its
        alternative is a misfit, so the "best plan that did not fit" is not reported
        (``finalize.select_alternatives``): the lowest misfit step decides nothing, and a deferred
        candidate is skipped on its family's test alone."""
        self.settle(math.inf)
        no_best_misfit = False
        if self.fitting and not self.exhaustive:
            winner = family(min(self.fitting, key=lambda e: (e.step_s, e.config.summary())).config)
            no_best_misfit = any(f != winner and not self._family_fits.get(f, 0) for f in self._family_oom_mem)
        skipped = 0
        while self._deferred:
            lb, c, floor, mem_limit = self._deferred.popleft()
            if (no_best_misfit and self._family_skips(c, floor)) or self.skip_out_of_memory(c, lb, floor, mem_limit, False):
                skipped += 1
            else:
                self.cost(c)
        return skipped

    def _oom_below(self, lb: float) -> bool:
        """Whether a misfit has a partial step below ``lb``, costing deferred ones with bounds below
        ``lb`` (lowest first) until one has or none is left: a partial step is never below its bound,
        so this is the answer costing every candidate in bound order would give."""
        below = lb * (1 - EPS)
        while not self._oom_min < below and self._deferred and self._deferred[0][0] < below:
            self.cost(self._deferred.popleft()[1])
        return self._oom_min < below

    # ---- phase 2 -------------------------------------------------------------------------------
    def settle(self, lb: float) -> None:
        """Run phase 2 over the fitting candidates whose partial step is below ``lb`` (all of them
        with ``lb = inf``): nothing costed later can come before them."""
        while self._heap and not self.stopped and (lb == math.inf or self._heap[0][0] < lb * (1 - EPS)):
            pe = heapq.heappop(self._heap)[3]
            self._step(pe)

    def _step(self, pe: Evaluation) -> None:
        best = min((e.step_s for e in self.fitting), default=math.inf)
        groups = {group(e.config) for e in self.fitting if e.step_s <= best * (1 + self.margin)}
        if (
            not self.exhaustive
            and pe.step_s > best
            and (len(groups) >= self.keep or pe.step_s > best * (1 + self.margin))
        ):
            self.stopped = True
            return
        ev = self.simulate(pe)
        self.fitting.append(ev)
        if self.on_simulated is not None:
            self.on_simulated(len(self.fitting), pe, best)

    # ---- the skip test -----------------------------------------------------------------------
    def can_skip(self, c: Config, lb: float) -> bool:
        """Whether costing ``c`` (lower bound ``lb``) cannot change the search's result."""
        if self.exhaustive or not self.stopped:
            return False
        if self._winner_slots is None:  # phase 2's winner (its order: step, then summary)
            self._winner_slots = slots(min(self.fitting, key=lambda e: (e.step_s, e.config.summary())).config)
        below = lb * (1 - EPS)
        for key in slots(c):
            if key in self._winner_slots:
                continue
            low = self._slots.get(key, ())
            if len(low) < SLOT_DEPTH or not low[SLOT_DEPTH - 1] < below:
                return False
        return self._oom_below(lb)
