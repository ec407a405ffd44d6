"""Model-level published formulas for GPT-style decoders (4h MLP), used to check the graph costs.

Notation (FORMULAS.md): B global batch (sequences), b microbatch, s sequence length, h hidden,
a heads, L layers, V vocab, t TP degree, p PP degree, m microbatches, v interleaved chunks,
N parameters. Every function states its formula, unit and source. No torch import.
"""

from __future__ import annotations


def _pos(**kw: float) -> None:
    for k, v in kw.items():
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"{k} must be a positive number, got {v!r}")


def gpt_param_count(num_layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Parameters of a GPT (learned positions, 4h MLP, biases, tied head): ``12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h))``.

    Unit: parameters. Source: Narayanan et al. SC'21, eq. 2.
    """
    _pos(num_layers=num_layers, hidden=hidden, vocab=vocab, seq_len=seq_len)
    L, h = num_layers, hidden
    return 12 * L * h**2 * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * L * h))


def megatron_flops_per_iteration(
    global_batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int
) -> float:
    """Hardware FLOPs of one iteration with full activation recompute: ``96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h))``.

    Counts forward, backward and the recomputed forward (4 passes of 24·B·s·h² per layer).
    Unit: FLOPs. Source: Narayanan et al. SC'21, eq. 3.
    """
    _pos(global_batch=global_batch, seq_len=seq_len, num_layers=num_layers, hidden=hidden, vocab=vocab)
    B, s, L, h, V = global_batch, seq_len, num_layers, hidden, vocab
    return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))


def model_flops_per_iteration(
    global_batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int
) -> float:
    """Model FLOPs of one iteration, no recompute: ``72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h))``.

    Forward + backward only (the MFU convention). Unit: FLOPs. Source: Korthikanti et al. 2022, eq. 7.
    """
    _pos(global_batch=global_batch, seq_len=seq_len, num_layers=num_layers, hidden=hidden, vocab=vocab)
    B, s, L, h, V = global_batch, seq_len, num_layers, hidden, vocab
    return 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))


def model_flops_per_token(num_params: float, num_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): ``6·N + 12·L·h·s``.

    ``N`` excludes embedding tables when following PaLM exactly (the caller decides).
    Unit: FLOPs per token. Source: Chowdhery et al. 2022 (PaLM), appendix B.
    """
    _pos(num_params=num_params, num_layers=num_layers, hidden=hidden, seq_len=seq_len)
    return 6 * num_params + 12 * num_layers * hidden * seq_len


def fwd_flops_per_token_matmul(num_matmul_params: float, num_layers: int, hidden: int, seq_len: int) -> float:
    """Forward FLOPs per token counted by matmuls: ``2·N_matmul + 4·L·h·s``.

    ``N_matmul`` is every weight used in a matmul, the LM head included even when tied; attention
    counted without causal masking (as ``FlopCounterMode`` does). One third of ``model_flops_per_token``.
    Unit: FLOPs per token. Source: FORMULAS.md, from PaLM appendix B.
    """
    _pos(num_matmul_params=num_matmul_params, num_layers=num_layers, hidden=hidden, seq_len=seq_len)
    return 2 * num_matmul_params + 4 * num_layers * hidden * seq_len


def mfu(model_flops_per_s: float, num_devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: ``model FLOP/s / (num_devices · peak FLOP/s)`` (a fraction).

    Source: Chowdhery et al. 2022 (PaLM), appendix B.
    """
    _pos(num_devices=num_devices, peak_flops_per_device=peak_flops_per_device)
    if model_flops_per_s < 0:
        raise ValueError(f"model_flops_per_s must be >= 0, got {model_flops_per_s!r}")
    return model_flops_per_s / (num_devices * peak_flops_per_device)


def pipeline_bubble_fraction(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Bubble time over ideal compute time: ``(p − 1)/(v·m)`` (GPipe/1F1B: v = 1).

    Unit: fraction. Source: Narayanan et al. SC'21, §2.2.1–2.2.2.
    """
    _pos(pp=pp, num_microbatches=num_microbatches, virtual_stages=virtual_stages)
    return (pp - 1) / (virtual_stages * num_microbatches)


def tp_allreduce_bytes_per_layer(micro_batch: int, seq_len: int, hidden: int, elem_bytes: int = 2) -> int:
    """Bytes of each TP all-reduce in a transformer layer: ``b·s·h`` elements.

    There are 2 such all-reduces forward and 2 backward per layer per microbatch.
    Unit: bytes. Source: Narayanan et al. SC'21, §3.2.
    """
    _pos(micro_batch=micro_batch, seq_len=seq_len, hidden=hidden, elem_bytes=elem_bytes)
    return micro_batch * seq_len * hidden * elem_bytes


def pp_boundary_bytes(
    micro_batch: int,
    seq_len: int,
    hidden: int,
    *,
    tp: int = 1,
    scatter_gather: bool = False,
    elem_bytes: int = 2,
) -> float:
    """Bytes sent across one pipeline-stage boundary per microbatch: ``b·s·h`` elements (÷t with scatter/gather).

    Unit: bytes. Source: Narayanan et al. SC'21, §3.2 (scatter/gather optimisation §4.1).
    """
    _pos(micro_batch=micro_batch, seq_len=seq_len, hidden=hidden, tp=tp, elem_bytes=elem_bytes)
    n = micro_batch * seq_len * hidden * elem_bytes
    return n / tp if scatter_gather else n
