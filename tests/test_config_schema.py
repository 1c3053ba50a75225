"""Each key is declared once (shardtune/config/schema.py), and everything else is read from that declaration: the
coercion and checks of a value, a problem's key, --help-keys, docs/config.md and the recipe's JSON Schema, which
the repository's example recipes satisfy."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
import yaml

from shardtune.cli import main
from shardtune.config import load_train_config, save_resolved
from shardtune.config.keys import Problem, declared, key
from shardtune.config.recipe_schema import recipe_schema
from shardtune.config.schema import ALIASES, CHAT_TEMPLATES, TrainConfig, all_keys, known_keys
from shardtune.config.validation import validate
from shardtune.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "out"]


@dataclasses.dataclass
class Planted:
    """A section of the declaration forms the schema uses, to test the machinery apart from the real keys."""

    kind: Literal["AB", "CD"] | None = key(None, "A choice.", spellings={"Z": "AB"}, refused={"ef": "not that"})
    count: int = key(1, "A count.", ge=1)
    ratio: float = key(0.5, "A ratio.", ge=0, lt=1)
    names: list[str] = key(help="Names.", factory=list, choices=("x", "y"))
    flag: bool | None = key(None, "A flag.")


def test_values_are_coerced_and_checked_as_their_type_and_metadata_declare():
    kind, count, ratio, names, flag = declared(Planted)
    assert [kind.coerce(v) for v in ("ab", "z", "null", "Cd")] == ["AB", "AB", None, "CD"]
    assert (count.coerce("3"), count.coerce(4.0), ratio.coerce("0.25"), names.coerce("X, y,"), flag.coerce("No")) == \
        (3, 4, 0.25, ["x", "y"], False)
    for d, value, error in ((count, "3.5", "expected an integer"), (count, True, "expected an integer"),
                            (ratio, "inf", "expected a finite number"), (flag, "maybe", "expected true or false"),
                            (count, None, "a value is required")):
        with pytest.raises(ValueError, match=error):
            d.coerce(value)
    assert kind.problems(kind.coerce("EF")) == ["kind=ef: not that"]
    assert kind.problems("GH") == ["kind='GH' is not accepted; use one of AB, CD"]
    assert count.problems(0) == ["count=0 must be at least 1"]
    assert ratio.problems(1.0) == ["ratio=1.0 must be in [0, 1)"]
    assert names.problems(["x", "q"]) == ["names='q' is not accepted; use one of x, y"]
    assert all(p.keys == (p.split("=")[0],) for d in (kind, count) for p in d.problems("GH" if d is kind else 0))


def test_a_list_key_given_a_mapping_is_refused_naming_the_file_and_line(tmp_path):
    """'callbacks:' followed by an indented 'mypkg: hooks' was read as one callback named "{'mypkg': 'hooks'}",
    refused much later as a module that cannot be imported; a mapping is not a list, nor is an item of one."""
    _, _, _, names, _ = declared(Planted)
    for value in ({"a": "b"}, ["x", {"a": "b"}], ["x", ["y"]]):
        with pytest.raises(ValueError, match="expected a list"):
            names.coerce(value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: m\ndataset_name: d.jsonl\noutput_dir: out\ncallbacks:\n  mypkg: hooks\n")
    with pytest.raises(UsageError, match=rf"^{re.escape(str(recipe))}, line 4: callbacks=.*expected a list"):
        load_train_config([str(recipe)])


def problem_config() -> TrainConfig:
    """A config breaking a value rule and a rule between keys in every section."""
    cfg = TrainConfig()
    cfg.model.torch_dtype, cfg.model.dtype = "bfloat16", "float32"
    cfg.data.max_seq_len, cfg.data.group_by_length, cfg.data.packing = 1, True, True
    cfg.lora.lora_r, cfg.lora.use_dora = 0, True
    cfg.optim.optim, cfg.optim.adam_epsilon = "sgd", 1e-6
    cfg.run.seed, cfg.run.bf16, cfg.run.fp16 = -1, True, True
    cfg.checkpoint.save_steps, cfg.checkpoint.metric_for_best_model = 0, "loss"
    cfg.distributed.num_processes, cfg.distributed.num_machines = 3, 2
    return cfg


def test_every_problem_carries_the_keys_it_is_about():
    """No key is recovered from a problem's words: each problem names its keys, and they are real keys."""
    problems = validate(problem_config())
    assert len(problems) == 14 and all(isinstance(p, Problem) for p in problems)
    assert {k for p in problems for k in p.keys} <= set(known_keys())
    assert all(p.keys[0] in p for p in problems)  # the line names the key it is located by


def test_a_problem_is_located_by_the_first_of_its_keys_that_a_file_sets(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("output_dir: out\nfp16: true\n")
    with pytest.raises(UsageError) as info:
        load_train_config([str(recipe), "--model_name_or_path", "m", "--dataset_name", "d", "--bf16", "true"])
    assert str(info.value) == f"{recipe}, line 2: bf16 and fp16 are both true; choose one"
    # The file sets both: the problem's first key (bf16) locates it, though fp16 comes first in the file.
    recipe.write_text("output_dir: out\nfp16: true\nbf16: true\n")
    with pytest.raises(UsageError) as info:
        load_train_config([str(recipe), "--model_name_or_path", "m", "--dataset_name", "d"])
    assert str(info.value) == f"{recipe}, line 3: bf16 and fp16 are both true; choose one"


def test_templates_are_the_declared_chat_template_formats():
    from shardtune.data.templates import TEMPLATES

    assert CHAT_TEMPLATES == ("none", *TEMPLATES)


# ------------------------------------------------------------------------------------------------ other names


# A value of each other name that is not its key's default, and the keys it needs beside it.
ALIAS_VALUES = {"max_length": (64, []), "max_seq_length": (64, []),
                "dataset_config": ("subset", ["--dataset_name", "org/rows"]),  # a hub data set's subset
                "use_peft": (True, []), "load_in_4bit": (True, ["--use_peft_lora", "true"]),
                "use_bnb_nested_quant": (False, ["--use_peft_lora", "true", "--use_4bit_quantization", "true"]),
                "bnb_4bit_use_double_quant": (False, ["--use_peft_lora", "true", "--use_4bit_quantization", "true"]),
                "evaluation_strategy": ("steps", []), "dtype": ("bfloat16", []),
                "activation_checkpointing": (False, []),
                "fsdp_backward_prefetch_policy": ("BACKWARD_PRE", ["--distributed_type", "FSDP"]),
                "bnb_4bit_quant_storage": ("float32", ["--use_peft_lora", "true", "--use_4bit_quantization", "true"])}


def test_the_other_names_are_the_ones_listed_here():
    """Each accepted other name has its case below, and none is dropped without this list changing."""
    assert sorted(ALIASES) == sorted(ALIAS_VALUES)


@pytest.mark.parametrize("alias", sorted(ALIAS_VALUES))
def test_another_tools_name_sets_its_key(alias, tmp_path):
    """Every accepted name acts: as the key it names."""
    d = next(d for d in all_keys() if d.name == ALIASES[alias])
    value, extra = ALIAS_VALUES[alias]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({alias: value}))
    cfg = load_train_config([str(recipe), *BASE, *extra])
    assert getattr(getattr(cfg, d.section), d.name) == value != getattr(getattr(TrainConfig(), d.section), d.name)


def test_a_key_and_its_other_name_disagreeing_in_one_place_are_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_seq_len: 128\nmax_length: 256\n")
    with pytest.raises(UsageError) as info:
        load_train_config([str(recipe), *BASE])
    assert str(info.value) == (f"{recipe}, line 2: max_seq_len=128 and max_length=256 disagree (max_length is TRL's "
                               f"name for max_seq_len); give one of them")
    recipe.write_text("max_seq_len: 128\nmax_length: 128\n")  # the same value twice loses nothing
    assert load_train_config([str(recipe), *BASE]).data.max_seq_len == 128
    assert load_train_config([str(recipe), *BASE, "--max_length", "64"]).data.max_seq_len == 64  # flag over file


# ------------------------------------------------------------------------ one description, read everywhere


def test_each_description_is_the_declarations_own_everywhere_it_is_shown(capsys):
    doc = (ROOT / "docs" / "config.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| `[^`]*` \| (.*) \|$", doc, re.M))
    properties = recipe_schema()["properties"]
    assert main(["train", "--help-keys"]) == 0
    # --help-keys: each key's line, then its description's indented lines up to the next key or section
    blocks = re.findall(r"^  --(\w+) (\(.*\))\n((?:      .*\n?)*)", capsys.readouterr().out, re.M)
    shown = {name: (header, " ".join(text.split())) for name, header, text in blocks}
    assert len(blocks) == len(shown) == len(all_keys())
    for d in all_keys():
        assert d.meta.help, f"{d.name} has no description"
        assert rows[d.name].replace("\\|", "|") == d.described()
        assert properties[d.name]["description"] == d.described()
        header, described = shown[d.name]
        assert header.startswith(f"({d.type_text()}, default ") and described == " ".join(d.described().split())


def test_the_docs_generator_describes_no_key_itself():
    """Every word docs/config.md says of a key comes from the schema: the generator names no key."""
    source = ast.parse((ROOT / "scripts" / "gen_config_docs.py").read_text())
    texts = [node.value for node in ast.walk(source) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    named = {k for k in known_keys() for text in texts if re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", text)}
    assert named == set()


# ----------------------------------------------------------------------------------------- the JSON Schema


@pytest.fixture(scope="module")
def schema() -> dict:
    """What ``shardtune config schema > shardtune.schema.json`` writes, read back."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "shardtune", "config", "schema"], capture_output=True, text=True,
                         check=True).stdout
    document = json.loads(out)
    jsonschema.Draft202012Validator.check_schema(document)
    return document


class Yaml12Loader(yaml.SafeLoader):
    """YAML as editors read it (1.2): 2e-4 is a number and an unquoted no a string, where PyYAML's 1.1 reads a
    string and false (shardtune takes both)."""

    yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
                               for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                   list("-+0123456789."))


def example_recipes(tmp_path: Path) -> dict[str, str]:
    """The repository's recipes: docs/recipe.yaml, the YAML recipes its pages show, the tests' Accelerate file, the
    demo's keys, and what shardtune writes for a user to train again (--emit-config, config.yaml)."""
    from shardtune.demo.run import DemoSettings, train_args
    from tests.test_config import ACCELERATE_FSDP

    found = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S)):
            if "apiVersion:" not in block:  # a Kubernetes manifest is no recipe
                found[f"{page.name} block {i}"] = block
    found.update({path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.yaml"))})
    found["Accelerate's fsdp_config.yaml (tests/test_config.py)"] = ACCELERATE_FSDP
    flags = train_args(DemoSettings(), Path("base"), Path("data"), Path("run"))
    found["the demo's keys"] = "".join(f"{k[2:]}: {v}\n" for k, v in zip(flags[::2], flags[1::2]))
    assert main(["estimate", "llama-3.2-1b", "--method", "qlora", "--num-gpus", "2", "--strategy", "fsdp",
                 "--emit-config", str(tmp_path / "emitted.yaml")]) == 0
    found["estimate --emit-config"] = (tmp_path / "emitted.yaml").read_text()
    busy = load_train_config([*BASE, "--use_peft_lora", "true", "--report_to", "none", "--callbacks", "a.b:C",
                              "--distributed_type", "fsdp", "--fsdp_sharding_strategy", "2"])
    for name, cfg in (("default", TrainConfig()), ("busy", busy)):
        save_resolved(cfg, tmp_path / f"{name}.yaml")
        found[f"config.yaml ({name})"] = (tmp_path / f"{name}.yaml").read_text()
    return found


def test_the_example_recipes_satisfy_the_schema_and_load(schema, tmp_path, capsys):
    examples = example_recipes(tmp_path)
    capsys.readouterr()
    assert len(examples) >= 7 and any("yaml-language-server: $schema" in text for text in examples.values())
    validator = jsonschema.Draft202012Validator(schema)
    for name, text in examples.items():
        document = yaml.load(text, Yaml12Loader)  # noqa: S506 - a SafeLoader
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(document)]
        assert errors == [], f"{name}: {errors}"
        (tmp_path / "recipe.yaml").write_text(text)
        load_train_config([str(tmp_path / "recipe.yaml"), *BASE])  # and shardtune reads each


@pytest.mark.parametrize("recipe, where", [
    ({"lora_rank": 8}, ""),  # an unknown key
    ({"lr_scheduler_type": "cosin"}, "lr_scheduler_type"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
    ({"torch_dtype": "float16"}, "torch_dtype"),  # refused with its reason by shardtune too
    ({"fsdp_version": 3}, "fsdp_version"),
    # with FSDP on: without it shardtune refused the key for being set off FSDP too, so a value it took passed
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL"}},
     "fsdp_config.fsdp_sharding_strategy"),
    ({"learning_rate": "fast"}, "learning_rate"),
])
def test_the_schema_refuses_what_shardtune_refuses(schema, recipe, where, tmp_path):
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(recipe))
    assert errors and {".".join(map(str, e.path)) for e in errors} == {where}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(UsageError) as refused:
        load_train_config([str(tmp_path / "r.yaml"), *BASE])
    key = where.split(".")[-1] or next(iter(recipe))  # refused for this key, not for another reason beside it
    assert all(key in problem for problem in str(refused.value).split(" | ")), str(refused.value)


def test_the_schema_takes_every_spelling_shardtune_reads(schema):
    """A choice in any case and the other spellings (Accelerate's MULTI_GPU, FSDP1's numbers), unset keys, a list
    as comma-separated names, other tools' names and the no-op keys."""
    recipe = {"distributed_type": "multi_gpu", "fsdp_sharding_strategy": 4, "optim": "ADAMW_TORCH", "eval_steps": None,
              "report_to": "tensorboard,wandb", "max_length": 512, "do_train": True, "dynamo_backend": "INDUCTOR",
              "fsdp_config": {"fsdp_offload_params": True, "fsdp_use_orig_params": False}}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(recipe)) == []


AGREED = [  # (a recipe, whether shardtune train takes it): the schema must say the same (found apart by an audit)
    ("resume_from_checkpoint: true\n", True), ("lora_target_modules: [q_proj, v_proj]\nuse_peft_lora: true\n", True),
    ("splits: [train, test]\n", True), ("fsdp_transformer_layer_cls_to_wrap: [LlamaDecoderLayer]\n"
                                        "distributed_type: FSDP\n", True),
    ("eval_strategy: false\n", True), ("distributed_type: NO\n", True), ("deepspeed_config: {zero_stage: 2}\n", True),
    ("init_lora_weights: pissa_niter_4\nuse_peft_lora: true\n", True), ("fsdp_offload_optimizer: false\n", True),
    ("tpu_env: []\n", True), ("model_revision: main\n", True), ("assistant_only_loss: true\n", True),
    ("max_steps: 0\n", False), ("save_safetensors: false\n", False), ("model_revision: dev\n", False),
    ("assistant_only_loss: false\n", False), ("compute_environment: AMAZON_SAGEMAKER\n", False),
    ("assistant_only_loss: false\ntrain_on_prompt: true\n", True),  # a written-out SFTConfig training every token
    ("completion_only_loss: false\ntrain_on_prompt: false\n", False),
    ("fsdp_offload_optimizer: true\n", False), ("init_lora_weights: loftq\nuse_peft_lora: true\n", False),
    ("dataset_name: [a.jsonl, b.jsonl]\n", False), ("gpu_ids: all\n", True),
    ("gpu_ids: 0\n", False),  # GPU 0 alone, not false
]


@pytest.mark.parametrize("text, taken", AGREED, ids=[text.split(":")[0] + ("-ok" if ok else "-refused")
                                                    for text, ok in AGREED])
def test_the_schema_and_train_agree(schema, tmp_path, text, taken):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    try:
        load_train_config([str(recipe), *BASE] if "dataset_name" not in text else
                          [str(recipe), "--model_name_or_path", "m", "--output_dir", "o"])
        loaded = True
    except UsageError:
        loaded = False
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(yaml.load(text, Yaml12Loader)))  # noqa: S506
    assert (loaded, not errors) == (taken, taken), errors


def test_an_unquoted_no_reads_as_no(tmp_path):
    """PyYAML (YAML 1.1) reads ``eval_strategy: no`` as false; for a key whose choices hold "no", that is what the
    recipe says (it was refused as 'false' before)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("save_strategy: no\neval_strategy: no\nlogging_strategy: no\nmixed_precision: no\n")
    cfg = load_train_config([str(recipe), *BASE])
    assert (cfg.checkpoint.save_strategy, cfg.run.eval_strategy, cfg.run.logging_strategy,
            cfg.distributed.mixed_precision) == ("no", "no", "no", "no")


def test_the_schema_takes_the_trl_and_transformers_5_spellings_shardtune_reads(schema, tmp_path):
    recipe = {"gradient_checkpointing_kwargs": {"use_reentrant": False}, "warmup_steps": 0.03}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(recipe)) == []
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert load_train_config([str(tmp_path / "r.yaml"), *BASE]).optim.warmup_ratio == 0.03
    assert list(jsonschema.Draft202012Validator(schema).iter_errors({"gradient_checkpointing_kwargs": {"x": 1}}))
    assert list(jsonschema.Draft202012Validator(schema).iter_errors({"warmup_steps": 2.5}))  # refused by shardtune


def test_a_qlora_recipe_in_bitsandbytes_config_names_builds_that_quantisation(tmp_path):
    """A QLoRA recipe copied from Transformers' BitsAndBytesConfig: bnb_4bit_use_double_quant was an unknown key
    ("did you mean 'bnb_4bit_quant_type'?"). Each of its keys reaches the BitsAndBytesConfig the base loads with."""
    import torch

    from shardtune.train.model import _quantization_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("use_peft_lora: true\nload_in_4bit: true\nbnb_4bit_quant_type: fp4\n"
                      "bnb_4bit_use_double_quant: false\nbnb_4bit_compute_dtype: float16\n"
                      "bnb_4bit_quant_storage: float32\n")
    built = _quantization_config(load_train_config([str(recipe), *BASE]).lora)
    assert (built.bnb_4bit_quant_type, built.bnb_4bit_use_double_quant, built.bnb_4bit_compute_dtype,
            built.bnb_4bit_quant_storage) == ("fp4", False, torch.float16, torch.float32)


def test_a_written_out_bitsandbytes_config_loads_and_builds_the_same_quantisation(tmp_path):
    """Its other keys were offered other keys' spellings: llm_int8_skip_modules lora_target_modules,
    llm_int8_has_fp16_weight init_lora_weights, quant_method run_name. A BitsAndBytesConfig written out (its public
    keys) now loads as the QLoRA recipe it is, and gives back the same BitsAndBytesConfig; a value that would act is
    refused, naming what to do."""
    import torch
    from transformers import BitsAndBytesConfig

    from shardtune.train.model import _quantization_config

    theirs = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False,
                                bnb_4bit_compute_dtype=torch.float16, bnb_4bit_quant_storage=torch.float32)
    written = {k: v for k, v in json.loads(theirs.to_json_string(use_diff=False)).items() if not k.startswith("_")}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"use_peft_lora": True, **written}))
    ours = _quantization_config(load_train_config([str(recipe), *BASE]).lora).to_dict()
    assert ours == theirs.to_dict()
    for name, value, says in (("llm_int8_skip_modules", "lm_head,embed_tokens", "quantises every linear layer but "
                              "the output head"), ("quant_method", "gptq", "set it to bitsandbytes"),
                             ("llm_int8_enable_fp32_cpu_offload", "true", "fsdp_offload_params true")):
        with pytest.raises(UsageError, match=f"{name}='{value}' would change what runs .*{says}"):
            load_train_config([str(recipe), *BASE, f"--{name}", value])
