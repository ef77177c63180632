"""Peak resident memory of ``interp-norm collapse`` / ``noise`` / ``geometry`` on a Qwen3-0.6B-shaped
Hugging Face folder, over the size of its weights (target <= 1.5x).

The folder: a random ``Qwen3ForCausalLM`` of Qwen3-0.6B's shape (28 layers, d_model 1024, 16 query /
8 key-value heads of 128, gated MLP 3072, vocabulary 151 936, tied embeddings: 596M parameters,
2.4 GB in float32), written once with ``save_pretrained`` into ``--cache`` in float32 and in
bfloat16; each run loads one in its stored dtype, or ``float32:bfloat16`` loads the float32 folder
with ``--dtype bfloat16`` (converted at load, the embedding through a mapped temporary file in ``TMPDIR``;
the ratio is then over the bfloat16 weights). Nothing is downloaded.

Each command runs in its own child process (``python -m interp_norm.cli``, ``nice -n 5``, one torch
thread), and its peak resident memory is the kernel's high-water mark of that child
(``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` read in a fresh waiter process per run, so one
run's peak never hides another's). Weights = parameter bytes in the run's dtype. The windows are
random token ids (the folder has no tokenizer): ``--sizes`` WINDOWSxTOKENS, by default 2 x 128 and
8 x 256; ``collapse`` and ``geometry`` get ``--window-batch`` (default 2 windows per forward pass, the
passes in lockstep layer by layer and each layer analysed a block at a time: same tables as one pass;
several values, e.g. ``--window-batch 2 0``, are printed side by side, 0 = every window in one pass),
``noise`` ``--batch-size 1``. The bound: with a fixed window batch the peak stays flat as windows grow.

    nice -n 5 .venv/bin/python benchmarks/bench_memory.py                 # both sizes and dtypes, all three commands
    nice -n 5 .venv/bin/python benchmarks/bench_memory.py --sizes 2x128 --dtypes bfloat16
    nice -n 5 .venv/bin/python benchmarks/bench_memory.py --dtypes float32:bfloat16 bfloat16 --load-probe
    nice -n 5 .venv/bin/python benchmarks/bench_memory.py --sizes 4x256 16x256 --window-batch 2 0 --dtypes float32 --commands collapse geometry
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Qwen3-0.6B's shape (its config.json on the Hub).
SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
             rope_theta=1000000.0, rms_norm_eps=1e-6)
COMMANDS = {  # the command's own arguments beyond the model and the shared ones
    "collapse": ["--levels", "0.05", "0.2"],
    "noise": ["--levels", "0", "0.1", "--batch-size", "1"],  # one window's logits at a time
    "geometry": [],
}


def build_folder(folder: Path, dtype: str) -> Path:
    """The random Qwen3-0.6B-shaped folder in ``dtype`` (built once, reused)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers as tf

    from interp_norm.anatomy.build import _reinit

    cfg = tf.Qwen3Config(**SHAPE, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg)
    _reinit(model, 0)
    model = model.to(getattr(torch, dtype))
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    model.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2}[sl.get_dtype()]
    return total


WAITER = """
import resource, subprocess, sys, time
t0 = time.perf_counter()
code = subprocess.call(sys.argv[1:])
print(code, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


LOAD_PROBE = """
import re, sys
import interp_norm
import interp_norm.anatomy.build as build
seen = {}
real = build.bridge_from_hf
build.bridge_from_hf = lambda m, **kw: seen.update(m.state_dict(keep_vars=True)) or real(m, **kw)
bridge = interp_norm.load(sys.argv[1], dtype=sys.argv[2])
emb = bridge.original_model.get_input_embeddings().weight
tied = [n for n, t in seen.items() if t.data_ptr() == emb.data_ptr()]
where = 'not found'
for block in re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", open('/proc/self/smaps').read()):
    lo, hi = (int(x, 16) for x in block.split()[0].split('-'))
    if lo <= emb.data_ptr() < hi:
        kb = {k: int(v) for k, v in re.findall(r"^(Size|Rss|Anonymous):\\s+(\\d+) kB", block, re.M)}
        name = block.splitlines()[0].split(maxsplit=5)[5:] or ['anonymous memory']
        where = f"{name[0].strip()}: {kb['Size'] / 2**20:.2f} GiB mapped, {kb['Rss'] / 2**20:.2f} GiB resident"
hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", open('/proc/self/status').read()).group(1))
print(f"load peak {hwm * 1024 / 1e9:.2f} GB; embedding ({', '.join(tied)}) in {where}")
"""


def load_probe(folder: Path, dtype: str) -> str:
    """Where the loaded model's input embedding lives (its /proc/self/smaps mapping: file or anonymous,
    resident part) and the load's peak, in a fresh child process that only loads."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(folder), dtype], env=env, capture_output=True,
                         text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"load probe failed:\n{res.stderr[-3000:]}")
    return res.stdout.strip().splitlines()[-1]


def run(command: str, folder: Path, dtype: str, size: tuple[int, int], wb: int, args: argparse.Namespace,
        out: Path) -> dict:
    windows, n_ctx = size
    chunked = ["--window-batch", str(wb or windows)] if command != "noise" else []  # 0: every window in one pass
    argv = [sys.executable, "-m", "interp_norm.cli", command, str(folder), "--dtype", dtype, "--windows",
            str(windows), "--n-ctx", str(n_ctx), "--threads",
            str(args.threads), "--no-progress", "--force", "--out", str(out / f"{command}-{dtype}-{windows}x{n_ctx}-{wb}-{folder.name}"),
            *COMMANDS[command], *chunked]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-c", WAITER, "nice", "-n", "5", *argv], env=env, capture_output=True,
                         text=True, cwd=ROOT)
    code, seconds, maxrss_kb = res.stdout.strip().splitlines()[-1].split()
    if int(code) != 0:
        raise SystemExit(f"{command} {dtype} failed:\n{res.stderr[-3000:]}")
    return dict(command=command, dtype=dtype, seconds=float(seconds), peak_gb=int(maxrss_kb) * 1024 / 1e9)


def _size(text: str) -> tuple[int, int]:
    try:
        windows, n_ctx = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WINDOWSxTOKENS such as 8x256, got {text!r}") from None
    return windows, n_ctx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "interp_norm_bench_memory"))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float32:bfloat16"],
                    help="the folder's stored dtype, or STORED:RUN to convert at load (float32:bfloat16)")
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    ap.add_argument("--sizes", nargs="+", type=_size, default=[(2, 128), (8, 256)],
                    help="WINDOWSxTOKENS per run (default: 2x128 8x256)")
    ap.add_argument("--window-batch", type=int, nargs="+", default=[2],
                    help="collapse/geometry: windows per forward pass (0: all in one pass); several values are run "
                         "side by side")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--load-probe", action="store_true",
                    help="only load each folder (no command) and print the load's peak and where the embedding lives "
                         "(Linux /proc)")
    args = ap.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    folders = {d: build_folder(cache / f"qwen3-0.6b-shaped-{d.split(':')[0]}", d.split(":")[0]) for d in args.dtypes}
    if args.build_only:
        print(json.dumps({d: str(f) for d, f in folders.items()}))
        return
    if args.load_probe:
        for spec, folder in folders.items():
            print(f"{spec.replace(':', '>')}: {load_probe(folder, spec.split(':')[-1])}", flush=True)
        return
    out = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    print(f"Qwen3-0.6B-shaped random folder; noise --batch-size 1; {args.threads} thread(s); "
          "window batch 0 = every window in one pass")
    print(f"{'windows x tokens':<18}{'command':<10}{'dtype':<18}{'weights GB':>11}"
          + "".join(f"{f'wb {wb}: peak GB':>16}{'ratio':>7}{'s':>7}" for wb in args.window_batch))
    for size in args.sizes:
        for spec, folder in folders.items():
            stored, dtype = spec.split(":")[0], spec.split(":")[-1]  # STORED:RUN converts at load
            w = weight_bytes(folder) / 1e9 * _BYTES[dtype] / _BYTES[stored]  # the weights in the run's dtype
            for command in args.commands:
                line = f"{f'{size[0]} x {size[1]}':<18}{command:<10}{spec.replace(':', '>'):<18}{w:>11.2f}"
                for wb in (args.window_batch if command != "noise" else args.window_batch[:1]):
                    r = run(command, folder, dtype, size, wb, args, out)
                    line += f"{r['peak_gb']:>16.2f}{r['peak_gb'] / w:>7.2f}{r['seconds']:>7.1f}"
                print(line, flush=True)

if __name__ == "__main__":
    main()
