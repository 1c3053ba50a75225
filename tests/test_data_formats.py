"""Formats, templates, masking rules, truncation, readers, bad input and the cache of the data pipeline."""

import csv
import json

import pytest
import yaml

from shardtune.data import DataConfig, load_tokenizer, prepare_datasets
from shardtune.data.encode import IGNORE
from shardtune.data.formats import to_example
from shardtune.errors import UsageError
from shardtune.testing.tiny import BOS, EOS, make_model_folder, make_tokenizer

CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."}]},
    {"messages": [{"role": "user", "content": "Name a red thing."}, {"role": "assistant", "content": "A red car."},
                  {"role": "user", "content": "And a blue one?"}, {"role": "assistant", "content": "The blue river."}]},
    {"messages": [{"role": "user", "content": "How many cats?"},
                  {"role": "assistant", "content": "Three cats and one dog."}]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model_folder(tmp_path_factory.mktemp("tiny") / "model"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prepare(model_dir, tmp_path, rows_or_path, *, seed=0, **settings):
    name = rows_or_path if isinstance(rows_or_path, str) else write_jsonl(tmp_path / "data.jsonl", rows_or_path)
    cfg = DataConfig(dataset_name=name, splits=settings.pop("splits", "train"), **settings)
    tok = load_tokenizer(model_dir, cfg)
    return prepare_datasets(cfg, tok, seed=seed, cache_dir=str(tmp_path / "cache")), tok


def targets(tok, row):
    return tok.decode([t for t in row["labels"] if t != IGNORE])


def assistant_text(conv, end):
    return "".join(m["content"] + end for m in conv["messages"] if m["role"] == "assistant")


@pytest.mark.parametrize("template,end", [("none", "<|im_end|>"), ("chatml", "<|im_end|>"),
                                          ("llama-3", "<|eot_id|>"), ("zephyr", EOS), ("alpaca", EOS)])
def test_chat_targets_are_assistant_turns_with_their_end_token(model_dir, tmp_path, template, end):
    # The tiny tokenizer has ChatML's tokens and not Llama 3's: those are added
    data, tok = prepare(model_dir, tmp_path, CHATS, chat_template_format=template, max_seq_len=256,
                        add_special_tokens=template == "llama-3")
    assert len(data.train) == len(CHATS)
    for row, conv in zip(data.train, CHATS):
        assert targets(tok, row) == assistant_text(conv, end)  # multi-turn: every reply, no prompt text
        assert row["input_ids"].count(tok.bos_token_id) == 1 and row["input_ids"][0] == tok.bos_token_id
        assert row["labels"][0] == IGNORE and len(row["labels"]) == len(row["input_ids"]) == row["seq_lens"][0]
        # labels are the inputs where they are targets (Hugging Face alignment: the loss shifts)
        assert all(lab in (IGNORE, i) for lab, i in zip(row["labels"], row["input_ids"]))


@pytest.mark.parametrize("template,end", [("none", "<|im_end|>"), ("chatml", "<|im_end|>"),
                                          ("llama-3", "<|eot_id|>"), ("zephyr", EOS), ("alpaca", EOS)])
def test_a_conversation_that_opens_with_the_assistant_trains_its_reply_not_its_header(model_dir, tmp_path,
                                                                                     template, end):
    """The first turn's header (<|im_start|>assistant and the like) was a target when no turn came before it."""
    opening = [{"messages": [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4"}]}]
    data, tok = prepare(model_dir, tmp_path, opening, chat_template_format=template, max_seq_len=256,
                        add_special_tokens=template == "llama-3")
    assert targets(tok, data.train[0]) == assistant_text(opening[0], end)


TOOL_TEMPLATE = (  # ChatML that writes an assistant turn's tool calls, as tool-aware templates (Qwen 2.5's) do
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.tool_calls or [] %}{{ '<tool_call>' + call.function.name + ' ' }}"
    "{{ call.function.arguments | tojson }}{{ '</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOL_CHATS = [  # the user names the function: a template that drops the call must still be found out
    {"messages": [{"role": "user", "content": "Weather in Paris? Use get_weather.", "tool_calls": []},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "18C", "tool_call_id": "c1"},
                  {"role": "assistant", "content": "It is 18C."}]},
    {"messages": [{"role": "user", "content": "Find cats."},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "search", "arguments": {"query": "cats", "n": 3}}}]},
                  {"role": "tool", "content": "3 cats"}, {"role": "assistant", "content": "Three cats."}]},
]


def test_tool_calls_are_trained_as_the_template_writes_them_or_refused(model_dir, tmp_path):
    """An assistant turn's tool_calls were dropped: it trained as an empty reply. The template writes them now,
    each call with its own arguments only (the rows pass through an Arrow table); a template that does not write
    them is refused for that row."""
    import shutil

    tools = shutil.copytree(model_dir, tmp_path / "tools")
    tokenizer = load_tokenizer(model_dir, DataConfig())
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(tools)
    data, tok = prepare(str(tools), tmp_path, TOOL_CHATS, max_seq_len=256)
    assert [targets(tok, row) for row in data.train] == [
        '<tool_call>get_weather {"city": "Paris"}</tool_call><|im_end|>It is 18C.<|im_end|>',
        '<tool_call>search {"query": "cats", "n": 3}</tool_call><|im_end|>Three cats.<|im_end|>']
    with pytest.raises(UsageError, match=r"data.jsonl:1: message 1: the chat template does not write its tool_calls, "
                                         r"so the turn would train as an empty reply"):
        (plain := tmp_path / "plain").mkdir()
        prepare(model_dir, plain, TOOL_CHATS, max_seq_len=256)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_a_rows_tools_are_written_into_its_prompt_by_the_template_or_refused(model_dir, tmp_path):
    """TRL's tools column (the function definitions a tool-calling chat was made with) was dropped without a word:
    the model learnt calls to functions its prompt never defined. The template writes them into the prompt now
    (never a target); a template that does not, and a row format with no template, are refused for that row."""
    import shutil

    folder = shutil.copytree(model_dir, tmp_path / "tools")
    tokenizer = load_tokenizer(model_dir, DataConfig())
    tokenizer.chat_template = ("{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
                               "{% endif %}" + TOOL_TEMPLATE)
    tokenizer.save_pretrained(folder)
    rows = [{**TOOL_CHATS[0], "tools": [WEATHER]}, TOOL_CHATS[1]]  # the second row has none (null in the table)
    data, tok = prepare(str(folder), tmp_path, rows, max_seq_len=512)
    prompt = [tok.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label == IGNORE])
              for row in data.train]
    assert prompt[0].startswith("<|begin_of_text|><|im_start|>system\nTools: [") and "Current weather" in prompt[0]
    assert '"name": "get_weather"' in prompt[0] and "Tools:" not in prompt[1]
    assert [targets(tok, row) for row in data.train] == [
        '<tool_call>get_weather {"city": "Paris"}</tool_call><|im_end|>It is 18C.<|im_end|>',
        '<tool_call>search {"query": "cats", "n": 3}</tool_call><|im_end|>Three cats.<|im_end|>']
    plain = shutil.copytree(model_dir, tmp_path / "plain")
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(plain)
    with pytest.raises(UsageError, match=r"data.jsonl:1: the chat template does not write the row's tools, so the "
                                         r"model would learn its tool calls without their definitions"):
        (tmp_path / "p1").mkdir()
        prepare(str(plain), tmp_path / "p1", rows, max_seq_len=512)
    # a row whose tools are empty has none, however its file writes that; a JSON string is read as the list
    chat = {"messages": TOOL_CHATS[1]["messages"]}
    assert [to_example({**chat, "tools": empty}, "x", "chat", "text", True)["tools"] for empty in (None, [], "", " ")] \
        == [""] * 4
    assert json.loads(to_example({**chat, "tools": json.dumps([WEATHER])}, "x", "chat", "text", True)["tools"]) == \
        [WEATHER]
    with pytest.raises(UsageError, match=r"data.jsonl:1: its 'tools' reach the model only through a chat template"):
        (tmp_path / "p2").mkdir()
        prepare(str(folder), tmp_path / "p2", [{"prompt": "Weather?", "completion": " Sunny.", "tools": [WEATHER]}])


THINKING_TEMPLATE = (  # Qwen3's way: enable_thinking false writes an empty think block after the assistant header
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and enable_thinking is defined and not enable_thinking %}"
    "{{ '<think></think>' }}{% endif %}{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}")


def test_an_assistant_turns_reasoning_reaches_the_template_and_trains(model_dir, tmp_path):
    """A message's keys beyond role, content and tool calls were dropped: an assistant turn's thinking (gpt-oss's
    key, TRL's Multilingual-Thinking recipe) or reasoning_content (Qwen3's) never reached the template, so a
    reasoning data set trained its answers without their reasoning, where TRL trains both. They now reach it (a
    Parquet table's null padding left out) and train as part of the reply."""
    import shutil

    import pandas as pd

    folder = shutil.copytree(model_dir, tmp_path / "thinking")
    tokenizer = load_tokenizer(model_dir, DataConfig())
    tokenizer.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message.thinking %}{{ '<think>' + message.thinking + '</think>' }}"
        "{% elif message.reasoning_content %}{{ '<think>' + message.reasoning_content + '</think>' }}"
        "{% endif %}{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tokenizer.save_pretrained(folder)
    rows = [{"messages": [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4", "thinking": "Two and two."}]},
            {"messages": [{"role": "user", "content": "3+3?"},
                          {"role": "assistant", "content": "6", "reasoning_content": "Three twice."}]}]
    replies = ["<think>Two and two.</think>4<|im_end|>", "<think>Three twice.</think>6<|im_end|>"]
    data, tok = prepare(str(folder), tmp_path, rows, max_seq_len=256)
    assert [targets(tok, row) for row in data.train] == replies
    first = tok.decode(data.train[0]["input_ids"])
    assert first == BOS + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n" + replies[0] + "\n"
    pd.DataFrame(rows).to_parquet(tmp_path / "rows.parquet")  # each message gets both keys, one of them null
    from_parquet = prepare(str(folder), tmp_path, str(tmp_path / "rows.parquet"), max_seq_len=256)[0]
    assert from_parquet.train.to_list() == data.train.to_list()


def test_trls_chat_template_path_renders_the_rows_with_that_template(model_dir, tmp_path):
    """TRL's chat_template_path (a Jinja file for a base model without a template) was refused, so a TRL recipe
    needed its template copied into the model folder. The file's template now renders every row, as TRL's
    SFTTrainer sets it, and the tokenizer carries it into final/."""
    template = tmp_path / "turns.jinja"
    template.write_text("{% for message in messages %}{{ '### ' + message['role'] + ': ' + message['content'] }}"
                        "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ '### assistant: ' }}{% endif %}")
    data, tok = prepare(model_dir, tmp_path, CHATS[:1], max_seq_len=256, chat_template_path=str(template))
    assert tok.chat_template == template.read_text()
    assert tok.decode(data.train[0]["input_ids"]) == (BOS + "### system: Be brief.\n### user: What is two plus two?\n"
                                                      "### assistant: Four." + EOS + "\n")
    assert targets(tok, data.train[0]) == "Four." + EOS


def test_a_rows_chat_template_kwargs_reach_the_template(model_dir, tmp_path):
    """TRL's chat_template_kwargs column (the template's variables for a row: Qwen3's enable_thinking false) was
    dropped without a word: the rows trained without the empty think block the model is prompted with at
    inference. Each chat row's variables now reach every rendering of it (a JSON text cell's too, and a Parquet
    table's without Arrow's null padding); other values are refused for that row."""
    import shutil

    import pandas as pd

    folder = shutil.copytree(model_dir, tmp_path / "thinking")
    tokenizer = load_tokenizer(model_dir, DataConfig())
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(folder)
    hi = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rows = [{"messages": hi, "chat_template_kwargs": {"enable_thinking": False}},
            {"messages": hi, "chat_template_kwargs": {"enable_thinking": True}}]
    conversational = [{"prompt": hi[:1], "completion": hi[1:],
                       "chat_template_kwargs": json.dumps({"enable_thinking": False})}]  # as a CSV cell holds it
    expected = [(BOS + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + think, "Hello<|im_end|>")
                for think in ("<think></think>", "", "<think></think>")]
    data, tok = prepare(str(folder), tmp_path, rows, max_seq_len=256)
    (tmp_path / "pc").mkdir()
    pc = prepare(str(folder), tmp_path / "pc", conversational, max_seq_len=256)[0]
    for row, (prompt, reply) in zip([*data.train, *pc.train], expected, strict=True):
        assert tok.decode(row["input_ids"]) == prompt + reply + "\n" and targets(tok, row) == reply
        start, length = (len(tok(text, add_special_tokens=False).input_ids) for text in (prompt, reply))
        assert [i for i, label in enumerate(row["labels"]) if label != IGNORE] == list(range(start, start + length))
    pd.DataFrame(rows[:2]).to_parquet(tmp_path / "rows.parquet")  # row 2's struct gets row 1's keys as nulls
    pd.DataFrame([rows[0], {"messages": hi, "chat_template_kwargs": {"other": 1}}]).to_parquet(tmp_path / "b.parquet")
    assert prepare(str(folder), tmp_path, str(tmp_path / "rows.parquet"), max_seq_len=256)[0].train.to_list() == \
        data.train.to_list()
    padded = prepare(str(folder), tmp_path, str(tmp_path / "b.parquet"), max_seq_len=256)[0].train
    assert tok.decode(padded[1]["input_ids"]) == expected[1][0] + "Hello<|im_end|>\n"
    with pytest.raises(UsageError, match=r"data\.jsonl:1: 'chat_template_kwargs' names tools, which the template "
                                         r"call sets itself: give an object of the chat template's variables"):
        prepare(str(folder), tmp_path, [{"messages": hi, "chat_template_kwargs": {"tools": []}}], max_seq_len=256)


def test_tool_calls_and_tools_from_parquet_or_a_saved_data_set_train_without_arrows_nulls(model_dir, tmp_path):
    """An Arrow column holds one struct type, so in Parquet, a saved data set or a hub one every call's arguments
    carry the keys of all the others: search(query, n) trained as {"city": null, "query": "cats", "n": 3}, and each
    tool definition carried the others' parameters as nulls. They now train as the JSON rows do."""
    import shutil

    import datasets

    folder = shutil.copytree(model_dir, tmp_path / "tools")
    tokenizer = load_tokenizer(model_dir, DataConfig())
    tokenizer.chat_template = ("{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
                               "{% endif %}" + TOOL_TEMPLATE)
    tokenizer.save_pretrained(folder)
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "n": {"type": "integer"}}}}}
    rows = [{**TOOL_CHATS[0], "tools": [WEATHER]}, {**TOOL_CHATS[1], "tools": [search]}]
    (tmp_path / "json").mkdir()
    expected, tok = prepare(str(folder), tmp_path / "json", rows, max_seq_len=512)
    assert '"n": 3' in targets(tok, expected.train[1])
    dataset = datasets.Dataset.from_list(rows)
    dataset.to_parquet(str(tmp_path / "tools.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    for name in ("tools.parquet", "saved"):
        (tmp_path / f"cache-{name}").mkdir()
        data, _ = prepare(str(folder), tmp_path / f"cache-{name}", str(tmp_path / name), max_seq_len=512)
        assert [tok.decode(row["input_ids"]) for row in data.train] == \
            [tok.decode(row["input_ids"]) for row in expected.train], name
        assert data.train.to_list() == expected.train.to_list(), name


def test_sharegpt_conversations_train_as_the_same_messages_do(model_dir, tmp_path):
    """ShareGPT rows (conversations of from/value) give the ids and labels of the same chats as messages; a "tool"
    turn (hermes-function-calling-v1 writes them) was refused as an unknown ShareGPT role, though a messages row
    has that role."""
    names = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}
    chats = [*CHATS, {"messages": [{"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": "<tool_call>get_weather Paris</tool_call>"},
                                   {"role": "tool", "content": "18C"}, {"role": "assistant", "content": "18C."}]}]
    sharegpt = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in chat["messages"]]}
                for chat in chats]
    (tmp_path / "messages").mkdir()
    expected, tok = prepare(model_dir, tmp_path / "messages", chats, max_seq_len=256)
    data, _ = prepare(model_dir, tmp_path, sharegpt, max_seq_len=256)
    assert data.train.to_list() == expected.train.to_list()
    assert targets(tok, data.train[3]) == "<tool_call>get_weather Paris</tool_call><|im_end|>18C.<|im_end|>"


def test_an_assistant_turn_of_weight_0_is_not_trained(model_dir, tmp_path):
    """OpenAI's fine-tuning files mark an assistant turn not to learn from with weight 0: it was trained like the
    others, without a word. Now it is context only, from JSON lines and from Parquet (where Arrow gives every other
    message a null weight); a weight that is neither 0 nor 1, or 1 on a turn that never trains, is refused."""
    import datasets

    rows = [{"messages": [{"role": "user", "content": "Name a red thing."},
                          {"role": "assistant", "content": "A blue river.", "weight": 0},
                          {"role": "user", "content": "Red, please."},
                          {"role": "assistant", "content": "A red car.", "weight": 1}]},
            {"messages": [{"role": "user", "content": "How many cats?", "weight": 0},
                          {"role": "assistant", "content": "Three cats."}]}]
    data, tok = prepare(model_dir, tmp_path, rows, max_seq_len=256)
    assert [targets(tok, row) for row in data.train] == ["A red car.<|im_end|>", "Three cats.<|im_end|>"]
    assert "A blue river." in tok.decode(data.train[0]["input_ids"])
    sharegpt = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"],
                                    **({"weight": m["weight"]} if "weight" in m else {})} for m in row["messages"]]}
                for row in rows]  # axolotl's ShareGPT rows carry the same weight
    (tmp_path / "sharegpt").mkdir()
    assert prepare(model_dir, tmp_path / "sharegpt", sharegpt, max_seq_len=256)[0].train.to_list() == \
        data.train.to_list()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "w.parquet"))
    (tmp_path / "parquet").mkdir()
    from_parquet, _ = prepare(model_dir, tmp_path / "parquet", str(tmp_path / "w.parquet"), max_seq_len=256)
    assert from_parquet.train.to_list() == data.train.to_list()
    for role, weight in (("assistant", 0.5), ("user", 1)):
        bad = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
        bad[0]["messages"][role == "assistant"]["weight"] = weight
        with pytest.raises(UsageError, match=rf"data\.jsonl:1: message {int(role == 'assistant')} \({role}\) has "
                                             rf"weight {weight}: a weight is 0 \(not trained\) or 1"):
            prepare(model_dir, tmp_path, bad, max_seq_len=256)
    with pytest.raises(UsageError, match=r"data\.jsonl:1: message 1 \(assistant\) has weight 0, but train_on_prompt "
                                         r"true trains every token: set train_on_prompt false, or drop the weight"):
        prepare(model_dir, tmp_path, rows, max_seq_len=256, train_on_prompt=True)


def test_mistral_template_keeps_eos_as_target_and_never_doubles_bos(model_dir, tmp_path):
    data, tok = prepare(model_dir, tmp_path, CHATS, chat_template_format="mistral", max_seq_len=256)
    row = data.train[1]
    assert targets(tok, row) == " A red car." + EOS + " The blue river." + EOS
    assert row["input_ids"][-1] == tok.eos_token_id and row["labels"][-1] == tok.eos_token_id
    # the template writes bos_token itself; the tokenizer would add one too
    assert row["input_ids"].count(tok.bos_token_id) == 1


def test_a_template_whose_tokens_the_tokenizer_lacks_is_refused_without_add_special_tokens(model_dir, tmp_path):
    """Llama 3's turns on a tokenizer without its tokens trained <|eot_id|> as text spelled out in ten pieces, and
    generation never stopped there; it is named, with the key that adds it. Zephyr's and Mistral's markers are
    spelled in pieces by design (their turns end in EOS), so they need nothing added."""
    assert load_tokenizer(model_dir, DataConfig(chat_template_format="llama-3"))  # export of such a run loads it
    with pytest.raises(UsageError) as exc:
        prepare(model_dir, tmp_path, CHATS, chat_template_format="llama-3", max_seq_len=256)
    assert str(exc.value) == ("chat_template_format llama-3: the tokenizer has no token <|eot_id|>, the template's "
                              "end of a turn: it would train as text spelled out in pieces, and generation would not "
                              "stop there; set add_special_tokens true (adds the template's tokens and resizes the "
                              "embeddings), or chat_template_format none to keep the tokenizer's own template")
    for name in ("zephyr", "mistral"):
        assert load_tokenizer(model_dir, DataConfig(chat_template_format=name)).chat_template


def test_llama3_special_tokens_added_and_eos_becomes_end_of_turn(model_dir, tmp_path):
    plain = load_tokenizer(model_dir, DataConfig())
    cfg = DataConfig(chat_template_format="llama-3", add_special_tokens=True)
    tok = load_tokenizer(model_dir, cfg)
    assert len(tok) == len(plain) + 3
    assert len(tok("<|eot_id|>", add_special_tokens=False).input_ids) == 1
    assert len(plain("<|eot_id|>", add_special_tokens=False).input_ids) > 1
    assert tok.eos_token == "<|eot_id|>" and tok.pad_token_id != tok.eos_token_id
    from shardtune.infer.generate import stop_token_ids

    assert tok.convert_tokens_to_ids("<|eot_id|>") in stop_token_ids(None, tok)  # generation stops there
    # and at the base's EOS, which neither this tokenizer nor a GGUF of the run names any more: generate on the
    # GGUF ran past it ("65?<|end_of_text|>What is 5 plus 4? 9") where the adapter stopped, and llama.cpp stops
    assert tok.convert_tokens_to_ids("<|end_of_text|>") in stop_token_ids(None, tok)
    data, tok2 = prepare(model_dir, tmp_path, CHATS, chat_template_format="llama-3", add_special_tokens=True,
                         max_seq_len=256)
    row = data.train[0]
    eot = tok2.convert_tokens_to_ids("<|eot_id|>")
    assert row["labels"][-1] == eot and targets(tok2, row) == "Four.<|eot_id|>"


def test_train_on_prompt_trains_every_token_but_the_first(model_dir, tmp_path):
    data, _ = prepare(model_dir, tmp_path, CHATS, train_on_prompt=True, max_seq_len=256)
    for row in data.train:
        assert row["labels"][0] == IGNORE and row["labels"][1:] == row["input_ids"][1:]


def test_prompt_completion_masks_prompt_and_appends_eos_target(model_dir, tmp_path):
    rows = [{"prompt": "The sum of two and two is", "completion": " four."}, {"prompt": "Red or blue?",
                                                                              "completion": " Blue."}]
    data, tok = prepare(model_dir, tmp_path, rows, max_seq_len=256)
    assert data.report.data_format == "prompt_completion"
    for row, src in zip(data.train, rows):
        assert tok.decode(row["input_ids"]) == BOS + src["prompt"] + src["completion"] + EOS
        assert targets(tok, row) == src["completion"] + EOS
        assert row["labels"][-1] == tok.eos_token_id


def test_conversational_prompt_completion_trains_only_the_completion(model_dir, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                        {"role": "user", "content": "Count to two."}],
             "completion": [{"role": "assistant", "content": "One two."}]}]
    data, tok = prepare(model_dir, tmp_path, rows, max_seq_len=256)
    assert targets(tok, data.train[0]) == "One two.<|im_end|>"


def test_a_prompt_and_completion_of_different_shapes_say_so(model_dir, tmp_path):
    """A conversational prompt with a string completion was refused as "the field 'prompt' is missing or not a
    non-empty string", of a prompt that is there. A null prompt before a conversational completion is an empty one,
    as it is before a string completion."""
    user, reply = [{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": "One two."}]
    for prompt, completion, says in ((user, "One two.", "'prompt' is a list of messages but 'completion' is a string"),
                                     ("Hi", reply, "'prompt' is a string but 'completion' is a list of messages"),
                                     (user, None, "'prompt' is a list of messages but 'completion' is empty")):
        with pytest.raises(UsageError, match=rf"data\.jsonl:1: {says}: give both as lists of \{{role, content\}} "
                                             rf"messages \(conversational\) or both as strings; fix it"):
            prepare(model_dir, tmp_path, [{"prompt": prompt, "completion": completion}], max_seq_len=256)
    data, tok = prepare(model_dir, tmp_path, [{"prompt": None, "completion": reply}], max_seq_len=256)
    assert targets(tok, data.train[0]) == "One two.<|im_end|>"


def test_alpaca_rows_plain_prompt_or_chat_template(model_dir, tmp_path):
    rows = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Say yes.", "input": "", "output": "Yes."}]
    data, tok = prepare(model_dir, tmp_path, rows, max_seq_len=256)
    assert data.report.data_format == "alpaca"
    first = tok.decode(data.train[0]["input_ids"])
    assert "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n5" in first
    assert "### Input" not in tok.decode(data.train[1]["input_ids"])
    assert [targets(tok, r) for r in data.train] == ["5" + EOS, "Yes." + EOS]
    chat, tok = prepare(model_dir, tmp_path, rows, max_seq_len=256, chat_template_format="chatml")
    assert tok.decode(chat.train[0]["input_ids"]).startswith(BOS + "<|im_start|>user\nAdd the numbers.\n\n2 and 3")
    assert targets(tok, chat.train[0]) == "5<|im_end|>"



def test_an_alpaca_rows_system_text_reaches_the_model_with_or_without_a_template(model_dir, tmp_path):
    """LLaMA-Factory's Alpaca files carry a 'system' column. Through a named template it was the system turn, but
    through the plain Alpaca prompt (the default) it was dropped without a word. It now stands where the Alpaca
    preamble (the format's own system prompt) is, is never a target, and a non-string one is a bad row."""
    rows = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "system": "You are terse."},
            {"instruction": "Say yes.", "input": "", "output": "Yes.", "system": None}]
    data, tok = prepare(model_dir, tmp_path, rows, max_seq_len=256)
    first, second = (tok.decode(r["input_ids"]) for r in data.train)
    assert first == (BOS + "You are terse.\n\n### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n"
                     "### Response:\n5" + EOS)
    assert second.startswith(BOS + "Below is an instruction that describes a task. Write a response")
    assert [targets(tok, r) for r in data.train] == ["5" + EOS, "Yes." + EOS]
    chat, tok = prepare(model_dir, tmp_path, rows, max_seq_len=256, chat_template_format="chatml")
    assert tok.decode(chat.train[0]["input_ids"]).startswith(BOS + "<|im_start|>system\nYou are terse.<|im_end|>")
    assert "system" not in tok.decode(chat.train[1]["input_ids"])
    with pytest.raises(UsageError, match=r"data\.jsonl:1: the field 'system' is a list of messages, not text: give "
                                         r"it as a non-empty string"):
        prepare(model_dir, tmp_path, [{**rows[0], "system": ["You are terse."]}], max_seq_len=256)

def test_raw_text_trains_all_tokens_and_ends_with_eos(model_dir, tmp_path):
    rows = [{"body": "The quick cat is happy."}, {"body": "Two plus two is four."}]
    data, tok = prepare(model_dir, tmp_path, rows, dataset_text_field="body", max_seq_len=256)
    assert data.report.data_format == "text"
    for row, src in zip(data.train, rows):
        assert tok.decode(row["input_ids"]) == BOS + src["body"] + EOS
        assert row["labels"][1:] == row["input_ids"][1:] and row["labels"][0] == IGNORE


def test_seed_recipe_content_text_field_still_reads_chat(model_dir, tmp_path):
    # rows of messages alone, and rows that also hold a 'content' text column (the text field's name): chat both
    with_text = [{**c, "content": " ".join(m["content"] for m in c["messages"])} for c in CHATS]
    for i, rows in enumerate((CHATS, with_text)):
        (tmp_path / str(i)).mkdir()
        data, tok = prepare(model_dir, tmp_path / str(i), rows, chat_template_format="chatml",
                            add_special_tokens=False, append_concat_token=False, max_seq_len=128, packing=True,
                            dataset_text_field="content")
        assert data.report.data_format == "chat" and data.report.packing
        got = "".join(sorted(targets(tok, {"labels": r["labels"]}) for r in data.train))
        # the targets are the assistant turns, each once with its end token, and nothing else
        assert sorted(got) == sorted("".join(assistant_text(c, "<|im_end|>") for c in CHATS)), got


def test_pad_token_never_eos(model_dir, tmp_path):
    tok = make_tokenizer()
    tok.pad_token = tok.eos_token  # the classic bug: collators masking pad also mask EOS
    folder = tmp_path / "padeos"
    tok.save_pretrained(folder)
    fixed = load_tokenizer(str(folder), DataConfig())
    assert fixed.pad_token_id is not None and fixed.pad_token_id != fixed.eos_token_id
    # the vocabulary already holds <|pad|>: it is reused, so the embeddings need no resize
    assert fixed.pad_token == "<|pad|>" and len(fixed) == len(tok)


@pytest.mark.parametrize("specials, pad", [
    (["<|reserved_special_token_0|>", "<|finetune_right_pad_id|>"], "<|finetune_right_pad_id|>"),  # Llama 3.1
    (["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"], "<|reserved_special_token_0|>"),  # 3.0
    ([], "<|pad|>"),  # nothing spare: a token is added (and the embeddings grow)
])
def test_a_tokenizer_without_pad_or_unk_pads_with_a_spare_special_token(tmp_path, specials, pad):
    """No pad and no unk (Llama 3's tokenizer): a special token the vocabulary holds for padding or reserves is
    used, so no embedding row is added; only without one is <|pad|> added."""
    tok = make_tokenizer()
    folder = tmp_path / "nopad"
    tok.save_pretrained(folder)
    text = (folder / "tokenizer.json").read_text().replace('"<|pad|>"', '"<|tool|>"')  # <|pad|>'s id, renamed
    (folder / "tokenizer.json").write_text(text)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("pad_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    unpadded = AutoTokenizer.from_pretrained(folder)
    unpadded.add_tokens(specials, special_tokens=True)
    unpadded.save_pretrained(folder)
    assert unpadded.pad_token is None and unpadded.unk_token is None
    fixed = load_tokenizer(str(folder), DataConfig())
    assert fixed.pad_token == pad and fixed.pad_token_id != fixed.eos_token_id
    assert len(fixed) == len(unpadded) + (pad not in unpadded.get_vocab())


def test_truncation_is_reported(model_dir, tmp_path):
    full, _ = prepare(model_dir, tmp_path, CHATS, max_seq_len=256)
    lengths = [len(r["input_ids"]) for r in full.train]
    limit = sorted(lengths)[1]  # the middle document fits exactly, the longest does not
    cut, _ = prepare(model_dir, tmp_path, CHATS, max_seq_len=limit)
    rep = cut.report
    assert rep.truncated_rows == sum(n > limit for n in lengths)
    assert rep.dropped_tokens == sum(max(0, n - limit) for n in lengths)
    assert all(len(r["input_ids"]) <= limit for r in cut.train)
    assert "truncated rows 1" in rep.format()


def test_truncating_away_every_target_drops_the_row(model_dir, tmp_path):
    rows = [{"prompt": "one two three four five six seven eight nine ten " * 3, "completion": " yes"},
            {"prompt": "Red?", "completion": " Yes."}]
    data, _ = prepare(model_dir, tmp_path, rows, max_seq_len=8)
    assert data.report.empty_rows_dropped == 1 and data.report.documents == 1 and len(data.train) == 1


def test_every_file_type_gives_the_same_rows(model_dir, tmp_path):
    rows = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(5)]
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {"jsonl": write_jsonl(tmp_path / "d.jsonl", rows)}
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with (tmp_path / "d.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "completion"])
        w.writeheader()
        w.writerows(rows)
    paths.update({k: str(tmp_path / f"d.{k}") for k in ("json", "parquet", "csv")})
    results = {k: prepare(model_dir, tmp_path, p, max_seq_len=64)[0].train.to_list() for k, p in paths.items()}
    assert len(results["jsonl"]) == 5
    assert all(v == results["jsonl"] for v in results.values())



def test_chat_rows_in_a_csv_hold_their_messages_as_json_text(model_dir, tmp_path):
    """A CSV cell holds text only, so a chat data set exported to CSV (or Parquet from pandas with to_json'd
    columns) holds each row's messages as JSON text: it was refused, "the field 'messages' is missing or not a
    list", though the list is there. JSON text that is a list is now read as the list, giving the same rows as the
    JSONL file; text that starts as a list and does not parse names the row and what is wrong."""
    path = tmp_path / "chats.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["conversations"])
        w.writeheader()
        w.writerows({"conversations": json.dumps(c["messages"])} for c in CHATS)
    from_csv = prepare(model_dir, tmp_path, str(path), max_seq_len=256)[0].train.to_list()
    renamed = [{"conversations": c["messages"]} for c in CHATS]
    assert from_csv == prepare(model_dir, tmp_path, renamed, max_seq_len=256)[0].train.to_list()
    assert len(from_csv) == len(CHATS)
    broken = [{"messages": json.dumps(CHATS[0]["messages"])[:-1]}]
    with pytest.raises(UsageError, match=r"data\.jsonl:1: 'messages' is text that starts as a JSON list but does not "
                                         r"parse \(Expecting ',' delimiter at character \d+\)"):
        prepare(model_dir, tmp_path, broken, max_seq_len=256)

def test_trls_eos_token_ends_each_completion_and_becomes_the_tokenizers_eos(model_dir, tmp_path):
    """TRL's eos_token (<|im_end|> for a base model taught ChatML text) was refused, 'leave it out', which trained
    every completion to end in the base's <|end_of_text|> instead. It now ends each text and prompt/completion row
    as a target, as TRL's SFTTrainer appends it, and is the tokenizer's EOS; a token the tokenizer lacks is refused
    naming the key."""
    rows = [{"prompt": "What is two plus two?", "completion": " Four."},
            {"prompt": "Hi", "completion": " Yo<|im_end|>"}]
    data, tok = prepare(model_dir, tmp_path, rows, max_seq_len=256, eos_token="<|im_end|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end and tok.pad_token_id not in (im_end, None)
    for row, src in zip(data.train, rows):
        assert row["input_ids"][-1] == row["labels"][-1] == im_end
        assert row["input_ids"].count(im_end) == 1 and tok.convert_tokens_to_ids(EOS) not in row["input_ids"]
        assert targets(tok, row) == src["completion"].removesuffix("<|im_end|>") + "<|im_end|>"
    with pytest.raises(UsageError, match=r"^eos_token '<\|eot\|>' is not a token of the tokenizer .*: give one of "
                                         r"its tokens, e.g. <\|end_of_text\|>, its own EOS, or leave eos_token out\.$"):
        prepare(model_dir, tmp_path, rows, max_seq_len=256, eos_token="<|eot|>")


def test_a_csv_chat_named_by_dataset_text_field_trains_as_messages_not_json_text(model_dir, tmp_path):
    """dataset_text_field messages (or chat) naming a CSV's column of JSON message lists read each row as plain
    text and trained the JSON itself, '[{"role": "user", ...', every token a target. It now gives the rows the JSONL
    file gives."""
    for field in ("messages", "chat"):
        path = tmp_path / f"{field}.csv"
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[field])
            w.writeheader()
            w.writerows({field: json.dumps(c["messages"])} for c in CHATS)
        data, tok = prepare(model_dir, tmp_path, str(path), max_seq_len=256, dataset_text_field=field)
        assert data.report.data_format == "chat"
        assert [targets(tok, row) for row in data.train] == [assistant_text(c, "<|im_end|>") for c in CHATS]
        assert data.train.to_list() == prepare(model_dir, tmp_path, CHATS, max_seq_len=256)[0].train.to_list()


def test_a_conversational_prompt_and_completion_in_a_csv_train_as_messages_not_json_text(model_dir, tmp_path):
    """A conversational prompt/completion data set exported to CSV holds each prompt and completion as JSON text of
    its messages: it trained the JSON itself ('[{"role": "assistant", ...') as the target, a model taught to answer
    in JSON. It now gives the same rows as the JSONL file; a plain completion that is JSON but no messages stays
    text."""
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
             "completion": [{"role": "assistant", "content": "Four."}]},
            {"prompt": [{"role": "user", "content": "Name a red thing."}],
             "completion": [{"role": "assistant", "content": "A red car."}]}]
    path = tmp_path / "conv.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "completion"])
        w.writeheader()
        w.writerows({k: json.dumps(v) for k, v in r.items()} for r in rows)
    from_csv, tok = prepare(model_dir, tmp_path, str(path), max_seq_len=256)
    assert [targets(tok, row) for row in from_csv.train] == ["Four.<|im_end|>", "A red car.<|im_end|>"]
    assert from_csv.train.to_list() == prepare(model_dir, tmp_path, rows, max_seq_len=256)[0].train.to_list()
    plain, tok = prepare(model_dir, tmp_path, [{"prompt": "Sort 3 1 2:", "completion": " [1, 2, 3]"}],
                         max_seq_len=256)
    assert targets(tok, plain.train[0]) == " [1, 2, 3]" + EOS


def test_a_json_file_with_a_byte_order_mark_is_read_as_datasets_reads_it(model_dir, tmp_path):
    """A .json file that begins with UTF-8's byte-order mark (Windows PowerShell's Out-File -Encoding utf8 writes
    one) was refused as 'malformed JSON (Unexpected UTF-8 BOM ...); fix the file', where load_dataset, and so a TRL
    script, reads it; the JSONL and CSV readers already dropped the mark. A list of rows, an object holding one, and
    JSON lines saved as .json (one of them not UTF-8: still that row's problem) now read as without it."""
    bom = "\ufeff".encode()
    rows = [{"text": "Two plus two is four."}, {"text": "The cat is red."}]
    plain, tok = prepare(model_dir, tmp_path, rows, max_seq_len=64)
    for name, body in (("list.json", json.dumps(rows)), ("object.json", json.dumps({"data": rows})),
                       ("lines.json", "".join(json.dumps(r) + "\n" for r in rows))):
        (tmp_path / name).write_bytes(bom + body.encode())
        data = prepare(model_dir, tmp_path, str(tmp_path / name), max_seq_len=64)[0]
        assert data.train.to_list() == plain.train.to_list(), name
        assert [tok.decode(row["input_ids"]) for row in data.train] == [BOS + r["text"] + EOS for r in rows]
    (tmp_path / "bad.json").write_bytes(bom + b'{"text": "caf\xe9"}\n' + json.dumps(rows[1]).encode() + b"\n")
    with pytest.raises(UsageError, match=r"bad\.json:1: not valid UTF-8 \(byte 0xe9 at column 14\); re-encode"):
        prepare(model_dir, tmp_path, str(tmp_path / "bad.json"), max_seq_len=64)
    data = prepare(model_dir, tmp_path, str(tmp_path / "bad.json"), max_seq_len=64, skip_bad_rows=True)[0]
    assert data.report.bad_rows_skipped == 1 and data.train.to_list() == plain.train.to_list()[1:]


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.csv", "data.jsonl.gz"])
def test_a_utf16_file_is_named_as_utf16_not_given_the_cp1252_advice(model_dir, tmp_path, name):
    """Windows PowerShell's > and Out-File write UTF-16: its first line was 'not valid UTF-8 (byte 0xff at column
    1)' with advice to re-encode from cp1252, which turns the file into garbage (and with skip_bad_rows every row was
    skipped as malformed). The file is now refused whole, saying what it is and how to convert it."""
    import gzip

    body = ("text\nTwo plus two.\n" if name == "data.csv" else '{"text": "Two plus two."}\n').encode("utf-16")
    (tmp_path / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    for skip in (False, True):
        with pytest.raises(UsageError, match=rf"{name}: the file is UTF-16 text .*; re-encode it as UTF-8 \(e\.g\. "
                                             r"iconv -f utf-16 -t utf-8 IN > OUT, or Out-File -Encoding utf8\)\.$"):
            prepare(model_dir, tmp_path, str(tmp_path / name), max_seq_len=64, skip_bad_rows=skip)


def test_rows_already_tokenised_are_refused_saying_so(model_dir, tmp_path):
    """TRL trains rows that hold input_ids as they are; here they were refused as 'cannot tell the data format',
    which read as a misnamed column. The refusal now says they are tokenised rows, which are not read, and what to
    give instead."""
    rows = [{"input_ids": [1, 5, 6, 7], "labels": [-100, 5, 6, 7]}]
    with pytest.raises(UsageError, match=r"data\.jsonl:1: the rows are already tokenised \(columns \['input_ids', "
                                         r"'labels'\]\), which shardtune does not read: .*; give the rows as text "
                                         r"instead: 'messages', 'prompt'\+'completion' or the text field 'content'"):
        prepare(model_dir, tmp_path, rows, max_seq_len=64, dataset_text_field="content")


def test_a_text_field_of_another_type_is_named_by_what_it_holds(model_dir, tmp_path):
    """A column whose type changes between rows (a number in row 2 of a JSONL file), or a Parquet binary column,
    was refused as 'missing or not a non-empty string' of a field that is there. The refusal now says what the row
    holds."""
    import pandas as pd

    for rows, says in (([{"text": "Two."}, {"text": 4}], r"data\.jsonl:2: the field 'text' is an int, not text"),
                       ([{"text": "Two."}, {"text": ""}], r"data\.jsonl:2: the field 'text' is empty"),
                       ([{"prompt": "Hi", "completion": "Yo"}, {"prompt": "Hi", "answer": "Yo"}],
                        r"data\.jsonl:2: the field 'completion' is missing")):
        with pytest.raises(UsageError, match=rf"{says}: give it as a non-empty string; fix it"):
            prepare(model_dir, tmp_path, rows, max_seq_len=64)
    pd.DataFrame([{"text": "caf\xe9".encode("latin-1")}]).to_parquet(tmp_path / "binary.parquet")
    with pytest.raises(UsageError, match=r"binary\.parquet row 1: the field 'text' is bytes, not text \(a binary "
                                         r"column: store it as UTF-8 strings\): give it as a non-empty string"):
        prepare(model_dir, tmp_path, str(tmp_path / "binary.parquet"), max_seq_len=64)


def test_a_csv_cell_longer_than_128_kib_is_read_as_load_dataset_reads_it(model_dir, tmp_path):
    """Python's csv refuses a field over 131072 characters: a CSV holding one long document (a book chapter, a code
    file) stopped with the traceback '_csv.Error: field larger than field limit (131072)', where load_dataset reads
    it. The row is read now, and truncated to max_seq_len as the same row from a JSONL file is."""
    rows = [{"text": "The cat is red. " * 20000}, {"text": "Two plus two is four."}]
    path = tmp_path / "long.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text"])
        w.writeheader()
        w.writerows(rows)
    data, tok = prepare(model_dir, tmp_path, str(path), max_seq_len=64)
    assert data.train.to_list() == prepare(model_dir, tmp_path, rows, max_seq_len=64)[0].train.to_list()
    assert [len(row["input_ids"]) for row in data.train] == [64, len(tok(rows[1]["text"]).input_ids) + 1]
    assert data.report.truncated_rows == 1


def test_a_jsonl_file_written_by_json_dump_is_read_as_datasets_reads_it(model_dir, tmp_path):
    """json.dump(rows) into data.jsonl (a JSON list), or each row dumped with indent=2: load_dataset, and so a TRL
    script, reads both, where this refused line 1 as malformed JSON or as 'a row must be a JSON object, got list'.
    A broken list names the line where it breaks; a bad JSON line of a real JSON-lines file is still that line."""
    rows = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(5)]
    plain = prepare(model_dir, tmp_path, rows, max_seq_len=64)[0].train.to_list()
    for name, text in (("list.jsonl", json.dumps(rows, indent=2)), ("line.jsonl", json.dumps(rows)),
                       ("pretty.jsonl", "\n".join(json.dumps(r, indent=2) for r in rows)),
                       ("pretty.json", "\n".join(json.dumps(r, indent=2) for r in rows))):
        (tmp_path / name).write_text(text)
        assert prepare(model_dir, tmp_path, str(tmp_path / name), max_seq_len=64)[0].train.to_list() == plain, name
    (tmp_path / "broken.jsonl").write_text('[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": "a",}\n]\n')
    with pytest.raises(UsageError, match=r"broken\.jsonl:3: malformed JSON \(Expecting property name .*; fix the file"):
        prepare(model_dir, tmp_path, str(tmp_path / "broken.jsonl"))
    (tmp_path / "typo.jsonl").write_text('{"prompt": "a", "completion": "b"\n{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(UsageError, match=r"typo\.jsonl:1: malformed JSON"):
        prepare(model_dir, tmp_path, str(tmp_path / "typo.jsonl"))
    data = prepare(model_dir, tmp_path, str(tmp_path / "typo.jsonl"), skip_bad_rows=True)[0]
    assert len(data.train) == 1 and data.report.bad_rows_skipped == 1


def test_compressed_files_are_read_as_datasets_reads_them(model_dir, tmp_path, capsys):
    """data.jsonl.gz (and .bz2, .xz; a CSV or a JSON array too), which load_dataset and so a TRL script read, was
    refused as an 'unsupported file type'; in a folder beside plain files it was left out without a word. A file
    that does not decompress is one line naming it, exit 2."""
    import bz2
    import gzip
    import lzma

    from shardtune.cli import main

    rows = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(5)]
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    plain = prepare(model_dir, tmp_path, rows, max_seq_len=64)[0].train.to_list()
    text = "prompt,completion\n" + "".join(f'"{r["prompt"]}","{r["completion"]}"\n' for r in rows)
    for name, data, opener in (("d.jsonl.gz", lines, gzip.open), ("d.jsonl.bz2", lines, bz2.open),
                               ("d.jsonl.xz", lines, lzma.open), ("d.json.gz", json.dumps(rows).encode(), gzip.open),
                               ("d.csv.gz", text.encode(), gzip.open)):
        with opener(tmp_path / name, "wb") as f:
            f.write(data)
        assert prepare(model_dir, tmp_path, str(tmp_path / name), max_seq_len=64)[0].train.to_list() == plain, name
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", rows[:2])
    with gzip.open(folder / "part-1.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[2:]))
    assert len(prepare(model_dir, tmp_path, str(folder), max_seq_len=64)[0].train) == 5
    write_jsonl(folder / "part-1.jsonl", rows[2:])  # the file beside its compressed copy: refused, not read twice
    with pytest.raises(UsageError, match=r"the folder holds both part-1\.jsonl and part-1\.jsonl\.gz, whose rows "
                                         r"would train twice if they are copies; move one out of the folder"):
        prepare(model_dir, tmp_path, str(folder), max_seq_len=64)
    (tmp_path / "bad.jsonl.gz").write_bytes(lines)  # named .gz, not compressed
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "bad.jsonl.gz"), "--model_name_or_path", model_dir,
                 "--cache_dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'bad.jsonl.gz'}: cannot decompress it as gz" in err[0], err


def test_folder_splits_and_saved_dataset(model_dir, tmp_path):
    import datasets

    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", CHATS[:2])
    write_jsonl(folder / "test.jsonl", CHATS[2:])
    data, _ = prepare(model_dir, tmp_path, str(folder), splits="train,test", max_seq_len=256)
    assert len(data.train) == 2 and len(data.eval) == 1 and data.report.eval.documents == 1
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHATS[:2]),
                          "test": datasets.Dataset.from_list(CHATS[2:])}).save_to_disk(str(saved))
    data2, _ = prepare(model_dir, tmp_path, str(saved), splits="train,test", max_seq_len=256)
    assert data2.train.to_list() == data.train.to_list() and data2.eval.to_list() == data.eval.to_list()
    assert not any("left out" in note for note in data2.report.notes)
    # A saved split that splits does not list is left out with a word, as a folder's file is.
    saved3 = tmp_path / "saved3"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHATS[:2]),
                          "validation": datasets.Dataset.from_list(CHATS[2:])}).save_to_disk(str(saved3))
    data4, _ = prepare(model_dir, tmp_path, str(saved3), splits="train,test", max_seq_len=256)
    assert data4.train.to_list() == data.train.to_list() and (data4.eval is None or not len(data4.eval))
    assert ("validation left out: named after a split that splits (train,test) does not list; add it there to read "
            "it") in data4.report.notes
    # Split words as `datasets` reads a folder (load_dataset, so a TRL script): these trained on the eval file too.
    for train_file, eval_file, splits in (("training.jsonl", "testing.jsonl", "train,test"),
                                          ("sums_train.jsonl", "sums_test.jsonl", "train,test"),
                                          ("training.jsonl", "dev.jsonl", "train,validation")):
        named = tmp_path / f"{train_file}-{eval_file}".replace(".", "-")
        named.mkdir(parents=True)
        write_jsonl(named / train_file, CHATS[:2])
        write_jsonl(named / eval_file, CHATS[2:])
        data3, _ = prepare(model_dir, tmp_path, str(named), splits=splits, max_seq_len=256)
        assert data3.train.to_list() == data.train.to_list() and data3.eval.to_list() == data.eval.to_list()


def test_each_split_reads_its_own_format(model_dir, tmp_path):
    """Chats to train on and prompt/completion rows to evaluate (as TRL takes a train and an eval data set, each
    read for itself): the eval file was read as chats and refused as "the field 'messages' is missing"."""
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", CHATS)
    write_jsonl(folder / "test.jsonl", [{"prompt": "How many cats?", "completion": " Three cats."}])
    data, tok = prepare(model_dir, tmp_path, str(folder), splits="train,test", max_seq_len=256)
    assert targets(tok, data.train[0]) == "Four.<|im_end|>" and len(data.train) == 3
    assert [targets(tok, row) for row in data.eval] == [" Three cats.<|end_of_text|>"]
    assert (data.report.data_format, data.report.eval.data_format) == ("chat", "prompt_completion")


def test_a_folders_files_that_no_split_reads_are_refused_naming_them(model_dir, tmp_path):
    """part1.jsonl beside test.jsonl was left out without a word (the error said only "no training rows in split(s)
    train"); it is named, with the way to have it read. A file named after a split the splits key leaves out
    (test.jsonl under splits train) is left out on purpose, and a folder whose files name no split at all still
    trains on every one."""
    folder = tmp_path / "folder"
    folder.mkdir()
    for name in ("part1", "part2", "test"):
        write_jsonl(folder / f"{name}.jsonl", CHATS)
    with pytest.raises(UsageError) as exc:
        prepare(model_dir, tmp_path, str(folder), splits="train,test", max_seq_len=256)
    assert str(exc.value) == (f"dataset_name '{folder}': part1.jsonl, part2.jsonl are named after none of the splits "
                              "(train, test), while the folder's other files are, so no split would read them; name "
                              "each file after its split (train.jsonl, test.jsonl; train-00001.jsonl counts too), or "
                              "move them out of the folder")
    (folder / "part1.jsonl").rename(folder / "train.jsonl")
    (folder / "part2.jsonl").rename(folder / "validation.jsonl")
    data, _ = prepare(model_dir, tmp_path, str(folder), splits="train", max_seq_len=256)
    assert len(data.train) == len(CHATS) and (data.eval is None or not len(data.eval))
    assert ("test.jsonl, validation.jsonl left out: named after a split that splits (train) does not list; add it "
            "there to read it") in data.report.notes
    data, _ = prepare(model_dir, tmp_path, str(folder), splits="train,validation", max_seq_len=256)
    assert len(data.train) == len(data.eval) == len(CHATS)
    # A split's word in a longer name counts, as `datasets` reads it (load_dataset, and so a TRL script).
    for name in ("train", "validation", "test"):
        (folder / f"{name}.jsonl").rename(folder / f"some-{name}.jsonl")
    data, _ = prepare(model_dir, tmp_path, str(folder), splits="train,test", max_seq_len=256)
    assert len(data.train) == len(data.eval) == len(CHATS)
    for name in ("train", "validation", "test"):
        (folder / f"some-{name}.jsonl").rename(folder / f"part-{name[:2]}.jsonl")
    data, _ = prepare(model_dir, tmp_path, str(folder), splits="train,test", max_seq_len=256)
    assert len(data.train) == 3 * len(CHATS)


def test_eval_split_ratio_holds_out_rows_by_seed(model_dir, tmp_path):
    rows = [{"prompt": f"Q{i}", "completion": f" A{i}"} for i in range(20)]
    # The only row held out: it was blamed on the file ("empty data set, or every row skipped as bad").
    with pytest.raises(UsageError, match=r"eval_split_ratio 0\.1 held out all 1 row\(s\), leaving none to train on"):
        prepare(model_dir, tmp_path, rows[:1], eval_split_ratio=0.1, max_seq_len=32)
    # Beside an eval split it holds nothing out, and says so (it was dropped without a word).
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows[:15])
    write_jsonl(folder / "test.jsonl", rows[15:])
    split, _ = prepare(model_dir, tmp_path, str(folder), splits="train,test", eval_split_ratio=0.3, max_seq_len=32)
    assert (len(split.train), len(split.eval)) == (15, 5)
    assert ("eval_split_ratio 0.3 holds nothing out: split(s) test give the eval rows (splits train alone would hold "
            "them out of train instead).") in split.report.notes
    a, _ = prepare(model_dir, tmp_path, rows, eval_split_ratio=0.25, max_seq_len=32, seed=1)
    b, _ = prepare(model_dir, tmp_path, rows, eval_split_ratio=0.25, max_seq_len=32, seed=2)
    assert len(a.train) == 15 and len(a.eval) == 5
    held_a = sorted(map(tuple, a.eval["input_ids"]))
    assert held_a != sorted(map(tuple, b.eval["input_ids"]))
    assert not set(held_a) & set(map(tuple, a.train["input_ids"]))
    # by the seed alone: the same seed, prepared afresh (no cache to hand the first split back), holds out the same rows
    (tmp_path / "again").mkdir()
    again, _ = prepare(model_dir, tmp_path / "again", rows, eval_split_ratio=0.25, max_seq_len=32, seed=1)
    assert sorted(map(tuple, again.eval["input_ids"])) == held_a


def test_bad_inputs_name_file_and_line(model_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CHATS[0]) + "\n{not json\n")
    with pytest.raises(UsageError, match=r"bad\.jsonl:2: malformed JSON.*skip_bad_rows"):
        prepare(model_dir, tmp_path, str(path))
    path.write_text(json.dumps(CHATS[0]) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "asistant", "content": "yo"}]}) + "\n")
    with pytest.raises(UsageError, match=r"bad\.jsonl:2: message 1 has role 'asistant' \(did you mean 'assistant'"):
        prepare(model_dir, tmp_path, str(path))
    path.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}) + "\n")
    with pytest.raises(UsageError, match=r"bad\.jsonl:1: message 0 \(user\): 'content' is a list of parts "
                                         r"\(\{type, text\}\), not text; write each message's content as one string"):
        prepare(model_dir, tmp_path, str(path))  # it was "has no text 'content'", of text in its parts
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(UsageError, match=r"bad\.jsonl:2: the field 'completion' is missing"):
        prepare(model_dir, tmp_path, str(path))
    path.write_text(json.dumps({"messages": "not a list"}) + "\n")  # it was "cannot tell the data format"
    with pytest.raises(UsageError, match=r"bad\.jsonl:1: the field 'messages' is missing or not a list; fix it"):
        prepare(model_dir, tmp_path, str(path))
    path.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n")
    with pytest.raises(UsageError, match=r"bad\.jsonl:1: cannot tell the data format from the columns \['answer'"):
        prepare(model_dir, tmp_path, str(path))
    path.write_text("\n")
    with pytest.raises(UsageError, match="no training rows"):
        prepare(model_dir, tmp_path, str(path))
    with pytest.raises(UsageError, match="does not exist"):
        prepare(model_dir, tmp_path, str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.csv").write_text("prompt,completion\nhi,there\nonly-one-field\n")
    with pytest.raises(UsageError, match=r"bad\.csv:3: has a different number of fields"):
        prepare(model_dir, tmp_path, str(tmp_path / "bad.csv"))


def test_skip_bad_rows_counts_and_drops(model_dir, tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(CHATS[0]), "{oops", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
             json.dumps(CHATS[1]), json.dumps({"messages": "not a list"})]
    path.write_text("\n".join(lines) + "\n")
    data, _ = prepare(model_dir, tmp_path, str(path), skip_bad_rows=True, max_seq_len=256)
    assert data.report.bad_rows_skipped == 3 and data.report.documents == 2
    text = data.report.format()
    assert "bad rows skipped 3" in text and "note: skipped " + str(path) + ":2: malformed JSON" in text
    assert "set skip_bad_rows true" not in text  # it is set: no note advises setting it


def test_cache_is_reused_and_invalidated(model_dir, tmp_path, monkeypatch):
    from shardtune.data import pipeline

    first, _ = prepare(model_dir, tmp_path, CHATS, max_seq_len=256)
    assert not first.from_cache

    def no_rebuild(*args, **kwargs):
        raise AssertionError("tokenised again despite a valid cache")

    monkeypatch.setattr(pipeline, "build_split", no_rebuild)
    second, _ = prepare(model_dir, tmp_path, CHATS, max_seq_len=256)
    assert second.from_cache and second.train.to_list() == first.train.to_list()
    assert second.report == first.report
    # settings that change no token: a run that only groups rows by length, or tokenises in 2 processes, reuses it
    assert prepare(model_dir, tmp_path, CHATS, max_seq_len=256, group_by_length=True, dataset_num_proc=2)[0].from_cache
    monkeypatch.undo()
    other, _ = prepare(model_dir, tmp_path, CHATS, max_seq_len=255)  # another setting: another cache
    assert not other.from_cache
    changed, _ = prepare(model_dir, tmp_path, CHATS + CHATS[:1], max_seq_len=256)  # changed data: rebuilt
    assert not changed.from_cache and len(changed.train) == 4
    # A new transformers (or tokenizers, or jinja2) may render or tokenise the same text otherwise: an upgrade
    # trained on the ids the old one made.
    import importlib.metadata

    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "99.0" if name == "transformers" else version(name))
    assert not prepare(model_dir, tmp_path, CHATS + CHATS[:1], max_seq_len=256)[0].from_cache
    monkeypatch.setattr(importlib.metadata, "version", version)
    # The same file spelt another way (relative or absolute, as inspect and a launch script may give it), or
    # copied elsewhere, is the same data: a large one was tokenised again, and cached again, for each spelling.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "data.jsonl").write_bytes((tmp_path / "data.jsonl").read_bytes())
    for spelling in ("data.jsonl", "./data.jsonl", str(tmp_path / "copy" / "data.jsonl")):
        again, _ = prepare(model_dir, tmp_path, spelling, max_seq_len=256)
        assert again.from_cache and again.cache_path == changed.cache_path, spelling


def test_cache_lives_where_shardtune_cache_or_xdg_cache_home_says(model_dir, tmp_path, monkeypatch):
    """A cluster home with a small quota: XDG_CACHE_HOME moves Hugging Face's caches to scratch, but the tokenised
    data (gigabytes for a large data set) still filled ~/.cache/shardtune."""
    cfg = DataConfig(dataset_name=write_jsonl(tmp_path / "d.jsonl", CHATS), splits="train", max_seq_len=256)
    tok = load_tokenizer(model_dir, cfg)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SHARDTUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "scratch"))
    data = prepare_datasets(cfg, tok, seed=0)
    assert data.cache_path.parent == tmp_path / "scratch" / "shardtune" / "data"
    assert not (tmp_path / "home").exists()
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "mine"))  # shardtune's own variable comes first
    assert prepare_datasets(cfg, tok, seed=0).cache_path.parent == tmp_path / "mine" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("SHARDTUNE_CACHE")
    assert prepare_datasets(cfg, tok, seed=0).cache_path.parent == tmp_path / "home" / ".cache" / "shardtune" / "data"


def test_config_validate_reports_every_problem():
    from shardtune.config.validation import data_problems

    bad = {"data_format": "chatty", "chat_template_format": "chatmlx", "max_seq_len": 0, "splits": "test",
           "eval_split_ratio": 1.5}
    problems = data_problems(DataConfig(**bad))
    # One problem for each bad value and for the missing dataset_name, each carrying its own key (the key puts a
    # recipe's file and line in front of it) and naming the key and the value given.
    assert sorted(p.keys for p in problems) == sorted([(key,) for key in bad] + [("dataset_name",)])
    for p in problems:
        (key,) = p.keys
        assert p.startswith(key) and (key == "dataset_name" or str(bad[key]) in p), p
    assert all("\n" not in p for p in problems)
    # a misspelt choice gets the nearest one (the bad value and the list of choices name "chatml" anyway)
    assert [p.rsplit(" (", 1)[-1] for p in problems if "did you mean" in p] == ["did you mean chat?)",
                                                                             "did you mean chatml?)"]
    assert data_problems(DataConfig(dataset_name="x.jsonl")) == []


def test_cli_inspect_prints_report_and_example(model_dir, tmp_path, capsys):
    from shardtune.cli import main

    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    rc = main(["data", "inspect", path, "--model_name_or_path", model_dir, "--max_seq_len", "128", "--packing",
               "--splits", "train", "--cache_dir", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert rc == 0 and "packing efficiency" in out and "target tokens" in out and "⟦The blue river.<|im_end|>⟧" in out
    # where the tokenised rows are, and whether this run made them: a user tells a reused cache from a new one
    (entry,) = (tmp_path / "c").iterdir()
    assert f"tokenised data: built now and cached in {entry}\n" in out
    rc = main(["data", "inspect", path, "--model_name_or_path", model_dir, "--max_seq_len", "128", "--packing",
               "--splits", "train", "--cache_dir", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert rc == 0 and f"tokenised data: read from the cache {entry} (built by an earlier run" in out
    rc = main(["data", "inspect", str(tmp_path / "nope.jsonl"), "--model_name_or_path", model_dir])
    assert rc == 2 and "nope.jsonl" in capsys.readouterr().err
    # A training recipe is inspected as it will be trained: its keys, then the command line's on top.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {model_dir}\ndataset_name: {path}\nsplits: train\nmax_seq_len: 64\n"
                      f"output_dir: {tmp_path / 'out'}\npacking: true\n")
    rc = main(["data", "inspect", str(recipe), "max_seq_len=128", "--example", "0", "--cache_dir", str(tmp_path / "c")])
    assert rc == 0 and "max_seq_len 128, packed" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # inspecting writes no training output
    # Beyond the model's positions (the tiny model's 2048) train refuses it, and so does inspect (it showed it).
    rc = main(["data", "inspect", str(recipe), "max_seq_len=4096", "--cache_dir", str(tmp_path / "c")])
    assert rc == 2 and "max_seq_len 4096 is beyond the 2048 positions" in capsys.readouterr().err
    rc = main(["data", "inspect", str(recipe), "--max_seq_lenn", "128"])
    assert rc == 2 and "did you mean 'max_seq_len'" in capsys.readouterr().err
    # A JSON recipe, as train reads one (it was read as the data set, and the model was missing); a JSON data file
    # of rows stays the data set.
    as_json = tmp_path / "args.json"
    as_json.write_text(json.dumps(yaml.safe_load(recipe.read_text())))
    rc = main(["data", "inspect", str(as_json), "max_seq_len=96", "--cache_dir", str(tmp_path / "c")])
    assert rc == 0 and "max_seq_len 96, packed" in capsys.readouterr().out
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(CHATS))
    rc = main(["data", "inspect", str(rows), "--model_name_or_path", model_dir, "--max_seq_len", "64", "--splits",
               "train", "--cache_dir", str(tmp_path / "c")])
    assert rc == 0 and "max_seq_len 64)" in capsys.readouterr().out
    rc = main(["data", "inspect", str(recipe), "--example", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--example: invalid int value: 'x'" in err
    # A typo of inspect's own option was answered with the training keys ('see shardtune train --help-keys')
    rc = main(["data", "inspect", str(recipe), "--examples", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "--examples: no option of 'shardtune data inspect' and no training key; did you mean " \
        "--example?" in err


def test_template_that_rewrites_history_falls_back_to_finding_replies(model_dir, tmp_path):
    # marks only the last user turn, so the history rendered alone is not a prefix of the whole conversation
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
                "{% if m['role'] == 'user' and loop.revindex <= 2 %}{{ '[latest] ' }}{% endif %}"
                "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    cfg = DataConfig(dataset_name=write_jsonl(tmp_path / "d.jsonl", CHATS), splits="train", max_seq_len=256)
    tok = load_tokenizer(model_dir, cfg)
    tok.chat_template = template
    data = prepare_datasets(cfg, tok, seed=0, cache_dir=str(tmp_path / "cache"))
    for row, conv in zip(data.train, CHATS):
        assert "[latest]" in tok.decode(row["input_ids"])
        assert targets(tok, row) == assistant_text(conv, "<|im_end|>")


def test_hub_cache_key_follows_the_datasets_revision(monkeypatch):
    """A new upload to the hub (a new commit sha) must not reuse the tokenised cache of the old one."""
    import huggingface_hub

    from shardtune.data.readers import resolve

    shas = iter(["aaa111", "bbb222"])
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info",
                        lambda self, name, timeout=None: type("Info", (), {"sha": next(shas)})())
    first, second = resolve("org/chats", ["train"], None), resolve("org/chats", ["train"], None)
    assert first.kind == second.kind == "hub" and first.fingerprint != second.fingerprint
    assert "aaa111" in first.fingerprint and "bbb222" in second.fingerprint
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: keyed by the name, with a warning
    assert resolve("org/chats", ["train"], None).fingerprint.endswith(":unknown")


def test_a_malformed_row_says_where_in_plain_words():
    """json's message for a raw tab in a string ends in 'at'; the row's error read 'character at at column 15'."""
    import json

    from shardtune.data.readers import json_error

    with pytest.raises(json.JSONDecodeError) as info:
        json.loads('{"text": "a\tb"}')
    assert json_error(info.value) == "Invalid control character at column 12"
    with pytest.raises(json.JSONDecodeError) as info:
        json.loads('{"text": "a"')
    assert json_error(info.value) == "Expecting ',' delimiter at column 13"


def test_a_line_cut_short_inside_a_string_is_said_so(model_dir, tmp_path):
    """A line of a large file cut short in the middle of a reply (a copy or a generator stopped there) was reported
    as 'Invalid control character at column 52': its newline, read as part of the unclosed string."""
    lines = [json.dumps(c) for c in CHATS]
    lines[1] = lines[1][:60]
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UsageError) as info:
        prepare(model_dir, tmp_path, str(path))
    at = lines[1].rindex('"') + 1
    assert str(info.value) == (f"{path}:2: malformed JSON (the string at column {at} is never closed: is the line cut "
                               "short?); fix it, or set skip_bad_rows true to drop bad rows")
    data, _ = prepare(model_dir, tmp_path, str(path), skip_bad_rows=True)
    assert data.report.bad_rows_skipped == 1 and data.report.documents == 2


def test_a_reply_is_never_taken_from_the_question_that_asks_for_it(model_dir, tmp_path):
    """Mistral v0.3's template writes the system prompt into the last user turn, so the history rendered alone is
    not a prefix of the conversation and the replies are found in the text: "OK" was found inside "Say OK or NO"
    and the question trained, the reply not."""
    template = ("{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
                "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
                "{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'user' %}"
                "{{ '<|im_start|>user\n' }}{% if m == users[-1] and system %}{{ system + '\n\n' }}{% endif %}"
                "{{ m['content'] + '<|im_end|>\n<|im_start|>assistant\n' }}"
                "{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}")
    conv = {"messages": [{"role": "system", "content": "Be terse."},
                         {"role": "user", "content": "Is 2 > 1? Say OK or NO"}, {"role": "assistant", "content": "OK"},
                         {"role": "user", "content": "Is 1 > 2? Say OK or NO"}, {"role": "assistant", "content": "NO"}]}
    cfg = DataConfig(dataset_name=write_jsonl(tmp_path / "d.jsonl", [conv]), splits="train", max_seq_len=256)
    tok = load_tokenizer(model_dir, cfg)
    tok.chat_template = template
    row = prepare_datasets(cfg, tok, seed=0, cache_dir=str(tmp_path / "cache")).train[0]
    trained = [i for i, label in enumerate(row["labels"]) if label != IGNORE]
    runs = [[i for i in trained if i >= start and all(j in trained for j in range(start, i + 1))]
            for start in trained if start - 1 not in trained]
    assert [tok.decode([row["input_ids"][i] for i in run]) for run in runs] == ["OK<|im_end|>", "NO<|im_end|>"]
    for run, question in zip(runs, ("Is 2 > 1? Say OK or NO", "Be terse.\n\nIs 1 > 2? Say OK or NO")):
        assert tok.decode(row["input_ids"][:run[0]]).endswith(question + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """A tiny model with a Llama-2/Mistral-style tokenizer: SentencePiece's Metaspace marks a text's start with
    a space ("15" alone is "▁15"), which byte-level BPE, the other tests' tokenizer, does not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from shardtune.testing.tiny import sample_corpus

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    sums = [f"What is {a} plus {b}? {a + b}" for a in range(20) for b in range(20)]
    tok.train_from_iterator(sample_corpus(300) + sums,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                initial_alphabet=list("\n"), show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return str(make_model_folder(tmp_path_factory.mktemp("sp") / "model", tokenizer=fast))


def test_a_sentencepiece_row_is_tokenised_whole_as_trl_and_generation_tokenise_it(sentencepiece_dir, tmp_path):
    """Each piece tokenised apart gave every reply and completion a leading "▁" (" 15": not what the model sees
    when it generates, nor what TRL trains); the whole text is tokenised once and the targets marked in it."""
    chat = {"messages": [{"role": "user", "content": "What is 7 plus 8?"}, {"role": "assistant", "content": "15"},
                         {"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}]}
    pair = {"prompt": "What is 7 plus 8?", "completion": "15"}
    for rows, template, whole in (([chat], "zephyr", None), ([pair], "none", "What is 7 plus 8?15")):
        (tmp_path / template).mkdir()
        data, tok = prepare(sentencepiece_dir, tmp_path / template, rows, chat_template_format=template,
                            max_seq_len=128)
        row = data.train[0]
        whole = whole or tok.apply_chat_template(chat["messages"], tokenize=False)
        expected = tok(whole, add_special_tokens=False).input_ids
        assert row["input_ids"] == [tok.bos_token_id, *expected, *([tok.eos_token_id] if template == "none" else [])]
        trained = [tok.convert_ids_to_tokens(t) for t in row["labels"] if t != IGNORE]
        assert trained == (["1", "5", "</s>", "4", "</s>"] if template == "zephyr" else ["1", "5", "</s>"])


def test_a_tokenizer_without_offsets_tokenises_each_piece(model_dir):
    """A slow tokenizer gives no character offsets: the pieces are tokenised apart (where byte-level BPE gives
    the same ids as the whole text)."""
    from shardtune.data.encode import marked_ids

    class Slow:
        is_fast = False

        def __init__(self, tok):
            self.tok = tok

        def __call__(self, text, **kwargs):
            assert "return_offsets_mapping" not in kwargs
            return self.tok(text, **kwargs)

    tok = load_tokenizer(model_dir, DataConfig(dataset_name="unused"))
    segments = [("<|im_start|>user\nHow many cats?<|im_end|>\n<|im_start|>assistant\n", False),
                ("Three cats and one dog.<|im_end|>", True), ("\n", False)]
    whole = marked_ids(tok, segments, None, 8)
    assert marked_ids(Slow(tok), segments, None, 8) == whole
    ids, marks, length, estimated = whole
    assert tok.decode([i for i, m in zip(ids, marks) if m]) == "Three cats and one dog.<|im_end|>"
    assert length == len(ids) and not estimated
