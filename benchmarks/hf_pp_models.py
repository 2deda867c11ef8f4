"""Tiny Hugging Face models built from configs (random weights, no download) for ``adaptdist train
benchmarks/hf_pp_models.py:NAME --plan pp`` (issue 15 with issue 14's models): each ``NAME(batch_size, seq_len)``
returns ``(model, batch, loss_fn)``, the batch's last tensor the target. Two layers, hidden 32, no dropout;
padded rows (id 0) with an attention mask built from the padding where the model takes one, so a mask indexed
by ``torch.arange(batch)`` (transformers' masking_utils) is exercised. Used by ``benchmarks/bench_hf_pp.py``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V = 64  # vocabulary
H = 32  # hidden size


def _ids(batch_size: int, seq_len: int, seed: int = 1, pad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (batch_size, seq_len), generator=g)
    if pad:
        for r in range(batch_size):
            if r % 4:
                x[r, seq_len - r % 4:] = 0  # rows padded by 0..3 tokens (right padding)
    return x


def _targets(batch_size: int, seq_len: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch_size, seq_len), generator=g)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token cross entropy: ``logits [B, T, V]``, ``targets [B, T]`` -> scalar mean."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Masked(nn.Module):
    """A causal LM or encoder called on ``ids [B, T]`` with ``attention_mask = ids != 0`` (long), -> logits."""

    def __init__(self, model: nn.Module, mask: bool = True):
        super().__init__()
        self.model, self.mask = model.eval(), mask

    def forward(self, ids):
        if self.mask:
            return self.model(input_ids=ids, attention_mask=(ids != 0).long()).logits
        return self.model(input_ids=ids).logits


def _causal(config_class: str, mask: bool = True, **cfg):
    def factory(batch_size: int = 4, seq_len: int = 8):
        import transformers as tr

        torch.manual_seed(0)
        model = tr.AutoModelForCausalLM.from_config(getattr(tr, config_class)(vocab_size=V, **cfg))
        return Masked(model, mask), (_ids(batch_size, seq_len), _targets(batch_size, seq_len)), lm_loss
    return factory


_LLAMA_LIKE = dict(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=32, use_cache=False)

gpt2 = _causal("GPT2Config", n_positions=32, n_embd=H, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
llama = _causal("LlamaConfig", **_LLAMA_LIKE)
mistral = _causal("MistralConfig", sliding_window=None, **_LLAMA_LIKE)
qwen2 = _causal("Qwen2Config", **_LLAMA_LIKE)
gemma = _causal("GemmaConfig", head_dim=8, **_LLAMA_LIKE)
falcon = _causal("FalconConfig", hidden_size=H, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
                 multi_query=True, parallel_attn=True, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                 max_position_embeddings=32, use_cache=False)


def bert(batch_size: int = 4, seq_len: int = 8):
    """BERT masked LM with its padding mask."""
    import transformers as tr

    torch.manual_seed(0)
    model = tr.BertForMaskedLM(tr.BertConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, max_position_embeddings=32,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return Masked(model), (_ids(batch_size, seq_len), _targets(batch_size, seq_len)), lm_loss


class Seq2Seq(nn.Module):
    """An encoder-decoder on ``(ids [B, T], attention_mask [B, T], decoder_ids [B, T])`` -> logits; the mask is
    an input of the batch (as a data loader gives it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.eval()

    def forward(self, ids, mask, decoder_ids):
        return self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits


def _seq2seq_batch(batch_size: int, seq_len: int) -> tuple:
    ids = _ids(batch_size, seq_len)
    dec = _ids(batch_size, seq_len, seed=3, pad=False)
    return ids, (ids != 0).long(), dec, _targets(batch_size, seq_len)


def bart(batch_size: int = 4, seq_len: int = 8):
    """BART for conditional generation, 2 encoder + 2 decoder layers, padding mask as an input."""
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.BartConfig(vocab_size=V, d_model=H, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=2, use_cache=False)
    return Seq2Seq(tr.BartForConditionalGeneration(cfg)), _seq2seq_batch(batch_size, seq_len), lm_loss


def t5(batch_size: int = 4, seq_len: int = 8):
    """T5 for conditional generation, 2 + 2 layers, padding mask as an input (shared embedding, tied head)."""
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return Seq2Seq(tr.T5ForConditionalGeneration(cfg)), _seq2seq_batch(batch_size, seq_len), lm_loss


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        import transformers as tr

        self.vit = tr.ViTForImageClassification(tr.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=48, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def forward(self, pixels):
        return self.vit(pixel_values=pixels).logits


def vit(batch_size: int = 4, seq_len: int = 8):
    """ViT image classifier: ``pixels [B, 3, 8, 8]`` -> 3 classes (``seq_len`` unused)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ViT(), (torch.randn(batch_size, 3, 8, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)), \
        F.cross_entropy


MODELS = ("bart", "gpt2", "llama", "mistral", "qwen2", "gemma", "falcon", "bert", "t5", "vit")
