"""An engine encodes prompts exactly as transformers' AutoTokenizer does for the same folder: the
exported tokenizer.json is the backend transformers runs, checked at build time."""

import json
import shutil

import pytest
from tokenizers import Tokenizer

from conftest import FAMILIES
from llmc.compiler import recipes
from llmc.compiler.tokenizer import export_tokenizer
from llmc.contract.manifest import Tokenizer as TokenizerEntry
from llmc.errors import ModelError, RequestError
from llmc.runtime.llm import LLM

PROJECT_TOKENIZER = recipes.RECIPES_DIR / "tokenizer"
TEXTS = [
    "12", "12 345 6789", "x=3.14159, y=-1e-6", "2024-01-31 12:30:45",
    "  two spaces", "tabs\t\tand\nnew\n\nlines\r\n", "trailing   ", "\n", " ", "",
    "héllo wörld 你好 🙂", "Straße naïve café こんにちは",
    "I'M SURE it's fine, isn't it ? Yes .",
]
SPECIAL_TEXTS = ["{0}hi{1}", "a {0} b {1} c {2}", "{2}{2} 12{1}"]


def _folder(tmp_path, config: dict, tokenizer_json: dict | None = None, **tok_config):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer_json is None:  # the project tokenizer, with all its files
        shutil.copy(PROJECT_TOKENIZER / "special_tokens_map.json", folder)
    tj = tokenizer_json or json.loads((PROJECT_TOKENIZER / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    tc = json.loads((PROJECT_TOKENIZER / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tc, **tok_config}))
    return folder


def _recipe_folder(tmp_path, name, **tok_config):
    return _folder(tmp_path, recipes.load_recipe(name)["config"], **tok_config)


def _texts(specials):
    return TEXTS + [t.format(*specials) for t in SPECIAL_TEXTS]


def _assert_matches_transformers(folder, dest, specials):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    served = Tokenizer.from_file(str(dest / "tokenizer.json"))
    for text in _texts(specials):
        assert served.encode(text).ids == hf(text).input_ids, text


@pytest.mark.parametrize("name", FAMILIES)
def test_project_tokenizer_exports_like_transformers(tmp_path, name):
    folder = _recipe_folder(tmp_path, name)
    export = export_tokenizer(folder, tmp_path / "out")
    _assert_matches_transformers(folder, tmp_path / "out", ["<s>", "</s>", "<pad>"])
    assert export.files == ("tokenizer.json", "tokenizer_config.json")
    # Qwen2Tokenizer's default unk_token is added as a new token, past the model's vocab.
    unk = ("<|endoftext|>", 1024) if name == "tiny-qwen2" else (None, None)
    assert (export.bos_token, export.bos_token_id, export.eos_token, export.eos_token_id,
            export.pad_token, export.pad_token_id, export.unk_token, export.unk_token_id) == (
        "<s>", 0, "</s>", 1, "<pad>", 2, *unk)
    assert export.chat_template is None and export.chat_template_file is None


def test_project_qwen2_folder_needs_the_export(tmp_path):
    # transformers maps model_type qwen2 to Qwen2Tokenizer whatever tokenizer_config says, so
    # even the project's own tiny-qwen2 splits digits and would be broken by a plain copy.
    folder = _recipe_folder(tmp_path, "tiny-qwen2")
    assert export_tokenizer(folder, tmp_path / "out").tokenizer_class == "Qwen2Tokenizer"
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    served = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert raw.encode("12 345").ids != served.encode("12 345").ids


def _qwen_tokenizer_json():
    """The project vocab with Qwen-style special tokens, a "12" merge and a plain ByteLevel
    pre-tokenizer (which keeps digit runs together, unlike Qwen2Tokenizer)."""
    tj = json.loads((PROJECT_TOKENIZER / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    renames = {"<s>": "<|endoftext|>", "</s>": "<|im_start|>", "<pad>": "<|im_end|>"}
    for added in tj["added_tokens"]:
        vocab[renames[added["content"]]] = vocab.pop(added["content"])
        added["content"] = renames[added["content"]]
    vocab["12"] = len(vocab)
    tj["model"]["merges"].append(["1", "2"])
    assert tj["pre_tokenizer"]["type"] == "ByteLevel"
    tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                            "use_regex": False}
    return tj


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_qwen2_tokenizer_class_overrides_tokenizer_json(tmp_path):
    folder = _folder(tmp_path, {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
                     _qwen_tokenizer_json(), tokenizer_class="Qwen2Tokenizer", add_bos_token=False,
                     bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                     chat_template=CHATML)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert raw.encode("12").ids == [1024]  # the file merges the digits...
    assert hf("12").input_ids == [19, 20]  # ...transformers splits them: copying would be wrong

    export = export_tokenizer(folder, tmp_path / "out")
    _assert_matches_transformers(folder, tmp_path / "out", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert export.tokenizer_class == "Qwen2Tokenizer"
    assert (export.bos_token, export.eos_token, export.eos_token_id, export.pad_token_id) == (
        None, "<|im_end|>", 2, 0)
    assert export.chat_template == CHATML and export.chat_template_file == "chat_template.jinja"
    assert export.manifest_entry("tok") == TokenizerEntry(
        file="tok/tokenizer.json", config="tok/tokenizer_config.json", chat_template="tok/chat_template.jinja",
        bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == CHATML


def test_chat_template_jinja_file_is_carried(tmp_path):
    folder = _recipe_folder(tmp_path, "tiny-llama")
    (folder / "chat_template.jinja").write_text(CHATML)
    export = export_tokenizer(folder, tmp_path / "out")
    assert export.chat_template == CHATML
    assert export.files == ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json")


def test_add_bos_token_in_config_is_ignored_like_transformers(tmp_path):
    # With a tokenizer.json, transformers drops add_bos_token: the file's post-processor decides.
    folder = _recipe_folder(tmp_path, "tiny-llama", add_bos_token=False)
    export_tokenizer(folder, tmp_path / "out")
    assert Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).encode("hi").ids[0] == 0
    _assert_matches_transformers(folder, tmp_path / "out", ["<s>", "</s>", "<pad>"])


def test_truncation_in_tokenizer_json_is_not_served(tmp_path):
    tj = json.loads((PROJECT_TOKENIZER / "tokenizer.json").read_text())
    tj["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    folder = _folder(tmp_path, recipes.load_recipe("tiny-llama")["config"], tj)
    export_tokenizer(folder, tmp_path / "out")
    assert len(Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).encode("a b c d e f").ids) > 4


def test_unfaithful_tokenizer_is_refused(tmp_path):
    # transformers splits special tokens in Python-side state tokenizer.json cannot hold.
    folder = _recipe_folder(tmp_path, "tiny-llama", split_special_tokens=True)
    with pytest.raises(ModelError, match="cannot be served faithfully") as info:
        export_tokenizer(folder, tmp_path / "out")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("make", ["empty", "missing"])
def test_folder_without_tokenizer_is_refused(tmp_path, make):
    folder = tmp_path / "model"
    if make == "empty":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="cannot load a tokenizer") as info:
        export_tokenizer(folder, tmp_path / "out")
    assert "\n" not in str(info.value)


# -- the engine's LLM.encode ----------------------------------------------------------------------


@pytest.mark.parametrize("recipe", FAMILIES)
def test_an_engine_encodes_like_transformers(recipe, engines):
    from transformers import AutoTokenizer

    llm = LLM(engines(recipe))
    hf = AutoTokenizer.from_pretrained(recipes.materialize(recipe))
    for text in _texts(["<s>", "</s>", "<pad>"]):
        assert llm.encode(text) == hf(text).input_ids, text


def test_a_token_the_model_lacks_is_a_request_error(engines):
    # Qwen2Tokenizer adds its unk token past tiny-qwen2's vocab: a prompt holding it cannot run.
    llm = LLM(engines("tiny-qwen2"))
    with pytest.raises(RequestError, match=r"'<\|endoftext\|>' \(id 1024\), outside the model's vocabulary"):
        llm.generate("hello <|endoftext|>")
    with pytest.raises(RequestError, match=r"token id 1024 is outside the vocabulary \(0..1023\)"):
        llm.generate([5, 1024])
    assert llm.blocks.num_free == llm.blocks.capacity


def test_a_qwen2_engine_whose_tokenizer_json_differs_encodes_like_transformers(tmp_path):
    """tokenizer.json keeps "12" whole; transformers' Qwen2Tokenizer splits digits: the engine
    must see the digits transformers sees, and generate from them."""
    from transformers import AutoTokenizer

    from llmc.compiler.build import build
    from llmc.contract.options import BuildOptions
    from llmc.runtime.sampling import SamplingParams

    folder = tmp_path / "qwen2"
    shutil.copytree(recipes.materialize("tiny-qwen2"), folder)
    (folder / "special_tokens_map.json").unlink()
    (folder / "tokenizer.json").write_text(json.dumps(_qwen_tokenizer_json()))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="Qwen2Tokenizer", add_bos_token=False, bos_token=None, eos_token="<|im_end|>",
                  pad_token="<|endoftext|>", unk_token=None, chat_template=CHATML)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = build(str(folder), tmp_path / "engine", BuildOptions(block_size=4, max_context=64)).engine_dir

    llm, hf = LLM(engine), AutoTokenizer.from_pretrained(folder)
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode("12").ids != llm.encode("12")
    for text in _texts(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert llm.encode(text) == hf(text).input_ids, text
    assert llm.engine.manifest.tokenizer.chat_template == "tokenizer/chat_template.jinja"
    assert (engine / llm.engine.manifest.tokenizer.chat_template).read_text() == CHATML
    out = llm.generate("x = 12345", SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.prompt_token_ids == hf("x = 12345").input_ids and len(out.token_ids) == 4


def _gemma_tokenizer_json() -> dict:
    """A tokenizer.json in Gemma's published format, trained here: SentencePiece-style BPE over
    text whose spaces the normalizer makes "▁", no pre-tokenizer, byte fallback (<0x00>..<0xFF>
    tokens for what the vocabulary lacks: here CJK and emoji), <bos> prepended, and a decoder
    that undoes the "▁" and fuses the bytes."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, processors, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials + [f"<0x{i:02X}>" for i in range(256)],
                                  limit_alphabet=60, show_progress=False)
    corpus = [t * 3 for t in TEXTS[:10]] + ["the quick brown fox jumps over the lazy dog " * 4,
                                           "Straße naïve café über alles: 3.14159 = pi"]
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return json.loads(tok.to_str())


def test_gemma_byte_fallback_bpe_exports_like_transformers(tmp_path):
    config = recipes.load_recipe("tiny-gemma3")["config"]
    folder = _folder(tmp_path, config, _gemma_tokenizer_json(), tokenizer_class="GemmaTokenizer",
                     bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                     add_bos_token=True, add_eos_token=False)
    export = export_tokenizer(folder, tmp_path / "out")
    _assert_matches_transformers(folder, tmp_path / "out", ["<bos>", "<start_of_turn>", "<end_of_turn>"])
    served = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    for text in _texts(["<bos>", "<start_of_turn>", "<end_of_turn>"]):
        ids = hf(text).input_ids
        assert served.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    fallback = served.encode("你好 🙂").tokens
    assert any(t.startswith("<0x") for t in fallback)  # byte fallback, not <unk>
    assert (export.bos_token, export.eos_token, export.unk_token) == ("<bos>", "<eos>", "<unk>")


# o200k's pre-tokenizer split (tiktoken's o200k_base, which gpt-oss's tokenizer.json writes as a
# Split before a regex-free ByteLevel): cased words with their contractions, digit runs of up to
# three, punctuation runs with trailing newlines, whitespace.
O200K_SPLIT = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>"]


def _o200k_tokenizer_json() -> dict:
    """A tokenizer.json in gpt-oss's published format, trained here: byte-level BPE behind o200k's
    regex split, harmony's special tokens, no BOS."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=HARMONY_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [t * 3 for t in TEXTS] + ["The Quick brown FOX can't jump 12345 times; it'll REST.\n\n" * 4]
    tok.train_from_iterator(corpus, trainer)
    return json.loads(tok.to_str())


def test_gpt_oss_o200k_style_tokenizer_exports_like_transformers(tmp_path):
    """Digits split in threes, case-split words and contractions, harmony's specials whole: the
    engine's tokenizer encodes and decodes as transformers does."""
    config = recipes.load_recipe("tiny-gpt-oss")["config"]
    folder = _folder(tmp_path, config, _o200k_tokenizer_json(), tokenizer_class="PreTrainedTokenizerFast",
                     bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>",
                     add_bos_token=False)
    export = export_tokenizer(folder, tmp_path / "out")
    _assert_matches_transformers(folder, tmp_path / "out", ["<|start|>", "<|message|>", "<|end|>"])
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    served = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert [served.decode([i]) for i in served.encode("12345").ids] == ["123", "45"]
    for text in _texts(["<|start|>", "<|channel|>", "<|return|>"]):
        ids = hf(text).input_ids
        assert served.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    assert (export.eos_token, export.pad_token) == ("<|return|>", "<|endoftext|>")


# Qwen3.5's pre-tokenizer split (transformers' Qwen3_5Tokenizer): Qwen2's, but a word keeps its
# combining marks (\p{M}) and punctuation runs stop at them.
QWEN35_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN35_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN35_ADDED = ["<think>", "</think>"]  # added, not special: they stay in decoded text
QWEN35_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                   "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
                   "{%- endif %}")
QWEN35_TEXTS = ["12345 6789 3.14", "  x   y\t\t\tz\n\n\n w   ", "你好世界，今天天气很好。", "🙂🚀👍🏽 ok", "नमस्ते दुनिया",
                "e\u0301 cafe\u0301 Ça", "I'M SURE they'll go", "<|im_start|>user\nhi<|im_end|>\n",
                "<think>\nhmm\n</think>\n\nyes", "a<|endoftext|>b", "Ⅻ ½ ²", "x\u200dy \u00a0 nbsp"]


def _qwen35_folder(tmp_path, split: str):
    """A published Qwen3.5 folder's tokenizer in its format, trained here: byte-level BPE behind
    `split`, NFC, ChatML's specials, <think> added, no BOS; config.json the multimodal wrapper's."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog 1234567890 times.", "你好，世界！今天天气很好。",
              "Ça va? naïve café Straße 🙂🚀 नमस्ते दुनिया", "def f(x):\n    return x ** 2  # squared\n\n",
              "I'm sure it's fine, isn't it?"] * 3
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=QWEN35_SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN35_ADDED])
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen3_5Tokenizer", "add_prefix_space": False, "bos_token": None, "unk_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
        "errors": "replace", "model_max_length": 262144, "split_special_tokens": False,
        "added_tokens_decoder": {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                 "single_word": False, "special": t in QWEN35_SPECIALS}
                                 for t in QWEN35_SPECIALS + QWEN35_ADDED},
        "chat_template": QWEN35_TEMPLATE}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                    "model_type": "qwen3_5",
                                                    "text_config": {"model_type": "qwen3_5_text"}}))
    return folder


@pytest.mark.parametrize("split", ["qwen3.5", "qwen2"])
def test_qwen35_tokenizer_exports_like_transformers(tmp_path, split):
    """Digits one by one, marks kept in their words, whitespace runs, ChatML and <think> whole: the
    engine's tokenizer encodes and decodes as transformers' Qwen3_5Tokenizer, also where the folder's
    tokenizer.json still splits as Qwen2 did (transformers rebuilds the split from its class)."""
    from transformers import AutoTokenizer

    folder = _qwen35_folder(tmp_path, QWEN35_SPLIT if split == "qwen3.5" else QWEN2_SPLIT)
    export = export_tokenizer(folder, tmp_path / "out")
    hf = AutoTokenizer.from_pretrained(folder)
    assert type(hf).__name__ == export.tokenizer_class == "Qwen3_5Tokenizer"
    served = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    for text in QWEN35_TEXTS:
        ids = hf(text).input_ids
        assert served.encode(text).ids == ids, text
        for skip in (False, True):
            assert served.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert [served.decode([i]) for i in served.encode("2024").ids] == ["2", "0", "2", "4"]
    assert len(served.encode("<think>").ids) == len(served.encode("<|im_end|>").ids) == 1
    as_stored = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # The Qwen2 split cuts Devanagari words at their vowel signs; transformers' class does not.
    assert (as_stored.encode("नमस्ते दुनिया").ids == served.encode("नमस्ते दुनिया").ids) == (split == "qwen3.5")
    assert (export.eos_token, export.pad_token, export.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert export.chat_template == QWEN35_TEMPLATE
