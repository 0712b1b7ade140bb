"""Export the tokenizer transformers actually runs, so the lean runtime encodes like it.

A model folder's tokenizer.json is not always what `AutoTokenizer` uses: for some model types
transformers picks a class that rebuilds parts of the backend in Python (Qwen2Tokenizer swaps
the pre-tokenizer for one that splits digits one by one and adds an NFC normalizer), and
special tokens named only in tokenizer_config.json are added to the backend. Copying the file
would then make the runtime, which only loads tokenizer.json with the `tokenizers`
library, encode prompts differently from transformers. So we load the tokenizer with
transformers, serialize its backend, and check on probe texts that the file encodes and
decodes exactly like transformers before an engine ships it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmc.contract.manifest import Tokenizer
from llmc.errors import ModelError, first_line

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"  # save_pretrained always writes it

# Each probe is encoded on its own: some behaviour (prefix spaces) only shows at text start.
_PROBES = (
    "12 345 6789 3.14159 2024-01-31 1e-6",
    "  two leading spaces,\tone tab\t\ttwo tabs\n\nnew lines\r\n   trailing   ",
    "héllo wörld 你好 🙂 Straße naïve café",
    "I'M SURE it's fine, isn't it ? Yes . No !",  # contractions; " ." shows decode clean-up
    " ",
    "",
    "a",
)


@dataclass(frozen=True)
class TokenizerExport:
    """What export_tokenizer wrote; file names are relative to its `dest`."""

    files: tuple[str, ...]
    tokenizer_class: str  # the transformers class that was loaded, e.g. "Qwen2Tokenizer"
    chat_template: str | None  # the default chat template's text
    chat_template_file: str | None
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None
    unk_token: str | None
    unk_token_id: int | None

    def manifest_entry(self, directory: str) -> Tokenizer:
        """The engine manifest's tokenizer entry, for an export written to the engine's `directory`."""
        return Tokenizer(file=f"{directory}/{TOKENIZER_FILE}", config=f"{directory}/{CONFIG_FILE}",
                         chat_template=f"{directory}/{self.chat_template_file}" if self.chat_template_file else None,
                         bos_token=self.bos_token, eos_token=self.eos_token, pad_token=self.pad_token,
                         unk_token=self.unk_token)


def export_tokenizer(folder: Path, dest: Path) -> TokenizerExport:
    """Write the tokenizer `AutoTokenizer.from_pretrained(folder)` loads into `dest`.

    dest gets tokenizer.json (the backend transformers runs), tokenizer_config.json and the
    chat template (chat_template.jinja), as transformers' save_pretrained writes them.
    Raises ModelError when there is no fast tokenizer or the export would encode differently.
    """
    folder, dest = Path(folder), Path(dest)
    tok = _load(folder)
    dest.mkdir(parents=True, exist_ok=True)
    # save_pretrained writes the config and chat template transformers needs to rebuild the
    # tokenizer; its tokenizer.json is then replaced by our cleaned copy of the backend.
    written = tok.save_pretrained(dest)
    _served_backend(tok).save(str(dest / TOKENIZER_FILE))
    _check_faithful(folder, tok, dest / TOKENIZER_FILE)

    files = sorted({Path(f).resolve().relative_to(dest.resolve()).as_posix() for f in written}
                   | {TOKENIZER_FILE})
    template = tok.chat_template
    if isinstance(template, dict):  # named templates: the server uses the default one
        template = template.get("default")
    return TokenizerExport(
        files=tuple(files),
        tokenizer_class=type(tok).__name__,
        chat_template=template,
        chat_template_file="chat_template.jinja" if "chat_template.jinja" in files else None,
        bos_token=tok.bos_token, bos_token_id=tok.bos_token_id,
        eos_token=tok.eos_token, eos_token_id=tok.eos_token_id,
        pad_token=tok.pad_token, pad_token_id=tok.pad_token_id,
        unk_token=tok.unk_token, unk_token_id=tok.unk_token_id,
    )


def _load(folder: Path):
    if not folder.is_dir():
        raise ModelError(f"cannot load a tokenizer: {folder} is not a folder; pass a model folder")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as exc:
        raise ModelError(f"cannot load a tokenizer from {folder} ({first_line(exc).rstrip(': ')}); "
                         "the model folder needs tokenizer.json and tokenizer_config.json") from None
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise ModelError(f"the tokenizer in {folder} ({type(tok).__name__}) has no fast "
                         "(tokenizers) backend; llmc needs one: add a tokenizer.json to the folder")
    return tok


def _served_backend(tok):
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    # transformers switches truncation/padding off for a plain tok(text) call, but they stay in
    # the backend it loaded from tokenizer.json; left there, the runtime would cut long prompts.
    backend.no_truncation()
    backend.no_padding()
    return backend


def _check_faithful(folder: Path, tok, path: Path) -> None:
    from tokenizers import Tokenizer

    served = Tokenizer.from_file(str(path))
    specials = list(dict.fromkeys([*tok.all_special_tokens, *tok.get_added_vocab()]))
    probes = [*_PROBES, "".join(f"x{t}y {t} " for t in specials)]
    for text in probes:
        want = tok(text).input_ids
        if served.encode(text).ids != want:
            raise ModelError(f"the tokenizer in {folder} cannot be served faithfully: its exported "
                             f"tokenizer.json encodes {text[:40]!r} differently from transformers "
                             f"({type(tok).__name__}), which does extra work in Python; llmc "
                             "cannot serve this tokenizer")
        # The runtime detokenizes with the same file; transformers may clean up spaces after.
        for skip in (False, True):
            if served.decode(want, skip_special_tokens=skip) != tok.decode(want, skip_special_tokens=skip):
                raise ModelError(f"the tokenizer in {folder} cannot be served faithfully: decoding "
                                 f"{text[:40]!r} differs from transformers (clean_up_tokenization_"
                                 "spaces?); set clean_up_tokenization_spaces to false in "
                                 "tokenizer_config.json if that is acceptable")
