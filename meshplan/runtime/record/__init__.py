"""Records and measurement: the RunRecord, per-phase times, progress lines, comparability.
"""
