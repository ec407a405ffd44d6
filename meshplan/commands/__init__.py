"""One module per ``meshplan`` subcommand.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
``meshplan.cli`` lists them in ``COMMANDS``; a module is imported only when its command runs
(and to build its argument parser), so ``meshplan --help`` stays fast.
"""
