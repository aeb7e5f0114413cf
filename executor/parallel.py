"""Tensor and expert parallelism: the process group of the ranks, and how the model splits over them.

`TPGroup` is what the layers see: its size, this process's rank, and the two collectives the
model needs (all-reduce after a row-parallel layer and the vocab-parallel embedding, all-gather
of the lm_head's vocab slices and of fully sharded LoRA's rank slices). At size 1 every
collective returns its input untouched and nothing of torch.distributed is touched, so a
single-rank executor runs exactly the code it ran before TP existed.

How the model splits (the same cuts the adapter store applies to adapters, adapter_store/layout.py):

  qkv_proj, gate_up_proj   column-parallel: each rank keeps 1/tp of every slice's output rows;
                           kv heads are replicated when tp exceeds their count
  o_proj, down_proj        row-parallel: each rank keeps 1/tp of the input columns, partial sums
                           are all-reduced (the bias is added once, after the reduce)
  embed_tokens, lm_head    vocab-parallel: each rank keeps 1/tp of the vocabulary rows

Expert parallelism (ep_size > 1, MoE models, tp_size 1) uses the same processes and the same
kind of group: every rank holds the whole attention and dense layers (replicated, their TPGroup
is size 1) and a contiguous block of E / ep experts (executor/model/moe.py). The tokens are on
every rank already, so a sparse layer needs no dispatch: each rank runs its experts' (token,
expert) pairs and one all-reduce of [T, H] combines the ranks' partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from loraserve.adapter_store.layout import MAX_TP, qkv_output_ranges
from loraserve.v1 import common_pb2

from .model.config import ModelConfig


@dataclass(eq=False)
class TPGroup:
    size: int = 1
    rank: int = 0
    process_group: object | None = None  # a torch.distributed ProcessGroup (gloo or NCCL) when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.size > 1:
            self.process_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.process_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x on every rank, in place (x contiguous)."""
        if self.size > 1:
            self.process_group.broadcast(x, src).wait()
        return x

    def part(self, size: int) -> slice:
        """This rank's 1/size-th of range(size) (size must divide)."""
        n = size // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, num_kv_heads: int) -> int:
        """kv heads this rank keeps: its share, or one replicated head when tp exceeds their count."""
        return num_kv_heads // self.size if num_kv_heads >= self.size else 1

    def qkv_rows(self, cfg: ModelConfig) -> list[slice]:
        """Rows of q_proj, k_proj and v_proj this rank keeps: the store's QKV rule, reused."""
        m = common_pb2.ModuleLayout(output_sizes=[cfg.q_size, cfg.kv_size, cfg.kv_size], head_size=cfg.head_dim)
        return qkv_output_ranges(m, self.size, self.rank)


def tp_size_error(cfg: ModelConfig, tp: int, max_rank: int = 0, fully_sharded: bool = False) -> str | None:
    """Why `cfg` cannot be split over `tp` ranks (None: it can), naming the sizes that do not divide."""
    if tp < 1:
        return f"tp_size must be at least 1, got {tp}"
    if tp > 1 and cfg.num_experts:
        return (
            f"tp_size {tp}: {cfg.model_type} is a mixture-of-experts model, and those do not split their "
            f"attention over ranks: use --tp-size 1 (and --ep-size to split the experts)"
        )
    reasons = _split_problems(cfg, tp, max_rank, fully_sharded)
    if not reasons:
        return None
    ok = [n for n in range(1, MAX_TP + 1) if not _split_problems(cfg, n, max_rank, fully_sharded)]
    return f"tp_size {tp} does not split this model: {'; '.join(reasons)} (tp sizes that do: {', '.join(map(str, ok))})"


def ep_with_tp_error(tp: int, ep: int) -> str | None:
    """Why tp and ep ranks cannot be combined (None: they can; one of them must be 1)."""
    if ep > 1 and tp > 1:
        return (
            f"ep_size {ep} with tp_size {tp}: expert parallelism runs with tp_size 1 (attention "
            f"replicated on every rank), use one of --ep-size / --tp-size"
        )
    return None


def ep_size_error(cfg: ModelConfig, ep: int) -> str | None:
    """Why `cfg`'s experts cannot be split over `ep` ranks (None: they can)."""
    if ep < 1:
        return f"ep_size must be at least 1, got {ep}"
    if ep == 1:
        return None
    if not cfg.num_experts:
        return (
            f"ep_size {ep}: {cfg.model_type} is a dense model (no experts to split): expert parallelism "
            f"needs a mixture-of-experts model; use --ep-size 1 (or --tp-size to split a dense model)"
        )
    if cfg.num_experts % ep:
        ok = [n for n in range(1, cfg.num_experts + 1) if cfg.num_experts % n == 0]
        return (
            f"ep_size {ep} does not split this model: {cfg.num_experts} experts do not make {ep} equal "
            f"blocks (ep sizes that do: {', '.join(map(str, ok))})"
        )
    return None


def roles(group: TPGroup, ep_size: int) -> tuple[TPGroup, TPGroup]:
    """(tp, ep) of this rank: the one process group serves as the TP group or as the EP group
    (ep_size > 1 runs with tp_size 1); the other role is a size-1 group."""
    if ep_size > 1:
        return TPGroup(), group
    return group, TPGroup()


def _split_problems(cfg: ModelConfig, tp: int, max_rank: int, fully_sharded: bool) -> list[str]:
    if tp == 1:
        return []
    reasons = []
    if tp > MAX_TP:
        reasons.append(f"the adapter store slices for at most {MAX_TP} ranks")
    if cfg.num_heads % tp:
        reasons.append(f"{cfg.num_heads} attention heads")
    kvh = cfg.num_kv_heads
    if (kvh >= tp and kvh % tp) or (kvh < tp and tp % kvh):
        reasons.append(f"{kvh} kv heads (tp_size must divide them, or be a multiple of them)")
    if cfg.intermediate_size % tp:
        reasons.append(f"intermediate size {cfg.intermediate_size}")
    if cfg.vocab_size % tp:
        reasons.append(f"vocabulary of {cfg.vocab_size}")
    if fully_sharded and max_rank % tp:
        reasons.append(f"max LoRA rank {max_rank} (fully sharded LoRA cuts the rank)")
    return reasons


def open_store(host: str, port: int, size: int, is_master: bool, timeout_s: float):
    """The TCPStore the ranks meet at; rank 0 opens it (port 0: any free port, read `.port`)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, size, is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def make_group(store, rank: int, size: int, backend: str, timeout_s: float) -> TPGroup:
    """This rank's TPGroup; blocks until every rank has joined. A collective that waits longer
    than timeout_s on another rank fails instead of hanging."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("tp", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout_s))
    return TPGroup(size, rank, pg)
