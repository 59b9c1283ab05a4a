"""Write a tiny random Llama model as GGUF for llama.cpp (``tests/test_llamacpp.py``).

Nothing is downloaded: the ``gguf`` package (PyPI; the ``llamacpp`` extra) writes a Llama
architecture with random F32 weights and a SentencePiece-style vocabulary of the 256 byte
tokens plus a few words, so any text tokenizes. Output is gibberish; llama.cpp serves it as a
real engine. Run with the interpreter that has ``gguf`` and ``numpy``::

    python -m tests.harness.llamacpp_model OUT.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

# ~1M parameters per layer: a few hundred tokens a second on 2 cores, so a long generation
# lasts seconds and what the server does after a disconnect can be watched.
HIDDEN = 512
LAYERS = 4
HEADS = 8
FFN = 1408
CONTEXT = 4096
WORDS = ("▁the ▁a ▁engine ▁request ▁client ▁server ▁proxy ▁abort ▁cancel ▁stream ▁token "
         "▁model ▁hello ▁world ▁user ▁assistant").split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
EOS_ID = 2


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write the model to ``path`` (GGUF); returns ``path``."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *WORDS]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL,
             *([TokenType.BYTE] * 256), *([TokenType.NORMAL] * len(WORDS))]
    scores = [0.0, 0.0, 0.0, *([-1000.0] * 256), *(-float(i) for i in range(len(WORDS)))]
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = GGUFWriter(str(path), "llama")
    writer.add_name("cancel-sidecar tiny llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(vocab)
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    # numpy shape (rows, cols) = GGUF/ggml (ne1, ne0): a [out, in] matrix as llama.cpp expects.
    writer.add_tensor("token_embd.weight", weight(vocab, HIDDEN))
    for n in range(LAYERS):
        writer.add_tensor(f"blk.{n}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{n}.{name}.weight", weight(HIDDEN, HIDDEN))
        writer.add_tensor(f"blk.{n}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{n}.ffn_gate.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"blk.{n}.ffn_up.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"blk.{n}.ffn_down.weight", weight(HIDDEN, FFN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.add_tensor("output.weight", weight(vocab, HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    print(write_tiny_llama(Path(sys.argv[1])))
