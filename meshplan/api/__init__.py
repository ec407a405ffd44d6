"""The model-level public API that ``meshplan/__init__.py`` names and the CLI's commands call.

``plan``: ``autoparallel`` and ``estimate`` (what ``meshplan plan`` and ``meshplan estimate`` do, on
a torch model, a traced ``ModelGraph`` or a model name); ``export``: ``export(plan, to=...)`` (what
``meshplan export`` writes). Above the planner and ``engines/`` (an engine target limits the
search; an export renders an engine's configuration), below ``commands/``: one implementation,
which the commands parse flags into. Torch is imported only when a torch model is traced.
"""
