"""Generation: the KV cache changes nothing but the speed; sampling, stopping, adapters and the CLI behave."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from shardtune.cli import main
from shardtune.errors import UsageError
from shardtune.cli.generate import run_chat
from shardtune.infer.generate import (ChatSession, GenerationStats, _Streamer, encode_prompt, generate,
                                      generate_batch, load_for_generation, stop_token_ids)

ANSWER = ("one two three four five six seven eight nine ten the cat and the dog are red green blue small large "
          "quick slow happy sad tree house car road river bird fish")
STORY_START = "Once upon a time"
STORY = STORY_START + " the model was small and the batch was large and the memory was yes"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from two threads, and on a loaded machine a second thread makes every op wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama folder trained to answer 'Count please' with ANSWER and to end STORY with EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.testing.tiny import make_model_folder

    folder = make_model_folder(tmp_path_factory.mktemp("trained") / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    chat = encode_prompt(tokenizer, "Count please") + tokenizer(ANSWER + "<|im_end|>", add_special_tokens=False)[
        "input_ids"]
    story = tokenizer(STORY)["input_ids"] + [tokenizer.eos_token_id]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(200):
        for seq in (chat, story):
            ids = torch.tensor([seq])
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(trained):
    return load_for_generation(trained, device="cpu")


def greedy_reference(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding written out: the whole sequence through the model, the argmax of the last position."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_kv_cache_matches_no_cache_token_for_token(loaded):
    """With the cache each step feeds the model one new token (the prompt once, first); without it, the whole
    sequence again: both give the written-out greedy tokens."""
    model, tokenizer = loaded
    fed: list[int] = []  # tokens each forward is given
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        # a memorised reply, and text the model never saw (so it wanders far from anything learned)
        for prompt in (encode_prompt(tokenizer, "Count please"),
                       tokenizer("Seven blue birds and 42 red cars")["input_ids"]):
            fed.clear()
            with_cache = generate(model, tokenizer, prompt, max_new_tokens=60, stop_ids=(), use_cache=True)
            assert fed == [len(prompt)] + [1] * 59
            fed.clear()
            without = generate(model, tokenizer, prompt, max_new_tokens=60, stop_ids=(), use_cache=False)
            assert fed == [len(prompt) + i for i in range(60)]
            assert len(with_cache) == 60
            assert with_cache == without == greedy_reference(model, prompt, 60)
    finally:
        hook.remove()


def test_the_models_own_generation_defaults_do_not_change_what_is_asked(loaded):
    """A generation_config.json may ask for sampling, top-k or a repetition penalty: greedy stays greedy."""
    model, tokenizer = loaded
    prompt = tokenizer("Seven blue birds and 42 red cars")["input_ids"]
    saved = model.generation_config
    try:
        model.generation_config = type(saved)(do_sample=True, temperature=0.3, top_k=2, repetition_penalty=5.0,
                                              no_repeat_ngram_size=1, max_new_tokens=3)
        assert generate(model, tokenizer, prompt, max_new_tokens=40, stop_ids=()) == \
            greedy_reference(model, prompt, 40)
    finally:
        model.generation_config = saved


def test_greedy_reproduces_the_trained_reply_and_stops_at_end_of_turn(loaded):
    model, tokenizer = loaded
    stats = GenerationStats()
    new = generate(model, tokenizer, encode_prompt(tokenizer, "Count please"), max_new_tokens=100, stats=stats)
    assert len(new) >= 30
    assert tokenizer.decode(new) == ANSWER
    assert stats.stop_reason == "stop_token"
    assert stats.stop_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stats.new_tokens == len(new) and stats.decode_steps == len(new)


def test_stops_at_eos_and_at_max_new_tokens(loaded):
    model, tokenizer = loaded
    prompt = tokenizer(STORY_START)["input_ids"]
    stats = GenerationStats()
    new = generate(model, tokenizer, prompt, max_new_tokens=100, stats=stats)
    assert tokenizer.decode(prompt + new, skip_special_tokens=True) == STORY
    assert stats.stop_token_id == tokenizer.eos_token_id
    assert tokenizer.eos_token_id in stop_token_ids(model, tokenizer)
    short = generate(model, tokenizer, prompt, max_new_tokens=5, stats=stats)
    assert short == new[:5] and stats.stop_reason == "max_new_tokens"


def test_sampling_is_reproducible_per_seed_and_differs_across_seeds(tmp_path):
    from shardtune.testing.tiny import make_model_folder

    # the untrained model spreads its probability, so different seeds must give different text
    model, tokenizer = load_for_generation(make_model_folder(tmp_path / "random"), device="cpu")
    prompt = encode_prompt(tokenizer, "hello")
    runs = {seed: generate(model, tokenizer, prompt, max_new_tokens=30, temperature=1.0, top_p=0.95, seed=seed,
                           stop_ids=()) for seed in range(4)}
    again = generate(model, tokenizer, prompt, max_new_tokens=30, temperature=1.0, top_p=0.95, seed=2, stop_ids=())
    assert again == runs[2]
    assert len({tuple(r) for r in runs.values()}) == 4
    cached_off = generate(model, tokenizer, prompt, max_new_tokens=30, temperature=1.0, top_p=0.95, seed=2,
                          stop_ids=(), use_cache=False)
    assert cached_off == runs[2]
    greedy = generate(model, tokenizer, prompt, max_new_tokens=30, stop_ids=())
    tiny_p = generate(model, tokenizer, prompt, max_new_tokens=30, temperature=1.0, top_p=1e-6, seed=3, stop_ids=())
    assert tiny_p == greedy
    # top_k 1 keeps only the likeliest token: sampling decodes greedily (without it, seed 3 samples other text)
    assert generate(model, tokenizer, prompt, max_new_tokens=30, temperature=1.0, seed=3, stop_ids=()) != greedy
    top_1 = generate(model, tokenizer, prompt, max_new_tokens=30, temperature=1.0, top_k=1, seed=3, stop_ids=())
    assert top_1 == greedy
    # A huge repetition_penalty leaves no token of the prompt or of the reply to come back, where greedy repeats
    assert len(set(greedy)) < len(greedy)
    penalised = generate(model, tokenizer, prompt, max_new_tokens=30, repetition_penalty=1e9, stop_ids=())
    assert len(set(penalised)) == len(penalised) == 30 and not set(penalised) & set(prompt)


def test_stream_pieces_join_to_the_decoded_reply_without_splitting_characters(loaded):
    model, tokenizer = loaded
    pieces: list[str] = []
    new = generate(model, tokenizer, encode_prompt(tokenizer, "Count please"), max_new_tokens=100,
                   stream=pieces.append)
    assert len(pieces) > 10 and "".join(pieces) == tokenizer.decode(new)
    # one token at a time, as generate hands them on: no piece splits a character
    text = "naïve café — 日本語 🙂 ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    streamed: list[str] = []
    streamer = _Streamer(tokenizer, streamed.append, stops={tokenizer.eos_token_id})
    for value in ([1, 2], *([i] for i in ids), [tokenizer.eos_token_id]):  # the prompt first, a stop token last
        streamer.put(torch.tensor([value]))
    streamer.end()
    assert "".join(streamed) == text and not any("\ufffd" in piece for piece in streamed)


def _make_adapter(base_folder, adapter_folder):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at zero; make the adapter change the model
                param.normal_(0, 0.3)
    peft_model.save_pretrained(adapter_folder)
    return peft_model


def test_adapter_folder_loads_and_matches_the_merged_model(trained, loaded, tmp_path):
    base_model, tokenizer = loaded
    peft_model = _make_adapter(trained, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    merged = peft_model.merge_and_unload().eval()
    adapted, _ = load_for_generation(tmp_path / "adapter", device="cpu")
    prompt = encode_prompt(tokenizer, "Count please")
    from_adapter = generate(adapted, tokenizer, prompt, max_new_tokens=40, stop_ids=())
    assert from_adapter == generate(merged, tokenizer, prompt, max_new_tokens=40, stop_ids=())
    assert from_adapter != generate(base_model, tokenizer, prompt, max_new_tokens=40, stop_ids=())
    assert from_adapter == generate(adapted, tokenizer, prompt, max_new_tokens=40, stop_ids=(), use_cache=False)


def test_an_adapter_of_a_run_on_a_hub_name_loads_its_base_from_the_local_cache(trained, tmp_path, monkeypatch,
                                                                                capsys):
    """A run trained on model_name_or_path org/name keeps that name in final/adapter_config.json; generate, chat
    and merge refused it ("not a local model folder"), though training had just read it from the local cache."""
    import shutil

    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(trained, snapshot)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    _make_adapter(trained, tmp_path / "adapter")
    on_local_base, tokenizer = load_for_generation(tmp_path / "adapter", device="cpu")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "base_model_name_or_path": "org/tiny"}))
    on_cached_base, _ = load_for_generation(tmp_path / "adapter", device="cpu")
    prompt = encode_prompt(tokenizer, "Count please")
    assert generate(on_cached_base, tokenizer, prompt, max_new_tokens=20, stop_ids=()) == \
        generate(on_local_base, tokenizer, prompt, max_new_tokens=20, stop_ids=())
    assert main(["merge", str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    shutil.rmtree(cache)  # nothing there: said so, and nothing downloaded
    with pytest.raises(UsageError, match=rf"^{config_file}: base_model_name_or_path 'org/tiny' is neither a local "
                                         rf"model folder nor in the local Hugging Face cache \(nothing is downloaded"):
        load_for_generation(tmp_path / "adapter")


def test_bad_paths_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="not a folder"):
        load_for_generation(tmp_path / "missing")
    with pytest.raises(UsageError, match="neither config.json nor adapter_config.json"):
        load_for_generation(tmp_path)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/remote"}))
    with pytest.raises(UsageError, match="base_model_name_or_path 'org/remote'"):
        load_for_generation(tmp_path / "adapter")


class _Timeline(io.StringIO):
    """stdout that notes, for each write and flush, how many module forwards had run by then."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0
        self.events: list[tuple[str, str, int]] = []

    def write(self, text: str) -> int:
        self.events.append(("write", text, self.forwards))
        return super().write(text)

    def flush(self) -> None:
        self.events.append(("flush", "", self.forwards))


def test_cli_generate_streams_the_greedy_reply(trained, capsys, monkeypatch):
    out = _Timeline()
    monkeypatch.setattr("sys.stdout", out)

    def count(*_):
        out.forwards += 1

    hook = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        assert main(["generate", str(trained), "--prompt", "Count please", "--max_new_tokens", "100"]) == 0
    finally:
        hook.remove()
    monkeypatch.undo()
    assert out.getvalue() == ANSWER + "\n"
    # streamed as it is decoded: the words come out piece by piece while the model still runs, each piece flushed
    # before the next forward (written whole at the end, or buffered, the reply would come out in one moment)
    writes = [(i, at) for i, (kind, text, at) in enumerate(out.events) if kind == "write" and text.strip()]
    assert len({at for _, at in writes}) > len(ANSWER.split()) // 2 and writes[0][1] < out.forwards
    assert all(out.events[i + 1] == ("flush", "", at) for i, at in writes)
    captured = capsys.readouterr()
    # which stop token ended it: the template's end of turn for the chat, EOS for the plain story (it said
    # "stopped by stop_token" for both)
    assert "stopped at <|im_end|>" in captured.err and "KV cache on" in captured.err
    assert main(["generate", str(trained), "--prompt", STORY_START, "--no-chat-template", "--no-cache"]) == 0
    captured = capsys.readouterr()
    assert STORY_START + captured.out == STORY + "\n"
    assert "stopped at <|end_of_text|>; KV cache off" in captured.err
    # One new token comes from the prefill: nothing was decoded, so no speed is given (it said "nan tokens/s").
    assert main(["generate", str(trained), "--prompt", "Count please", "--max_new_tokens", "1"]) == 0
    assert "; 1 new token; stopped by max_new_tokens;" in capsys.readouterr().err


def test_a_reader_that_leaves_the_pipe_stops_generate_without_a_disk_error(trained, capsys, monkeypatch):
    """'shardtune generate ... | head -c 5': the closed pipe was reported as 'Broken pipe; free disk space, fix the
    permissions or give another path'. It ends quietly now, as Unix tools do, with exit code 1."""
    tried = []

    class ClosedPipe(io.StringIO):
        def write(self, text):
            tried.append(text)
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["generate", str(trained), "--prompt", "Count please", "--max_new_tokens", "5"]) == 1
    assert capsys.readouterr().err == ""
    assert len(tried) == 1, tried  # generation stopped at the first piece the closed pipe refused, not after all 5


def test_cli_rejects_bad_sampling_values(trained, capsys):
    assert main(["generate", str(trained), "--prompt", "hi", "--top_p", "1.5"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    # A nucleus under greedy decoding (temperature's default, 0) changed nothing and said nothing: refused, as
    # every accepted option acts; with a temperature it samples.
    assert main(["generate", str(trained), "--prompt", "hi", "--top_p", "0.9"]) == 2
    assert "top_p 0.9 acts only when sampling, and temperature 0 decodes greedily" in capsys.readouterr().err
    assert main(["generate", str(trained), "--prompt", "hi", "--top_p", "0.9", "--temperature", "0.7",
                 "--max_new_tokens", "3"]) == 0
    assert main(["generate", str(trained), "--prompt", "hi", "--seed", "3"]) == 2  # greedy: nothing is drawn
    assert "--seed 3 acts only when sampling, and temperature 0 decodes greedily" in capsys.readouterr().err
    assert main(["generate", str(trained), "--prompt", "hi", "--top_k", "5"]) == 2
    assert "top_k 5 acts only when sampling, and temperature 0 decodes greedily" in capsys.readouterr().err
    assert main(["generate", str(trained), "--prompt", "hi", "--repetition_penalty", "0"]) == 2
    assert "repetition_penalty must be a number above 0 (got 0)" in capsys.readouterr().err


def test_a_template_that_takes_no_system_turn_refuses_system_in_one_line(trained, tmp_path, capsys, monkeypatch):
    """Gemma's and Mistral's templates raise on a system turn (raise_exception): --system was a jinja traceback."""
    import shutil

    folder = shutil.copytree(trained, tmp_path / "no_system")
    template = folder / "chat_template.jinja"
    template.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                        "{% endif %}" + template.read_text())
    assert main(["generate", str(folder), "--prompt", "Count please", "--system", "Be brief."]) == 2
    err = capsys.readouterr().err
    assert "refuses this conversation (System role not supported): leave out --system" in err
    assert "Traceback" not in err and err.count("\n") == 1
    monkeypatch.setattr("sys.stdin", io.StringIO("Count please\n"))
    assert main(["chat", str(folder), "--system", "Be brief.", "--max_new_tokens", "100"]) == 2
    assert "leave out --system" in capsys.readouterr().err
    # without the system turn the same folder answers as it was trained to
    assert main(["generate", str(folder), "--prompt", "Count please", "--max_new_tokens", "100"]) == 0
    assert capsys.readouterr().out == ANSWER + "\n"


def test_chat_keeps_the_conversation_and_resets(trained, loaded, capsys, monkeypatch):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer, options={"max_new_tokens": 100})
    assert session.reply("Count please") == ANSWER
    second_prompt = encode_prompt(tokenizer, messages=session.messages + [{"role": "user", "content": "again"}])
    # the second turn's prompt holds the first exchange: the model sees the whole conversation
    assert tokenizer.decode(second_prompt).count(ANSWER) == 1
    session.reset()
    assert session.messages == []

    monkeypatch.setattr("sys.stdin", io.StringIO("Count please\n/reset\n/bogus\nCount please\n/exit\nnever read\n"))
    assert main(["chat", str(trained), "--max_new_tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> " + ANSWER + "\n") == 2
    assert "[conversation reset]" in out and "unknown command /bogus" in out and "never read" not in out
    monkeypatch.setattr("sys.stdin", io.StringIO("Count please\n"))  # end of input ends the chat
    assert main(["chat", str(trained), "--max_new_tokens", "100"]) == 0
    assert capsys.readouterr().out.count(ANSWER) == 1


def test_ctrl_c_during_a_reply_stops_the_reply_and_the_chat_goes_on(loaded):
    """Ctrl-C mid-reply ended the whole chat (exit 130) and the conversation with it; terminal chats stop the reply
    there. The interrupted turn is left out, so the next message does not see half an answer."""
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer, options={"max_new_tokens": 100})
    stops = iter([True])

    def interrupted(piece: str) -> None:
        if piece.strip() and next(stops, False):
            raise KeyboardInterrupt

    reply = session.reply

    def reply_with_ctrl_c(text, stream=None, note=None):
        return reply(text, stream=lambda piece: (stream(piece), interrupted(piece)), note=note)

    session.reply = reply_with_ctrl_c
    out = io.StringIO()
    try:
        run_chat(session, io.StringIO("Count please\nCount please\n"), out)
    except KeyboardInterrupt:  # (not let through: pytest would take it for the user's and stop the session)
        pytest.fail("Ctrl-C during a reply ended the chat")
    first, said, second = out.getvalue().split("\n", 2)
    assert first.startswith("assistant> ") and ANSWER.startswith(first[len("assistant> "):]) and first != \
        "assistant> " + ANSWER  # stopped after its first words
    assert said == "[reply stopped; the message and its reply are left out of the conversation]"
    assert second == "assistant> " + ANSWER + "\n"
    assert session.messages == [{"role": "user", "content": "Count please"}, {"role": "assistant", "content": ANSWER}]


def test_generation_stops_at_the_models_last_position_and_chat_drops_its_earliest_turns(loaded, monkeypatch,
                                                                                           capsys):
    """Past max_position_embeddings a model's output is garbage (transformers only warned): generate stops at the
    last position and says so, a prompt beyond it is refused in one line, and a chat drops its earliest turns
    (saying so) or, for one message too long alone, says so and goes on."""
    model, tokenizer = loaded
    prompt = encode_prompt(tokenizer, "Count please")
    monkeypatch.setattr(model.config, "max_position_embeddings", len(prompt) + 3)
    stats = GenerationStats()
    assert len(generate(model, tokenizer, prompt, max_new_tokens=100, stop_ids=set(), stats=stats)) == 3
    assert stats.stop_reason == "context_length"
    with pytest.raises(UsageError, match=rf"^the prompt is {len(prompt) + 5} tokens, and the model covers "
                                         rf"{len(prompt) + 3} positions \(its config: max_position_embeddings\): "
                                         rf"shorten it$"):
        generate(model, tokenizer, prompt + prompt[-5:], max_new_tokens=10)
    # the second turn's prompt, with the first exchange, leaves less room than a reply (4 tokens): it goes
    monkeypatch.setattr(model.config, "max_position_embeddings", 2048)
    notes = []
    session = ChatSession(model, tokenizer, options={"max_new_tokens": 4})
    session.reply("Count please", note=notes.append)
    second = len(encode_prompt(tokenizer, messages=[*session.messages, {"role": "user", "content": "Count please"}]))
    monkeypatch.setattr(model.config, "max_position_embeddings", second + 2)
    session.reply("Count please", note=notes.append)
    assert notes == [f"the conversation went beyond the model's {second + 2} positions: its earliest 2 turns are "
                     f"left out from here"]
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    kept = list(session.messages)
    out = io.StringIO()
    run_chat(session, io.StringIO("Count please " * 40 + "\n"), out)
    assert out.getvalue().startswith("[the prompt is ") and out.getvalue().endswith(": shorten it]\n")
    assert session.messages == kept  # the refused message is not kept


@pytest.mark.parametrize("template,appends_eos", [("none", False), ("llama-3", False), ("none", True)])
def test_prompt_ids_are_the_training_rows_prompt(tmp_path, template, appends_eos):
    """What generation feeds the model is what the trainer put before the first target token of the same chat,
    with one BOS, also for a tokenizer that appends EOS to whatever it encodes with special tokens."""
    from tokenizers.processors import TemplateProcessing

    from shardtune.config.schema import DataConfig
    from shardtune.data.encode import IGNORE, encode_example, special_prefix
    from shardtune.data.templates import load_tokenizer
    from shardtune.testing.tiny import make_model_folder

    folder = make_model_folder(tmp_path / "model", num_layers=1)
    tokenizer = load_tokenizer(str(folder), DataConfig(chat_template_format=template,
                                                       add_special_tokens=template == "llama-3"))
    if appends_eos:
        bos, eos = tokenizer.bos_token, tokenizer.eos_token
        tokenizer._tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, tokenizer.bos_token_id), (eos, tokenizer.eos_token_id)])
        assert tokenizer("a").input_ids[-1] == tokenizer.eos_token_id
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2 plus 3?"}]
    example = {"kind": "chat", "messages": messages + [{"role": "assistant", "content": "5"}], "target_from": 2,
               "where": "test"}
    ids, labels = encode_example(example, tokenizer, prefix=special_prefix(tokenizer), train_on_prompt=False,
                                 chat_template_format=template)
    first_target = next(i for i, label in enumerate(labels) if label != IGNORE)
    prompt = encode_prompt(tokenizer, messages=messages)
    assert prompt == ids[:first_target]
    assert prompt.count(tokenizer.bos_token_id) == 1
    # (Llama 3's EOS is its end of turn once its tokens are added: every turn of the prompt ends in it.)
    assert prompt.count(tokenizer.eos_token_id) == (2 if template == "llama-3" else 0)


def test_a_run_folder_or_a_checkpoint_given_to_generate_names_what_to_give(tmp_path):
    """They were "holds neither config.json nor adapter_config.json", with no word of final/ or export."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "trainer_state.json").write_text("{}")
    with pytest.raises(UsageError, match=rf"^'{run}' is a training run's output_dir: give its final/ "
                                         rf"\({run / 'final'}\)$"):
        load_for_generation(run)
    step = run / "checkpoints" / "step-2"
    with pytest.raises(UsageError, match=rf"^'{step}' is a training checkpoint: export it first \(shardtune export "
                                         rf"{step} OUT\), then give OUT$"):
        load_for_generation(step)
    # a run still going, or stopped before final/, and its checkpoints/ folder: they said "holds neither
    # config.json nor adapter_config.json ... (e.g. a training run's final/)", a folder the run has not written
    (run / "final").rmdir()
    for step_n in (2, 4, 6):
        (run / "checkpoints" / f"step-{step_n}").mkdir(exist_ok=True)
        (run / "checkpoints" / f"step-{step_n}" / "manifest.json").write_text("{}")
    (run / "checkpoints" / "step-6" / "manifest.json").unlink()  # being written: not complete
    newest = run / "checkpoints" / "step-4"
    for given in (run, run / "checkpoints"):
        with pytest.raises(UsageError) as refused:
            load_for_generation(given)
        assert str(refused.value) == (f"'{given}' holds training checkpoints, not a model: export one first, e.g. "
                                      f"the newest (shardtune export {newest} OUT), then give OUT; a run that "
                                      f"finished has its model in OUTPUT_DIR/final")


def test_a_run_trained_on_plain_prompts_is_prompted_as_it_trained(tmp_path, capsys, monkeypatch):
    """A run's final/ trained on plain prompt/completion rows was prompted through the chat template by default,
    a format it never saw; summary.json now says how the run wrote its prompts and generate follows it (with a
    note), --chat-template overriding. A chat-trained run keeps the template."""
    from transformers import AutoTokenizer

    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import logging_restored, write_chat_data

    make_model_folder(tmp_path / "model")
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} plus 1? ",
                                                              "completion": f"{i + 1}."}) + "\n" for i in range(16)))
    write_chat_data(tmp_path / "chat.jsonl", rows=16)
    for data in ("plain", "chat"):
        with logging_restored():
            assert main(["train", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name",
                         str(tmp_path / f"{data}.jsonl"), "--output_dir", str(tmp_path / data), "--max_steps", "1",
                         "--use_peft_lora", "true", "--max_seq_len", "64", "--predict_memory", "false"]) == 0
    styles = [json.loads((tmp_path / data / "summary.json").read_text())["prompt_style"] for data in ("plain", "chat")]
    assert styles == ["plain text", "chat template"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "plain" / "final")
    prompt = "What is 3 plus 1? "
    counts = {}
    for name, flags in (("default", []), ("template", ["--chat-template"])):
        capsys.readouterr()
        assert main(["generate", str(tmp_path / "plain" / "final"), "--prompt", prompt, "--max_new_tokens", "2",
                     *flags]) == 0
        err = capsys.readouterr().err
        counts[name] = int(re.search(r"\[(\d+) prompt tokens", err)[1])
        assert ("the run trained on plain prompts" in err) == (name == "default"), err
    assert counts == {"default": len(encode_prompt(tokenizer, prompt, chat_template=False)),
                      "template": len(encode_prompt(tokenizer, prompt))}
    assert counts["default"] < counts["template"]
    assert main(["generate", str(tmp_path / "chat" / "final"), "--prompt", "What is 3 plus 1?",
                 "--max_new_tokens", "2"]) == 0
    assert "plain prompts" not in capsys.readouterr().err
    # its merge and its exported checkpoint too: they were prompted through the chat template, having no
    # summary.json beside them; the export list now carries the run's prompt_style
    assert main(["merge", str(tmp_path / "plain" / "final"), str(tmp_path / "merged")]) == 0
    assert main(["export", str(tmp_path / "plain" / "checkpoints" / "step-1"), str(tmp_path / "exported")]) == 0
    for folder in ("merged", "exported"):
        capsys.readouterr()
        assert main(["generate", str(tmp_path / folder), "--prompt", prompt, "--max_new_tokens", "2"]) == 0
        err = capsys.readouterr().err
        assert "the run trained on plain prompts" in err and f"[{counts['default']} prompt tokens" in err, err
    # chat always uses the template: for the plain-trained run it says so
    for data in ("plain", "chat"):
        monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
        assert main(["chat", str(tmp_path / data / "final")]) == 0
        assert ("the run trained on plain prompts" in capsys.readouterr().err) == (data == "plain")


def test_rows_an_adapter_added_are_loaded_without_drawing_them_first(tmp_path, monkeypatch):
    """An adapter whose run added tokens (llama-3's specials) grew the base's embeddings at every generate, merge and
    export with transformers' mean resizing: the mean and covariance of every row (a minute and more on a 128k
    vocabulary) and a warning that the new rows are drawn at random, for rows the adapter's saved ones replace."""
    from safetensors.torch import load_file
    from transformers import PreTrainedModel

    from shardtune.testing.tiny import make_model_folder
    from tests.trainutil import logging_restored, write_chat_data

    make_model_folder(tmp_path / "model", num_layers=1)
    write_chat_data(tmp_path / "chat.jsonl", rows=16)
    run = tmp_path / "run"
    with logging_restored():
        assert main(["train", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name",
                     str(tmp_path / "chat.jsonl"), "--output_dir", str(run), "--max_steps", "1", "--use_peft_lora",
                     "true", "--chat_template_format", "llama-3", "--add_special_tokens", "true", "--max_seq_len", "64",
                     "--learning_rate", "0.05", "--predict_memory", "false"]) == 0

    def drawn(*args, **kwargs):
        raise AssertionError("the added rows were drawn around the mean of the others")

    monkeypatch.setattr(PreTrainedModel, "_init_added_embeddings_weights_with_mean", drawn)
    model, tokenizer = load_for_generation(run / "final", device="cpu")
    saved = load_file(run / "final" / "adapter_model.safetensors")
    delta = next(v for k, v in saved.items() if "embed_tokens" in k)
    added = tokenizer.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    embedded = model.get_input_embeddings()(torch.tensor(added))
    assert torch.equal(embedded, delta.to(embedded.dtype))  # the trained rows, as saved
    assert main(["merge", str(run / "final"), str(tmp_path / "merged")]) == 0
    assert main(["export", str(run / "checkpoints" / "step-1"), str(tmp_path / "exported")]) == 0
    prompt = encode_prompt(tokenizer, "What is 2 plus 3?")
    reply = generate(model, tokenizer, prompt, max_new_tokens=8, stop_ids=())
    for folder in ("merged", "exported"):
        other, _ = load_for_generation(tmp_path / folder, device="cpu")
        assert generate(other, tokenizer, prompt, max_new_tokens=8, stop_ids=()) == reply


def test_generate_stops_at_the_end_of_turn_token_the_chat_template_writes(tmp_path):
    """A template whose replies end in a token of its own (Command R's <|END_OF_TURN_TOKEN|>), which neither the
    EOS nor the generation config names: training took it as each reply's last target, so the reply ends there,
    as a merged export's generation_config (export.stop_at_tokenizer_eos) makes transformers stop."""
    from shardtune.testing.tiny import make_model_folder, make_tokenizer

    start, end = "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>"
    tokenizer = make_tokenizer()
    tokenizer.add_tokens([start, end], special_tokens=True)
    tokenizer.chat_template = ("{% for m in messages %}{{ '" + start + "' + m['role'] + ': ' + m['content'] + '"
                               + end + "' }}{% endfor %}{% if add_generation_prompt %}{{ '" + start
                               + "assistant: ' }}{% endif %}")
    folder = make_model_folder(tmp_path / "model", tokenizer=tokenizer, num_layers=1)
    model, tokenizer = load_for_generation(folder, device="cpu")
    end_id = tokenizer.convert_tokens_to_ids(end)
    reply = tokenizer("one two three", add_special_tokens=False)["input_ids"]
    past = tokenizer(" four five six seven eight", add_special_tokens=False)["input_ids"]
    prompt = encode_prompt(tokenizer, "Count please")
    seq = prompt + reply + [end_id] + past  # what follows the end of turn is what an unstopped reply would go on to
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(60):
        ids = torch.tensor([seq])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert generate(model, tokenizer, prompt, max_new_tokens=len(seq), stop_ids=())[:len(reply) + 1 + len(past)] \
        == reply + [end_id] + past  # the model learned to go on past its end of turn
    stats = GenerationStats()
    assert generate(model, tokenizer, prompt, max_new_tokens=len(seq), stats=stats) == reply
    assert stats.stop_token_id == end_id and stats.stop_reason == "stop_token"


def test_a_batch_of_prompts_gives_each_the_reply_it_gets_alone(loaded):
    """Left-padded rows of different lengths, the pads masked out: greedy, each reply is token for token the one
    generate gives its prompt alone, stop tokens and reasons too (a row that stopped is padded after its stop);
    sampled in batches of one, each is the reply its seed draws alone."""
    model, tokenizer = loaded
    prompts = [encode_prompt(tokenizer, "Count please"), tokenizer(STORY_START)["input_ids"],
               tokenizer("Seven blue birds and 42 red cars on the long road by the river")["input_ids"],
               encode_prompt(tokenizer, "Count please", system="You count."), tokenizer("The")["input_ids"]]
    assert len({len(p) for p in prompts}) == len(prompts)
    batch_rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: batch_rows.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        batched = generate_batch(model, tokenizer, prompts, batch_size=3, max_new_tokens=40)
    finally:
        hook.remove()
    assert set(batch_rows) == {3, 2}  # two batches: 3 prompts, then 2
    for prompt, (new_ids, stats) in zip(prompts, batched):
        alone = GenerationStats()
        assert new_ids == generate(model, tokenizer, prompt, max_new_tokens=40, stats=alone)
        assert (stats.new_tokens, stats.stop_reason, stats.stop_token_id, stats.prompt_tokens) == \
            (alone.new_tokens, alone.stop_reason, alone.stop_token_id, alone.prompt_tokens)
    assert tokenizer.decode(batched[0][0]) == ANSWER and batched[0][1].stop_token_id == \
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert batched[1][1].stop_token_id == tokenizer.eos_token_id
    assert len({stats.new_tokens for _, stats in batched}) > 1  # rows that stopped early were padded after
    sampled = generate_batch(model, tokenizer, prompts, batch_size=1, max_new_tokens=20, temperature=1.5, seed=4)
    assert [ids for ids, _ in sampled] == [generate(model, tokenizer, prompt, max_new_tokens=20, temperature=1.5,
                                                    seed=4) for prompt in prompts]


def test_cli_generate_prompt_file_prints_each_reply_as_generate_gives_it(trained, loaded, tmp_path, capsys):
    """--prompt_file: a text file's lines and a .jsonl file's prompt and messages rows (a last assistant turn, the
    reference reply, left out), batched; each JSON line's reply and counts are those of the prompt generated alone."""
    model, tokenizer = loaded
    text_file = tmp_path / "prompts.txt"
    text_file.write_text("Count please\n\nSeven blue birds\nHow many red cars are on the road by the river\n")
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text(json.dumps({"prompt": "Count please"}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "You count."}, {"role": "user", "content": "Count please"},
                      {"role": "assistant", "content": "the reference"}]}) + "\n" + json.dumps(  # TRL's prompt-only
        {"prompt": [{"role": "system", "content": "You count."}, {"role": "user", "content": "Count please"}]}) + "\n")
    expected = {}
    for messages in ([{"role": "user", "content": "Count please"}], [{"role": "user", "content": "Seven blue birds"}],
                     [{"role": "user", "content": "How many red cars are on the road by the river"}],
                     [{"role": "system", "content": "You count."}, {"role": "user", "content": "Count please"}]):
        stats = GenerationStats()
        new_ids = generate(model, tokenizer, encode_prompt(tokenizer, messages=messages), max_new_tokens=40,
                           stats=stats)
        stopped = tokenizer.convert_ids_to_tokens(stats.stop_token_id) if stats.stop_token_id is not None \
            else stats.stop_reason
        expected[messages[-1]["content"], len(messages)] = {
            "reply": tokenizer.decode(new_ids, skip_special_tokens=True), "prompt_tokens": stats.prompt_tokens,
            "new_tokens": stats.new_tokens, "stopped": stopped}
    assert expected["Count please", 1]["reply"] == ANSWER
    assert main(["generate", str(trained), "--prompt_file", str(text_file), "--batch_size", "2",
                 "--max_new_tokens", "40"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line.pop("prompt") for line in lines] == ["Count please", "Seven blue birds",
                                                      "How many red cars are on the road by the river"]
    assert lines == [expected["Count please", 1], expected["Seven blue birds", 1],
                     expected["How many red cars are on the road by the river", 1]]
    assert "[3 prompts in batches of up to 2;" in captured.err
    assert main(["generate", str(trained), "--prompt_file", str(rows_file), "--max_new_tokens", "40"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[1]["prompt"][-1] == {"role": "user", "content": "Count please"}
    assert [{k: v for k, v in line.items() if k != "prompt"} for line in lines] == \
        [expected["Count please", 1], expected["Count please", 2], expected["Count please", 2]]


@pytest.mark.parametrize("args,message", [
    (["--prompt_file", "{tmp}/missing.txt"], "--prompt_file {tmp}/missing.txt: no such file; give a text file"),
    (["--prompt_file", "{tmp}/bad.jsonl"], "--prompt_file {tmp}/bad.jsonl:2: neither a 'prompt' text nor "),
    (["--prompt_file", "{tmp}/list.jsonl"], "--prompt_file {tmp}/list.jsonl:1: not a JSON object; give each line"),
    (["--prompt_file", "{tmp}/empty.txt"], "--prompt_file {tmp}/empty.txt: holds no prompt"),
    (["--prompt_file", "{tmp}/long.txt"], "--prompt_file {tmp}/long.txt:2: its prompt is "),
    (["--prompt_file", "{tmp}/empty.txt", "--batch_size", "0"], "--batch_size must be at least 1 (got 0)"),
    (["--prompt", "hi", "--batch_size", "4"], "--batch_size 4 acts only with --prompt_file"),
    (["--prompt", "hi", "--prompt_file", "{tmp}/bad.jsonl"], "not allowed with argument"),
])
def test_cli_generate_refuses_a_bad_prompt_file_in_one_line(trained, tmp_path, capsys, args, message):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"messages": [{"role": "assistant", "content": "x"}]}\n')
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "list.jsonl").write_text('["hi"]\n')
    (tmp_path / "long.txt").write_text("Count please\n" + "Count please " * 1000 + "\n")
    try:
        code = main(["generate", str(trained), *(a.format(tmp=tmp_path) for a in args)])
    except SystemExit as stop:  # argparse's own refusals (two of --prompt and --prompt_file) exit from the parser
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1, err


# Qwen3's switch, as its template reads it: a reply written without thinking has an empty think block, which
# enable_thinking false puts into the prompt (the template's default leaves it to the reply)
THINKING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")


def test_chat_template_kwargs_give_generate_and_chat_the_prompt_the_rows_trained_on(tmp_path, capsys, monkeypatch):
    """Rows trained with chat_template_kwargs {"enable_thinking": false} (TRL's column; Qwen3 fine-tunes that
    answer without thinking) put an empty think block before every reply: generate was prompted without it, so
    the fine-tune met a prompt it never trained on. --chat_template_kwargs (and a --prompt_file row's own) render
    the prompt with them: its ids are the training row's up to its first target, in generate, a batch and chat."""
    from shardtune.data.encode import IGNORE, encode_example, special_prefix
    from shardtune.testing.tiny import make_model_folder, make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    folder = make_model_folder(tmp_path / "model", tokenizer=tokenizer, num_layers=1)
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    kwargs = {"enable_thinking": False}
    example = {"kind": "chat", "messages": messages + [{"role": "assistant", "content": "5"}], "target_from": 0,
               "where": "test", "template_kwargs": json.dumps(kwargs)}
    ids, labels = encode_example(example, tokenizer, prefix=special_prefix(tokenizer), train_on_prompt=False,
                                 chat_template_format="none")
    trained_prompt = ids[:next(i for i, label in enumerate(labels) if label != IGNORE)]
    assert encode_prompt(tokenizer, messages=messages) != trained_prompt  # the template's default thinks
    assert encode_prompt(tokenizer, messages=messages, template_kwargs=kwargs) == trained_prompt

    seen: list[list[int]] = []  # the prompt of each row model.generate is given, its pads left out

    def record(model, *args, input_ids, attention_mask, **options):
        seen.extend(row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask))
        return torch.cat([input_ids, torch.full((len(input_ids), 1), tokenizer.eos_token_id)], dim=1)

    monkeypatch.setattr("transformers.GenerationMixin.generate", record)
    flag = ["--chat_template_kwargs", json.dumps(kwargs)]
    assert main(["generate", str(folder), "--prompt", messages[0]["content"], *flag]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO(messages[0]["content"] + "\n"))
    assert main(["chat", str(folder), *flag]) == 0
    assert seen == [trained_prompt, trained_prompt]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps(
        {"messages": messages, "chat_template_kwargs": kwargs}) + "\n")
    seen.clear()
    assert main(["generate", str(folder), "--prompt_file", str(rows)]) == 0  # the second row brings its own
    assert sorted(seen) == sorted([encode_prompt(tokenizer, messages=messages), trained_prompt])
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "hi", "--no-chat-template", *flag]) == 2  # it would not act
    err = capsys.readouterr().err
    assert "acts only through the chat template, and the prompt goes in as plain text" in err, err
    for bad, says in (("[1]", "is not a JSON object"), ('{"tools": []}', "names tools, which the template call sets"),
                      ("{nope", "is not JSON")):
        assert main(["generate", str(folder), "--prompt", "hi", "--chat_template_kwargs", bad]) == 2
        err = capsys.readouterr().err
        assert f"--chat_template_kwargs {bad}" in err and says in err and len(err.strip().splitlines()) == 1, err


def test_cli_generate_says_a_reply_stopped_at_the_models_last_position(tmp_path, capsys):
    """It said 'stopped by context_length', a name from the code: it names the positions and where they are read."""
    from shardtune.testing.tiny import make_model_folder

    folder = make_model_folder(tmp_path / "model", num_layers=1, max_position_embeddings=30)
    assert main(["generate", str(folder), "--prompt", "Count please", "--max_new_tokens", "100"]) == 0
    err = capsys.readouterr().err
    assert "new tokens at" in err and "; stopped at the model's last position (30 positions, its config: " \
        "max_position_embeddings); KV cache on]" in err, err
    prompt_tokens = int(re.search(r"\[(\d+) prompt tokens", err).group(1))
    assert f"; {30 - prompt_tokens} new tokens at" in err


def test_the_demos_questions_are_answered_in_batches_as_each_alone(loaded):
    """The demo's before/after table (answer_questions) asked its 60 questions one at a time; batched, the same
    replies come sooner (the real demo spent minutes on its base model's greedy replies)."""
    from shardtune.demo.evaluate import answer_questions
    from shardtune.demo.task import split_task

    model, tokenizer = loaded
    sums = split_task(10, 12).test
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        answers = answer_questions(model, tokenizer, sums, max_new_tokens=6, batch_size=5)
    finally:
        hook.remove()
    assert max(rows) == 5
    assert [a.reply for a in answers] == [
        tokenizer.decode(generate(model, tokenizer, encode_prompt(tokenizer, s.question()), max_new_tokens=6),
                         skip_special_tokens=True) for s in sums]
