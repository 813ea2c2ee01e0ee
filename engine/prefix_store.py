"""`PrefixStore`: the KV of pinned prefixes on disk, so a restarted engine loads them instead of computing them.

One safetensors file per prefix under `ROOT/<model identity>/<dtype>-kv-<cache dtype>-bs<block size>/<tokens
hash>.safetensors`: the K and V of its full blocks, every layer, `[layers, blocks, block_size, kv_heads, head_dim]`
(and, for a quantized cache, their scales, `[layers, blocks, block_size, kv_heads]`). The key holds what the KV
depends on: the model (its config and weight files: names, sizes, modification times), the code that computes it
(engine/models/ and the kernels' sources), the model's and the cache's dtypes, the block size and the token ids. Its metadata repeats them
with a SHA-256 of the tensors' bytes; a file whose metadata, shape or digest does not match is refused (and
replaced by the caller), never used. Writes go to a temporary file of their own, then rename.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

log = logging.getLogger("sluice.prefix_store")

FORMAT = "sluice-prefix-kv-2"
PARTS = ("k", "v", "k_scale", "v_scale")  # the names of a layer's KV parts (engine/model_runner.py), in order


@functools.cache
def code_identity() -> str:
    """A digest of the sources that compute KV (the model code and the kernels): an upgrade is another store."""
    roots = [Path(__file__).parent / "models", Path(__file__).parent.parent / "sluice_kernels"]
    h = hashlib.sha256(FORMAT.encode())
    for p in sorted(f for r in roots for f in r.rglob("*") if f.suffix in (".py", ".cpp", ".h")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def model_identity(model_dir: Path) -> str:
    """A digest of what the model's KV depends on, cheap to compute for any size: config.json's bytes, each weight
    file's name, size and modification time (a changed file is another model) and the code's identity."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes() + code_identity().encode())
    for p in sorted(model_dir.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _digest(parts: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in parts:
        h.update(t.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


class PrefixStore:
    def __init__(self, root: Path, model_dir: Path, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int) -> None:
        self.model = model_identity(model_dir)
        self.dtype = str(dtype).removeprefix("torch.")
        self.kv_dtype = str(kv_dtype).removeprefix("torch.")
        self.block_size = block_size
        self.dir = root / self.model / f"{self.dtype}-kv-{self.kv_dtype}-bs{block_size}"

    def _meta(self, token_ids: list[int]) -> dict[str, str]:
        tokens = hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()
        return {"format": FORMAT, "model": self.model, "dtype": self.dtype, "kv_dtype": self.kv_dtype,
                "block_size": str(self.block_size), "tokens": tokens}

    def path(self, token_ids: list[int]) -> Path:
        return self.dir / f"{self._meta(token_ids)['tokens'][:32]}.safetensors"

    def load(self, token_ids: list[int], shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
        """The stored parts (K, V and, quantized, their scales) of `token_ids`' full blocks, of these (shape, dtype)
        each (`ModelRunner.block_shapes`), or None: not stored, or refused (the log says why)."""
        path = self.path(token_ids)
        if not path.is_file():
            return None
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(path)
        except Exception as e:  # noqa: BLE001 — whatever is wrong with the file, it is not used
            log.warning("prefix store: refusing %s: unreadable (%s: %s)", path, type(e).__name__, e)
            return None
        want = self._meta(token_ids)
        if any(meta.get(key) != value for key, value in want.items()):
            log.warning("prefix store: refusing %s: made for another model, code, dtype, block size or prompt", path)
            return None
        parts = [tensors.get(name) for name in PARTS[: len(shapes)]]
        if set(tensors) != set(PARTS[: len(shapes)]) or any(
                tuple(t.shape) != tuple(s) or t.dtype != d for t, (s, d) in zip(parts, shapes)):
            log.warning("prefix store: refusing %s: its tensors are not %s", path, shapes)
            return None
        if meta.get("sha256") != _digest(parts):
            log.warning("prefix store: refusing %s: its contents do not match its digest (corrupt)", path)
            return None
        return parts

    def save(self, token_ids: list[int], parts: list[torch.Tensor]) -> Path:
        path = self.path(token_ids)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            parts = [t.contiguous().cpu() for t in parts]
            save_file(dict(zip(PARTS, parts)), tmp, metadata={**self._meta(token_ids), "sha256": _digest(parts)})
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return path
