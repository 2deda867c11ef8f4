"""A Hugging Face BertModel with its pooler and a loss on the token outputs, for ``adaptdist train
tests/hf_bert_pooler_model.py:factory``: built from a tiny BertConfig (random weights, no download), no dropout.
``add_pooling_layer=True`` (BertModel's default) computes the pooler from the first token, but the loss reads only
``last_hidden_state``: the pooler's weight and bias receive no gradient (DDP needs find_unused_parameters=True)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 29
UNUSED = ["bert.pooler.dense.weight", "bert.pooler.dense.bias"]


class BertTokens(nn.Module):
    """``forward(ids [B, S] int64) -> [B, S, hidden]``: BertModel's last hidden state (its pooler runs too)."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        self.bert = BertModel(cfg, add_pooling_layer=True)

    def forward(self, ids):
        return self.bert(input_ids=ids).last_hidden_state


def _loss(hidden, target):
    return F.mse_loss(hidden, target)


def factory(batch_size, seq_len):
    torch.manual_seed(0)
    model = BertTokens()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    target = torch.randn(batch_size, seq_len, 16, generator=g)
    return model, (ids, target), _loss
