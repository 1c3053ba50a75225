"""load_best_model_at_end, metric_for_best_model, greater_is_better, early stopping, eval_on_start and NEFTune."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardtune.config import load_train_config
from shardtune.errors import UsageError
from tests.trainutil import flags, tiny_workspace

LORA = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj"]
# Eval and save every 2 steps; the eval loss falls as training goes on, so with greater_is_better true the first
# evaluation (step 2) is the "best" and every later one a non-improvement: a run whose best is not its last step.
# A constant learning rate: the resumed test stops a run at max_steps 4, and a schedule would depend on it.
WATCH = ["--eval_strategy", "steps", "--eval_steps", "2", "--save_steps", "2", "--eval_split_ratio", "0.1",
         "--load_best_model_at_end", "true", "--greater_is_better", "true", "--early_stopping_patience", "2",
         "--save_total_limit", "1", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", *LORA]


def args(root: Path, out: str, *extra: str) -> list[str]:
    return flags("--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "chat.jsonl"),
                 "--splits", "train", "--max_seq_len", "64", "--packing", "True", "--max_steps", "20",
                 "--per_device_train_batch_size", "2", "--logging_steps", "1", "--output_dir", str(root / out),
                 *extra)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny_workspace(tmp_path_factory, "best", rows=300)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


@pytest.mark.parametrize("extra, message", [
    (["--load_best_model_at_end", "true"], "compare evaluations: set eval_strategy"),
    (["--load_best_model_at_end", "true", "--eval_strategy", "steps", "--save_strategy", "epoch"],
     "needs save_strategy equal to eval_strategy (they are epoch and steps)"),
    (["--load_best_model_at_end", "true", "--eval_strategy", "steps", "--eval_steps", "3", "--save_steps", "4"],
     "save_steps (4) to be a multiple of eval_steps (3)"),
    (["--metric_for_best_model", "accuracy", "--early_stopping_patience", "1", "--eval_strategy", "steps"],
     "metric_for_best_model='accuracy' is not a metric evaluation writes; use one of eval_loss, eval_perplexity"),
    (["--greater_is_better", "true"], "which only load_best_model_at_end, early_stopping_patience and "
                                      "lr_scheduler_type reduce_lr_on_plateau use"),
    (["--early_stopping_patience", "0", "--eval_strategy", "steps"], "early_stopping_patience=0 must be at least 1"),
    (["--neftune_noise_alpha", "-1"], "neftune_noise_alpha=-1.0 must be positive"),
    # Transformers' save_strategy best: refused with what gives the same best model here
    (["--eval_strategy", "steps", "--save_strategy", "best"], "save_strategy=best: Transformers' saving only on a "
                                                              "new best is not done here; save on the eval steps"),
])
def test_settings_that_cannot_work_are_refused(root, extra, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_train_config(args(root, "refused", *extra))


class AdapterAtTrainEnd:
    """A callback keeping the adapter weights the model holds when ``on_train_end`` is called."""

    def on_train_end(self, args, state, control, *, model, **kwargs):
        from peft import get_peft_model_state_dict

        self.adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.fixture(scope="module")
def watched(root):
    """The run of the next test: (its output_dir, its summary, the weights its on_train_end saw)."""
    from shardtune.train.loop import train
    from tests.trainutil import logging_restored

    seen = AdapterAtTrainEnd()
    with logging_restored():
        summary = train(load_train_config(args(root, "watched", *WATCH, "--eval_on_start", "true")), callbacks=[seen])
    return root / "watched", summary, seen.adapter


def test_early_stopping_keeps_the_best_checkpoint_and_final_holds_it(root, watched):
    """eval_on_start gives a step-0 baseline that is not counted (counted, it would be the "best" and stop the run
    at step 4). Evaluations at 2 (best), 4 and 6 (no improvement: patience 2) stop the run at step 6 of 20;
    save_total_limit 1 keeps step-6 and, beyond the limit, the best step-2, whose weights final/ holds. A callback's
    on_train_end sees them too, as Transformers' Trainer loads the best before on_train_end (it saw step 6's)."""
    from shardtune.train.export import export_checkpoint

    out, summary, at_train_end = watched
    evals = [r for r in records(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 6]
    assert evals[1]["eval_loss"] > evals[2]["eval_loss"] > evals[3]["eval_loss"]  # it learns: step 2 is "best"
    assert max(r["step"] for r in records(out) if "loss" in r) == 6
    assert summary["stopped_by"] == "early stopping" and summary["steps"] == 6
    assert (summary["best_step"], summary["best_metric"], summary["final_step"]) == (2, evals[1]["eval_loss"], 2)
    assert summary["best_model_checkpoint"].endswith("checkpoints/step-2")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-6"]
    export_checkpoint(out / "checkpoints" / "step-2", root / "step2")
    export_checkpoint(out / "checkpoints" / "step-6", root / "step6")
    final, best, last = adapter(out / "final"), adapter(root / "step2"), adapter(root / "step6")
    assert all(torch.equal(final[k], best[k]) for k in best)
    assert not all(torch.equal(final[k], last[k]) for k in last)
    assert final.keys() == at_train_end.keys() and all(torch.equal(final[k], at_train_end[k]) for k in final)


def test_a_resumed_run_keeps_the_best_and_the_patience_count(root, watched, restore_logging):
    """Stopped at step 4 (the best at step 2, one evaluation without improvement), resumed with max_steps 20: the
    next evaluation (step 6) is the second without improvement, so it stops there with step 2's weights, as the
    run above did without the interruption."""
    from shardtune.train.loop import train

    out = root / "resumed"
    train(load_train_config(args(root, "resumed", *WATCH, "--max_steps", "4")))
    state = json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert (state["best"]["checkpoint_step"], state["best"]["evals_without_improvement"]) == (2, 1)
    shutil.rmtree(out / "final")
    summary = train(load_train_config(args(root, "resumed", *WATCH, "--resume_from_checkpoint", "true")))
    assert (summary["stopped_by"], summary["steps"], summary["best_step"]) == ("early stopping", 6, 2)
    final, reference = adapter(out / "final"), adapter(root / "watched" / "final")
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_a_resume_into_another_output_dir_loads_the_best_from_the_run_it_came_from(root, watched, restore_logging):
    """Run A stops at step 4 (best: step 2); run B resumes A's step-4 in an empty output_dir, trains to step 6,
    then again (its own step-6) to 8. The best checkpoint was looked for in B's folder, where it never was: B
    crashed with a FileNotFoundError after training, without final/. It is A's step-2 now, as summary.json says,
    and final/ holds its weights."""
    from shardtune.train.loop import train

    train(load_train_config(args(root, "fromA", *WATCH, "--max_steps", "4")))
    patient = [*WATCH, "--early_stopping_patience", "5"]
    train(load_train_config(args(root, "intoB", *patient, "--max_steps", "6", "--resume_from_checkpoint",
                                 str(root / "fromA" / "checkpoints" / "step-4"))))
    shutil.rmtree(root / "intoB" / "final")
    summary = train(load_train_config(args(root, "intoB", *patient, "--max_steps", "8", "--resume_from_checkpoint",
                                           "true")))
    assert (summary["stopped_by"], summary["steps"], summary["best_step"]) == ("completed", 8, 2)
    assert summary["best_model_checkpoint"] == str(root / "fromA" / "checkpoints" / "step-2")
    final, reference = adapter(root / "intoB" / "final"), adapter(root / "watched" / "final")
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_a_resume_that_changes_the_metric_starts_the_best_afresh(root, restore_logging):
    """Saved at step 4 choosing by eval_loss (higher is better: the best is step 2, one evaluation without
    improvement), resumed choosing by eval_perplexity, lower is better: the checkpoint's best loss was compared with
    perplexities (exp(loss) > loss: never an improvement), so step 6 stopped the run early with step 2's weights.
    The new choice starts afresh: perplexity falls at 6 and 8, and the run completes with step 8 its best."""
    from shardtune.train.loop import train

    out = root / "remetric"
    train(load_train_config(args(root, "remetric", *WATCH, "--max_steps", "4")))
    summary = train(load_train_config(args(root, "remetric", *WATCH, "--max_steps", "8", "--resume_from_checkpoint",
                                           "true", "--metric_for_best_model", "eval_perplexity",
                                           "--greater_is_better", "false")))
    evals = [r["eval_perplexity"] for r in records(out) if "eval_perplexity" in r]
    assert evals[-2] > evals[-1]  # it learns: step 8 is the best of the resumed run
    assert (summary["stopped_by"], summary["steps"], summary["best_step"]) == ("completed", 8, 8)
    assert summary["best_metric"] == evals[-1]


def test_final_keeps_an_evaluated_last_step_that_beats_the_best_checkpoint(root, restore_logging):
    """Evaluations at 2, 4 and 6, saves at 4; the eval loss falls, but an early_stopping_threshold no fall reaches
    counts 4 and 6 as no improvement, so the run stops early at step 6, which saved nothing. Its weights evaluated
    better than the best checkpoint's (step 4), yet final/ was loaded from step 4: load_best_model_at_end wrote a
    worse model than the run ended with. final/ now holds step 6's weights, as the same run without it does."""
    from shardtune.train.loop import train

    stop = [*WATCH, "--greater_is_better", "false", "--save_steps", "4", "--save_total_limit", "2",
            "--early_stopping_threshold", "100"]
    summary = train(load_train_config(args(root, "lastbest", *stop)))
    evals = [r["eval_loss"] for r in records(root / "lastbest") if "eval_loss" in r]
    assert evals[0] > evals[1] > evals[2]
    assert (summary["stopped_by"], summary["steps"], summary["best_step"]) == ("early stopping", 6, 4)
    assert summary["final_step"] == 6  # summary.json says which weights final/ holds, not only the log
    train(load_train_config(args(root, "lastplain", *stop, "--load_best_model_at_end", "false")))
    final, last = adapter(root / "lastbest" / "final"), adapter(root / "lastplain" / "final")
    assert all(torch.equal(final[k], last[k]) for k in last)


@pytest.mark.parametrize("greater_is_better", [False, True])
def test_early_stopping_counts_evaluations_as_transformers_callback_does(greater_is_better):
    """early_stopping_threshold 0.01 and an eval loss falling 0.006 an evaluation: Transformers' EarlyStoppingCallback
    compares each evaluation with the best so far, which every better evaluation becomes, so no evaluation here
    resets patience. shardtune kept the best where it last beat it by the threshold, so every second evaluation
    (0.012 below it) reset patience and a recipe ran on where Transformers stopped it."""
    from types import SimpleNamespace

    from transformers import EarlyStoppingCallback

    from shardtune.train.best import Best

    sign = -1 if greater_is_better else 1
    values = [sign * v for v in (1.0, 0.994, 0.988, 0.982, 0.976, 0.95, 0.951, 0.9, 0.8999)]
    theirs, state = EarlyStoppingCallback(early_stopping_patience=100, early_stopping_threshold=0.01), \
        SimpleNamespace(best_metric=None)
    args = SimpleNamespace(greater_is_better=greater_is_better)
    ours = Best(metric="eval_loss", greater_is_better=greater_is_better, threshold=0.01)
    counts = []
    for value in values:
        theirs.check_metric_value(args, state, None, value)  # on_evaluate, then the Trainer updates its best
        if state.best_metric is None or (value > state.best_metric if greater_is_better else value < state.best_metric):
            state.best_metric = value
        ours.on_evaluate({"eval_loss": value})
        counts.append((ours.evals_without_improvement, ours.eval_value))
        assert counts[-1] == (theirs.early_stopping_patience_counter, state.best_metric), (value, counts)
    assert [count for count, _ in counts] == [0, 1, 2, 3, 4, 0, 1, 0, 1]


def test_neftune_noises_training_embeddings_only_within_its_bound():
    from torch import nn

    from shardtune.train.build import add_neftune_noise

    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.get_input_embeddings = lambda: model.embed
    ids = torch.randint(0, 50, (2, 8))
    plain = model.embed(ids).detach()
    add_neftune_noise(model, alpha=5.0)
    noisy = model.embed(ids).detach()
    bound = 5.0 / (8 * 16) ** 0.5
    assert 0.5 * bound < (noisy - plain).abs().max() <= bound
    model.eval()
    assert torch.equal(model.embed(ids), plain)


def test_neftune_noise_alpha_reaches_the_trained_model(root):
    """--neftune_noise_alpha is wired to the model the run trains: its input embeddings are noisy in training, by
    at most alpha / sqrt(seq_len x hidden) and, over 64 x hidden uniform draws, more than half that (the alpha
    given, not another), and clean in evaluation."""
    from shardtune.train.loop import train
    from tests.trainutil import logging_restored

    seen = {}

    class Look:
        def on_train_begin(self, args, state, control, *, model, **kwargs) -> None:
            embed, ids = model.get_input_embeddings(), torch.randint(0, 100, (1, 64))
            with torch.no_grad():
                seen["noisy"], seen["again"] = embed(ids), embed(ids)
                model.eval()
                seen["clean"], seen["hidden"] = embed(ids), embed.weight.shape[1]
                model.train()

    with logging_restored():
        train(load_train_config(args(root, "neftune", "--neftune_noise_alpha", "5", "--max_steps", "1",
                                     "--save_strategy", "no")), callbacks=[Look()])
    bound = 5 / (64 * seen["hidden"]) ** 0.5
    assert 0.5 * bound < (seen["noisy"] - seen["clean"]).abs().max() <= bound
    assert not torch.equal(seen["noisy"], seen["again"])  # drawn afresh for each forward


def test_the_summary_names_the_best_checkpoint_when_it_is_the_last(root, restore_logging):
    """summary.json named best_model_checkpoint only when final/ was loaded from an earlier checkpoint: where the
    last step was the best, the key was missing (a script reading it failed on the run that went best)."""
    from shardtune.train.loop import train

    out = root / "best-last"
    summary = train(load_train_config(args(root, "best-last", *WATCH, "--max_steps", "2")))
    assert (summary["steps"], summary["best_step"]) == (2, 2)
    assert summary["best_model_checkpoint"] == str(out / "checkpoints" / "step-2")
    assert json.loads((out / "summary.json").read_text())["best_model_checkpoint"] == str(out / "checkpoints" /
                                                                                          "step-2")
    # and the last evaluation, which was only in metrics.jsonl: a script comparing runs read one file per run
    evals = [r for r in records(out) if "eval_loss" in r]
    written = json.loads((out / "summary.json").read_text())
    assert evals and (written["eval_loss"], written["eval_perplexity"], written["eval_step"]) == (
        evals[-1]["eval_loss"], evals[-1]["eval_perplexity"], evals[-1]["step"]) and evals[-1]["step"] == 2


# reduce_lr_on_plateau, its arguments as a Transformers recipe hands them on: a threshold of half the best loss, which
# no evaluation here reaches, so the rate is cut after every second evaluation without improvement.
PLATEAU = ["--eval_strategy", "steps", "--eval_steps", "2", "--save_steps", "2", "--eval_split_ratio", "0.1",
           "--learning_rate", "3e-3", "--lr_scheduler_type", "reduce_lr_on_plateau",
           "--lr_scheduler_kwargs", '{"factor": 0.5, "patience": 1, "threshold": 0.5}', *LORA]


def plateau_rates(out: Path, **settings) -> tuple[list[float], list[float]]:
    """The rate each logged step trained at, and the rates torch's ReduceLROnPlateau gives the same steps when fed
    the run's logged eval losses after the steps that evaluated (as Transformers' Trainer feeds it)."""
    logged = records(out)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **settings)
    trained, expected = [], []
    for record in logged:
        if "eval_loss" in record:
            reference.step(record["eval_loss"])
        elif "lr" in record:
            trained.append(record["lr"])
            expected.append(optimizer.param_groups[0]["lr"])
    return trained, expected


@pytest.fixture(scope="module")
def plateau(root):
    """An uninterrupted reduce_lr_on_plateau run of 12 steps: its output_dir."""
    from shardtune.train.loop import train
    from tests.trainutil import logging_restored

    with logging_restored():
        train(load_train_config(args(root, "plateau", *PLATEAU, "--max_steps", "12")))
    return root / "plateau"


def test_reduce_lr_on_plateau_cuts_the_rate_as_torchs_scheduler_does(plateau):
    """Each step's logged rate is the one torch's ReduceLROnPlateau (factor 0.5, patience 1, threshold 0.5) sets from
    the evaluations before it, the arguments read from lr_scheduler_kwargs; no warm-up, no step-wise decay."""
    trained, expected = plateau_rates(plateau, factor=0.5, patience=1, threshold=0.5)
    assert len(trained) == 12 and trained == pytest.approx(expected, rel=1e-12)
    assert sorted(set(trained), reverse=True) == pytest.approx([3e-3, 1.5e-3, 7.5e-4])  # cut twice in 12 steps


def test_a_resumed_plateau_run_keeps_its_cuts_and_count(root, plateau, restore_logging):
    """Stopped at step 6 (one cut made, one evaluation counted since), resumed to 12: the same rates and weights as
    the run that was not stopped; the checkpoint's count and best carry over, so the next cut comes where it did."""
    from shardtune.train.loop import train

    out = root / "plateau-resumed"
    train(load_train_config(args(root, "plateau-resumed", *PLATEAU, "--max_steps", "6")))
    shutil.rmtree(out / "final")
    train(load_train_config(args(root, "plateau-resumed", *PLATEAU, "--max_steps", "12",
                                 "--resume_from_checkpoint", "true")))
    assert plateau_rates(out, factor=0.5, patience=1, threshold=0.5)[0] == plateau_rates(plateau, factor=0.5,
                                                                                          patience=1, threshold=0.5)[0]
    final, reference = adapter(out / "final"), adapter(plateau / "final")
    assert all(torch.equal(final[k], reference[k]) for k in reference)


@pytest.mark.parametrize("extra, message", [
    (["--lr_scheduler_type", "reduce_lr_on_plateau"], "reduce_lr_on_plateau compare evaluations: set eval_strategy"),
    ([*PLATEAU, "--warmup_steps", "3"], "warmup_steps=3 set without lr_scheduler_type linear"),
    ([*PLATEAU, "--lr_scheduler_kwargs", '{"mode": "max"}'], "reduce_lr_on_plateau's direction follows "
                                                              "greater_is_better"),
    (["--plateau_patience", "3"], "plateau_patience=3 set without lr_scheduler_type reduce_lr_on_plateau"),
    (["--lr_scheduler_type", "cosine_with_min_lr", "--min_lr", "1e-5", "--min_lr_rate", "0.1"],
     "min_lr=1e-05 and min_lr_rate=0.1 both set the cosine's floor"),
])
def test_plateau_and_floor_settings_that_cannot_work_are_refused(root, extra, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_train_config(args(root, "refused", *extra))


def test_plateau_keys_read_from_lr_scheduler_kwargs(root):
    cfg = load_train_config(args(root, "read", *PLATEAU, "--lr_scheduler_kwargs",
                                 '{"factor": 0.2, "patience": 3, "threshold": 0.01, "threshold_mode": "abs", '
                                 '"cooldown": 2, "min_lr": 1e-6, "eps": 1e-9}'))
    o = cfg.optim
    assert (o.plateau_factor, o.plateau_patience, o.plateau_threshold, o.plateau_threshold_mode, o.plateau_cooldown,
            o.min_lr, o.plateau_eps) == (0.2, 3, 0.01, "abs", 2, 1e-6, 1e-9)


def test_evaluating_leaves_the_training_steps_as_they_were(root, restore_logging):
    """With LoRA dropout, a run evaluating after every step trained other weights than the same run evaluating only
    at its end: each pass over the eval DataLoader drew a seed from torch's global generator, which draws the
    dropout masks on CPU. The steps' losses and the final weights are now the same."""
    from shardtune.train.loop import train

    run = [*LORA, "--lora_dropout", "0.5", "--max_steps", "3", "--save_strategy", "no", "--eval_split_ratio", "0.1",
           "--eval_strategy", "steps", "--learning_rate", "1e-2"]
    train(load_train_config(args(root, "eval-each", *run, "--eval_steps", "1")))
    train(load_train_config(args(root, "eval-end", *run, "--eval_steps", "3")))
    each, end = records(root / "eval-each"), records(root / "eval-end")
    assert [r["step"] for r in each if "eval_loss" in r] == [1, 2, 3]
    assert [r["loss"] for r in each if "loss" in r] == [r["loss"] for r in end if "loss" in r]
    final, reference = adapter(root / "eval-each" / "final"), adapter(root / "eval-end" / "final")
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_eval_delay_holds_evaluation_and_early_stopping_back(root, restore_logging):
    """Transformers' eval_delay was refused as a key with no counterpart. Evaluating every 2 steps from step 5 on
    (eval_delay 5), the first evaluation is step 6's: with greater_is_better true the falling loss makes it the
    best and step 8's the one without improvement that stops the run (patience 1), not steps 2 and 4."""
    from shardtune.train.loop import train

    summary = train(load_train_config(args(root, "delayed", *LORA, "--eval_strategy", "steps", "--eval_steps", "2",
                                           "--eval_delay", "5", "--eval_split_ratio", "0.1", "--max_steps", "12",
                                           "--greater_is_better", "true", "--early_stopping_patience", "1",
                                           "--save_strategy", "no", "--learning_rate", "3e-3")))
    assert [r["step"] for r in records(root / "delayed") if "eval_loss" in r] == [6, 8]
    assert (summary["stopped_by"], summary["steps"]) == ("early stopping", 8)
