"""report_to: one short run logged to TensorBoard, W&B (offline), MLflow (file store) and Trackio (local), each read
back with its own reader and compared with metrics.jsonl; and the config checks of report_to."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import pytest
import yaml

from shardtune.config import load_train_config
from shardtune.config.schema import TRACKER_PACKAGES
from tests.trainutil import flags, tiny_workspace

ALL = ",".join(TRACKER_PACKAGES)
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m, _ in TRACKER_PACKAGES.values()),
                                reason="pip install 'shardtune[trackers]' (the dev extra has them)")


def args(root: Path, *extra: str) -> list[str]:
    return flags("--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"),
                 "--splits", "train", "--max_seq_len", "64", "--packing", "True", "--max_steps", "4",
                 "--per_device_train_batch_size", "2", "--logging_steps", "1", "--eval_strategy", "steps",
                 "--eval_steps", "2", "--eval_split_ratio", "0.1", "--save_strategy", "no",
                 "--learning_rate", "3e-3", "--output_dir", str(root / "out"), *extra)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "trackers")


def offline_env(monkeypatch, tmp: Path) -> None:
    """No credentials, no tracking server, every tracker's files under ``tmp``; variables the product sets for
    itself are put back afterwards (set, then deleted: monkeypatch restores both)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_PROJECT",
                 "WANDB_NAME", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
                 "MLFLOW_TAGS", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_DISABLE_TELEMETRY", "TRACKIO_SPACE_ID",
                 "TRACKIO_SERVER_URL", "TRACKIO_PROJECT", "TENSORBOARD_LOGGING_DIR"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    (tmp / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp / "netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp / name.lower()))
    monkeypatch.setenv("TRACKIO_DIR", str(tmp / "trackio"))  # read when trackio is first imported


NETWORK_CALLS: list[tuple[str, str]] = []
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", ""}


def watch_network(event: str, event_args: tuple) -> None:
    """An audit hook: name lookups and connections to other hosts made by Python code of this process while the
    run trains. (It cannot see wandb-core, another process, nor threads that call out after the run.)"""
    if not WATCHING or event not in ("socket.getaddrinfo", "socket.connect"):
        return
    address = event_args[0] if event == "socket.getaddrinfo" else event_args[1]
    host = address if isinstance(address, str) else address[0] if isinstance(address, tuple) else ""
    if event == "socket.connect" and isinstance(address, str):
        return  # a Unix socket: wandb's service
    if str(host) not in LOCAL_HOSTS:
        NETWORK_CALLS.append((event, str(host)))


WATCHING = False


def expected(out: Path) -> dict[tuple[str, int], float]:
    """(key, step) -> value of every number metrics.jsonl holds (read here, not through the trackers' own filter,
    which the test would then share)."""
    found = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        found.update({(key, record["step"]): value for key, value in record.items()
                      if key != "step" and type(value) in (int, float)})
    return found


def trainer_name(key: str, *, prefixed: bool = True) -> str:
    """metrics.jsonl's ``key`` as a Trainer run logs it in a tracker: Trainer's learning_rate for lr (and
    num_input_tokens_seen for tokens_seen), and where
    ``prefixed`` (TensorBoard, W&B, Trackio) the name Transformers' own ``rewrite_logs`` gives it there."""
    from transformers.integrations.integration_utils import rewrite_logs

    named = {"lr": "learning_rate", "tokens_seen": "num_input_tokens_seen"}.get(key, key)
    return next(iter(rewrite_logs({named: 0}))) if prefixed else named


def trainer_logged(want: dict[tuple[str, int], float], *, prefixed: bool = True) -> dict[tuple[str, int], float]:
    return {(trainer_name(key, prefixed=prefixed), step): value for (key, step), value in want.items()}


def wandb_records(path: Path):
    """The records of a .wandb transaction log. wandb 0.31 ships no Python reader for it (wandb-core writes it;
    the old ``wandb.sdk.internal.datastore`` is gone), so this walks its framing (LevelDB's log format after a
    7-byte W&B header: 32 KiB blocks, chunks of crc32, length, type) and parses each record with wandb's own
    protobuf class, ``wandb.proto.wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb(out: Path) -> tuple[str, dict, dict]:
    (log_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb"))
    name, config, history = None, {}, {}
    for record in wandb_records(Path(log_file)):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            row = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.update({(k, row["_step"]): v for k, v in row.items() if not k.startswith("_")})
    return name, config, history


def read_tensorboard(out: Path, run_name: str) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard" / run_name), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return scalars, json.loads(text.strip("`\n"))


def read_mlflow(out: Path) -> tuple[str, dict, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("shardtune").experiment_id])
    metrics = {(key, m.step): m.value for key in run.data.metrics
               for m in client.get_metric_history(run.info.run_id, key)}
    return run.info.run_name, run.data.params, metrics


def read_trackio(run_name: str) -> tuple[dict, dict]:
    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs("shardtune", run_name)
    metrics = {(k, row["step"]): v for row in rows for k, v in row.items() if k not in ("step", "timestamp")}
    return SQLiteStorage.get_run_config("shardtune", run_name), metrics


def test_every_tracker_holds_the_losses_and_config_of_metrics_jsonl(root, tmp_path, monkeypatch, restore_logging):
    from shardtune.train.loop import train

    offline_env(monkeypatch, tmp_path)
    out = root / "out"
    cfg = load_train_config(args(root, "--report_to", ALL, "--run_name", "tiny-run"))
    global WATCHING
    sys.addaudithook(watch_network)  # hooks stay for the process's life: WATCHING keeps it to this run
    WATCHING = True
    try:
        train(cfg)
    finally:
        WATCHING = False
    assert NETWORK_CALLS == []
    want = expected(out)
    losses = {k: v for k, v in want.items() if k[0] in ("loss", "eval_loss")}
    assert sorted(s for k, s in losses if k == "loss") == [1, 2, 3, 4]
    assert sorted(s for k, s in losses if k == "eval_loss") == [2, 4]
    assert {"lr", "grad_norm", "tokens"} <= {k for k, _ in want}  # not the losses alone

    # A Trainer (TRL) run's names: its charts and this run's line up in one project
    assert {("train/loss", 1), ("train/learning_rate", 1), ("train/grad_norm", 1), ("eval/loss", 2)} <= set(
        trainer_logged(want)) and ("learning_rate", 1) in trainer_logged(want, prefixed=False)
    name, config, history = read_wandb(out)
    assert name == "tiny-run" and history == trainer_logged(want)  # every number, float64 as written
    assert (config["learning_rate"], config["report_to"], config["run_name"]) == (3e-3, list(TRACKER_PACKAGES),
                                                                                  "tiny-run")
    scalars, tb_config = read_tensorboard(out, "tiny-run")
    import numpy as np

    assert scalars == {k: float(np.float32(v)) for k, v in trainer_logged(want).items()}  # event files: float32
    # the config the run recorded (config.yaml: its precision decided for this machine), not the one it was given
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["bf16"] is not None and recorded["learning_rate"] == cfg.optim.learning_rate
    assert tb_config == json.loads(json.dumps(recorded, default=str))
    name, params, metrics = read_mlflow(out)
    assert name == "tiny-run" and metrics == trainer_logged(want, prefixed=False)
    assert params == {key: str(value) for key, value in recorded.items()}
    trackio_config, metrics = read_trackio("tiny-run")
    assert metrics == trainer_logged(want)
    assert trackio_config["learning_rate"] == 3e-3 and trackio_config["max_steps"] == 4


def test_tensorboard_reads_each_step_once_after_a_resume(root, tmp_path, restore_logging):
    """A resume redoes the steps after its checkpoint: metrics.jsonl drops the first tries, and TensorBoard, which
    appends to the same folder, kept both (two loss values at one step)."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardtune.train.loop import train

    out = tmp_path / "tb"
    common = ("--report_to", "tensorboard", "--run_name", "tb", "--output_dir", str(out), "--save_strategy", "steps",
              "--save_steps", "2")
    train(load_train_config(args(root, *common)))
    train(load_train_config(args(root, *common, "--resume_from_checkpoint", str(out / "checkpoints" / "step-2"),
                                 "--learning_rate", "1e-2")))  # steps 3 and 4 log other losses
    acc = EventAccumulator(str(out / "tensorboard" / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    events = [(tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # epoch: twice (step and eval records); lr and learning_rate, one scalar under Trainer's name
    logged = sorted((name, r["step"], value) for r in records for name, value in {
        trainer_name(key): float(np.float32(value)) for key, value in r.items()
        if key != "step" and type(value) in (int, float)}.items())
    assert sorted(events) == logged


def test_report_to_all_none_and_lists(root):
    installed = [name for name, (module, _) in TRACKER_PACKAGES.items() if importlib.util.find_spec(module)]
    assert load_train_config(args(root, "--report_to", "all")).run.report_to == installed
    assert load_train_config(args(root, "--report_to", "none")).run.report_to == []
    assert load_train_config(args(root)).run.report_to == []
    assert load_train_config(args(root, "--report_to", "WandB,mlflow")).run.report_to == ["wandb", "mlflow"]
    recipe = root / "recipe.yaml"
    recipe.write_text("report_to: [trackio, tensorboard]\nrun_name: named\n")
    cfg = load_train_config([str(recipe), *args(root)])
    assert (cfg.run.report_to, cfg.run.run_name) == (["trackio", "tensorboard"], "named")


@pytest.mark.parametrize("value, message", [
    ("wandbb", "report_to='wandbb' is not accepted; use one of tensorboard, wandb, mlflow, trackio, all, none "
               "(did you mean wandb?)"),
    ("none,wandb", "none and all stand alone"),
])
def test_a_bad_name_is_exit_2_in_one_line(root, capsys, value, message):
    from shardtune.cli import main

    assert main(["train", *args(root, "--report_to", value)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_missing_package_is_exit_2_naming_it_before_anything_is_written(root, tmp_path, capsys, monkeypatch):
    from shardtune.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    out = tmp_path / "never"
    assert main(["train", *args(root, "--report_to", "tensorboard,mlflow", "--output_dir", str(out))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "report_to mlflow needs the mlflow-skinny package, which is not installed: pip install mlflow-skinny" in err
    assert "tensorboard" not in err.split("report_to mlflow")[1] and not out.exists()
    # "all" takes only the installed ones, so it never refuses
    assert "mlflow" not in load_train_config(args(root, "--report_to", "all")).run.report_to


def test_a_failing_tracker_warns_once_and_the_others_go_on(caplog):
    from shardtune.train.trackers import Trackers

    class Broken:
        name, prefixed = "broken", False

        def log(self, scalars, step):
            raise OSError(28, "No space left on device")

        def finish(self, failed):
            raise OSError(28, "No space left on device")

    class Kept:
        name, prefixed = "kept", False
        seen: list = []

        def log(self, scalars, step):
            self.seen.append((step, scalars))

        def finish(self, failed):
            self.seen.append(("finished", failed))

    trackers = Trackers([Broken(), Kept()])
    with caplog.at_level("WARNING", logger="shardtune"):
        for step in (1, 2):
            trackers.log({"step": step, "loss": 1.0 / step, "note": "text", "flag": True})
        trackers.finish()
    assert Kept.seen == [(1, {"loss": 1.0}), (2, {"loss": 0.5}), ("finished", False)]
    warnings = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert warnings == ["report_to broken: log failed ([Errno 28] No space left on device); training goes on, "
                        "metrics.jsonl keeps every record"]


def test_other_ranks_start_no_tracker(tmp_path, monkeypatch):
    from shardtune.train import trackers

    monkeypatch.setattr(trackers, "TRACKERS", {})  # any tracker made would be a KeyError
    assert trackers.start_trackers(list(TRACKER_PACKAGES), tmp_path, None, {}, enabled=False).trackers == []


def test_tensorboard_reads_each_step_once_after_a_resume_that_found_no_checkpoint(root, tmp_path, restore_logging):
    """resume_from_checkpoint true with no checkpoint yet (the run was killed before its first) starts again at
    step 1: metrics.jsonl dropped the killed run's records, but TensorBoard kept them beside the new ones."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardtune.train.loop import train

    class Crash:
        def on_step_end(self, args, state, control, **kwargs):
            if state.step == 3:
                raise RuntimeError("killed")

    out = tmp_path / "tb-scratch"
    common = ("--report_to", "tensorboard", "--run_name", "tb", "--output_dir", str(out), "--resume_from_checkpoint",
              "true")
    with pytest.raises(RuntimeError, match="killed"):
        train(load_train_config(args(root, *common)), callbacks=[Crash()])  # steps 1-3 logged, no checkpoint
    train(load_train_config(args(root, *common, "--learning_rate", "1e-2")))  # from step 1, other losses
    acc = EventAccumulator(str(out / "tensorboard" / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(r["step"], pytest.approx(r["loss"], rel=1e-6))
                                                                 for r in records if "loss" in r]


def test_under_ddp_rank_1_prints_nothing_rank_0_says_and_only_rank_0_writes_the_events(root, tmp_path):
    """Rank 1 ran the same code as rank 0 and printed its warnings again (a resume that found no checkpoint) and
    transformers' "Loading weights" bar: once per process. Only rank 0 writes the tracker's files."""
    from tests.trainutil import JOB_MARK, train_jobs

    out = tmp_path / "ddp"
    argv = args(root, "--report_to", "tensorboard", "--run_name", "ddp", "--output_dir", str(out),
                "--distributed_type", "DDP", "--resume_from_checkpoint", "true", "--max_steps", "2",
                "--predict_memory", "false")
    errors = train_jobs(tmp_path, {"ddp": (2, argv)})
    assert errors["ddp"] == "", errors["ddp"]
    logs = [(tmp_path / f"jobs_2_rank{rank}.log").read_text().split(JOB_MARK)[1] for rank in range(2)]
    assert logs[0].count("resume_from_checkpoint=true: no complete checkpoint") == 1
    assert "Loading weights" in logs[0] and "shardtune rank 0]" in logs[0]
    assert "shardtune rank 1]" not in logs[1] and "Loading weights" not in logs[1], logs[1]
    (events,) = (out / "tensorboard" / "ddp").iterdir()
    scalars, _ = read_tensorboard(out, "ddp")
    assert sorted(scalars) == sorted(trainer_logged(expected(out))) and len(scalars) > 0


def test_tensorboard_logging_dir_and_wandb_dir_place_the_files_as_in_transformers(tmp_path, monkeypatch):
    """TENSORBOARD_LOGGING_DIR (the event files' folder) and WANDB_DIR (where wandb/ goes), which Transformers'
    callbacks honour, were overruled: the files went to output_dir/tensorboard/RUN_NAME and output_dir/wandb."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardtune.train.trackers import start_trackers

    offline_env(monkeypatch, tmp_path)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb_here"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb_here"))
    (tmp_path / "wb_here").mkdir()
    trackers = start_trackers(["tensorboard", "wandb"], tmp_path / "out", "named", {"learning_rate": 0.1},
                              enabled=True)
    for step, loss in ((1, 2.5), (2, 2.0)):
        trackers.log({"step": step, "loss": loss})
    trackers.finish()
    acc = EventAccumulator(str(tmp_path / "tb_here"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (2, 2.0)]
    assert len(glob.glob(str(tmp_path / "wb_here" / "wandb" / "offline-run-*" / "*.wandb"))) == 1
    assert not (tmp_path / "out").exists()


def test_mlflow_run_id_carries_on_that_run_and_mlflow_tags_are_set_as_in_transformers(tmp_path, monkeypatch):
    """MLFLOW_RUN_ID (Transformers' way to carry on a run, a resumed job's) and MLFLOW_TAGS were ignored: every
    start made a new run, without the tags."""
    from mlflow.tracking import MlflowClient

    from shardtune.errors import UsageError
    from shardtune.train.trackers import start_trackers

    offline_env(monkeypatch, tmp_path)
    out = tmp_path / "out"
    first = start_trackers(["mlflow"], out, "named", {"learning_rate": 0.1}, enabled=True)
    first.log({"step": 1, "loss": 2.5})
    first.finish()
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("shardtune").experiment_id])
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "nlp", "try": 2}')
    again = start_trackers(["mlflow"], out, "named", {"learning_rate": 0.2, "seed": 7}, enabled=True)
    again.log({"step": 2, "loss": 2.0})
    again.finish()
    (run,) = client.search_runs([client.get_experiment_by_name("shardtune").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 2.5), (2, 2.0)]
    assert run.data.params == {"learning_rate": "0.1", "seed": "7"} and run.info.status == "FINISHED"
    assert {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")} == {"team": "nlp", "try": "2"}
    monkeypatch.setenv("MLFLOW_TAGS", "team=nlp")
    with pytest.raises(UsageError, match="MLFLOW_TAGS='team=nlp' .report_to mlflow. is not a JSON object"):
        start_trackers(["mlflow"], out, "named", {}, enabled=True)


def test_bad_mlflow_tags_are_refused_before_anything_is_written(root, tmp_path, capsys, monkeypatch):
    """Read only as the tracker started, MLFLOW_TAGS that is no JSON object stopped the run after an earlier run it
    replaced (overwrite_output_dir) was deleted; it is now refused with the config's problems."""
    from tests.trainutil import refused

    monkeypatch.setenv("MLFLOW_TAGS", "team=nlp")
    out = tmp_path / "never"
    refused(capsys, ["train", *args(root, "--report_to", "mlflow", "--output_dir", str(out))],
            "MLFLOW_TAGS='team=nlp' (report_to mlflow) is not a JSON object")
    assert not out.exists()
    assert load_train_config(args(root, "--report_to", "tensorboard")).run.report_to == ["tensorboard"]  # not read


def test_trackio_says_its_run_finished_once(tmp_path, monkeypatch):
    """The run was finished, but trackio still held it as its current run: its exit handler finished it again and
    printed a second "Run finished. Uploading logs" after the run's last line."""
    import subprocess

    offline_env(monkeypatch, tmp_path)
    code = ("from shardtune.train.trackers import start_trackers; "
            f"t = start_trackers(['trackio'], {str(tmp_path / 'out')!r}, 'once', {{}}, enabled=True); "
            "t.log({'step': 1, 'loss': 2.5}); t.finish(); print('finished')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Run finished") == 1 and done.stdout.rstrip().endswith("finished"), done.stdout


def test_transformers_5s_project_names_the_trackio_project(root, tmp_path, monkeypatch):
    """Transformers 5's project (the Trackio project of report_to trackio) was refused as a key with no counterpart
    here, and its default huggingface, as a written-out TrainingArguments holds it, dropped."""
    from trackio.sqlite_storage import SQLiteStorage

    from shardtune.train.trackers import start_trackers

    offline_env(monkeypatch, tmp_path)
    cfg = load_train_config(args(root, "--report_to", "trackio", "--project", "myproj"))
    trackers = start_trackers(cfg.run.report_to, tmp_path / "out", "proj-run", cfg.to_flat(), enabled=True,
                              project=cfg.run.project)
    trackers.log({"step": 1, "loss": 2.5})
    trackers.finish()
    assert [row["train/loss"] for row in SQLiteStorage.get_logs("myproj", "proj-run")] == [2.5]
    assert load_train_config(args(root, "--project", "huggingface")).run.project == "huggingface"
    from shardtune.errors import UsageError

    with pytest.raises(UsageError, match="project=myproj set without report_to trackio"):
        load_train_config(args(root, "--project", "myproj"))  # without trackio it would do nothing
    # its Space, Transformers 5's trackio_space_id, is trackio's own environment variable here
    with pytest.raises(UsageError, match="unknown key 'trackio_space_id'; the Space report_to trackio sends to is the "
                                         "environment variable TRACKIO_SPACE_ID here"):
        load_train_config(args(root, "--report_to", "trackio", "--trackio_space_id", "me/space"))


def test_the_mlflow_start_line_says_how_to_browse_the_file_store(tmp_path, monkeypatch, caplog):
    """MLflow 3's own readers (mlflow ui, MlflowClient) refuse the file store the run wrote unless
    MLFLOW_ALLOW_FILE_STORE is set in the user's shell too: the start line named the store's URI alone."""
    import subprocess

    from shardtune.train.trackers import start_trackers

    offline_env(monkeypatch, tmp_path)
    with caplog.at_level("INFO", logger="shardtune"):
        start_trackers(["mlflow"], tmp_path / "out", "browse", {}, enabled=True).finish()
    uri = (tmp_path / "out" / "mlruns").resolve().as_uri()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("report_to mlflow")]
    assert line.endswith(f"at {uri} (browse it: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri})")
    read = ("from mlflow.tracking import MlflowClient; "
            f"print(MlflowClient(tracking_uri={uri!r}).search_experiments()[0].name)")
    for allow, found in (("", "MLFLOW_ALLOW_FILE_STORE=true"), ("true", "shardtune")):  # the hint is needed
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"} | (
            {"MLFLOW_ALLOW_FILE_STORE": allow} if allow else {})
        done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, env=env, timeout=120)
        assert found in done.stdout + done.stderr


def test_wandb_mode_disabled_says_nothing_is_logged(tmp_path, monkeypatch, caplog):
    """WANDB_MODE=disabled started a run whose line named files in a folder wandb never writes."""
    from shardtune.train.trackers import start_trackers

    offline_env(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with caplog.at_level("INFO", logger="shardtune"):
        trackers = start_trackers(["wandb"], tmp_path / "out", "off", {}, enabled=True)
        trackers.log({"step": 1, "loss": 2.5})
        trackers.finish()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("report_to wandb")]
    assert line == "report_to wandb: disabled by WANDB_MODE=disabled: nothing is logged to W&B (unset it to log)"
    assert not (tmp_path / "out" / "wandb").exists()


def test_wandb_name_names_the_wandb_run_where_run_name_is_unset(tmp_path, monkeypatch):
    """WANDB_NAME, which names the run of a Transformers job that sets no run_name, was overruled by the output
    folder's name; run_name, where given, still names it."""
    from shardtune.train.trackers import start_trackers

    offline_env(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_NAME", "from-env")
    names = []
    for run_name, out in ((None, "out-a"), ("given", "out-b")):
        trackers = start_trackers(["wandb"], tmp_path / out, run_name, {}, enabled=True)
        names.append(trackers.trackers[0].run.name)
        trackers.finish()
    assert names == ["from-env", "given"]


def test_a_second_run_in_one_process_reads_wandb_mode_again(tmp_path, monkeypatch, caplog):
    """The offline settings a run gave wandb stayed for the process's life: a notebook's next run, with WANDB_MODE
    (or a login) set by then, was offline still."""
    from shardtune.train.trackers import start_trackers

    offline_env(monkeypatch, tmp_path)
    start_trackers(["wandb"], tmp_path / "first", "first", {}, enabled=True).finish()  # offline
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with caplog.at_level("INFO", logger="shardtune"):
        start_trackers(["wandb"], tmp_path / "second", "second", {}, enabled=True).finish()
    assert "report_to wandb: disabled by WANDB_MODE=disabled" in caplog.text
