"""Feed every shardtune command every kind of bad input, and report what does not answer in one line.

    PYTHONPATH=$PWD .venv/bin/python scripts/fuzz_inputs.py [--work DIR] [--only COMMAND] [--subprocess]

The contract (issue 27): a bad input ends with exit code 2 and one line that names the input and the fix; nothing
prints a traceback, hangs, or exits 0 having ignored what it was given. A workspace is made once (a tiny model, chat
data, a short LoRA run with checkpoints and final/, its GGUF), then each case runs the real command in a fresh
process: forked from this one (torch and transformers imported once, so a case costs a fraction of a second), or
with ``--subprocess`` a new interpreter per case (what a user runs; about 5 s a case). Prints one row per case and a
table per command and input kind, and exits 1 when any case broke the contract. Cases that need a GPU, the network
or a non-root user are not run (as root every file is readable, so "unreadable file" cases are skipped there).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.trainutil import NOISE  # noqa: E402 - what a command may print around its one line

USAGE, OK, FAIL = "usage", "ok", "fail"  # exit 2 and one line; exit 0; exit 1 and one line (a failed write, ...)


@dataclass
class Case:
    command: str  # the row of the summary: train, launch, estimate, data, export, merge, generate, chat, ...
    kind: str  # the column: recipe, accelerate, deepspeed, gguf, options, resume, symlink, path, ...
    argv: list[str]
    expect: str = USAGE
    setup: Callable[[Path], None] | None = None  # makes what the case needs in the workspace, before it runs
    timeout: float = 120.0
    stdin: str = ""
    result: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# The workspace


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def chat_rows(n: int) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                            {"role": "assistant", "content": f"{2 * i}."}]}) + "\n" for i in range(n))


def make_workspace(work: Path) -> None:
    """The tiny model, data, a LoRA run (checkpoints/step-2, step-4, final/) and its GGUF; made once per --work."""
    from shardtune.testing.tiny import make_model_folder

    if (work / "ready").exists():
        return
    make_model_folder(work / "model")
    write(work / "chat.jsonl", chat_rows(64))
    run = [sys.executable, "-m", "shardtune"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([*run, "train", "--model_name_or_path", "model", "--dataset_name", "chat.jsonl", "--output_dir",
                    "run", "--max_steps", "4", "--save_steps", "2", "--use_peft_lora", "true", "--max_seq_len", "64",
                    "--per_device_train_batch_size", "2"], cwd=work, env=env, check=True, capture_output=True)
    subprocess.run([*run, "export", "run", "tiny.gguf", "--format", "gguf", "--quantize", "f16"], cwd=work, env=env,
                   check=True, capture_output=True)
    make_bad_files(work)
    write(work / "ready", "")


def make_bad_files(work: Path) -> None:
    gguf = (work / "tiny.gguf").read_bytes()
    for name, content in {"zero.gguf": b"", "magic.gguf": b"GGML" + gguf[4:], "header.gguf": gguf[:64],
                          "cut.gguf": gguf[:2000], "short.gguf": gguf[:len(gguf) * 2 // 3],
                          "text.gguf": "not a model\n"}.items():
        write(work / "gguf" / name, content)
    (work / "gguf" / "dir.gguf").mkdir(exist_ok=True)
    write(work / "two" / "a.gguf", gguf)
    write(work / "two" / "b.gguf", gguf)
    base = "model_name_or_path: model\ndataset_name: chat.jsonl\noutput_dir: out\nmax_steps: 1\n"
    for name, content in {"empty.yaml": "", "binary.yaml": bytes(range(256)) * 4, "syntax.yaml": "a: [1, 2\n",
                          "list.yaml": "- model_name_or_path\n- m\n", "scalar.yaml": "just words\n",
                          "wrong_type.yaml": base + "learning_rate: fast\n",
                          "wrong_type_int.yaml": base + "save_steps: 1.5\n",
                          "bool_type.yaml": base + "packing: maybe\n",
                          "list_value.yaml": base + "learning_rate: [1, 2]\n",
                          "dict_value.yaml": base + "seed: {a: 1}\n",
                          "unknown.yaml": base + "learning_rat: 1e-4\n",
                          "duplicate.yaml": base + "max_steps: 2\n", "null.yaml": base + "learning_rate: null\n",
                          "negative.yaml": base + "per_device_train_batch_size: -1\n",
                          "nan.yaml": base + "learning_rate: .nan\n", "inf.yaml": base + "max_grad_norm: .inf\n",
                          "tabs.yaml": base + "\tseed: 1\n", "bom.yaml": "\ufeff" + base,
                          "anchor.yaml": "a: &x [*x]\n", "huge_int.yaml": base + "seed: 99999999999999999999999\n",
                          "not_yaml.txt": base}.items():
        write(work / "recipes" / name, content)
    for name, content in {"bad_type.yaml": "distributed_type: BOGUS\n", "unknown.yaml": "compute_environment: "
                          "LOCAL_MACHINE\nfoo_bar: 1\n", "num_processes.yaml": "num_processes: two\n",
                          "zero.yaml": "num_processes: 0\n", "empty.yaml": "", "binary.yaml": b"\x00\xff" * 100,
                          "list.yaml": "- 1\n", "fsdp_scalar.yaml": "distributed_type: FSDP\nfsdp_config: 5\n",
                          "fsdp_bad.yaml": "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HALF\n",
                          "mp_bad.yaml": "mixed_precision: fp8x\n", "machines.yaml": "num_machines: -1\n",
                          "ds_list.yaml": "deepspeed_config: [1]\n"}.items():
        write(work / "accelerate" / name, content)
    for name, content in {"syntax.json": "{\"zero_optimization\": {\"stage\": 2,}", "stage7.json":
                          '{"zero_optimization": {"stage": 7}}', "unknown.json": '{"zero_optimisation": {}}',
                          "empty.json": "", "list.json": "[1, 2]", "binary.json": b"\x89PNG\x00\x01",
                          "stage_str.json": '{"zero_optimization": {"stage": "two"}}',
                          "offload_bad.json": '{"zero_optimization": {"stage": 3, "offload_param": {"device": '
                                              '"tape"}}}',
                          "batch_auto.json": '{"train_micro_batch_size_per_gpu": "many"}'}.items():
        write(work / "deepspeed" / name, content)
    make_bad_data(work)
    make_bad_models(work)


def make_bad_data(work: Path) -> None:
    rows = {"binary.jsonl": bytes(range(256)) * 8, "not_json.jsonl": "hello\nworld\n", "empty.jsonl": "",
            "numbers.jsonl": "1\n2\n", "no_messages.jsonl": '{"foo": "bar"}\n' * 4,
            "bad_roles.jsonl": json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n",
            "null_content.jsonl": json.dumps({"messages": [{"role": "user", "content": None},
                                                           {"role": "assistant", "content": None}]}) + "\n",
            "half_line.jsonl": chat_rows(3) + '{"messages": [{"role": "us', "garbage.parquet": b"PAR1garbage",
            "garbage.csv": b"\x00\x01\x02", "text_rows.jsonl": '{"text": 5}\n', "empty_list.json": "[]",
            "utf16.jsonl": chat_rows(2).encode("utf-16")}
    for name, content in rows.items():
        write(work / "data" / name, content)
    (work / "data" / "empty_dir").mkdir(exist_ok=True)
    write(work / "sp ace" / "chät dätä.jsonl", chat_rows(16))


def make_bad_models(work: Path) -> None:
    model = work / "model"
    for name, change in {"broken_config": lambda d: write(d / "config.json", "{\"model_type\": "),
                         "list_config": lambda d: write(d / "config.json", "[]"),
                         "unknown_type": lambda d: write(d / "config.json", '{"model_type": "nonesuch"}'),
                         "no_weights": lambda d: [p.unlink() for p in d.glob("*.safetensors")],
                         "cut_weights": lambda d: [write(p, p.read_bytes()[:1000]) for p in d.glob("*.safetensors")],
                         "broken_tokenizer": lambda d: write(d / "tokenizer.json", "{"),
                         "no_tokenizer": lambda d: [p.unlink() for p in d.glob("tokenizer*")]}.items():
        target = work / "models" / name
        if not target.exists():
            shutil.copytree(model, target)
            change(target)
    links = work / "links"
    links.mkdir(exist_ok=True)
    for name, to in {"dangling": "nowhere", "loop_a": "loop_b", "loop_b": "loop_a", "model": "../model",
                     "data.jsonl": "../chat.jsonl", "dangling.jsonl": "gone.jsonl",
                     "dangling.gguf": "gone.gguf"}.items():
        if not (links / name).is_symlink():
            (links / name).symlink_to(to)
    write(work / "a_file", "not a folder\n")


# ---------------------------------------------------------------------------------------------------------------
# The cases


TRAIN = ["--model_name_or_path", "model", "--dataset_name", "chat.jsonl", "--output_dir", "out", "--max_steps", "1",
         "--max_seq_len", "64"]


def train_with(**keys: str) -> list[str]:
    """TRAIN with ``keys`` replacing or adding ``--key value`` pairs."""
    pairs = dict(zip(TRAIN[::2], TRAIN[1::2]))
    pairs.update({f"--{k}": v for k, v in keys.items()})
    return ["train", *[x for kv in pairs.items() for x in kv]]


def copy_run(name: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        shutil.rmtree(work / name, ignore_errors=True)
        shutil.copytree(work / "run", work / name)
    return setup


def recipe_cases() -> list[Case]:
    cases = [Case("train", "recipe", ["train", f"recipes/{name}"]) for name in
             ("empty.yaml", "binary.yaml", "syntax.yaml", "list.yaml", "scalar.yaml", "wrong_type.yaml",
              "wrong_type_int.yaml", "bool_type.yaml", "list_value.yaml", "dict_value.yaml", "unknown.yaml",
              "duplicate.yaml", "null.yaml", "negative.yaml", "nan.yaml", "inf.yaml", "tabs.yaml", "anchor.yaml",
              "huge_int.yaml", "not_yaml.txt", "missing.yaml")]
    cases += [Case("train", "recipe", ["train", "recipes/bom.yaml", "--dry_run", "true"], OK),
              Case("train", "recipe", ["train", "recipes"]),  # a folder
              Case("estimate", "recipe", ["estimate", "--config", "recipes/syntax.yaml"]),
              Case("estimate", "recipe", ["estimate", "--config", "recipes/binary.yaml"]),
              Case("estimate", "recipe", ["estimate", "--config", "recipes/wrong_type.yaml"]),
              Case("estimate", "recipe", ["estimate", "--config", "recipes/missing.yaml"]),
              Case("estimate", "recipe", ["estimate", "--config", "recipes/list.yaml"]),
              Case("data", "recipe", ["data", "inspect", "recipes/syntax.yaml"]),
              Case("data", "recipe", ["data", "inspect", "recipes/unknown.yaml"]),
              Case("launch", "recipe", ["launch", "--dry_run", "train", "recipes/wrong_type.yaml"]),
              Case("launch", "recipe", ["launch", "train", "recipes/binary.yaml"]),
              Case("bench", "recipe", ["bench", "strategies", "recipes/syntax.yaml", "--strategies", "ddp"]),
              Case("bench", "recipe", ["bench", "strategies", "recipes/missing.yaml", "--strategies", "ddp"]),
              Case("bench", "recipe", ["bench", "strategies", "recipes/empty.yaml", "--strategies", "ddp"])]
    return cases


def accelerate_cases() -> list[Case]:
    names = ("bad_type.yaml", "unknown.yaml", "num_processes.yaml", "zero.yaml", "empty.yaml", "binary.yaml",
             "list.yaml", "fsdp_scalar.yaml", "fsdp_bad.yaml", "mp_bad.yaml", "machines.yaml", "ds_list.yaml",
             "missing.yaml")
    # An empty file is an empty mapping (what PyYAML reads): it sets nothing, and nothing is ignored.
    cases = [Case("train", "accelerate", ["train", "--config_file", f"accelerate/{n}", *TRAIN],
                  OK if n == "empty.yaml" else USAGE, timeout=180) for n in names]
    cases += [Case("launch", "accelerate", ["launch", "--config_file", f"accelerate/{n}", "--dry_run", "train",
                                            *TRAIN[:6]], OK if n == "empty.yaml" else USAGE) for n in names]
    cases += [Case("estimate", "accelerate", ["estimate", "model", "--config", f"accelerate/{n}"])
              for n in ("bad_type.yaml", "binary.yaml", "fsdp_scalar.yaml")]
    return cases


def deepspeed_cases() -> list[Case]:
    names = ("syntax.json", "stage7.json", "unknown.json", "empty.json", "list.json", "binary.json",
             "stage_str.json", "offload_bad.json", "batch_auto.json", "missing.json")
    cases = [Case("train", "deepspeed", train_with(deepspeed=f"deepspeed/{n}")) for n in names]
    cases += [Case("estimate", "deepspeed", ["estimate", "model", "--config", f"deepspeed/{n}"])
              for n in ("syntax.json", "stage7.json", "binary.json")]
    cases += [Case("launch", "deepspeed", ["launch", "--dry_run", "train", *train_with(deepspeed=f"deepspeed/{n}")[1:]])
              for n in ("stage7.json", "list.json")]
    return cases


GGUFS = ("zero.gguf", "magic.gguf", "header.gguf", "cut.gguf", "short.gguf", "text.gguf", "dir.gguf")


def gguf_cases() -> list[Case]:
    cases = []
    for name in GGUFS:
        path = f"gguf/{name}"
        cases += [Case("train", "gguf", train_with(model_name_or_path=path)),
                  Case("estimate", "gguf", ["estimate", path]),
                  Case("generate", "gguf", ["generate", path, "--prompt", "hi"]),
                  Case("chat", "gguf", ["chat", path], stdin="hi\n"),
                  Case("export", "gguf", ["export", path, f"x-{name}", "--format", "gguf"]),
                  Case("export", "gguf", ["export", "run", f"y-{name}", "--format", "gguf", "--base", path]),
                  Case("merge", "gguf", ["merge", "run/final", "--base", path, f"m-{name}"]),
                  Case("data", "gguf", ["data", "inspect", "chat.jsonl", "--model_name_or_path", path])]
    cases += [Case("estimate", "gguf", ["estimate", "two"]), Case("generate", "gguf", ["generate", "two", "--prompt",
                                                                                          "hi"]),
              Case("train", "gguf", train_with(model_name_or_path="links/dangling.gguf")),
              Case("demo", "gguf", ["demo", "--real", "gguf/short.gguf", "--skip-estimate"])]
    return cases


def launch_cases() -> list[Case]:
    job = ["train", *TRAIN]
    opts = [["--main_process_port", "70000"], ["--main_process_port", "0"], ["--main_process_port", "-1"],
            ["--main_process_port", "http"], ["--num_processes", "0"], ["--num_processes", "-2"],
            ["--num_processes", "two"], ["--num_machines", "0"], ["--num_machines", "2:1"],
            ["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "127.0.0.1"],
            ["--num_machines", "2", "--machine_rank", "-1", "--main_process_ip", "127.0.0.1"],
            ["--num_machines", "1", "--machine_rank", "1"], ["--max_restarts", "-1"],
            ["--monitor_interval", "-1"], ["--monitor_interval", "nan"], ["--num_machines", "2"],
            ["--rdzv_backend", "etcd"], ["--rdzv_conf", "join_timeout=x"], ["--main_process_ip", "not an ip!"],
            ["--num_processes", "3", "--num_machines", "2", "--main_process_ip", "127.0.0.1"]]
    cases = [Case("launch", "options", ["launch", *o, "--dry_run", "train", *TRAIN]) for o in opts]
    cases += [Case("launch", "options", ["launch", *o, *job], timeout=60) for o in
              (["--main_process_port", "70000"], ["--num_machines", "2", "--machine_rank", "2", "--main_process_ip",
                                                  "127.0.0.1", "--main_process_port", "29999"],
               ["--monitor_interval", "-1"], ["--max_restarts", "-1"], ["--rdzv_backend", "etcd"])]
    cases += [Case("launch", "options", ["launch"]), Case("launch", "options", ["launch", "--num_processes", "2"]),
              Case("launch", "options", ["launch", "trian"]),
              Case("launch", "options", ["launch", "--slurm", "a_file/x.sbatch", "train", *TRAIN]),
              Case("launch", "options", ["launch", "--kubernetes", "k.yaml", "train", *TRAIN]),
              Case("launch", "options", ["launch", "--slurm", "s.sbatch", "--time", "forever", "train", *TRAIN]),
              Case("launch", "options", ["launch", "--slurm", "s.sbatch", "--grace_period", "-5", "train", *TRAIN]),
              Case("launch", "options", ["launch", "--slurm", "s.sbatch", "--gpus_per_node", "-1", "train", *TRAIN])]
    return cases


def train_option_cases() -> list[Case]:
    values = {"learning_rate": ["-1", "nan", "inf", "x"], "max_steps": ["-5", "1.5", "0"],
              "max_seq_len": ["1", "100000"],
              "per_device_train_batch_size": ["0"], "gradient_accumulation_steps": ["0"], "lora_r": ["0", "-4"],
              "save_steps": ["0"], "logging_steps": ["-1"], "warmup_ratio": ["2"], "num_train_epochs": ["-1"],
              "seed": ["-1", "x"], "callbacks": ["nosuchmodule:Cb", "json:loads", "json:nothing", "json"],
              "report_to": ["nonesuch"], "optim": ["adamw_8bitt"],
              "eval_strategy": ["steps"], "mixed_precision": ["fp8"], "torch_dtype": ["float7"],
              "splits": ["test"], "eval_split_ratio": ["1.5"], "ddp_timeout": ["0"], "dataset_num_proc": ["0"],
              "save_total_limit": ["-1"], "metric_for_best_model": ["nonesuch"], "chat_template_format": ["x"]}
    cases = [Case("train", "options", train_with(**{key: v})) for key, vs in values.items() for v in vs]
    cases += [Case("train", "options", train_with(use_peft_lora="true", lora_target_modules="nosuch_proj"))]
    cases += [Case("train", "options", ["train", "--model_name_or_path"]),
              Case("train", "options", ["train", "--max_steps", "1", "--max_steps", "2", *TRAIN[:6]]),
              Case("train", "options", ["train", "key=value=x", *TRAIN]),
              Case("train", "options", ["train", "--", *TRAIN]),
              Case("train", "options", ["train", *TRAIN, "extra_positional"])]
    return cases


def resume_cases() -> list[Case]:
    resume = ["--output_dir", "r", "--use_peft_lora", "true", "--max_steps", "6", "--save_steps", "2",
              "--per_device_train_batch_size", "2"]

    def case(*changes: str, expect: str = USAGE, name: str = "r") -> Case:
        argv = ["train", "--model_name_or_path", "model", "--dataset_name", "chat.jsonl", "--max_seq_len", "64",
                *resume, "--resume_from_checkpoint", "r/checkpoints/step-2", *changes]
        pairs: dict[str, str] = {}
        i = 1
        while i < len(argv):
            pairs[argv[i]] = argv[i + 1]
            i += 2
        return Case("train", "resume", ["train", *[x for kv in pairs.items() for x in kv]], expect,
                    setup=copy_run(name), timeout=180)

    return [case("--lora_r", "16"), case("--max_seq_len", "32"), case("--dataset_name", "sp ace/chät dätä.jsonl"),
            case("--model_name_or_path", "models/unknown_type"), case("--use_peft_lora", "false"),
            case("--per_device_train_batch_size", "4"), case("--seed", "7"),
            case("--resume_from_checkpoint", "r/checkpoints/step-3"),
            case("--resume_from_checkpoint", "r/config.yaml"), case("--resume_from_checkpoint", "a_file"),
            # true with no checkpoint yet starts afresh, with a warning: the same command runs every attempt
            case("--resume_from_checkpoint", "true", "--output_dir", "nowhere", expect=OK),
            Case("train", "resume", train_with(output_dir="run"), setup=None),  # an earlier run's folder
            case("--learning_rate", "2e-4", expect=OK)]


def fresh(*names: str) -> Callable[[Path], None]:
    """Remove what an earlier run of the fuzz left at ``names``: the case writes them anew."""
    def setup(work: Path) -> None:
        for name in names:
            shutil.rmtree(work / name, ignore_errors=True)
    return setup


def path_cases() -> list[Case]:
    return [Case("train", "path", train_with(dataset_name="sp ace/chät dätä.jsonl", output_dir="sp ace/öut"), OK,
                 setup=fresh("sp ace/öut"), timeout=180),
            Case("train", "path", train_with(output_dir="a_file")),
            Case("train", "path", train_with(output_dir="a_file/sub")),
            Case("train", "path", train_with(output_dir="deep/new/parents/out"), OK, setup=fresh("deep"), timeout=180),
            Case("train", "path", train_with(model_name_or_path="model/config.json")),
            Case("train", "path", train_with(model_name_or_path="nowhere/model")),
            Case("train", "path", train_with(dataset_name="data/empty_dir")),
            Case("train", "path", train_with(dataset_name="nowhere.jsonl")),
            Case("train", "path", train_with(dataset_name="a_file")),
            Case("estimate", "path", ["estimate", "nowhere/model"]),
            Case("estimate", "path", ["estimate", "a_file"]),
            Case("estimate", "path", ["estimate", "model", "--emit-config", "a_file/x.yaml"]),
            Case("estimate", "path", ["estimate", "model", "--plot", "a_file/x.png"]),
            Case("estimate", "path", ["estimate", "model", "--data", "nowhere.jsonl"]),
            Case("estimate", "path", ["estimate", "model", "--measured", "nowhere.json"]),
            Case("estimate", "path", ["estimate", "model", "--measured", "data/binary.jsonl"]),
            Case("export", "path", ["export", "run/checkpoints/step-2", "a_file"]),
            Case("export", "path", ["export", "run/checkpoints/step-2", "a_file/sub"]),
            Case("export", "path", ["export", "run/checkpoints/step-9", "o"]),
            Case("export", "path", ["export", "a_file", "o"]),
            Case("export", "path", ["export", "run/checkpoints/step-2", "sp ace/éxport"], OK,
                 setup=fresh("sp ace/éxport"), timeout=180),
            Case("export", "path", ["export", "run", "a_file/x.gguf", "--format", "gguf"]),
            Case("export", "path", ["export", "run", "o.gguf", "--format", "gguf", "--quantize", "q4_k"]),
            Case("export", "path", ["export", "run/checkpoints/step-2", "o2", "--quantize", "f16"]),
            Case("merge", "path", ["merge", "nowhere", "--base", "model", "o3"]),
            Case("merge", "path", ["merge", "run/final", "--base", "model", "a_file"]),
            Case("merge", "path", ["merge", "run/final", "--base", "a_file", "o4"]),
            Case("merge", "path", ["merge", "model", "--base", "model", "o5"]),
            Case("generate", "path", ["generate", "nowhere", "--prompt", "hi"]),
            Case("generate", "path", ["generate", "a_file", "--prompt", "hi"]),
            Case("generate", "path", ["generate", "run", "--prompt", "hi"]),
            Case("plot", "path", ["plot", "no/such/run"]), Case("plot", "path", ["plot", "a_file"]),
            Case("plot", "path", ["plot", "run", "--out", "a_file"]),
            Case("data", "path", ["data", "inspect", "nowhere.jsonl", "--model_name_or_path", "model"]),
            Case("demo", "path", ["demo", "--output-dir", "a_file", "--skip-estimate"])]


# estimate reads config.json and the tokenizer (the vocabulary train grows the embeddings to), not the weights
ESTIMATE_READS_NOT = ("no_weights", "cut_weights", "no_tokenizer")


def model_cases() -> list[Case]:
    cases = []
    for name in ("broken_config", "list_config", "unknown_type", "no_weights", "cut_weights", "broken_tokenizer",
                 "no_tokenizer"):
        path = f"models/{name}"
        cases += [Case("train", "model", train_with(model_name_or_path=path)),
                  Case("estimate", "model", ["estimate", path], OK if name in ESTIMATE_READS_NOT else USAGE),
                  Case("generate", "model", ["generate", path, "--prompt", "hi"]),
                  # the adapter folder holds the tokenizer train used, and merge writes that one
                  Case("merge", "model", ["merge", "run/final", "--base", path, f"mm-{name}"],
                       OK if name == "no_tokenizer" else USAGE),
                  Case("export", "model", ["export", path, f"g-{name}.gguf", "--format", "gguf"])]
    return cases


def adapter_cases() -> list[Case]:
    def damaged(name: str, change: Callable[[Path], None]) -> Callable[[Path], None]:
        def setup(work: Path) -> None:
            copy_run(name)(work)
            change(work / name / "final")
        return setup

    changes = {"cut": lambda d: write(d / "adapter_model.safetensors",
                                      (d / "adapter_model.safetensors").read_bytes()[:-100]),
               "header": lambda d: write(d / "adapter_model.safetensors", b"\x08" + b"\x00" * 7 + b"{}"),
               "json": lambda d: write(d / "adapter_config.json", "{\"r\": "),
               "list": lambda d: write(d / "adapter_config.json", "[]"),
               "types": lambda d: write(d / "adapter_config.json", json.dumps(
                   {**json.loads((d / "adapter_config.json").read_text()), "r": "x"})),
               "peft_type": lambda d: write(d / "adapter_config.json", json.dumps(
                   {**json.loads((d / "adapter_config.json").read_text()), "peft_type": "NOPE"})),
               "no_weights": lambda d: (d / "adapter_model.safetensors").unlink()}
    cases = []
    for name, change in changes.items():
        run = f"ad-{name}"
        cases += [Case("export", "adapter", ["export", run, f"{run}.gguf", "--format", "gguf"],
                       setup=damaged(run, change)),
                  Case("merge", "adapter", ["merge", f"{run}/final", "--base", "model", f"{run}-merged"],
                       setup=damaged(run, change)),
                  Case("generate", "adapter", ["generate", f"{run}/final", "--prompt", "hi"],
                       setup=damaged(run, change))]
    return cases


def checkpoint_cases() -> list[Case]:
    def damaged(name: str, change: Callable[[Path], None]) -> Callable[[Path], None]:
        def setup(work: Path) -> None:
            copy_run(name)(work)
            change(work / name / "checkpoints" / "step-2")
        return setup

    changes = {"manifest": lambda d: write(d / "manifest.json", "{"),
               "manifest_list": lambda d: write(d / "manifest.json", "[]"),
               "config": lambda d: write(d / "config.yaml", "a: [\n"),
               "config_types": lambda d: write(d / "config.yaml", "max_steps: many\n"),
               "state": lambda d: write(d / "trainer_state.json", "{"),
               "shard": lambda d: [write(p, p.read_bytes()[:10]) for p in (d / "dcp").glob("*.distcp")],
               "no_config": lambda d: (d / "config.yaml").unlink()}
    cases = []
    for name, change in changes.items():
        run = f"ck-{name}"
        cases += [Case("export", "checkpoint", ["export", f"{run}/checkpoints/step-2", f"{run}-out"],
                       setup=damaged(run, change)),
                  Case("train", "checkpoint", ["train", "--model_name_or_path", "model", "--dataset_name",
                                               "chat.jsonl", "--max_seq_len", "64", "--output_dir", run,
                                               "--use_peft_lora", "true", "--max_steps", "6", "--save_steps", "2",
                                               "--per_device_train_batch_size", "2", "--resume_from_checkpoint",
                                               f"{run}/checkpoints/step-2"], setup=damaged(run, change))]
    return cases


def symlink_cases() -> list[Case]:
    return [Case("train", "symlink", train_with(model_name_or_path="links/dangling")),
            Case("train", "symlink", train_with(model_name_or_path="links/loop_a")),
            Case("train", "symlink", train_with(dataset_name="links/dangling.jsonl")),
            Case("train", "symlink", train_with(dataset_name="links/loop_a")),
            Case("train", "symlink", train_with(output_dir="links/loop_a")),
            Case("train", "symlink", train_with(output_dir="links/dangling")),
            Case("train", "symlink", train_with(model_name_or_path="links/model", dataset_name="links/data.jsonl",
                                                output_dir="linked-out"), OK, setup=fresh("linked-out"),
                 timeout=180),
            Case("estimate", "symlink", ["estimate", "links/loop_a"]),
            Case("estimate", "symlink", ["estimate", "links/dangling"]),
            Case("generate", "symlink", ["generate", "links/loop_a", "--prompt", "hi"]),
            Case("export", "symlink", ["export", "links/loop_a", "o6"]),
            Case("export", "symlink", ["export", "run/checkpoints/step-2", "links/loop_a"]),
            Case("export", "symlink", ["export", "run/checkpoints/step-2", "links/dangling"]),
            Case("merge", "symlink", ["merge", "run/final", "--base", "links/loop_a", "o7"]),
            Case("plot", "symlink", ["plot", "links/loop_a"]),
            Case("data", "symlink", ["data", "inspect", "links/loop_a", "--model_name_or_path", "model"])]


def data_cases() -> list[Case]:
    names = ("binary.jsonl", "not_json.jsonl", "empty.jsonl", "numbers.jsonl", "no_messages.jsonl",
             "bad_roles.jsonl", "null_content.jsonl", "half_line.jsonl", "garbage.parquet", "garbage.csv",
             "text_rows.jsonl", "empty_list.json", "utf16.jsonl")
    cases = [Case("data", "data", ["data", "inspect", f"data/{n}", "--model_name_or_path", "model"]) for n in names]
    cases += [Case("train", "data", train_with(dataset_name=f"data/{n}")) for n in names]
    cases += [Case("estimate", "data", ["estimate", "model", "--data", f"data/{n}"]) for n in
              ("binary.jsonl", "empty.jsonl", "garbage.parquet")]
    return cases


def option_cases() -> list[Case]:
    estimate = [["--num-gpus", "0"], ["--num-gpus", "-1"], ["--seq-len", "0"], ["--batch-size", "-1"],
                ["--gpu-memory", "-5"], ["--gpu-memory", "nan"], ["--gpu-memory", "inf"], ["--lora-r", "0"],
                ["--method", "qlorax"], ["--gpu", "h9000"], ["--num-nodes", "0"], ["--strategy", "zero9"],
                ["--optimizer", "adamw_9bit"], ["--pipeline-microbatches", "0"], ["--tokens", "-1"],
                ["--price-per-gpu-hour", "-2"], ["--gradient-accumulation-steps", "0"],
                ["--sharding-strategy", "HALF"], ["--mixed-precision", "fp3"], ["--interconnect", "carrier-pigeon"]]
    cases = [Case("estimate", "options", ["estimate", "llama-3-8b", *o]) for o in estimate]
    generate = [["--max_new_tokens", "-1"], ["--temperature", "-1"], ["--top_p", "2"], ["--top_p", "0"],
                ["--dtype", "float7"], ["--device", "tpu"], ["--device", "cuda:7"], ["--seed", "x"]]
    cases += [Case("generate", "options", ["generate", "model", "--prompt", "hi", *o]) for o in generate]
    cases += [Case("chat", "options", ["chat", "model", "--temperature", "-1"], stdin="hi\n"),
              Case("generate", "options", ["generate", "model"])]
    cases += [Case("config", "options", ["config", *o]) for o in (["scheme"], ["schema", "--bogus"], ["schema", "x"])]
    demo = [["--max-steps", "-1"], ["--max-steps", "0"], ["--num-processes", "0"], ["--gpu", "h9000"],
            ["--quantize", "q2"], ["--quantize", "f16"]]
    cases += [Case("demo", "options", ["demo", *o, "--skip-estimate"]) for o in demo]
    bench = [["--strategies", "zero"], ["--num_processes", "0"], ["--steps", "0"], ["--warmup_steps", "9"],
             ["--set", "nokey"], ["--set", "learning_rat=1"], ["--timeout", "-1"]]
    cases += [Case("bench", "options", ["bench", "strategies", "recipes/../recipe_ok.yaml", *o],
                   setup=lambda w: write(w / "recipe_ok.yaml", "model_name_or_path: model\ndataset_name: chat.jsonl\n"
                                                               "max_seq_len: 64\n")) for o in bench]
    cases += [Case("plot", "options", ["plot", "run", "--out", "sp ace/plöts"], OK),
              Case("plot", "metrics", ["plot", "pm"], setup=lambda w: write(w / "pm" / "metrics.jsonl", b"\x00\xff")),
              Case("plot", "metrics", ["plot", "pe"], setup=lambda w: write(w / "pe" / "metrics.jsonl", "")),
              # a run that diverged logs NaN: its curve is drawn, not refused
              Case("plot", "metrics", ["plot", "pn"], OK, setup=lambda w: write(w / "pn" / "metrics.jsonl",
                                                                                '{"step": 1, "loss": NaN}\n')),
              Case("plot", "metrics", ["plot", "pt"], setup=lambda w: write(w / "pt" / "metrics.jsonl",
                                                                            '{"step": "x", "loss": "y"}\n[]\n'))]
    return cases


def all_cases() -> list[Case]:
    return [*recipe_cases(), *accelerate_cases(), *deepspeed_cases(), *gguf_cases(), *launch_cases(),
            *train_option_cases(), *resume_cases(), *path_cases(), *model_cases(), *adapter_cases(),
            *checkpoint_cases(), *symlink_cases(), *data_cases(), *option_cases()]


# ---------------------------------------------------------------------------------------------------------------
# Running and judging


def judge(case: Case, code: int | None, err: str) -> str:
    """'' when the case kept the contract, else what broke it."""
    if code is None:
        return f"hung (killed after {case.timeout:.0f} s)"
    if "Traceback (most recent call last)" in err:
        return f"traceback: {last_line(err)}"
    lines = [line for line in err.splitlines() if not NOISE.search(line)]
    if case.expect == OK:
        return "" if code == 0 else f"exit {code}: {last_line(err)}"
    wanted = 2 if case.expect == USAGE else (1, 2)
    if code == 0:
        return "exit 0: the bad input was accepted"
    if code not in (wanted if isinstance(wanted, tuple) else (wanted,)):
        return f"exit {code}: {last_line(err)}"
    if len(lines) != 1:
        return f"{len(lines)} lines: " + " | ".join(line[:80] for line in lines[:4])
    return ""


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(nothing)"


def run_forked(case: Case, work: Path) -> tuple[int | None, str]:
    """The case in a child forked from this process: torch and transformers already imported."""
    err_path = work / ".case-stderr"
    pid = os.fork()
    if pid == 0:  # the child: what `shardtune ARGS` does, in the workspace
        try:
            os.chdir(work)
            os.setsid()
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            read, write_end = os.pipe()
            os.write(write_end, case.stdin.encode())
            os.close(write_end)
            os.dup2(read, 0)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.argv = ["shardtune", *case.argv]
            from shardtune.cli import command

            code = command()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - what the interpreter would print
            import traceback

            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    return wait(pid, case.timeout), err_path.read_text(errors="replace") if err_path.exists() else ""


def wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def run_subprocess(case: Case, work: Path) -> tuple[int | None, str]:
    try:
        proc = subprocess.run([sys.executable, "-m", "shardtune", *case.argv], cwd=work, input=case.stdin,
                              capture_output=True, text=True, timeout=case.timeout, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        return None, (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
    return proc.returncode, proc.stderr


def preload() -> None:
    """What most cases import, imported once before forking."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import shardtune.cli.common as common

    common.build_parser()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None, help="workspace (kept; made once); default: a temp dir")
    parser.add_argument("--only", default=None, help="run only this command's cases (train, launch, ...)")
    parser.add_argument("--kind", default=None, help="run only this input kind's cases (recipe, gguf, ...)")
    parser.add_argument("--subprocess", action="store_true", help="a new interpreter per case (slower, exact)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="shardtune-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    make_workspace(work)
    cases = [c for c in all_cases() if (args.only is None or c.command == args.only)
             and (args.kind is None or c.kind == args.kind)]
    if not args.subprocess:
        preload()
    broken = run_all(cases, work, run_subprocess if args.subprocess else run_forked)
    print_table(cases)
    return 1 if broken else 0


def run_all(cases: list[Case], work: Path, runner: Callable[[Case, Path], tuple[int | None, str]]) -> int:
    broken = 0
    for case in cases:
        shutil.rmtree(work / "out", ignore_errors=True)  # what an accepted case trained: the next starts afresh
        if case.setup is not None:
            case.setup(work)
        started = time.monotonic()
        code, err = runner(case, work)
        problem = judge(case, code, err)
        broken += bool(problem)
        case.result = {"code": code, "problem": problem, "seconds": time.monotonic() - started,
                       "line": last_line(err)}
        mark = "BROKEN" if problem else "ok    "
        shown = " ".join(case.argv)
        print(f"{mark} [{case.command}/{case.kind}] exit {code} {time.monotonic() - started:5.1f}s  {shown[:110]}",
              flush=True)
        print(f"         {problem or case.result['line']}"[:260], flush=True)
    return broken


def print_table(cases: list[Case]) -> None:
    cells: dict[tuple[str, str], list[Case]] = collections.defaultdict(list)
    for case in cases:
        cells[(case.command, case.kind)].append(case)
    print("\n| command | input kind | cases | broke the contract |")
    print("|---|---|---|---|")
    for (command, kind), group in sorted(cells.items()):
        bad = [c for c in group if c.result.get("problem")]
        print(f"| {command} | {kind} | {len(group)} | {len(bad) or '-'} |")
    print(f"\n{sum(bool(c.result.get('problem')) for c in cases)} of {len(cases)} cases broke the contract")


if __name__ == "__main__":
    sys.exit(main())
