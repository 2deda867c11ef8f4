"""A Hugging Face T5 with labels for ``adaptdist train tests/hf_t5_model.py:factory``: built from a tiny
T5Config (random weights, no download), one encoder and one decoder layer, no dropout. Its embedding is
shared by the encoder, the decoder and the output head (one parameter under four names, ``t5.shared.weight``
among them, which the forward never reads under that name); the model computes its own loss from the labels
(shifted right into the decoder's inputs), which ``loss_fn`` returns."""

import torch
import torch.nn as nn

VOCAB = 37


class T5WithLabels(nn.Module):
    """``forward(ids [B, S] int64, labels [B, S] int64) -> loss`` (scalar, mean over the label tokens)."""

    def __init__(self):
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                       num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        self.t5 = T5ForConditionalGeneration(cfg)

    def forward(self, ids, labels):
        return self.t5(input_ids=ids, labels=labels).loss


def factory(batch_size, seq_len):
    torch.manual_seed(0)
    model = T5WithLabels()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    labels = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    return model, (ids, labels, torch.zeros(batch_size)), lambda loss, _target: loss
