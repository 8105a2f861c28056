"""The interface every engine implements (variants/__init__.py registers them by name).

An engine decides four things and nothing else; the session (engine/session.py) loads the model with
them and runs a job's steps through the runners, whichever engine made them:
- `kernels()`: the attention and routed-expert implementations the model is loaded with;
- `after_load(model)`: module swaps once the weights are in (checkpoints keep the vendor's layout);
- `runners(model, device, compiler)`: the callables of a job's vision stages, LM prefill and decode step;
- `compiled()`: what it compiles with inductor ahead of jobs (None: nothing), so that the cold start
  (engine/coldstart/) can compile, share and key those graphs without knowing the engine.
What other code may do with it is declared here too (capabilities), never read from its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from dsocr_workers.engine.regions import Compiler, GraphedPrefill
    from dsocr_workers.model.interface import OCRModel


@dataclass(frozen=True)
class Vision:
    """The vision stages over a page's view groups (the global view, then the tiles if any): plain
    methods (eager), compiled block by block (fast), replayed as CUDA graphs (fast on CUDA)."""

    sam: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    views: Callable[[list[torch.Tensor]], list[torch.Tensor]]  # the family's view encoder
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @classmethod
    def per_group(cls, model: OCRModel) -> Vision:
        """The model's own methods, one call per view group."""
        sam, views = model.encode_sam, model.encode_views
        return cls(
            lambda groups: [sam(g) for g in groups],
            lambda features: [views(f) for f in features],
            model.project,
        )


@dataclass(frozen=True)
class Runners:
    """What a job's steps call: `prefill(model, embeds, cache) -> logits` (engine/generate.py prefill's
    signature) and `decode_step(model, cache, ban, options)` (decode_one_token's). `prefill_graphs`:
    where the LM prefill is replayed as a CUDA graph per padded prompt length, the graphs a warm-up
    captures ahead of jobs. `compiler`: what made the compiled regions among them (None: none)."""

    vision: Vision
    prefill: Callable[..., torch.Tensor]
    decode_step: Callable[..., torch.Tensor]
    prefill_graphs: GraphedPrefill | None = None
    compiler: Compiler | None = None


@dataclass(frozen=True)
class InductorGraphs:
    """What an engine compiles with inductor, as the cold start must build it too (the build step) and key
    its artifacts by: the backend and the settings its graphs depend on."""

    backend: str
    dynamic_tiles: bool


class Engine(ABC):
    """One way of running the model. `name` is its registry name (recorded with every result);
    `needs_cuda`, when not empty, why it cannot run on a CPU (it runs the CPU fallback there)."""

    name: ClassVar[str]
    needs_cuda: ClassVar[str] = ""
    # Whether the batched engine (engine/batched/) compiles its decode step over this engine's modules
    # by default on CUDA, and may replay it as CUDA graphs (its kernels read nothing back to the host).
    compiles_batched_step: ClassVar[bool] = False
    graphs_batched_step: ClassVar[bool] = False

    @abstractmethod
    def kernels(self) -> dict[str, str]:
        """`attn_implementation` and `experts_implementation` for loading the model."""

    def after_load(self, model: OCRModel) -> None:  # noqa: B027 (a hook: most engines swap nothing)
        """Module swaps once the weights are loaded; none by default."""

    @abstractmethod
    def runners(self, model: OCRModel, device: torch.device, compiler: Compiler | None = None) -> Runners:
        """The callables a job's steps run: vision, LM prefill, decode step (and prefill graphs).
        `compiler`: what makes the engine's compiled regions instead of its own (engine/regions.py
        `Compiler`: AOTInductor packages loaded at start, the build step's recorder); ignored by an
        engine that compiles nothing."""

    def compiled(self) -> InductorGraphs | None:
        """What this engine compiles with inductor ahead of jobs; None: nothing."""
        return None

    def compile_backend(self) -> str:
        """torch.compile's backend for what is compiled over this engine's modules."""
        return "inductor"
