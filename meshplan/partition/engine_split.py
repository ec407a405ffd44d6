"""Stage splits an engine can express: its rule for how many repeated blocks each stage holds.

A pipeline engine does not take an arbitrary split of the layers; it takes a rule:

- ``"even"``: every stage the same number of blocks (DeepSpeed's ``PipelineModule`` with
  ``partition_method="uniform"`` as meshplan exports it);
- ``"first_last"``: even but for the first and the last stage, each any count >= 1 (Megatron-LM's
  ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``; v = 1 only,
  ``rule_for`` makes it "even" with virtual stages);
- ``"fewer_first_last"``: ``per`` blocks a stage, the first ``per - a`` and the last ``per - b``
  with ``0 <= a, b < per`` (torchtitan's ``pipeline_parallel_layers_per_stage`` with
  ``pipeline_parallel_first/last_stage_less_layers``, virtual stages included);
- ``"any"``: any contiguous split (meshplan's own runtime).

Layers that are not repeated blocks (embedding before the first block, head after the last, glue
between blocks) go with the stage of the next block (the last stage for trailing ones), as the
engines place them. ``rule_split`` returns the legal split with the smallest bottleneck (the
largest stage cost), the quantity a time-balanced split minimises. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

SPLIT_RULES = ("any", "even", "first_last", "fewer_first_last")


def block_counts(rule: str, n_blocks: int, n_stages: int) -> Iterator[tuple[int, ...]]:
    """Every blocks-per-stage tuple ``rule`` allows for ``n_blocks`` over ``n_stages`` (each >= 1)."""
    if rule not in SPLIT_RULES or rule == "any":
        raise ValueError(f"split rule must be one of {', '.join(SPLIT_RULES[1:])}, got {rule!r}")
    n, L = n_stages, n_blocks
    if n < 1 or L < n:
        return
    if n == 1:
        yield (L,)
        return
    if rule == "even":
        if L % n == 0:
            yield (L // n,) * n
        return
    if rule == "first_last":
        if n == 2:
            yield from ((f, L - f) for f in range(1, L))
            return
        for e in range(1, (L - 2) // (n - 2) + 1):  # the middle stages' count
            rest = L - e * (n - 2)
            yield from ((f, *([e] * (n - 2)), rest - f) for f in range(1, rest))
        return
    # fewer_first_last: L = n * per - a - b, 0 <= a, b < per
    for per in range(-(-L // n), L + 1):
        less = n * per - L
        if less > 2 * (per - 1):
            break
        for a in range(max(0, less - (per - 1)), min(per - 1, less) + 1):
            yield (per - a, *([per] * (n - 2)), per - (less - a))


def block_runs(is_block: Sequence[bool], counts: Sequence[int]) -> list[tuple[int, int]]:
    """Layer ranges of the stages holding ``counts`` blocks each (a stage begins at its first
    block: glue before it joins it; trailing layers join the last stage)."""
    blocks = [i for i, b in enumerate(is_block) if b]
    if sum(counts) != len(blocks) or min(counts, default=0) < 1:
        raise ValueError(f"blocks per stage {list(counts)} must be >= 1 each and add up to the model's "
                         f"{len(blocks)} repeated blocks")
    starts, k = [0], 0
    for c in counts[:-1]:
        k += c
        starts.append(blocks[k])
    bounds = [*starts, len(is_block)]
    return list(zip(bounds[:-1], bounds[1:]))


def rule_for(rule: str, virtual_stages: int) -> str:
    """Megatron-LM takes uneven first/last stages only without virtual stages: "even" with them."""
    return "even" if rule == "first_last" and virtual_stages > 1 else rule


def rule_split(
    costs: Sequence[float], is_block: Sequence[bool], rule: str, n_stages: int
) -> list[tuple[int, int]] | None:
    """The split of the layers (``(start, end)`` per stage) that ``rule`` allows with the smallest
    largest-stage cost; None when the rule allows none (e.g. "even" with blocks not divisible)."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best: tuple[float, list[tuple[int, int]]] | None = None
    for counts in block_counts(rule, sum(map(bool, is_block)), n_stages):
        runs = block_runs(is_block, counts)
        worst = max(prefix[b] - prefix[a] for a, b in runs)
        if best is None or worst < best[0]:
            best = (worst, runs)
    return best[1] if best else None
