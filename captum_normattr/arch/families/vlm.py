r"""Vision-language models: where the language model sits inside one, described as data.

A vision-language model (LLaVA: ``LlavaForConditionalGeneration``) runs a vision tower and a
projector on ``pixel_values``, writes the projector's outputs into the embeddings of the image
tokens (the ids equal to ``config.image_token_id``), and runs an ordinary decoder over the merged
sequence. The decompositions of that decoder start at its input embeddings: an image token's
embedding (a projector output) is a per-token input like any word embedding. What differs from
a text model is only where things are:

- the decoder's layers and final norm are under the language model's path
  (``model.model.language_model`` in transformers 5: :attr:`VisionLanguage.language_model`,
  from the base model), the LM head stays at the top (``model.lm_head``);
- the decoder's config is ``config.text_config`` (:attr:`VisionLanguage.text_config`); its
  ``model_type`` chooses the text family's description (Llama, Mistral, Qwen2, ...), which
  :func:`vision_language_spec` re-roots under the language model's path;
- the forward takes further inputs by keyword (:attr:`VisionLanguage.inputs`: ``pixel_values``,
  ...), which the package passes through to the model unchanged;
- the image tokens map back to the image through the family's geometry
  (:attr:`VisionLanguage.geometry`; :mod:`captum_normattr.attr.vlm_regions`);
- where the decoder's positions are not one stream (Qwen2-VL's M-RoPE), the model computes them
  itself (:attr:`VisionLanguage.positions`), and a decoder whose model type is the family's own but
  whose layer is a described text family's is named by :attr:`VisionLanguage.text_types`.

Described: LLaVA (:data:`LLAVA`), Qwen2-VL (:data:`QWEN2_VL`) and Qwen2.5-VL (:data:`QWEN2_5_VL`: Qwen2-VL's
decoder and merged grid; its tower's window attention stays inside the tower; both also take videos,
:attr:`VisionLanguage.video_token`, as do the Qwen3 families below), Qwen3-VL and Qwen3-VL-MoE
(:data:`QWEN3_VL`, :data:`QWEN3_VL_MOE`: Qwen3's decoders with DeepStack, :data:`STREAM_ADDITIONS`), the multimodal
Qwen3.5 and Qwen3.5-MoE (:data:`QWEN3_5`, :data:`QWEN3_5_MOE`: the hybrid Qwen3.5 decoders on Qwen2-VL's route), Idefics3 and SmolVLM
(:data:`IDEFICS3`, :data:`SMOLVLM`: a Llama decoder under ``model.text_model``, pixel-shuffled grids) and
Mistral 3 (:data:`MISTRAL3`: a Mistral decoder, a Pixtral tower whose patches are merged per image),
Gemma 3 with images (:data:`GEMMA3`: pooled grids), PaliGemma (:data:`PALIGEMMA`: a Gemma decoder, SigLIP
patches; PaliGemma 2's Gemma 2 decoder by its ``text_config.model_type``) and Llama 4 with images
(:data:`LLAMA4`: the Llama 4 text model, a whole ``*ForCausalLM`` under ``language_model``, its head moved
with it by :attr:`VisionLanguage.lm_head`; tiles of pixel-shuffled patches).
Gemma 4 with images (:data:`GEMMA4`, :mod:`captum_normattr.arch.families.vlm_gemma4`: variable-resolution pooled
grids, image spans two-way on the sliding-window layers).

Three of them attend two-way over part of the sequence when the call carries ``token_type_ids`` (their
processors return them; :attr:`VisionLanguage.two_way`, :data:`TWO_WAY`): Gemma 3 within each image span,
PaliGemma over its prefix (the image tokens and the prompt), the suffix causal, and Gemma 4 within each
image span on its sliding-window layers (its types are ``mm_token_type_ids``:
:attr:`VisionLanguage.two_way_input`). Such a call's attention maps
are not lower triangular, so the package decomposes it as a stack without the causal shortcuts (full maps,
no triangular storage or row blocks): the recorded probabilities carry the model's own mask, so every entry
above the diagonal that the mask opens is kept, and every other one is exactly 0 (docs/vlm.md,
"Two-way spans").

:data:`VISION_LANGUAGE` lists the descriptions by ``config.model_type``; they are kept apart
from the one-stack registry's table (:data:`~captum_normattr.arch.registry.ARCHITECTURES`)
because a vision-language model is a text family's description placed elsewhere, not a family
of its own (``docs/vlm.md``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

from captum_normattr.arch.spec import ArchitectureSpec

__all__ = [
    "GEMMA3",
    "GEMMA4",
    "GEOMETRIES",
    "IDEFICS3",
    "LLAMA4",
    "LLAVA",
    "MISTRAL3",
    "PALIGEMMA",
    "QWEN2_VL",
    "QWEN2_5_VL",
    "QWEN3_5",
    "QWEN3_5_MOE",
    "QWEN3_VL",
    "QWEN3_VL_MOE",
    "STREAM_ADDITIONS",
    "SMOLVLM",
    "TWO_WAY",
    "VISION_LANGUAGE",
    "VisionLanguage",
    "text_config",
    "vision_language_spec",
]

#: How image tokens lie over the image: ``"patch_grid"``: one token per vision-tower patch, in
#: row-major order over a (H / patch) x (W / patch) grid, after the tower's leading [CLS] feature
#: when ``vision_feature_select_strategy`` is ``"full"`` (LLaVA 1.5).
#: ``"merged_grid"``: Qwen2-VL's ``image_grid_thw`` (t, h, w) patches per image, each
#: ``spatial_merge_size`` x ``spatial_merge_size`` block merged into one token, row-major over
#: the (h / m) x (w / m) grid (frames in order).
#: ``"shuffled_grid"``: Idefics3 / SmolVLM's pixel shuffle: the tower's square (S / p) x (S / p) patch
#: grid (``vision_config.image_size`` S), every ``scale_factor`` s x s block one token, row-major over the
#: (S / p / s) x (S / p / s) grid; each sub-image (a tile, or the global image) is one such grid.
#: ``"merged_sizes"``: Mistral 3's patch merger: each image's ``image_sizes`` (h, w) in pixels, every
#: ``spatial_merge_size`` m x m block of its (h / p) x (w / p) patches one token, row-major over the
#: (h / p / m) x (w / p / m) grid (the processor's row-break and end tokens are text tokens).
#: ``"pooled_grid"``: Gemma 3's projector: the tower's square (S / p) x (S / p) patch grid average-pooled
#: to a square sqrt(mm_tokens_per_image) x sqrt(mm_tokens_per_image) grid of tokens, row-major.
#: ``"tiled_grid"``: Llama 4's tiles: every tile (and the global view) is the tower's square (S / p) x (S / p) patch
#: grid pixel-shuffled (``vision_config.pixel_shuffle_ratio`` r: every 1/r x 1/r block one token), row-major over
#: (S r / p) x (S r / p); the tiles' places on the image: :mod:`captum_normattr.attr.vlm_tiles`.
#: ``"anyres_tiles"``: LLaVA-NeXT / OneVision's base view then unpadded any-resolution tiles with a newline after every
#: row (:mod:`captum_normattr.arch.families.vlm_anyres`, :mod:`captum_normattr.attr.vlm_anyres`).
#: ``"pooled_sizes"``: Gemma 4's tower: each image's ``image_sizes`` (h, w) in pixels (the processor's resized image,
#: :func:`~captum_normattr.arch.families.vlm_gemma4.gemma4_image_sizes`), every ``vision_config.pooling_kernel_size``
#: k x k block of its (h / p) x (w / p) patches average-pooled into one token, row-major over (h / p / k) x (w / p / k).
GEOMETRIES: Tuple[str, ...] = ("patch_grid", "merged_grid", "shuffled_grid", "merged_sizes", "pooled_grid",
                               "tiled_grid", "anyres_tiles", "pooled_sizes")

#: How ``token_type_ids`` open the attention of a decoder above the diagonal (:attr:`VisionLanguage.two_way`):
#: ``"image_spans"`` (Gemma 3): each maximal run of tokens of type 1 (an image's tokens) attends to itself two-way,
#: the rest causally; ``"prefix"`` (PaliGemma): the tokens of type 0 (the image tokens and the prompt, the prefix)
#: attend to one another two-way, the tokens of type 1 (the suffix) causally.
TWO_WAY: Tuple[str, ...] = ("image_spans", "prefix")

#: What the language model adds to the stream between its layers besides the layers' own outputs
#: (:attr:`VisionLanguage.stream_additions`): ``"deepstack"`` (Qwen3-VL): after decoder layer l < n, the tower's
#: l-th DeepStack feature of every image token is added to that token's stream (docs/vlm.md, "Qwen3-VL (DeepStack)";
#: :mod:`captum_normattr.models.capture.deepstack`).
STREAM_ADDITIONS: Tuple[str, ...] = ("deepstack",)


@dataclass(frozen=True)
class VisionLanguage:
    r"""Where a vision-language model keeps its language model, and what it takes besides the ids.

    Attributes:
        family: readable family name (``"LLaVA"``).
        model_types: the ``config.model_type`` values it serves.
        language_model: path of the decoder, from the base model (``model.model``): its layers and
            final norm are under it.
        text_config: the config attribute holding the decoder's config.
        inputs: the further model inputs the forward takes by keyword and the package passes
            through (``additional_forward_args={"pixel_values": ...}``).
        image_token: config attributes that may hold the image token's id, in order.
        geometry: how the image tokens lie over the image (:data:`GEOMETRIES`).
        text_families: the decoder ``model_type`` values a tiny model of this family was tested
            with (the docs say so); another decoder that the registry describes is used as well.
        text_types: (decoder ``model_type``, registry key) pairs for a decoder whose model type is
            the vision-language family's own but whose layer is a described text family's
            (Qwen2-VL's ``qwen2_vl_text`` is Qwen2's layer; its M-RoPE is inside the attention).
        positions: ``"package"``: the package passes its position ids (counted over real tokens);
            ``"model"``: the model computes its own from the mask and its multimodal inputs
            (M-RoPE), and the package passes none unless the caller gives them.
        vision_config: the config attribute holding the vision tower's config (its
            ``image_size`` and ``patch_size`` give the patch grid).
        strategy: the config attribute naming which tower features become image tokens
            (``"default"``: the first feature dropped, ``"full"``: all kept); None: all kept (PaliGemma).
        class_token_towers: the vision tower ``model_type`` values whose sequence starts with a
            [CLS] feature before the patches (CLIP); the others (SigLIP) have patches only.
        refused: (model input, reason) pairs: inputs the forward takes that the package refuses, with why
            (none of the described families refuses one today).
        two_way: how ``token_type_ids`` make the decoder's attention two-way over part of the sequence
            (:data:`TWO_WAY`), or None (the decoder is causal whatever the inputs). A call that carries
            them is decomposed without the causal shortcuts (full maps; docs/vlm.md, "Two-way spans").
        lm_head: the LM head's path from the model with the head where it is not the text family's (Llama 4:
            ``language_model.lm_head``, the head inside the language model), else None.
        stream_additions: token-own vectors the language model adds to the stream after some of its layers
            (:data:`STREAM_ADDITIONS`), or None. Recorded per layer (``LayerTensors.own_after``) and given to each
            image token as its own part; methods that cannot take them refuse the family.
        generated_type: the ``token_type_ids`` value of tokens appended after the prompt (targets, generated
            tokens), as the model's own ``generate`` extends them: 0 for Gemma 3 (text), 1 for PaliGemma (suffix).
        video_token: config attributes that may hold the video token's id, in order; empty: the family takes no
            videos. Videos lie on the ``"merged_grid"`` geometry frame group by frame group
            (:mod:`captum_normattr.attr.vlm_video`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE variants),
            LLaVA-OneVision's as pooled frames (:mod:`captum_normattr.attr.vlm_video_pooled`).
        two_way_input: the model input carrying the token types of :attr:`two_way` (``"token_type_ids"``;
            Gemma 4: ``"mm_token_type_ids"``, one of :attr:`inputs`).
        two_way_config: (decoder config attribute, value): the types open the attention only where the decoder's
            config has that value (Gemma 4: ``("use_bidirectional_attention", "vision")``); None: always.
        notes: for the docs.
    """

    family: str
    model_types: Tuple[str, ...]
    language_model: str = "language_model"
    text_config: str = "text_config"
    inputs: Tuple[str, ...] = ("pixel_values",)
    image_token: Tuple[str, ...] = ("image_token_id", "image_token_index")
    geometry: str = "patch_grid"
    text_families: Tuple[str, ...] = ()
    text_types: Tuple[Tuple[str, str], ...] = ()
    positions: str = "package"
    vision_config: str = "vision_config"
    strategy: Optional[str] = "vision_feature_select_strategy"
    class_token_towers: Tuple[str, ...] = ("clip_vision_model",)
    refused: Tuple[Tuple[str, str], ...] = ()
    two_way: Optional[str] = None
    stream_additions: Optional[str] = None
    generated_type: int = 0
    video_token: Tuple[str, ...] = ()
    lm_head: Optional[str] = None
    two_way_input: str = "token_type_ids"
    two_way_config: Optional[Tuple[str, Any]] = None
    notes: str = ""

    def __post_init__(self) -> None:
        if self.positions not in ("package", "model"):
            raise ValueError(f"VisionLanguage {self.family}: positions must be 'package' or 'model'")
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"VisionLanguage {self.family}: geometry must be one of {GEOMETRIES}, got {self.geometry!r}")
        if self.two_way is not None and self.two_way not in TWO_WAY:
            raise ValueError(f"VisionLanguage {self.family}: two_way must be None or one of {TWO_WAY}, got {self.two_way!r}")
        if self.stream_additions is not None and self.stream_additions not in STREAM_ADDITIONS:
            raise ValueError(f"VisionLanguage {self.family}: stream_additions must be None or one of {STREAM_ADDITIONS}, "
                             f"got {self.stream_additions!r}")


LLAVA = VisionLanguage(
    family="LLaVA", model_types=("llava",), inputs=("pixel_values", "image_sizes"),
    text_families=("llama", "mistral", "qwen2"),
    notes="CLIP or SigLIP tower, MLP projector; image tokens on the tower's patch grid, [CLS] dropped by the "
          "'default' feature strategy",
)

QWEN2_VL = VisionLanguage(
    family="Qwen2-VL", model_types=("qwen2_vl",),
    inputs=("pixel_values", "image_grid_thw", "mm_token_type_ids", "pixel_values_videos", "video_grid_thw"),
    video_token=("video_token_id",),
    text_types=(("qwen2_vl_text", "qwen2"),), positions="model", geometry="merged_grid",
    text_families=("qwen2_vl_text",),
    notes="Qwen2's decoder layer with M-RoPE inside the attention (positions computed by the model); image "
          "tokens on the (h / p / m) x (w / p / m) grid of m x m merged patches",
)

QWEN2_5_VL = VisionLanguage(
    family="Qwen2.5-VL", model_types=("qwen2_5_vl",),
    inputs=("pixel_values", "image_grid_thw", "mm_token_type_ids", "pixel_values_videos", "video_grid_thw",
            "second_per_grid_ts"),
    video_token=("video_token_id",),
    text_types=(("qwen2_5_vl_text", "qwen2"),), positions="model", geometry="merged_grid",
    text_families=("qwen2_5_vl_text",),
    notes="Qwen2-VL's decoder (Qwen2's layer with M-RoPE, positions computed by the model); the tower's window "
          "attention is the tower's own (its merged tokens are put back in the image's order); image tokens on the "
          "(h / p / m) x (w / p / m) grid of m x m merged patches",
)

QWEN3_VL = VisionLanguage(
    family="Qwen3-VL", model_types=("qwen3_vl",),
    inputs=("pixel_values", "image_grid_thw", "mm_token_type_ids", "pixel_values_videos", "video_grid_thw"),
    video_token=("video_token_id",),
    text_types=(("qwen3_vl_text", "qwen3"),), positions="model", geometry="merged_grid", stream_additions="deepstack",
    text_families=("qwen3_vl_text",),
    notes="Qwen3's decoder layer with M-RoPE inside the attention (positions computed by the model); DeepStack: after "
          "decoder layer l the tower's l-th merged feature of each image token is added to that token's stream (its own "
          "part); image tokens on the (h / p / m) x (w / p / m) grid of m x m merged patches",
)

QWEN3_VL_MOE = replace(QWEN3_VL, family="Qwen3-VL-MoE", model_types=("qwen3_vl_moe",),
                       text_types=(("qwen3_vl_moe_text", "qwen3_moe"),), text_families=("qwen3_vl_moe_text",),
                       notes="Qwen3-MoE's decoder layer (experts, routing held fixed); otherwise as Qwen3-VL")

QWEN3_5 = replace(QWEN2_VL, family="Qwen3.5", model_types=("qwen3_5",), text_types=(), text_families=("qwen3_5_text",),
                  notes="the hybrid Qwen3.5 decoder (Gated DeltaNet and gated attention layers; M-RoPE positions computed "
                        "by the model); no DeepStack; image tokens on the (h / p / m) x (w / p / m) grid of m x m merged "
                        "patches")

QWEN3_5_MOE = replace(QWEN3_5, family="Qwen3.5-MoE", model_types=("qwen3_5_moe",), text_families=("qwen3_5_moe_text",),
                      notes="the hybrid Qwen3.5-MoE decoder (experts, routing held fixed); otherwise as Qwen3.5")

IDEFICS3 = VisionLanguage(
    family="Idefics3", model_types=("idefics3",), language_model="text_model",
    inputs=("pixel_values", "pixel_attention_mask"), image_token=("image_token_id",), geometry="shuffled_grid",
    text_families=("llama",),
    notes="SigLIP tower, pixel shuffle (scale_factor s: s x s patches per token) and a linear projector; image tokens "
          "on the (S / p / s) x (S / p / s) grid of each sub-image (tiles row by row, then the global image)",
)

SMOLVLM = replace(IDEFICS3, family="SmolVLM", model_types=("smolvlm",))

MISTRAL3 = VisionLanguage(
    family="Mistral 3", model_types=("mistral3",), inputs=("pixel_values", "image_sizes"), geometry="merged_sizes",
    text_families=("mistral",),
    notes="Pixtral tower (images of any size), a projector whose patch merger makes every m x m block of patches one "
          "token; image tokens row by row over each image's (h / p / m) x (w / p / m) grid, the row breaks and the "
          "image end text tokens",
)

GEMMA3 = VisionLanguage(
    family="Gemma 3", model_types=("gemma3",), geometry="pooled_grid", text_families=("gemma3_text",),
    two_way="image_spans",
    notes="SigLIP tower average-pooled to mm_tokens_per_image tokens on a square grid; with token_type_ids (1 on the "
          "image tokens, as the processor gives them) each image span is attended two-way",
)

PALIGEMMA = VisionLanguage(
    family="PaliGemma", model_types=("paligemma",), geometry="patch_grid", text_families=("gemma", "gemma2"),
    two_way="prefix", generated_type=1, strategy=None,
    notes="SigLIP tower (no [CLS]), a linear projector; image tokens on the tower's patch grid; with token_type_ids "
          "(0 on the prefix: the image tokens and the prompt; 1 on the suffix) the prefix is attended two-way",
)

LLAMA4 = VisionLanguage(
    family="Llama 4", model_types=("llama4",), language_model="language_model.model", lm_head="language_model.lm_head",
    image_token=("image_token_id",), geometry="tiled_grid", text_families=("llama4_text",), strategy=None,
    class_token_towers=(),
    notes="the Llama 4 text model (Llama4ForCausalLM) as the model's language_model; a tower whose [CLS] is dropped, "
          "each tile's patches pixel-shuffled (1/r x 1/r per token); image tokens on each tile's grid, the tiles "
          "row by row, then the global view (attr.vlm_tiles stitches them)",
)

_NOT_YET = "Gemma 4's {} soft tokens are not checked by the package yet; explain the text and images alone"

#: Gemma 4 with images (why each field is what it is, and the geometry's helper:
#: :mod:`~captum_normattr.arch.families.vlm_gemma4`)
GEMMA4 = VisionLanguage(
    family="Gemma 4", model_types=("gemma4",), geometry="pooled_sizes", text_families=("gemma4_text",),
    inputs=("pixel_values", "image_position_ids", "mm_token_type_ids"), image_token=("image_token_id",),
    two_way="image_spans", two_way_input="mm_token_type_ids",
    two_way_config=("use_bidirectional_attention", "vision"), strategy=None,
    refused=(("input_features", _NOT_YET.format("audio")), ("input_features_mask", _NOT_YET.format("audio")),
             ("pixel_values_videos", _NOT_YET.format("video"))),
    notes="variable-resolution tower, k x k patches average-pooled by position into one soft token; image tokens "
          "row by row over each resized image's (h / p / k) x (w / p / k) grid; with mm_token_type_ids and "
          "use_bidirectional_attention='vision' each image span is two-way on the sliding-window layers only; "
          "audio and video inputs refused",
)

#: ``config.model_type`` -> the vision-language description.
VISION_LANGUAGE: Dict[str, VisionLanguage] = {
    t: d for d in (LLAVA, QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE, IDEFICS3, SMOLVLM,
                   MISTRAL3, GEMMA3, PALIGEMMA, LLAMA4, GEMMA4)
    for t in d.model_types}


def text_config(config: Any, description: VisionLanguage) -> Any:
    r"""The decoder's config inside a vision-language model's config.

    Args:
        config: the model's config.
        description: its :class:`VisionLanguage` description.

    Returns:
        ``getattr(config, description.text_config)``.

    Raises:
        ValueError: the config has no such attribute.
    """
    inner = getattr(config, description.text_config, None)
    if inner is None:
        raise ValueError(f"the {description.family} config has no {description.text_config} (its decoder's config)")
    return inner


def _under(prefix: str, path: Optional[str]) -> Optional[str]:
    return None if path is None else f"{prefix}.{path}"


def vision_language_spec(description: VisionLanguage, text_spec: ArchitectureSpec) -> ArchitectureSpec:
    r"""The text family's description re-rooted at the language model inside a vision-language model.

    The layers, the final norm and a projection before the head (paths from the base model) move
    under :attr:`VisionLanguage.language_model`; the LM head (from the model with the head) and
    the layer description are the text family's.

    Args:
        description: the vision-language description.
        text_spec: the decoder's description (its config variant already chosen).

    Returns:
        An :class:`~captum_normattr.arch.spec.ArchitectureSpec` named ``"LLaVA (Llama)"`` and so on.

    Raises:
        ValueError: the text family is not a causal decoder.

    Examples::

        >>> spec = vision_language_spec(LLAVA, ARCHITECTURES["llama"])
        >>> spec.layers, spec.final_norm
        ('language_model.layers', 'language_model.norm')
    """
    if not text_spec.causal or text_spec.is_encoder_decoder:
        raise ValueError(f"{description.family}'s language model must be a decoder; {text_spec.family} is not one")
    lm = description.language_model
    head = text_spec.head
    norm = None if head.final_norm is None else replace(head.final_norm, path=_under(lm, head.final_norm.path))
    head = replace(head, final_norm=norm, projection=_under(lm, head.projection),
                   lm_head=description.lm_head or head.lm_head)
    return replace(text_spec, family=f"{description.family} ({text_spec.family})", model_types=description.model_types,
                   layers=f"{lm}.{text_spec.layers}", head=head, variants=(),
                   notes=f"{text_spec.family}'s decoder under {lm}; {description.notes}")
