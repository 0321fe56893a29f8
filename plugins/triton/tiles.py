"""Prefill tiles: the candidates, the tuner that times them on a problem class's first prefill, and the disk cache
that keeps its choices across processes (a restarted server tunes nothing it tuned before). Which launches are
tuned, and what makes a problem class, is the host's (attention.py)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

log = logging.getLogger("sharp.triton")


@dataclass(frozen=True)
class Tile:
    """A prefill program's shape and schedule: block_m queries against block_n keys per step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# Prefill tiles measured on first use per problem class on CUDA (`tuned_tile`); FlashAttention-2-sized. A tile that
# does not fit the GPU's shared memory or registers at a head dim is skipped there.
PREFILL_TILES: tuple[Tile, ...] = (
    Tile(64, 64, 4, 3),
    Tile(128, 64, 8, 3),
    Tile(128, 32, 4, 3),
    Tile(64, 32, 4, 2),
    Tile(128, 128, 8, 2),
    Tile(64, 128, 4, 2),
)
_TUNED: dict[tuple, Tile] = {}


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=5, rep=20)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def tuned_tile(key: tuple, device: torch.device, run_with: Callable[[Tile], object]) -> Tile:
    """The fastest of PREFILL_TILES for the problem class `key` (the caller's: norm, dtype, head dim, masks, length
    classes), measured by running `run_with(tile)` on first use and remembered for the process and on disk."""
    if key not in _TUNED:
        cache = tile_cache_path(device)
        disk_key = _disk_key(key, device) if cache is not None else ""
        stored = _stored_tile(cache, disk_key) if cache is not None else None
        if stored is not None:
            _TUNED[key] = stored
            return stored
        timings = {}
        for tile in PREFILL_TILES:
            try:
                run_with(tile)  # compile outside the timing
                timings[tile] = _time_ms(lambda t=tile: run_with(t), device)
            except OutOfResources:  # too much shared memory or too many registers for this GPU at this head dim
                continue
        if not timings:
            raise RuntimeError(f"no prefill tile of {PREFILL_TILES} fits this device for {key}")
        _TUNED[key] = min(timings, key=timings.get)
        log.info("prefill tile for %s: %s (%.3f ms)", key, _TUNED[key], timings[_TUNED[key]])
        if cache is not None:
            _store_tile(cache, disk_key, _TUNED[key])
    return _TUNED[key]


def tile_cache_path(device: torch.device) -> Path | None:
    """Where tuned tiles persist across processes (a server's restart tunes nothing it tuned before): the file
    $SHARP_TILE_CACHE ("0" turns it off), else on CUDA `sharp/prefill-tiles.json` in the user cache directory
    ($XDG_CACHE_HOME or ~/.cache). Entries are keyed by GPU name, Triton version and problem class."""
    setting = os.environ.get("SHARP_TILE_CACHE", "")
    if setting == "0":
        return None
    if setting:
        return Path(setting)
    if device.type != "cuda":
        return None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sharp" / "prefill-tiles.json"


def _disk_key(key: tuple, device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return json.dumps([gpu, triton.__version__, [str(x) for x in key]])


def _read_tiles(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # unreadable or corrupt: tune again and rewrite it
        log.warning("tile cache %s ignored: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _stored_tile(path: Path, disk_key: str) -> Tile | None:
    """The tile stored for this class, if it is still one of PREFILL_TILES."""
    fields = _read_tiles(path).get(disk_key)
    try:
        tile = Tile(*fields) if isinstance(fields, list) else None
    except TypeError:
        return None
    return tile if tile in PREFILL_TILES else None


def _store_tile(path: Path, disk_key: str, tile: Tile) -> None:
    """Add one entry, replacing the file atomically (concurrent servers may write it too)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read_tiles(path), disk_key: [tile.block_m, tile.block_n, tile.num_warps, tile.num_stages]}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: keep tuning per process
        log.warning("tile cache %s not written: %s", path, e)
