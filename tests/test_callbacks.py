"""Callbacks: the loop calls them in order with the documented arguments, and they steer it (stop, save)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from shardtune.train.callbacks import load_callback
from tests.trainutil import losses, shardtune_env, write_chat_data

DOC = Path(__file__).resolve().parents[1] / "docs" / "callbacks.md"


@pytest.fixture(autouse=True)
def _restore(restore_logging):
    """These tests run ``train`` in this process."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("callbacks")
    return root, make_model_folder(root / "model"), write_chat_data(root / "chat.jsonl", rows=300)


def config(assets, out: str, *extra: str):
    root, model, data = assets
    return load_train_config(["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                              "--max_seq_len", "64", "--packing", "True", "--max_steps", "6", "--logging_steps", "1",
                              "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2",
                              "--output_dir", str(root / out), *extra])


class Recorder:
    """Records every event; stops the run after step 3 and asks for an extra checkpoint at step 1."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.logged: list[float] = []
        self.records: list[dict] = []  # every record on_log got
        self.saved: list[str] = []

    def on_train_begin(self, args, state, control, *, model, optimizer, plan, info, **kwargs):
        self.events.append(("train_begin", state.step))
        assert plan.strategy == "NO" and info.world_size == 1 and optimizer.param_groups
        assert state.is_world_process_zero and state.is_local_process_zero  # Transformers' callbacks ask these

    def on_step_begin(self, args, state, control, *, micro_batches, **kwargs):
        self.events.append(("step_begin", state.global_step))
        assert len(micro_batches) == 1 and micro_batches[0]["input_ids"].shape[0] == 2  # batch 2, no accumulation

    def on_step_end(self, args, state, control, *, stats, **kwargs):
        self.events.append(("step_end", state.step))
        control.should_save = state.step == 1
        control.should_training_stop = state.step == 3

    def on_log(self, args, state, control, *, logs, **kwargs):
        self.records.append(dict(logs))
        if "loss" in logs or "eval_loss" in logs:
            self.logged.append(logs.get("loss", logs.get("eval_loss")))

    def on_save(self, args, state, control, *, checkpoint, **kwargs):
        self.saved.append(Path(checkpoint).name)

    def on_train_end(self, args, state, control, *, summary, log, **kwargs):
        self.events.append(("train_end", state.step))
        summary["recorded_steps"] = state.step
        log({"note": "from a callback"})  # no step: stamped with the last one, as plots and trackers need


def test_events_arrive_in_order_and_control_steers_the_loop(assets):
    from shardtune.train.loop import train

    recorder = Recorder()
    summary = train(config(assets, "steered"), callbacks=[recorder])
    steps = [("step_begin", 0), ("step_end", 1), ("step_begin", 1), ("step_end", 2), ("step_begin", 2),
             ("step_end", 3)]
    assert recorder.events == [("train_begin", 0), *steps, ("train_end", 3)]
    out = assets[0] / "steered"
    assert summary["steps"] == 3 and summary["recorded_steps"] == 3  # stopped by the callback, not max_steps=6
    assert recorder.saved == ["step-1", "step-2"]  # step 1 asked for by the callback, step 2 by save_steps
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert recorder.logged == losses(out)  # on_log sees exactly what metrics.jsonl holds
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]) == {"step": 3, "note": "from a callback"}
    # on_log gets every record, on_train_end's too (it got none of those: a callback forwarding records missed them)
    assert recorder.records == [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (out / "final" / "config.json").is_file()  # a stopped run still writes final/
    # Stopped by a callback, the run is finished: resumed (as a cluster job resumes), it trains nothing and changes
    # nothing (it retrained step 3 and set final/ and summary.json aside).
    assert summary["stopped_by"] == "callback stop"
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = train(config(assets, "steered", "--resume_from_checkpoint", "true"), callbacks=[Recorder()])
    assert again["steps"] == 3 and {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


class Terminated(Recorder):
    """Sends itself a SIGTERM after step 3 (no save_steps checkpoint there); evaluates every 2 steps."""

    def on_step_end(self, args, state, control, *, stats, **kwargs):
        self.events.append(("step_end", state.step))
        if state.step == 3:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_the_sigterm_checkpoint_and_eval_records_reach_their_events(assets):
    """on_save was not called for the checkpoint a SIGTERM saves, nor on_log for eval records (both documented,
    and Transformers logs eval metrics through on_log)."""
    from shardtune.errors import TrainingStopped
    from shardtune.train.loop import train

    recorder = Terminated()
    try:
        train(config(assets, "terminated", "--eval_strategy", "steps", "--eval_steps", "2", "--eval_split_ratio",
                     "0.1"), callbacks=[recorder])
    except TrainingStopped:
        pass
    out = assets[0] / "terminated"
    assert recorder.saved == ["step-2", "step-3"]  # save_steps at 2, the SIGTERM's at 3
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recorder.logged == [r.get("loss", r.get("eval_loss")) for r in records
                               if "loss" in r or "eval_loss" in r]  # eval records too
    assert records[-1] == {"step": 3, "note": "from a callback"}  # on_train_end's log, at the last step
    assert any("eval_loss" in r for r in records)


def test_the_documented_example_stops_a_run(assets, tmp_path, monkeypatch):
    # The callback class in docs/callbacks.md, named in the config as users name theirs.
    code = re.search(r"```python\n(class StopOnPlateau.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "plateau_hooks.py").write_text(code.replace("patience: int = 20", "patience: int = 1"))
    monkeypatch.syspath_prepend(str(tmp_path))
    from shardtune.train.loop import train

    # A learning rate of 0 leaves the loss flat after step 1: the callback stops the run at step 2.
    summary = train(config(assets, "plateau", "--learning_rate", "0", "--callbacks", "plateau_hooks:StopOnPlateau"))
    assert summary["steps"] == 2


@pytest.mark.parametrize("spec, message", [
    ("nocolon", "callbacks: 'nocolon' is not 'package.module:Class'; name an importable class, e.g. "
                "mypkg.hooks:StopOnPlateau"),
    ("no_such_module_xyz:Cls", "callbacks: cannot import 'no_such_module_xyz' for 'no_such_module_xyz:Cls' (No module "
                               "named 'no_such_module_xyz'); install it or put its folder on PYTHONPATH (every "
                               "process torchrun starts imports it)"),
    ("json:NoSuchClass", "callbacks: json has no class 'NoSuchClass' (for 'json:NoSuchClass')")])
def test_a_bad_callback_name_is_refused_naming_it(spec, message):
    """Each whole message: the entry as the user wrote it, and the part of it that failed."""
    with pytest.raises(UsageError) as exc:
        load_callback(spec)
    assert str(exc.value) == message


def test_a_callback_with_only_an_event_never_called_is_told_where_to_move_it():
    """A plain class whose one event is on_init_end was told it 'has none of the events ...', not that
    on_init_end is never called and that its code belongs in on_train_begin (as a TrainerCallback subclass is)."""
    from shardtune.train.callbacks import CallbackList

    class InitOnly:
        def on_init_end(self, args, state, control, **kwargs):
            pass

    with pytest.raises(UsageError, match=r"InitOnly\.on_init_end would never be called.*move its code to "
                                         r"on_train_begin"):
        CallbackList([InitOnly()], None, None)


def test_a_callback_with_no_events_is_refused_before_a_tracker_writes(assets, tmp_path):
    """A callback class with none of the events was refused (exit 2) after the trackers had written into
    output_dir, so the next run there was refused as 'an earlier run'; the callbacks are checked first."""
    root, model, data = assets
    (tmp_path / "no_events.py").write_text("class NoEvents:\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "shardtune", "train", "--model_name_or_path", str(model),
                           "--dataset_name", str(data), "--output_dir", str(root / "no-events"), "--max_steps", "1",
                           "--report_to", "tensorboard", "--callbacks", "no_events:NoEvents"], cwd=root,
                          env={**shardtune_env(root), "PYTHONPATH": os.pathsep.join(
                              [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "NoEvents" in proc.stderr.strip().splitlines()[-1]
    assert not (root / "no-events").exists()


def test_a_bad_callback_stops_the_command_before_anything_is_written(assets):
    root, model, data = assets
    proc = subprocess.run([sys.executable, "-m", "shardtune", "train", "--model_name_or_path", str(model),
                           "--dataset_name", str(data), "--output_dir", str(root / "bad"), "--callbacks",
                           "no_such_module_xyz:Cls"], cwd=root, env=shardtune_env(root), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "callbacks: cannot import 'no_such_module_xyz'" in proc.stderr
    assert not (root / "bad").exists()


def test_a_transformers_callback_reads_the_config_by_its_trainingarguments_names(assets):
    """A callback written for Transformers reads ``args.output_dir``, ``args.learning_rate``: on shardtune's
    config that raised AttributeError (a traceback, after the training steps, and no final/)."""
    from transformers import TrainerCallback

    from shardtune.train.loop import train

    class ReadsArgs(TrainerCallback):
        seen: dict = {}

        def on_train_end(self, args, state, control, **kwargs):
            self.seen.update(output_dir=args.output_dir, learning_rate=args.learning_rate,
                             max_length=args.max_length, save_steps=args.save_steps)  # max_length: TRL's alias
            with pytest.raises(AttributeError, match="no attribute 'no_such_key'"):
                args.no_such_key

    reader = ReadsArgs()
    out = assets[0] / "reads-args"
    summary = train(config(assets, "reads-args", "--max_steps", "1", "--learning_rate", "3e-4"), callbacks=[reader])
    assert reader.seen == {"output_dir": str(out), "learning_rate": 3e-4, "max_length": 64, "save_steps": 2}
    assert summary["steps"] == 1 and (out / "final" / "config.json").is_file()


def test_a_transformers_callbacks_epoch_events_are_called_and_one_never_called_is_refused(assets, tmp_path):
    """on_epoch_begin/on_epoch_end of a transformers.TrainerCallback were never called (the subclass was accepted,
    its epoch code silently never ran); an event the loop has no place for is refused naming it."""
    from transformers import TrainerCallback

    from shardtune.train.loop import train

    class EachEpoch(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.events.append(("begin", state.epoch, state.step))

        def on_step_begin(self, args, state, control, **kwargs):
            self.events.append(("step_begin", state.epoch, state.step))

        def on_step_end(self, args, state, control, **kwargs):
            self.events.append(("step", state.epoch, state.step))

        def on_epoch_end(self, args, state, control, **kwargs):
            self.events.append(("end", state.epoch, state.step))
            control.should_save = True  # acted on at once, as in Transformers

    root, model, _ = assets
    data = write_chat_data(tmp_path / "twelve.jsonl", rows=12)  # 6 steps of 2 rows an epoch

    def cfg(out):
        return load_train_config(["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits",
                                  "train", "--max_seq_len", "64", "--max_steps", "8", "--per_device_train_batch_size",
                                  "2", "--save_strategy", "no", "--output_dir", str(root / out)])

    each = EachEpoch()
    train(cfg("epochs"), callbacks=[each])
    # max_steps ends the run inside epoch 2: its on_epoch_end still comes, as in Transformers. state.epoch is
    # Transformers' float epoch (it was the whole epochs completed: 0 all through the first epoch)
    # on_step_begin sees the epoch the last step left (it was a step ahead: the sampler's, dealing this step's rows)
    steps = [(event, round(step / 6, 4), step) for done in range(8) for event, step in (("step_begin", done),
                                                                                        ("step", done + 1))]
    assert each.events == [("begin", 0.0, 0), *steps[:12], ("end", 1.0, 6), ("begin", 1.0, 6), *steps[12:],
                           ("end", 1.3333, 8)]
    assert sorted(p.name for p in (root / "epochs" / "checkpoints").iterdir()) == ["step-6", "step-8"]

    class Substep(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            pass

    refused = r"Substep\.on_substep_end would never be called.*move its code to on_step_end"
    with pytest.raises(UsageError, match=refused):
        train(cfg("substep"), callbacks=[Substep()])
    assert not (root / "substep" / "metrics.jsonl").exists()


def test_a_transformers_callback_reads_log_history_and_the_best_checkpoint_from_state(assets):
    """``state.log_history``, ``state.best_metric`` and ``state.best_model_checkpoint``, which Transformers'
    callbacks read, raised AttributeError; log_history holds what metrics.jsonl holds, a resumed run's too."""
    from transformers import TrainerCallback

    from shardtune.train.loop import train

    class ReadsState(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            self.history = [dict(r) for r in state.log_history]
            self.best = (state.best_metric, state.best_model_checkpoint)

    out = assets[0] / "log-history"
    extra = ("--eval_strategy", "steps", "--eval_steps", "2", "--eval_split_ratio", "0.1",
             "--load_best_model_at_end", "true", "--max_steps", "4")
    first = ReadsState()
    train(config(assets, "log-history", *extra), callbacks=[first])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert first.history == records and [r["step"] for r in records] == [1, 2, 2, 3, 4, 4]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    best_step = min(evals, key=evals.get)
    assert first.best == (evals[best_step], str(out / "checkpoints" / f"step-{best_step}"))

    again = ReadsState()  # resumed at step 2: the earlier run's records come back with the checkpoint
    train(config(assets, "log-history", *extra, "--resume_from_checkpoint", str(out / "checkpoints" / "step-2")),
          callbacks=[again])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert again.history == records and [r["step"] for r in records] == [1, 2, 2, 3, 4, 4]


def test_control_should_log_writes_the_step_once(assets):
    """A callback's control.should_log (Transformers' flag) was silently ignored: the step it asked for had no
    record. Now it logs that step once, under any logging_strategy, and a step logged already is not repeated."""
    from shardtune.train.loop import train

    class LogsSome:
        def on_step_end(self, args, state, control, **kwargs):
            control.should_log = state.step in (2, 3)  # 3 is logging_steps' own step: one record, not two

    out = assets[0] / "should-log"
    train(config(assets, "should-log", "--logging_steps", "3", "--max_steps", "4"), callbacks=[LogsSome()])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all("loss" in r for r in records)

    root, model, data = assets
    quiet = load_train_config(["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                               "--max_seq_len", "64", "--packing", "True", "--max_steps", "4", "--logging_strategy",
                               "no", "--per_device_train_batch_size", "2", "--output_dir", str(root / "should-log-no")])
    train(quiet, callbacks=[LogsSome()])
    records = [json.loads(line) for line in (assets[0] / "should-log-no" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3]


def test_flags_set_before_a_step_are_cleared_as_it_begins_as_in_transformers(assets):
    """Transformers' callback handler clears should_log, should_evaluate and should_save as each step begins, so a
    flag set in on_train_begin (or on_save) asks for nothing; here should_save acted after the next step: a
    checkpoint at step 1 that no strategy asked for. A flag set in the step still acts."""
    from shardtune.train.loop import train

    class SetsEarly:
        def on_train_begin(self, args, state, control, **kwargs):
            control.should_save = control.should_log = True

        def on_step_end(self, args, state, control, **kwargs):
            control.should_log = state.step == 2

    root, model, data = assets
    train(load_train_config(["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                             "--max_seq_len", "64", "--packing", "True", "--max_steps", "3", "--logging_strategy",
                             "no", "--save_strategy", "no", "--per_device_train_batch_size", "2", "--output_dir",
                             str(root / "flags-early")]), callbacks=[SetsEarly()])
    records = [json.loads(line) for line in (root / "flags-early" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2]
    assert not (root / "flags-early" / "checkpoints").exists() or \
        not any((root / "flags-early" / "checkpoints").iterdir())


def test_logging_first_step_logs_step_1_under_logging_strategy_no(assets):
    """logging_first_step true with logging_strategy no was accepted and did nothing (no record at all), where
    Transformers' Trainer logs the first step whatever the strategy."""
    from shardtune.train.loop import train

    root, model, data = assets
    cfg = load_train_config(["--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
                             "--max_seq_len", "64", "--packing", "True", "--max_steps", "3", "--logging_strategy",
                             "no", "--logging_first_step", "true", "--per_device_train_batch_size", "2",
                             "--output_dir", str(root / "first-step-no")])
    train(cfg)
    records = [json.loads(line) for line in (root / "first-step-no" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and records[0]["loss"] > 0


def test_every_event_gets_the_model_optimizer_scheduler_and_tokenizer_as_in_transformers(assets):
    """Transformers hands every event model, processing_class, optimizer and lr_scheduler; here on_evaluate,
    on_save and on_log got None for them (a callback generating samples on_evaluate failed on model.generate).
    A callback whose event names only its own arguments is still called with just those."""
    from transformers import TrainerCallback

    from shardtune.train.loop import train

    class UsesModel(TrainerCallback):
        seen: list = []

        def on_evaluate(self, args, state, control, model=None, processing_class=None, **kwargs):
            self.seen.append((type(model).__name__, processing_class.eos_token_id is not None))

        def on_save(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            self.seen.append((bool(optimizer.param_groups), lr_scheduler is state.scheduler))

    class Strict:
        saved: list = []

        def on_save(self, args, state, control, checkpoint):  # no **kwargs: the documented argument only
            self.saved.append(Path(checkpoint).name)

    uses, strict = UsesModel(), Strict()
    train(config(assets, "common-kwargs", "--max_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2",
                 "--eval_split_ratio", "0.1"), callbacks=[uses, strict])
    assert uses.seen == [("LlamaForCausalLM", True), (True, True)]
    assert strict.saved == ["step-2"]


def test_a_run_early_stopping_ends_logs_its_last_step(assets, capsys):
    """logging_steps and the last step are logged; a run early stopping ended at step 4 (not a multiple of
    logging_steps 3) had no record of its last step, where a callback's stop or max_steps logs it. Its line said
    'for 1 evaluations'."""
    from shardtune.train.loop import train

    out = assets[0] / "early-last"
    summary = train(config(assets, "early-last", "--logging_steps", "3", "--eval_strategy", "steps", "--eval_steps",
                           "2", "--eval_split_ratio", "0.1", "--learning_rate", "0", "--early_stopping_patience", "1"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["stopped_by"] == "early stopping" and summary["steps"] == 4
    assert [(r["step"], "loss" in r) for r in records] == [(1, True), (2, False), (3, True), (4, False), (4, True)]
    assert "has not improved on" in (err := capsys.readouterr().err) and " for 1 evaluation (early_stopping" in err


def test_every_event_gets_the_train_and_eval_dataloaders_as_in_transformers(assets):
    """Transformers hands every event train_dataloader and eval_dataloader; here they were never given (a callback
    reading len(train_dataloader) or the eval batches got None and failed). The train loader yields this
    rank's micro-batches of the epoch as the steps train them, and reading it does not move the run's place."""
    import torch
    from transformers import TrainerCallback

    from shardtune.train.loop import train
    from shardtune.train.loss import num_targets

    class ReadsLoaders(TrainerCallback):
        def __init__(self):
            self.trained, self.lengths, self.loaded, self.eval_targets, self.eval_tokens = [], set(), [], None, None

        def on_step_begin(self, args, state, control, *, micro_batches, **kwargs):
            self.trained += [b["input_ids"] for b in micro_batches]

        def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
            self.lengths.add(len(train_dataloader))
            if state.step == 1:  # the whole epoch, read in the middle of the run
                self.loaded = [b["input_ids"] for b in train_dataloader]

        def on_evaluate(self, args, state, control, metrics=None, eval_dataloader=None, **kwargs):
            self.eval_targets = sum(num_targets(b["labels"]) for b in eval_dataloader)
            self.eval_tokens = metrics["eval_tokens"]

    reads = ReadsLoaders()
    summary = train(config(assets, "loaders", "--max_steps", "3", "--gradient_accumulation_steps", "2",
                           "--eval_strategy", "steps", "--eval_steps", "3", "--eval_split_ratio", "0.1"),
                    callbacks=[reads])
    assert summary["steps"] == 3 and len(reads.trained) == 6  # 3 steps of 2 micro-batches
    (per_epoch,) = reads.lengths
    assert per_epoch == len(reads.loaded) > 6 and per_epoch % 2 == 0  # micro-batches of the epoch
    # the loader's first micro-batches are the ones steps 1-3 trained, step 2 and 3 too (reading it moved nothing)
    assert all(torch.equal(a, b) for a, b in zip(reads.trained, reads.loaded[:6], strict=True))
    assert reads.eval_targets == reads.eval_tokens > 0  # the eval loader holds the rows the evaluation scored


class CutsEpochs:
    """Ends each epoch after its second step (should_epoch_stop); records the events, and whether each epoch's first
    step trained the first micro-batch of that epoch's order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.first_of_epoch = None
        self.began_at_the_start: list[bool] = []

    def on_epoch_begin(self, args, state, control, *, train_dataloader, **kwargs):
        self.events.append(("epoch_begin", state.step, state.epoch))
        self.first_of_epoch = next(iter(train_dataloader))["input_ids"]

    def on_step_begin(self, args, state, control, *, micro_batches, **kwargs):
        if self.first_of_epoch is not None:
            self.began_at_the_start.append(bool((micro_batches[0]["input_ids"] == self.first_of_epoch).all()))
            self.first_of_epoch = None

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.step, state.epoch))
        control.should_epoch_stop = state.step % 2 == 0

    def on_epoch_end(self, args, state, control, **kwargs):
        self.events.append(("epoch_end", state.step, state.epoch))


def test_should_epoch_stop_goes_on_with_the_next_epoch_and_resumes_there(assets):
    """control.should_epoch_stop (Transformers' flag) was ignored: the epoch ran on. As in Transformers it now ends
    the epoch (its end's log, evaluation and checkpoint) and training goes on at the next epoch's first step, for
    num_train_epochs epochs; a checkpoint saved there resumes to the same losses."""
    from shardtune.train.loop import train

    epochs = ["--max_steps", "-1", "--num_train_epochs", "3"]  # save_steps 2: each epoch's last step
    cuts = CutsEpochs()
    summary = train(config(assets, "epoch-stop", *epochs), callbacks=[cuts])
    out = assets[0] / "epoch-stop"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    at = {r["step"]: r["epoch"] for r in records}  # state.epoch: Transformers' float, as metrics.jsonl has it
    assert cuts.events == [(event, step, epoch) for e in range(3) for event, step, epoch in (
        ("epoch_begin", 2 * e, e), ("step_end", 2 * e + 1, at[2 * e + 1]), ("step_end", 2 * e + 2, at[2 * e + 2]),
        ("epoch_end", 2 * e + 2, e + 1))]
    assert cuts.began_at_the_start == [True, True, True]  # not the epoch's third step
    assert summary["steps"] == 6 and summary["epochs"] == 3 and summary["stopped_by"] == "callback stop"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    # Transformers' float epoch: each epoch's first step counts from its start
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [int(r["epoch"]) for r in records] == [0, 0, 1, 1, 2, 2]
    assert [r["epoch"] % 1 for r in records] == pytest.approx([records[0]["epoch"], records[1]["epoch"]] * 3)

    resumed = CutsEpochs()
    train(config(assets, "epoch-stop", *epochs, "--resume_from_checkpoint", str(out / "checkpoints" / "step-2")),
          callbacks=[resumed])
    assert resumed.events[0] == ("epoch_begin", 2, 1) and resumed.began_at_the_start == [True, True]
    assert losses(out)[2:] == pytest.approx([r["loss"] for r in records][2:], rel=1e-5)


def test_an_evaluation_shows_a_bar_of_its_batches_unless_disable_tqdm(assets, capsys):
    """An evaluation showed nothing until its result: on a large eval split, minutes of a still training bar. It
    now has a bar of its batches, as in Transformers, that goes when done; disable_tqdm hides it too. (Rank 0's
    alone on 2 processes: tests/test_eval_loss.py.)"""
    from shardtune.train.loop import train

    class Batches:
        seen: list[int] = []

        def on_evaluate(self, args, state, control, *, eval_dataloader, **kwargs):
            self.seen.append(len(eval_dataloader))

    evaluated = ("--eval_strategy", "steps", "--eval_steps", "3", "--eval_split_ratio", "0.1",
                 "--per_device_eval_batch_size", "3", "--save_steps", "6", "--predict_memory", "false")
    capsys.readouterr()
    train(config(assets, "eval-bar", *evaluated), callbacks=[Batches()])
    totals = re.findall(r"(?:^|[\r\n])eval: +\d+%\|[^|]*\| \d+/(\d+) ", capsys.readouterr().err)  # not tokenising's
    assert len(Batches.seen) == 2 and Batches.seen[0] > 1
    assert totals and set(totals) == {str(Batches.seen[0])}  # this rank's eval batches
    train(config(assets, "eval-no-bar", *evaluated, "--disable_tqdm", "true"))
    assert not re.search(r"(?:^|[\r\n])eval: +\d+%\|", capsys.readouterr().err)


class FailsAtStep2:
    """A callback with a bug: raises in on_step_end at step 2."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise ValueError("my bug")


class ReadsTotalFlos:
    """Reads a TrainerState attribute shardtune's state lacks, with no counterpart here."""

    def on_train_begin(self, args, state, control, **kwargs):
        print(state.total_flos)


class ReadsArgsToDict:
    """Calls TrainingArguments.to_dict, as W&B-style callbacks do; shardtune's args has to_flat."""

    def on_train_begin(self, args, state, control, **kwargs):
        print(args.to_dict())


@pytest.mark.parametrize("callback, error, message", [
    (FailsAtStep2, "TrainingStopped", "callback tests.test_callbacks:FailsAtStep2.on_step_end raised ValueError: my "
                                      "bug at step 2 (its traceback is above); fix it, or leave it out of callbacks"),
    (ReadsTotalFlos, "UsageError", "callbacks: tests.test_callbacks:ReadsTotalFlos.on_train_begin reads "
                                   "state.total_flos, which shardtune's state does not have (Transformers' "
                                   "TrainerState does); use one of state.global_step, epoch, max_steps, "
                                   "num_train_epochs, log_history, best_metric, best_model_checkpoint, "
                                   "num_input_tokens_seen, is_world_process_zero, is_local_process_zero "
                                   "(docs/callbacks.md)"),
    (ReadsArgsToDict, "UsageError", "callbacks: tests.test_callbacks:ReadsArgsToDict.on_train_begin reads "
                                    "args.to_dict, which shardtune's args does not have (Transformers' "
                                    "TrainingArguments does); use args.to_flat() (every key by its flat name) "
                                    "(docs/callbacks.md)")])
def test_an_error_inside_a_callback_names_the_callback_and_its_event(assets, callback, error, message, capsys):
    """A callback that raised mid-run gave a traceback from inside the loop and exit 1, naming neither the callback
    nor the event; one reading a Transformers attribute shardtune lacks, an AttributeError traceback. Now: the
    callback (module:Class), its event and the step, with its own frames logged; a missing attribute is bad input
    (exit 2) with what to read instead."""
    from shardtune.train.loop import train

    with pytest.raises(Exception) as exc:
        train(config(assets, f"fails-{callback.__name__}", "--max_steps", "3"), callbacks=[callback()])
    assert type(exc.value).__name__ == error and str(exc.value) == message
    if error == "UsageError":
        assert exc.value.exit_code == 2
    else:  # its traceback, from the callback's own frame on
        logged = capsys.readouterr().err
        assert f'Traceback (most recent call last):\n  File "{__file__}"' in logged
        assert "loop.py" not in logged and 'raise ValueError("my bug")\nValueError: my bug' in logged


def test_a_callback_is_named_by_its_files_path(assets, tmp_path, monkeypatch):
    """``callbacks: [hooks.py:StopAt2]``, a file beside the recipe, failed with a TypeError traceback from importlib
    (a relative import without a package); the class is now made from that file, and a missing file is named."""
    from shardtune.train.loop import train

    (tmp_path / "my hooks").mkdir()
    (tmp_path / "my hooks" / "stop_hooks.py").write_text(
        "class StopAt2:\n    def on_step_end(self, args, state, control, **kwargs):\n"
        "        control.should_training_stop = state.global_step == 2\n")
    monkeypatch.chdir(tmp_path)  # a relative path reads from the folder the command runs in
    summary = train(config(assets, "by-path", "--callbacks", "my hooks/stop_hooks.py:StopAt2"))
    assert summary["steps"] == 2 and summary["stopped_by"] == "callback stop"
    with pytest.raises(UsageError) as exc:
        load_callback("hooks/missing.py:StopAt2")
    assert str(exc.value) == (f"callbacks: 'hooks/missing.py:StopAt2' names the file hooks/missing.py, which does not "
                              f"exist (from {tmp_path}); give the path of your .py file, or an importable module, "
                              f"mypkg.hooks:StopOnPlateau")


def test_a_callback_class_passed_in_code_is_made_as_trainer_makes_it(assets):
    """``train(cfg, callbacks=[StopAt2])``, a class as Transformers' Trainer takes one, had its events called
    unbound: a TypeError at the first event, after the model was built. The class is now made with no arguments
    (the run stops at step 2, as an instance would stop it); one that cannot be made is refused before the run."""
    from shardtune.train.loop import train

    class StopAt2:
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    summary = train(config(assets, "class-given"), callbacks=[StopAt2])
    assert summary["steps"] == 2 and summary["stopped_by"] == "callback stop"

    class NeedsPatience(StopAt2):
        def __init__(self, patience):
            self.patience = patience

    with pytest.raises(UsageError) as exc:
        train(config(assets, "class-refused"), callbacks=[NeedsPatience])
    assert str(exc.value).startswith(
        "callbacks: test_a_callback_class_passed_in_code_is_made_as_trainer_makes_it.<locals>.NeedsPatience failed as "
        "it was made, NeedsPatience() (TypeError: ")
    assert str(exc.value).endswith("a callback class passed to train() is made as NeedsPatience(): give its "
                                   "arguments defaults (or read them from the environment), or pass an instance in "
                                   "code (train(cfg, [NeedsPatience(...)]))")
    assert not (assets[0] / "class-refused").exists()


def test_a_transformers_on_log_reads_learning_rate(assets):
    """A callback written for Transformers reads ``logs["learning_rate"]`` in on_log (Trainer's name; shardtune's
    record had only ``lr``): a KeyError stopped the run at the first logged step. Each step's record has it, the
    rate the step used, in metrics.jsonl and state.log_history too."""
    from transformers import TrainerCallback

    from shardtune.train.loop import train

    class LearningRates(TrainerCallback):
        def __init__(self):
            self.rates: list[tuple[int, float]] = []
            self.used: dict[int, float] = {}

        def on_step_end(self, args, state, control, *, stats, **kwargs):
            self.used[state.global_step] = stats.lr

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                self.rates.append((state.global_step, logs["learning_rate"]))

    rates = LearningRates()
    train(config(assets, "learning-rate", "--max_steps", "4", "--warmup_steps", "2"), callbacks=[rates])
    assert rates.rates == list(rates.used.items()) and [s for s, _ in rates.rates] == [1, 2, 3, 4]
    assert rates.rates[0][1] < rates.rates[1][1]  # warming up: the rate of each step, not one number
    records = [json.loads(line) for line in (assets[0] / "learning-rate" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["learning_rate"]) for r in records if "loss" in r] == rates.rates


def test_an_on_log_that_edits_its_logs_leaves_log_history_as_metrics_jsonl_has_it(assets):
    """A callback's on_log that edits its ``logs`` (pops a key, rounds one, as Transformers' own callbacks do) edited
    state.log_history with it, the same dict, and so the checkpoint's copy a resumed run reads back. As in
    Transformers, log_history keeps the record as it was logged."""
    from transformers import TrainerCallback

    from shardtune.train.loop import train

    class EditsLogs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logs.pop("grad_norm", None)
            if "loss" in logs:
                logs["loss"] = round(logs["loss"], 1)

        def on_train_end(self, args, state, control, **kwargs):
            self.history = [dict(r) for r in state.log_history]

    edits = EditsLogs()
    train(config(assets, "edits-logs", "--max_steps", "2", "--save_steps", "1"), callbacks=[edits])
    out = assets[0] / "edits-logs"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert edits.history == records and all("grad_norm" in r for r in records if "loss" in r)
    saved = json.loads((out / "checkpoints" / "step-1" / "trainer_state.json").read_text())["log_history"]
    assert saved == records[:1]
