"""nxd-train's data preparation and loader against the usual Hugging Face recipe (issue #22).

    .venv/bin/python bench/data.py [--sizes 25 250 1000] [--vocab 2048] [--steps 30]
                                   [--peers-up-to MB]  # the peers only at the smaller sizes

A folder of 1 MB text files is generated from the Python standard library's sources (the
files concatenated in a fixed order, copy ``k`` of the library marked by a header line, so
anyone can regenerate it). One byte-level BPE (``--vocab``) is trained once on an 8 MiB sample
and given to every entry (``--tokenizer``), so all of them tokenize with the same model. Per
corpus size, each entry runs in a subprocess (a cold start, as a user runs it), its peak memory
the largest sum of PSS over the process tree (``/proc/PID/smaps_rollup``, sampled every 0.1 s:
shared pages counted once):

* ``nxd_prepare``: ``nxd-train prepare --workers CORES`` (plan, hash, tokenize, shards);
* ``hf_recipe``: ``datasets.load_dataset("text", data_files=...)`` (into a cold cache), then
  ``map(tokenizer(batch["text"]), batched=True, num_proc=CORES)``, then ``map(group_texts,
  batched=True, num_proc=CORES)`` into blocks of ``seq_len`` (run_clm.py's recipe);
* ``tokenizers_ceiling``: ``Tokenizer.encode_batch`` (its own threads) over the corpus read in
  16 MB batches, nothing kept: what tokenization alone costs.

Then nxd-train trains ``--steps`` steps of the tiny model (TP=1, one process) on each size's
shards: the worker's peak RSS (VmHWM) is the memory per rank; the loader's time per step
(``PackedLoader.next_batch``, in this process) is compared with the run's median step time.

Goals (issue #22): preparation >= 1.0x the recipe's MB/s; its peak memory < 2 GB at every
size; training memory per rank within +10% from the smallest to the largest size; loader
< 1% of a step. Results in bench/results/data.json, with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MB = 1_000_000


def make_corpus(folder: Path, size_mb: int) -> Path:
    """``size_mb`` files of 1 MB of standard-library source (cut at line ends; valid UTF-8: the
    library's few Latin-1 test files are decoded with replacement, as the recipe's ``text``
    builder would refuse them)."""
    if folder.is_dir() and len(list(folder.iterdir())) == size_mb:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.parts),
        key=lambda p: zlib.crc32(p.relative_to(root).as_posix().encode()),
    )
    written, copy, buffer = 0, 0, bytearray()
    while written < size_mb:
        buffer += f"# copy {copy} of the standard library\n".encode()
        for path in files:
            buffer += path.read_bytes().decode("utf-8", "replace").encode()  # valid UTF-8
            while len(buffer) >= MB and written < size_mb:
                cut = buffer.rfind(b"\n", 0, MB) + 1 or MB
                (folder / f"part{written:05d}.txt").write_bytes(bytes(buffer[:cut]))
                del buffer[:cut]
                written += 1
        copy += 1
    return folder


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _hwm_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(cmd: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run ``cmd``; wall seconds, the peak PSS of its process tree and every process's
    peak RSS (VmHWM) by pid."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    peak, hwm = 0, {}
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True)
    reader.start()
    while proc.poll() is None:
        pids = _tree(proc.pid)
        peak = max(peak, sum(_pss_kb(p) for p in pids))
        for p in pids:
            hwm[p] = max(hwm.get(p, 0), _hwm_kb(p))
        time.sleep(0.1)
    reader.join()
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} exited {proc.returncode}:\n{''.join(output)[-4000:]}")
    return {"seconds": seconds, "peak_pss_mb": peak / 1e3, "hwm_kb": hwm,
            "output": "".join(output)[-2000:]}  # fmt: skip


HF_RECIPE = """
import sys, glob, datasets
from transformers import AutoTokenizer
folder, tok_dir, cores, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(tok_dir)
raw = datasets.load_dataset("text", data_files=sorted(glob.glob(folder + "/*.txt")),
                            split="train")
tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, num_proc=cores,
                    remove_columns=["text"])
def group_texts(examples):
    joined = {k: sum(examples[k], []) for k in examples.keys()}
    n = len(joined["input_ids"]) // seq_len * seq_len
    return {k: [v[i:i + seq_len] for i in range(0, n, seq_len)] for k, v in joined.items()}
blocks = tokenized.map(group_texts, batched=True, num_proc=cores)
print("blocks", len(blocks), flush=True)
"""

CEILING = """
import sys, glob, time
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[2] + "/tokenizer.json")
files, batch, size, tokens, spent = sorted(glob.glob(sys.argv[1] + "/*.txt")), [], 0, 0, 0.0
def flush():
    global batch, tokens, spent
    started = time.perf_counter()
    tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False))
    spent += time.perf_counter() - started
    batch = []
for path in files:
    text = open(path, encoding="utf-8", errors="replace").read()
    size += len(text.encode())
    batch += [text[i:i + 65536] for i in range(0, len(text), 65536)]
    if len(batch) >= 256:
        flush()
flush()
print("encode_seconds", spent, "tokens", tokens, flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[25, 250])
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--peers-up-to", type=int, default=None, metavar="MB",
        help="run the HF recipe and the tokenizers ceiling only at sizes up to MB (default: all)",
    )  # fmt: skip
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.json"))
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    work = Path(args.work or tempfile.mkdtemp(prefix="nxd-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": {"cores": cores, "cpu": platform.processor() or platform.machine(),
                    "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
                    "python": sys.version.split()[0], "load_before": os.getloadavg()},
        "settings": vars(args), "sizes": {},
    }  # fmt: skip
    from nxd_trainer.train.data import train_tokenizer

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        sample = make_corpus(work / "corpus-8", 8)
        texts = [p.read_text(errors="replace") for p in sorted(sample.iterdir())]
        train_tokenizer(texts, args.vocab).save_pretrained(str(tok_dir))
    for size in args.sizes:
        corpus = make_corpus(work / f"corpus-{size}", size)
        one: dict[str, Any] = {}
        runs = work / f"runs-{size}"
        shutil.rmtree(runs, ignore_errors=True)
        common = ["--data", str(corpus), "--tokenizer", str(tok_dir), "--runs-dir", str(runs),
                  "--seq-len", str(args.seq_len), "--no-progress"]  # fmt: skip
        nxd = measure([sys.executable, "-m", "nxd_trainer.train", "prepare", "--workers",
                       str(cores), *common], {**env, "OMP_NUM_THREADS": "1"}, work)  # fmt: skip
        if args.peers_up_to is not None and size > args.peers_up_to:
            one["nxd_prepare"] = {"seconds": nxd["seconds"], "mb_per_s": size / nxd["seconds"],
                                  "peak_pss_mb": nxd["peak_pss_mb"]}  # fmt: skip
            meta = json.loads((runs / "tiny" / "data" / "meta.json").read_text())
            one["tokens"] = meta["tokens"]
            one["train"] = train_entry(runs, common, args, env, work)
            results["sizes"][str(size)] = one
            print(json.dumps({size: one}, indent=1), flush=True)
            continue
        hf_env = {**env, "HF_DATASETS_CACHE": str(work / f"hf-cache-{size}"),
                  "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        shutil.rmtree(work / f"hf-cache-{size}", ignore_errors=True)
        hf = measure([sys.executable, "-c", HF_RECIPE, str(corpus), str(tok_dir), str(cores),
                      str(args.seq_len)], hf_env, work)  # fmt: skip
        shutil.rmtree(work / f"hf-cache-{size}", ignore_errors=True)
        ceiling = measure([sys.executable, "-c", CEILING, str(corpus), str(tok_dir)], env, work)
        encode_s = float(ceiling["output"].split("encode_seconds")[1].split()[0])
        for name, entry in (("nxd_prepare", nxd), ("hf_recipe", hf)):
            one[name] = {"seconds": entry["seconds"], "mb_per_s": size / entry["seconds"],
                         "peak_pss_mb": entry["peak_pss_mb"]}  # fmt: skip
        one["tokenizers_ceiling"] = {"encode_seconds": encode_s, "mb_per_s": size / encode_s,
                                     "peak_pss_mb": ceiling["peak_pss_mb"]}  # fmt: skip
        one["nxd_vs_hf_recipe"] = hf["seconds"] / nxd["seconds"]
        one["nxd_vs_ceiling"] = encode_s / nxd["seconds"]
        meta = json.loads((runs / "tiny" / "data" / "meta.json").read_text())
        one["tokens"] = meta["tokens"]
        one["train"] = train_entry(runs, common, args, env, work)
        results["sizes"][str(size)] = one
        print(json.dumps({size: one}, indent=1), flush=True)
    sizes = [str(s) for s in args.sizes]
    first, last = results["sizes"][sizes[0]], results["sizes"][sizes[-1]]
    results["goals"] = {
        "prepare_vs_hf_recipe >= 1.0": {s: results["sizes"][s]["nxd_vs_hf_recipe"] for s in sizes
                                        if "nxd_vs_hf_recipe" in results["sizes"][s]},
        "prepare_peak_mb < 2000": {s: results["sizes"][s]["nxd_prepare"]["peak_pss_mb"]
                                   for s in sizes},
        "rank_memory_growth <= 10%": last["train"]["worker_peak_rss_mb"]
        / first["train"]["worker_peak_rss_mb"] - 1,
        "loader_share_of_step < 1%": {s: results["sizes"][s]["train"]["loader_share"]
                                      for s in sizes},
    }  # fmt: skip
    results["machine"]["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["goals"], indent=1))


def train_entry(
    runs: Path, common: list[str], args: Any, env: dict[str, str], work: Path
) -> dict[str, Any]:
    """The tiny model for ``--steps`` steps at TP=1 on the prepared shards: the worker's peak
    RSS, the median step, and the loader's time per step measured in this process."""
    from nxd_trainer.train import PackedLoader, parse_config
    from nxd_trainer.train.data import prepare_data

    flags = [*common, "--tp", "1", "--nproc-per-node", "1", "--steps", str(args.steps),
             "--eval-every", "0", "--save-every", str(10 * args.steps), "--no-export",
             "--batch-size", "8"]  # fmt: skip
    run = measure([sys.executable, "-m", "nxd_trainer.train", *flags],
                  {**env, "OMP_NUM_THREADS": "1"}, work)  # fmt: skip
    rows = [json.loads(line) for line in (runs / "tiny" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["tokens"] / r["step"] / r["tokens_per_s"] for r in rows if r["kind"] == "train"]
    step_s = statistics.median(steps[3:] or steps)
    _, train, _ = prepare_data(parse_config(flags), build=False)
    loader = PackedLoader(train, 8, 0, 1, seed=1234)
    for _ in range(10):
        loader.next_batch()
    started = time.perf_counter()
    for _ in range(1000):
        loader.next_batch()
    loader_s = (time.perf_counter() - started) / 1000
    worker = sorted(run["hwm_kb"].values())[-1]  # the largest process: the worker
    return {"steps": args.steps, "median_step_s": step_s, "loader_s": loader_s,
            "loader_share": loader_s / step_s, "worker_peak_rss_mb": worker / 1e3,
            "tree_peak_pss_mb": run["peak_pss_mb"], "blocks": len(train)}  # fmt: skip


if __name__ == "__main__":
    main()
