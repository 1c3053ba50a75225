"""A callback for tests (``--callbacks tests.setup_probe:SetupProbe``): what a run actually set up, written to
``OUTPUT_DIR/setup_probe_rank{R}.json`` at the end, so that a test comparing two runs' losses can also check that the
setting it varies took effect (on a CPU most settings change no number: FSDP's sharding, prefetch and offload, the
attention kernel, length grouping).

Recorded: the model's attention implementation, its embedding rows, its 4-bit linear layers; under FSDP2, each
unit's module class, its device mesh (shape and dimension names), whether it reshards after forward, how many units
it prefetches in forward, and its offload policy, and whether each of the first step's forwards reduces its
gradients (deferred to the last micro-batch, or not); step by step, the real (unpadded) length of every row of every
micro-batch (unpacked rows); the first step's schedule as the rank's last decoder layer sees it; and the class of
the ``model`` that on_train_begin and on_step_end got. FSDP2's and
autograd's private attributes are read (torch 2.13): a torch upgrade may rename them.
"""

from __future__ import annotations

import json
from pathlib import Path


def _row_lengths(position_ids) -> list[int]:
    """Each unpacked row's real length: it holds one document, whose positions count from 0, and the collator's
    padding after it starts a segment of its own, from 0 again."""
    lengths = []
    for row in position_ids.tolist():
        starts = [i for i, p in enumerate(row) if p == 0]
        lengths.append(starts[1] if len(starts) > 1 else len(row))
    return lengths


def fsdp_units(model) -> list[tuple]:
    """Each FSDP2 unit of ``model``: (module, its FSDP state, its parameter groups)."""
    from torch.distributed.fsdp import FSDPModule

    return [(m, m._get_fsdp_state(), m._get_fsdp_state()._fsdp_param_groups) for m in model.modules()
            if isinstance(m, FSDPModule)]


class SetupProbe:
    def __init__(self) -> None:
        self.record: dict = {"row_lengths": []}

    def on_train_begin(self, args, state, control, *, model, plan, info, **kwargs) -> None:
        from shardtune.train.plan import unwrap

        self.output_dir, self.rank = Path(args.run.output_dir), info.rank
        self.record["model_class"] = {"on_train_begin": type(model).__name__}
        base = unwrap(model)
        self.record["attn_implementation"] = getattr(base.config, "_attn_implementation", None)
        self.record["embedding_rows"] = base.config.vocab_size  # resize_token_embeddings keeps it
        self.record["linear4bit"] = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
        units = []
        for module, fsdp, groups in fsdp_units(model):
            mesh = groups[0].mesh_info.mesh if groups else None
            name = type(module).__name__.removeprefix("FSDP")  # fully_shard's subclass of the module's class
            cls = next(c for c in type(module).__mro__ if c.__name__ == name)
            units.append({"module": name, "package": cls.__module__.split(".")[0],  # torch, transformers or peft
                          "mesh_shape": list(mesh.shape) if mesh is not None else None,
                          "mesh_dims": list(mesh.mesh_dim_names or ()) if mesh is not None else None,
                          "reshard_after_forward": any(g.post_forward_mesh_info is not None for g in groups),
                          "forward_prefetch": len(fsdp._states_to_forward_prefetch),
                          "offload": sorted({type(g.offload_policy).__name__ for g in groups})})
        self.record["fsdp_units"] = units
        self._watch_last_layer(model)
        self._watch_gradient_sync(model)

    def _watch_gradient_sync(self, model) -> None:
        """Whether the root unit will reduce its gradients after each forward of step 1 (FSDP2 only)."""
        import torch

        self.record["gradient_sync"] = []
        units = fsdp_units(model)
        if not units:
            return
        root, _, groups = units[0]  # modules() yields the root first

        def before(module, args) -> None:
            if self.recording and torch._C._current_graph_task_id() == -1:
                self.record["gradient_sync"].append(all(g.reduce_grads for g in groups))

        root.register_forward_pre_hook(before)

    def _watch_last_layer(self, model) -> None:
        """The schedule as this rank's last decoder layer sees step 1: "F<rows>" for each forward (the rows of its
        micro-batch; a checkpoint's recompute inside backward is not one), "B" when its output's gradient arrives."""
        import torch

        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        self.record["schedule"], self.recording = [], False
        if not layers:
            return

        def forward(module, args, kwargs, output) -> None:
            if not self.recording or torch._C._current_graph_task_id() != -1:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            self.record["schedule"].append(f"F{hidden.shape[0]}")
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: self.record["schedule"].append("B") if self.recording else None)

        layers[-1].register_forward_hook(forward, with_kwargs=True)

    def on_step_begin(self, args, state, control, *, micro_batches, **kwargs) -> None:
        self.record["row_lengths"].append([_row_lengths(b["position_ids"]) for b in micro_batches])
        self.recording = state.step == 0  # the first step (state.step counts those done)

    def on_step_end(self, args, state, control, *, model, **kwargs) -> None:
        self.recording = False
        self.record["model_class"]["on_step_end"] = type(model).__name__  # the model every event gets

    def on_train_end(self, args, state, control, **kwargs) -> None:
        path = self.output_dir / f"setup_probe_rank{self.rank}.json"
        path.write_text(json.dumps(self.record))


def probe(output_dir: Path, rank: int = 0) -> dict:
    """What ``SetupProbe`` recorded for the run in ``output_dir`` (rank ``rank``)."""
    return json.loads((Path(output_dir) / f"setup_probe_rank{rank}.json").read_text())
