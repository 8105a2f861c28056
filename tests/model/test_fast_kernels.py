"""The fast engine's decoder kernels against transformers' modules (float32, on the GPU where there is
one; on a CPU the Triton kernels run in Triton's interpreter, tests/conftest.py): fused projections, the
router kernel, the selected-experts GEMVs, the two-stage argmax, and the whole decoder with all of them."""

from dataclasses import replace

import pytest
import torch

from dsocr_workers.engine.sampling import ARGMAX_ROWS, first_argmax
from dsocr_workers.model.checkpoint import build_preset
from dsocr_workers.model.decoder import CACHE_ARGUMENT
from dsocr_workers.model.fused import FusedGateUpMLP, FusedQKVAttention, fuse_projections
from dsocr_workers.model.router import FusedRouter
from dsocr_workers.model.selected_experts import MAX_PAIRS, SELECTED_EXPERTS, selected_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny(experts: str = "grouped_mm"):
    return build_preset(
        "tiny", device=DEVICE, dtype=torch.float32, attn_implementation="sdpa", experts_implementation=experts
    ).model


@pytest.mark.parametrize("tokens", [1, 3])
def test_selected_experts_match_grouped_mm(tokens):
    model = tiny()
    moe = model.language_model.layers[1].mlp
    hidden = torch.randn(
        tokens, model.config.text.hidden_size, generator=torch.Generator().manual_seed(tokens)
    ).to(DEVICE)
    with torch.inference_mode():
        _, weights, index = moe.gate(hidden)
        expected = moe.experts(hidden, index, weights)
        got = selected_experts(hidden, moe.experts.gate_up_proj, moe.experts.down_proj, index, weights)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert got.abs().max() > 0.1  # the experts contributed


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="Triton's interpreter multiplies bfloat16 dot operands wrongly",
            ),
        ),
    ],
)
def test_a_prompt_goes_to_the_grouped_kernels_with_transformers_result(dtype):
    """Past MAX_PAIRS (token, expert) pairs the implementation hands over to the grouped GEMM kernels:
    transformers' batched GEMMs' result, for each size of their blocks, from a decode step's few pairs
    per expert (blocks partly filled, experts left out) to a prompt's many blocks per expert."""
    from dsocr_workers.model.grouped_experts import GROUPED_BLOCKS, blocks_for

    model = tiny(SELECTED_EXPERTS).to(dtype)
    moe = model.language_model.layers[1].mlp
    text = model.config.text
    sizes = [MAX_PAIRS // text.num_experts_per_tok + 5, 70, 150, 300]  # mean pairs 9.8, 26, 56, 113
    assert text.n_routed_experts == 8 and text.num_experts_per_tok == 3
    for tokens, blocks in zip(sizes, GROUPED_BLOCKS, strict=True):
        assert blocks_for(tokens * text.num_experts_per_tok, text.n_routed_experts) == blocks
        hidden = torch.randn(
            1,
            tokens,
            model.config.text.hidden_size,
            device=DEVICE,
            dtype=dtype,
            generator=torch.Generator(DEVICE).manual_seed(tokens),
        )
        with torch.inference_mode():
            got = moe(hidden)
            model.language_model.config._experts_implementation = "batched_mm"
            expected = moe(hidden)
            model.language_model.config._experts_implementation = SELECTED_EXPERTS
        assert got.abs().max() > 0.1  # the experts contributed
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        else:  # the same roundings; float32 sums in another order
            torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("tokens", [1, 37])
def test_fused_router_picks_transformers_experts_in_expert_order(tokens):
    """The router kernel against transformers' router: the same experts for every token (37 tokens span
    three program blocks), listed in expert order, their weights (scaled) within float32 rounding."""
    gate = tiny().language_model.layers[1].mlp.gate
    gate.routed_scaling_factor = 2.5  # the scaling applied once, to the top-k weights
    hidden = torch.randn(
        tokens, gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens)
    ).to(DEVICE)
    with torch.inference_mode():
        _, expected_weights, expected_index = gate(hidden)
        none, weights, index = FusedRouter(gate)(hidden)
    assert none is None and index.dtype == torch.int64 and weights.dtype == torch.float32
    assert index.shape == expected_index.shape == (tokens, gate.top_k)
    assert (index.diff(dim=1) > 0).all()  # expert order
    expected_index, order = expected_index.sort(dim=1)
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(weights, expected_weights.gather(1, order), rtol=1e-5, atol=1e-7)
    assert weights.sum(1).max() > 2.5 / gate.weight.shape[0]  # scaled scores, not zeros


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(23, 3, 8, 4), (128, 6, 64, 16), (341, 6, 64, 128)],  # the last two: a decode step's, a prompt's
)
def test_expert_blocks_cover_every_pair_once(tokens, top_k, experts, block_m):
    """The grouped kernels' blocks: every pair in exactly one block of its own expert, no block over
    `m` pairs, the blocks past the last expert's empty."""
    from dsocr_workers.model.grouped_experts import expert_blocks

    index = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(tokens))
    index[:, 0] = 5  # one expert with many pairs (several blocks); some experts may get none
    index[index == 3] = 4  # and one none at all
    order, block_expert, start, end = expert_blocks(index.to(DEVICE), experts, block_m)
    order, block_expert, start, end = order.cpu(), block_expert.cpu(), start.cpu(), end.cpu()
    flat = index.reshape(-1)
    seen = []
    for e, s, t in zip(block_expert.tolist(), start.tolist(), end.tolist(), strict=True):
        assert 0 <= t - s <= block_m
        pairs = order[s:t].tolist()
        assert all(flat[p] == e for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(flat.numel()))
    assert block_expert.shape[0] == -(-flat.numel() // block_m) + experts
    # the counting sort's order is a stable sort's: pairs of one expert keep their order
    assert torch.equal(order.long(), torch.argsort(flat, stable=True))


def test_fused_decoder_equals_unfused():
    """Prefill and one decode step of the whole decoder: fused projections and selected experts give
    the logits of transformers' own modules."""
    reference, fast = tiny("grouped_mm"), tiny(SELECTED_EXPERTS)
    fuse_projections(fast.language_model)
    layers = fast.language_model.layers
    assert all(isinstance(layer.self_attn, FusedQKVAttention) for layer in layers)
    assert isinstance(layers[0].mlp, FusedGateUpMLP) and isinstance(
        layers[1].mlp.shared_experts, FusedGateUpMLP
    )
    assert isinstance(layers[1].mlp.gate, FusedRouter)
    embeds = torch.randn(
        1, 9, reference.config.text.hidden_size, generator=torch.Generator().manual_seed(0)
    ).to(DEVICE)
    with torch.inference_mode():
        logits = []
        for model in (reference, fast):
            prompt = model.language_model(inputs_embeds=embeds[:, :8], use_cache=True)
            step = model.language_model(
                inputs_embeds=embeds[:, 8:],
                position_ids=torch.tensor([[8]], device=DEVICE),
                use_cache=True,
                **{CACHE_ARGUMENT: prompt.past_key_values},
            )
            logits.append((model.logits(prompt.last_hidden_state), model.logits(step.last_hidden_state)))
    for expected, got in zip(logits[0], logits[1], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_first_argmax_is_argmax_ties_included():
    vocab = ARGMAX_ROWS * 1010
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = torch.randn(1, vocab, generator=generator)
        assert torch.equal(first_argmax(scores), torch.argmax(scores, dim=-1))
    scores = torch.zeros(1, vocab)
    scores[0, [5000, 70_000, 129_000]] = 3.0  # a tie across rows: the first index wins, as in torch.argmax
    assert first_argmax(scores).tolist() == [5000] == torch.argmax(scores, dim=-1).tolist()
    scores[0, :5000] = float("-inf")
    scores[0, 4000] = 3.0  # a tie within an earlier row than the other maxima
    assert first_argmax(scores).tolist() == [4000]


@pytest.mark.parametrize("size", [640, 1024])
def test_sam_with_folded_relative_positions_equals_transformers(size):
    """The full model's SAM dims (head dim 64; 14×14 windows and global blocks), float32: the relative
    positions as extra query/key channels give transformers' attention-bias result."""
    from dsocr_workers.model.deepseek_ocr.config import PRESETS
    from dsocr_workers.model.sam import build_sam
    from dsocr_workers.model.sam_attention import FoldedRelPosAttention, fold_relative_positions

    torch.manual_seed(0)
    dims = PRESETS["full"].sam
    sam = build_sam(replace(dims, layers=2, global_attn_indexes=(1,))).eval()
    with torch.no_grad():  # the presets' scales (model/checkpoint.py); transformers starts rel_pos at zero
        for name, parameter in sam.named_parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0) if "norm" in name and name.endswith("weight") else parameter.normal_(
                    0.0, 0.02
                )
            elif "rel_pos" in name or "pos_embed" in name:
                parameter.normal_(0.0, 0.5)
            else:
                parameter.normal_(0.0, parameter[0].numel() ** -0.5)
    pixels = torch.randn(1, 3, size, size)
    with torch.inference_mode():
        reference = sam(pixels).last_hidden_state
        fold_relative_positions(sam)
        assert all(isinstance(layer.attn, FoldedRelPosAttention) for layer in sam.layers)
        folded = sam(pixels).last_hidden_state
    assert reference.std() > 0.1  # a live signal, not one flattened by the init
    torch.testing.assert_close(folded, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="Triton's interpreter multiplies bfloat16 dot operands wrongly",
            ),
        ),
    ],
)
@pytest.mark.parametrize(("batch", "height", "width", "channels"), [(3, 14, 14, 16), (1, 20, 24, 64)])
def test_fold_kernel_builds_the_torch_operands(dtype, batch, height, width, channels):
    """The Triton kernel that builds the folded query, key and value from the qkv projection gives the
    torch operations' tensors: a batch of SAM windows (14×14, padded blocks) and a non-square grid at
    the full model's head dim (small shapes: on a CPU the kernel runs in Triton's interpreter)."""
    from dsocr_workers.model.sam_attention import fold_with_torch, launch_fold

    heads, scale = 2, channels**-0.5
    generator = torch.Generator(DEVICE).manual_seed(height)
    qkv = torch.randn(batch, height, width, 3 * heads * channels, device=DEVICE, generator=generator).to(
        dtype
    )
    table_h = torch.randn(2 * height - 1, channels, device=DEVICE, generator=generator).to(dtype)
    table_w = torch.randn(2 * width - 1, channels, device=DEVICE, generator=generator).to(dtype)
    got = launch_fold(qkv, table_h, table_w, heads, scale)
    expected = fold_with_torch(qkv, table_h, table_w, heads, scale)
    for name, built, reference in zip(("query", "key", "value"), got, expected, strict=True):
        assert built.shape == reference.shape and built.is_contiguous(), name
        # float32: the products in another order; bfloat16: those rounded once to 8 bits.
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}
        torch.testing.assert_close(built, reference, **tolerance, msg=name)
    query, key, _ = got
    assert (
        query.shape[-1] % 8 == 0 and query[..., channels:].abs().max() > 1.0
    )  # the relative terms are there
    assert torch.equal(key[..., channels:].sum(-1), torch.full_like(key[..., 0], 2.0))  # one row, one column


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sam_mlp_with_gelu_in_the_gemm_follows_transformers(dtype):
    """SAM's MLP block with lin1's bias and GELU in one GEMM: on a GPU in bfloat16 cuBLASLt's epilogue
    (tanh GELU) within bfloat16's rounding of transformers' block; float32 (and a CPU) the exact GELU."""
    from dsocr_workers.model.deepseek_ocr.config import PRESETS
    from dsocr_workers.model.sam import build_sam
    from dsocr_workers.model.sam_mlp import FusedGeluMLP, fuse_gelu_into_lin1

    torch.manual_seed(0)
    sam = build_sam(replace(PRESETS["full"].sam, layers=1, global_attn_indexes=())).to(DEVICE, dtype).eval()
    mlp = sam.layers[0].mlp
    with torch.no_grad():  # unit-scale activations (transformers' init leaves them near zero)
        for linear in (mlp.lin1, mlp.lin2):
            linear.weight.normal_(0.0, linear.in_features**-0.5)
            linear.bias.normal_(0.0, 0.1)
    x = torch.randn(2, 40, 40, 768, device=DEVICE).to(dtype)
    with torch.inference_mode():
        expected = mlp(x)
        exact = mlp.float()(x.float()).to(dtype) if dtype != torch.float32 else expected
        mlp.to(dtype)
        fuse_gelu_into_lin1(sam)
        assert isinstance(sam.layers[0].mlp, FusedGeluMLP)
        got = sam.layers[0].mlp(x)
    assert got.shape == expected.shape and expected.std() > 0.1
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # the GELU from the float32 accumulator, approximated, against the rounded GEMM then exact GELU
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
        # and no further from the float32 block than transformers' block in bfloat16 is
        assert (got - exact).float().abs().mean() <= 1.1 * (expected - exact).float().abs().mean()


def test_patch_embedding_as_matmul_equals_the_convolution():
    """The full model's SAM patch embedding (16×16 at stride 16, 3 → 768), float32, a 1024-px view and
    two 640-px tiles: the GEMM over unfolded patches gives the convolution's output."""
    from dsocr_workers.model.deepseek_ocr.config import PRESETS
    from dsocr_workers.model.sam import build_sam
    from dsocr_workers.model.sam_patches import PatchEmbeddingMatmul, embed_patches_by_matmul

    torch.manual_seed(0)
    sam = build_sam(replace(PRESETS["full"].sam, layers=1, global_attn_indexes=())).eval()
    convolution = sam.patch_embed
    with torch.no_grad():  # build_sam leaves the weights near zero and the bias at zero: make both count
        convolution.projection.weight.normal_(0.0, (3 * 16 * 16) ** -0.5)
        convolution.projection.bias.normal_()
    views = [torch.randn(1, 3, 1024, 1024), torch.randn(2, 3, 640, 640)]
    with torch.inference_mode():
        expected = [convolution(view) for view in views]
        embed_patches_by_matmul(sam)
        assert isinstance(sam.patch_embed, PatchEmbeddingMatmul)
        got = [sam.patch_embed(view) for view in views]
    for g, e in zip(got, expected, strict=True):
        assert e.std() > 0.5  # a live signal
        assert g.shape == e.shape == (e.shape[0], e.shape[1], e.shape[2], 768)
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_clip_layer_over_view_groups_equals_each_group_alone():
    """The full model's CLIP layer, float32: a global view (257 positions) and three tiles (101 each)
    packed as rows give each group's own forward; attention never crosses views."""
    from dsocr_workers.model.deepseek_ocr.config import PRESETS
    from dsocr_workers.model.deepseek_ocr.vision import ClipLayer

    torch.manual_seed(0)
    layer = ClipLayer(PRESETS["full"].clip).eval()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 1.0 if parameter.dim() == 1 else parameter.shape[1] ** -0.5)
    groups = [torch.randn(1, 257, 1024), torch.randn(3, 101, 1024)]
    with torch.inference_mode():
        expected = [layer(group) for group in groups]
        got = layer.forward_views(groups)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and e.std() > 0.5
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
