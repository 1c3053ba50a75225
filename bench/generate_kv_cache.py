"""Greedy generation with the KV cache against recomputing the whole prefix every token, side by side.

A Llama of a few million parameters is built from a config here (random weights, nothing downloaded) and both paths
of ``shardtune.infer.generate.generate`` decode the same prompt. The script checks that they produce the same tokens,
then reports the median time of each and their ratio, and writes bench/results/generate_kv_cache_<device>.json and .md.

    .venv/bin/python bench/generate_kv_cache.py                      # defaults: CPU, 2 threads
    .venv/bin/python bench/generate_kv_cache.py --new-tokens 64 256 --hidden-size 512 --num-layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from shardtune.infer.generate import generate  # noqa: E402
from shardtune.testing.tiny import tiny_llama_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (random ids)")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256], help="tokens to generate, one run each")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per setting; the median is reported")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (default 1: on a shared machine, more threads make every "
                        "op wait for the slowest one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    config = tiny_llama_config(args.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
                               intermediate_size=args.intermediate_size, num_heads=args.num_heads,
                               num_kv_heads=args.num_kv_heads,
                               max_position_embeddings=args.prompt_len + max(args.new_tokens) + 8)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval()


def time_once(model, prompt: list[int], new_tokens: int, use_cache: bool, device: str) -> tuple[float, list[int]]:
    """Seconds of one greedy decode of ``new_tokens`` tokens, and the tokens."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    # no tokenizer: the bench decodes ids only, and no stop token, so every run makes exactly new_tokens tokens
    tokens = generate(model, None, prompt, max_new_tokens=new_tokens, use_cache=use_cache, stop_ids=())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    model = build_model(args)
    parameters = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(0, args.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(args.seed)).tolist()
    for use_cache in (True, False):  # warm-up: first-call allocations and kernel choice for both paths
        time_once(model, prompt, min(args.new_tokens), use_cache, args.device)
    rows = []
    for n in args.new_tokens:
        times: dict[bool, list[float]] = {True: [], False: []}
        ids: dict[bool, list[int]] = {}
        for _ in range(args.repeats):
            # interleaved, so a neighbour's load on a shared machine hits both paths alike
            for use_cache in (True, False):
                seconds, ids[use_cache] = time_once(model, prompt, n, use_cache, args.device)
                times[use_cache].append(seconds)
        cached_s, full_s = statistics.median(times[True]), statistics.median(times[False])
        same = ids[True] == ids[False]
        rows.append({"new_tokens": n, "with_cache_s": cached_s, "without_cache_s": full_s,
                     "with_cache_min_s": min(times[True]), "without_cache_min_s": min(times[False]),
                     "with_cache_tokens_per_s": n / cached_s, "without_cache_tokens_per_s": n / full_s,
                     "speedup": full_s / cached_s, "speedup_of_min": min(times[False]) / min(times[True]),
                     "same_tokens": same})
        best_cached, best_full = min(times[True]), min(times[False])
        print(f"{n:>5} new tokens, best of {args.repeats}: with cache {best_cached:7.3f} s "
              f"({n / best_cached:6.1f} tok/s)   without {best_full:7.3f} s ({n / best_full:6.1f} tok/s)   "
              f"speed-up x{best_full / best_cached:.2f} (medians: x{full_s / cached_s:.2f})   same tokens: {same}",
              flush=True)
    return {
        "benchmark": "greedy generation, KV cache vs recomputing the prefix (shardtune.infer.generate.generate)",
        "device": args.device if args.device != "cpu" else f"cpu ({platform.processor() or platform.machine()}, "
                                                            f"{args.threads} thread{'s' if args.threads > 1 else ''})",
        "torch": torch.__version__, "dtype": args.dtype, "parameters": parameters,
        "model": {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                                "num_heads", "num_kv_heads")},
        "prompt_len": args.prompt_len, "repeats": args.repeats,
        # other jobs on the machine inflate medians; the best runs are the cleaner comparison
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]}, "results": rows,
    }


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def to_markdown(report: dict) -> str:
    lines = [f"# {report['benchmark']}", "",
             f"{report['parameters']:,} parameters ({report['model']}), {report['dtype']}, prompt "
             f"{report['prompt_len']} tokens, {report['device']}, torch {report['torch']}, best and median of "
             f"{report['repeats']} interleaved runs each; load average {report['load_average_1min']['start']:.2f} "
             f"at the start, {report['load_average_1min']['end']:.2f} at the end (a shared machine: the best runs "
             f"are the cleaner comparison).", "",
             "| new tokens | with cache, best (s) | tok/s | without cache, best (s) | tok/s | speed-up (best runs) "
             "| speed-up (medians) | same tokens |",
             "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in report["results"]:
        n, cached, full = r["new_tokens"], r["with_cache_min_s"], r["without_cache_min_s"]
        lines.append(f"| {n} | {cached:.3f} | {n / cached:.1f} | {full:.3f} | {n / full:.1f} | "
                     f"x{r['speedup_of_min']:.2f} | x{r['speedup']:.2f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"generate_kv_cache_{'cpu' if args.device == 'cpu' else 'cuda'}"
    write_atomic(RESULTS / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    write_atomic(RESULTS / f"{stem}.md", to_markdown(report))
    print(f"wrote {RESULTS / stem}.json and .md")
    return 0 if all(r["same_tokens"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
