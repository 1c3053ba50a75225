"""Each key is declared once (shardtune/config/schema.py), and everything else is read from that declaration: the
coercion and checks of a value, a problem's key, --help-keys and docs/config.md."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Literal

import pytest
import yaml

from shardtune.cli import main
from shardtune.config import load_train_config
from shardtune.config.keys import Problem, declared, key
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
    assert count.problems(0) == ["count=0 must be at least 1"] and ratio.problems(1.0) == ["ratio=1.0 must be in [0, 1)"]
    assert names.problems(["x", "q"]) == ["names='q' is not accepted; use one of x, y"]
    assert all(p.keys == (p.split("=")[0],) for d in (kind, count) for p in d.problems("GH" if d is kind else 0))


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


def test_templates_are_the_declared_chat_template_formats():
    from shardtune.data.templates import TEMPLATES

    assert CHAT_TEMPLATES == ("none", *TEMPLATES)


# ------------------------------------------------------------------------------------------------ other names


# A value of each other name that is not its key's default, and the keys it needs beside it.
ALIAS_VALUES = {"max_length": (64, []), "max_seq_length": (64, []), "dataset_config": ("subset", []),
                "use_peft": (True, []), "load_in_4bit": (True, ["--use_peft_lora", "true"]),
                "use_bnb_nested_quant": (False, []), "evaluation_strategy": ("steps", [])}


@pytest.mark.parametrize("alias", sorted(ALIASES))
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
    assert main(["train", "--help-keys"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    for d in all_keys():
        assert d.meta.help, f"{d.name} has no description"
        assert rows[d.name].replace("\\|", "|") == d.described()
        assert f"--{d.name} ({d.type_text()}, default " in shown and " ".join(d.described().split()) in shown


def test_the_docs_generator_describes_no_key_itself():
    """Every word docs/config.md says of a key comes from the schema: the generator names no key."""
    source = ast.parse((ROOT / "scripts" / "gen_config_docs.py").read_text())
    texts = [node.value for node in ast.walk(source) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    named = {k for k in known_keys() for text in texts if re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", text)}
    assert named == set()


def test_an_unquoted_no_reads_as_no(tmp_path):
    """PyYAML (YAML 1.1) reads ``eval_strategy: no`` as false; for a key whose choices hold "no", that is what the
    recipe says (it was refused as 'false' before)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("save_strategy: no\neval_strategy: no\nlogging_strategy: no\nmixed_precision: no\n")
    cfg = load_train_config([str(recipe), *BASE])
    assert (cfg.checkpoint.save_strategy, cfg.run.eval_strategy, cfg.run.logging_strategy,
            cfg.distributed.mixed_precision) == ("no", "no", "no", "no")
