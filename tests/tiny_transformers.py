"""Tiny transformers models built from configs (no download), dropout off so runs compare exactly."""
from __future__ import annotations

import torch


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)


def tiny_llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=32, hidden_dropout_prob=0.0,
                                                    attention_probs_dropout_prob=0.0))
