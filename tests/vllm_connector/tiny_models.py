"""Tiny models for the vLLM tests, written locally (never downloaded). Imports no vLLM.

- `write_tiny_deepseek_v2`: a DeepSeek-V2-style MLA model (kv_lora_rank 512, qk_rope_head_dim 64:
  the 576-wide latent the CPU MLA decode kernel requires) with seeded random weights in
  safetensors, large enough (init range 0.1) that greedy tokens have clear margins.
- `write_word_tokenizer`: a word-level tokenizer over the model's vocabulary ("t3".."t511"), for
  the OpenAI server, which detokenizes its completions.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512


def write_tiny_deepseek_v2(directory: Path, *, layers: int = 3, seed: int = 0) -> Path:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=2048, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=layers,  # dense MLPs only
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
        initializer_range=0.1, torch_dtype="float32", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(config).save_pretrained(directory)
    return directory


def write_word_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 2048}))
    return directory
