"""The transformers baselines, loading the same model directory in the same dtype.

- `HFStatic`: `generate` on left-padded batches of `batch_size` requests in arrival order, with the
  attention mask; a batch runs until its longest request is done (only each request's own
  tokens count as output). Per-token time stamps come from a streamer.
- `HFContinuous`: transformers' own continuous batching (`ContinuousBatchingManager`, what
  `generate_batch` wraps), driven request by request so each keeps its own `max_new_tokens`.
Both return a `bench.driver.Trace`, so every system is measured by the same code.
"""
from __future__ import annotations

import logging
import math
import time

import torch
from tqdm import tqdm

from bench.driver import Req, Trace


def load(model_dir, dtype: torch.dtype, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    # NOTE: sdpa is transformers' fastest CPU attention; flash/paged kernels are CUDA-only (and need packages a
    # GPU check cannot count on), so a GPU run uses sdpa too.
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").to(device).eval()


class _StepClock:
    """A `generate` streamer that only records when each decoding step's tokens exist."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first call hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFStatic:
    def __init__(self, name: str, model_dir, dtype: torch.dtype, batch_size: int, device: str = "cpu"):
        self.name, self.model_dir, self.dtype, self.batch_size, self.device = name, model_dir, dtype, batch_size, device
        self.model = None

    @torch.inference_mode()
    def run(self, reqs: list[Req], desc: str = "", progress: bool = True) -> Trace:
        if self.model is None:
            self.model = load(self.model_dir, self.dtype, self.device)
        m = self.model
        pad = m.config.pad_token_id if m.config.pad_token_id is not None else 0
        order = sorted(reqs, key=lambda r: r.at)
        tr = Trace()
        bar = tqdm(total=sum(r.max_tokens for r in reqs), desc=desc or self.name, unit="tok", leave=False,
                   disable=not progress)
        tr.start = t0 = time.perf_counter()
        for i in range(0, len(order), self.batch_size):
            batch = order[i : i + self.batch_size]
            wait = t0 + max(r.at for r in batch) - time.perf_counter()
            if wait > 0:  # a static batch is formed once all its members arrived
                time.sleep(wait)
            for r in batch:
                tr.arrive(r, t0 + r.at)
            L = max(len(r.prompt) for r in batch)
            ids = torch.tensor([[pad] * (L - len(r.prompt)) + r.prompt for r in batch], device=self.device)
            mask = torch.tensor([[0] * (L - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=self.device)
            n = max(r.max_tokens for r in batch)
            clock = _StepClock()
            m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=pad, eos_token_id=None, streamer=clock)
            for r in batch:
                tr.tokens[r.rid] = clock.times[: r.max_tokens]
            bar.update(sum(r.max_tokens for r in batch))
        if self.device != "cpu":
            torch.cuda.synchronize()
        tr.end = time.perf_counter()
        bar.close()
        return tr

    def close(self) -> None:
        self.model = None


class HFContinuous:
    def __init__(self, name: str, model_dir, dtype: torch.dtype, max_num_seqs: int, max_batch_tokens: int,
                 page_size: int = 256):
        self.name, self.model_dir, self.dtype = name, model_dir, dtype
        self.max_num_seqs, self.max_batch_tokens, self.page_size = max_num_seqs, max_batch_tokens, page_size
        self.model = None

    @torch.inference_mode()
    def run(self, reqs: list[Req], desc: str = "", progress: bool = True) -> Trace:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        # It logs an ERROR that psutil is missing (only used for a CPU-offload size cap we do not use).
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        if self.model is None:
            self.model = load(self.model_dir, self.dtype)
        m = self.model
        pages = sum(math.ceil((len(r.prompt) + r.max_tokens) / self.page_size) for r in reqs)
        cbc = ContinuousBatchingConfig(
            page_size=self.page_size, num_blocks=pages + 4, max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.max_num_seqs, use_cuda_graph=False, seed=0,
        )
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=m.config.pad_token_id or 0,
                               max_new_tokens=max(r.max_tokens for r in reqs))
        order = sorted(reqs, key=lambda r: r.at)
        tr = Trace()
        bar = tqdm(total=sum(r.max_tokens for r in reqs), desc=desc or self.name, unit="tok", leave=False,
                   disable=not progress)
        with m.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cbc,
                                                   block=True, timeout=30, warmup=False) as mgr:
            tr.start = t0 = time.perf_counter()
            i, done = 0, 0
            while done < len(order):
                now = time.perf_counter()
                while i < len(order) and t0 + order[i].at <= now:
                    r = order[i]
                    tr.arrive(r, t0 + r.at)
                    mgr.add_request(r.prompt, request_id=r.rid, max_new_tokens=r.max_tokens, eos_token_id=-1,
                                    record_timestamps=True)
                    i += 1
                timeout = 0.5 if i == len(order) else max(0.001, t0 + order[i].at - time.perf_counter())
                res = mgr.get_result(timeout=timeout)
                if res is None:
                    if not mgr.is_running():
                        raise RuntimeError("transformers continuous batching stopped before finishing")
                    continue
                if res.error:
                    raise RuntimeError(f"transformers continuous batching failed: {res.error}")
                if res.is_finished():
                    tr.tokens[res.request_id] = list(res.timestamps or [])[: len(res.generated_tokens)]
                    bar.update(len(res.generated_tokens))
                    done += 1
            tr.end = time.perf_counter()
        bar.close()
        return tr

    def close(self) -> None:
        self.model = None
