"""Time and host memory of loading a Hugging Face checkpoint: the engine vs transformers.

A random Llama checkpoint (default ~125M parameters: hidden 768, 12 layers, 12 heads, 4
key/value heads, intermediate 2048, vocab 32000, untied embeddings; float32) is written with
``save_pretrained`` as safetensors, sharded by ``--max-shard-size`` (default 200MB, so the
``model.safetensors.index.json`` path is exercised), into a temporary directory or ``--dir``
(reused when it already holds a checkpoint; delete it to change the model). Then each variant
loads it in a fresh subprocess, so that its peak memory is its own:

* engine: ``Engine.build(head="lm", device="cpu", config={"model": dir, "forward_only": True})``
  then ``.initialize()`` (TP=1: the megatron model is built with random weights, then the
  checkpoint is streamed into it); forward-only so that, like transformers, no gradient buffers
  or optimizer state are allocated. Also shown: the time spent in the mesh set-up
  (``mesh.init_mesh``) and in ``load_hf_weights``; the rest is mostly building the model.
* transformers: ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)``.

Before a load the child imports everything the load needs (torch, transformers with the Llama
modelling code, megatron-core, the engine), so import time is not counted; the RSS after these
imports (``VmRSS`` of ``/proc/self/status``) is printed as the baseline. Then the peak RSS
high-water mark is reset (``echo 5 > /proc/self/clear_refs``; if the kernel refuses, the mark
counts from process start and the line says so) and the load runs, timed with
``time.perf_counter``. Peak extra memory = ``VmHWM`` after the load - ``VmRSS`` right before it.

RSS counts the pages of memory-mapped safetensors files a process has touched while they are
mapped, as well as anonymous memory. transformers 5 leaves its parameters as views of the mapped
files, so its load faults almost nothing in; the weights are read on first use. Each child
therefore next reads every parameter and buffer once (a sum), timed, and the peak is taken again
(same ``VmHWM`` minus the same pre-load ``VmRSS``); the change in ``RssAnon`` and ``RssFile``
after that shows how much of the memory still held is private copies and how much mapped file
pages. The checkpoint was just written, so its files are normally in the page cache (no disk
reads timed). With ``--repeats N`` the variants alternate N times, each run a fresh subprocess,
and medians are printed. Ratios are engine / transformers, for the load alone and for the load
plus the first read of every weight. Never pass/fail.

    python -m benchmarks.hf_load [--dir DIR] [--max-shard-size 200MB|none] [--repeats 1]
        [--hidden 768] [--layers 12] [--heads 12] [--kv-heads 4] [--intermediate 2048]
        [--vocab 32000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from benchmarks.measure import time_calls

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("engine", "transformers")
MIB = 1024 * 1024


def _status_kib(field: str) -> int:
    """``field`` (e.g. VmRSS, VmHWM) of /proc/self/status, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


# -- the checkpoint -------------------------------------------------------------------------------
def write_checkpoint(directory: Path, args: argparse.Namespace) -> int:
    """A random Llama saved to ``directory`` unless one is there already; its parameter count."""
    from safetensors import safe_open

    if not (directory / "config.json").is_file():
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.utils.logging import disable_progress_bar

        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
        disable_progress_bar()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        shard = {} if args.max_shard_size == "none" else {"max_shard_size": args.max_shard_size}
        model.save_pretrained(directory, **shard)
        del model
    count = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                count += int(torch.Size(shape).numel())
    return count


# -- one load, in the child process ---------------------------------------------------------------
def _read_every_weight(modules: list[torch.nn.Module]) -> float:
    """Sum every parameter and buffer once (faults in any lazily mapped weight)."""
    total = 0.0
    with torch.no_grad():
        for module in modules:
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                total += float(tensor.sum())
    return total


def child(variant: str, directory: str) -> None:
    """Load ``directory`` with ``variant``; print one JSON line of measurements."""
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import transformers.models.llama.modeling_llama  # noqa: F401 (not timed)
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.from_pretrained(directory, local_files_only=True)  # config parsing warm-up
    parts: dict[str, float] = {}

    load: Callable[[], list[torch.nn.Module]]
    if variant == "engine":
        import megatron.core.models.gpt  # noqa: F401 (not timed)

        import strategies.backends.megatron.hf.loading as loading
        import strategies.backends.megatron.mesh as mesh
        from engine import Engine

        time_calls(mesh, "init_mesh", "mesh_s", parts)
        time_calls(loading, "load_hf_weights", "weights_s", parts)
        config = {"model": directory, "forward_only": True, "micro_batch_size": 1}

        def load() -> list[torch.nn.Module]:
            engine = Engine.build(head="lm", device="cpu", config=config).initialize()
            modules: list[torch.nn.Module] = engine.backend.modules()
            return modules

    else:

        def load() -> list[torch.nn.Module]:
            model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.float32, local_files_only=True
            )
            return [model]

    baseline = _status_kib("VmRSS")
    reset = _reset_peak()
    before = {field: _status_kib(field) for field in ("VmRSS", "RssAnon", "RssFile")}
    start = time.perf_counter()
    modules = load()
    middle = time.perf_counter()
    load_peak = _status_kib("VmHWM")
    _read_every_weight(modules)
    end = time.perf_counter()
    result = {
        "load_s": middle - start,
        "read_s": end - middle,
        "load_peak_kib": load_peak - before["VmRSS"],
        "read_peak_kib": _status_kib("VmHWM") - before["VmRSS"],
        "anon_kib": _status_kib("RssAnon") - before["RssAnon"],
        "file_kib": _status_kib("RssFile") - before["RssFile"],
        "baseline_kib": baseline,
        "peak_reset": reset,
        **parts,
    }
    print(json.dumps(result), flush=True)


def run_child(variant: str, directory: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.hf_load", "--variant", variant]
    process = subprocess.run(
        [*command, "--dir", str(directory)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    lines = process.stdout.strip().splitlines()
    if process.returncode != 0 or not lines:
        sys.stderr.write(process.stdout + process.stderr)
        raise SystemExit(f"the {variant} child failed (exit status {process.returncode})")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- the parent -----------------------------------------------------------------------------------
def measure(directory: Path, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    count = write_checkpoint(directory, args)
    files = sorted(directory.glob("*.safetensors"))
    size = sum(file.stat().st_size for file in files)
    index = (directory / "model.safetensors.index.json").is_file()
    print(
        f"checkpoint: {count:,} parameters ({count / 1e6:.1f}M), {len(files)} safetensors "
        f"file(s){' + index' if index else ''}, {size / MIB:.0f} MiB "
        f"(ready in {time.perf_counter() - start:.1f} s)"
    )
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):  # alternate the order so that drift hits both alike
        for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            runs[variant].append(run_child(variant, directory))
    medians: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        keys = [key for key, value in runs[variant][0].items() if not isinstance(value, bool)]
        medians[variant] = {k: statistics.median(run[k] for run in runs[variant]) for k in keys}
        m = medians[variant]
        if variant == "engine":
            label = "engine TP=1 (build+initialize, lm)"
            parts = f" [mesh {m['mesh_s']:.2f} s, load_hf_weights {m['weights_s']:.2f} s]"
        else:
            label, parts = "transformers from_pretrained", ""
        reset = "" if all(run["peak_reset"] for run in runs[variant]) else " [VmHWM not reset]"
        print(
            f"{label}: load {m['load_s']:.2f} s{parts}, peak extra RSS "
            f"{m['load_peak_kib'] / 1024:.0f} MiB{reset}; then reading every weight once "
            f"{m['read_s']:.2f} s, peak extra RSS {m['read_peak_kib'] / 1024:.0f} MiB; held after: "
            f"anon +{m['anon_kib'] / 1024:.0f} MiB, file-backed +{m['file_kib'] / 1024:.0f} MiB; "
            f"baseline RSS after imports {m['baseline_kib'] / 1024:.0f} MiB "
            f"(median of {args.repeats})"
        )
    engine, reference = medians["engine"], medians["transformers"]
    print(
        "ratio engine/transformers, load only: time "
        f"{engine['load_s'] / reference['load_s']:.3f}, peak extra RSS "
        f"{engine['load_peak_kib'] / reference['load_peak_kib']:.3f}"
    )
    total = {name: m["load_s"] + m["read_s"] for name, m in medians.items()}
    print(
        "ratio engine/transformers, load + reading every weight once: time "
        f"{total['engine'] / total['transformers']:.3f}, peak extra RSS "
        f"{engine['read_peak_kib'] / reference['read_peak_kib']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, help="checkpoint directory (kept; reused if present)")
    parser.add_argument("--max-shard-size", default="200MB", help="'none': one safetensors file")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.variant:
        child(args.variant, str(args.dir))
        return
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        measure(args.dir, args)
        return
    with tempfile.TemporaryDirectory(prefix="hf_load_") as directory:
        measure(Path(directory), args)


if __name__ == "__main__":
    main()
