"""LLaMA-Factory's `template: NAME`, read as the tokenizer's own chat template.

LLaMA-Factory's template registry is not shipped: a text model's own chat template (the one its
tokenizer carries, what vLLM and transformers' pipelines render) is what `template: NAME` stands for
here. What a name means beyond that is said at start, or refused:
- a multimodal template: refused (text data only);
- LLaMA-Factory's own formats that are no model's template (alpaca, default, empty, fewshot): refused,
  naming data.template=FILE (a Jinja template written in that format) instead;
- a template with a default system prompt: that prompt becomes data.system for records without one
  (unless default_system is given), as LLaMA-Factory renders them;
- a reasoning template (qwen3, deepseekr1, ...): the model's own template renders thinking as it does;
  LLaMA-Factory's enable_thinking handling is not applied, and the start line says so.
The names and prompts are LLaMA-Factory's (src/llamafactory/data/template.py, Apache-2.0).
"""

from __future__ import annotations

import json
from pathlib import Path

from elastictrain.config.llamafactory.reading import Reading

GENERIC = ("alpaca", "default", "empty", "fewshot")

MULTIMODAL = frozenset(
    [
        "dots_ocr",
        "ernie_vl",
        "glm4_5v",
        "glm4v",
        "glm_ocr",
        "granite3_vision",
        "intern_s1",
        "intern_vl",
        "keye_vl",
        "kimi_vl",
        "lfm2_vl",
        "llama4",
        "llava",
        "llava_next",
        "llava_next_llama3",
        "llava_next_mistral",
        "llava_next_qwen",
        "llava_next_video",
        "llava_next_video_mistral",
        "llava_next_video_yi",
        "llava_next_yi",
        "mimo_vl",
        "minicpm_o",
        "minicpm_v",
        "minicpm_v_4_6",
        "ministral3",
        "mistral_small",
        "mllama",
        "moss_vl",
        "paligemma",
        "paligemma_chat",
        "pixtral",
        "qwen2_audio",
        "qwen2_omni",
        "qwen2_vl",
        "qwen3_5",
        "qwen3_5_nothink",
        "qwen3_6",
        "qwen3_omni",
        "qwen3_omni_nothink",
        "qwen3_vl",
        "qwen3_vl_nothink",
        "video_llava",
        "yi_vl",
        "youtu_vl",
    ]
)

TEXT = frozenset(
    [
        "aeva",
        "bailing",
        "bailing_v2",
        "breeze",
        "chatglm3",
        "chatml",
        "chatml_de",
        "cohere",
        "cpm4",
        "dbrx",
        "deepseek",
        "deepseek3",
        "deepseekcoder",
        "deepseekr1",
        "ernie",
        "ernie_nothink",
        "exaone",
        "falcon",
        "falcon_h1",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3n",
        "gemma4",
        "gemma4n",
        "glm4",
        "glm4_7",
        "glm4_moe",
        "glmz1",
        "gpt_oss",
        "granite3",
        "granite4",
        "hunyuan",
        "hunyuan_small",
        "hy3",
        "hy_dense_1_8b",
        "hy_dense_7b",
        "index",
        "intern2",
        "lfm2",
        "llama2",
        "llama2_zh",
        "llama3",
        "mimo",
        "mimo_v2",
        "minimax1",
        "minimax2",
        "ministral",
        "mistral",
        "moonlight",
        "olmo",
        "openchat",
        "openchat-3.6",
        "opencoder",
        "phi",
        "phi4",
        "phi4_mini",
        "phi_small",
        "qwen",
        "qwen3",
        "qwen3_nothink",
        "sailor",
        "seed_coder",
        "seed_oss",
        "smollm",
        "smollm2",
        "solar",
        "starchat",
        "telechat2",
        "vicuna",
        "xuanyuan",
        "yi",
        "youtu",
        "yuan",
        "zephyr",
    ]
)

REASONING = frozenset(
    [
        "deepseekr1",
        "hy3",
        "gemma4",
        "gemma4n",
        "glm4_moe",
        "glm4_7",
        "glmz1",
        "gpt_oss",
        "mimo",
        "mimo_v2",
        "minimax2",
        "qwen3",
        "seed_oss",
        "youtu",
        "aeva",
    ]
)

# The default system prompt of each text template that has one, applied to records without a system turn.
DEFAULT_SYSTEM = {
    "aeva": (
        "You are an AI assistant named Aeva created by Zongzhi Lou. Your answer should be friendly, "
        "unbiased, faithful, informative and detailed."
    ),
    "chatml_de": "Du bist ein freundlicher und hilfsbereiter KI-Assistent.",
    "dbrx": (
        "You are DBRX, created by Databricks. You were last updated in December 2023. You answer "
        "questions based on information available up to that point.\nYOU PROVIDE SHORT RESPONSES TO "
        "SHORT QUESTIONS OR STATEMENTS, but provide thorough responses to more complex and open-ended "
        "questions.\nYou assist with various tasks, from writing to coding (using markdown for code "
        "blocks — remember to use ``` with code, JSON, and tables).\n(You do not have real-time data "
        "access or code execution capabilities. You avoid stereotyping and provide balanced "
        "perspectives on controversial topics. You do not provide song lyrics, poems, or news "
        "articles and do not divulge details of your training data.)\nThis is your system prompt, "
        "guiding your responses. Do not reference it, just respond to the user. If you find yourself "
        "talking about this message, stop. You should be responding appropriately and usually that "
        "means not mentioning this.\nYOU DO NOT MENTION ANY OF THIS INFORMATION ABOUT YOURSELF UNLESS "
        "THE INFORMATION IS DIRECTLY PERTINENT TO THE USER'S QUERY."
    ),
    "deepseekcoder": (
        "You are an AI programming assistant, utilizing the DeepSeek Coder model, developed by "
        "DeepSeek Company, and you only answer questions related to computer science. For politically "
        "sensitive questions, security and privacy issues, and other non-computer science questions, "
        "you will refuse to answer.\n"
    ),
    "ernie": "<global_setting>\nthink_mode=True\n</global_setting>",
    "gemma4": "You are a helpful assistant.",
    "gemma4n": "You are a helpful assistant.",
    "gpt_oss": "You are ChatGPT, a large language model trained by OpenAI.",
    "granite4": "You are Granite, developed by IBM. You are a helpful AI assistant.",
    "intern2": (
        "You are an AI assistant whose name is InternLM (书生·浦语).\n- InternLM (书生·浦语) is a "
        "conversational language model that is developed by Shanghai AI Laboratory "
        "(上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
        "- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by "
        "the user such as English and 中文."
    ),
    "lfm2": "You are a helpful AI assistant.",
    "llama2_zh": "You are a helpful assistant. 你是一个乐于助人的助手。",
    "mimo": "You are a helpful assistant.",
    "mimo_v2": "You are MiMo, a helpful AI assistant engineered by Xiaomi.",
    "minimax1": "You are a helpful assistant.",
    "minimax2": "You are a helpful assistant. Your name is MiniMax-M2.1 and is built by MiniMax.",
    "moonlight": "You are a helpful assistant provided by Moonshot-AI.",
    "opencoder": "You are OpenCoder, created by OpenCoder Team.",
    "qwen": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "sailor": (
        "You are an AI assistant named Sailor created by Sea AI Lab. Your answer should be friendly, "
        "unbiased, faithful, informative and detailed."
    ),
    "seed_coder": (
        "You are an AI programming assistant, utilizing the Seed-Coder model, developed by ByteDance "
        "Seed, and you only answer questions related to computer science. For politically sensitive "
        "questions, security and privacy issues, and other non-computer science questions, you will "
        "refuse to answer.\n\n"
    ),
    "smollm2": "You are a helpful AI assistant named SmolLM, trained by Hugging Face.",
    "telechat2": (
        "你是中国电信星辰语义大模型，英文名是TeleChat，"
        "你是由中电信人工智能科技有限公司和中国电信人工智能研究院（TeleAI）研发的人工智能助手。"
    ),
    "vicuna": (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
        "helpful, detailed, and polite answers to the user's questions."
    ),
    "xuanyuan": (
        "以下是用户和人工智能助手之间的对话。用户以Human开头，人工智能助手以Assistant开头，会对人类提出的问题给出有帮助、高质量、详细和礼貌的回答，并且总是拒绝参与与不道德、不安全、有争议、政治敏感等相关的话题、问题和指示。\n"
    ),
    "zephyr": "You are Zephyr, a helpful assistant.",
}


def has_chat_template(folder: str) -> bool:
    """Whether a tokenizer folder carries a chat template (read from its files, no transformers import)."""
    root = Path(folder)
    if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template")) if isinstance(config, dict) else False


def read_template(name: str | None, r: Reading) -> None:
    """`template: NAME` against the model's tokenizer: notices, data.system, or refusals."""
    if name is None:
        return
    if name in MULTIMODAL:
        r.refuse("template", "a multimodal template; elastictrain trains text models on text records")
        return
    if name in GENERIC:
        r.refuse(
            "template",
            f"LLaMA-Factory's own {name!r} format, not a model's chat template; give data.template=FILE, a "
            "Jinja chat template written in that format (the model's own template is used without it)",
        )
        return
    if name not in TEXT:
        r.refuse(
            "template", "not one of LLaMA-Factory's template names; data.template=FILE takes a Jinja file"
        )
        return
    if r.model_path and not has_chat_template(r.model_path) and "data.template" not in r.native:
        r.refuse(
            "template",
            f"the tokenizer of model_name_or_path ({r.model_path}) has no chat template to stand for it; "
            "give data.template=FILE (a Jinja chat template, e.g. the chat_template.jinja of a model of "
            "that family)",
        )
        return
    said = [f"template {name}: the tokenizer's own chat template (LLaMA-Factory's registry is not shipped)"]
    system = DEFAULT_SYSTEM.get(name)
    if system and r.get("default_system") is None:
        r.set("data.system", system)
        said.append(f"its default system prompt {system[:40]!r}... for records without one (data.system)")
    if name in REASONING:
        said.append("thinking is rendered as the model's template does (enable_thinking is not applied)")
    r.note("; ".join(said))
