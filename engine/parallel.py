"""Tensor parallelism (`tensor_parallel_size`, docs/architecture.md §13): one engine, its model sharded over N ranks.

Rank 0 is the engine's own process: it schedules, samples and owns the outputs. Ranks 1..N-1 are processes it
starts (`torch.multiprocessing`, spawn), each holding its shard of the weights and of the KV cache (its KV heads);
they run the same forward on the metadata rank 0 broadcasts each step, as one packed int64 tensor (no pickling on
the hot path). Collectives go through torch.distributed: gloo on CPU, NCCL on CUDA (a rank per GPU).

Megatron-style sharding (`Shard`): q/k/v and gate/up by output rows (heads, intermediate), o and down by input
columns followed by one all-reduce each; the embedding and the LM head by vocabulary rows (an all-reduce of the
looked-up rows, an all-gather of the logits). KV heads split when N divides them; when they divide N, each is
replicated on N / Hkv ranks. A rank that dies ends the engine: its peers' next collective fails (the service then
exits 1), and a worker whose parent is gone exits by itself; nothing waits forever.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from engine.models import ModelConfig

log = logging.getLogger("sluice.parallel")

_STOP, _STEP = 0, 1
_HEADER = 6  # command, T, B, max_blocks, logit rows, 0


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds of a model: head and row ranges, for `LlamaModel`."""

    rank: int
    world: int
    num_heads: int  # query heads here
    num_kv_heads: int  # KV heads here
    kv_head_start: int
    intermediate: int  # MLP rows here
    vocab: int  # vocabulary rows here (the vocabulary padded to a multiple of world)

    @property
    def head_start(self) -> int:
        return self.rank * self.num_heads

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int = 0, world: int = 1) -> Shard:
        """Raises ValueError, naming the sizes, for a model that cannot split `world` ways."""
        if world < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
        problems = []
        if cfg.num_heads % world:
            problems.append(f"{cfg.num_heads} attention heads")
        if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
            problems.append(f"{cfg.num_kv_heads} KV heads (nor do they divide it)")
        if cfg.intermediate_size % world:
            problems.append(f"intermediate size {cfg.intermediate_size}")
        if problems:
            raise ValueError(f"tensor_parallel_size={world} does not divide the model's {', '.join(problems)}")
        if cfg.num_kv_heads % world == 0:
            kv, kv_start = cfg.num_kv_heads // world, rank * (cfg.num_kv_heads // world)
        else:  # fewer KV heads than ranks: each one replicated on world / Hkv ranks
            kv, kv_start = 1, rank // (world // cfg.num_kv_heads)
        return cls(rank, world, cfg.num_heads // world, kv, kv_start, cfg.intermediate_size // world,
                   -(-cfg.vocab_size // world))

    @staticmethod
    def pad(t: torch.Tensor, n: int) -> torch.Tensor:
        """`t` with zero rows appended up to `n` (a vocabulary shard past the vocabulary's end)."""
        return t if t.shape[0] >= n else torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    if shard.world > 1:
        dist.all_reduce(x)
    return x


def all_gather_rows(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[B, n] on each rank -> [B, world * n], ranks in order."""
    if shard.world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(shard.world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


JOIN_TIMEOUT = datetime.timedelta(seconds=120)  # from the last rank ready to the group joined


def _init(rank: int, world: int, port: int, device: torch.device) -> None:
    # NOTE: the rendezvous is bounded (every rank is loaded by then); the collectives are not: an idle server waits
    # for its next step for as long as it is idle. A dead peer ends a gloo collective with an error; NCCL would wait
    # (rank 0 checks its ranks before each step; the service's step watchdog catches one dying mid-step).
    # All ranks are on this host: gloo talks over loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=JOIN_TIMEOUT)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(days=365))


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


class Workers:
    """Rank 0's side: starts ranks 1..N-1 (`__init__`), joins the process group once every rank has loaded its
    shard (`join`), broadcasts each step, stops them (`close`)."""

    def __init__(self, config, model_dir: Path, device: torch.device, dtype: torch.dtype):
        self.world = config.tensor_parallel_size
        self.device = device
        self.closed = self.joined = self.layout_sent = False
        self.port = _free_port()
        ctx = mp.get_context("spawn")
        self.pipes = [ctx.Pipe() for _ in range(1, self.world)]
        self.procs = [ctx.Process(target=_worker_main, name=f"sluice-tp-rank{r}", daemon=True,
                                  args=(r, self.world, self.port, config, str(model_dir), str(device), dtype,
                                        os.getpid(), self.pipes[r - 1][1]))
                      for r in range(1, self.world)]
        for p in self.procs:
            p.start()
        for _, child_end in self.pipes:
            child_end.close()  # the child has its own: a rank waiting for "go" then sees EOF when this end closes

    def join(self) -> None:
        """Waits until every rank has loaded its shard (one that dies first fails this at once: watched, not waited
        for), then they all join the group together: the rendezvous only waits for ranks that are ready."""
        for p, (conn, _) in zip(self.procs, self.pipes):
            try:
                while not conn.poll(0.2):
                    if not p.is_alive():
                        raise EOFError
                conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"tensor-parallel {p.name} died while starting (its error is in the log)") from None
        for conn, _ in self.pipes:
            conn.send(True)  # go
        _init(0, self.world, self.port, self.device)
        self.joined = True
        self.header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)

    def send_layout(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """What rank 0 planned (its memory decides): every rank builds the same pool. (-1 blocks: stop.)"""
        dist.broadcast(torch.tensor([num_blocks, block_size, max_model_len], device=self.device), src=0)
        self.layout_sent = True

    def step(self, input_ids: torch.Tensor, meta) -> None:
        """Sends this step's inputs; the caller then runs the forward, as every rank does."""
        if not self.alive():  # NOTE: NCCL would wait for a dead peer; gloo would fail, but only mid-collective
            raise RuntimeError("a tensor-parallel rank is gone")
        T, (B, mb) = input_ids.shape[0], meta.block_tables.shape
        payload = torch.cat([input_ids, meta.positions, meta.slot_mapping, meta.block_tables.reshape(-1).long(),
                             meta.cu_seqlens_q.long(), meta.seq_lens.long(), meta.logits_indices.long()])
        self.header.copy_(torch.tensor([_STEP, T, B, mb, meta.logits_indices.shape[0], 0]))
        dist.broadcast(self.header, src=0)
        dist.broadcast(payload, src=0)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.joined and self.alive():  # tell them in what they wait for: the layout, or the next step
                if self.layout_sent:
                    self.header.zero_()  # _STOP
                    dist.broadcast(self.header, src=0)
                else:
                    self.send_layout(-1, 0, 0)
        except Exception:  # noqa: BLE001 — a peer already gone: nothing left to tell
            pass
        for conn, _ in self.pipes:
            conn.close()  # a rank still loading, or waiting for "go", stops
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        if self.joined and dist.is_initialized():
            dist.destroy_process_group()


def _unpack(header: torch.Tensor, payload: torch.Tensor):
    from engine.models.llama import AttentionMetadata

    _, T, B, mb, n, _ = header.tolist()
    parts = payload.split([T, T, T, B * mb, B + 1, B, n])
    meta = AttentionMetadata(positions=parts[1], slot_mapping=parts[2],
                             block_tables=parts[3].view(B, mb).to(torch.int32), cu_seqlens_q=parts[4].to(torch.int32),
                             seq_lens=parts[5].to(torch.int32), logits_indices=parts[6])
    return parts[0], meta


def watch_parent(parent: int) -> None:
    """A child process outlives `parent` by at most a second (a thread's loop): a rank its engine, an engine process
    its server (service/engine_process.py). SIGKILL of the server leaves nothing behind."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_main(rank: int, world: int, port: int, config, model_dir: str, device: str, dtype: torch.dtype,
                 parent: int, ready) -> None:
    from engine import loader
    from engine.config import kernel_cache_dir
    from engine.layout import KV_DTYPES, Layout
    from engine.model_runner import kv_pool
    from engine.models import LlamaModel

    import sluice_kernels as kernels

    threading.Thread(target=watch_parent, args=(parent,), daemon=True, name="parent-watch").start()
    torch.set_num_threads(max(1, torch.get_num_threads() // world))  # N ranks share the cores rank 0 was given
    dev = rank_device(torch.device(device), rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif kernels.MODE == "auto":
        kernels.cpu.load(kernel_cache_dir())
    mc = loader.load_model_config(model_dir)
    shard = Shard.plan(mc, rank, world)
    model = LlamaModel(mc, loader.Weights(model_dir), dev, dtype, shard)
    try:
        ready.send(True)
        ready.recv()  # every rank is loaded: join
    except (EOFError, OSError):  # rank 0 gave up before the group formed
        return
    _init(rank, world, port, dev)
    sizes = torch.zeros(3, dtype=torch.int64, device=dev)
    dist.broadcast(sizes, src=0)
    num_blocks, block_size, max_model_len = sizes.tolist()
    if num_blocks < 0:  # rank 0 could not start
        dist.destroy_process_group()
        return
    kv_dtype = None if config.kv_cache_dtype == "auto" else KV_DTYPES[config.kv_cache_dtype]
    layout = Layout(dev, dtype, block_size, num_blocks, max_model_len, 0, kv_dtype)
    caches = kv_pool(model, layout)
    header = torch.zeros(_HEADER, dtype=torch.int64, device=dev)
    try:
        while True:
            dist.broadcast(header, src=0)
            if header[0].item() == _STOP:
                break
            _, T, B, mb, n, _ = header.tolist()
            payload = torch.empty(3 * T + B * mb + 2 * B + 1 + n, dtype=torch.int64, device=dev)
            dist.broadcast(payload, src=0)
            input_ids, meta = _unpack(header, payload)
            model.forward(input_ids, meta, caches)
    except Exception as e:  # noqa: BLE001 — rank 0 gone or failed: this rank has nothing left to do
        log.warning("tensor-parallel rank %d stops: %s: %s", rank, type(e).__name__, e)
        os._exit(1)
    dist.destroy_process_group()
