"""Published model configurations bundled with graphflop, so that ``hf:`` specs name the
models people plan with offline.

Each :class:`Preset` is a transformers configuration (``model_type`` and the fields of the
model's published ``config.json``, without the token ids, dtypes and training-only fields that
do not change the graph) with where it comes from and the parameter counts its authors
publish. ``hf:llama-3.1-70b`` (the preset's name, any case) builds the preset without asking
the Hub; ``hf:meta-llama/Llama-3.1-70B`` (its Hub name) reads the Hub's ``config.json`` and
falls back to the preset when the Hub cannot be reached (:mod:`graphflop.hf`).

Published figures are strings as their source rounds them (``"8.03B"``, ``"110M"``):
:func:`published_precision` reads the rounding unit from the string (the last significant
digit, a trailing zero of an integer not counting: ``"110M"`` is given to 10 M), and
:func:`matches_published` compares an exact count at that precision.

Total parameters come from the model built on the meta device; active parameters per token
(mixture-of-experts models) from its structure (:func:`active_parameters`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from torch import nn

#: units of published parameter counts
_UNITS = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True)
class Preset:
    """One published model configuration.

    Attributes:
        name: graphflop's name (lower case): ``hf:NAME``.
        hub: the model's repository on the Hugging Face Hub (``ORG/NAME``).
        config: transformers configuration fields, ``model_type`` included.
        source: where the configuration comes from (the Hub's ``config.json``, a paper).
        params: total parameters as published (``"8.03B"``).
        active: parameters active per token as published (mixture-of-experts models), or None.
        params_source: where ``params`` and ``active`` are published.
        aliases: other Hub names of the same configuration.
        note: what differs from the published checkpoint (e.g. a module transformers does not
            build), or "".
        rounding: how the source rounds its figures: ``"nearest"``, or ``"down"`` for a
            source that truncates (Qwen's model cards: 7,615,616,512 as 7.61B).
        family: the model family, for grouping in ``graphflop models``.
    """

    name: str
    hub: str
    config: dict[str, Any]
    source: str
    params: str
    params_source: str
    active: str | None = None
    aliases: tuple[str, ...] = ()
    note: str = ""
    rounding: str = "nearest"
    family: str = field(default="", compare=False)

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def context(self) -> int | None:
        """Token positions the model was trained for (``max_position_embeddings`` or its
        alias ``n_positions``; Whisper's decoder: ``max_target_positions``), or None (T5's
        relative positions, a vision model)."""
        for key in ("max_target_positions", "max_position_embeddings", "n_positions"):
            if key in self.config:
                return int(self.config[key])
        return None


def _llama31(size: str, hidden: int, ffn: int, layers: int, heads: int, params: str) -> Preset:
    return Preset(
        name=f"llama-3.1-{size.lower()}",
        hub=f"meta-llama/Llama-3.1-{size}",
        aliases=(f"meta-llama/Meta-Llama-3.1-{size}",),
        family="Llama 3.1",
        config={
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": hidden,
            "intermediate_size": ffn,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
        source=f"config.json of meta-llama/Llama-3.1-{size} on the Hugging Face Hub",
        params=params,
        params_source="the Hub's parameter count of the safetensors checkpoint",
    )


def _mixtral(
    size: str, hidden: int, ffn: int, layers: int, heads: int, ctx: int, params: str, active: str
) -> Preset:
    return Preset(
        name=f"mixtral-{size.lower()}",
        hub=f"mistralai/Mixtral-{size}-v0.1",
        family="Mixtral",
        config={
            "model_type": "mixtral",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": ffn,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "hidden_act": "silu",
            "max_position_embeddings": ctx,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
        source=f"config.json of mistralai/Mixtral-{size}-v0.1 on the Hugging Face Hub",
        params=params,
        active=active,
        params_source="Mistral AI's announcement (total and active parameters)",
    )


def _qwen25(size: str, hidden: int, ffn: int, layers: int, heads: int, kv: int, params: str):
    return Preset(
        name=f"qwen2.5-{size.lower()}",
        hub=f"Qwen/Qwen2.5-{size}",
        family="Qwen2.5",
        config={
            "model_type": "qwen2",
            "vocab_size": 152064,
            "hidden_size": hidden,
            "intermediate_size": ffn,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6 if size == "7B" else 1e-5,
            "rope_theta": 1e6,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
        source=f"config.json of Qwen/Qwen2.5-{size} on the Hugging Face Hub",
        params=params,
        params_source=f"the Qwen/Qwen2.5-{size} model card ('Number of Parameters')",
        rounding="down",
    )


def _gpt2(
    size: str, hub: str, width: int, layers: int, heads: int, params: str, rounding: str = "nearest"
) -> Preset:
    return Preset(
        name=f"gpt2-{size}",
        hub=hub,
        aliases=(hub.split("/")[1],),
        family="GPT-2",
        config={
            "model_type": "gpt2",
            "vocab_size": 50257,
            "n_positions": 1024,
            "n_embd": width,
            "n_layer": layers,
            "n_head": heads,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": True,
        },
        source=f"config.json of {hub} on the Hugging Face Hub (Radford et al. 2019, Table 2)",
        params=params,
        params_source=f"the {hub} model card",
        rounding=rounding,
    )


def _bert(size: str, width: int, layers: int, heads: int, params: str) -> Preset:
    hub = f"google-bert/bert-{size}-uncased"
    return Preset(
        name=f"bert-{size}",
        hub=hub,
        aliases=(f"bert-{size}-uncased",),
        family="BERT",
        config={
            "model_type": "bert",
            "vocab_size": 30522,
            "hidden_size": width,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "intermediate_size": 4 * width,
            "hidden_act": "gelu",
            "max_position_embeddings": 512,
            "type_vocab_size": 2,
            "layer_norm_eps": 1e-12,
        },
        source=f"config.json of {hub} on the Hugging Face Hub",
        params=params,
        params_source="Devlin et al. 2019 (BERT), section 3",
    )


PRESETS: tuple[Preset, ...] = (
    _llama31("8B", 4096, 14336, 32, 32, "8.03B"),
    _llama31("70B", 8192, 28672, 80, 64, "70.6B"),
    _llama31("405B", 16384, 53248, 126, 128, "405.9B"),
    _mixtral("8x7B", 4096, 14336, 32, 32, 32768, "46.7B", "12.9B"),
    _mixtral("8x22B", 6144, 16384, 56, 48, 65536, "141B", "39B"),
    _qwen25("7B", 3584, 18944, 28, 28, 4, "7.61B"),
    _qwen25("72B", 8192, 29568, 80, 64, 8, "72.7B"),
    Preset(
        name="deepseek-v3",
        hub="deepseek-ai/DeepSeek-V3",
        family="DeepSeek-V3",
        config={
            "model_type": "deepseek_v3",
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "first_k_dense_replace": 3,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_shared_experts": 1,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "tie_word_embeddings": False,
        },
        source="config.json of deepseek-ai/DeepSeek-V3 on the Hugging Face Hub",
        params="671B",
        active="37B",
        params_source="DeepSeek-AI 2024 (DeepSeek-V3 technical report), abstract",
        rounding="down",
        note="multi-head latent attention, 1 shared + 8 of 256 routed experts per token; the "
        "checkpoint's multi-token-prediction module (14B more, not used to generate) is not "
        "built by transformers",
    ),
    _gpt2("small", "openai-community/gpt2", 768, 12, 12, "124M"),
    _gpt2("medium", "openai-community/gpt2-medium", 1024, 24, 16, "355M"),
    _gpt2("large", "openai-community/gpt2-large", 1280, 36, 20, "774M"),
    # the card's "1.5B" is the paper's 1542M (Table 2) shortened; the model has 1,557.6 M
    _gpt2("xl", "openai-community/gpt2-xl", 1600, 48, 25, "1.5B", rounding="down"),
    _bert("base", 768, 12, 12, "110M"),
    _bert("large", 1024, 24, 16, "340M"),
    Preset(
        name="t5-base",
        hub="google-t5/t5-base",
        aliases=("t5-base",),
        family="T5",
        config={
            "model_type": "t5",
            "vocab_size": 32128,
            "d_model": 768,
            "d_kv": 64,
            "d_ff": 3072,
            "num_layers": 12,
            "num_decoder_layers": 12,
            "num_heads": 12,
            "relative_attention_num_buckets": 32,
            "feed_forward_proj": "relu",
            "layer_norm_epsilon": 1e-6,
            "tie_word_embeddings": True,
        },
        source="config.json of google-t5/t5-base on the Hugging Face Hub",
        params="220M",
        params_source="Raffel et al. 2020 (T5), section 3.1",
    ),
    Preset(
        name="vit-b-16",
        hub="google/vit-base-patch16-224",
        family="ViT",
        config={
            "model_type": "vit",
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "hidden_act": "gelu",
            "image_size": 224,
            "patch_size": 16,
            "num_channels": 3,
            "qkv_bias": True,
            "layer_norm_eps": 1e-12,
        },
        source="config.json of google/vit-base-patch16-224 on the Hugging Face Hub",
        params="86M",
        params_source="Dosovitskiy et al. 2021 (ViT), Table 1",
    ),
    Preset(
        name="whisper-small",
        hub="openai/whisper-small",
        family="Whisper",
        config={
            "model_type": "whisper",
            "vocab_size": 51865,
            "num_mel_bins": 80,
            "d_model": 768,
            "encoder_layers": 12,
            "decoder_layers": 12,
            "encoder_attention_heads": 12,
            "decoder_attention_heads": 12,
            "encoder_ffn_dim": 3072,
            "decoder_ffn_dim": 3072,
            "max_source_positions": 1500,
            "max_target_positions": 448,
            "activation_function": "gelu",
            "scale_embedding": False,
            "tie_word_embeddings": True,
        },
        source="config.json of openai/whisper-small on the Hugging Face Hub",
        params="242M",
        params_source="the Hub's parameter count of the openai/whisper-small checkpoint",
    ),
)


def _key(name: str) -> str:
    return name.strip().lower()


_BY_NAME: dict[str, Preset] = {}
for _p in PRESETS:
    for _n in (_p.name, _p.hub, *_p.aliases):
        _BY_NAME.setdefault(_key(_n), _p)


def find(name: str) -> Preset | None:
    """The preset called ``name`` (graphflop's name, its Hub name or an alias, any case), or
    None."""
    return _BY_NAME.get(_key(name))


def close_names(name: str, n: int = 3) -> list[str]:
    """Preset names close to ``name`` (for a 'did you mean' hint)."""
    return difflib.get_close_matches(_key(name), [p.name for p in PRESETS], n=n, cutoff=0.7)


def published_precision(figure: str) -> tuple[int, int]:
    """``(value, unit)`` of a published count: ``"8.03B"`` → (8_030_000_000, 10_000_000);
    ``"110M"`` → (110_000_000, 10_000_000) (a trailing zero of an integer is not a
    significant digit); ``"124M"`` → (124_000_000, 1_000_000).

    Raises:
        ValueError: not a number followed by K, M, B or T.
    """
    text = figure.strip()
    if not text or text[-1].upper() not in _UNITS:
        raise ValueError(f"not a parameter count: {figure!r} (e.g. 8.03B)")
    scale = _UNITS[text[-1].upper()]
    number = Decimal(text[:-1])
    exponent = number.as_tuple().exponent
    assert isinstance(exponent, int)
    if exponent == 0:  # an integer: its trailing zeros are not significant
        digits = str(int(number))
        exponent = len(digits) - len(digits.rstrip("0")) if int(number) else 0
    return int(number * scale), int(Decimal(10) ** exponent * scale)


def round_to(count: int, unit: int, rounding: str = "nearest") -> int:
    """``count`` rounded to a multiple of ``unit``: to the nearest (halves up) or down."""
    if rounding == "down":
        return count // unit * unit
    if rounding != "nearest":
        raise ValueError(f"unknown rounding {rounding!r}: nearest or down")
    return (count + unit // 2) // unit * unit


def matches_published(count: int, figure: str, rounding: str = "nearest") -> bool:
    """Whether the exact ``count`` rounded (``rounding``) at the published ``figure``'s
    precision is that figure."""
    value, unit = published_precision(figure)
    return round_to(count, unit, rounding) == value


def routed_experts(model: nn.Module, config: Any = None) -> list[tuple[str, int, int, int]]:
    """The routed-expert modules of ``model``: ``(path, parameters, E, k)`` each.

    A routed-expert module holds the weights of its ``E`` experts stacked along the first
    dimension (transformers' ``*Experts`` modules: ``num_experts`` set, every own parameter of
    leading size ``E``) and has no ``top_k`` of its own (the router beside it, which every
    token runs, has). ``k``, the experts each token runs, is the ``top_k`` of a router among
    its siblings or of its parent, else the configuration's ``num_experts_per_tok``. Shared
    experts are ordinary modules: they count as active.

    Raises:
        ValueError: an expert module whose k cannot be found.
    """
    found: list[tuple[str, int, int, int]] = []
    parents = {m: p for p in model.modules() for m in p.children()}
    for path, mod in model.named_modules():
        e = getattr(mod, "num_experts", None)
        if not isinstance(e, int) or e <= 1 or hasattr(mod, "top_k"):
            continue
        own = list(mod.parameters(recurse=False))
        if not own or any(p.dim() == 0 or p.shape[0] != e for p in own):
            continue
        parent = parents.get(mod)
        k = None
        if parent is not None:
            candidates = [parent, *parent.children()]
            k = next(
                (c.top_k for c in candidates if isinstance(getattr(c, "top_k", None), int)), None
            )
        if k is None and config is not None:
            k = getattr(config, "num_experts_per_tok", None)
        if not isinstance(k, int) or not 0 < k <= e:
            raise ValueError(f"{path}: {e} routed experts but no top-k found")
        found.append((path, sum(p.numel() for p in mod.parameters()), e, k))
    return found


def active_parameters(model: nn.Module, config: Any = None) -> int:
    """Parameters a token's forward reads: every parameter, less the routed experts it does
    not run (a module of ``E`` stacked experts of which each token runs ``k`` contributes
    ``k/E`` of its parameters, :func:`routed_experts`). Equal to the total for a dense model.
    """
    total = sum(p.numel() for p in model.parameters())
    idle = sum(n * (e - k) // e for _, n, e, k in routed_experts(model, config))
    return total - idle


def experts_summary(
    model: nn.Module, config: Any, tokens: int, routing: Any = None
) -> dict[str, Any] | None:
    """What a mixture-of-experts model's analysis assumes about routing, for the report; None
    for a model without routed experts (:func:`routed_experts`).

    Keys: ``params`` and ``active_params`` (per token), ``routed_layers``, ``experts`` (E) and
    ``top_k`` (k) (the first layer's), ``uniform`` (false when layers differ in E or k, or
    when the experts receive different numbers of tokens, as under a measured histogram),
    ``tokens`` (T), ``routing`` (the assumption,
    :class:`graphflop.ops.transformers_ops.Routing`, balanced by default, in words),
    ``tokens_per_expert`` (the mean: T·k/E, or under a capacity the buffer each expert
    computes), ``tokens_per_expert_min`` and ``tokens_per_expert_max`` (a histogram's idlest
    and busiest experts) and ``expert_tokens`` (the rows each of the E experts receives, a
    list). Balanced or measured, each token-expert pair is one row of a grouped
    product, so the FLOPs do not depend on the split; the split changes the per-expert load
    (time on parallel hardware), which the FLOPs do not show.
    """
    from graphflop.ops.transformers_ops import current_routing

    found = routed_experts(model, config)
    if not found:
        return None
    routing = routing or current_routing()
    _, _, e, k = found[0]
    per_expert = routing.tokens_per_expert(tokens * k, e)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "active_params": active_parameters(model, config),
        "routed_layers": len(found),
        "experts": e,
        "top_k": k,
        "uniform": all((x[2], x[3]) == (e, k) for x in found)
        and min(per_expert) == max(per_expert),
        "tokens": tokens,
        "routing": routing.describe(),
        "tokens_per_expert": sum(per_expert) / e,
        "tokens_per_expert_min": min(per_expert),
        "tokens_per_expert_max": max(per_expert),
        "expert_tokens": per_expert,
    }
