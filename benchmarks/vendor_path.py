"""The vendor's side of bench_vendor.py: DeepSeek-OCR's or DeepSeek-OCR-2's HF remote code (`--family`), run in its own process under the
transformers it was written for (4.46.3; from 4.48 its imports fail, spec §6.7), on a page that
bench_vendor.py prepared. Run by bench_vendor.py, not by hand:

    PYTHONPATH=<site with transformers 4.46.3> python benchmarks/vendor_path.py --vendor-code DIR \
        --family deepseek-ocr --checkpoint DIR --inputs page.pt --tokens 256 --repeats 3 --out vendor.json

What runs is the vendor's own model code, untouched, imported from DIR (the five .py files of the family's HF
repository, `FAMILIES`; nothing of it is copied into this repository):
  - the model: `DeepseekOCRForCausalLM` / `DeepseekOCR2ForCausalLM` `.from_pretrained(checkpoint)` with eager attention (the vendor's
    fallback without flash-attn), in the dtype asked; in bfloat16 every forward runs under
    `torch.autocast("cuda", bfloat16)` + `no_grad`, as the vendor's `infer()` does;
  - the split path of anchors.md: one prefill forward over the page's prompt (vision inside it), then one
    forward per token through the vendor's `prepare_inputs_for_generation` and its DynamicCache, greedy
    argmax on its float32 logits, EOS ignored, no n-gram ban (the anchors' 23.0 ms/token is without it).
What does not run is the vendor's preprocessing (`infer()` reads a file, tiles and normalises it with
torchvision transforms): the page comes in as the tensors our preprocessing made, which tests hold equal
to the vendor's pixels and token schedule (tests/model/test_preprocess.py). The module imports
torchvision for those transforms only: where no torchvision built for the installed torch imports (the
CPU development machine), a stand-in that fails if used takes its place.

Timing: CUDA events around the prefill forward and every decode step; forward hooks put events around
the vendor's `sam_model`, view encoder (`vision_model`: CLIP; `qwen2_model`: OCR-2's Qwen2 encoder) and
`projector` calls, summed per prefill (gundam calls
each twice: tiles, then the global view). LM prefill is the span from the last projector call's end to
the end of the prefill forward (the embedding scatter and the decoder layers). Peak memory is
torch.cuda.max_memory_allocated over the timed runs.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import types
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class VendorFamily:
    """One family's remote code: its files, the module and class to load, the view encoder to time."""

    files: tuple[str, ...]
    module: str
    model_class: str
    encoder: str  # the attribute of the vendor's inner model that encodes a view after SAM


# Keyed by our family names (model/families.py); bench_vendor.py passes the checkpoint's.
FAMILIES = {
    "deepseek-ocr": VendorFamily(
        ("modeling_deepseekocr.py", "deepencoder.py", "modeling_deepseekv2.py", "configuration_deepseek_v2.py",
         "conversation.py"), "modeling_deepseekocr", "DeepseekOCRForCausalLM", "vision_model",
    ),
    "deepseek-ocr2": VendorFamily(
        ("modeling_deepseekocr2.py", "deepencoderv2.py", "modeling_deepseekv2.py", "configuration_deepseek_v2.py",
         "conversation.py"), "modeling_deepseekocr2", "DeepseekOCR2ForCausalLM", "qwen2_model",
    ),
}  # fmt: skip
PACKAGE = "deepseek_ocr_vendor_code"


def torchvision_or_stand_in() -> None:
    """torchvision if it imports; else register one that imports but fails if any of it is used."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or built for another torch (its operators fail to register)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    else:
        return

    def unused(name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"torchvision.{name} was called: the vendor preprocessing must not run here")

        return fail

    modules = {}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__getattr__ = unused  # type: ignore[method-assign]
        modules[name] = module
    modules["torchvision"].transforms = modules["torchvision.transforms"]  # type: ignore[attr-defined]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]  # type: ignore[attr-defined]
    sys.modules.update(modules)


def import_vendor(code_dir: Path, scratch: Path, family: VendorFamily) -> types.ModuleType:
    """The vendor's modeling module, imported as a package (its files import each other relatively)."""
    missing = [name for name in family.files if not (code_dir / name).is_file()]
    if missing:
        raise SystemExit(f"--vendor-code {code_dir}: missing {', '.join(missing)} (the HF repository's .py files)")
    package = scratch / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in family.files:
        (package / name).symlink_to((code_dir / name).resolve())
    sys.path.insert(0, str(scratch))
    torchvision_or_stand_in()
    import importlib

    return importlib.import_module(f"{PACKAGE}.{family.module}")


def mark(cuda: bool) -> Any:
    """A point on the GPU's timeline (a recorded CUDA event); on a CPU smoke run, the host clock (its ops are
    synchronous)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class ModuleTimer:
    """CUDA events around every call of some modules (forward pre-hook / hook): summed ms per name."""

    def __init__(self, modules: dict[str, torch.nn.Module], cuda: bool) -> None:
        self.cuda = cuda
        self.pairs: dict[str, list[tuple[Any, Any]]] = {name: [] for name in modules}
        self.open: dict[str, Any] = {}
        for name, module in modules.items():
            module.register_forward_pre_hook(lambda _m, _a, name=name: self._start(name))
            module.register_forward_hook(lambda _m, _a, _o, name=name: self._end(name))

    def _start(self, name: str) -> None:
        self.open[name] = mark(self.cuda)

    def _end(self, name: str) -> None:
        self.pairs[name].append((self.open.pop(name), mark(self.cuda)))

    def reset(self) -> None:
        for pairs in self.pairs.values():
            pairs.clear()

    def last_end(self, name: str) -> Any:
        return self.pairs[name][-1][1]

    def totals(self) -> dict[str, float]:
        return {name: sum(elapsed(a, b) for a, b in pairs) for name, pairs in self.pairs.items()}


def elapsed(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3
    return float(start.elapsed_time(end))


def run_once(model: Any, timer: ModuleTimer, page: dict[str, Any], tokens: int, autocast: Any, cuda: bool) -> dict:
    """One job on the split path: prefill forward, then `tokens` greedy steps (EOS ignored)."""
    timer.reset()
    input_ids = page["input_ids"]
    images_kwargs = {
        "images": page["images"], "images_seq_mask": page["images_seq_mask"],
        "images_spatial_crop": page["images_spatial_crop"],
    }  # fmt: skip
    step_marks = []
    with torch.no_grad(), autocast:
        start = mark(cuda)
        out = model(input_ids=input_ids, use_cache=True, **images_kwargs)
        prefill_end = mark(cuda)
        past = out.past_key_values
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([input_ids, next_id], dim=1)
        picked = [next_id]
        mask = torch.ones_like(ids)
        for _ in range(tokens - 1):
            inputs = model.prepare_inputs_for_generation(
                ids, past_key_values=past, attention_mask=mask, use_cache=True, **images_kwargs
            )
            before = mark(cuda)
            out = model(**inputs)
            next_id = out.logits[:, -1].argmax(-1, keepdim=True)
            step_marks.append((before, mark(cuda)))
            past = out.past_key_values
            ids = torch.cat([ids, next_id], dim=1)
            mask = torch.ones_like(ids)
            picked.append(next_id)
    if cuda:
        torch.cuda.synchronize()
    stages = timer.totals()
    vision_end = timer.last_end("projector")
    return {
        "prefill_ms": elapsed(start, prefill_end),
        "sam_ms": stages["sam"],
        "encoder_ms": stages["encoder"],
        "projector_ms": stages["projector"],
        "vision_ms": elapsed(start, vision_end),
        "lm_prefill_ms": elapsed(vision_end, prefill_end),
        "decode_step_ms": [elapsed(a, b) for a, b in step_marks],
        "token_ids": [int(t) for t in torch.cat(picked, dim=1)[0].tolist()],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vendor-code", type=Path, required=True)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="deepseek-ocr")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True, help="the page, as bench_vendor.py saved it")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda:
        # The vendor forward moves its image mask with `.cuda()` (spec §6.1): a no-op for CPU smoke runs.
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]

    import transformers

    report: dict[str, Any] = {"transformers": transformers.__version__, "torch": torch.__version__,
                              "dtype": args.dtype, "device": args.device, "tokens": args.tokens,
                              "family": args.family}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        family = FAMILIES[args.family]
        vendor = import_vendor(args.vendor_code, Path(scratch), family)
        dtype = getattr(torch, args.dtype)
        began = time.perf_counter()
        model = getattr(vendor, family.model_class).from_pretrained(
            str(args.checkpoint), torch_dtype=dtype, attn_implementation="eager", use_safetensors=True
        )
        model = model.eval().to(args.device).to(dtype)
        if cuda:
            torch.cuda.synchronize()
        report["load_s"] = time.perf_counter() - began
        report["parameters"] = sum(p.numel() for p in model.parameters())

    saved = torch.load(args.inputs)
    pixel_dtype = dtype  # the vendor's pixels are bf16 in its bf16 path (spec §6.5)
    page = {
        "input_ids": saved["input_ids"].unsqueeze(0).to(args.device),
        "images_seq_mask": saved["images_seq_mask"].unsqueeze(0).to(args.device),
        "images": [(saved["tiles"].to(args.device, pixel_dtype), saved["global_view"].to(args.device, pixel_dtype))],
        "images_spatial_crop": torch.tensor([saved["crop_grid"]], dtype=torch.long),
    }
    vision = model.model
    encoder = getattr(vision, family.encoder)
    timer = ModuleTimer({"sam": vision.sam_model, "encoder": encoder, "projector": vision.projector}, cuda)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and args.dtype == "bfloat16" else nullcontext()

    for _ in range(args.warmup):
        run_once(model, timer, page, args.tokens, autocast, cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    report["runs"] = [run_once(model, timer, page, args.tokens, autocast, cuda) for _ in range(args.repeats)]
    if cuda:
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    args.out.write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.exit(main())
