"""Train the project tokenizer: a 1024-token byte-level BPE shared by all built-in recipes.

Run from the repo root:  python models/make_tokenizer.py
It writes models/tokenizer/{tokenizer.json, tokenizer_config.json, special_tokens_map.json};
the output is committed, so this only needs re-running to change the tokenizer (which changes
the recipe cache key and therefore every materialized model).

The corpus is built locally and deterministically: prose written below plus the docstrings of
a fixed list of stdlib modules. Nothing is downloaded. Docstrings differ a little between
Python versions, so a re-run on another version may give different merges; that is fine
because the committed files, not this script, are what recipes use.
"""

import importlib
import inspect
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 1024
# Order fixes the ids: <s>=0, </s>=1, <pad>=2.
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]
# Large enough for smollm2-135m-shape; materialize() rewrites it per recipe anyway.
MODEL_MAX_LENGTH = 8192

OUT_DIR = Path(__file__).resolve().parent / "tokenizer"

PROSE = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and
predicts the next one. When it is asked a question, it answers one token at a time, and each
new token is appended to the prompt before the next step begins.

Once upon a time there was a small village at the edge of a great forest. The people of the
village were farmers and weavers, and every morning they walked to the fields while the sun
rose over the hills. In the evening they told stories by the fire: stories of kings and
queens, of rivers that ran backwards, of a clock that could stop time for exactly one minute.

Hello, world! How are you today? I am fine, thank you. What is your name? My name is Ada.
Where do you live? I live in a city by the sea. What time is it? It is half past three.
Please write a short poem about the ocean. Summarize the following paragraph in one sentence.
Translate this sentence into French. Explain how a compiler turns source code into a program.

A compiler reads a program, checks that it is well formed, and translates it into another
form that a machine can run. Modern compilers build an intermediate representation, apply
optimization passes such as constant folding, dead code elimination and operator fusion, and
finally emit code for the target. An inference engine for neural networks works the same
way: the model graph is exported, simplified, fused and then executed by a runtime that
schedules requests, batches them together and manages the memory of the attention cache.

The weather today is sunny with a light breeze from the west. Tomorrow there will be clouds
in the morning and rain in the afternoon. Temperatures will range from twelve to eighteen
degrees. Remember to bring an umbrella if you go out after lunch.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 4096 3.14159 2.71828 1e-6 -1.
Dates and times: 2024-01-31, 12:30:45, Monday, Tuesday, Wednesday, Thursday, Friday.
Punctuation and symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? . , ; : ' " ` @ # $ _ \\

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

if __name__ == "__main__":
    print(fibonacci(10))

Accents and other scripts appear now and then: naïve café, résumé, Straße, España, 東京,
北京, こんにちは, Привет, γειά σου, مرحبا, 안녕하세요, emoji 🙂 and 🚀.
"""

# A fixed list (not whatever happens to be importable) keeps the corpus reproducible.
STDLIB_MODULES = [
    "abc", "argparse", "array", "base64", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "inspect", "io",
    "ipaddress", "itertools", "json", "logging", "math", "operator", "os", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "shlex", "shutil", "socket", "statistics",
    "string", "struct", "subprocess", "tempfile", "textwrap", "threading", "time", "timeit",
    "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile", "zlib",
]


def stdlib_docstrings():
    """Module docstrings plus those of their public members, in a deterministic order."""
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        doc = inspect.getdoc(module)
        if doc:
            yield doc
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            doc = inspect.getdoc(getattr(module, attr))
            # getdoc falls back to the type's docstring for plain values (int, str, ...),
            # which would repeat the same text hundreds of times.
            if doc and callable(getattr(module, attr)):
                yield doc


def corpus():
    # Prose is repeated so it weighs about as much as the (code-flavoured) docstrings.
    yield from [PROSE] * 20
    yield from stdlib_docstrings()


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(s)) == s exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Models are trained with BOS first, so every encode adds it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def main():
    tok = train()
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    OUT_DIR.mkdir(exist_ok=True)
    tok.save(str(OUT_DIR / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": MODEL_MAX_LENGTH,
        # BOS comes from the tokenizer.json post-processor; no EOS on encode.
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
    }
    (OUT_DIR / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (OUT_DIR / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    print(f"wrote {OUT_DIR} (vocab {tok.get_vocab_size()}, special ids {ids})")


if __name__ == "__main__":
    main()
