"""DeepSeek-OCR-2 numerics on the `ocr2-tiny` preset (random weights), float32 on CPU, against an
independent reference that follows the vendor's remote code and reads the weights under the vendor's
checkpoint names: SAM written out as its `ImageEncoderViT`, the encoder as transformers' plain
`Qwen2Model` with the vendor's additive mask (its loop) and 1-D positions, its projector, concat order
and `masked_scatter_`; the decoder is the shared v1 module (its parity is v1's). Then the checkpoint
layouts, the configs, and where transformers' `deepseek_ocr2` differs from the vendor."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import safe_open
from transformers import Qwen2Config, Qwen2Model
from transformers.cache_utils import DynamicCache

from dsocr_workers.errors import CheckpointError, InputError
from dsocr_workers.model.checkpoint import PRESET_METADATA_KEY, build_preset, load_checkpoint, save_preset
from dsocr_workers.model.decoder import CACHE_ARGUMENT
from dsocr_workers.model.deepseek_ocr.config import PRESETS as V1_PRESETS
from dsocr_workers.model.deepseek_ocr2 import keys
from dsocr_workers.model.deepseek_ocr2.config import PRESETS, OCR2Config, matches, read_config
from dsocr_workers.model.deepseek_ocr2.modeling import DeepSeekOCR2
from dsocr_workers.model.deepseek_ocr2.preprocess import prepare_page
from dsocr_workers.model.preprocess import normalize_pixels

DATA = Path(__file__).parent / "data" / "deepseek-ocr-2"
TINY = PRESETS["ocr2-tiny"]


@pytest.fixture(scope="module")
def model() -> DeepSeekOCR2:
    return build_preset("ocr2-tiny", seed=1, device=torch.device("cpu"), dtype=torch.float32).model


@pytest.fixture(scope="module")
def vendor(model) -> dict[str, torch.Tensor]:
    """The model's weights under the vendor's checkpoint names (what the reference reads)."""
    return keys.to_vendor_state(model.state_dict())


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def square_view(side: int, seed: int = 0) -> torch.Tensor:
    """A normalised (1, 3, side, side) view of noise."""
    return normalize_pixels(torch.from_numpy(np.array(noise(side, side, seed))).permute(2, 0, 1)[None])


# --- the reference: the vendor's code, written out over its checkpoint names ------------------------


def ref_window_partition(x, window):
    B, H, W, C = x.shape
    pad_h, pad_w = (window - H % window) % window, (window - W % window) % window
    x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    Hp, Wp = H + pad_h, W + pad_w
    x = x.view(B, Hp // window, window, Wp // window, window, C).permute(0, 1, 3, 2, 4, 5)
    return x.contiguous().view(-1, window, window, C), (Hp, Wp)


def ref_window_unpartition(windows, window, pad_hw, hw):
    (Hp, Wp), (H, W) = pad_hw, hw
    B = windows.shape[0] // (Hp * Wp // window // window)
    x = windows.view(B, Hp // window, Wp // window, window, window, -1).permute(0, 1, 3, 2, 4, 5)
    return x.contiguous().view(B, Hp, Wp, -1)[:, :H, :W, :].contiguous()


def ref_rel_pos(q_size, k_size, rel_pos):
    max_rel_dist = int(2 * max(q_size, k_size) - 1)
    if rel_pos.shape[0] != max_rel_dist:
        resized = F.interpolate(rel_pos.float().reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1),
                                size=max_rel_dist, mode="linear").to(rel_pos.dtype)
        rel_pos = resized.reshape(-1, max_rel_dist).permute(1, 0)
    q_coords = torch.arange(q_size)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size)[None, :] * max(q_size / k_size, 1.0)
    return rel_pos[((q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)).long()]


def ref_sam_attention(w, prefix, x, heads):
    B, H, W, _ = x.shape
    qkv = F.linear(x, w[prefix + "qkv.weight"], w[prefix + "qkv.bias"])
    q, k, v = qkv.reshape(B, H * W, 3, heads, -1).permute(2, 0, 3, 1, 4).reshape(3, B * heads, H * W, -1).unbind(0)
    Rh, Rw = ref_rel_pos(H, H, w[prefix + "rel_pos_h"]), ref_rel_pos(W, W, w[prefix + "rel_pos_w"])
    r_q = q.reshape(B * heads, H, W, -1)
    rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, Rh).unsqueeze(-1).reshape(B * heads, H * W, H, 1)
    rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, Rw).unsqueeze(-2).reshape(B * heads, H * W, 1, W)
    q, k, v = (t.view(B, heads, H * W, -1) for t in (q, k, v))
    rel_h = rel_h.view(B, heads, H * W, H, 1)
    rel_w = rel_w.view(B, heads, H * W, 1, W)
    bias = (rel_h + rel_w).view(B, heads, H * W, H * W)
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    x = x.view(B, heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
    return F.linear(x, w[prefix + "proj.weight"], w[prefix + "proj.bias"])


def ref_layer_norm_2d(x, weight, bias):
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    return weight[:, None, None] * ((x - u) / torch.sqrt(s + 1e-6)) + bias[:, None, None]


def ref_sam(w, pixels, config: OCR2Config):
    """`ImageEncoderViT.forward` (with `get_abs_pos_sam`), then the neck and `net_2`, `net_3`."""
    p, dims = "model.sam_model.", config.sam
    x = F.conv2d(pixels, w[p + "patch_embed.proj.weight"], w[p + "patch_embed.proj.bias"], stride=16)
    x = x.permute(0, 2, 3, 1)
    pos = w[p + "pos_embed"]
    if pos.shape[1] != x.shape[1]:
        pos = F.interpolate(pos.permute(0, 3, 1, 2).float(), size=(x.shape[1], x.shape[2]), mode="bicubic",
                            antialias=True, align_corners=False).to(pos.dtype).permute(0, 2, 3, 1)
    x = x + pos
    for i in range(dims.layers):
        b = f"{p}blocks.{i}."
        shortcut = x
        h = F.layer_norm(x, (dims.width,), w[b + "norm1.weight"], w[b + "norm1.bias"], eps=1e-6)
        window = 0 if i in dims.global_attn_indexes else dims.window_size
        if window:
            H, W = h.shape[1], h.shape[2]
            h, pad_hw = ref_window_partition(h, window)
        h = ref_sam_attention(w, b + "attn.", h, dims.heads)
        if window:
            h = ref_window_unpartition(h, window, pad_hw, (H, W))
        x = shortcut + h
        h = F.layer_norm(x, (dims.width,), w[b + "norm2.weight"], w[b + "norm2.bias"], eps=1e-6)
        h = F.linear(F.gelu(F.linear(h, w[b + "mlp.lin1.weight"], w[b + "mlp.lin1.bias"])),
                     w[b + "mlp.lin2.weight"], w[b + "mlp.lin2.bias"])
        x = x + h
    x = x.permute(0, 3, 1, 2)
    x = ref_layer_norm_2d(F.conv2d(x, w[p + "neck.0.weight"]), w[p + "neck.1.weight"], w[p + "neck.1.bias"])
    x = ref_layer_norm_2d(F.conv2d(x, w[p + "neck.2.weight"], padding=1), w[p + "neck.3.weight"],
                          w[p + "neck.3.bias"])
    x = F.conv2d(x, w[p + "net_2.weight"], stride=2, padding=1)
    return F.conv2d(x.clone(), w[p + "net_3.weight"], stride=2, padding=1)


def ref_mask(token_type_ids, dtype):
    """`CustomQwen2ModelInner._create_custom_4d_mask`, as written."""
    min_dtype = torch.finfo(dtype).min
    masks = []
    for b in range(token_type_ids.shape[0]):
        length = token_type_ids.shape[1]
        mask = torch.full((length, length), fill_value=min_dtype, dtype=dtype)
        image_positions = (token_type_ids[b] == 0).nonzero(as_tuple=True)[0]
        text_positions = (token_type_ids[b] == 1).nonzero(as_tuple=True)[0]
        if len(image_positions) > 0:
            mask[image_positions[:, None], image_positions] = 0.0
        for i, text_pos in enumerate(text_positions):
            if len(image_positions) > 0:
                mask[text_pos, image_positions] = 0.0
            mask[text_pos, text_positions[: i + 1]] = 0.0
        masks.append(mask)
    return torch.stack(masks, dim=0).unsqueeze(1)


def ref_encoder(w, config: OCR2Config) -> Qwen2Model:
    """`CustomQwen2Decoder`: transformers' Qwen2Model with the vendor's settings (its theta and eps, not
    our config's), sdpa, no token embedding; the sizes are the preset's."""
    dims = config.encoder
    qwen = Qwen2Model(Qwen2Config(
        hidden_size=dims.hidden_size, num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads, intermediate_size=dims.intermediate_size, vocab_size=16,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, attention_dropout=0.0, hidden_act="silu",
        max_position_embeddings=131072, attn_implementation="sdpa",
    ))
    prefix = "model.qwen2_model.model.model."
    state = {k.removeprefix(prefix): t for k, t in w.items() if k.startswith(prefix)}
    missing, unexpected = qwen.load_state_dict(state, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    return qwen.eval()


def ref_views(w, qwen, sam_features):
    """`Qwen2Decoder2Encoder.forward`: [visual ; queries], types 0 then 1, keep the query outputs."""
    x = sam_features.flatten(2).transpose(1, 2)
    bs, n_query, _ = x.shape
    table = {144: "model.qwen2_model.query_768.weight", 256: "model.qwen2_model.query_1024.weight"}[n_query]
    x = torch.cat([x, w[table].unsqueeze(0).expand(bs, -1, -1)], dim=1)
    types = torch.cat([torch.zeros(bs, n_query, dtype=torch.long), torch.ones(bs, n_query, dtype=torch.long)], 1)
    out = qwen(inputs_embeds=x, attention_mask=ref_mask(types, x.dtype),
               position_ids=torch.arange(x.shape[1])[None]).last_hidden_state
    return out[:, n_query:, :]


def ref_image_features(w, qwen, page, config):
    """`DeepseekOCR2Model.forward`'s image branch: local, then global, then the separator."""
    project = lambda t: F.linear(t, w["model.projector.layers.weight"], w["model.projector.layers.bias"])  # noqa: E731
    global_features = project(ref_views(w, qwen, ref_sam(w, normalize_pixels(page.global_pixels), config)))
    n_dim = global_features.shape[-1]
    parts = [global_features.view(-1, n_dim), w["model.view_seperator"][None, :]]
    if page.tile_pixels is not None:
        local = project(ref_views(w, qwen, ref_sam(w, normalize_pixels(page.tile_pixels), config)))
        parts.insert(0, local.view(-1, n_dim))
    return torch.cat(parts, dim=0)


# --- ours, the way the engine calls the model ---------------------------------------------------------


def our_image_features(model, page):
    groups = [page.global_pixels] + ([] if page.tile_pixels is None else [page.tile_pixels])
    sam = [model.encode_sam(normalize_pixels(g)) for g in groups]
    tokens = [model.project(model.encode_views(s), s) for s in sam]
    return model.layout(tokens[0][0], tokens[1] if len(tokens) > 1 else None, page.crop_grid)


def our_greedy(model, page, image_features, steps):
    """Prefill into a cache with the image vectors placed at the placeholder positions, then one token
    per step (what the engine does, with transformers' dynamic cache)."""
    embeds = model.embed(page.input_ids).clone()
    embeds.index_copy_(0, page.images_seq_mask.nonzero().squeeze(1), image_features)
    cache = DynamicCache(config=model.language_model.config)
    hidden = model.language_model(inputs_embeds=embeds[None], use_cache=True, **{CACHE_ARGUMENT: cache})
    logits = [model.logits(hidden.last_hidden_state[0, -1])]
    tokens = [int(logits[-1].argmax())]
    for step in range(steps - 1):
        position = torch.tensor([[page.prompt_tokens + step]])
        hidden = model.language_model(inputs_embeds=model.embed(torch.tensor([tokens[-1:]])), position_ids=position,
                                      use_cache=True, **{CACHE_ARGUMENT: cache})
        logits.append(model.logits(hidden.last_hidden_state[0, -1]))
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def ref_greedy(model, page, image_features, steps):
    """The vendor's prefill (`masked_scatter_` into the embeddings) and greedy steps, every step a full
    forward of the whole sequence (no cache)."""
    embeds = model.language_model.embed_tokens(page.input_ids)[None].clone()
    embeds[0].masked_scatter_(page.images_seq_mask.unsqueeze(-1), image_features)
    tokens, logits = [], []
    for _ in range(steps):
        hidden = model.language_model(inputs_embeds=embeds).last_hidden_state
        logits.append(F.linear(hidden[0, -1], model.lm_head.weight).float())
        tokens.append(int(logits[-1].argmax()))
        embeds = torch.cat([embeds, model.language_model.embed_tokens(torch.tensor([tokens[-1:]]))], dim=1)
    return tokens, torch.stack(logits)


# --- numerics ------------------------------------------------------------------------------------


PAGES = {"2x1-crops": (1600, 900), "no-crops": (700, 500), "2x3-crops": (800, 1200)}


@pytest.mark.parametrize("size", PAGES.values(), ids=PAGES.keys())
def test_vision_features_equal_the_vendor_reference(model, vendor, size):
    page = prepare_page(noise(*size, seed=size[0]), lambda text: [1000 + b for b in text.encode()])
    qwen = ref_encoder(vendor, TINY)
    with torch.inference_mode():
        for pixels in [page.global_pixels] + ([] if page.tile_pixels is None else [page.tile_pixels]):
            ours_sam, ref_sam_out = model.encode_sam(normalize_pixels(pixels)), ref_sam(vendor, normalize_pixels(pixels), TINY)
            # transformers' SAM and the vendor's compute the same float32 ops in another order (its
            # rel-pos bias and LayerNorm2d): equal to rounding, not bit for bit
            torch.testing.assert_close(ours_sam, ref_sam_out, rtol=1e-5, atol=1e-5)
            # the encoder from the same SAM features: transformers' Qwen2 layers on both sides
            assert torch.equal(model.encode_views(ours_sam), ref_views(vendor, qwen, ours_sam))
        ours, ref = our_image_features(model, page), ref_image_features(vendor, qwen, page, TINY)
    assert ours.shape == (page.image_tokens, TINY.text.hidden_size)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_logits_and_greedy_tokens_equal_the_vendor_reference(model, vendor):
    page = prepare_page(noise(1600, 900, seed=4), lambda text: [1000 + b for b in text.encode()])
    with torch.inference_mode():
        features = our_image_features(model, page)
        ours_tokens, ours_logits = our_greedy(model, page, features, steps=12)
        ref_tokens, ref_logits = ref_greedy(model, page, ref_image_features(vendor, ref_encoder(vendor, TINY), page, TINY),
                                            steps=12)
    assert ours_tokens == ref_tokens
    assert len(set(ours_tokens)) > 1  # the weights' scale keeps greedy output from one repeated token
    # the cached steps multiply shorter matrices than the reference's whole-sequence forwards
    torch.testing.assert_close(ours_logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_mask_is_the_vendors_and_queries_stay_causal(model):
    from dsocr_workers.model.deepseek_ocr2.modeling import view_mask

    for views in (144, 256):
        types = torch.cat([torch.zeros(1, views, dtype=torch.long), torch.ones(1, views, dtype=torch.long)], 1)
        assert torch.equal(view_mask(views, torch.float32, torch.device("cpu")), ref_mask(types, torch.float32))
    sam = torch.randn(1, TINY.encoder.hidden_size, 12, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model.encode_views(sam)
        # a change to the query table at k leaves queries < k unchanged, bit for bit
        table = model.query_768.weight.clone()
        model.query_768.weight[100] += 1.0
        try:
            moved = model.encode_views(sam)
        finally:
            model.query_768.weight.copy_(table)
    assert torch.equal(moved[:, :100], base[:, :100]) and not torch.equal(moved[:, 100:], base[:, 100:])


def test_only_768_and_1024_views_have_queries(model):
    with torch.inference_mode(), pytest.raises(ValueError, match="10×10 SAM grid has no query table"):
        model.encode_views(torch.zeros(1, TINY.encoder.hidden_size, 10, 10))


def test_the_encoder_compiles_as_one_graph(model):
    """No data-dependent Python in the encoder (mask, positions and query table from shapes): one
    graph, what CUDA-graph capture needs later. aot_eager traces as inductor does without codegen."""
    sam = torch.randn(2, TINY.encoder.hidden_size, 12, 12, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model.encode_views, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        assert torch.equal(compiled(sam), model.encode_views(sam))


def test_layout_is_crops_then_global_then_separator(model):
    hidden = TINY.text.hidden_size
    local = torch.randn(6, 144, hidden)
    glob = torch.randn(256, hidden)
    out = model.layout(glob, local, (2, 3))
    assert out.shape == (6 * 144 + 257, hidden)
    assert torch.equal(out[:144], local[0]) and torch.equal(out[5 * 144:6 * 144], local[5])
    assert torch.equal(out[864:1120], glob) and torch.equal(out[-1], model.view_seperator)
    assert torch.equal(model.layout(glob, None, (1, 1)), torch.cat([glob, model.view_seperator[None]]))


# --- transformers' deepseek_ocr2 against the vendor ---------------------------------------------------


def transformers_vision(model):
    from transformers import DeepseekOcr2Config
    from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2VisionModel

    config = DeepseekOcr2Config(**{k: v for k, v in TINY.to_transformers().items() if k != "architectures"})
    config.vision_config._attn_implementation = "sdpa"
    tower = DeepseekOcr2VisionModel(config.vision_config)
    theirs = {keys.transformers_key(k): t for k, t in model.state_dict().items()}
    prefix = "model.vision_tower."
    tower.load_state_dict({k.removeprefix(prefix): t for k, t in theirs.items() if k.startswith(prefix)})
    return tower.eval()


def test_transformers_vision_tower_equals_ours_and_picks_a_query_table_for_any_small_view(model):
    """With our weights, transformers' vision tower gives our query outputs on 768 and 1024 views (its
    mask comes from block ids, the same mask); on a 640 view (100 SAM tokens) it reads the 144-query
    table and returns 144 outputs, where the vendor has no table (and we raise)."""
    tower = transformers_vision(model)
    with torch.inference_mode():
        for side in (768, 1024):
            pixels = square_view(side, seed=side)
            ours = model.encode_views(model.encode_sam(pixels))
            torch.testing.assert_close(tower(pixels).last_hidden_state, ours, rtol=1e-5, atol=1e-5)
        small = square_view(640)
        assert tower(small).last_hidden_state.shape[1] == 144
        with pytest.raises(ValueError):
            model.encode_views(model.encode_sam(small))


# --- checkpoint layouts and configs -----------------------------------------------------------------


def test_vendor_key_names_are_the_checkpoint_index():
    """The 2707 names of deepseek-ai/DeepSeek-OCR-2's `model.safetensors.index.json`, pinned by their
    hash (the index is not in this repository), and the names of the parts OCR-2 adds."""
    shapes = keys.expected_shapes(PRESETS["ocr2-full"])
    names = "\n".join(sorted(shapes)).encode()
    assert len(shapes) == 2707
    assert hashlib.sha256(names).hexdigest() == VENDOR_INDEX_SHA256
    assert shapes["model.sam_model.net_3.weight"] == (896, 512, 3, 3)
    assert shapes["model.qwen2_model.model.model.layers.23.self_attn.k_proj.weight"] == (128, 896)
    assert shapes["model.qwen2_model.query_768.weight"] == (144, 896)
    assert shapes["model.qwen2_model.query_1024.weight"] == (256, 896)
    assert shapes["model.projector.layers.weight"] == (1280, 896)
    assert shapes["model.view_seperator"] == (1280,)
    assert shapes["model.layers.11.mlp.experts.63.gate_proj.weight"] == (896, 1280)
    assert not any("image_newline" in name for name in shapes)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 3_389_119_360


VENDOR_INDEX_SHA256 = "82f945d7251cf783a2bdbfc72c5ee8a1dbae4aa6e3cbd7340de0b9a9b4d7aade"


@pytest.mark.parametrize("name", PRESETS)
def test_transformers_names_are_its_modules(name):
    from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration

    config = PRESETS[name]
    with torch.device("meta"):
        theirs = DeepseekOcr2ForConditionalGeneration(
            DeepseekOcr2Config(**{k: v for k, v in config.to_transformers().items() if k != "architectures"})
        )
        ours = DeepSeekOCR2(config)
    expected = {k: tuple(t.shape) for k, t in theirs.state_dict().items()}
    assert keys.expected_shapes(config, "transformers") == expected
    assert {keys.to_ours(k, "transformers") for k in theirs.state_dict()} == set(ours.state_dict())


def test_vendor_config_reads_as_the_full_preset():
    vendor = json.loads((DATA / "config.json").read_text())
    assert matches(vendor) == "vendor" and read_config(vendor) == PRESETS["ocr2-full"]


@pytest.mark.parametrize("name", PRESETS)
def test_configs_round_trip_in_both_layouts(name):
    config = PRESETS[name]
    assert matches(config.to_vendor()) == "vendor" and OCR2Config.from_vendor(config.to_vendor()) == config
    assert matches(config.to_transformers()) == "transformers"
    assert OCR2Config.from_transformers(config.to_transformers()) == config


def test_other_configs_are_not_ocr2():
    assert matches(V1_PRESETS["full"].to_vendor()) is None and matches({}) is None and matches([]) is None
    with pytest.raises(CheckpointError, match="not DeepSeek-OCR-2"):
        read_config(V1_PRESETS["tiny"].to_vendor())
    broken = PRESETS["ocr2-tiny"].to_transformers()
    del broken["vision_config"]["encoder_config"]["hidden_size"]  # transformers' default is a placeholder
    with pytest.raises(CheckpointError, match="hidden_size"):
        read_config(broken)
    with pytest.raises(CheckpointError, match="use_mla"):
        read_config({**PRESETS["ocr2-full"].to_vendor(), "use_mla": True})


def test_unknown_preset_is_an_input_error():
    with pytest.raises(InputError, match="unknown preset 'huge'; presets: .*ocr2-full, ocr2-tiny"):
        build_preset("huge", device=torch.device("cpu"), dtype=torch.float32)


def test_a_saved_preset_is_vendor_layout_labelled_random_and_reloads(model, tmp_path):
    directory = save_preset("ocr2-tiny", tmp_path / "ocr2-tiny", seed=1)
    config = read_config(json.loads((directory / "config.json").read_text()))
    assert config == TINY
    with safe_open(str(next(directory.glob("*.safetensors"))), framework="pt") as handle:
        assert handle.metadata()[PRESET_METADATA_KEY] == "ocr2-tiny:seed1"
        vendor = {key: handle.get_tensor(key) for key in handle.keys()}
    assert {k: tuple(t.shape) for k, t in vendor.items()} == keys.expected_shapes(TINY)
    loaded = load_checkpoint(directory, device=torch.device("cpu"), dtype=torch.float32)
    assert (loaded.family.name, loaded.preset, loaded.seed) == ("deepseek-ocr2", "ocr2-tiny", 1)
    state, reloaded = model.state_dict(), loaded.model.state_dict()
    assert reloaded.keys() == state.keys() and all(torch.equal(t, state[k]) for k, t in reloaded.items())
