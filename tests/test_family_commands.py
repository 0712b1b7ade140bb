"""Every family through the commands users run on it: `llmc run` streams transformers' greedy
completion, `llmc eval --reference` finds no distance between the engine and transformers on the
same weights, and `llmc serve`'s chat endpoint, with the family's published template, answers
through the `openai` client as transformers answers the same conversation. (`llmc build` made each
engine: the `engines` fixture builds through the same `build()`.)"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import FAMILIES
from test_chat_templates import GEMMA2, GEMMA3, GPT_OSS, GRANITE, LLAMA31, OLMO2, QWEN3, SMOLLM3
from test_server import _Server

from llmc.cli import main

openai = pytest.importorskip("openai")

# The families whose published template is ChatML (Qwen2's, and the form the rest ship or
# fine-tunes use) take this one; the others take their own, in the hub's shape.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEMPLATES = {"tiny-llama": LLAMA31, "tiny-qwen3": QWEN3, "tiny-smollm3": SMOLLM3, "tiny-olmo2": OLMO2,
             "tiny-granite": GRANITE, "tiny-gemma2": GEMMA2, "tiny-gemma3": GEMMA3, "tiny-gpt-oss": GPT_OSS}
MESSAGES = [{"role": "user", "content": "What is a paged KV cache?"}]
TEXT = "".join(f"def area_{i}(r):\n    return 3.14159 * r * r  # über {i}\n\n" for i in range(12))
NEW_TOKENS = 12


def _greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("recipe", FAMILIES)
def test_run_eval_and_serve_answer_as_transformers(recipe, engines, hf_models, tmp_path):
    from transformers import AutoTokenizer

    engine = engines(recipe)
    model, folder = hf_models(recipe)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    prompt = "def fib(n):"
    want = tokenizer.decode(_greedy(model, tokenizer(prompt)["input_ids"]), skip_special_tokens=True)
    assert _invoke("run", str(engine), prompt, "--max-tokens", str(NEW_TOKENS)) == prompt + want + "\n"

    (tmp_path / "text.txt").write_text(TEXT)
    scores = json.loads(_invoke("eval", str(engine), str(tmp_path / "text.txt"), "--reference", str(folder),
                                "--context", "64", "--json"))
    assert scores["scored_tokens"] > 64  # more than one window
    assert scores["reference"]["kl_mean"] < 1e-6 and scores["reference"]["top1_agreement"] == 1.0

    template = TEMPLATES.get(recipe, CHATML)
    (tmp_path / "chat.jinja").write_text(template)
    ids = tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=True, return_dict=False,
                                        add_generation_prompt=True)
    answer = tokenizer.decode(_greedy(model, list(ids)), skip_special_tokens=True)
    server = _Server(engine, "--chat-template", tmp_path / "chat.jinja")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="code", messages=MESSAGES, max_tokens=NEW_TOKENS,
                                               temperature=0)
    finally:
        server.close()
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == answer
