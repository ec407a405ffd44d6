"""torchrun as ``meshplan run`` starts it: ``python -m meshplan.runtime.launch.agent <torchrun arguments>``.

It is ``torch.distributed.run.main`` itself, run inside ``meshplan.console.third_party_quiet``:
torchrun's notices (the OMP_NUM_THREADS banner, "Sending process ... closing signal SIGTERM")
stay off the output unless the ranks' ``--verbose`` is among the arguments; its errors still
show. When ranks fail, torchrun's ``ChildFailedError`` (a traceback and a table of ~40 lines) is
told as one line per failed rank (rank, pid, exit code or signal); the reason itself is in the
failing rank's own one-line report and ``run_tree``'s closing line (``runtime.loop.faults``).
With ``--verbose`` torchrun's full report is printed as torchrun prints it. Exit code: torchrun's
(1 when ranks failed). torch is imported inside ``main``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from meshplan.console import third_party_quiet


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    verbose = "--verbose" in args  # the ranks' flag (commands/run.build_command): the same choice here
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    with third_party_quiet(verbose):
        try:
            torchrun(args)
        except ChildFailedError as e:
            if verbose:
                raise
            for rank, failure in sorted(e.failures.items()):
                print(f"torchrun: rank {rank} (pid {failure.pid}) stopped: {failure_text(failure.exitcode)}",
                      file=sys.stderr, flush=True)
            return 1
    return 0


def failure_text(exitcode: int) -> str:
    """'exit code 1', or the signal that ended the process ('signal 9 (SIGKILL)')."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    import signal

    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown"
    return f"signal {-exitcode} ({name})"


if __name__ == "__main__":
    sys.exit(main())
