"""``hf:`` model specs: HuggingFace ``transformers`` models built from a configuration only.

* ``hf:MODEL_TYPE`` (``hf:llama``, ``hf:bert``, ``hf:gpt2``): the configuration
  ``transformers.AutoConfig.for_model(MODEL_TYPE, **args)``, whose defaults are the library's
  (Llama's are Llama-2-7B's shapes);
* ``hf:PRESET`` (``hf:llama-3.1-70b``): a published configuration bundled with graphflop
  (:mod:`graphflop.presets`, ``graphflop models``), never asking the Hub;
* ``hf:ORG/NAME[@REVISION]`` (``hf:meta-llama/Llama-3.1-8B``): the ``config.json`` of that
  repository on the Hugging Face Hub (only that file, never weights), through
  ``huggingface_hub``'s cache, so a name read once works offline afterwards
  (``HF_HUB_OFFLINE=1`` reads the cache alone). When the Hub cannot be reached, or refuses (a
  gated or missing repository), a name that is a preset's Hub name builds the preset (with a
  note saying so); any other is a :class:`~graphflop.load.SpecError` of one line naming the
  offline alternatives. Reachability is probed once with a 3 s connection, so that no network
  fails in seconds rather than after the Hub client's retries;
* ``hf:PATH``: a folder holding a ``config.json`` (read locally).

``--arg key=value`` sets configuration fields (``num_hidden_layers=2``). Decoder-only models
(those with a causal-LM class and no masked-LM class: GPT-2, Llama, Mistral, Qwen2, ...) get
their causal-LM head; every other model is the base model. No weights are loaded and nothing
but a ``config.json`` is downloaded; with ``meta=True`` the parameters are on the meta device.
``use_cache`` is off
(training), and so is ``use_associative_scan`` unless set (Mamba's compiled-only scan: eager
PyTorch scans step by step). The default inputs are ``batch=1`` and ``seq`` (default 128) wide: ``input_ids``
(token ids drawn from the vocabulary with a fixed seed, never the padding id, so that
``--verify`` differentiates through real tokens), plus ``decoder_input_ids`` for
encoder-decoder models, or ``pixel_values``
(1, channels, image_size, image_size) for vision models, ``input_values`` (1, 16000·seq/128
samples) for speech models and ``input_features`` (1, mel bins, 2·max_source_positions) for
Whisper-like models, as each model's ``forward`` takes them. A ``seq`` longer than the
positions the model has (``max_position_embeddings``; Whisper's decoder:
``max_target_positions``) is refused: set that field with ``--arg`` to analyse longer inputs.

Needs ``pip install graphflop[hf]`` (``transformers``); without it an ``hf:`` spec is a
:class:`~graphflop.load.SpecError`.
"""

from __future__ import annotations

import difflib
import inspect
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphflop.frontend.errors import first_line, library_logs_quiet
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
    :class:`~graphflop.load.LoadedModel` with its default inputs bound; its notes say where
    the configuration came from when it is not a model type's defaults.

    Raises:
        SpecError: transformers missing, an unknown model type or preset, a folder without
            ``config.json``, a Hub name the Hub cannot give (unreachable, gated, missing) with
            no cached copy and no preset, a configuration field that does not fit, a bad
            ``seq`` or one longer than the model's positions.
    """
    if not name:
        raise SpecError(
            "give a model type, a preset, a Hub name or a config folder: hf:llama, "
            "hf:llama-3.1-8b, hf:meta-llama/Llama-3.1-8B, hf:path/to/folder"
        )
    seq = DEFAULT_SEQ if seq is None else seq
    if seq <= 0:
        raise SpecError(f"bad sequence length {seq}: must be a positive integer")
    tf = _transformers()
    # transformers logs its configuration checks (token ids outside the vocabulary) on
    # stderr; graphflop's own advice names them in its one-line error
    with library_logs_quiet():
        return _load_hf(tf, name, args, meta=meta, seq=seq)


def _load_hf(tf: Any, name: str, args: dict, *, meta: bool, seq: int) -> LoadedModel:
    from graphflop.frontend.inputs import bind_call

    config, notes = _config(tf, name, args)
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
            + _token_ids_advice(config)
        ) from e
    _check_context(model, config, seq, name)
    kwargs = default_inputs(model, config, seq)
    example = bind_call(model, (), kwargs)
    notes = (*notes, *(onto_meta(model) if meta else ()))
    seq_inputs = tuple(k for k in SEQ_INPUTS if k in kwargs)
    return LoadedModel(f"hf:{name}", model, example, notes, seq_inputs)


def _token_ids_advice(config: Any) -> str:
    """Advice for a build that failed where the configuration's special token ids
    (``pad_token_id``, …) are not below its ``vocab_size`` (a vocabulary made smaller with
    ``--arg vocab_size=N``: an embedding's ``padding_idx`` then lies outside its table); ""
    when they are."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return ""
    names = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
    out = []
    for k in names:
        v = getattr(config, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
            out.append(f"{k} {v}")
    if not out:
        return ""
    give = " ".join(f"--arg {x.split()[0]}=0" for x in out)
    return f" ({', '.join(out)} not below vocab_size {vocab}: give ids below it, e.g. {give})"


def _check_context(model: nn.Module, config: Any, seq: int, name: str) -> None:
    """Raises SpecError when the token inputs of ``seq`` positions are longer than the
    model's positions (its position table, or the rotary context it was trained for)."""
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params and "decoder_input_ids" not in params:
        return
    for key in ("max_target_positions", "max_position_embeddings"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit > 0:
            break
    else:
        return
    if seq > limit:
        field = "n_positions" if "n_positions" in vars(config) else key
        raise SpecError(
            f"hf:{name}: --seq {seq} is longer than the model's {limit} positions ({field}); "
            f"give --seq {limit} or less, or --arg {field}={seq} to analyse a longer context"
        )


#: a Hub repository id, with an optional revision: ORG/NAME[@REVISION]
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


def _is_folder(name: str) -> bool:
    """Whether ``name`` is meant as a local folder rather than a Hub name."""
    return (
        Path(name).expanduser().exists()
        or name.startswith((".", "/", "~"))
        or ("/" in name and not _HUB_ID.fullmatch(name))
    )


def _config(tf: Any, name: str, args: dict) -> tuple[Any, tuple[str, ...]]:
    """The configuration ``name`` names, with ``args`` set, and notes on where it came from."""
    from graphflop import presets

    if _is_folder(name):
        return _folder_config(tf, Path(name).expanduser(), name, args), ()
    hub = _HUB_ID.fullmatch(name)
    if hub:
        preset = presets.find(hub["repo"])
        config, note = _hub_config(tf, hub["repo"], hub["revision"], preset, name)
        _check_fields(config, args, name)
        _set_fields(config, args, name)
        return config, (note,)
    types = list(tf.CONFIG_MAPPING.keys())
    preset = presets.find(name)
    if name not in types and preset is not None:
        # "from": a source may end in a parenthesis of its own (a paper's table)
        note = f"configuration: graphflop's preset {preset.name}, from {preset.source}"
        return _preset_config(tf, preset, args, name), (note,)
    if name not in types:
        close = difflib.get_close_matches(name, types, n=3) + presets.close_names(name)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise SpecError(
            f"transformers has no model type {name!r} and graphflop no preset of that name"
            f"{hint} (graphflop models lists the presets)"
        )
    try:
        _check_fields(tf.AutoConfig.for_model(name), args, name)
        return tf.AutoConfig.for_model(name, **args), ()
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(
            f"hf:{name}: bad configuration {args}: {first_line(e, continued=True)}"
        ) from e


def _folder_config(tf: Any, path: Path, name: str, args: dict) -> Any:
    if not (path / "config.json").is_file():
        raise SpecError(
            f"hf:{name}: no config.json in {path} (give a folder holding a transformers "
            "config.json, a Hub name such as hf:meta-llama/Llama-3.1-8B, a preset such as "
            "hf:llama-3.1-8b or a model type such as hf:llama)"
        )
    try:
        config = tf.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise SpecError(
            f"hf:{name}: reading config.json failed: {first_line(e, continued=True)}"
        ) from e
    _check_fields(config, args, name)
    _set_fields(config, args, name)
    return config


def _preset_config(tf: Any, preset: Any, args: dict, name: str) -> Any:
    """The preset's configuration with ``args`` set (a field it does not have refused)."""
    fields = {k: v for k, v in preset.config.items() if k != "model_type"}
    try:
        config = tf.AutoConfig.for_model(preset.model_type, **fields)
    except Exception as e:  # a transformers too old or too new for the preset's fields
        raise SpecError(
            f"hf:{name}: transformers {tf.__version__} cannot build preset {preset.name}: "
            f"{first_line(e, continued=True)}"
        ) from e
    _check_fields(config, args, name)
    _set_fields(config, args, name)
    return config


#: seconds the Hub's host gets to accept a connection before it counts as unreachable
HUB_CONNECT_TIMEOUT = 3.0


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be reached (offline mode, no route, no name resolution), or None.

    One TCP connection to the endpoint's host with a :data:`HUB_CONNECT_TIMEOUT` limit: the
    Hub client retries a failed connection for about 25 s. Behind a proxy (``HTTPS_PROXY``
    and the like) the host is not probed and the client's own errors decide."""
    import socket
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    offline = getattr(constants, "is_offline_mode", None)
    if offline() if offline is not None else constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urllib.parse.urlparse(constants.ENDPOINT)
    if url.hostname is None or urllib.request.getproxies().get(url.scheme):
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_CONNECT_TIMEOUT).close()
    except OSError as e:
        return f"{url.hostname} cannot be reached ({getattr(e, 'strerror', None) or e})"
    return None


def _hub_config(
    tf: Any, repo: str, revision: str | None, preset: Any, name: str
) -> tuple[Any, str]:
    """The configuration of Hub repository ``repo`` at ``revision`` (its ``config.json``,
    downloaded into or read from huggingface_hub's cache), or ``preset``'s when the Hub
    cannot give it; and a note saying which.

    Raises:
        SpecError: the Hub cannot give it, no cached copy, no preset: one line naming the
            offline alternatives.
    """
    import huggingface_hub as hub
    from huggingface_hub import errors

    why = _hub_unreachable()
    at = f"@{revision}" if revision else ""
    problem = None
    try:
        path = hub.hf_hub_download(
            repo, "config.json", revision=revision, local_files_only=why is not None
        )
    except errors.GatedRepoError:
        problem = (
            "is gated: accept its licence on huggingface.co and log in (hf auth login or HF_TOKEN)"
        )
    except errors.RepositoryNotFoundError:
        problem = "is not on the Hub (or is private: log in)"
    except errors.RevisionNotFoundError:
        problem = f"has no revision {revision!r} on the Hub"
    except errors.LocalEntryNotFoundError:
        problem = (
            f"cannot be read: {why or 'the Hub cannot be reached'}, and its config.json is not in "
            "the Hugging Face cache"
        )
    except errors.EntryNotFoundError:
        problem = "has no config.json on the Hub"
    except Exception as e:  # the client's connection and HTTP errors
        problem = (
            f"cannot be read from the Hub: {type(e).__name__}: {first_line(e, continued=True)}"
        )
    if problem is None:
        config = _folder_config(tf, Path(path).parent, name, {})
        where = "the Hugging Face cache" if why else "the Hub"
        return config, f"configuration: config.json of {repo}{at} from {where}"
    if preset is not None:
        pinned = f" (revision {revision} not checked)" if revision else ""
        note = f"configuration: graphflop's preset {preset.name}{pinned}, since {repo} {problem}"
        return _preset_config(tf, preset, {}, name), note
    raise SpecError(
        f"hf:{name} {problem}; offline, give a preset (graphflop models lists them, e.g. "
        "hf:llama-3.1-8b), a folder holding its config.json (hf:path/to/folder) or a model "
        "type (hf:llama)"
    )


def _implementation_field(config: Any, key: str) -> bool:
    """Whether ``key`` is one of the implementation choices a configuration takes as a keyword
    and keeps privately (``attn_implementation``, ``experts_implementation``: kept as
    ``_attn_implementation_internal``, read through the ``_attn_implementation`` property)."""
    return hasattr(config, f"_{key}_internal")


def _set_fields(config: Any, args: dict, name: str) -> None:
    """Set ``args`` on ``config``, the implementation choices through their properties.

    Raises:
        SpecError: a value the configuration refuses (transformers checks a field's type as it
            is set: ``num_hidden_layers=abc``, ``tie_word_embeddings=maybe``).
    """
    for k, v in args.items():
        try:
            setattr(config, f"_{k}" if _implementation_field(config, k) else k, v)
        except Exception as e:  # noqa: BLE001 - whatever the configuration's check raises
            why = " ".join(str(e).split())[:200] or type(e).__name__
            raise SpecError(
                f"hf:{name}: {type(config).__name__} refuses {k}={v!r} ({why}); give a value "
                f"of the type its default {getattr(config, k, None)!r} has"
            ) from e


def _check_fields(config: Any, args: dict, name: str) -> None:
    """Raises SpecError for a key of ``args`` that is not a field of ``config`` (or one of its
    aliases): transformers keeps an unknown keyword as an attribute nothing reads, so a typo
    (``n_layers`` for GPT-2's ``n_layer``) would analyse the default model."""
    for k, v in args.items():
        if hasattr(config, k) or _implementation_field(config, k):
            _check_sign(config, k, v, name)
            continue
        fields = [*vars(config), *getattr(config, "attribute_map", {})]
        close = difflib.get_close_matches(k, fields, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise SpecError(
            f"hf:{name}: the configuration has no field {k!r}{hint} (see {type(config).__name__})"
        )


def _check_sign(config: Any, key: str, value: Any, name: str) -> None:
    """Raises SpecError for a negative integer given to a field whose default is a positive
    integer (a count or a size: ``n_layer=-1`` would build a model of no layers, since
    ``range(-1)`` is empty)."""
    default = getattr(config, key, None)
    plain = (int,)
    if (
        isinstance(value, plain)
        and not isinstance(value, bool)
        and isinstance(default, plain)
        and not isinstance(default, bool)
        and default > 0
        and value < 0
    ):
        raise SpecError(
            f"hf:{name}: {key}={value} is negative; {key} is a count or size "
            f"(default {default}): give a positive value"
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


#: the default inputs whose length ``seq`` sets (:func:`default_inputs`)
SEQ_INPUTS = ("input_ids", "decoder_input_ids", "input_values")


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
