"""Model families as a new user brings them: tiny configs built from code (no downloads), their
batches, losses, a single-process reference, and the cells of the numerics matrix.

A family is ``Family(name, build, batch, loss)``: ``build()`` returns a fresh, seeded model (dropout
off), ``batch(step)`` returns ``(inputs, targets)`` for one GLOBAL batch (inputs a tensor, a tuple
or a dict, as the user has them), ``loss(output, targets)`` averages over the batch. Cells are
plans made by the planner, the way a user gets them (``estimate`` with fixed degrees, or
``autoparallel``), applied with ``apply_plan`` and trained for ``STEPS`` steps; the result is the
largest loss difference to the one-process reference, or the error raised before training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH, STEPS = 64, 8, 8, 3


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[Any, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    batch_stats: bool = False  # BatchNorm: statistics depend on the microbatch, so dp2/tp2 cells use one


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["logits"]
    return getattr(out, "logits", out[0] if isinstance(out, tuple) else out)


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = _logits(out)
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def mse_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(_logits(out), y)


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def images(step: int, classes: int = 10, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(step)
    return torch.randn(BATCH, 3, size, size, generator=g), torch.randint(0, classes, (BATCH,), generator=g)


def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return fn().train()

    return build


def _tf() -> Any:
    import transformers

    return transformers


_NO_DROP = dict(attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0)


def hf_gpt2() -> nn.Module:
    tf = _tf()
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=16,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def hf_llama() -> nn.Module:
    tf = _tf()
    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                              max_position_embeddings=16))


def hf_qwen2() -> nn.Module:
    tf = _tf()
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                              max_position_embeddings=16))


def hf_mistral() -> nn.Module:
    tf = _tf()
    return tf.MistralForCausalLM(tf.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                                  max_position_embeddings=16, sliding_window=None))


def hf_phi() -> nn.Module:
    tf = _tf()
    return tf.PhiForCausalLM(tf.PhiConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                          intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))


def hf_mixtral() -> nn.Module:
    from moe_models import hf_mixtral_tiny

    return hf_mixtral_tiny()


def hf_qwen2_moe() -> nn.Module:
    from moe_models import hf_qwen2_moe_tiny

    return hf_qwen2_moe_tiny()


def hf_opt() -> nn.Module:
    tf = _tf()
    return tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64,
                                          vocab_size=VOCAB, max_position_embeddings=16, word_embed_proj_dim=32,
                                          dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def hf_neox() -> nn.Module:
    tf = _tf()
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                                  intermediate_size=64, vocab_size=VOCAB,
                                                  max_position_embeddings=16, hidden_dropout=0.0,
                                                  attention_dropout=0.0))


def hf_bert() -> nn.Module:
    tf = _tf()
    return tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                            intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16,
                                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def hf_t5() -> nn.Module:
    tf = _tf()
    return tf.T5ForConditionalGeneration(tf.T5Config(num_layers=2, num_decoder_layers=2, num_heads=4, d_model=32,
                                                     d_kv=8, d_ff=64, vocab_size=VOCAB, dropout_rate=0.0,
                                                     decoder_start_token_id=0, pad_token_id=0))


def hf_vit() -> nn.Module:
    tf = _tf()
    return tf.ViTForImageClassification(tf.ViTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                                     intermediate_size=64, image_size=8, patch_size=4,
                                                     num_labels=10, hidden_dropout_prob=0.0,
                                                     attention_probs_dropout_prob=0.0))


class CNN(nn.Module):
    """A small ResNet-like CNN: conv stem, two residual stages with BatchNorm, pooled linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.stage1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.stage2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.stage1(x)
        x = self.stage2(x)
        return self.head(x.mean(dim=(2, 3)))


class BasicBlock(nn.Module):
    """A ResNet basic block with GroupNorm (statistics per sample: the same on any microbatch)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, cout)
        self.down = nn.Conv2d(cin, cout, 1, stride=stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x)))))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """A tiny ResNet: stem, layer1 (two identical blocks), layer2 (a strided block with a
    projection shortcut and a plain one), pooled linear head. Few repeated blocks: the pipeline
    is cut at the graph's cut points (stage boundaries, block boundaries)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, stride=2), BasicBlock(16, 16))
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class UNet(nn.Module):
    """A two-level UNet: the encoder's skip tensors feed the decoder (no repeated blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        m = self.mid(e2) + e2
        u = self.up(m)
        return self.out(self.dec(torch.cat([u, e1], dim=1)))


class LSTMLM(nn.Module):
    """Embedding, two stacked one-layer LSTMs, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.lstm1 = nn.LSTM(32, 32, batch_first=True)
        self.lstm2 = nn.LSTM(32, 32, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm1(self.emb(ids))
        h, _ = self.lstm2(h)
        return self.head(h)


def zoo_gpt() -> nn.Module:
    from meshplan.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=16))


def dict_net() -> nn.Module:
    from dict_batch import DictNet

    return DictNet()


def _dict_batch(step: int) -> tuple[Any, torch.Tensor]:
    """A dict of features by keyword (token ids and dense per-token features), targets apart."""
    from dict_batch import FEATS
    from dict_batch import VOCAB as DICT_VOCAB

    g = _gen(step)
    ids = torch.randint(0, DICT_VOCAB, (BATCH, SEQ), generator=g)
    return {"ids": ids, "feats": torch.randn(BATCH, SEQ, FEATS, generator=g)}, (ids * 3 + 1) % DICT_VOCAB


def _t5_batch(step: int) -> tuple[Any, torch.Tensor]:
    x, y = tokens(step)
    dec = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), y[:, :-1]], dim=1)
    return {"input_ids": x, "decoder_input_ids": dec}, y


def _vit_batch(step: int) -> tuple[Any, torch.Tensor]:
    x, y = images(step)
    return {"pixel_values": x}, y


def _masked_batch(step: int) -> tuple[Any, torch.Tensor]:
    x, y = tokens(step)
    mask = torch.ones_like(x)
    mask[: BATCH // 2, -2:] = 0  # padded tails on half of the rows
    return {"input_ids": x, "attention_mask": mask}, y


def _unet_batch(step: int) -> tuple[Any, torch.Tensor]:
    g = _gen(step)
    return torch.randn(BATCH, 3, 8, 8, generator=g), torch.randn(BATCH, 3, 8, 8, generator=g)


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("gpt", _seeded(zoo_gpt), tokens, lm_loss),
    Family("hf_gpt2", _seeded(hf_gpt2), tokens, lm_loss),
    Family("hf_llama", _seeded(hf_llama), tokens, lm_loss),
    Family("hf_qwen2", _seeded(hf_qwen2), tokens, lm_loss),
    Family("hf_opt", _seeded(hf_opt), tokens, lm_loss),
    Family("hf_neox", _seeded(hf_neox), tokens, lm_loss),
    Family("hf_mistral", _seeded(hf_mistral), tokens, lm_loss),
    Family("hf_phi", _seeded(hf_phi), tokens, lm_loss),
    Family("hf_mixtral", _seeded(hf_mixtral), tokens, lm_loss),
    Family("hf_qwen2_moe", _seeded(hf_qwen2_moe), tokens, lm_loss),
    Family("hf_bert", _seeded(hf_bert), _masked_batch, lm_loss),
    Family("hf_t5", _seeded(hf_t5), _t5_batch, lm_loss),
    Family("hf_vit", _seeded(hf_vit), _vit_batch, lm_loss),
    Family("cnn", _seeded(CNN), images, lm_loss, batch_stats=True),
    Family("resnet", _seeded(ResNet), images, lm_loss),
    Family("unet", _seeded(UNet), _unet_batch, mse_loss),
    Family("lstm", _seeded(LSTMLM), tokens, lm_loss),
    Family("dict", _seeded(dict_net), _dict_batch, lm_loss),
]}


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def opt_factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference_losses(fam: Family) -> list[float]:
    m = fam.build()
    opt = opt_factory([p for p in m.parameters() if p.requires_grad])
    out = []
    for s in range(STEPS):
        x, y = fam.batch(s)
        loss = fam.loss(_call(m, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def _example(inputs: Any) -> Any:
    """A batch-1 example, as a user's factory gives it (never the microbatch)."""
    if isinstance(inputs, dict):
        return {k: v[:1] for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(v[:1] for v in inputs)
    return inputs[:1]


def comm_bound_cluster(world: int) -> Any:
    """An H100 node whose links are nearly free (each collective costs a launch) and compute slow: the TP placement ILP then shards
    every layer it can, so the tp cells exercise sharded attention/MLP groups on tiny models."""
    import dataclasses

    from meshplan.cost_models.hardware import resolve_cluster

    c = resolve_cluster("h100", world)
    return dataclasses.replace(c, name="comm-free", intra_bw_bytes_per_s=1e18, inter_bw_bytes_per_s=1e18,
                               intra_latency_s=1e-6, inter_latency_s=1e-6,
                               peak_flops={k: v * 1e-6 for k, v in c.peak_flops.items()})


def make_plan(fam: Family, cell: str, world: int) -> Any:
    from meshplan.api.plan import autoparallel, estimate

    model = fam.build()
    ex = _example(fam.batch(0)[0])
    if cell == "auto":
        return autoparallel(model, world, global_batch_size=BATCH, example_inputs=ex, cluster="h100")
    deg = {"dp2": dict(dp=2, tp=1, pp=1), "tp2": dict(dp=1, tp=2, pp=1), "pp2": dict(dp=1, tp=1, pp=2)}[cell]
    m = 4 if cell == "pp2" else (1 if fam.batch_stats else 2)
    cluster = comm_bound_cluster(world) if cell == "tp2" else "h100"
    return estimate(model, world, **deg, num_microbatches=m, global_batch_size=BATCH, cluster=cluster,
                    example_inputs=ex)


def sharded_styles(plan: Any) -> int:
    """How many modules the plan's TP placement shards (styles other than replicate)."""
    return sum(v != "replicate" for v in plan.tp_styles.values())


def run_cell(fam: Family, cell: str, world: int, ref: list[float]) -> tuple[str, float, str, int]:
    """("ok", max loss error, notes, modules the TP placement shards) or ("error", inf, the error
    raised before training, -1)."""
    from meshplan.runtime.apply.api import apply_plan

    stage = "plan"
    try:
        plan = make_plan(fam, cell, world)
        stage = "apply"
        pm = apply_plan(fam.build(), plan, loss_fn=fam.loss, optimizer_factory=opt_factory, dtype="fp32",
                        example_inputs=_example(fam.batch(0)[0]))
    except Exception as e:  # noqa: BLE001 - the cell reports the error it raised before training
        return "error", float("inf"), f"{stage}: {type(e).__name__}: {e}", -1
    losses = [pm.step(*fam.batch(s)) for s in range(STEPS)]
    err = max(abs(a - b) for a, b in zip(losses, ref))
    desc = f"dp{plan.dp} tp{plan.tp} pp{plan.pp} {plan.schedule} m{plan.num_microbatches}"
    return "ok", err, desc + "; " + "; ".join(pm.notes), sharded_styles(plan)


def worker(rank: int, world: int, cells: list[tuple[str, str]]) -> list[tuple[str, str, str, float, str, float, int]]:
    """Runs every (family, cell) inside one spawn; rows (family, cell, status, error, notes, seconds,
    modules the plan's TP placement shards)."""
    torch.manual_seed(0)
    refs: dict[str, list[float]] = {}
    out = []
    for name, cell in cells:
        fam = FAMILIES[name]
        t0 = time.perf_counter()
        if name not in refs:
            refs[name] = reference_losses(fam)
        try:
            status, err, notes, sharded = run_cell(fam, cell, world, refs[name])
        except Exception as e:  # noqa: BLE001 - a failure during training is a bug: report it
            status, err, notes, sharded = "crash", float("inf"), f"{type(e).__name__}: {e}", -1
        out.append((name, cell, status, err, notes[:600], time.perf_counter() - t0, sharded))
    return out

