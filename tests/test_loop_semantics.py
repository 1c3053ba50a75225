"""What the training loop records, against what Transformers' Trainer records under the same names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardtune.config import load_train_config
from tests.trainutil import flags, tiny_workspace


@pytest.fixture(autouse=True)
def _restore(restore_logging):
    """These tests run ``train`` in this process."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "loop", rows=100)


def run(root: Path, out: str, *extra: str, callbacks=()) -> list[dict]:
    """A short run of the tiny model (batch 2, no packing); its metrics.jsonl records."""
    from shardtune.train.loop import train

    train(load_train_config(flags("--model_name_or_path", str(root / "model"), "--dataset_name",
                                  str(root / "chat.jsonl"), "--splits", "train", "--max_seq_len", "64",
                                  "--per_device_train_batch_size", "2", "--logging_steps", "1", "--save_strategy",
                                  "no", "--disable_tqdm", "true", "--output_dir", str(root / out), *extra)), callbacks)
    return [json.loads(line) for line in (root / out / "metrics.jsonl").read_text().splitlines()]


def test_the_logged_learning_rate_is_the_one_the_step_used(root):
    """Each record's lr is the rate its step's update was made with, as Transformers' Trainer logs it (it reads the
    rate before stepping the schedule): 2 warm-up steps from 0, then linear decay over 4 steps. It was the next
    step's rate: step 1 of a warm-up from 0 read lr/2 and the last step 0."""

    used = RatesStepped()  # read as optimizer.step() runs: a rate read at on_step_begin missed a schedule stepped
    records = run(root, "lr", "--max_steps", "4", "--learning_rate", "1e-3", "--warmup_steps", "2",  # too early
                  "--lr_scheduler_type", "linear", callbacks=[used])
    logged = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert logged == pytest.approx({1: 0.0, 2: 5e-4, 3: 1e-3, 4: 5e-4})
    assert logged == dict(enumerate(used.lr, start=1))


def test_cosine_with_min_lr_decays_to_its_floor_as_a_trl_recipe_writes_it(root, tmp_path):
    """lr_scheduler_type cosine_with_min_lr with TRL's lr_scheduler_kwargs {min_lr_rate: 0.1} (it was refused, and
    its kwargs): 1 warm-up step from 0, then half a cosine from 1e-3 down to 1e-4 over the other 4 steps, each step's
    rate as the schedule's formula gives it; a DeepSpeed WarmupCosineLR with cos_min_ratio 0.1 runs the same."""
    import math

    records = run(root, "floor", "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs",
                  '{"min_lr_rate": 0.1}', "--max_steps", "5", "--learning_rate", "1e-3", "--warmup_steps", "1")
    logged = {r["step"]: r["lr"] for r in records if "lr" in r}
    floor = {1: 0.0, **{k + 1: 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 1) / 4))) for k in range(1, 5)}}
    assert logged == pytest.approx(floor)
    assert logged[5] > 1e-4 > 0  # the floor is the rate after the last step, not one a step trained at
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": 1, "cos_min_ratio": 0.1, "warmup_type": "linear"}}}))
    records = run(root, "floor-ds", "--deepspeed", str(ds), "--max_steps", "5", "--learning_rate", "1e-3")
    assert {r["step"]: r["lr"] for r in records if "lr" in r} == pytest.approx(floor)


# Transformers' schedules as TRL recipes set them (lr_scheduler_kwargs), with learning_rate 1e-3: the schedule, its
# settings, the warm-up steps, and the rate each step trains at, in units of 1e-3, worked out by hand.
SCHEDULES = {
    # two cosine decays over the 6 steps after warm-up, each 3 steps from 1e-3: 1, (1 + cos(pi/3)) / 2, and
    # (1 + cos(2 pi/3)) / 2, then the rate starts again at 1e-3
    "cosine_with_restarts": ("cosine_with_restarts", {"num_cycles": 2}, 1, [0, 1, 0.75, 0.25, 1, 0.75, 0.25]),
    # a whole wave over the 4 steps after warm-up: (1 + cos(2 pi k/4)) / 2, down to 0 and half way up again
    "cosine-num_cycles": ("cosine", {"num_cycles": 1}, 1, [0, 1, 0.5, 0, 0.5]),
    # 1e-4 + (1e-3 - 1e-4) x (steps left of the 4 after warm-up / 4) ^ 2
    "polynomial": ("polynomial", {"lr_end": 1e-4, "power": 2}, 1, [0, 1, 0.1 + 0.9 * 0.75**2, 0.1 + 0.9 * 0.5**2,
                                                                   0.1 + 0.9 * 0.25**2]),
    # 1e-3 / sqrt((steps since warm-up + 4) / 4) = 2e-3 / sqrt(steps since warm-up + 4)
    "inverse_sqrt": ("inverse_sqrt", {"timescale": 4}, 2, [0, 0.5, 1, 2 / 5**0.5, 2 / 6**0.5, 2 / 7**0.5]),
    # a straight warm-up from 0.5 (warmup_lr_rate) to 1 over the 2 warm-up steps, then a cosine over the 4 steps
    # after them, counted from the first, down to 0.1 (min_lr_rate): 0.1 + 0.9 x (1 + cos(pi k/4)) / 2, k = 1..4
    "cosine_warmup_with_min_lr": ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1, "warmup_lr_rate": 0.5}, 2,
                                  [0.5, 1, *(0.1 + 0.9 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(1, 5))]),
    # 2 warm-up steps from 0.1 (min_lr_ratio) up, 7 - 2 - 3 = 2 stable steps at 1, then a straight decay over 3
    # steps towards 0.1: 0.1 + 0.9 x (1 - k/3)
    "warmup_stable_decay": ("warmup_stable_decay", {"num_decay_steps": 3, "decay_type": "linear",
                                                    "min_lr_ratio": 0.1}, 2, [0.1, 0.55, 1, 1, 1, 0.7, 0.4]),
}


@pytest.mark.parametrize("case", sorted(SCHEDULES))
def test_transformers_schedules_train_at_their_rates_and_resume_exactly(root, case):
    """cosine_with_restarts, polynomial, inverse_sqrt, warmup_stable_decay and cosine_warmup_with_min_lr, and
    cosine's num_cycles, with their lr_scheduler_kwargs (all were refused): each step trains at the rate the
    schedule gives it, and a run resumed from its step-3 checkpoint trains the same later steps, at the same rates
    to the bit and to the same losses, as the run that went on."""
    import shutil

    schedule, settings, warmup, rates = SCHEDULES[case]
    args = ["--lr_scheduler_type", schedule, "--lr_scheduler_kwargs", json.dumps(settings), "--warmup_steps",
            str(warmup), "--max_steps", str(len(rates)), "--learning_rate", "1e-3", "--save_strategy", "steps",
            "--save_steps", "3"]
    used, used_resumed = RatesStepped(), RatesStepped()
    whole = run(root, case, *args, callbacks=[used])
    logged = [r["lr"] for r in whole if "loss" in r]
    assert logged == pytest.approx([1e-3 * rate for rate in rates], rel=1e-9)
    assert used.lr == logged  # the rates the updates were made with, not only the ones logged
    shutil.copytree(root / case, root / f"{case}-resumed")
    resumed = run(root, f"{case}-resumed", *args, "--resume_from_checkpoint",
                  str(root / f"{case}-resumed" / "checkpoints" / "step-3"), callbacks=[used_resumed])
    summary = json.loads((root / f"{case}-resumed" / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps_this_run"]) == (3, len(rates) - 3)
    trained = [(r["step"], r["lr"], r["loss"]) for r in whole if "loss" in r]
    assert [(r["step"], r["lr"], r["loss"]) for r in resumed if "loss" in r] == trained
    assert used_resumed.lr == logged[3:]


class RatesStepped:
    """The learning rate of each optimizer step, read as the step runs (torch's step pre-hook): the rate the update
    is made with, which a schedule stepped too early changes while the logged rate stays as it was."""

    def __init__(self) -> None:
        self.lr: list[float] = []

    def on_train_begin(self, args, state, control, *, optimizer, **kwargs):
        optimizer.register_step_pre_hook(lambda opt, *_: self.lr.append(opt.param_groups[0]["lr"]))


def test_torch_empty_cache_steps_empties_the_device_cache_after_every_nth_step(root, monkeypatch, capsys):
    """Transformers' torch_empty_cache_steps was refused as another tool's key: with 2, a run of 5 steps empties
    the device cache after steps 2 and 4 (unset: never); on CUDA that is one torch.cuda.empty_cache, on a CPU
    nothing. 0 exits 2 naming it, as Transformers refuses it."""
    import torch

    from shardtune.cli import main
    from shardtune.train import loop

    emptied, at = [], []

    class Steps:
        def on_step_begin(self, args, state, control, **kwargs):
            at.append(state.global_step + 1)

    monkeypatch.setattr(loop, "empty_device_cache", lambda device: emptied.append((at[-1], device.type)))
    run(root, "cache", "--max_steps", "5", "--learning_rate", "1e-3", "--torch_empty_cache_steps", "2",
        callbacks=[Steps()])
    assert emptied == [(2, "cpu"), (4, "cpu")]
    emptied.clear()
    run(root, "no-cache", "--max_steps", "2", "--learning_rate", "1e-3", callbacks=[Steps()])
    assert emptied == [] and at[-2:] == [1, 2]
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("emptied"))
    loop.empty_device_cache(torch.device("cpu"))
    assert calls == []
    loop.empty_device_cache(torch.device("cuda"))
    assert calls == ["emptied"]
    assert main(["train", "--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"),
                 "--output_dir", str(root / "never"), "--torch_empty_cache_steps", "0"]) == 2
    assert "torch_empty_cache_steps=0 must be at least 1" in capsys.readouterr().err


def test_the_last_step_is_evaluated_and_saved_when_steps_do_not_divide_max_steps(root):
    """eval_strategy and save_strategy steps act at every eval_steps / save_steps and at the run's last step, as
    Transformers' Trainer does: max_steps 5 with both every 2 evaluates and saves at 2, 4 and 5. The model a run
    ends with went unevaluated (and load_best_model_at_end could not choose it), and a run given more steps
    trained step 5 again from step-4."""
    import shutil

    every_2 = ["--eval_strategy", "steps", "--eval_steps", "2", "--eval_split_ratio", "0.1", "--save_strategy",
               "steps", "--save_steps", "2", "--learning_rate", "1e-3", "--lr_scheduler_type", "constant"]
    records = run(root, "end", "--max_steps", "5", *every_2)
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]
    checkpoints = root / "end" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4", "step-5"]
    assert json.loads((checkpoints / "step-5" / "trainer_state.json").read_text())["step"] == 5

    # More steps carry on from the last one; the resumed run's losses are those of a run of 7 from the start.
    shutil.copytree(root / "end", root / "more")
    resumed = run(root, "more", "--max_steps", "7", *every_2, "--resume_from_checkpoint", "true")
    summary = json.loads((root / "more" / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps_this_run"]) == (5, 2)
    whole = run(root, "seven", "--max_steps", "7", *every_2)
    assert [r["step"] for r in resumed if "loss" in r] == [r["step"] for r in whole if "loss" in r] == [*range(1, 8)]
    assert [r["loss"] for r in resumed if "loss" in r] == pytest.approx([r["loss"] for r in whole if "loss" in r])
    # Trainer.train's metrics by their names: train_loss the mean loss of this run's own steps, epoch fractional.
    trained = {r["step"]: r for r in resumed if "loss" in r}
    assert summary["train_loss"] == pytest.approx((trained[6]["loss"] + trained[7]["loss"]) / 2)
    assert summary["epoch"] == trained[7]["epoch"]
    assert summary["train_runtime"] == summary["wall_s"]
    assert summary["train_steps_per_second"] == pytest.approx(2 / summary["wall_s"])
    seven = json.loads((root / "seven" / "summary.json").read_text())
    assert seven["train_loss"] == pytest.approx(sum(r["loss"] for r in whole if "loss" in r) / 7)


def test_tokens_per_s_leaves_out_evaluations_and_saves(root):
    """A record's tokens_per_s is its steps' throughput: the time of an evaluation or a checkpoint's save (here made
    a second each by a callback) since the last record is not a step's. It was counted: the step after each eval and
    save read a fraction of the others' throughput (161 tokens/s against 4,900 after a 600-row eval)."""
    import time

    class Slow:
        def on_evaluate(self, args, state, control, **kwargs):
            time.sleep(1.0)

        def on_save(self, args, state, control, **kwargs):
            time.sleep(1.0)

    records = run(root, "paused", "--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2",
                  "--eval_split_ratio", "0.1", "--save_strategy", "steps", "--save_steps", "2", callbacks=[Slow()])
    step_3 = next(r for r in records if r["step"] == 3 and "loss" in r)
    # 2 s of eval and save went before step 3; the tiny model's step takes milliseconds
    assert step_3["tokens_per_s"] > step_3["tokens"] / 1.0, step_3


def test_tokens_seen_counts_the_steps_between_records_and_goes_on_after_a_resume(root):
    """At logging_steps 3 a record's tokens are its own step's, so the tokens of the two steps before it were in no
    record (a plot over tokens, or a user adding them up, guessed them). Each record now carries tokens_seen, the
    input tokens of every step so far (Transformers' num_input_tokens_seen), and a checkpoint carries it on."""
    every_step = {r["step"]: r["tokens"] for r in run(root, "seen_each", "--max_steps", "7") if "loss" in r}
    sums = {step: sum(every_step[s] for s in range(1, step + 1)) for step in every_step}
    assert len(set(every_step.values())) > 1  # the steps differ in tokens: a count of one step times 3 is wrong
    sparse = ["--max_steps", "7", "--logging_steps", "3", "--save_strategy", "steps", "--save_steps", "4"]
    logged = {r["step"]: r["tokens_seen"] for r in run(root, "seen_sparse", *sparse) if "loss" in r}
    assert logged == {step: sums[step] for step in (1, 3, 6, 7)}  # the first step too (logging_first_step)
    resumed = run(root, "seen_resumed", *sparse, "--resume_from_checkpoint",
                  str(root / "seen_sparse" / "checkpoints" / "step-4"))
    assert {r["step"]: r["tokens_seen"] for r in resumed if "loss" in r} == {6: sums[6], 7: sums[7]}


WSD = ["--lr_scheduler_type", "warmup_stable_decay", "--max_steps", "5"]


@pytest.mark.parametrize("extra, steps, says", [
    (["--warmup_steps", "50"], 5, "warmup_steps=50 is longer than the run's 5 optimizer steps (max_steps 5): it ends "
     "before its rate reaches learning_rate 5e-05, as it would in Transformers; for more than a trial, set "
     "warmup_steps to at most 5 or give warmup_ratio (a share of the run)"),
    # Its decay began at step 1 at half the rate (stable steps: 5 - 0 - 10 < 0), as in Transformers.
    ([*WSD, "--lr_scheduler_kwargs", '{"num_decay_steps": 10}'], 5, "lr_scheduler_type warmup_stable_decay: "
     "num_decay_steps 10 steps, more than the run's 5 optimizer steps (max_steps 5): its decay starts midway, at a "
     "fraction of learning_rate, or never, as it would in Transformers; for more than a trial, make them fit in 5 "
     "steps"),
    ([*WSD, "--warmup_ratio", "0.5", "--lr_scheduler_kwargs", '{"num_decay_steps": 4}'], 5,
     "warmup_ratio 0.5's 3 + num_decay_steps 4 = 7 steps, more than the run's 5 optimizer steps"),
    ([*WSD, "--lr_scheduler_kwargs", '{"num_decay_steps": 2, "num_stable_steps": 10}'], 5,  # it never decayed
     "num_stable_steps 10 + num_decay_steps 2 = 12 steps, more than the run's 5 optimizer steps"),
    ([*WSD, "--lr_scheduler_kwargs", '{"num_decay_steps": 2, "num_stable_steps": 3}'], 5, None)])
def test_a_schedule_longer_than_the_run_is_said(extra, steps, says):
    """A recipe's warmup_steps 50 kept in a 5-step trial run trained 5 steps at rates from 0 to 4e-6 of a
    learning_rate 5e-5 it never reached, and warmup_stable_decay's phases past the end started its decay midway
    (as Transformers' Trainer does, without a word): said, and run as Transformers runs it (a trial of a recipe
    meant for a longer run is no error)."""
    from shardtune.config import load_train_config
    from shardtune.train.optim import schedule_past_the_end

    cfg = load_train_config(flags("--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "o",
                                  "--max_steps", "5", *extra))
    notes = schedule_past_the_end(cfg.optim, steps, "max_steps 5")
    assert [says in note for note in notes] == ([True] if says else [])


def test_a_trial_of_a_recipe_with_a_longer_warmup_trains_and_says_so(root, capfd):
    """The warning reaches the run's log, and the run trains at the rates Transformers' schedule gives."""
    records = run(root, "long_warmup", "--max_steps", "3", "--warmup_steps", "50", "--learning_rate", "1e-3")
    assert "warmup_steps=50 is longer than the run's 3 optimizer steps (max_steps 3)" in capfd.readouterr().err
    rates = [r["lr"] for r in records if "lr" in r]
    assert rates == pytest.approx([1e-3 * step / 50 for step in range(3)])


class GroupsStepped:
    """The settings of each optimizer step's parameter groups (weight_decay, betas, eps), read as the step runs."""

    def __init__(self) -> None:
        self.groups: list[list[tuple]] = []

    def on_train_begin(self, args, state, control, *, optimizer, **kwargs):
        optimizer.register_step_pre_hook(lambda opt, *_: self.groups.append(
            [(g["weight_decay"], g["betas"], g["eps"]) for g in opt.param_groups]))


def test_optimizer_settings_changed_on_resume_take_effect_as_the_log_says(root):
    """A resume with another weight_decay, adam_beta1 and adam_epsilon logged 'the new value takes effect from
    here', and the checkpoint's optimizer state brought back the old ones: its steps trained with weight_decay 0.
    The resumed steps use the new values (norms and biases still undecayed)."""
    saving = ("--save_strategy", "steps", "--save_steps", "2", "--learning_rate", "1e-3")
    run(root, "settings", "--max_steps", "2", *saving)
    resumed = GroupsStepped()
    run(root, "settings", "--max_steps", "3", *saving, "--resume_from_checkpoint", "true", "--weight_decay", "0.5",
        "--adam_beta1", "0.5", "--adam_epsilon", "1e-3", callbacks=[resumed])
    assert resumed.groups == [[(0.5, (0.5, 0.999), 1e-3), (0.0, (0.5, 0.999), 1e-3)]]
