#!/usr/bin/env python3
"""Write GPT-OSS's o200k_harmony tokenizer as Hugging Face tokenizer files.

The anchor converts the synthetic checkpoint with llama.cpp's convert_hf_to_gguf.py, which reads the
vocabulary through transformers' AutoTokenizer; `picchio synth` writes no tokenizer. GPT-OSS's
tokenizer is o200k_base (199998 byte-level BPE ranks) plus the Harmony special tokens
199998..201087, so it is rebuilt here from the o200k_base ranks file that the tiktoken-rs crate
ships (the one Picchio embeds), with transformers' own tiktoken converter and the o200k
pre-tokenizer regex. llama.cpp recognises the result by its pre-tokenizer hash as "gpt-4o", the
same as the released gpt-oss tokenizer.

Usage: make_tokenizer.py RANKS_FILE OUT_DIR
"""

import sys
from pathlib import Path

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

# o200k_base's pre-tokenizer (tiktoken's openai_public.py, tiktoken-rs's O200K_BASE_PAT_STR).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

BASE_VOCAB = 199_998  # o200k_base ranks 0..199997
VOCAB_SIZE = 201_088  # GPT-OSS's vocabulary (config.json vocab_size)

# The named Harmony special tokens (src/chat/tokenizer.rs); every other ID from BASE_VOCAB on is
# <|reserved_ID|>.
NAMED = {
    199_998: "<|startoftext|>",
    199_999: "<|endoftext|>",
    200_002: "<|return|>",
    200_003: "<|constrain|>",
    200_005: "<|channel|>",
    200_006: "<|start|>",
    200_007: "<|end|>",
    200_008: "<|message|>",
    200_012: "<|call|>",
}


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} RANKS_FILE OUT_DIR")
    ranks, out = Path(sys.argv[1]), Path(sys.argv[2])
    with ranks.open() as f:
        n = sum(1 for line in f if line.strip())
    if n != BASE_VOCAB:
        sys.exit(f"{ranks}: {n} ranks, expected o200k_base's {BASE_VOCAB}")
    specials = [NAMED.get(i, f"<|reserved_{i}|>") for i in range(BASE_VOCAB, VOCAB_SIZE)]
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=O200K_PATTERN, additional_special_tokens=specials).converted()
    # Special tokens are added in ID order after the base vocabulary: check they got the right IDs.
    for i, name in enumerate(specials):
        got = tok.token_to_id(name)
        if got != BASE_VOCAB + i:
            sys.exit(f"special token {name} got ID {got}, expected {BASE_VOCAB + i}")
    if tok.get_vocab_size() != VOCAB_SIZE:
        sys.exit(f"vocabulary has {tok.get_vocab_size()} IDs, expected {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        model_max_length=131_072,
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # A known o200k encoding, so a broken conversion fails here rather than in llama.cpp.
    ids = fast.encode("Hello world")
    if ids != [13225, 2375]:
        sys.exit(f"'Hello world' encodes to {ids}, o200k_base gives [13225, 2375]")
    print(f"wrote {out}/tokenizer.json ({tok.get_vocab_size()} IDs)")


if __name__ == "__main__":
    main()
