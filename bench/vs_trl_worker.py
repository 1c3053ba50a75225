"""The child side of bench/vs_trl.py: TRL's SFTTrainer on one job, and the step clock both tools carry.

Each run of the bench is a fresh process (so its peak RSS is its own): ``shardtune train`` with
``--callbacks vs_trl_worker:StepClock``, or ``python bench/vs_trl_worker.py SPEC.json`` for TRL. The same
``StepClock`` class is a callback of both trainers (their events share Transformers' names and arguments), so the
step times are taken at the same point of both loops: the end of each optimizer step, after its update.

The clock writes ``VS_TRL_CLOCK`` (a JSON path) when training ends; with ``VS_TRL_PROFILE_STEP`` set it also runs
torch.profiler over that one step and writes the breakdown beside it (see ``breakdown``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Top-level profiler ranges of one training step, by the part of the step they belong to. Backward is whatever the
# autograd engine runs (it includes the recomputation of checkpointed chunks); everything else on the training
# thread that is no optimizer or data work is forward (the model and the loss).
PARTS = (("optimizer", ("Optimizer.step", "Optimizer.zero_grad", "aten::_foreach", "clip_grad")),
         ("backward", ("autograd::engine::evaluate_function",)),
         ("data", ("enumerate(DataLoader)", "DataLoader", "collate")))


def _peak_bytes() -> dict:
    """This process's peaks so far: RSS (Linux: ru_maxrss in KiB) and, on CUDA, the caching allocator's reserve."""
    import resource

    import torch

    cuda = int(torch.cuda.max_memory_reserved()) if torch.cuda.is_available() else None
    return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cuda_reserved": cuda}


class StepClock:
    """Wall time at the end of every optimizer step (and, for TRL, the step's tokens and loss, see ``trl_main``)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.steps: list[dict] = []  # TRL: tokens, target tokens and loss of each step, filled by the runner
        self.path = os.environ.get("VS_TRL_CLOCK")
        self.profile_step = int(os.environ.get("VS_TRL_PROFILE_STEP", "0"))
        self.profiler = None
        self.profile: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.ends = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs) -> None:
        import torch

        if torch.cuda.is_available():  # the step's kernels done, not only queued
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        step = len(self.ends) - 1  # optimizer steps done
        if self.profile_step and step == self.profile_step - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():  # the kernels too, with the time the GPU spent in them
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        elif self.profiler is not None and step == self.profile_step:
            self.profiler.__exit__(None, None, None)
            try:
                self.profile = breakdown(self.profiler, self.ends[-1] - self.ends[-2])
            except Exception as exc:  # noqa: BLE001 - a profile that cannot be read must not end the run
                self.profile = {"error": f"{type(exc).__name__}: {exc}"}
            self.profiler = None
            # Stopping the profiler (CUPTI's flush) and reading it took time that belongs to no step: the next,
            # timed, step starts now.
            self.ends[-1] = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps({"step_ends": self.ends, "steps": self.steps,
                                                   "peak_at_train_end": _peak_bytes(), "profile": self.profile}))


def breakdown(profiler, wall_s: float) -> dict:
    """Seconds of one step by part (``PARTS``; the rest of the ranges is forward), the gap outside any range
    (Python between operators), and the ten operators of most self time."""
    by_thread: dict[int, list] = {}
    for event in profiler.events():
        if event.cpu_parent is None and event.device_type.name == "CPU":  # ranges, not the GPU's kernels
            by_thread.setdefault(event.thread, []).append(event)
    # the training thread: the one with the most time in ranges (a CPU backward runs on it too); on CUDA the
    # autograd engine runs backward on a thread of its own, whose ranges are added to it
    main = max(by_thread, key=lambda t: sum(e.time_range.elapsed_us() for e in by_thread[t]), default=None)
    top = [e for t, evs in by_thread.items() for e in evs
           if t == main or e.name.startswith("autograd::engine::evaluate_function")]
    parts = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "data": 0.0}
    for event in top:
        part = next((p for p, prefixes in PARTS if event.name.startswith(prefixes)), "forward")
        parts[part] += event.time_range.elapsed_us() / 1e6
    parts["python_outside_ops"] = max(0.0, wall_s - sum(parts.values()))
    averages = profiler.key_averages()
    ops = sorted(averages, key=lambda a: -a.self_cpu_time_total)[:10]
    result = {"wall_s": wall_s, "parts_s": parts,
              "top_ops": [{"name": a.key, "self_s": a.self_cpu_time_total / 1e6, "calls": a.count} for a in ops]}
    # On CUDA: the kernels by the GPU time they took themselves, and the GPU's busy time in all of them (against
    # the step's wall time: what is left is the GPU waiting on Python, launches or the host).
    kernels = [a for a in averages if a.self_device_time_total > 0 and a.device_type.name == "CUDA"]
    if kernels:
        kernels.sort(key=lambda a: -a.self_device_time_total)
        result["device_busy_s"] = sum(a.self_device_time_total for a in kernels) / 1e6
        # how many kernels the step launched: where the GPU waits, the step's wall time over this is the host's
        # time per launch (what a host term of the time model needs, docs/estimator.md)
        result["kernels_launched"] = sum(a.count for a in kernels)
        result["top_kernels"] = [{"name": a.key, "self_s": a.self_device_time_total / 1e6, "calls": a.count}
                                 for a in kernels[:12]]
    return result


def _sampler_order(num_rows: int, spec: dict) -> list[int]:
    """The rows in shardtune's order for this seed and batch (its GlobalBatchSampler), so both tools train on the
    same rows at every step: losses can then be compared step by step."""
    from shardtune.data.sampler import GlobalBatchSampler

    sampler = GlobalBatchSampler(num_rows, micro_batch_size=spec["batch"], gradient_accumulation_steps=spec["accum"],
                                 world_size=1, rank=0, seed=spec["seed"])
    return [row for step in sampler for micro in step for row in micro]


def _trl_config(spec: dict):
    """TRL's SFTConfig: every setting pinned (matched mode), or only the recipe a user writes (defaults mode)."""
    from trl import SFTConfig

    cuda = spec["device"] == "cuda"
    recipe = dict(output_dir=spec["output_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
                  gradient_accumulation_steps=spec["accum"], learning_rate=spec["lr"], seed=spec["seed"],
                  max_length=spec["seq_len"], assistant_only_loss=True, chat_template_path=spec["chat_template"],
                  # Transformers refuses SFTConfig's default bf16 on a machine without a GPU unless told use_cpu
                  use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to=[])
    if spec["mode"] == "defaults":
        return SFTConfig(**recipe)
    return SFTConfig(
        **recipe, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, packing=False, padding_free=False,
        gradient_checkpointing=False, bf16=spec["bf16"], dataloader_num_workers=0, disable_tqdm=True,
        dataset_num_proc=None)


def _model_and_tokenizer(spec: dict):
    """As a user gives them: the folder's path in the defaults mode (TRL loads both, the model in its default
    dtype), else loaded here in the matched dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec["mode"] == "defaults":
        return spec["model"], None
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    dtype = torch.bfloat16 if spec["bf16"] and spec["method"] == "lora" and spec["device"] == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="sdpa"), tokenizer


def trl_main(spec_path: str) -> None:
    """TRL's SFTTrainer on the job ``spec_path`` describes (written by bench/vs_trl.py); the clock records it."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    try:
        from trl import SFTTrainer
    except ImportError:
        sys.exit("TRL is not installed: see bench/vs_trl.py")
    from datasets import load_dataset
    from peft import LoraConfig

    dataset = load_dataset("json", data_files=spec["data"], split="train")
    model, tokenizer = _model_and_tokenizer(spec)
    peft_config = None
    if spec["method"] == "lora":
        peft_config = LoraConfig(r=spec["lora_r"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                                 target_modules=spec["lora_target_modules"].split(","), task_type="CAUSAL_LM")
    order = _sampler_order(len(dataset), spec)

    class SameOrderTrainer(SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return order

    from transformers import TrainerCallback

    class TrlStepClock(StepClock, TrainerCallback):  # Transformers calls every event of a callback
        pass

    clock = TrlStepClock()
    trainer = SameOrderTrainer(model=model, args=_trl_config(spec), train_dataset=dataset,
                               processing_class=tokenizer, peft_config=peft_config, callbacks=[clock])
    _count_steps(trainer, clock)
    trainer.train()


def _count_steps(trainer, clock: StepClock) -> None:
    """Wrap ``training_step`` to add each micro-batch's tokens (attention mask), target tokens (labels after the
    shift) and loss (already divided by the step's target tokens, so the micro-batches' losses add up to the
    step's mean) to the step it belongs to."""
    original = trainer.training_step

    def counting_step(model, inputs, num_items_in_batch=None):
        if len(clock.steps) < len(clock.ends):  # the first micro-batch of a new step
            clock.steps.append({"tokens": 0, "target_tokens": 0, "loss": 0.0})
        record = clock.steps[-1]
        record["tokens"] += int(inputs["attention_mask"].sum())
        record["target_tokens"] += int((inputs["labels"][:, 1:] != -100).sum())
        loss = original(model, inputs, num_items_in_batch)
        record["loss"] += float(loss)
        return loss

    trainer.training_step = counting_step


if __name__ == "__main__":
    trl_main(sys.argv[1])
