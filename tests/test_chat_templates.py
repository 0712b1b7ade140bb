"""Chat templates in each family's published shape render and tokenize as transformers'
apply_chat_template does: the special tokens as variables (Gemma's and Llama 3's BOS, OLMo 2's
EOS), raise_exception (Gemma 2 has no system role), namespace and enable_thinking (Qwen3),
{% generation %} and /no_think (SmolLM3), strftime_now, break, `tools is none` and a non-ASCII
tojson (Llama 3.1, Granite), harmony's channels and reasoning_effort (gpt-oss). The templates are written here in the hub's forms (the hub is out
of reach); the tokenizer is the project's, whose special tokens are <s>, </s> and <pad>."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmc.errors import RequestError
from llmc.runtime.chat import ChatTemplate
from llmc.runtime.llm import LLM

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
          "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
          "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

SMOLLM3 = """{%- set reasoning_mode = "/think" -%}
{%- if messages[0].role == "system" -%}
  {%- set system_message = messages[0].content -%}
  {%- if "/no_think" in system_message -%}{%- set reasoning_mode = "/no_think" -%}
  {%- elif "/think" in system_message -%}{%- set reasoning_mode = "/think" -%}{%- endif -%}
  {%- set custom_instructions = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}
{%- endif -%}
{%- if enable_thinking is defined and enable_thinking is false -%}{%- set reasoning_mode = "/no_think" -%}{%- endif -%}
{{- "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nToday Date: " + strftime_now("%d %B %Y") -}}
{{- "\nReasoning Mode: " + reasoning_mode + "\n\n" -}}
{%- if custom_instructions is defined -%}{{- "## Custom Instructions\n\n" + custom_instructions + "\n\n" -}}{%- endif -%}
{{- "<|im_end|>\n" -}}
{%- for message in messages -%}
  {%- if message.role == "user" -%}
    {{ "<|im_start|>user\n" + message.content + "<|im_end|>\n" }}
  {%- elif message.role == "assistant" -%}
    {% generation %}{{ "<|im_start|>assistant\n" + message.content.lstrip("\n") + "<|im_end|>\n" }}{% endgeneration %}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {%- if reasoning_mode == "/think" -%}{{ "<|im_start|>assistant\n" }}
  {%- else -%}{{ "<|im_start|>assistant\n<think>\n\n</think>\n" }}{%- endif -%}
{%- endif -%}
"""

LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\nToday Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'ipython' %}{%- break %}{%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

OLMO2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
         "{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}"
         "{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}"
         "{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}{% else %}"
         "{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
         "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}")

GRANITE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\nToday's Date: " + strftime_now('%B %d, %Y') + ".\nYou are Granite, developed by IBM." %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}
{%- if tools %}{{- '<|start_of_role|>tools<|end_of_role|>' + tools | tojson(indent=4) + '<|end_of_text|>\n' }}{%- endif %}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}
    {%- if message.get('metadata') %}{{- message['metadata'] | tojson }}{%- endif %}
    {%- if loop.last and add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}
{%- endfor %}
"""

# gpt-oss's harmony format: a system turn the template writes itself (identity, knowledge cutoff,
# today's date, reasoning effort, the channels), the caller's system prompt as a developer turn,
# an assistant's past reasoning dropped but for the last turn's (channel analysis), answers on
# channel final, and the prompt ending where the model names its channel.
GPT_OSS = """{%- if reasoning_effort is not defined %}
    {%- set reasoning_effort = "medium" %}
{%- endif %}
{%- if model_identity is not defined %}
    {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
{%- endif %}
{{- "<|start|>system<|message|>" + model_identity + "\n" }}
{{- "Knowledge cutoff: 2024-06\n" }}
{{- "Current date: " + strftime_now("%Y-%m-%d") + "\n\n" }}
{{- "Reasoning: " + reasoning_effort + "\n\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>" }}
{%- if messages[0].role in ("system", "developer") %}
    {{- "<|start|>developer<|message|># Instructions\n\n" + messages[0].content + "\n\n<|end|>" }}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set last_user = namespace(at=-1) %}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}{%- set last_user.at = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- elif message.role == "assistant" %}
        {%- if message.thinking is defined and loop.index0 > last_user.at %}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
        {%- endif %}
        {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
    {%- else %}
        {{- raise_exception("Only user and assistant turns may follow the first message, not " + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start|>assistant" }}
{%- endif %}"""

SYSTEM = {"role": "system", "content": "Answer briefly. /no_think"}
CHAT = [{"role": "user", "content": "  What is paging?  "},
        {"role": "assistant", "content": "<think>\nblocks\n</think>\n\nFixed-size blocks."},
        {"role": "user", "content": "And a prefix cache — über fast?"}]
CASES = {  # template, conversations, chat_template_kwargs
    "gemma3": (GEMMA3, [CHAT, [SYSTEM, *CHAT]], {}),
    "gemma2": (GEMMA2, [CHAT], {}),
    "qwen3": (QWEN3, [CHAT, [SYSTEM, *CHAT]], {"enable_thinking": False}),
    "qwen3-thinking": (QWEN3, [[SYSTEM, *CHAT]], {}),
    "smollm3": (SMOLLM3, [CHAT, [SYSTEM, *CHAT]], {}),
    "smollm3-no-thinking": (SMOLLM3, [CHAT], {"enable_thinking": False}),
    "llama3.1": (LLAMA31, [CHAT, [SYSTEM, *CHAT, {"role": "ipython", "content": "x"}]], {}),
    "olmo2": (OLMO2, [[SYSTEM, *CHAT]], {}),
    "gpt-oss": (GPT_OSS, [CHAT, [SYSTEM, *CHAT, {"role": "assistant", "thinking": "Pages.", "content": "Yes."}]],
                {"reasoning_effort": "low"}),
    "granite": (GRANITE, [CHAT, [SYSTEM, *CHAT[:2], {**CHAT[2], "metadata": {"sprache": "Deutsch, überall"}}]], {}),
}


@pytest.fixture(scope="module")
def llm(llama_engine):
    return LLM(llama_engine)


@pytest.fixture(scope="module")
def hf_tokenizer(llama_engine):
    from transformers import AutoTokenizer

    from llmc.compiler.recipes import materialize

    return AutoTokenizer.from_pretrained(materialize("tiny-llama"))


@pytest.mark.parametrize("case", CASES)
def test_a_family_template_renders_and_tokenizes_like_transformers(case, llm, hf_tokenizer):
    template, conversations, variables = CASES[case]
    ours = ChatTemplate(template, Path(f"{case}.jinja"))
    for messages in conversations:
        prompt = ours.prompt(llm, messages, variables)
        text = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                add_generation_prompt=True, **variables)
        ids = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=False,
                                               add_generation_prompt=True, **variables)
        assert prompt.text == text
        assert prompt.ids == list(ids)
        if "bos_token" in template:
            assert text.startswith("<s>") and prompt.ids[0] == hf_tokenizer.bos_token_id


def test_a_template_that_refuses_the_messages_is_a_request_error(llm):
    with pytest.raises(RequestError, match="cannot render these messages \\(System role not supported\\)"):
        ChatTemplate(GEMMA2, Path("gemma2.jinja")).prompt(llm, [SYSTEM, *CHAT])
    with pytest.raises(RequestError, match="roles must alternate"):
        ChatTemplate(GEMMA3, Path("gemma3.jinja")).prompt(llm, CHAT[:1] * 2)
    with pytest.raises(RequestError, match="chat_template_kwargs cannot set bos_token, tools"):
        ChatTemplate(GEMMA3, Path("gemma3.jinja")).prompt(llm, CHAT, {"tools": [], "bos_token": "x"})
