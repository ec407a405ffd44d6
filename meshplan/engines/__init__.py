"""Plans to and from the configurations of torchtitan, Megatron-LM and DeepSpeed (text in, text out).

``spec``: the engine-neutral ``EngineSpec``, each engine's capabilities, ``nearest``;
``megatron``, ``torchtitan``, ``deepspeed``: ``export(spec) -> str`` and ``parse(text, ...) ->
Imported``; ``formats``: one table of them. Never imports torch or ``runtime/``.
"""
