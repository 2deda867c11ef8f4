"""The model zoo of ``adaptdist zoo``: small models with random weights (no download), each built as
``(model, batch, loss_fn)`` with ``loss = loss_fn(model(*batch[:-1]), batch[-1])`` — the contract of
``adaptdist train``'s ``FILE.py:FACTORY`` (:mod:`adaptdist.model_spec`) and of the torch.compile backend's
tests (each rank passes its own rows of every tensor of ``batch``).

Ours: ``gpt``, ``llama`` (:mod:`adaptdist.models.gpt`, :mod:`adaptdist.models.llama`), ``mlp``,
``mlp-dropout``, ``cnn`` (BatchNorm in training mode), ``moe`` (a top-k router, experts as an
``nn.ModuleList``, ``index_add`` combine), ``moe-stacked`` (one stacked ``[E, ...]`` weight per layer) and
``dlrm`` (``EmbeddingBag`` tables, a dense MLP, a dot-product interaction). Hugging Face ones (``hf-*``),
built from small configs through ``transformers`` (an optional dependency: :func:`unavailable` says why a
model cannot be built). Every model builds in well under a second and steps in milliseconds on one core.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UsageError

SEQ_LEN = 8  # tokens per row of the language models


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry.

    Attributes:
        name: the name on the command line (``hf-bert``).
        build: ``build(batch_size) -> (model, batch, loss_fn)``, the same weights and batch on every call
            (it seeds torch itself).
        batch_size: global rows of the sweep's batch (every rank gets ``batch_size / ranks`` of them).
        description: one line for the table.
        tp_plan: ``TP_PLAN`` globs (``{param glob: "S(0)"}``) for ``--plans tp``; None: the model has no
            tensor-parallel plan and ``tp`` is not swept for it.
        requires: the optional package it needs (``transformers``), or None.
        random: the model draws random numbers in training (dropout): a mismatch with eager is
            "differs by design (rng)", not a failure.
        tolerance: absolute tolerance of loss, gradients and parameters against eager.
        ep_plan: ``EP_PLAN`` globs (the stacked experts' ``{param glob: "S(0)"}``) for ``--plans ep``; None: no
            expert parallelism swept.
        options: lowering options the model is swept with, as ``adaptdist.backend`` keywords
            (``{"batch_norm": "sync"}``; ``adaptdist train`` gets the matching flags).
    """

    name: str
    build: Callable[[int], tuple]
    batch_size: int
    description: str
    tp_plan: dict | None = None
    requires: str | None = None
    random: bool = False
    tolerance: float = 1e-5
    tags: tuple[str, ...] = field(default=())
    ep_plan: dict | None = None
    options: dict = field(default_factory=dict)

    @property
    def whole_batch(self) -> bool:
        """Whether eager's reference runs the forward on the whole batch (each rank's loss on its rows of the
        output), not each rank's rows alone: synchronized BatchNorm statistics, or random numbers drawn as one
        process draws them (``rng="global"``)."""
        return self.options.get("batch_norm") == "sync" or self.random


# --- our models ---------------------------------------------------------------------------------------

def _tokens(batch_size: int, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch_size, SEQ_LEN), generator=g),
            torch.randint(0, vocab, (batch_size, SEQ_LEN), generator=g))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_gpt(batch_size: int):
    """Our GPT (2 layers, width 32): token ids ``[B, 8]`` -> next-token loss; ``(model, (ids, targets), lm_loss)``."""
    from .gpt import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=32, num_layers=2, num_heads=4, max_seq_len=SEQ_LEN))
    return model, _tokens(batch_size, 256), lm_loss


def build_llama(batch_size: int):
    """Our LLaMA-style model (2 layers, width 32, 2 KV heads): ids ``[B, 8]``; ``(model, (ids, targets), lm_loss)``."""
    from .gpt import lm_loss
    from .llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, max_seq_len=SEQ_LEN))
    return model, _tokens(batch_size, 256), lm_loss


class MLP(nn.Module):
    """``x [B, 12] -> logits [B, 5]``: two linear layers, tanh between, optionally dropout."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(24, 5)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _rows(batch_size: int, classes: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, *shape, generator=g), torch.randint(0, classes, (batch_size,), generator=g)


def build_mlp(batch_size: int, dropout: float = 0.0):
    """:class:`MLP` (``dropout`` after the hidden layer): ``x [B, 12]`` -> 5 classes, cross entropy."""
    torch.manual_seed(0)
    return MLP(dropout), _rows(batch_size, 5, 12), F.cross_entropy


class ConvNet(nn.Module):
    """``x [B, 3, 8, 8] -> logits [B, 3]``: conv, BatchNorm (training mode), relu, max-pool, linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)
        return self.head(h.mean(dim=(2, 3)))


def build_cnn(batch_size: int):
    """:class:`ConvNet`: images ``[B, 3, 8, 8]`` -> 3 classes, cross entropy."""
    torch.manual_seed(0)
    return ConvNet(), _rows(batch_size, 3, 3, 8, 8), F.cross_entropy


class TopKMoE(nn.Module):
    """A mixture-of-experts layer as users write it: ``x [B, T, D]`` routed per token to its top-``k`` of
    ``E`` experts (softmax router, weights renormalised over the k), experts an ``nn.ModuleList`` of MLPs,
    each expert's outputs summed back with ``index_add``; a linear head to ``classes`` per row."""

    def __init__(self, dim: int = 8, hidden: int = 16, experts: int = 4, k: int = 2, classes: int = 3):
        super().__init__()
        self.k = k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                     for _ in range(experts))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return self.head((tokens + out).reshape(x.shape).mean(1))


class StackedMoE(nn.Module):
    """The same layer with the experts as stacked weights ``w1 [E, D, H]``, ``w2 [E, H, D]``: every token
    through its top-k experts by gathering their weights (``w1[chosen]``) and batched matmuls."""

    def __init__(self, dim: int = 8, hidden: int = 16, experts: int = 4, k: int = 2, classes: int = 3):
        super().__init__()
        self.k = k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(0.3 * torch.randn(experts, dim, hidden))
        self.w2 = nn.Parameter(0.3 * torch.randn(experts, hidden, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), self.k, dim=-1)  # [N, k]
        weights = weights / weights.sum(-1, keepdim=True)
        h = F.gelu(torch.einsum("nd,nkdh->nkh", tokens, self.w1[chosen]))
        y = torch.einsum("nkh,nkhd->nkd", h, self.w2[chosen])
        out = (y * weights[..., None]).sum(1)
        return self.head((tokens + out).reshape(x.shape).mean(1))


def build_moe(batch_size: int, stacked: bool = False):
    """:class:`StackedMoE` (``stacked``) or :class:`TopKMoE`: ``x [B, 6, 8]`` -> 3 classes, cross entropy."""
    torch.manual_seed(0)
    model = StackedMoE() if stacked else TopKMoE()
    return model, _rows(batch_size, 3, 6, 8), F.cross_entropy


def build_moe_dense(batch_size: int, experts: str):
    """adaptdist/models/moe.py's layer (static shapes: dense dispatch with the router's zero-masked weights),
    experts an ``nn.ModuleList`` combined by ``index_add`` or stacked weights combined by ``scatter_add``."""
    from . import moe

    if experts == "list":
        return moe.list_factory(batch_size, 6)
    return moe.factory(batch_size, 6)


def build_dlrm(batch_size: int):
    """:class:`adaptdist.models.dlrm.DLRM` (the one of ``builtin:dlrm``) with a bottom MLP: dense ``[B, 4]`` and 3
    tables of 20 rows, ids ``int64[B, 2 per bag]`` each -> click logit, binary cross entropy with logits against
    ``clicks [B]``."""
    from .dlrm import DLRM

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(batch_size, 4, generator=g)
    ids = [torch.randint(0, 20, (batch_size, 2), generator=g) for _ in range(3)]
    clicks = torch.randint(0, 2, (batch_size,), generator=g).float()
    return DLRM((20, 20, 20), dim=8, dense_in=4), (dense, *ids, clicks), F.binary_cross_entropy_with_logits


# --- Hugging Face models from configs (random weights, no download) ------------------------------------

class HFLogits(nn.Module):
    """A Hugging Face model called on token ids (``ids [B, T]``, id 0 = padding when ``padding_mask``),
    returning its logits; eval mode (no dropout: the configs set none anyway)."""

    def __init__(self, model: nn.Module, padding_mask: bool = False, ones_mask: bool = False):
        super().__init__()
        self.model = model.eval()
        self.padding_mask, self.ones_mask = padding_mask, ones_mask

    def forward(self, ids):
        if self.padding_mask:
            return self.model(input_ids=ids, attention_mask=(ids != 0).long()).logits
        if self.ones_mask:
            return self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        return self.model(input_ids=ids).logits


def _padded_tokens(batch_size: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, vocab, (batch_size, SEQ_LEN), generator=g)
    for r in range(batch_size):
        x[r, SEQ_LEN - r % 4:] = 0  # rows padded by 0..3 tokens
    return x


def _causal_lm(config_class: str, vocab: int = 64, ones_mask: bool = False, **cfg):
    def build(batch_size: int):
        import transformers as tr

        torch.manual_seed(0)
        model = tr.AutoModelForCausalLM.from_config(getattr(tr, config_class)(vocab_size=vocab, **cfg))
        return HFLogits(model, ones_mask=ones_mask), _tokens(batch_size, vocab), _lm_loss
    return build


_LLAMA_LIKE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=16, use_cache=False)


def _llama_tp(prefix: str = "model.model.layers.*") -> dict:
    return {f"{prefix}.self_attn.[qkv]_proj.weight": "S(0)", f"{prefix}.self_attn.o_proj.weight": "S(1)",
            f"{prefix}.mlp.gate_proj.weight": "S(0)", f"{prefix}.mlp.up_proj.weight": "S(0)",
            f"{prefix}.mlp.down_proj.weight": "S(1)"}


def _encoder_classifier(config_class: str, model_class: str, vocab: int = 31, **cfg):
    def build(batch_size: int):
        import transformers as tr

        torch.manual_seed(0)
        model = getattr(tr, model_class)(getattr(tr, config_class)(vocab_size=vocab, **cfg))
        g = torch.Generator().manual_seed(2)
        return (HFLogits(model, padding_mask=True), (_padded_tokens(batch_size, vocab),
                torch.randint(0, 3, (batch_size,), generator=g)), F.cross_entropy)
    return build


def build_hf_bert(batch_size: int):
    """BERT for masked LM on padded rows, with its attention mask from the padding."""
    import transformers as tr

    torch.manual_seed(0)
    model = tr.BertForMaskedLM(tr.BertConfig(vocab_size=31, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 31, (batch_size, SEQ_LEN), generator=g)
    return HFLogits(model, padding_mask=True), (_padded_tokens(batch_size, 31), y), _lm_loss


class T5WithLabels(nn.Module):
    """T5 with labels: ``(ids [B, T], labels [B, T]) -> loss`` (the model's own cross entropy; its shared
    embedding is one module under three names)."""

    def __init__(self):
        super().__init__()
        import transformers as tr

        self.t5 = tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                            num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                                            decoder_start_token_id=0, pad_token_id=0))

    def forward(self, ids, labels):
        return self.t5(input_ids=ids, labels=labels).loss


def build_hf_t5(batch_size: int):
    """:class:`T5WithLabels`: ids and labels ``int64[B, 8]`` (vocab 32); the model returns its own loss, so the
    batch's last tensor is a dummy target ``[B]`` for :func:`_returned_loss`."""
    torch.manual_seed(0)
    model = T5WithLabels()
    ids, labels = _tokens(batch_size, 32)
    return model, (ids, labels, torch.zeros(batch_size)), _returned_loss


def _returned_loss(loss: torch.Tensor, _unused: torch.Tensor) -> torch.Tensor:
    """The model returns its loss: the target is a placeholder with one row per sample."""
    return loss


class HFViT(nn.Module):
    """ViT for image classification: ``pixels [B, 3, 8, 8] -> logits [B, 3]``."""

    def __init__(self):
        super().__init__()
        import transformers as tr

        self.vit = tr.ViTForImageClassification(tr.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def forward(self, pixels):
        return self.vit(pixel_values=pixels).logits


def build_hf_vit(batch_size: int):
    """:class:`HFViT`: images ``[B, 3, 8, 8]`` -> 3 classes, cross entropy."""
    torch.manual_seed(0)
    return HFViT(), _rows(batch_size, 3, 3, 8, 8), F.cross_entropy


class HFSwin(nn.Module):
    """Swin for image classification: ``pixels [B, 3, 16, 16] -> logits [B, 3]`` (patches of 2, windows of 2x2
    patches, shifted windows in the second block of each stage, a patch merging between the two stages)."""

    def __init__(self):
        super().__init__()
        import transformers as tr

        self.swin = tr.SwinForImageClassification(tr.SwinConfig(
            image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 1], num_heads=[2, 2], window_size=2,
            mlp_ratio=2.0, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            drop_path_rate=0.0))

    def forward(self, pixels):
        return self.swin(pixel_values=pixels).logits


def build_hf_swin(batch_size: int):
    """:class:`HFSwin`: images ``[B, 3, 16, 16]`` -> 3 classes, cross entropy."""
    torch.manual_seed(0)
    return HFSwin(), _rows(batch_size, 3, 3, 16, 16), F.cross_entropy


_NO_DROPOUT_ENC = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("gpt", build_gpt, 4, "adaptdist GPT, 2 layers, dim 32, tied head",
             tp_plan={"tok_emb.weight": "S(0)", "blocks.*.attn.[qkv].weight": "S(0)", "blocks.*.attn.[qkv].bias": "S(0)",
                      "blocks.*.attn.proj.weight": "S(1)", "blocks.*.fc.weight": "S(0)", "blocks.*.fc.bias": "S(0)",
                      "blocks.*.fc_out.weight": "S(1)"}),
    ZooModel("llama", build_llama, 4, "adaptdist LLaMA: RMSNorm, RoPE, GQA (4 heads, 2 kv), SwiGLU",
             tp_plan={"tok_emb.weight": "S(0)", "head.weight": "S(0)", "layers.*.attn.w[qkv].weight": "S(0)",
                      "layers.*.attn.wo.weight": "S(1)", "layers.*.mlp.w[13].weight": "S(0)",
                      "layers.*.mlp.w2.weight": "S(1)"}),
    ZooModel("mlp", build_mlp, 4, "2-layer MLP, tanh, cross entropy",
             tp_plan={"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"}),
    ZooModel("mlp-dropout", lambda b: build_mlp(b, dropout=0.5), 4, "the MLP with dropout 0.5 (training mode)",
             tp_plan={"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"}, random=True),
    ZooModel("cnn", build_cnn, 4, "conv + BatchNorm2d (training mode, synchronized statistics) + max-pool + linear",
             options={"batch_norm": "sync"}),
    ZooModel("moe", lambda b: build_moe_dense(b, "list"), 4,
             "top-2 of 4 experts (nn.ModuleList), dense dispatch, index_add combine; ep shards the list (held stacked)",
             ep_plan={"moe.experts.*": "S(0)"}),
    ZooModel("moe-stacked", lambda b: build_moe_dense(b, "stacked"), 4,
             "top-2 of 4 experts, stacked [E, D, H] weights, scatter_add combine; ep shards the experts",
             ep_plan={"moe.w_in": "S(0)", "moe.w_out": "S(0)"}),
    ZooModel("moe-gather", lambda b: build_moe(b, stacked=True), 4,
             "top-2 of 4 experts, stacked weights gathered per token (w1[chosen])"),
    ZooModel("moe-where", build_moe, 4, "Mixtral-style: torch.where per expert in a loop, index_add "
             "(data-dependent token counts: refused, naming the construct)"),
    ZooModel("dlrm", build_dlrm, 4, "DLRM-style: 3 EmbeddingBag tables, bottom/top MLP, dot interaction"),
    ZooModel("hf-gpt2", _causal_lm("GPT2Config", n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), 4,
             "HF GPT-2 (Conv1D layers, tied head)", requires="transformers",
             tp_plan={"model.transformer.h.*.mlp.c_fc.weight": "S(1)", "model.transformer.h.*.mlp.c_fc.bias": "S(0)",
                      "model.transformer.h.*.mlp.c_proj.weight": "S(0)"}),
    ZooModel("hf-llama", _causal_lm("LlamaConfig", ones_mask=True, **_LLAMA_LIKE), 4,
             "HF LLaMA (GQA, RoPE, an all-ones attention mask)", requires="transformers", tp_plan=_llama_tp()),
    ZooModel("hf-mistral", _causal_lm("MistralConfig", sliding_window=None, **_LLAMA_LIKE), 4,
             "HF Mistral (GQA)", requires="transformers", tp_plan=_llama_tp()),
    ZooModel("hf-qwen2", _causal_lm("Qwen2Config", **_LLAMA_LIKE), 4, "HF Qwen2 (GQA, qkv biases)",
             requires="transformers", tp_plan={**_llama_tp(), "model.model.layers.*.self_attn.[qkv]_proj.bias": "S(0)"}),
    ZooModel("hf-bert", build_hf_bert, 4, "HF BERT masked LM, attention mask from padding", requires="transformers",
             tp_plan={"model.bert.encoder.layer.*.intermediate.dense.weight": "S(0)",
                      "model.bert.encoder.layer.*.intermediate.dense.bias": "S(0)",
                      "model.bert.encoder.layer.*.output.dense.weight": "S(1)"}),
    ZooModel("hf-t5", build_hf_t5, 4, "HF T5 encoder-decoder with labels (its own loss, shared embedding)",
             requires="transformers"),
    ZooModel("hf-vit", build_hf_vit, 4, "HF ViT image classifier (class token, position embeddings)",
             requires="transformers"),
    ZooModel("hf-swin", build_hf_swin, 4, "HF Swin image classifier (shifted windows, patch merging)",
             requires="transformers"),
    ZooModel("hf-roberta", _encoder_classifier("RobertaConfig", "RobertaForSequenceClassification", vocab=31,
                                               hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, max_position_embeddings=24, num_labels=3,
                                               pad_token_id=0, **_NO_DROPOUT_ENC), 4,
             "HF RoBERTa sequence classifier, padding mask", requires="transformers"),
    ZooModel("hf-distilbert", _encoder_classifier("DistilBertConfig", "DistilBertForSequenceClassification", vocab=31,
                                                  dim=16, hidden_dim=32, n_layers=1, n_heads=2,
                                                  max_position_embeddings=16, num_labels=3, dropout=0.0,
                                                  attention_dropout=0.0, seq_classif_dropout=0.0), 4,
             "HF DistilBERT sequence classifier, padding mask", requires="transformers"),
    ZooModel("hf-opt", _causal_lm("OPTConfig", hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=2,
                                  max_position_embeddings=16, word_embed_proj_dim=32, dropout=0.0,
                                  attention_dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2), 4,
             "HF OPT causal LM (learned positions)", requires="transformers"),
    ZooModel("hf-gptneox", _causal_lm("GPTNeoXConfig", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=16, use_cache=False,
                                      hidden_dropout=0.0, attention_dropout=0.0), 4,
             "HF GPT-NeoX (parallel residual, partial rotary)", requires="transformers"),
)}


def unavailable(model: ZooModel) -> str | None:
    """Why ``model`` cannot be built here (its optional package is not installed), or None."""
    if model.requires and importlib.util.find_spec(model.requires) is None:
        return f"{model.requires} is not installed (pip install {model.requires})"
    return None


def get(name: str) -> ZooModel:
    """The zoo model called ``name``.

    Raises:
        UsageError: no such model; lists the names.
    """
    try:
        return ZOO[name]
    except KeyError:
        raise UsageError(f"no zoo model {name!r}; the zoo has: {', '.join(ZOO)}") from None


def factory_of(name: str) -> Callable[[int, int], tuple]:
    """``factory(batch_size, seq_len)`` for ``adaptdist train`` (``seq_len`` is fixed at :data:`SEQ_LEN`)."""
    model = get(name)
    return lambda batch_size, seq_len=SEQ_LEN: model.build(batch_size)
