"""``hf:`` model specs: HuggingFace ``transformers`` models built from a configuration only.

* ``hf:MODEL_TYPE`` (``hf:llama``, ``hf:bert``, ``hf:gpt2``): the configuration
  ``transformers.AutoConfig.for_model(MODEL_TYPE, **args)``, whose defaults are the library's
  (Llama's are Llama-2-7B's shapes);
* ``hf:PATH``: a folder holding a ``config.json`` (read locally, never from the hub).

``--arg key=value`` sets configuration fields (``num_hidden_layers=2``). Decoder-only models
(those with a causal-LM class and no masked-LM class: GPT-2, Llama, Mistral, Qwen2, ...) get
their causal-LM head; every other model is the base model. No weights are loaded and nothing
is downloaded; with ``meta=True`` the parameters are on the meta device. ``use_cache`` is off
(training), and so is ``use_associative_scan`` unless set (Mamba's compiled-only scan: eager
PyTorch scans step by step). The default inputs are ``batch=1`` and ``seq`` (default 128) wide: ``input_ids``
(token ids drawn from the vocabulary with a fixed seed, never the padding id, so that
``--verify`` differentiates through real tokens), plus ``decoder_input_ids`` for
encoder-decoder models, or ``pixel_values``
(1, channels, image_size, image_size) for vision models, ``input_values`` (1, 16000·seq/128
samples) for speech models and ``input_features`` (1, mel bins, 2·max_source_positions) for
Whisper-like models, as each model's ``forward`` takes them.

Needs ``pip install graphflop[hf]`` (``transformers``); without it an ``hf:`` spec is a
:class:`~graphflop.load.SpecError`.
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphflop.frontend.errors import first_line
from graphflop.specs import LoadedModel, SpecError, onto_meta

#: default sequence length of the token inputs
DEFAULT_SEQ = 128


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise SpecError(
            f"hf: specs need the transformers package, which is not installed "
            f"(pip install 'graphflop[hf]' or pip install transformers): {e}"
        ) from e
    return transformers


def load_hf(name: str, args: dict, *, meta: bool = False, seq: int | None = None):
    """The ``hf:`` model ``name`` (see the module docstring) as a
    :class:`~graphflop.load.LoadedModel` with its default inputs bound.

    Raises:
        SpecError: transformers missing, an unknown model type, a folder without
            ``config.json``, a configuration field that does not fit, a bad ``seq``.
    """
    from graphflop.frontend.inputs import bind_call

    if not name:
        raise SpecError("give a model type or a config folder: hf:llama, hf:path/to/folder")
    seq = DEFAULT_SEQ if seq is None else seq
    if seq <= 0:
        raise SpecError(f"bad sequence length {seq}: must be a positive integer")
    tf = _transformers()
    config = _config(tf, name, args)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    if getattr(config, "use_associative_scan", False) and "use_associative_scan" not in args:
        # Mamba-family models scan with torch's associative_scan only under compilation, which
        # graphflop's trace reports to transformers; eager PyTorch scans step by step, which is
        # what graphflop describes (and associative_scan's vmap cannot be traced here)
        config.use_associative_scan = False
    cls = _model_class(tf, config)
    try:
        if meta:
            with torch.device("meta"):
                model = cls.from_config(config)
        else:
            model = cls.from_config(config)
    except Exception as e:
        raise SpecError(
            f"building hf:{name} failed: {type(e).__name__}: {first_line(e, continued=True)}"
        ) from e
    kwargs = default_inputs(model, config, seq)
    example = bind_call(model, (), kwargs)
    notes = onto_meta(model) if meta else ()
    return LoadedModel(f"hf:{name}", model, example, notes)


def _config(tf: Any, name: str, args: dict) -> Any:
    path = Path(name)
    if path.is_dir() or "/" in name or name.startswith("."):
        if not (path / "config.json").is_file():
            raise SpecError(
                f"hf:{name}: no config.json in {path} (give a folder holding a transformers "
                "config.json, or a model type such as hf:llama)"
            )
        try:
            config = tf.AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise SpecError(
                f"hf:{name}: reading config.json failed: {first_line(e, continued=True)}"
            ) from e
        _check_fields(config, args, name)
        for k, v in args.items():
            setattr(config, k, v)
        return config
    types = list(tf.CONFIG_MAPPING.keys())
    if name not in types:
        close = difflib.get_close_matches(name, types, n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise SpecError(f"transformers has no model type {name!r}{hint}")
    try:
        _check_fields(tf.AutoConfig.for_model(name), args, name)
        return tf.AutoConfig.for_model(name, **args)
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(
            f"hf:{name}: bad configuration {args}: {first_line(e, continued=True)}"
        ) from e


def _check_fields(config: Any, args: dict, name: str) -> None:
    """Raises SpecError for a key of ``args`` that is not a field of ``config`` (or one of its
    aliases): transformers keeps an unknown keyword as an attribute nothing reads, so a typo
    (``n_layers`` for GPT-2's ``n_layer``) would analyse the default model."""
    for k in args:
        if hasattr(config, k):
            continue
        fields = [*vars(config), *getattr(config, "attribute_map", {})]
        close = difflib.get_close_matches(k, fields, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise SpecError(
            f"hf:{name}: the configuration has no field {k!r}{hint} (see {type(config).__name__})"
        )


def _model_class(tf: Any, config: Any) -> Any:
    """The causal-LM class for a decoder-only model, the base model class otherwise."""
    from transformers.models.auto import modeling_auto as ma

    ctype = type(config)
    decoder = (
        ctype in ma.MODEL_FOR_CAUSAL_LM_MAPPING
        and ctype not in ma.MODEL_FOR_MASKED_LM_MAPPING
        and not getattr(config, "is_encoder_decoder", False)
    )
    return tf.AutoModelForCausalLM if decoder else tf.AutoModel


def default_inputs(model: nn.Module, config: Any, seq: int) -> dict[str, torch.Tensor]:
    """Keyword inputs of batch 1 for ``model``'s ``forward`` (see the module docstring)."""
    params = inspect.signature(model.forward).parameters
    sub = getattr(config, "vision_config", None) or config
    out: dict[str, torch.Tensor] = {}
    if "input_ids" in params:
        out["input_ids"] = _token_ids(config, seq, seed=0)
    if "pixel_values" in params:
        size = getattr(sub, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        out["pixel_values"] = torch.zeros(1, getattr(sub, "num_channels", 3), size, size)
    if "input_features" in params:
        frames = 2 * getattr(config, "max_source_positions", 1500)
        out["input_features"] = torch.zeros(1, getattr(config, "num_mel_bins", 80), frames)
    if "input_values" in params:
        out["input_values"] = torch.zeros(1, 16000 * seq // DEFAULT_SEQ)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        out["decoder_input_ids"] = _token_ids(config, seq, seed=1)
    return out


def _token_ids(config: Any, seq: int, seed: int) -> torch.Tensor:
    """(1, seq) token ids drawn uniformly from the vocabulary (a fixed seed), the padding id
    replaced by the next one: a sequence of padding tokens (a model whose padding id is 0,
    such as Gemma or BERT, with all-zero ids) has zero embeddings and a gradient of zero, which
    ``--verify`` would compare with zero."""
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and vocab > 1:
        ids = torch.where(ids == pad, (ids + 1) % vocab, ids)
    return ids
