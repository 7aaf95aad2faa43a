"""Time and size of ``Engine.save_checkpoint`` / ``load_checkpoint`` vs a plain ``torch.save``.

For each model preset (default ``tiny`` and ``small``, ~20M parameters) an LM engine is built
on CPU (``Engine.build(head="lm", device="cpu", config={"model": name}).initialize()``) and
trained one step (so Adam's ``exp_avg`` / ``exp_avg_sq`` exist). Then, in the same process and
on the same state, two variants alternate ``--repeats`` times (order flipped every repeat so
that drift hits both alike; medians printed):

* engine: ``engine.save_checkpoint(fresh_dir)`` (megatron ``dist_checkpointing`` torch_dist
  files for model + optimizer, written in-process and checksummed (xxh3-128) as written, then
  fsynced; scheduler JSON, RNG states; then fsync of every file, read-back checksums of the
  small files not checksummed while written, ``manifest.json`` and an atomic rename), timed, and
  the bytes of the published ``global_step_N/`` directory (every file, manifest included); then
  ``engine.load_checkpoint(fresh_dir)`` (manifest check, checksum of every file, then restore,
  each model file read through one memory map), timed. The lines also show the time spent in
  the manifest write (``write_manifest``: fsync + read-back checksums) and in the load's
  verification (``verify_files``: checksums), the checkpoint's safety net, which the baseline
  has no counterpart for. The engine fsyncs its files; the baseline does only with
  ``--fsync-baseline``.
* engine async: ``engine.save_checkpoint(fresh_dir, async_save=True)``, timed (the time a
  training loop is blocked: planning, the state copied to host memory, the small files), then
  ``engine.wait_for_checkpoint()`` at once: the total from the call until the checkpoint is
  published (the files written in the background). Nothing trains meanwhile, so the total is
  what the background work costs on an idle machine.
* torch.save: the inner model chunks' ``state_dict()`` (``engine.backend.modules()``), the
  optimizer's ``state_dict()`` and the LR scheduler's ``state_dict()`` in one dict written
  with ``torch.save`` to a fresh file (no fsync unless ``--fsync-baseline``), timed, and its
  size; then ``torch.load(..., weights_only=True)`` and ``load_state_dict`` of each part, timed.

One untimed warm-up round of both variants comes first (the first ``dist_checkpointing`` save
pays one-off set-up; its time is shown as "first engine save"). Every save goes to a fresh
directory under ``--dir`` (default: the system temporary directory), deleted after its load,
so the files are normally still in the page cache when loaded (no disk reads timed). Ratios
are engine / torch.save. Never pass/fail.

    python -m benchmarks.checkpoint_io [--model tiny|small] [--repeats 5] [--dir DIR]
        [--fsync-baseline]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from benchmarks.measure import time_calls
from engine import Engine
from engine.checkpointing import load, save
from engine.losses import sft_loss
from strategies.checkpoint_files.publish import fsync_path
from tests.factories import random_batch

VARIANTS = ("engine", "engine async", "torch.save")
MIB = 1024 * 1024
#: Time spent inside the engine's manifest write and file verification during one round.
PARTS: dict[str, float] = {}


def _directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def engine_round(engine: Engine, root: Path) -> dict[str, float]:
    """One save + load with the engine into the fresh directory ``root``."""
    PARTS.clear()
    start = time.perf_counter()
    saved = Path(engine.save_checkpoint(root))
    save_s = time.perf_counter() - start
    size = _directory_bytes(saved)
    start = time.perf_counter()
    engine.load_checkpoint(root)
    load_s = time.perf_counter() - start
    shutil.rmtree(root)
    return {
        "save_s": save_s,
        "load_s": load_s,
        "bytes": size,
        "manifest_s": PARTS.get("manifest_s", 0.0),
        "verify_s": PARTS.get("verify_s", 0.0),
    }


def engine_async_round(engine: Engine, root: Path) -> dict[str, float]:
    """One asynchronous save into the fresh directory ``root``, waited for at once."""
    start = time.perf_counter()
    engine.save_checkpoint(root, async_save=True)
    blocked_s = time.perf_counter() - start
    engine.wait_for_checkpoint()
    total_s = time.perf_counter() - start
    shutil.rmtree(root)
    return {"blocked_s": blocked_s, "total_s": total_s}


def _schedule(backend: object) -> Any:
    """The backend's learning-rate schedule (megatron's ``_scheduler``, fsdp2's ``_schedule``,
    whose state is a few numbers that the engine's own checkpoint restores)."""
    for name in ("_scheduler", "_schedule"):
        if getattr(backend, name, None) is not None:
            return getattr(backend, name)
    raise AttributeError(f"{type(backend).__name__} has no learning-rate schedule")


def torch_round(engine: Engine, root: Path, fsync: bool) -> dict[str, float]:
    """One ``torch.save`` of the plain state dicts into ``root/state.pt``, and back (either
    backend)."""
    backend = engine.backend
    chunks = backend.modules()
    schedule = _schedule(backend)
    root.mkdir()
    path = root / "state.pt"
    start = time.perf_counter()
    state = {
        "model": [chunk.state_dict() for chunk in chunks],
        "optimizer": backend._optimizer.state_dict(),
        "scheduler": schedule.state_dict(),
    }
    torch.save(state, path)
    if fsync:
        fsync_path(path)
        fsync_path(root)
    save_s = time.perf_counter() - start
    del state
    size = path.stat().st_size
    start = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    for chunk, chunk_state in zip(chunks, loaded["model"], strict=True):
        chunk.load_state_dict(chunk_state)
    backend._optimizer.load_state_dict(loaded["optimizer"])
    if hasattr(schedule, "load_state_dict"):  # fsdp2's: read back, a few numbers
        schedule.load_state_dict(loaded["scheduler"])
    load_s = time.perf_counter() - start
    shutil.rmtree(root)
    return {"save_s": save_s, "load_s": load_s, "bytes": size}


def measure(model: str, args: argparse.Namespace, parent: Path) -> None:
    engine = Engine.build(head="lm", device="cpu", config={"model": model}).initialize()
    params = sum(p.numel() for chunk in engine.backend.modules() for p in chunk.parameters())
    batch = random_batch([64] * 4, engine.config.model.vocab_size, seed=0)
    engine.train_batch(batch, sft_loss)  # Adam state exists from here on

    counter = itertools.count()

    def fresh() -> Path:
        return parent / f"{model}-{next(counter)}"

    rounds: dict[str, Callable[[], dict[str, float]]] = {
        "engine": lambda: engine_round(engine, fresh()),
        "engine async": lambda: engine_async_round(engine, fresh()),
        "torch.save": lambda: torch_round(engine, fresh(), args.fsync_baseline),
    }
    first = rounds["engine"]()  # warm-up, not counted
    rounds["engine async"]()
    rounds["torch.save"]()
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):
        for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            runs[variant].append(rounds[variant]())
    m = {
        variant: {
            key: statistics.median(run[key] for run in runs[variant]) for key in runs[variant][0]
        }
        for variant in VARIANTS
    }
    engine_m, torch_m = m["engine"], m["torch.save"]
    label = f"model={model:5s} ({params / 1e6:.1f}M params)"
    fsync = " + fsync" if args.fsync_baseline else ""
    print(
        f"{label} save: engine {engine_m['save_s'] * 1e3:8.1f} ms [manifest: fsync + read-back "
        f"checksums "
        f"{engine_m['manifest_s'] * 1e3:.1f} ms; first engine save {first['save_s'] * 1e3:.0f} ms, "
        f"not counted], torch.save{fsync} {torch_m['save_s'] * 1e3:8.1f} ms, ratio "
        f"{engine_m['save_s'] / torch_m['save_s']:.2f} (median of {args.repeats})"
    )
    print(
        f"{label} load: engine {engine_m['load_s'] * 1e3:8.1f} ms [verify: checksums "
        f"{engine_m['verify_s'] * 1e3:.1f} ms], torch.load + load_state_dict "
        f"{torch_m['load_s'] * 1e3:8.1f} ms, ratio {engine_m['load_s'] / torch_m['load_s']:.2f} "
        f"(median of {args.repeats})"
    )
    async_m = m["engine async"]
    print(
        f"{label} async save: blocked {async_m['blocked_s'] * 1e3:8.1f} ms (ratio "
        f"{async_m['blocked_s'] / torch_m['save_s']:.2f} to torch.save), published after "
        f"{async_m['total_s'] * 1e3:8.1f} ms (written in the background; median of "
        f"{args.repeats})"
    )
    print(
        f"{label} size: engine {engine_m['bytes'] / MIB:8.2f} MiB ({int(engine_m['bytes']):,} B), "
        f"torch.save {torch_m['bytes'] / MIB:8.2f} MiB ({int(torch_m['bytes']):,} B), ratio "
        f"{engine_m['bytes'] / torch_m['bytes']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["tiny", "small"], action="append")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="where the temporary checkpoints go")
    parser.add_argument(
        "--fsync-baseline", action="store_true", help="fsync the torch.save file (like the engine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    time_calls(save, "write_manifest", "manifest_s", PARTS)
    time_calls(load, "verify_files", "verify_s", PARTS)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="checkpoint_io_", dir=args.dir) as parent:
        for model in args.model or ["tiny", "small"]:
            measure(model, args, Path(parent))


if __name__ == "__main__":
    main()
