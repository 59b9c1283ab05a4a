"""Build a tiny random Llama model + byte-level BPE tokenizer for real-vLLM e2e tests.

Nothing is downloaded: the tokenizer is trained on locally generated text and the
model weights are random. Output is gibberish, but vLLM serves it as a real engine
(real scheduler, real abort path, real metrics).

Usage::

    from tests.harness.e2e.tiny_model import build_tiny_model
    model_dir = build_tiny_model(Path("/tmp/tiny-llama"))

or ``HF_HUB_OFFLINE=1 python -m tests.harness.e2e.tiny_model /tmp/tiny-llama``.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set c = message['content'] %}"
    "{% else %}{% set c = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ c }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

# The default tiny model generates ~1000 tokens/s on 2 cores, so a max-length (1024)
# generation lasts ~1 s, and at that rate the vLLM API server is often starved (HTTP calls,
# including the abort, stall for seconds). For abort/disconnect tests use this bigger preset
# (~100 tokens/s, 8k context) and serve it with ``max_model_len=8192``:
#     build_tiny_model(Path("/tmp/slow-llama-8k"), **SLOW_MODEL_KWARGS)
SLOW_MODEL_KWARGS = dict(
    max_position_embeddings=8192, hidden_size=1024, num_hidden_layers=4, intermediate_size=2816
)
# The preset the e2e tests and the demo use: between the two above, ~250 tokens/s on 2 cores
# (measured by tests/e2e/test_vllm_e2e.py), so a 4000-token generation lasts ~15 s and a
# disconnect can be watched, while the engine still leaves CPU to its API server.
E2E_MODEL_KWARGS = dict(
    max_position_embeddings=8192, hidden_size=512, num_hidden_layers=4, intermediate_size=1408
)
_MARKER = "tiny_model_complete"

_WORDS = (
    "the a an engine request client server proxy abort cancel stream token model "
    "tiny llama sidecar vllm chat completion prompt reply user assistant system hello "
    "world quick brown fox jumps over lazy dog data time run stop start wait fast slow "
    "one two three four five six seven eight nine ten and or but if then else while "
    "for with from into onto about above below under over between"
).split()


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Generate deterministic pseudo-text (words, numbers, punctuation, all printable ASCII)."""
    rng = random.Random(seed)
    lines = []
    ascii_printable = "".join(chr(c) for c in range(32, 127))
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 10000)))
        if rng.random() < 0.1:
            words.append("".join(rng.choice(ascii_printable) for _ in range(8)))
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ",", ""]))
    return lines


def build_tiny_model(
    dir: Path,
    vocab_size: int = 2048,
    seed: int = 0,
    max_position_embeddings: int = 1024,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    intermediate_size: int = 256,
) -> Path:
    """Build (once) a tiny random Llama + tokenizer in ``dir`` and return ``dir``.

    Idempotent: if ``dir`` already holds a completed build (marker file), nothing is done.
    Model (defaults): hidden 128, 2 heads (head_dim 64), 2 KV heads, 2 layers, intermediate 256,
    max_position_embeddings (default 1024; serve with ``--max-model-len`` <= it), float32.
    Tokenizer: byte-level BPE, bos ``<s>``, eos ``</s>``, pad ``<pad>``, unk ``<unk>``, with a
    simple ``chat_template``.
    """
    dir = Path(dir)
    if (dir / _MARKER).exists() and (dir / "config.json").exists():
        return dir
    dir.mkdir(parents=True, exist_ok=True)

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_position_embeddings,
    )
    hf_tok.chat_template = CHAT_TEMPLATE

    num_heads = max(1, hidden_size // 64)  # head_dim 64 (16 is rejected by the CPU kernel)
    config = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=64,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",  # transformers 5: torch_dtype is only a deprecated alias of it
    )
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = hf_tok.bos_token_id
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.generation_config.pad_token_id = hf_tok.pad_token_id
    model.save_pretrained(dir, safe_serialization=True)
    hf_tok.save_pretrained(dir)
    (dir / _MARKER).write_text("ok\n")
    return dir


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m tests.harness.e2e.tiny_model TARGET_DIR [MAX_POSITION_EMBEDDINGS]``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print("usage: python -m tests.harness.e2e.tiny_model TARGET_DIR [MAX_POSITION_EMBEDDINGS]",
              file=sys.stderr)
        return 2
    mpe = int(argv[1]) if len(argv) == 2 else 1024
    print(build_tiny_model(Path(argv[0]), max_position_embeddings=mpe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
