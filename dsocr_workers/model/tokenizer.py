"""The tokenizer: the vendor's `tokenizer.json` read with the `tokenizers` library (exactly the
vendor's byte-level BPE and added tokens, no transformers class rebuilding the pipeline), or — for
random-weight presets, where nothing may be downloaded — a small byte-level BPE whose 830 special
tokens sit at the vendor ids, so prompts, image placeholders and stop ids are the real ones."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from dsocr_workers.errors import CheckpointError
from dsocr_workers.model.config import BOS_TOKEN_ID, EOS_TOKEN_ID, IMAGE_TOKEN_ID

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"

# ids 128000–128799 are "<｜place▁holder▁no▁N｜>" (N = id − 128000); the rest are named.
_NAMED_ADDED_TOKENS: dict[int, tuple[str, bool]] = {
    0: (BOS_TOKEN, True),
    1: (EOS_TOKEN, True),
    2: (PAD_TOKEN, True),
    128800: ("<｜fim▁hole｜>", False),
    128801: ("<｜fim▁begin｜>", False),
    128802: ("<｜fim▁end｜>", False),
    128803: ("<｜User｜>", False),
    128804: ("<｜Assistant｜>", False),
    128805: ("<|EOT|>", True),
    128806: ("<｜tool▁calls▁begin｜>", False),
    128807: ("<｜tool▁calls▁end｜>", False),
    128808: ("<｜tool▁call▁begin｜>", False),
    128809: ("<｜tool▁call▁end｜>", False),
    128810: ("<｜tool▁outputs▁begin｜>", False),
    128811: ("<｜tool▁outputs▁end｜>", False),
    128812: ("<｜tool▁output▁begin｜>", False),
    128813: ("<｜tool▁output▁end｜>", False),
    128814: ("<｜tool▁sep｜>", False),
    128815: ("<image>", True),
    128816: ("<|ref|>", True),
    128817: ("<|/ref|>", True),
    128818: ("<|det|>", True),
    128819: ("<|/det|>", True),
    128820: ("<|grounding|>", True),
    128821: ("<td>", True),
    128822: ("</td>", True),
    128823: ("<tr>", True),
    128824: ("</tr>", True),
    128825: ("<|User|>", True),
    128826: ("<|Assistant|>", True),
}


def vendor_added_tokens() -> dict[int, tuple[str, bool]]:
    """id → (content, special) for the 830 added tokens of the vendor tokenizer."""
    tokens = {128000 + n: (f"<｜place▁holder▁no▁{n}｜>", False) for n in range(800)}
    tokens.update(_NAMED_ADDED_TOKENS)
    return dict(sorted(tokens.items()))


class OCRTokenizer:
    """encode = `tokenizer.encode(text, add_special_tokens=False)` as the vendor's `infer()` calls it;
    decode keeps special tokens (the markup lives in them)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.bos_id = BOS_TOKEN_ID
        self.eos_id = EOS_TOKEN_ID

    @classmethod
    def from_dir(cls, directory: Path) -> OCRTokenizer:
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{directory}: no tokenizer.json (the vendor checkpoint ships one)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
            raise CheckpointError(f"{path}: cannot be read as a tokenizer: {exc}") from exc
        found = {i: tokenizer.id_to_token(i) for i in (BOS_TOKEN_ID, EOS_TOKEN_ID, IMAGE_TOKEN_ID)}
        expected = {BOS_TOKEN_ID: BOS_TOKEN, EOS_TOKEN_ID: EOS_TOKEN, IMAGE_TOKEN_ID: "<image>"}
        if found != expected:
            raise CheckpointError(f"{path}: special tokens are not at the DeepSeek-OCR ids: {found}")
        return cls(tokenizer)

    @classmethod
    def build_preset(cls) -> OCRTokenizer:
        """A byte-level BPE with no merges (every byte is a token) plus the vendor's added tokens at
        the vendor ids; ids in between are unreachable filler entries."""
        added = vendor_added_tokens()
        byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab: dict[str, int] = {content: token_id for token_id, (content, _) in added.items()}
        next_id = 3
        for char in byte_chars:
            vocab[char] = next_id
            next_id += 1
        for filler in range(next_id, 128000):
            vocab[f"<|dsocr_filler_{filler}|>"] = filler
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(
            [
                AddedToken(content, special=special, normalized=not special)
                for _, (content, special) in added.items()
            ]
        )
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def save(self, directory: Path) -> None:
        """tokenizer.json plus the vendor-style tokenizer_config.json / special_tokens_map.json."""
        directory = Path(directory)
        self._tokenizer.save(str(directory / "tokenizer.json"))
        added = {
            str(token_id): {
                "content": content, "lstrip": False, "normalized": not special, "rstrip": False,
                "single_word": False, "special": special,
            }
            for token_id, (content, special) in vendor_added_tokens().items()
        }
        config = {
            "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": added,
            "additional_special_tokens": ["<|User|>", "<|Assistant|>"], "bos_token": BOS_TOKEN,
            "clean_up_tokenization_spaces": False, "eos_token": EOS_TOKEN, "legacy": True,
            "model_max_length": 8192, "pad_token": PAD_TOKEN, "tokenizer_class": "LlamaTokenizerFast",
            "unk_token": None,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
                   "additional_special_tokens": ["<|User|>", "<|Assistant|>"]}
        (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))
