"""Shared helpers for trainer tests: a tiny model, chat data, and runs on 1 process or 2 gloo processes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_chat_data(path: Path, rows: int = 1500, seed: int = 0) -> Path:
    """Short addition dialogues: enough rows that packing at 64 tokens gives a few hundred training rows."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}) + "\n")
    return path


@contextlib.contextmanager
def logging_restored() -> Iterator[None]:
    """``train`` in this process sets up logging and warning filters as a training process does: undo it, so
    the tests after these see the interpreter as it was."""
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                    logging.getLogger(name).propagate) for name in ("shardtune", "bitsandbytes")}
    try:
        with warnings.catch_warnings():
            yield
    finally:
        for name, (level, handlers, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate = propagate


def flags(*args: str) -> list[str]:
    """``--key value`` arguments with a later value of a key replacing the earlier one in place.

    ``shardtune train`` refuses a key given two values on its command line, so tests that add to a shared base
    command line build it with this (a ``--key`` followed by another ``--key``, or by nothing, is a boolean flag).
    """
    pairs: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        key = args[i]
        assert key.startswith("--"), f"expected --key, got {key!r} in {args}"
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs[key.replace("-", "_")] = [key, args[i + 1]]
            i += 2
        else:
            pairs[key.replace("-", "_")] = [key]
            i += 1
    return [item for pair in pairs.values() for item in pair]


def write_sum_rows(path: Path, rows: int = 400) -> Path:
    """Addition dialogues in a fixed order (no random generator): the resume and optimizer tests' data."""
    dialogues = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                               {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
                 for a, b in ((i * 7 % 50, i * 13 % 50) for i in range(rows))]
    path.write_text("".join(json.dumps(r) + "\n" for r in dialogues))
    return path


def tiny_workspace(tmp_path_factory, name: str, *, model: str = "model", rows: int = 200) -> Path:
    """A folder with the tiny model (``model``) and ``rows`` chat rows (``chat.jsonl``), for a module's runs."""
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp(name)
    make_model_folder(root / model)
    write_chat_data(root / "chat.jsonl", rows=rows)
    return root


def shardtune_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", SHARDTUNE_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def run_shardtune(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``shardtune ARGS`` as a user runs it (a separate process), output captured."""
    return subprocess.run([sys.executable, "-m", "shardtune", *args], cwd=tmp_path, env=shardtune_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def run_ranks(argv: list[str], env: dict[str, str], logs: list[Path], timeout: int) -> list[int | str]:
    """``python ARGV`` in the repository, one process per log file (its output), and their exit codes. More than
    one: ranks 0, 1, ... of one job, whose process groups join, as clients, a store the caller holds
    (tests/ports.py) at the MASTER_PORT the job sets. All are killed if any is still running after ``timeout``
    seconds (their codes then say so)."""
    from tests.ports import AGENT_STORE_ENV

    world = len(logs)
    ranks = [{}] if world == 1 else [AGENT_STORE_ENV | {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                                        "LOCAL_WORLD_SIZE": str(world)} for r in range(world)]
    with contextlib.ExitStack() as files:
        procs = [subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env | extra,
                                  stdout=files.enter_context(log.open("w")), stderr=subprocess.STDOUT)
                 for log, extra in zip(logs, ranks)]
        try:
            return [p.wait(timeout=timeout) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            return [f"killed after {timeout} s"] * world


JOB_MARK = "\n##### shardtune train job "  # tests/jobs_worker.py prints it before each job's output


def train_jobs(work: Path, jobs: dict[str, tuple[int, list[str]]], timeout: int = 600) -> dict[str, str]:
    """Each job ``name: (processes, ARGV)`` as ``shardtune train ARGV`` runs it (``processes`` 2: as ``shardtune
    launch --num_processes 2`` does, on gloo), all 1-process jobs in one process and all 2-process jobs in one
    pair of processes (tests/jobs_worker.py): a test module's runs pay for importing torch and transformers once.
    Returns, for each job, "" when it exited 0, else what went wrong (its exit code or exception, and the log's
    end): the test that owns the job asserts on it, so one failed job fails its own test only."""
    from tests.ports import held_stores

    env = shardtune_env(work) | {"PYTHONPATH": str(REPO)}
    results = work / "jobs_results.jsonl"
    results.unlink(missing_ok=True)
    codes: dict[int, list] = {}
    job_logs: dict[str, list[str]] = {}
    for nproc in sorted({n for n, _ in jobs.values()}):
        names = [name for name, (n, _) in jobs.items() if n == nproc]
        assert nproc in (1, 2), f"{names}: train_jobs runs 1 or 2 processes"
        stores = held_stores(len(names)) if nproc == 2 else []  # one per job, held until both ranks are done
        spec = work / f"jobs_{nproc}.json"
        spec.write_text(json.dumps({"results": str(results), "jobs": [
            {"name": name, "argv": jobs[name][1], "port": stores[i].port if stores else None}
            for i, name in enumerate(names)]}))
        logs = [work / f"jobs_{nproc}_rank{r}.log" for r in range(nproc)]
        codes[nproc] = run_ranks(["-m", "tests.jobs_worker", str(spec)], env, logs, timeout)
        for log in logs:
            sections = log.read_text().split(JOB_MARK)[1:]  # each begins with its job's name
            for section in sections:
                name, _, text = section.partition("\n")
                job_logs.setdefault(name, []).append(text[-3000:])
    ended: dict[str, list[dict]] = {}
    for line in (results.read_text().splitlines() if results.exists() else []):
        r = json.loads(line)
        ended.setdefault(r["name"], []).append(r)
    out = {}
    for name, (nproc, _) in jobs.items():
        ranks = ended.get(name, [])
        wrong = [f"rank {r['rank']}: {r.get('error') or 'exit code ' + str(r['code'])}"
                 for r in ranks if r["code"] != 0]
        if len(ranks) < nproc:
            wrong.append(f"{nproc - len(ranks)} of its {nproc} processes never ended it")
        what = "; ".join(wrong)
        out[name] = what and (f"job {name}: {what} (workers' exit codes {codes[nproc]}); its log, rank by rank:\n"
                              + "\n".join(job_logs.get(name, ["(nothing)"])))
    return out


def job_log(work: Path, name: str, nproc: int, rank: int = 0) -> str:
    """What job ``name`` of a ``train_jobs`` call in ``work`` printed on ``rank`` (its ``processes``: ``nproc``)."""
    sections = (work / f"jobs_{nproc}_rank{rank}.log").read_text().split(JOB_MARK)[1:]
    return next(text for job, _, text in (s.partition("\n") for s in sections) if job == name)


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


# What a command may print on stderr around its one line: progress bars, the training log, library loading bars.
NOISE = re.compile(r"it/s\]|s/it\]|step/s\]|examples/s\]|^\[\d\d:\d\d:\d\d shardtune rank \d+\]|^Loading weights"
                   r"|^Writing model|^\s*$|^  ")


def refused(capsys, argv: list[str], *expected: str) -> str:
    """Run ``shardtune ARGV`` in this process: it must exit with code 2 and print one line (besides progress
    bars and the training log) holding every ``expected`` text; that line is returned."""
    from shardtune.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not NOISE.search(line)]
    assert code == 2, err
    assert len(lines) == 1, lines
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def make_lora_adapter(model: Path, out: Path) -> Path:
    """A LoRA adapter folder for the model folder ``model`` (q_proj and v_proj, rank 4), as PEFT saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
    return out


def one_rank_per_machine(starts: list[list[str]], cwd: Path, extra_env: dict[str, str], timeout: int = 120) -> list:
    """``python START`` for each start, as ranks 0, 1, ... of one job with one process on each machine (joining a
    store the test holds, tests/ports.py); returns each one's (exit code, stderr). All are killed on leaving."""
    from tests.ports import AGENT_STORE_ENV, held_stores

    [store] = held_stores(1)
    procs = [subprocess.Popen(
        [sys.executable, *start], cwd=cwd, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=shardtune_env(cwd) | AGENT_STORE_ENV | extra_env | {
            "PYTHONPATH": str(REPO), "MASTER_PORT": str(store.port), "RANK": str(rank),
            "WORLD_SIZE": str(len(starts)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        for rank, start in enumerate(starts)]
    try:
        said = [proc.communicate(timeout=timeout)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    return [(proc.returncode, err) for proc, err in zip(procs, said)]
