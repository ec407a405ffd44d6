"""Training data that each rank reads for itself: token files, user Datasets, per-step hooks.

Every source is a stream of *global samples* numbered 0, 1, 2, ...; step ``s`` consumes the
``global_batch`` samples after the ``samples_seen`` before it. Data-parallel replica ``d`` of
``D`` reads only samples ``[d*B/D, (d+1)*B/D)`` of that step (the slice ``ParallelModel.step``
would have cut from the global batch, so losses equal a global-batch run); within a pipeline
only the ranks whose stages read model inputs read inputs (the first stage, and a later one that
reads some, e.g. a decoder's ids) and only the one holding the last stage reads targets;
tensor-parallel ranks of one replica read the same samples. The position is one integer
(``samples_seen``), saved in every checkpoint, so a resumed run continues with the very next
sample even under another plan or global batch.

Sources (``--data``):

- ``tokens.bin`` (``meshplan.tokenfile``): memory-mapped, sampled into ``(seq+1)``-long windows
  whose start for global sample ``g`` is drawn from a PCG64 stream keyed by ``(seed, g // 4096)``
  (uniform, with replacement, as nanoGPT samples), independent of batch size and world size.
  ``eval_batches`` reads the held-out ``tokens.val.bin`` in fixed consecutive windows.
- ``pkg.mod:fn`` where ``fn()`` returns a ``torch.utils.data.Dataset``: DistributedSampler
  semantics (a permutation per epoch from ``seed + epoch``, epochs continue across steps); an
  ``IterableDataset`` is iterated in order and each replica keeps its own samples. Items are a
  1-D ``(seq+1)`` token tensor, an ``(inputs, target)`` pair (inputs a tensor, tuple or dict of
  tensors), or a dict of tensors with ``labels`` (the rest are the inputs, by keyword).
- ``pkg.mod:fn`` where ``fn(step, batch_size, seq_len)`` returns the global batch (the old hook):
  ``(inputs, targets)`` with inputs a tensor, tuple or dict of tensors, or one dict with ``labels``,
  and the synthetic default: every rank builds the global batch and ``step`` slices it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from meshplan.runtime.loop.batch_check import hook_batch
from meshplan.tokenfile import FileIdentity, file_change, open_tokens, read_meta, val_path

DP_AXES = ("dp_replicate", "dp_shard", "dp")
BLOCK = 4096  # samples per PCG64 key (token-window starts)
Batch = tuple[Any, torch.Tensor | None]  # inputs: a tensor, tuple or dict of tensors (None where no stage reads one)


@dataclass(frozen=True)
class Share:
    """Which samples and which halves of them this rank reads."""

    replica: int
    replicas: int
    inputs: bool = True
    targets: bool = True


def rank_share(env: Any, has_first: bool = True, has_last: bool = True) -> Share:
    """This rank's data-parallel replica (mixed radix over the dp axes present) and its pipeline role:
    ``has_first``: its stages read model inputs (``ParallelModel.reads_inputs``); ``has_last``: targets."""
    idx, n = 0, 1
    for axis in DP_AXES:
        d = env.degree(axis)
        idx, n = idx * d + env.coord(axis), n * d
    return Share(idx, n, has_first, has_last)


class DataStream:
    """Base: position bookkeeping; subclasses read ``samples`` (global indices) for this rank."""

    local = True  # batches are this rank's share (False: the global batch, sliced by step())
    kind = "stream"

    def __init__(self, global_batch: int, share: Share):
        if global_batch % share.replicas:
            raise ValueError(f"global batch {global_batch} is not divisible by {share.replicas} data-parallel replicas")
        self.global_batch, self.share, self.samples_seen = global_batch, share, 0

    def my_samples(self) -> range:
        per = self.global_batch // self.share.replicas
        first = self.samples_seen + self.share.replica * per
        return range(first, first + per)

    def next_batch(self) -> Batch:
        """This rank's part of the next step's batch; advances the position by one global batch."""
        out = self._read(self.my_samples()) if self.share.inputs or self.share.targets else (None, None)
        self.samples_seen += self.global_batch
        return out

    def _read(self, samples: range) -> Batch:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind", self.kind) != self.kind:
            raise ValueError(f"checkpoint data position is for a {state['kind']!r} source, this run reads {self.kind!r}")
        self.samples_seen = int(state["samples_seen"])

    def max_token_id(self) -> int | None:
        """Largest token id this source can produce, when known without reading it all."""
        return None


class TokenStream(DataStream):
    """(seq+1)-long windows of a memory-mapped token file."""

    kind = "tokens"

    def __init__(self, path: str | Path, seq_len: int, seed: int, global_batch: int, share: Share):
        super().__init__(global_batch, share)
        if seq_len < 1:
            raise ValueError(f"--data {path}: token files need the plan's seq_len (got {seq_len}); re-plan with --seq")
        self.path, self.seq_len, self.seed = Path(path), seq_len, seed
        self.meta = read_meta(self.path)
        self.tokens = open_tokens(self.path, self.meta.dtype)
        if self.tokens.shape[0] < seq_len + 1:
            raise ValueError(f"--data {path}: {self.tokens.shape[0]} tokens, fewer than one window of seq_len+1 = {seq_len + 1}")
        self._block: tuple[int, np.ndarray] | None = None
        self.identity = FileIdentity.of(self.path)  # checked before every read (check_unchanged)

    def check_unchanged(self) -> None:
        """DataChangedError when the file changed since it was opened: never train on what it became."""
        what = file_change(self.identity, self.path)
        if what is not None:
            from meshplan.runtime.loop.faults import DataChangedError

            step = self.samples_seen // self.global_batch + 1
            raise DataChangedError(
                f"--data {self.path} changed under the running job before step {step}: it {what}; stopped before "
                "training on it. Put the original file back and resume (--resume), or start a new --checkpoint-dir "
                "for the new data")

    def start(self, g: int) -> int:
        """First token of global sample ``g``'s window."""
        b = g // BLOCK
        if self._block is None or self._block[0] != b:
            rng = np.random.Generator(np.random.PCG64([self.seed, b]))
            self._block = (b, rng.integers(0, self.tokens.shape[0] - self.seq_len, size=BLOCK))
        return int(self._block[1][g % BLOCK])

    def _read(self, samples: range) -> Batch:
        self.check_unchanged()
        return windows(self.tokens, [self.start(g) for g in samples], self.seq_len, self.share)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "file": self.path.name, "tokens": int(self.tokens.shape[0]), "seed": self.seed,
                "header_sha256": self.identity.header_sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The position, after checking that this is the file the checkpoint was trained on (when it says)."""
        head, n = state.get("header_sha256"), state.get("tokens")
        if head is not None and (head != self.identity.header_sha256 or int(n) != int(self.tokens.shape[0])):
            raise ValueError(
                f"--data {self.path} is not the token file this checkpoint was trained on ({n:,} tokens, header "
                f"sha256 {head[:12]}; this file: {int(self.tokens.shape[0]):,} tokens, {self.identity.header_sha256[:12]}); "
                "resume with the original file, or start a new --checkpoint-dir for the new data")
        super().load_state_dict(state)

    def max_token_id(self) -> int:
        return self.meta.max_token_id

    def eval_batches(self, n_batches: int) -> list[Batch]:
        """Up to ``n_batches`` global batches of consecutive windows of the held-out file (this rank's share)."""
        vp = val_path(self.path)
        if not vp.is_file():
            raise ValueError(f"--eval-every: no held-out file {vp} (prepare-data --val-fraction > 0 writes it)")
        val = open_tokens(vp, self.meta.dtype)
        n_windows = (val.shape[0] - 1) // self.seq_len
        n_batches = min(n_batches, n_windows // self.global_batch)
        if n_batches < 1:
            raise ValueError(f"--eval-every: {vp} holds {n_windows} windows of {self.seq_len + 1} tokens, "
                             f"fewer than one global batch ({self.global_batch}); raise --val-fraction")
        per = self.global_batch // self.share.replicas
        out = []
        for b in range(n_batches):
            first = b * self.global_batch + self.share.replica * per
            out.append(windows(val, [w * self.seq_len for w in range(first, first + per)], self.seq_len, self.share))
        return out


def windows(tokens: np.ndarray, starts: list[int], seq_len: int, share: Share) -> Batch:
    """Inputs ``t[s:s+seq]`` and targets ``t[s+1:s+seq+1]`` as int64, only the halves ``share`` reads."""
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return (t[:, :-1].contiguous() if share.inputs else None, t[:, 1:].contiguous() if share.targets else None)


class DatasetStream(DataStream):
    """A user ``Dataset`` (DistributedSampler semantics) or ``IterableDataset`` (in order)."""

    kind = "dataset"

    def __init__(self, dataset: Any, seed: int, global_batch: int, share: Share, shuffle: bool = True):
        super().__init__(global_batch, share)
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if not self.iterable:
            self.length = len(dataset)
            if self.length < 1:
                raise ValueError("--data: the dataset is empty")
        self._perm: tuple[int, torch.Tensor] | None = None
        self._it: Iterator | None = None
        self._it_pos = 0

    def index(self, g: int) -> int:
        epoch, i = divmod(g, self.length)
        if not self.shuffle:
            return i
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)  # DistributedSampler's seed + epoch
            self._perm = (epoch, torch.randperm(self.length, generator=gen))
        return int(self._perm[1][i])

    def _item(self, g: int) -> Any:
        if not self.iterable:
            return self.dataset[self.index(g)]
        if self._it is None or self._it_pos > g:
            self._it, self._it_pos = iter(self.dataset), 0
        while True:
            try:
                item = next(self._it)  # type: ignore[arg-type]
            except StopIteration:
                self._it, self._it_pos = iter(self.dataset), self._it_pos  # next pass over the stream
                item = next(self._it)
            self._it_pos += 1
            if self._it_pos - 1 == g:
                return item

    def _read(self, samples: range) -> Batch:
        xs, ys = zip(*(split_item(self._item(g)) for g in samples))
        x = stack_inputs(list(xs)) if self.share.inputs else None
        y = torch.stack(ys) if self.share.targets else None
        return x, y


def stack_inputs(items: list[Any]) -> Any:
    """Items' inputs (each a tensor, tuple or dict of tensors, all alike) stacked entry by entry."""
    first = items[0]
    if isinstance(first, dict):
        return {k: torch.stack([it[k] for it in items]) for k in first}
    if isinstance(first, tuple):
        return tuple(torch.stack(col) for col in zip(*items))
    return torch.stack(items)


def split_item(item: Any) -> tuple[Any, torch.Tensor]:
    """A dataset item as (inputs, target); inputs a tensor, a tuple or a dict of tensors."""
    if isinstance(item, dict):
        if "labels" in item:
            x, y = hook_batch(item)
            return _as_inputs(x), torch.as_tensor(y)
        raise ValueError(f"--data: dict items need 'labels' (the targets), got keys {sorted(item)}")
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return _as_inputs(item[0]), torch.as_tensor(item[1])
    t = torch.as_tensor(item)
    if t.dim() == 1 and not t.dtype.is_floating_point and t.shape[0] >= 2:
        return t[:-1], t[1:]
    raise ValueError("--data: dataset items must be a 1-D token window of seq_len+1, an (inputs, target) pair, "
                     f"or a dict of tensors with labels; got {type(item).__name__}")


def _as_inputs(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: torch.as_tensor(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return tuple(torch.as_tensor(v) for v in x)
    return torch.as_tensor(x)


class GlobalBatchStream(DataStream):
    """The old contract: ``fn(step, batch, seq_len)`` gives the global batch on every rank."""

    local = False
    kind = "hook"

    def __init__(self, fn: Callable[[int, int, int], tuple], seq_len: int, global_batch: int, share: Share):
        super().__init__(global_batch, share)
        self.fn, self.seq_len = fn, seq_len

    def next_batch(self) -> Batch:
        step = self.samples_seen // self.global_batch + 1
        x, y = hook_batch(self.fn(step, self.global_batch, self.seq_len))
        self.samples_seen += self.global_batch
        return x, y


def load_data_fn(spec: str) -> Callable:
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"--data {spec!r}: expected tokens.bin or package.module:function")
    fn = getattr(importlib.import_module(mod), attr, None)
    if not callable(fn):
        raise ValueError(f"--data {spec!r}: {mod} has no function {attr}")
    return fn


def is_step_hook(fn: Callable) -> bool:
    """True for the per-step hook ``fn(step, batch_size, seq_len)`` (three required parameters)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) >= 3


def open_stream(spec: str | None, *, seq_len: int, seed: int, global_batch: int, share: Share,
                synthetic: Callable[[int, int, int], tuple] | None = None) -> DataStream:
    """The stream ``--data spec`` names (None: ``synthetic``, the global-batch default)."""
    if spec is None:
        if synthetic is None:
            raise ValueError("no --data and no synthetic data")
        return GlobalBatchStream(synthetic, seq_len, global_batch, share)
    if ":" not in spec or Path(spec).is_file():
        return TokenStream(spec, seq_len, seed, global_batch, share)
    fn = load_data_fn(spec)
    if is_step_hook(fn):
        return GlobalBatchStream(fn, seq_len, global_batch, share)
    kw = {"seq_len": seq_len} if "seq_len" in inspect.signature(fn).parameters else {}
    ds = fn(**kw)
    if not isinstance(ds, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)):
        raise ValueError(f"--data {spec}: {fn.__name__}() returned {type(ds).__name__}, not a torch Dataset "
                         "(or define fn(step, batch_size, seq_len) returning the global batch)")
    return DatasetStream(ds, seed, global_batch, share)


def model_vocab(model: nn.Module) -> int | None:
    """Input vocabulary of a token model: its (first) nn.Embedding's rows; None when it has none."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(emb.num_embeddings) if emb is not None else None


def check_vocab(stream: DataStream, model: nn.Module, spec: str | None) -> None:
    """Stop before step 1 when the data holds a token id the model's vocabulary cannot embed."""
    check_token_ids(stream.max_token_id(), model_vocab(model), spec)


def check_token_ids(top: int | None, vocab: int | None, spec: str | None) -> None:
    """ValueError when token id ``top`` is past a ``vocab``-entry embedding (``meshplan run`` checks it
    on the token file's metadata before torchrun starts, each rank on its stream)."""
    if top is not None and vocab is not None and top >= vocab:
        raise ValueError(
            f"--data {spec}: largest token id is {top} but the model's vocabulary has {vocab} entries "
            f"(ids 0..{vocab - 1}); use a model with vocab_size >= {top + 1} or re-tokenize with a smaller tokenizer"
        )
