"""The fast engine: SDPA, fused q/k/v and gate/up projections, Triton GEMVs over the selected experts at
decode (grouped GEMMs for a prompt), vision encoders compiled block by block, a compiled LM prefill and a
compiled decode step replayed as a CUDA graph. On a CPU the registry runs eager instead and says so."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsocr_workers.engine.generate import decode_one_token, prefill
from dsocr_workers.engine.regions import (
    Compiler,
    GraphedDecode,
    GraphedPrefill,
    GraphedVision,
    RegionalPrefill,
    RegionalVision,
    TorchCompiler,
)
from dsocr_workers.engine.variants.base import Engine, InductorGraphs, Runners, Vision
from dsocr_workers.model.fused import fuse_projections
from dsocr_workers.model.sam_attention import fold_relative_positions
from dsocr_workers.model.sam_mlp import fuse_gelu_into_lin1
from dsocr_workers.model.sam_patches import embed_patches_by_matmul
from dsocr_workers.model.selected_experts import SELECTED_EXPERTS

if TYPE_CHECKING:
    from dsocr_workers.model.interface import OCRModel


@dataclass(frozen=True)
class FastCompile:
    """What the fast engine compiles. The defaults are the engine: the vision encoders, the LM prefill and
    the decode step; on CUDA all three are replayed as CUDA graphs (engine/regions.py GraphedVision,
    GraphedPrefill, GraphedDecode). `decode_only`: the decode step alone, vision and prefill eager (what a
    test of the compiled decode step needs)."""

    decode_only: bool = False
    # One graph per vision block kind for every tile count (engine/regions.py); False: a graph per count
    # (the cold start keys its artifacts by it).
    dynamic_tiles: bool = True


def fast_vision_modules(model: OCRModel) -> None:
    """SAM's swaps: relative positions as query/key channels (`model.sam_attention`), the MLP's GELU in
    the first GEMM (`model.sam_mlp`) and the patch embedding as a GEMM (`model.sam_patches`)."""
    fold_relative_positions(model.sam)
    fuse_gelu_into_lin1(model.sam)
    embed_patches_by_matmul(model.sam)


@dataclass(frozen=True)
class FastEngine(Engine):
    """`compile`: what is compiled and how."""

    compile: FastCompile = FastCompile()

    name = "fast"
    needs_cuda = "compiled CUDA-graph decode"
    # The MoE router as one Triton kernel (model/router.py). Off for the tests' CPU subclasses: on a CPU
    # Triton runs only in its interpreter, which a compiled graph cannot trace.
    router_kernel = True
    compiles_batched_step = True
    graphs_batched_step = True

    def kernels(self) -> dict[str, str]:
        return {"attn_implementation": "sdpa", "experts_implementation": SELECTED_EXPERTS}

    def after_load(self, model: OCRModel) -> None:
        """Fused decoder projections and router (`model.fused`), then SAM's swaps (`fast_vision_modules`)."""
        fuse_projections(model.language_model, router=self.router_kernel)
        fast_vision_modules(model)

    def runners(self, model: OCRModel, device: torch.device, compiler: Compiler | None = None) -> Runners:
        """Vision: SAM and CLIP compiled block by block (engine/regions.py), per view size and kind of
        block, dynamic in the tile count, and on CUDA replayed as a CUDA graph per page shape. The
        projector (a concatenation and one linear layer) stays eager: compiled, it ran slower. LM
        prefill: compiled layer by layer, one graph per kind of layer, dynamic in the prompt length.
        Decode: one graph per cache bucket (fullgraph: a break would be a host round trip per token),
        replayed as a CUDA graph. `compiler`: what makes those regions, dynamo by default; AOTInductor
        packages built ahead (engine/coldstart/aoti.py)."""
        settings, backend = self.compile, self.compile_backend()
        compiler = compiler or TorchCompiler(backend)
        mode = "reduce-overhead" if backend == "inductor" else None
        decode = compiler.region("decode_step", self.decode_function(), mode=mode, fullgraph=True)
        graphs = device.type == "cuda" and compiler.capturable
        if graphs and compiler.decode_needs_graph:
            decode = GraphedDecode(decode)
        if settings.decode_only:
            return Runners(Vision.per_group(model), prefill, decode, compiler=compiler)
        regions = RegionalVision(model, compiler, settings.dynamic_tiles)
        if graphs:
            graphed, prefill_graphs = GraphedVision(regions), GraphedPrefill(RegionalPrefill(compiler))
            return Runners(
                Vision(graphed.sam, graphed.views, model.project), prefill_graphs, decode, prefill_graphs, compiler
            )
        return Runners(
            Vision(regions.encode_sam, regions.encode_views, model.project),
            RegionalPrefill(compiler),
            decode,
            compiler=compiler,
        )

    def decode_function(self) -> Callable[..., torch.Tensor]:
        """The decode step it compiles (engine/generate.py); a subclass may compile another of its
        signature."""
        return decode_one_token

    def compiled(self) -> InductorGraphs | None:
        backend = self.compile_backend()
        if self.compile.decode_only or backend != "inductor":
            return None
        return InductorGraphs(backend, self.compile.dynamic_tiles)
