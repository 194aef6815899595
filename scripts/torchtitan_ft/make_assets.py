"""Write the two repo-relative assets torchtitan's debug configs expect, into the current folder.

torchtitan 0.3.0's wheel ships neither (they live in its source repository's tests/):
  tests/assets/tokenizer/   tokenizer.json + tokenizer_config.json (the Trainer's hf_assets_path
                            default "./tests/assets/tokenizer")
  tests/assets/c4_test/     the "c4_test" data set (HuggingFaceTextDataLoader's default), read by
                            datasets.load_dataset("tests/assets/c4_test", split="train")
Both are made here offline: 400 deterministic pseudo-English documents, and a byte-level BPE
tokenizer trained on them with 2,000 tokens (the llama3 debugmodel's vocabulary is 2,048).
"""

from __future__ import annotations

import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
WORDS = (
    "the a one two some every small large quick slow red blue green model replica group step "
    "loss gradient quorum manager lighthouse heal commit train data token layer weight optimizer "
    "runs waits joins leaves fails restarts sends receives averages computes stores loads "
    "before after while because and or but then again soon never always often"
).split()


def main() -> None:
    rng = random.Random(0)
    docs = []
    for _ in range(400):
        sents = []
        for _ in range(rng.randint(3, 8)):
            n = rng.randint(5, 14)
            s = " ".join(rng.choice(WORDS) for _ in range(n))
            sents.append(s[0].upper() + s[1:] + ".")
        docs.append(" ".join(sents))

    data_dir = os.path.join("tests", "assets", "c4_test")
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "c4_sample.json"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tdir = os.path.join("tests", "assets", "tokenizer")
    os.makedirs(tdir, exist_ok=True)
    tok.save(os.path.join(tdir, "tokenizer.json"))
    with open(os.path.join(tdir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False},
            f,
        )
    print(f"assets: {len(docs)} docs, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
