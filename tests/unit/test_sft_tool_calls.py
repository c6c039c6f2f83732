"""Tool calls are never dropped (`data.source: sft`): sharegpt function_call / observation turns and a
`tools` column (LLaMA-Factory's glaive_toolcall demo layout) reach the trained and prompt tokens through
a template that renders them, or through data.tool_format (json, qwen) with a plain ChatML template;
a rendering that leaves a call, a tool or an answer out refuses the run before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sft_fixtures import make_chatml_tokenizer
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.config import ConfigError, load_config
from elastictrain.data.sft.dataset import SftDataError, build_sft_dataset
from elastictrain.data.sft.records import Conversation
from elastictrain.data.sft.tool_text import JSON_PREAMBLE, QWEN_TOOLS_HEAD, QWEN_TOOLS_TAIL, with_tool_format

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"

# A Qwen2.5-style template: tools in the system turn inside <tools></tools>, each call as <tool_call>,
# tool results as <tool_response> inside a user turn (results in a row share it).
QWEN_LIKE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}{{ 'You are helpful.' }}{% endif %}"
    "{{ '\\n\\n# Tools\\n\\n<tools>' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}{{ '<|im_start|>assistant' }}"
    "{% if message.content %}{{ '\\n' + message.content }}{% endif %}"
    '{% for call in message.tool_calls or [] %}{{ \'\\n<tool_call>\\n{"name": "\' + call.function.name }}'
    "{{ '\", \"arguments\": ' + call.function.arguments | tojson + '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% elif message.role != 'system' %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template that cannot render role tool (it raises), else ChatML.
NO_TOOL_ROLE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('roles: user, assistant, system') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template that writes every assistant turn without its content.
NO_CONTENT = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML that writes a call's name but not its arguments, and the tools' names in the system turn.
NAME_ONLY = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t.name + ' ' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.tool_calls or [] %}{{ call.function.name }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city now",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
}
CONVERT = {
    "name": "convert_currency",
    "description": "Convert an amount between currencies",
    "parameters": {
        "type": "object",
        "properties": {"amount": {"type": "number"}, "to": {"type": "string"}},
        "required": ["amount", "to"],
    },
}


def call(name: str, **arguments: Any) -> dict[str, str]:
    return {"from": "function_call", "value": json.dumps({"name": name, "arguments": arguments})}


def turn(who: str, text: str) -> dict[str, str]:
    return {"from": who, "value": text}


# glaive_toolcall_en_demo's layout: sharegpt turns, `tools` a JSON string of function schemas.
RECORDS: list[dict[str, Any]] = [
    {
        "conversations": [
            turn("human", "What is the weather in Paris?"),
            call("get_weather", city="Paris"),
            turn("observation", '{"temp": 18, "sky": "clear"}'),
            turn("gpt", "It is 18 degrees and clear in Paris."),
        ],
        "tools": json.dumps([WEATHER]),
    },
    {
        "conversations": [
            turn("human", "Weather in Oslo, then 20 euros in dollars?"),
            call("get_weather", city="Oslo", unit="c"),
            turn("observation", '{"temp": 4}'),
            call("convert_currency", amount=20, to="USD"),
            turn("observation", '{"result": 21.7}'),
            turn("gpt", "Oslo is at 4 degrees; 20 euros are 21.7 dollars."),
        ],
        "tools": json.dumps([WEATHER, CONVERT]),
    },
    {
        "conversations": [turn("human", "Tell me a joke"), turn("gpt", "I have no tool for jokes, sorry.")],
        "tools": json.dumps([CONVERT]),
    },
    {
        "conversations": [
            turn("human", "Weather in Rome and in Lima?"),
            {
                "from": "function_call",
                "value": json.dumps(
                    [
                        {"name": "get_weather", "arguments": {"city": "Rome"}},
                        {"name": "get_weather", "arguments": {"city": "Lima"}},
                    ]
                ),
            },
            turn("observation", '{"temp": 25}'),
            turn("gpt", "Rome 25 degrees; Lima did not answer."),
        ],
        "system": "You answer briefly.",
        "tools": json.dumps([WEATHER]),
    },
    {
        "conversations": [
            turn("human", "Convert 5 dollars to yen"),
            call("convert_currency", amount=5, to="JPY"),
            turn("observation", '{"result": 740}'),
            turn("gpt", "5 dollars are 740 yen."),
        ],
        "tools": json.dumps([CONVERT, WEATHER]),
    },
]
CALLS = [  # (record, name, arguments) of every call above
    (0, "get_weather", {"city": "Paris"}),
    (1, "get_weather", {"city": "Oslo", "unit": "c"}),
    (1, "convert_currency", {"amount": 20, "to": "USD"}),
    (3, "get_weather", {"city": "Rome"}),
    (3, "get_weather", {"city": "Lima"}),
    (4, "convert_currency", {"amount": 5, "to": "JPY"}),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chatml_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(tok: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok)


@pytest.fixture()
def glaive(tmp_path: Path) -> Path:
    path = tmp_path / "glaive_toolcall_en_demo.json"
    path.write_text(json.dumps(RECORDS, indent=1))
    return path


def template(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "template.jinja"
    path.write_text(text)
    return path


def sft(tok: Path, path: Path, *overrides: str) -> Any:
    return load_config(
        TINY,
        [
            "data.source=sft",
            f"data.path={path}",
            f"data.tokenizer={tok}",
            "data.packing=false",
            "data.seq_len=4096",
            "model.hf_config.max_position_embeddings=4096",
            *overrides,
        ],
    )


def split(hf: Any, item: dict[str, Any]) -> tuple[str, str]:
    """(the trained tokens' text, the prompt tokens' text): each decoded run by run, runs joined."""
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    trained, prompt, start = [], [], 0
    while start < len(ids):
        on = labels[start] != -100
        end = start
        while end < len(ids) and (labels[end] != -100) == on:
            end += 1
        (trained if on else prompt).append(hf.decode(ids[start:end]))
        start = end
    return "\n".join(trained), "\n".join(prompt)


def assert_calls_trained_and_tools_prompted(hf: Any, dataset: Any) -> None:
    assert len(dataset) == len(RECORDS)
    texts = [split(hf, dataset[i]) for i in range(len(dataset))]
    for record, name, arguments in CALLS:
        trained, _ = texts[record]
        as_json = json.dumps({"name": name, "arguments": arguments})
        assert as_json in trained, (record, as_json, trained)
    for i, record in enumerate(RECORDS):
        trained, prompt = texts[i]
        for tool in json.loads(record["tools"]):
            assert tool["name"] in prompt and json.dumps(tool["parameters"]) in prompt, (i, tool["name"])
        final = record["conversations"][-1]["value"]
        assert final in trained
        for t in record["conversations"]:
            if t["from"] == "observation":  # tool results are prompt, never trained
                assert t["value"] in prompt and t["value"] not in trained


def test_a_template_that_renders_tool_calls_trains_every_call_and_prompts_every_tool(
    tmp_path, tok, hf, glaive
):
    dataset = build_sft_dataset(sft(tok, glaive, f"data.template={template(tmp_path, QWEN_LIKE)}").data)
    assert_calls_trained_and_tools_prompted(hf, dataset)
    trained, prompt = split(hf, dataset[1])
    assert (
        '<tool_call>\n{"name": "convert_currency", "arguments": {"amount": 20, "to": "USD"}}\n</tool_call>'
        in (trained)
    )
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(CONVERT) + "\n</tools>" in prompt


def test_a_plain_chatml_template_refuses_tool_records_naming_them_and_data_tool_format(tok, glaive):
    with pytest.raises(SftDataError) as e:
        build_sft_dataset(sft(tok, glaive).data)
    message = str(e.value)
    lines = message.splitlines()
    assert lines[0].startswith(
        "data: 5 of 5 instruction records would train without their tool calls and tools: the chat template "
        f"of data.tokenizer {str(tok)!r} leaves them out of the rendering"
    ), message
    assert lines[1].startswith(
        f'  {glaive} record 0: answer 1: the call get_weather {{"city": "Paris"}} is not in its answer tokens'
    ), message
    assert f"{glaive} record 2: the tool convert_currency is not in the prompt" in message
    record_1 = next(line for line in lines if line.startswith(f"  {glaive} record 1: "))
    assert 'answer 2: the call convert_currency {"amount": 20, "to": "USD"} is not' in record_1
    assert lines[-1].startswith("data.tool_format: set it to json or qwen"), message


def test_the_refusal_comes_before_any_worker_starts_even_with_skip(tmp_path, tok, glaive):
    from elastictrain.driver.preflight import check_sft_records
    from elastictrain.user_code import UserCodeError

    with pytest.raises(UserCodeError, match=r"(?m)^data.tool_format: set it to json or qwen"):
        check_sft_records(sft(tok, glaive, "data.on_bad_record=skip"))
    run = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        ["train", "-c", str(TINY), "data.source=sft", f"data.path={glaive}", f"data.tokenizer={tok}"]
        + [
            "data.packing=false",
            "data.seq_len=4096",
            "model.hf_config.max_position_embeddings=4096",
            f"run.dir={run}",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "data: 5 of 5 instruction records would train without their tool calls" in result.output
    assert not (run / "run.json").exists()


@pytest.mark.parametrize("tool_format", ["json", "qwen"])
def test_tool_format_with_plain_chatml_trains_every_call_and_prompts_every_tool(tok, hf, glaive, tool_format):
    dataset = build_sft_dataset(sft(tok, glaive, f"data.tool_format={tool_format}").data)
    assert_calls_trained_and_tools_prompted(hf, dataset)


def test_qwen_tool_format_writes_llamafactory_s_qwen_text(tok, hf, glaive):
    dataset = build_sft_dataset(sft(tok, glaive, "data.tool_format=qwen").data)
    tools = "".join("\n" + json.dumps({"type": "function", "function": t}) for t in (WEATHER, CONVERT))
    assert hf.decode(dataset[1]["input_ids"].tolist()) == (
        f"<|im_start|>system\n{(QWEN_TOOLS_HEAD + tools + QWEN_TOOLS_TAIL).lstrip()}<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo, then 20 euros in dollars?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "c"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 4}\n</tool_response><|im_end|>\n'
        '<|im_start|>assistant\n<tool_call>\n{"name": "convert_currency", "arguments": {"amount": 20, "to": '
        '"USD"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"result": 21.7}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nOslo is at 4 degrees; 20 euros are 21.7 dollars.<|im_end|>\n"
    )
    assert "# Tools\n\nYou may call one or more functions" in QWEN_TOOLS_HEAD
    trained, _ = split(hf, dataset[3])  # two calls of one turn: a <tool_call> each
    assert trained.count("<tool_call>") == 2
    system = hf.decode(dataset[3]["input_ids"].tolist()).split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou answer briefly.\n\n# Tools\n\n")


def test_json_tool_format_keeps_role_tool_where_the_template_renders_it_else_a_user_turn(
    tmp_path, tok, hf, glaive
):
    dataset = build_sft_dataset(sft(tok, glaive, "data.tool_format=json").data)
    text = hf.decode(dataset[0]["input_ids"].tolist())
    assert '<|im_start|>tool\n{"temp": 18, "sky": "clear"}<|im_end|>' in text
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}<|im_end|>' in text
    assert text.startswith(f"<|im_start|>system\n{JSON_PREAMBLE}{json.dumps([WEATHER])}<|im_end|>\n")

    strict = f"data.template={template(tmp_path, NO_TOOL_ROLE)}"
    dataset = build_sft_dataset(sft(tok, glaive, "data.tool_format=json", strict).data)
    assert_calls_trained_and_tools_prompted(hf, dataset)
    text = hf.decode(dataset[0]["input_ids"].tolist())
    assert '<|im_start|>user\nTool result:\n{"temp": 18, "sky": "clear"}<|im_end|>' in text


def test_tool_results_in_a_row_share_one_user_turn():
    conversation = Conversation(
        [
            {"role": "user", "content": "two"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "a", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "1"},
            {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "done"},
        ]
    )
    qwen = with_tool_format(conversation, "qwen").messages
    assert [m["role"] for m in qwen] == ["user", "assistant", "user", "assistant"]
    assert qwen[1]["content"] == '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    assert qwen[2]["content"] == "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    as_user = with_tool_format(conversation, "json", tool_role=False).messages
    assert as_user[2] == {"role": "user", "content": "Tool result:\n1\n\nTool result:\n2"}
    assert [m["role"] for m in with_tool_format(conversation, "json").messages][2:4] == ["tool", "tool"]


def test_an_answer_the_template_renders_empty_is_refused(tmp_path, tok, glaive):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps([{"instruction": "say hi", "output": "hi there"}] * 3))
    with pytest.raises(SftDataError) as e:
        build_sft_dataset(sft(tok, path, f"data.template={template(tmp_path, NO_CONTENT)}").data)
    message = str(e.value)
    assert message.startswith("data: 3 of 3 instruction records would train without their answers"), message
    assert f"{path} record 0: answer 1's tokens are '<|im_end|>\\n' only: its content is left out" in message
    assert message.splitlines()[-1].startswith("data.template: give FILE"), message


def test_a_call_rendered_without_its_arguments_is_refused_naming_the_argument(tmp_path, tok, glaive):
    with pytest.raises(SftDataError) as e:
        build_sft_dataset(sft(tok, glaive, f"data.template={template(tmp_path, NAME_ONLY)}").data)
    message = str(e.value)
    assert message.startswith("data: 4 of 5 instruction records would train without their tool calls:"), (
        message
    )
    assert (
        f'{glaive} record 0: answer 1: the call get_weather {{"city": "Paris"}} is not in its answer '
        "tokens, 'get_weather<|im_end|>\\n' (argument name 'city' missing)"
    ) in message
    assert f"{glaive} record 2:" not in message  # no call, and its tool is in the prompt


@pytest.mark.parametrize(("key", "value"), [("data.tool_format", "hermes"), ("eval.data.tool_format", "xml")])
def test_an_unknown_tool_format_is_refused_naming_the_field_and_the_choices(tok, glaive, key, value):
    extra = ["eval.data.source=sft", f"eval.data.path={glaive}"] if key.startswith("eval") else []
    with pytest.raises(ConfigError) as e:
        sft(tok, glaive, *extra, f"{key}={value}")
    assert f"{key}: got {value!r}; expected json" in str(e.value)
    assert "qwen" in str(e.value) and "null" in str(e.value)


def test_preview_data_shows_the_call_in_the_trained_text(tok, glaive):
    result = CliRunner().invoke(
        app,
        ["preview-data", "-c", str(TINY), "data.source=sft", f"data.path={glaive}", f"data.tokenizer={tok}"]
        + [
            "data.packing=false",
            "data.seq_len=4096",
            "model.hf_config.max_position_embeddings=4096",
            "data.tool_format=qwen",
            "--first",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        '<|im_start|>assistant\n[[<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n]]"
    ) in result.output
    assert "<tools>\n" in result.output


def test_a_call_counts_as_rendered_in_any_usual_json_or_python_spelling():
    from elastictrain.data.sft.tool_text import call_parts, missing_from_call

    name, arguments = call_parts(
        {"function": {"name": "f", "arguments": '{"q": "say \\"hi\\"", "n": 2, "ok": true}'}}
    )
    assert (name, arguments) == ("f", {"q": 'say "hi"', "n": 2, "ok": True})
    assert missing_from_call('f {"q": "say \\"hi\\"", "n": 2, "ok": true}', name, arguments) is None
    assert missing_from_call("f(q='say \"hi\"', n=2, ok=True)", name, arguments) is None
    assert missing_from_call('f {"q": "say hi", "n": 2, "ok": true}', name, arguments) == (
        "the value of argument 'q'"
    )
    assert missing_from_call('g {"q": "x"}', name, arguments) == "its name"
