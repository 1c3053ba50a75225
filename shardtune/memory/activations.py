"""Activations: the bytes per token one forward pass keeps for backward, by place in the model.

Counted tensor by tensor from what the transformers implementation saves for backward (sources and measurements:
the docstring of formula.py, tests/test_activations.py and tests/test_estimate_lora_activations.py).
"""

from __future__ import annotations

from shardtune.memory.inventory import ModelInventory, normalize_targets
from shardtune.memory.setup import Dtypes, Setup
from shardtune.train.loss import LOSS_CHUNKS, loss_chunk_tokens

# Projections grouped by the tensor they read, by the names transformers gives them (Llama-style models, Phi-3's
# fused projections, Mixtral's router). An adapter on any member of a group keeps that group's input alive.
ATTENTION_INPUT = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj"})
MLP_INPUT = frozenset({"gate_proj", "up_proj", "gate_up_proj", "gate"})
MLP_DOWN = frozenset({"down_proj"})
_KNOWN_LINEARS = ATTENTION_INPUT | MLP_INPUT | MLP_DOWN | {"o_proj"}


def adapted_linears(inv: ModelInventory, setup: Setup) -> frozenset[str] | None:
    """Short names of a decoder layer's linear layers that carry a LoRA adapter; None for full fine-tuning.

    A model with linear layers outside the known groups, or with experts, is counted as if every weight trained
    (an over-estimate of its activations, never an under-estimate).
    """
    if (setup.method == "full" or inv.num_experts > 1 or not inv.linear_names
            or not set(inv.linear_names) <= _KNOWN_LINEARS):
        return None
    targets = normalize_targets(setup.lora_target_modules)
    if targets == ("all-linear",):
        return frozenset(inv.linear_names)
    return frozenset(t.rsplit(".", 1)[-1] for t in targets) & frozenset(inv.linear_names)


class Activations:
    """Bytes per token that one forward pass keeps for backward, by place in the model."""

    def __init__(self, inv: ModelInventory, setup: Setup, dt: Dtypes):
        self.inv, self.setup, self.dt = inv, setup, dt
        self.adapted = adapted_linears(inv, setup)  # None: every weight trains (full fine-tuning)

    @property
    def frozen(self) -> bool:
        """Base weights frozen (LoRA/QLoRA): autograd saves an op's input only where a gradient needs it."""
        return self.adapted is not None

    def _adapts(self, names: frozenset[str]) -> bool:
        return self.adapted is None or bool(self.adapted & names)

    def norm(self) -> int:
        """One RMSNorm: the fp32 upcast of its input, the normalised tensor, and 1/rms per token.

        The normalised tensor is kept only for the gradient of the norm's weight, so a frozen norm keeps none.
        """
        h = self.inv.hidden_size
        normalised = 4 if self.inv.norm_upcasts_weight else self.dt.residual
        return 4 * h + (0 if self.frozen else normalised * h) + 4

    def attention(self) -> int:
        inv, e, s = self.inv, self.dt.compute, self.setup.seq_len
        repeated = inv.num_kv_heads != inv.num_heads
        v_stored = inv.q_dim + 2 * inv.kv_dim if inv.fused_qkv else inv.kv_dim  # a view keeps the fused qkv alive
        if self.setup.attn_implementation == "eager":
            kv = 2 * inv.q_dim if repeated else inv.kv_dim + v_stored  # repeat_kv copies k and v to every head
            # q, k, v, the output, plus softmax probabilities in fp32 and again in compute dtype (s per head).
            return e * (inv.q_dim + kv + inv.q_dim) + (4 + e) * inv.num_heads * s
        if self.setup.attn_implementation == "sdpa":
            # shardtune's collator hands sdpa a block-causal boolean mask [B, 1, L, L] (packed documents never
            # attend to each other). SDPA's own GQA takes no mask, so transformers repeats k and v to every head
            # (sdpa_attention.use_gqa_in_sdpa), and SDPA turns the mask into an additive one in the compute dtype,
            # which its kernel keeps for backward: seq_len values per token, in every layer.
            kv = 2 * inv.q_dim if repeated else inv.kv_dim + v_stored
            return e * (inv.q_dim + kv + inv.q_dim + s) + 4 * inv.num_heads
        # Flash attention: no mask (documents come from the position ids) and GQA inside the kernel: rotated q and
        # k, v, the output, and an fp32 log-sum-exp per head.
        return e * (inv.q_dim + inv.kv_dim + v_stored + inv.q_dim) + 4 * inv.num_heads

    def mlp(self) -> int:
        inv, e = self.inv, self.dt.compute
        # Gate output, activation output, up output, and the down projection's input, which only the down weight's
        # gradient needs (with a frozen base, adapters() counts what an adapter on it keeps).
        # The activation keeps the gate's output and its own, the product the up output (fp32 where DoRA makes
        # them so: _output_bytes).
        gate, up = (self._output_bytes(names) for names in (frozenset({"gate_proj", "gate_up_proj"}),
                                                            frozenset({"up_proj", "gate_up_proj"})))
        dense = (2 * gate + up + (0 if self.frozen else e)) * inv.intermediate_size
        if inv.num_experts > 1:
            k = inv.experts_per_token
            # Each token goes through k experts: their MLP tensors, the gathered token copies, router logits.
            return k * (dense + e * inv.hidden_size) + 4 * inv.num_experts + 8 * k
        return dense

    def linear_inputs(self) -> int:
        """Copies of the normalised hidden states that the projections after each pre-norm keep.

        In compute dtype they share one tensor. Under torch.autocast each projection casts its fp32 input itself
        (autocast caches casts of weights, not of activations), so q, k and v keep three copies and gate and up two.
        """
        inv = self.inv
        copies = inv.pre_norms_per_layer
        if self.dt.autocast_copies:
            copies = (1 if inv.fused_qkv else 3) + (1 if inv.fused_gate_up else 2)
        elif self.frozen:  # a frozen projection keeps no input: adapters() counts what the adapters keep
            copies = 0
        return copies * self.dt.compute * inv.hidden_size

    def _input_width(self, name: str) -> int:
        if name in MLP_DOWN:
            return self.inv.intermediate_size
        return self.inv.q_dim if name == "o_proj" else self.inv.hidden_size

    @property
    def _fp32_under_autocast(self) -> bool:
        """Trainable weights stored in fp32 (adapters, DoRA's magnitudes) and used under torch.autocast with a 16-bit
        compute dtype: one process, DDP, MP and PP. FSDP gathers them in the compute dtype; pure bf16 stores them
        so."""
        dt = self.dt
        return dt.master == 4 and dt.compute != 4 and self.setup.strategy.autocasts

    @property
    def autocast_adapters(self) -> bool:
        """fp32 adapters (PEFT's, and the trainer's) run under torch.autocast, PEFT casting their input up to fp32
        first: single GPU, DDP and model parallel with a 16-bit compute dtype. Under FSDP the MixedPrecisionPolicy
        gathers them in the compute dtype instead, and PEFT's bitsandbytes 4-bit layers (QLoRA) skip that cast under
        CUDA autocast (peft/tuners/lora/bnb.py), so their adapters read the input as it is (measured on an H200:
        bench/results/estimate_cuda_nvidia-h200.md)."""
        return bool(self.adapted) and self._fp32_under_autocast and self.setup.method != "qlora"

    def adapters(self) -> int:
        """What LoRA adapters keep for backward: the input of A (for A's gradient) and A's r-wide output (for B's).

        Adapters in the activations' dtype (bf16 under pure bf16 or FSDP, fp32 without mixed precision) read the
        projection's input as it is, so the projections behind one norm share one copy, and o_proj's input is the
        attention output its kernel keeps anyway. fp32 adapters under torch.autocast (the trainer's default) each
        make their own copy: PEFT casts the input up to the adapter's fp32 and autocast casts that back to the
        compute dtype for A's matmul, which keeps it (autocast caches casts of weights, not of activations); the
        fp32 cast itself is not kept. With ``lora_dropout`` each adapter's dropout keeps its boolean mask and hands
        A its own copy of the input, shared with no other adapter. Measured on real PEFT models in
        tests/test_estimate_lora_activations.py.
        """
        if not self.adapted:
            return 0
        r, e = self.setup.lora_r, self.dt.compute
        # DoRA (peft/tuners/lora/dora.py) scales the base output and the adapter's by the magnitude over the weight
        # norm: the two products keep both outputs for the magnitude's gradient.
        dora = sum(2 * e * self._output_width(name) for name in self.adapted) if self.setup.use_dora else 0
        if self.autocast_adapters or self.setup.lora_dropout:
            mask = 1 if self.setup.lora_dropout else 0
            return dora + sum((e + mask) * self._input_width(name) + e * r for name in self.adapted)
        shared = int(bool(self.adapted & ATTENTION_INPUT)) + int(bool(self.adapted & MLP_INPUT))
        down = e * self.inv.intermediate_size if self.adapted & MLP_DOWN else 0
        return dora + e * r * len(self.adapted) + shared * e * self.inv.hidden_size + down

    def _output_width(self, name: str) -> int:
        inv = self.inv
        return {"q_proj": inv.q_dim, "k_proj": inv.kv_dim, "v_proj": inv.kv_dim, "qkv_proj": inv.q_dim + 2 * inv.kv_dim,
                "gate_proj": inv.intermediate_size, "up_proj": inv.intermediate_size,
                "gate_up_proj": 2 * inv.intermediate_size, "gate": inv.num_experts}.get(name, inv.hidden_size)

    @property
    def _dora_promotes(self) -> bool:
        """DoRA's fp32 magnitudes under torch.autocast turn its layers' bf16 outputs into fp32 ones (type
        promotion of the scaling products), which the next ops keep; FSDP gathers them in bf16, pure bf16 stores
        them so."""
        return self.setup.use_dora and self._fp32_under_autocast

    def _output_bytes(self, names: frozenset[str]) -> int:
        """Bytes per value of the output of a projection among ``names`` (fp32 where DoRA promotes it)."""
        return 4 if self._dora_promotes and self.adapted and self.adapted & names else self.dt.compute

    def dora_weight_norm(self) -> int:
        """The most one adapted linear's DoRA holds while its forward computes the weight norm (not per token).

        PEFT's DoraLinearLayer (peft/tuners/lora/dora.py) runs lora_B(lora_A(identity)) for the LoRA weight: an
        in x in identity in the adapter's dtype, its compute-dtype cast under autocast, and the in x out product.
        A's matmul keeps the identity it multiplied (the cast) for its gradient, so it stays while the LoRA weight
        does, to the end of the module's forward, beside the weight norm of base + scaling x LoRA weight: both
        weights in the input's dtype (a copy where it differs), the scaled weight and the sum. Forward and
        recompute run it once per adapted linear and free it before the next. A 4-bit base's dequantised weight is
        the formula's "NF4 weight dequantised" item.
        """
        if not (self.setup.use_dora and self.adapted):
            return 0
        e, r = self.dt.compute, self.setup.lora_r
        # The identity in the adapter's dtype: fp32 beside its cast under autocast, else the compute dtype. A's
        # matmul keeps it in the compute dtype, and lora_B returns the LoRA weight in it.
        identity_bytes = 4 + e if self._fp32_under_autocast else e
        base = e if self.setup.method == "qlora" else self.dt.frozen
        most = 0
        for name in self.adapted:
            d_in, d_out = self._input_width(name), self._output_width(name)
            x = self._input_bytes(name)
            identity = d_in * d_in * identity_bytes + d_in * r * e + d_in * d_out * e
            copy = x if base != x else 0
            norm = d_in * d_in * e + d_in * d_out * (3 * x + copy)
            most = max(most, identity, norm)
        return most

    def dora_kept_weights(self) -> int:
        """What one layer's DoRA keeps for backward beyond its per-token tensors (bytes, not per token).

        With ``lora_dropout`` PEFT recomputes the base output on the dropped-out input, F.linear(x, weight), and
        the matmul keeps its weight for the input's gradient: the frozen weight itself, unless autocast casts it
        (the fp32 copy made for an fp32 input). A 4-bit base's dequantised weight is not kept: measured on
        CPU against bitsandbytes' layers, a QLoRA DoRA step with dropout holds what one without it does beyond the
        dropout's tensors (``shardtune train``'s own memory check, real tensors).
        """
        if not (self.setup.use_dora and self.adapted and self.setup.lora_dropout):
            return 0
        e, total = self.dt.compute, 0
        for name in self.adapted:
            x = self._input_bytes(name)
            copied = x != e and self.setup.strategy.autocasts
            total += self._input_width(name) * self._output_width(name) * e if copied else 0
        return total

    def _input_bytes(self, name: str) -> int:
        """Bytes per value of a projection's input: the normalised residual stream for those after a norm, the
        attention output for o_proj, the MLP's product for down_proj."""
        if name == "o_proj":
            return self.dt.compute
        if name in MLP_DOWN:
            return self._output_bytes(MLP_INPUT)
        return self.dt.residual

    def layer(self) -> int:
        """A decoder layer without checkpointing."""
        inv = self.inv
        return (inv.norms_per_layer * self.norm() + self.linear_inputs() + self.attention() + self.mlp()
                + self.adapters())

    def layer_bytes(self, tokens: int) -> int:
        """A decoder layer without checkpointing, for a micro-batch of ``tokens``: what DoRA keeps per layer too."""
        return tokens * self.layer() + self.dora_kept_weights()

    def layer_recomputed_bytes(self, tokens: int) -> int:
        """A checkpointed layer while backward recomputes it, for a micro-batch of ``tokens``."""
        return tokens * self.layer_recomputed() + self.dora_kept_weights()

    def layer_checkpointed(self) -> int:
        """A checkpointed layer keeps only its input."""
        return self.dt.residual * self.inv.hidden_size

    def layer_recomputed(self) -> int:
        """A checkpointed layer while backward recomputes it: what ``layer()`` keeps, less its input where the
        first norm keeps the input itself (an fp32 residual stream needs no upcast): the checkpoint holds it."""
        return self.layer() - (self.layer_checkpointed() if self.dt.residual == 4 else 0)

    def layer_backward_temporaries(self) -> int:
        """What one layer holds beyond its saved activations while backward runs through it, at its fullest.

        Its MLP's backward: two intermediate-sized gradients (of the down projection's input and of one of its
        factors) and two residual-sized ones. With checkpointing, fp32 adapters under autocast top that while the
        layer is recomputed: at the down projection, PEFT's fp32 copy of its input (4 bytes x intermediate), and
        with ``lora_dropout`` the dropout's fp32 output, stand beside that input and the base projection's output,
        while the decoder layer's forward still holds the post-attention norm's output and the mid-layer residual,
        and the gradient of the layer's output waits.
        """
        inv, e, res, h = self.inv, self.dt.compute, self.dt.residual, self.inv.hidden_size
        width = inv.intermediate_size * (inv.experts_per_token if inv.num_experts > 1 else 1)
        gradients = 2 * e * width + 2 * res * h
        if not (self.setup.gradient_checkpointing and self.autocast_adapters and self.adapted & MLP_DOWN):
            return gradients
        dropped = 4 if self.setup.lora_dropout else 0
        return max(gradients, (4 + dropped + e) * width + 2 * e * h + 2 * res * h)

    def batch_inputs(self) -> int:
        """The micro-batch on the GPU: input ids, labels and position ids (int64), and the attention mask that
        shardtune's collator builds for packed documents, [B, 1, L, L]: boolean for sdpa, additive fp32 for eager,
        none for flash attention (it finds the documents from the position ids)."""
        mask = {"sdpa": 1, "eager": 4}.get(self.setup.attn_implementation, 0) * self.setup.seq_len
        return 24 + mask

    def outside_layers(self) -> int:
        """Final norm, the lm_head input, the micro-batch itself, and what the loss keeps for backward.

        shardtune's loss keeps no logits: its checkpointed chunks keep their input, the final norm's output (in
        the residual stream's dtype, frozen head or not), and the shifted labels (int64). The full loss keeps the
        fp32 log-softmax of every token; the chunked loss keeps the compute-dtype logits and recomputes the
        softmax one chunk at a time in backward (torchtune's CEWithChunkedOutputLoss, compiled).
        """
        inv = self.inv
        if self.setup.loss == "shardtune":
            kept, head_input = 8, self.dt.residual * inv.hidden_size
        elif self.setup.loss in ("full", "full-shifted"):
            kept, head_input = 4 * inv.vocab_size, self.dt.compute * inv.hidden_size
        else:  # the compute-dtype logits and the fp32 log-sum-exp of each token
            kept, head_input = self.dt.compute * inv.vocab_size + 4, self.dt.compute * inv.hidden_size
        if self.frozen:
            # A frozen head keeps no input (shardtune's chunks do). The final norm keeps its fp32 upcast (the
            # adapters below need the gradient of its input); without checkpointing that cancels against the
            # first layer's input norm, which keeps nothing (nothing before it needs a gradient: the embeddings
            # are frozen).
            final_norm = self.norm() if self.setup.gradient_checkpointing else 0
            kept += head_input if self.setup.loss == "shardtune" else 0
            return final_norm + self.batch_inputs() + kept
        return self.norm() + head_input + self.batch_inputs() + kept

    def rope_tables(self) -> int:
        """RoPE's cos and sin, shared by all layers: one row per token, since the trainer passes position ids for
        every sequence of the batch (they restart at each packed document)."""
        return 2 * self.setup.batch_size * self.setup.seq_len * self.inv.head_dim * self.dt.residual

    def loss_chunk_tokens(self, tokens: int) -> int:
        """Tokens in one chunk of shardtune's loss for a micro-batch of ``tokens`` (``head_loss_sum``)."""
        return min(tokens, loss_chunk_tokens(tokens, self.inv.vocab_size))

    def loss_forward_bytes(self, tokens: int) -> int:
        """Logits in compute dtype and their fp32 upcast, alive while the loss of ``tokens`` is computed."""
        v, e = self.inv.vocab_size, self.dt.compute
        if self.setup.loss == "shardtune":
            # shardtune.train.loss.head_loss_sum: one chunk's fp32 logits and their log-softmax at a time (the
            # upcast frees the compute-dtype logits; each chunk is checkpointed, so nothing is kept).
            return 8 * v * self.loss_chunk_tokens(tokens)
        if self.setup.loss == "chunked":
            # torchtune compiles the per-chunk upcast + cross-entropy (training.compile_loss): inductor fuses the
            # upcast into the log-sum-exp reduction, so no fp32 copy of a chunk is materialised, only one fp32
            # log-sum-exp per token (counted with the saved logits).
            return 0
        if self.setup.loss == "full-shifted":
            # transformers <= 4.44 LlamaForCausalLM: ``logits.float()`` (returned with the output), then
            # ``logits[..., :-1, :].contiguous()``: two fp32 copies while the log-softmax runs (the compute-dtype
            # logits are gone by then; at the upcast they are beside one fp32 copy, which is less).
            return tokens * max(8 * v, e * v + 4 * v)
        return tokens * (e * v + (4 * v if e != 4 else 0))

    def loss_backward_bytes(self, tokens: int, head_gradient: float = 0) -> int:
        """The gradients of the logits at the start of backward (beyond the saved activations). ``head_gradient``:
        the bytes of the head's weight gradient as its matmul makes it (full fine-tuning's fused loss)."""
        v = self.inv.vocab_size
        if self.setup.loss == "shardtune":
            # Backward recomputes one chunk: its log-softmax, that output's gradient and the gradient of the fp32
            # logits (12 bytes a value) at the log-softmax's backward. Then, when the head trains, its weight
            # gradient's matmul writes a new head-sized gradient (summed into autograd's buffer after it) from the
            # logits' gradient in the matmul's dtype. The chunks run last to first, and the gradients of the head's
            # input wait for all of them (the split's backward joins them): at the first chunk, those of every
            # other chunk are there.
            chunk = self.loss_chunk_tokens(tokens)
            at_chunk = max(12 * v * chunk, head_gradient + self.dt.compute * v * chunk)
            return int(at_chunk) + (tokens - chunk) * self.dt.residual * self.inv.hidden_size
        if self.setup.loss == "chunked":
            # Each chunk is its own branch of the graph: autograd runs one chunk's loss backward and then its slice
            # of the output projection, and frees that chunk's gradient before the next one, so one chunk's
            # gradient is alive, never all of them. The compiled backward writes it (softmax - one-hot) straight
            # in compute dtype, with no fp32 intermediate.
            return tokens * self.dt.compute * v // LOSS_CHUNKS
        held = 4 * v if self.setup.loss == "full-shifted" and self.setup.logits_held else 0
        return tokens * (8 * v + held)
