"""Mixture-of-experts models whose experts transformers 5 fused into 3-D tensors, and how PEFT adapts them.

transformers 5 stores the experts of Mixtral, Qwen3-MoE, OLMoE, ... as one 3-D tensor per projection and the router
as a custom module; PEFT (utils/transformers_weight_conversion.py) maps a recipe's transformers-4 target names onto
those tensors (``_MOE_TARGET_MODULE_MAPPING``), adapting them through its ParamWrapper. Both the estimate's count
(memory/lora_count.py) and the trainer's check of the target names (train/model.py) go by these rules.
"""

from __future__ import annotations

# PEFT's map from transformers-4 MoE names to transformers-5 parameters, and which of them are fused (rank x count).
MOE_TARGETS: dict[str, dict[str, str]] = {
    "mixtral": {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                  "down_proj": "down_proj"},
}
MOE_FUSED: dict[str, dict[str, tuple[str, ...]]] = {
    "mixtral": {"gate_up_proj": ("w1", "w3")},
    "qwen2_moe": {"gate_up_proj": ("gate_proj", "up_proj")},
}


def moe_family(model_type: str | None) -> str | None:
    """The MOE_TARGETS entry PEFT converts ``model_type``'s targets by, or None: PEFT (utils/
    transformers_weight_conversion.py) converts a model type transformers has a checkpoint conversion for, by the
    pattern transformers' conversion map gives it (which PEFT extends with Mixtral). So qwen3_moe, olmoe, glm4_moe
    and others go by qwen2_moe's names, while qwen2_moe itself, which the map gives no pattern, is not converted.
    Read from the installed packages; without them, Mixtral alone."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return "mixtral" if model_type == "mixtral" else None
    if not model_type or get_checkpoint_conversion_mapping(model_type) is None:
        return None
    family = _MODEL_TO_CONVERSION_PATTERN.get(model_type)
    return family if family in MOE_TARGETS else None


def moe_dora_problem(model_type: str | None, family: str | None, targets: tuple[str, ...] | str) -> str | None:
    """use_dora on targets that reach a mixture-of-experts weight transformers 5 stores as a 3-D tensor (all-linear,
    or a transformers-4 name such as Mixtral's w1): PEFT adapts those through its ParamWrapper, which has no DoRA.
    The refusal both ``estimate`` and ``train`` give; None where DoRA can run."""
    mapping = MOE_TARGETS.get(family or "", {})
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    reached = sorted(set(mapping) if names == ("all-linear",) else {t for t in names if t in mapping})
    if not reached:
        return None
    return (f"use_dora with lora_target_modules {','.join(names)}: PEFT's DoRA cannot adapt {model_type}'s "
            f"mixture-of-experts weights, which transformers 5 holds as parameters, not linear layers "
            f"({', '.join(reached)}); name the other linear layers (e.g. q_proj,k_proj,v_proj,o_proj) or leave "
            f"use_dora out")
