"""Row formats: chat (``messages``), prompt/completion, Alpaca (instruction/input/output) and raw text.

Every row is turned into one canonical example so that a single encoder handles all of them:
``{"kind": "chat" | "prompt_completion" | "text", "messages": [...], "target_from": int, "prompt": str,
"completion": str, "tools": str, "template_kwargs": str, "where": str}``: ``tools`` is a chat row's function
definitions (TRL's ``tools`` column, which the chat template writes into the prompt) as JSON text, or empty;
``template_kwargs`` its ``chat_template_kwargs`` (the template's variables for the row) as JSON text, or empty.
"""

from __future__ import annotations

import json

from shardtune.data.readers import SKIP_HINT, BadRow
from shardtune.data.templates import alpaca_prompt
from shardtune.errors import UsageError, closest

ROLES = ("system", "user", "assistant", "tool")
# "tool": the tool replies of ShareGPT function-calling sets (NousResearch's hermes-function-calling-v1)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
                  "tool": "tool"}


def detect_format(row: dict, text_field: str) -> str:
    """The format a row's columns say it has: chat, prompt_completion, alpaca or text."""
    # chat first: a chat data set with a `content` text field (the PEFT recipe) must still be read as chat
    if isinstance(row.get("messages"), list) or isinstance(row.get("conversations"), list):
        return "chat"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if text_field in row:  # a list there (or its JSON text, as a CSV cell holds it) is a conversation
        return "chat" if isinstance(_as_messages(row[text_field]), list) else "text"
    if "messages" in row or "conversations" in row:
        return "chat"  # whose messages are no list: reading them says so, at the row
    if "input_ids" in row:  # TRL trains such rows as they are (its skip_prepare_dataset data)
        raise UsageError(f"the rows are already tokenised (columns {sorted(row)}), which shardtune does not read: it "
                         f"tokenises each row itself, with the model's tokenizer and chat template, to mark its "
                         f"targets; give the rows as text instead: 'messages', 'prompt'+'completion' or the text "
                         f"field '{text_field}' (tokenizer.decode gives a row's text back).")
    raise UsageError(f"cannot tell the data format from the columns {sorted(row)}: give rows with 'messages', "
                     f"'prompt'+'completion', 'instruction'+'output' or the text field '{text_field}' "
                     "(set dataset_text_field or data_format).")


def _decoded(value, key: str, where: str):
    """A column of messages written as JSON text (a CSV cell can hold nothing else) as its list; another value as
    it is."""
    if not (isinstance(value, str) and value.lstrip().startswith("[")):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise BadRow(where, f"'{key}' is text that starts as a JSON list but does not parse ({exc.msg} at character "
                            f"{exc.pos}); {SKIP_HINT}") from None


def _as_messages(value):
    """A prompt or completion written as JSON text of a message list (a conversational data set exported to CSV) as
    that list; any other value as it is. Unlike ``_decoded``, text that is not such a list stays text: a plain
    completion may well be '[1, 2, 3]'."""
    if not (isinstance(value, str) and value.lstrip().startswith("[")):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    listed = isinstance(parsed, list) and bool(parsed)
    return parsed if listed and all(isinstance(m, dict) and ("role" in m or "from" in m) for m in parsed) else value


# A message's keys read here, not handed to the template as they are (ShareGPT's from and value are its role and
# content; weight marks an untrained turn)
OWN_KEYS = ("role", "content", "tool_calls", "weight", "from", "value")


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow(where, f"'messages' must be a non-empty list of {{role, content}} objects; {SKIP_HINT}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise BadRow(where, f"message {i} is not an object with role and content; {SKIP_HINT}")
        if "from" in m and "value" in m and "role" not in m:  # ShareGPT
            role = SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise BadRow(where, f"message {i} has unknown ShareGPT role '{m['from']}': use one of "
                                    f"{', '.join(SHAREGPT_ROLES)}; {SKIP_HINT}")
            m = {**m, "role": role, "content": m["value"]}  # its other keys (a weight) kept
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            hint = closest(str(role), ROLES) if role is not None else None
            did = f" (did you mean '{hint}'?)" if hint else ""
            raise BadRow(where, f"message {i} has role {role!r}{did}: roles must be one of {', '.join(ROLES)}; "
                                f"{SKIP_HINT}")
        calls = m.get("tool_calls")  # an empty list (OpenAI exports write one on every message) is no calls
        if calls is not None and (not isinstance(calls, list) or (calls and role != "assistant")
                                  or not all(isinstance(call, dict) for call in calls)):
            raise BadRow(where, f"message {i} ({role}): tool_calls must be a list of objects, on an assistant "
                                f"message; {SKIP_HINT}")
        if content is None and calls:  # the OpenAI form of a turn that only calls tools
            content = ""
        if isinstance(content, list):  # OpenAI's content parts: templates join them each their own way, or fail
            raise BadRow(where, f"message {i} ({role}): 'content' is a list of parts ({{type, text}}), not text; "
                                f"write each message's content as one string (its parts' text joined); {SKIP_HINT}")
        if not isinstance(content, str):
            raise BadRow(where, f"message {i} ({role}) has no text 'content'; {SKIP_HINT}")
        message = {"role": role, "content": content}
        weight = m.get("weight")  # OpenAI's fine-tuning files: 0 on an assistant turn that is not to be trained
        if weight is not None and (isinstance(weight, bool) or weight not in (0, 1) or
                                   (weight == 1 and role != "assistant")):
            raise BadRow(where, f"message {i} ({role}) has weight {weight!r}: a weight is 0 (not trained) or 1 "
                                f"(trained, on an assistant message only); {SKIP_HINT}")
        if weight == 0 and role == "assistant":
            message["weight"] = 0
        # the message's other keys reach the template as TRL hands them on: a tool reply's call id and name, an
        # assistant turn's reasoning (Qwen3's reasoning_content, gpt-oss's thinking); a table's null padding dropped
        tools = {"tool_calls": calls} if calls else {}
        tools.update({key: value for key, value in m.items() if key not in OWN_KEYS and value is not None})
        if tools:  # rendered by the chat template, which must write the calls (encode.chat_segments checks)
            message[TOOLS] = json.dumps(tools, default=str)  # a table's dates as text
        out.append(message)
    return out


def _tools(row: dict, where: str) -> str:
    """The row's ``tools`` (TRL's column: a list of function definitions, JSON schemas) as JSON text; empty where
    it has none (a null, an empty list or an empty string: Arrow gives every row of a file that has the column
    one)."""
    tools = row.get("tools")
    if tools is None or tools == [] or (isinstance(tools, str) and not tools.strip()):
        return ""
    if isinstance(tools, str):  # a JSON string, as some exports write the column
        try:
            tools = json.loads(tools)
        except ValueError:
            tools = None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRow(where, f"'tools' must be a list of function definitions (objects, as TRL's tools column "
                            f"holds them); {SKIP_HINT}")
    return json.dumps(tools)


# apply_chat_template's own arguments, which a row's chat_template_kwargs cannot set
TEMPLATE_OWN = ("conversation", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
                "continue_final_message", "return_dict", "return_assistant_tokens_mask")


def _template_kwargs(row: dict, where: str) -> str:
    """The row's ``chat_template_kwargs`` (TRL's column: the chat template's own variables for this row, e.g.
    Qwen3's enable_thinking) as JSON text; empty where it has none."""
    kwargs = row.get("chat_template_kwargs")
    if isinstance(kwargs, str) and kwargs.strip():  # a CSV cell's JSON text
        try:
            kwargs = json.loads(kwargs)
        except ValueError:
            pass
    if kwargs is None or kwargs == {} or (isinstance(kwargs, str) and not kwargs.strip()):
        return ""
    if not isinstance(kwargs, dict) or (own := [k for k in kwargs if k in TEMPLATE_OWN]):
        what = f"names {', '.join(own)}, which the template call sets itself" if isinstance(kwargs, dict) else \
            f"is {_shape(kwargs)}"
        raise BadRow(where, f"'chat_template_kwargs' {what}: give an object of the chat template's variables (TRL's "
                            f"column), e.g. {{\"enable_thinking\": false}}; {SKIP_HINT}")
    return json.dumps(kwargs)


# A message's tool calls and other keys for the template (a tool reply's call id, a turn's reasoning), kept as JSON
# text: the examples pass through an Arrow table, which would give every message and every call's arguments the
# keys of all the others.
TOOLS = "tools_json"


def template_message(message: dict) -> dict:
    """A canonical message as a chat template reads it: role, content, and its tool keys where it has them."""
    return {"role": message["role"], "content": message["content"],
            **(json.loads(message[TOOLS]) if message.get(TOOLS) else {})}


def _text(row: dict, key: str, where: str, allow_empty: bool = False) -> str:
    value = row.get(key)
    if value is None and allow_empty:
        return ""
    if isinstance(value, str) and (value or allow_empty):
        return value
    # what the row holds there: a column whose type changes between rows (a number, a list) or a Parquet binary one
    what = ("missing" if key not in row else "empty" if value in ("", None) else
            "bytes, not text (a binary column: store it as UTF-8 strings)" if isinstance(value, bytes) else
            f"{_shape(value)}, not text")
    raise BadRow(where, f"the field '{key}' is {what}: give it as a non-empty string; {SKIP_HINT}")


def _shape(value) -> str:
    """What a prompt or completion value is, in a user's words."""
    if isinstance(value, list):
        return "a list of messages"
    name = type(value).__name__
    return "empty" if value is None else "a string" if isinstance(value, str) else \
        f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def to_example(row: dict, where: str, fmt: str, text_field: str, alpaca_as_chat: bool) -> dict:
    """The canonical example of one row in format ``fmt``; raises BadRow when the row does not fit it."""
    base = {"kind": "chat", "messages": [], "target_from": 0, "prompt": "", "completion": "", "tools": "",
            "template_kwargs": "", "where": where}
    tools = _tools(row, where)
    template = {"tools": tools, "template_kwargs": _template_kwargs(row, where)}  # a chat's, as TRL renders it
    if fmt == "chat":
        columns = {k: _decoded(row.get(k), k, where) for k in ("messages", "conversations")}
        # a list in the text field, or its JSON text; other text there is no chat
        columns.setdefault(text_field, _as_messages(row.get(text_field)))
        key = next((k for k, value in columns.items() if isinstance(value, list)), None)
        if key is None:
            raise BadRow(where, f"the field 'messages' is missing or not a list; {SKIP_HINT}")
        return {**base, "messages": _messages(columns[key], where), **template}
    if fmt == "prompt_completion":
        prompt, completion = _as_messages(row.get("prompt")), _as_messages(row.get("completion"))
        # conversational prompt/completion; a null prompt is an empty one, as for strings
        if isinstance(completion, list) and (isinstance(prompt, list) or prompt is None):
            prompt_msgs = _messages(prompt, where) if prompt else []
            return {**base, "messages": prompt_msgs + _messages(completion, where), "target_from": len(prompt_msgs),
                    **template}
        if isinstance(prompt, list) or isinstance(completion, list):  # one conversational, the other not
            raise BadRow(where, f"'prompt' is {_shape(prompt)} but 'completion' is {_shape(completion)}: give both "
                                f"as lists of {{role, content}} messages (conversational) or both as strings; "
                                f"{SKIP_HINT}")
    if tools:
        raise BadRow(where, f"its 'tools' reach the model only through a chat template: give the row as 'messages' "
                            f"(or a conversational prompt and completion), or leave the tools out; {SKIP_HINT}")
    if fmt == "prompt_completion":
        return {**base, "kind": "prompt_completion", "prompt": _text(row, "prompt", where, allow_empty=True),
                "completion": _text(row, "completion", where)}
    if fmt == "alpaca":
        instruction, output = _text(row, "instruction", where), _text(row, "output", where)
        input_text = _text(row, "input", where, allow_empty=True)
        system = _text(row, "system", where, allow_empty=True)  # LLaMA-Factory's Alpaca column
        if alpaca_as_chat:
            user = instruction + (f"\n\n{input_text}" if input_text else "")
            messages = [{"role": "system", "content": system}] if system else []
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
            return {**base, "messages": messages}
        return {**base, "kind": "prompt_completion", "prompt": alpaca_prompt(instruction, input_text, system),
                "completion": output}
    if fmt == "text":
        return {**base, "kind": "text", "completion": _text(row, text_field, where)}
    raise UsageError(f"unknown data_format '{fmt}'.")
